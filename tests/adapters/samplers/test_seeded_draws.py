"""Same seed, same draws: the adapters' slice and prioritized samplers against TorchRL's.

For each sampler and configuration both libraries run the same program (extend, sample,
update_priority, five rounds) from the same ``torch.manual_seed`` / ``np.random.seed`` (and,
in half the cases, the same ``generator=``); the sampled data, the markers and weights must be
bit-identical, and so must the next ``torch.rand`` and ``np.random.rand`` (the generators were
consumed alike).

TorchRL's slice samplers run here as they are. TorchRL's prioritized samplers keep their
priorities in compiled segment trees whose extension does not load with this torch: their
Python code (``sample``, ``update_priority``, the slice exclusions) runs here over ``_RefTree``,
a line-by-line port of ``torchrl/csrc/segment_tree.h`` (scalar loops in the tree's dtype),
written independently of the adapters' vectorized port.
"""

from __future__ import annotations

import logging
import operator
import warnings

import numpy as np
import pytest
import torch
from _torchrl_trees import patch_torchrl_trees
from tensordict import TensorDict

import functional_rb.adapters as A

warnings.filterwarnings("ignore", module="torchrl")
T = pytest.importorskip("torchrl.data")
tprio = pytest.importorskip("torchrl.data.replay_buffers.samplers.prioritized")
logging.getLogger("torchrl").setLevel(logging.ERROR)


class _RefTree:
    """torchrl/csrc/segment_tree.h, one leaf at a time as the C++ loops."""

    def __init__(self, size, dtype, identity, op):
        self.size, self.dt, self.op = int(size), np.dtype(dtype), op
        cap = 1
        while cap <= self.size:
            cap <<= 1
        self.cap, self.identity = cap, self.dt.type(identity)
        self.v = [self.identity] * (2 * cap)

    @staticmethod
    def _idx(index):
        return np.asarray(
            index.cpu().numpy() if isinstance(index, torch.Tensor) else index, np.int64
        )

    def __getitem__(self, index):
        idx = self._idx(index)
        out = np.array([self.v[int(i) | self.cap] for i in idx.reshape(-1)], self.dt).reshape(
            idx.shape
        )
        if isinstance(index, torch.Tensor):
            return torch.from_numpy(out)
        return float(out) if out.ndim == 0 else out

    def __setitem__(self, index, value):
        idx = self._idx(index).reshape(-1)
        if isinstance(value, torch.Tensor):
            value = value.cpu().numpy()
        val = np.asarray(value, self.dt).reshape(-1)
        for k, i in enumerate(idx):
            j = int(i) | self.cap
            self.v[j] = val[0] if val.size == 1 else val[k]
            while j > 1:
                self.v[j >> 1] = self.op(self.v[j], self.v[j ^ 1])
                j >>= 1

    def query(self, l, r):
        l, r = int(l), int(r)
        if l <= 0 and r >= self.size:
            return float(self.v[1])
        ret, l, r = self.identity, l | self.cap, r | self.cap
        while l < r:
            if l & 1:
                ret, l = self.op(ret, self.v[l]), l + 1
            if r & 1:
                r -= 1
                ret = self.op(ret, self.v[r])
            l, r = l >> 1, r >> 1
        return float(ret)

    def scan_lower_bound(self, values):
        vals = np.asarray(values.numpy() if isinstance(values, torch.Tensor) else values)
        out = []
        for x in vals.astype(self.dt).reshape(-1):
            if x > self.v[1]:
                out.append(self.size)
                continue
            i, cur = 1, x
            while i < self.cap:
                i <<= 1
                if cur > self.v[i]:
                    cur = self.dt.type(cur - self.v[i])
                    i |= 1
            out.append(i ^ self.cap)
        return np.asarray(out, np.int64)


@pytest.fixture
def torchrl_trees(monkeypatch):
    patch_torchrl_trees(monkeypatch, tprio, _RefTree, operator.add, min)


def _steps(n, seed):
    """``n`` steps of episodes ending with probability 0.15 (ids and done flags agree)."""
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, 1, generator=g) < 0.15
    ep = torch.cat([torch.zeros(1, dtype=torch.long), done.long().squeeze(-1).cumsum(0)[:-1]])
    return TensorDict(
        {
            "obs": torch.arange(n).float() + seed * 1000,
            "episode": ep + seed * 100,
            ("next", "done"): done,
        },
        [n],
    )


def _program(L, make, ndim, cap, gen, rounds=5, bs=24, add=20):
    torch.manual_seed(7)
    np.random.seed(7)
    g = torch.Generator().manual_seed(11) if gen else None
    rb = L.TensorDictReplayBuffer(
        storage=L.LazyTensorStorage(cap, ndim=ndim),
        sampler=make(L, cap),
        batch_size=bs,
        generator=g,
    )
    out = []
    for r in range(rounds):
        d = _steps(add * ndim, r)
        rb.extend(d.reshape(add, 2) if ndim == 2 else d)
        try:
            s = rb.sample()
        except (RuntimeError, ValueError) as e:
            out.append(type(e).__name__)
            continue
        out.append(s["obs"].clone())
        for k in (
            "priority_weight",
            ("next", "truncated"),
            ("next", "done"),
            ("collector", "mask"),
        ):
            if k in s.keys(True):
                out.append(s[k].clone().float())
        if "priority_weight" in s.keys():
            rb.update_priority(s["index"], torch.rand(s.shape[0]) * 3 + 0.1)
    out += [torch.rand(3), torch.from_numpy(np.random.rand(2))]
    return out


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(b, str):
            assert a == b
        else:
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), (a, b)


SLICE = {
    "num_slices-traj_key": lambda L, c: L.SliceSampler(num_slices=4, traj_key="episode"),
    "slice_len-end_key": lambda L, c: L.SliceSampler(slice_len=3, end_key=("next", "done")),
    "not-strict": lambda L, c: L.SliceSampler(slice_len=6, traj_key="episode", strict_length=False),
    "pad_output": lambda L, c: L.SliceSampler(
        slice_len=6, traj_key="episode", strict_length=False, pad_output=True
    ),
    "span": lambda L, c: L.SliceSampler(slice_len=4, traj_key="episode", span=True),
    "span-ints": lambda L, c: L.SliceSampler(slice_len=4, end_key=("next", "done"), span=(1, 2)),
    "wor": lambda L, c: L.SliceSamplerWithoutReplacement(num_slices=4, traj_key="episode"),
    "wor-not-strict": lambda L, c: L.SliceSamplerWithoutReplacement(
        slice_len=4, end_key=("next", "done"), strict_length=False
    ),
    "wor-drop_last": lambda L, c: L.SliceSamplerWithoutReplacement(
        num_slices=4, traj_key="episode", drop_last=True
    ),
}


@pytest.mark.parametrize("gen", [False, True], ids=["global", "generator"])
@pytest.mark.parametrize(
    "ndim, cap",
    [(1, 60), (1, 200), (2, 60), (2, 200)],
    ids=["1d-wrapped", "1d", "2d-wrapped", "2d"],
)
@pytest.mark.parametrize("config", list(SLICE))
def test_slice_samplers_draw_torchrls_slices(config, ndim, cap, gen):
    _assert_same(
        _program(A, SLICE[config], ndim, cap, gen), _program(T, SLICE[config], ndim, cap, gen)
    )


PRIO = {
    "plain": lambda L, c: L.PrioritizedSampler(c, 0.7, 0.4),
    "plain-alpha1-float64": lambda L, c: L.PrioritizedSampler(c, 1.0, 0.9, dtype=torch.float64),
    "slice-num_slices": lambda L, c: L.PrioritizedSliceSampler(
        c, 0.7, 0.5, num_slices=4, traj_key="episode"
    ),
    "slice-not-strict": lambda L, c: L.PrioritizedSliceSampler(
        c, 0.7, 0.5, slice_len=3, end_key=("next", "done"), strict_length=False
    ),
    "slice-span": lambda L, c: L.PrioritizedSliceSampler(
        c, 1.0, 0.3, slice_len=4, traj_key="episode", span=(0, 1)
    ),
}


# TorchRL's compiled float64 tree rejects the float32 masses a generator gives (its binding
# wants float64), so float64 is compared with NumPy's global generator only.
_PRIO_CASES = [
    (c, nd, cap, gen)
    for c in PRIO
    for nd, cap in ((1, 60), (1, 200), (2, 200))
    for gen in (False, True)
    if not (gen and c == "plain-alpha1-float64")
]


@pytest.mark.parametrize("config, ndim, cap, gen", _PRIO_CASES)
def test_prioritized_samplers_draw_torchrls_indices(torchrl_trees, config, ndim, cap, gen):
    _assert_same(
        _program(A, PRIO[config], ndim, cap, gen), _program(T, PRIO[config], ndim, cap, gen)
    )


def test_prioritized_without_generator_uses_numpy_not_torch():
    """As TorchRL's: no generator, the masses come from NumPy's global generator; torch's is
    untouched (a TorchRL user seeds both)."""
    rb = A.ReplayBuffer(
        storage=A.LazyTensorStorage(50), sampler=A.PrioritizedSampler(50, 1, 0), batch_size=8
    )
    rb.extend(torch.arange(50))
    rb.update_priority(torch.arange(50), torch.arange(1.0, 51.0))
    torch.manual_seed(0)
    draws = []
    for seed in (3, 3, 4):
        np.random.seed(seed)
        draws.append(rb.sample())
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert torch.equal(torch.rand(2), torch.manual_seed(0) and torch.rand(2))


def test_segment_tree_boundary_is_torchrls_not_exact_cumsum():
    """A mass on a float32 boundary goes where TorchRL's descent sends it, which can differ
    from an exact (float64) prefix-sum search: the tree is TorchRL's, not a cumsum."""
    from functional_rb.adapters.samplers._trees import SumSegmentTree

    ref = _RefTree(7, np.float32, 0.0, operator.add)
    ours = SumSegmentTree(7, np.float32)
    leaves = np.array([0.1, 0.7, 1e-7, 0.3, 3e-8, 0.2, 0.9], np.float32)
    ref[np.arange(7)] = leaves
    ours[np.arange(7)] = leaves
    masses = np.concatenate(
        [
            np.cumsum(leaves, dtype=np.float32),
            np.random.default_rng(0).uniform(0, 2.2, 500).astype(np.float32),
        ]
    )
    np.testing.assert_array_equal(ours.scan_lower_bound(masses), ref.scan_lower_bound(masses))
    assert ours.query(0, 7) == ref.query(0, 7) and ours.query(2, 5) == ref.query(2, 5)


# ---------------------------------------------------------------------- edge cases
def test_update_priority_beyond_max_capacity(torchrl_trees):
    """TorchRL keeps indices up to its tree's padded size (test_ptdrb): so do we, with the
    same draws; past the padding, an IndexError naming the fix."""

    def prog(L):
        torch.manual_seed(0)
        np.random.seed(0)
        rb = L.TensorDictReplayBuffer(
            sampler=L.PrioritizedSampler(5, alpha=0.7, beta=0.9), batch_size=5, priority_key="p"
        )
        rb.extend(TensorDict({"a": torch.arange(3.0), "p": torch.rand(3) / 10}, [3]))
        rb.extend(TensorDict({"a": torch.arange(5.0) + 10, "p": torch.rand(5) / 10}, [5]))
        return [rb.sample()["a"] for _ in range(3)]

    for a, b in zip(prog(A), prog(T)):
        assert torch.equal(a, b)
    s = A.PrioritizedSampler(5, 0.7, 0.9)
    with pytest.raises(IndexError, match="max_capacity at least the storage's size"):
        s.update_priority(torch.tensor([8]), 1.0)


def test_prioritized_slice_update_before_storage_seen(torchrl_trees):
    s = A.PrioritizedSliceSampler(20, 0.7, 0.5, slice_len=2, traj_key="episode")
    s.update_priority(torch.tensor([3, 4]), torch.tensor([5.0, 6.0]))
    assert s.tree_values()[3] == np.float32(torch.pow(torch.tensor(5.0) + 1e-8, 0.7))
    assert s.default_priority == 6.0


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_state_dict_and_legacy_layout_give_torchrls_priorities(torchrl_trees, alpha):
    def filled(L):
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(10),
            sampler=L.PrioritizedSampler(
                10, alpha=alpha, beta=1.0, max_priority_within_buffer=True
            ),
        )
        idx = rb.extend(torch.arange(6))
        rb.update_priority(idx, torch.arange(1.0, 7.0))
        return rb

    ours, theirs = filled(A), filled(T)
    sd = theirs.sampler.state_dict()
    legacy = {k: v for k, v in sd.items() if k != "_schema_version"}
    legacy["_max_priority"] = (
        torch.tensor((6.0 + 1e-8) ** alpha, dtype=torch.float64),
        torch.tensor(5),
    )
    for payload in (sd, legacy, ours.sampler.state_dict()):
        s = A.PrioritizedSampler(10, alpha=alpha, beta=1.0, max_priority_within_buffer=True)
        s.load_state_dict(payload)
        assert float(s._max_priority[0]) == pytest.approx(6.0, rel=1e-4)
        assert int(s._max_priority[1]) == 5
        np.testing.assert_array_equal(s.tree_values(), theirs.sampler._sum_tree[np.arange(10)])


def test_dumps_loads_take_the_dumps_alpha_as_torchrl(torchrl_trees, tmp_path):
    src = A.PrioritizedSampler(10, alpha=0.8, beta=0.6)
    src.update_priority(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    src.dumps(tmp_path / "o")
    for L in (A, T):
        dst = L.PrioritizedSampler(10, alpha=0.5, beta=0.5)
        dst.loads(tmp_path / "o")
        assert (dst._alpha, dst._beta) == (0.8, 0.6)
        assert float(dst._max_priority[0]) == 4.0 and int(dst._max_priority[1]) == 3
        np.testing.assert_array_equal(
            np.asarray(dst._sum_tree[np.arange(10)], np.float32), src.tree_values()
        )


def test_wrong_end_signal_raises_runtime_error():
    data = TensorDict(
        {"obs": torch.arange(20.0), ("next", "done"): torch.zeros(20, 5, 1, dtype=torch.bool)}, [20]
    )
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(20), sampler=A.SliceSampler(num_slices=2), batch_size=4
    )
    rb.extend(data)
    with pytest.raises(RuntimeError, match="end-of-trajectory signal to be 1-dimensional"):
        rb.sample()
    storage = A.ListStorage(20)
    storage.set(range(20), list(data.unbind(0)))
    with pytest.raises(RuntimeError, match="Could not get a tensordict out of the storage"):
        A.SliceSampler(num_slices=2).sample(storage, 4)


def test_prioritized_slice_end_keys(torchrl_trees):
    """TorchRL's newest ``end_keys=``: the OR of several flags ends a trajectory."""
    td = TensorDict(
        {
            "obs": torch.arange(12.0),
            ("next", "done"): torch.zeros(12, 1, dtype=torch.bool),
            ("next", "truncated"): torch.zeros(12, 1, dtype=torch.bool),
        },
        [12],
    )
    td["next", "done"][3] = True
    td["next", "truncated"][7] = True
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(12),
        batch_size=30,
        sampler=A.PrioritizedSliceSampler(
            12,
            1.0,
            0.0,
            slice_len=3,
            truncated_key=None,
            end_keys=[("next", "done"), ("next", "truncated")],
        ),
    )
    rb.extend(td)
    obs = rb.sample()["obs"].reshape(10, 3)
    for row in obs.long().tolist():  # never across step 3|4 or 7|8
        assert row[0] // 4 == row[-1] // 4, row
