"""TorchRL's collectors writing into the adapters' buffers, beside TorchRL's own buffers.

Real collectors (``Collector``, ``MultiSyncCollector``, ``MultiAsyncCollector`` of torchrl
0.14) over real gymnasium environments (CartPole-v1, Pendulum-v1 through ``GymEnv``), used as
TorchRL's "Collectors and Replay Buffers" guide uses them: ``replay_buffer=`` (a shared
``LazyMemmapStorage`` for the multi-process collectors), ``extend_buffer=``, and the
iterate-and-extend pattern with ``ndim=1/2/3`` storages. Every frame carries its marks: the
collector's ``("collector", "traj_ids")`` and a ``StepCounter``'s ``step_count``, so
"every frame arrived once" and "a slice stays inside one episode" can be checked on what the
buffers hold and sample. Where the collector runs in one process and is seeded, ours and
TorchRL's buffers must hold exactly the same data (and seeded slice draws match); where
processes race, both must satisfy the same invariants.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

trl = pytest.importorskip("torchrl.data")
pytest.importorskip("gymnasium")
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.envs import GymEnv, ParallelEnv, SerialEnv, StepCounter, TransformedEnv  # noqa: E402

import functional_rb.adapters as frb  # noqa: E402

pytestmark = pytest.mark.heavy

TRAJ = ("collector", "traj_ids")
LIBS = {"frb": frb, "torchrl": trl}


# ------------------------------------------------------------------ environments (picklable)
def cartpole():
    return TransformedEnv(GymEnv("CartPole-v1"), StepCounter())


def pendulum():
    # Pendulum never terminates: StepCounter truncates episodes at 25 steps, so the buffers
    # see episode ends that are truncations (done = truncated)
    return TransformedEnv(GymEnv("Pendulum-v1"), StepCounter(max_steps=25))


def serial_cartpole():
    return SerialEnv(2, cartpole)


def parallel_cartpole():
    return ParallelEnv(2, cartpole)


def _seeded(env):
    env.set_seed(0)
    return env


# ------------------------------------------------------------------ checks
def _frames_once(td, *, complete: bool = False) -> None:
    """Every frame at most once and none lost inside an episode: the (traj id, step) marks are
    unique, each episode's steps are 0..n-1, a step's observation is the previous step's next
    observation (rows were not mixed), and with ``complete`` each episode ends with done."""
    td = td.reshape(-1)
    ids, steps = td[TRAJ], td["step_count"].reshape(-1)
    key = ids * 100_000 + steps
    assert key.unique().numel() == td.numel(), "a frame was stored twice"
    order = key.argsort()
    ids, steps, td = ids[order], steps[order], td[order]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(first).reshape(-1)
    run = torch.arange(ids.numel()) - starts[torch.cumsum(first.long(), 0) - 1]
    assert torch.equal(steps, run), "an episode lost a frame"
    same = ~first[1:]
    assert torch.equal(td["observation"][1:][same], td["next", "observation"][:-1][same])
    if complete:
        last = torch.ones_like(first)
        last[:-1] = first[1:]
        assert td["next", "done"].reshape(-1)[last].all(), "an episode was written unfinished"


def _slices_inside_episodes(sample, slice_len: int) -> None:
    s = sample.reshape(-1, slice_len)
    assert (s[TRAJ] == s[TRAJ][:, :1]).all(), "a slice crosses episodes"
    assert (s["step_count"].reshape(s.shape).diff(dim=1) == 1).all(), "a slice skips steps"
    assert not s["next", "done"].reshape(s.shape)[:, :-1].any(), "a slice runs past an end"


def _same_layout(a, b) -> None:
    """The same entries with the same trailing shapes and dtypes."""
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for k in a.keys(True, True):
        assert (a[k].shape[a.ndim :], a[k].dtype) == (b[k].shape[b.ndim :], b[k].dtype), k


def _assert_same_data(a, b) -> None:
    _same_layout(a, b)
    assert a.shape == b.shape
    for k in a.keys(True, True):
        assert torch.equal(a[k], b[k]), k


def _slice_buffer(lib, storage, **sampler_kw):
    return lib.TensorDictReplayBuffer(
        storage=storage, batch_size=32, sampler=lib.SliceSampler(slice_len=4, **sampler_kw)
    )


# ------------------------------------------------------------------ one process, seeded
@pytest.mark.parametrize(
    "make_env,extend_buffer",
    [(cartpole, True), (pendulum, False)],
    ids=["cartpole-extend", "pendulum-add"],
)
def test_collector_writes_like_torchrl(make_env, extend_buffer):
    """``Collector(..., replay_buffer=rb)``: the collector extends the buffer with each batch
    (``extend_buffer=True``) or adds each step (``False``); it yields nothing."""
    stored, buffers = {}, {}
    for name, lib in LIBS.items():
        torch.manual_seed(0)
        rb = _slice_buffer(lib, lib.LazyTensorStorage(1000), traj_key=TRAJ)
        collector = Collector(
            _seeded(make_env()),
            None,
            frames_per_batch=50,
            total_frames=300,
            replay_buffer=rb,
            extend_buffer=extend_buffer,
        )
        try:
            assert all(batch is None for batch in collector)
        finally:
            collector.shutdown()
        assert len(rb) == rb.write_count == 300
        stored[name] = rb[:]
        _frames_once(stored[name])
        _slices_inside_episodes(rb.sample(), 4)
        buffers[name] = rb
    _assert_same_data(stored["frb"], stored["torchrl"])
    _seeded_draws_match(buffers)
    assert stored["frb"][TRAJ].max() >= 5  # several episodes, so slices had ends to respect


def test_guide_ndim1_transitions_and_slices():
    """The guide's first two patterns, from one collector feeding both libraries: flat
    transitions (a ``reshape(-1)`` transform over a batched env), and slices of one env's
    steps in an ``ndim=1`` storage."""
    torch.manual_seed(0)
    flat = {
        n: lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(400),
            transform=lambda data: data.reshape(-1),
            batch_size=16,
        )
        for n, lib in LIBS.items()
    }
    sliced = {
        n: _slice_buffer(lib, lib.LazyTensorStorage(400), traj_key=TRAJ) for n, lib in LIBS.items()
    }
    for env, buffers in ((serial_cartpole(), flat), (cartpole(), sliced)):
        collector = Collector(_seeded(env), None, frames_per_batch=40, total_frames=200)
        try:
            for data in collector:
                for rb in buffers.values():
                    rb.extend(data)
        finally:
            collector.shutdown()
    for buffers in (flat, sliced):
        _assert_same_data(buffers["frb"][:], buffers["torchrl"][:])
        _frames_once(buffers["frb"][:])
    for n in LIBS:
        _slices_inside_episodes(sliced[n].sample(), 4)
        # the transform runs on samples: 16 stored [20]-step env rows, flattened (as TorchRL)
        assert flat[n].sample().shape == (16 * 20,)


def _seeded_draws_match(buffers, n: int = 3) -> None:
    """The same seed draws the same slices in both libraries (same data, same order)."""
    for seed in range(n):
        index = []
        for rb in buffers.values():
            torch.manual_seed(seed)
            drawn = rb.sample(return_info=True)[1]["index"]
            index.append(torch.stack(drawn, -1) if isinstance(drawn, tuple) else drawn)
        assert torch.equal(index[0], index[1]), seed


def _collect_into(collector, buffers: dict, shape: tuple) -> None:
    """Every batch of ``collector`` (of ``shape``) extends both libraries' buffers; they then
    hold the same data, each frame once, and draw slices inside one episode."""
    try:
        for data in collector:
            assert data.shape == shape
            for rb in buffers.values():
                rb.extend(data)
    finally:
        collector.shutdown()
    _assert_same_data(buffers["frb"][:], buffers["torchrl"][:])
    _frames_once(buffers["frb"][:])
    for rb in buffers.values():
        _slices_inside_episodes(rb.sample(), 4)


def test_guide_ndim2_batched_env():
    """``[envs, time]`` batches in an ``ndim=2`` storage (the guide uses ParallelEnv; a
    SerialEnv yields the same layout without processes)."""
    torch.manual_seed(0)
    buffers = {
        n: _slice_buffer(lib, lib.LazyTensorStorage(300, ndim=2), traj_key=TRAJ)
        for n, lib in LIBS.items()
    }
    collector = Collector(
        _seeded(SerialEnv(3, pendulum)), None, frames_per_batch=60, total_frames=240
    )
    _collect_into(collector, buffers, (3, 20))
    _seeded_draws_match(buffers)


def _ndim3(make_env, total: int) -> None:
    torch.manual_seed(0)
    buffers = {
        n: _slice_buffer(lib, lib.LazyTensorStorage(2 * total, ndim=3), traj_key=TRAJ)
        for n, lib in LIBS.items()
    }
    collector = MultiSyncCollector(
        [make_env, make_env], None, frames_per_batch=80, total_frames=total, cat_results="stack"
    )
    _collect_into(collector, buffers, (2, 2, 20))  # [workers, envs, time]
    # (no seeded-draw parity here: with ndim=3 the two libraries number the trajectories in
    # different orders, so one seed picks different, equally valid, slices)


def test_guide_ndim3_process_collection_of_batched_envs():
    """``[workers, envs, time]`` batches (``cat_results="stack"``) in an ``ndim=3`` storage."""
    _ndim3(serial_cartpole, 320)


@pytest.mark.slow
def test_guide_ndim3_parallel_envs_in_workers():
    """The guide's exact form: ParallelEnv inside each collector process."""
    _ndim3(parallel_cartpole, 640)


# ------------------------------------------------------------------ several processes
def _shared_buffer(lib, capacity: int, slices: bool):
    """A LazyMemmapStorage buffer (the collector shares it with its workers); ``slices``:
    sampled by episode ends (only meaningful when workers write whole episodes)."""
    storage = lib.LazyMemmapStorage(capacity, scratch_dir=tempfile.mkdtemp())
    if slices:
        return _slice_buffer(lib, storage, end_key=("next", "done"), traj_key=TRAJ)
    return lib.TensorDictReplayBuffer(storage=storage, batch_size=32)


def _multi_process(cls, *, workers: int, total: int, **kw) -> dict:
    """Each library's shared buffer written by the collector's worker processes."""
    out = {}
    for name, lib in LIBS.items():
        torch.manual_seed(0)
        rb = _shared_buffer(lib, 4 * total, slices="trajs_per_batch" in kw)
        collector = cls(
            [cartpole] * workers,
            None,
            frames_per_batch=100,
            total_frames=total,
            replay_buffer=rb,
            **kw,
        )
        try:
            assert all(batch is None for batch in collector)
        finally:
            collector.shutdown()
        assert len(rb) == rb.write_count
        out[name] = rb
    _same_layout(out["frb"][:], out["torchrl"][:])
    return out


def test_multi_sync_whole_trajectories_into_shared_memmap():
    """``trajs_per_batch``: each worker writes complete episodes into the shared storage (the
    guide's recommended way), so slices drawn by ``end_key`` never cross an episode."""
    buffers = _multi_process(MultiSyncCollector, workers=2, total=600, trajs_per_batch=4)
    for rb in buffers.values():
        assert len(rb) >= 300  # most of the frames collected, as whole episodes
        _frames_once(rb[:], complete=True)
        _slices_inside_episodes(rb.sample(), 4)


def test_multi_async_fixed_frames_into_shared_memmap():
    """Fixed-frame batches from racing workers: every frame collected is stored once (the
    workers' episodes are interleaved in storage, so only whole-episode writes suit slices)."""
    buffers = _multi_process(MultiAsyncCollector, workers=2, total=600)
    for rb in buffers.values():
        # The async collector tells a worker to go on before it counts that worker's batch, so
        # each worker may write one batch of 100 past the total before shutdown stops it.
        assert len(rb) % 100 == 0 and 600 <= len(rb) <= 600 + 2 * 100, len(rb)
        _frames_once(rb[:])
        sample = rb.sample()
        assert sample.shape == (32,) and torch.isin(sample[TRAJ], rb[:][TRAJ]).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls,kw",
    [
        (MultiSyncCollector, {}),
        (MultiAsyncCollector, {"trajs_per_batch": 4}),
        (MultiSyncCollector, {"trajs_per_batch": 2}),
    ],
    ids=["sync-frames", "async-trajs", "sync-trajs"],
)
def test_multi_process_long(cls, kw):
    buffers = _multi_process(cls, workers=3, total=1500, **kw)
    complete = "trajs_per_batch" in kw
    if not complete:  # 3 workers share 100 frames per batch as 34 each: 15 batches of 102
        assert len(buffers["frb"]) == len(buffers["torchrl"]) >= 1500
    for rb in buffers.values():
        _frames_once(rb[:], complete=complete)
        for _ in range(5 if complete else 0):
            _slices_inside_episodes(rb.sample(), 4)
