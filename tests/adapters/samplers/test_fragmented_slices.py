"""``SliceSampler(fragmented=True)`` against TorchRL's, on storages where several workers'
trajectories are interleaved step by step.

Both libraries run the same program (extends of interleaved steps, wrapping the ring, samples)
from the same seed: the sampled steps, the slice markers, the padding mask and the next draws
of the generators must be identical. The faults are caused in both, and must raise the same
exception types.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from tensordict import TensorDict

import functional_rb.adapters as A

warnings.filterwarnings("ignore", module="torchrl")
T = pytest.importorskip("torchrl.data")
logging.getLogger("torchrl").setLevel(logging.ERROR)


def _interleaved(workers: int, steps: int, seed: int, *, is_init: bool = False) -> TensorDict:
    """``steps`` steps of each of ``workers`` collectors, written step-major (worker 0's step,
    worker 1's step, ...); episodes of 1..8 steps with ids unique per worker and round."""
    g = torch.Generator().manual_seed(seed)
    ids, counts = (
        torch.empty(steps, workers, dtype=torch.long),
        torch.empty(steps, workers, dtype=torch.long),
    )
    for w in range(workers):
        t, traj = 0, (seed * workers + w) * 1000
        while t < steps:
            n = min(int(torch.randint(1, 9, (1,), generator=g)), steps - t)
            ids[t : t + n, w], counts[t : t + n, w] = traj, torch.arange(n)
            t, traj = t + n, traj + 1
    n = steps * workers
    done = torch.zeros(steps, workers, 1, dtype=torch.bool)
    done[:-1, :, 0] = ids[1:] != ids[:-1]
    td = TensorDict(
        {
            "obs": torch.arange(n).float() + 1000 * seed,
            "traj": ids.reshape(-1),
            "step_count": counts.reshape(-1),
            ("next", "done"): done.reshape(n, 1),
            ("next", "terminated"): done.reshape(n, 1),
        },
        [n],
    )
    if is_init:
        td["is_init"] = (counts == 0).reshape(n, 1)
    return td


def _program(L, kw, cap, gen, rounds=6, bs=12):
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(5) if gen else None
    rb = L.TensorDictReplayBuffer(
        storage=L.LazyTensorStorage(cap),
        batch_size=bs,
        generator=g,
        sampler=L.SliceSampler(traj_key="traj", fragmented=True, **kw),
    )
    out = []
    for r in range(rounds):
        rb.extend(_interleaved(3, 7, r, is_init=r % 2 == 1))
        try:
            s = rb.sample()
        except RuntimeError as e:
            out.append(type(e).__name__)
            continue
        out.append(("obs", s["obs"].clone()))
        for k in (
            ("next", "truncated"),
            ("next", "done"),
            ("next", "terminated"),
            ("collector", "mask"),
            "is_init",
        ):
            if k in s.keys(True):
                out.append((k, s[k].clone()))
    out.append(torch.rand(3))
    return out


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(b, tuple):
            assert a[0] == b[0]
            a, b = a[1], b[1]
        if isinstance(b, str):
            assert a == b
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


CONFIGS = {
    "slice_len": dict(slice_len=3),
    "num_slices": dict(num_slices=4),
    "too-long": dict(slice_len=12),  # longer than any run: TorchRL's RuntimeError
    "not-strict": dict(slice_len=4, strict_length=False),
    "pad_output": dict(slice_len=6, strict_length=False, pad_output=True),
}


@pytest.mark.parametrize("gen", [False, True], ids=["global", "generator"])
@pytest.mark.parametrize("cap", [30, 200], ids=["wrapped", "filling"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fragmented_draws_torchrls_slices(config, cap, gen):
    ours = _program(A, CONFIGS[config], cap, gen)
    _assert_same(ours, _program(T, CONFIGS[config], cap, gen))
    sampled = sum(isinstance(x, tuple) and x[0] == "obs" for x in ours)
    assert sampled == (0 if config == "too-long" else 6)


def test_fragmented_slices_follow_each_trajectory():
    """Every sampled slice is consecutive steps of one trajectory, although no two
    consecutive storage rows belong to the same one."""
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(300),
        batch_size=64,
        sampler=A.SliceSampler(slice_len=4, traj_key="traj", fragmented=True),
    )
    rb.extend(_interleaved(4, 60, 0))
    for _ in range(5):
        s = rb.sample().reshape(16, 4)
        assert (s["traj"] == s["traj"][:, :1]).all()
        assert (s["step_count"] == s["step_count"][:, :1] + torch.arange(4)).all()
        assert (s["index"][:, 1:] - s["index"][:, :-1] == 4).all()  # 4 workers interleaved


def _raises(build, data, match=None, storage=None):
    """The same exception type from both libraries (ours with ``match``)."""
    types = []
    for L in (A, T):
        rb = L.TensorDictReplayBuffer(
            storage=storage(L) if storage else L.LazyTensorStorage(40),
            sampler=build(L),
            batch_size=4,
        )
        rb.extend(data)
        with pytest.raises(Exception) as info:
            rb.sample()
        types.append(info.type)
        if L is A and match:
            assert info.match(match)
    assert types[0] is types[1], types


def test_fragmented_faults_raise_torchrls_errors():
    frag = dict(slice_len=2, traj_key="traj", fragmented=True)
    data = _interleaved(2, 10, 0)
    dup = data.clone()
    dup["traj"][:] = 7  # every worker's steps under one id: duplicated (trajectory, step)
    _raises(lambda L: L.SliceSampler(**frag), dup, "duplicate records for trajectory 7")
    neg = data.clone()
    neg["step_count"][3] = -1
    _raises(lambda L: L.SliceSampler(**frag), neg, "Step numbers must be non-negative")
    flt = data.clone()
    flt["step_count"] = flt["step_count"].float()
    _raises(lambda L: L.SliceSampler(**frag), flt, "must contain integer values")
    _raises(
        lambda L: L.SliceSampler(slice_len=2, end_key=("next", "done"), fragmented=True),
        data,
        "requires a trajectory identifier",
    )
    _raises(
        lambda L: L.SliceSampler(**frag),
        data.reshape(10, 2),
        "only supports single-dimensional",
        storage=lambda L: L.LazyTensorStorage(40, ndim=2),
    )
    _raises(
        lambda L: L.SliceSampler(slice_len=4, traj_key="traj", fragmented=True),
        data[:2],
        "fragmented trajectory run with sufficient length",
    )


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(step_key=None), ValueError),
        (dict(ends=torch.zeros(4, dtype=torch.bool)), ValueError),
        (dict(trajectories=torch.zeros(4)), ValueError),
        (dict(span=True), NotImplementedError),
        (dict(compile=True), NotImplementedError),
    ],
)
def test_fragmented_refuses_what_torchrl_refuses(kw, exc):
    for L in (A, T):
        with pytest.raises(exc):
            L.SliceSampler(slice_len=2, fragmented=True, cache_values=True, **kw)


def test_fragmented_follows_in_place_writes_and_empty():
    """A write the sampler was not told of (in place) and ``empty`` are seen, as in TorchRL:
    the records are read again."""
    outs = []
    for L in (A, T):
        torch.manual_seed(0)
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(60),
            batch_size=6,
            sampler=L.SliceSampler(slice_len=3, traj_key="traj", fragmented=True),
        )
        rb.extend(_interleaved(3, 20, 0))
        first = rb.sample()["obs"]
        rb.storage.set(torch.arange(60), _interleaved(3, 20, 1))
        second = rb.sample()["obs"]
        rb.empty()
        rb.extend(_interleaved(2, 10, 2))
        outs.append((first, second, rb.sample()["obs"], torch.rand(2)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][1].min() >= 1000  # the second sample read the rewritten rows


def test_fragmented_bad_records_raise_at_sampling_as_torchrl():
    """Records are checked when sampled (TorchRL reads them there): extending bad ones after a
    sample succeeds, the next sample raises, and good data written over them heals it."""
    for L in (A, T):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(40),
            batch_size=4,
            sampler=L.SliceSampler(slice_len=2, traj_key="traj", fragmented=True),
        )
        rb.extend(_interleaved(2, 10, 0))
        rb.sample()
        bad = _interleaved(2, 10, 1)
        bad["step_count"][5] = -2
        rb.extend(bad)
        with pytest.raises(ValueError, match="Step numbers must be non-negative"):
            rb.sample()
        rb.extend(_interleaved(2, 10, 2))
        rb.extend(_interleaved(2, 10, 3))  # the bad rows are overwritten
        assert rb.sample().shape == (4,)
