"""Prefetching buffers (``prefetch=``) beside TorchRL's: the same batches as a plain buffer,
whole epochs when iterated, a prefetch queue kept by ``state_dict``, ``dumps``/``loads`` and
pickle (the restored buffer serves the batches the saved one would have served), and
checkpoint operations that wait for the draws in flight without deadlock.

Every test that could hang runs its body in a thread joined with a timeout (``_hang.within``):
a deadlock fails the test instead of stopping the suite."""

from __future__ import annotations

import pickle
import threading

import pytest
from _hang import HANG_S, within

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402


def test_prefetch_gives_the_batches_a_plain_buffer_gives():
    def run(L, prefetch):
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(50),
            batch_size=5,
            prefetch=prefetch,
            generator=torch.Generator().manual_seed(3),
        )
        rb.extend(torch.arange(50))
        return torch.stack([rb.sample() for _ in range(10)])

    plain = run(T, None)
    assert torch.equal(run(A, None), plain)
    # TorchRL's prefetch threads share the generator without a lock, so under load even the
    # batches it draws (not only their order) depend on scheduling; the adapters draw in
    # submission order, the plain buffer's batches.
    assert torch.equal(run(A, 3), plain)


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterating_a_prefetching_buffer_serves_the_whole_epoch(drop_last):
    for L in (T, A):
        torch.manual_seed(0)
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(11),
            batch_size=2,
            prefetch=3,
            sampler=L.SamplerWithoutReplacement(drop_last=drop_last),
        )
        rb.extend(TensorDict({"a": torch.arange(11)}, [11]))
        for _ in range(5):
            seen = [d["a"].tolist() for d in rb]
            flat = sum(seen, [])
            assert len(seen) == 5 + (not drop_last) and len(set(flat)) == len(flat)
            assert (set(flat) == set(range(11))) != drop_last, L.__name__


def _prefetching(L, seed=0, storage=None, collate_fn=None, prefetch=2):
    rb = L.ReplayBuffer(
        storage=L.ListStorage(20) if storage is None else storage,
        batch_size=3,
        prefetch=prefetch,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed),
    )
    rb.extend(torch.arange(20))
    return rb


def _same_batches(a, b, L):
    # The restored queue holds the saved buffer's next ``prefetch`` batches on both sides.
    # Beyond it TorchRL's prefetch threads share one generator without a lock, so under load
    # its later batches depend on scheduling; the adapters draw in submission order.
    for _ in range(2 if L is T else 6):
        (da, ia), (db, ib) = a.sample(return_info=True), b.sample(return_info=True)
        assert torch.equal(da, db) and torch.equal(ia["index"], ib["index"])


# ----------------------------------------------------------------------------- prefetching
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_prefetch_state_dict_round_trip_serves_the_same_batches(L):
    def body():
        source = _prefetching(L)
        source.sample()  # two batches are now drawn ahead
        restored = _prefetching(L, seed=1)
        restored.sample()  # (its own queue, to be dropped by the load)
        restored.load_state_dict(source.state_dict())
        _same_batches(source, restored, L)

    within(body)


def test_prefetch_state_dict_carries_torchrl_queue_layout():
    rb = _prefetching(A)
    rb.sample()
    state = rb.state_dict()["_prefetch_state"]
    assert state["version"] == 1 and state["capacity"] == 2 and len(state["queue"]) == 2
    data, info = state["queue"][0]
    data.fill_(-1)  # the saved queue is a copy: the live one is unchanged
    assert (rb.sample() >= 0).all()
    with pytest.raises(RuntimeError, match="prefetch queue with capacity 2"):
        _prefetching(A, prefetch=1).load_state_dict(rb.state_dict())


@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_prefetch_dumps_loads_round_trip(L, tmp_path):
    def body():
        source = _prefetching(L, storage=L.LazyTensorStorage(20))
        source.sample()
        source.dumps(tmp_path / L.__name__)
        restored = _prefetching(L, seed=1, storage=L.LazyTensorStorage(20))
        restored.sample()
        restored.loads(tmp_path / L.__name__)
        _same_batches(source, restored, L)

    within(body)


def test_prefetch_pickle_round_trip():
    source = _prefetching(A)
    source.sample()
    _same_batches(source, within(lambda: pickle.loads(pickle.dumps(source))), A)


class _BlockedCollate:
    """Blocks every call after the first (the prefetched draws) until released."""

    def __init__(self):
        self.calls, self.started, self.release = 0, threading.Event(), threading.Event()

    def __call__(self, items):
        self.calls += 1
        if self.calls > 1:
            self.started.set()
            assert self.release.wait(HANG_S)
        return items if isinstance(items, torch.Tensor) else torch.stack(items)


@pytest.mark.parametrize("op", ["load_state_dict", "state_dict", "empty", "loads"])
def test_checkpoint_ops_wait_for_draws_in_flight_without_deadlock(op, tmp_path):
    """A draw in flight (blocked in collate_fn, one more queued behind it, which needs the
    buffer's lock): the operation waits for it and completes once it is released. Before the
    fix, load_state_dict / loads / empty waited for the queued draw while holding the lock it
    needed."""
    source = _prefetching(A, storage=A.LazyTensorStorage(20))
    source.sample()
    state = source.state_dict()
    source.dumps(tmp_path)
    collate = _BlockedCollate()
    rb = _prefetching(A, seed=1, collate_fn=collate, storage=A.LazyTensorStorage(20))
    rb.sample()
    assert collate.started.wait(HANG_S)
    releaser = threading.Timer(0.3, collate.release.set)
    releaser.start()
    try:
        if op == "load_state_dict":
            within(lambda: rb.load_state_dict(state))
        elif op == "loads":
            within(lambda: rb.loads(tmp_path))
        elif op == "state_dict":
            saved = within(rb.state_dict)
            assert len(saved["_prefetch_state"]["queue"]) == 2  # the settled draws
        else:
            within(rb.empty)
            assert len(rb) == 0 and rb.stats()["prefetch_queue_size"] == 0
    finally:
        collate.release.set()
        releaser.join()
    assert collate.release.is_set()
    if op in ("load_state_dict", "loads"):
        _same_batches(source, rb, A)
