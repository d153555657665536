"""The prioritized slice sampler's tree of slice starts (``samplers._trees.StartTree``): kept up to
date leaf by leaf, it must equal, bit for bit, the priority tree with the blocked steps zeroed
(what TorchRL builds for every draw), whatever the sequence of priority writes, trajectory
changes, slice lengths, reloads and copies; and the sampler must draw what TorchRL's draws
over the same trees."""

from __future__ import annotations

import copy
import logging
import pickle
import warnings

import numpy as np
import pytest
import torch
from _torchrl_trees import patch_torchrl_trees
from tensordict import TensorDict

import functional_rb.adapters as A
from functional_rb.adapters.samplers._trees import MinSegmentTree, StartTree, SumSegmentTree

warnings.filterwarnings("ignore", module="torchrl")
logging.getLogger("torchrl").setLevel(logging.ERROR)


def _trajectories(rng, rows):
    """A random partition of ``rows`` steps into trajectories: (start [N, 2], lengths [N])."""
    cuts = np.sort(rng.choice(np.arange(1, rows), rng.integers(1, rows // 3), replace=False))
    first = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([first, [rows]]))
    start = np.stack([first, np.zeros_like(first)], -1)
    return torch.from_numpy(start), torch.from_numpy(lengths)


def _split_or_merge(rng, start, lengths):
    first, lengths = start[:, 0].numpy().copy(), lengths.numpy().copy()
    i = int(rng.integers(0, first.size))
    if lengths[i] > 1 and (rng.random() < 0.5 or first.size == 1):
        cut = first[i] + int(rng.integers(1, lengths[i]))
        first = np.insert(first, i + 1, cut)
    elif i + 1 < first.size:
        first = np.delete(first, i + 1)
    lengths = np.diff(np.concatenate([first, [first[0] + lengths.sum()]]))
    return torch.from_numpy(np.stack([first, np.zeros_like(first)], -1)), torch.from_numpy(lengths)


def _excluded(seq):
    def f(start, lengths):  # the last seq - 1 steps of each trajectory
        k = np.minimum(seq - 1, lengths.numpy())
        return np.concatenate(
            [s + n - 1 - np.arange(c) for s, n, c in zip(start[:, 0].numpy(), lengths.numpy(), k)]
            + [np.zeros(0)]
        )

    return f


def _reference(source, start, lengths, seq):
    ref = SumSegmentTree(source.size, source.dtype)
    leaves = source.leaves(source.capacity)
    leaves[_excluded(seq)(start, lengths).astype(np.int64)] = 0
    ref.load_leaves(leaves)
    return ref.values


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_start_tree_equals_the_zeroed_tree_after_any_change(dtype):
    rng = np.random.default_rng(0)
    rows = 90
    source = SumSegmentTree(rows, dtype)
    source[np.arange(rows)] = rng.random(rows) * 3
    tree, seq, revision = StartTree(), 3, 0
    start, lengths = _trajectories(rng, rows)
    for _ in range(300):
        op = rng.random()
        if op < 0.4:  # priority writes (some past the size, in the padding: TorchRL's)
            idx = rng.integers(0, source.capacity, rng.integers(1, 40))
            source[idx] = rng.random(idx.size) * 5
        elif op < 0.5:
            start, lengths = _trajectories(rng, rows)
            revision += 1
        elif op < 0.7:  # one trajectory split in two or merged with the next (a write's change)
            start, lengths = _split_or_merge(rng, start, lengths)
            revision += 1
        elif op < 0.75:
            seq = int(rng.integers(1, 6))
        elif op < 0.78:  # a reload (load_state_dict): the journal is dropped
            source.load_leaves(rng.random(rows))
        elif op < 0.8:  # more writes than the journal keeps
            for _ in range(5):
                source[np.arange(rows)] = rng.random(rows)
        elif op < 0.85:  # a copy follows its own source from here on
            tree, source = copy.deepcopy((tree, source))
        elif op < 0.88:
            tree, source = pickle.loads(pickle.dumps((tree, source)))
        got = tree.follow(source, (seq,), revision, start, lengths, _excluded(seq))
        np.testing.assert_array_equal(got.values, _reference(source, start, lengths, seq))


def test_start_tree_refuses_steps_outside_the_tree():
    source = SumSegmentTree(8)
    start, lengths = torch.tensor([[0, 0]]), torch.tensor([20])
    with pytest.raises(IndexError, match="max_capacity at least the storage's size"):
        StartTree().follow(source, (3,), 0, start, lengths, _excluded(3))


# ---------------------------------------------------------------------- against TorchRL
T = pytest.importorskip("torchrl.data")
tprio = pytest.importorskip("torchrl.data.replay_buffers.samplers.prioritized")


@pytest.fixture
def numpy_trees(monkeypatch):
    """TorchRL's prioritized samplers over the adapters' port of its compiled trees (which do
    not load with this torch): same trees, so any difference is the samplers' own."""
    patch_torchrl_trees(
        monkeypatch, tprio, lambda n, dt, _, kind: kind(n, dt), SumSegmentTree, MinSegmentTree
    )


def _program(L, seed):
    rng = np.random.default_rng(seed)
    # ndim=1: on a full ndim=2 ring TorchRL's blocked steps are wrong (PrioritizedSliceSampler's
    # docstring); the tree of starts is checked there against the zeroed tree above
    ndim, cap = 1, int(rng.choice([40, 64, 150]))
    kw = [
        dict(num_slices=3),
        dict(slice_len=3),
        dict(slice_len=4, strict_length=False),
        dict(slice_len=2),
    ][seed % 4]  # (span: TorchRL's ends of wrapped trajectories differ)
    torch.manual_seed(seed)
    np.random.seed(seed)
    sampler = L.PrioritizedSliceSampler(cap, 0.7, 0.5, traj_key="episode", **kw)
    rb = L.TensorDictReplayBuffer(
        storage=L.LazyTensorStorage(cap, ndim=ndim),
        sampler=sampler,
        batch_size=12,
        generator=torch.Generator().manual_seed(seed),
    )
    g, out, n = torch.Generator().manual_seed(seed), [], int(rng.integers(8, 16))
    for r in range(25):
        op = rng.random()
        if op < 0.35 or len(rb) < min(3 * n * ndim, cap // 2):
            done = torch.rand(n * ndim, generator=g) < 0.08
            ep = done.long().cumsum(0) + 1000 * r
            d = TensorDict({"obs": torch.arange(n * ndim) + 100 * r, "episode": ep}, [n * ndim])
            rb.extend(d.reshape(n, 2) if ndim == 2 else d)
        elif op < 0.42:
            sampler.alpha = float(rng.choice([0.5, 0.9]))
        elif op < 0.45:
            rb.empty()
        else:
            try:
                s = rb.sample(int(rng.choice([6, 12, 18])) if "num_slices" in kw else 12)
            except RuntimeError as e:  # (TorchRL leaves its tree zeroed after a failed draw)
                return out + [type(e).__name__]
            out += [s["obs"], s["priority_weight"]]
            rb.update_priority(s["index"], torch.rand(s.shape[0], generator=g) * 2)
    return out


def test_prioritized_slices_draw_torchrls_over_the_same_trees(numpy_trees):
    compared = 0
    for seed in range(12):
        ours, theirs = _program(A, seed), _program(T, seed)
        assert len(ours) == len(theirs), seed
        for a, b in zip(ours, theirs):
            assert (a == b) if isinstance(b, str) else torch.equal(a, b), (seed, a, b)
        compared += sum(isinstance(x, torch.Tensor) for x in ours)
    assert compared > 100
