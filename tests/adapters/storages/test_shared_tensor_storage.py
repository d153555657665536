"""A LazyTensorStorage handed to another process: shared as TorchRL shares it (its tensors in
shared memory, the length and the mutation revision seen by every process), or, where it cannot
be shared, a copy that refuses writes rather than losing them.

TorchRL is the reference where it shares (a spawned Process's arguments): the same writes in the
child give the same data, length, revision and cursor in the parent. Where TorchRL loses the
child's writes silently (fork without shared memory, a ListStorage sent through a queue), ours
raise; those cases are checked against that rule, by causing them.
"""

import copy
import multiprocessing as mp
import pickle
import warnings

import pytest
from _hang import within

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
A = pytest.importorskip("functional_rb.adapters")
TensorDict = tensordict.TensorDict


def _td(x, n=2):
    return TensorDict(
        {
            "x": torch.as_tensor(x).expand(n).clone(),
            ("next", "done"): torch.zeros(n, dtype=torch.bool),
        },
        [n],
    )


def _writes(rb, q):
    """What TorchRL's TestSharedStorageInit workers do: an extend, then an in-place write."""
    try:
        rb.extend(_td(7))
        rb[1] = TensorDict({"x": torch.tensor(9), ("next", "done"): torch.tensor(True)}, [])
        q.put(("ok", int(rb.storage._mutation_revision)))
    except Exception as e:  # (reported to the parent, which asserts on it)
        q.put(("error", f"{type(e).__name__}: {e}"))


def _from_queue(q_in, q):
    _writes(q_in.get(timeout=60), q)


def _run(ctx, target, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's "os.fork()" warning
        p = ctx.Process(target=target, args=args)
        p.start()
        p.join(120)
    assert p.exitcode == 0
    return args[-1].get(timeout=10)


def _seen(rb):
    st = rb.storage
    return (
        rb[:]["x"].tolist(),
        rb[:]["next", "done"].tolist(),
        len(rb),
        int(st._mutation_revision),
        int(st._last_cursor_index),
    )


def _pair(lib):
    rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(8)).share(True)
    rb.extend(_td(torch.arange(2)))
    return rb


@pytest.fixture
def spawn_default():
    """TorchRL's ``share(True)`` creates its locks in multiprocessing's default context: make it
    spawn, as in a program that spawns its workers (an earlier test of the same process may
    have fixed it to fork, and a fork-context lock cannot go to a spawned child)."""
    previous = mp.get_start_method(allow_none=True)
    mp.set_start_method("spawn", force=True)
    yield
    mp.set_start_method(previous, force=True)


def test_spawned_child_writes_reach_the_parent_as_in_torchrl(spawn_default):
    """TorchRL's TestSharedStorageInit, both libraries in one spawned child."""
    T = pytest.importorskip("torchrl.data")
    ctx = mp.get_context("spawn")
    rbs = {"torchrl": _pair(T), "frb": _pair(A)}
    assert {k: int(rb.storage._mutation_revision) for k, rb in rbs.items()} == {
        "torchrl": 1,
        "frb": 1,
    }
    q = ctx.Queue()
    assert _run(ctx, _both, rbs, q) == {"torchrl": ("ok", 3), "frb": ("ok", 3)}
    assert (
        _seen(rbs["frb"])
        == _seen(rbs["torchrl"])
        == ([0, 9, 7, 7], [False, True, False, False], 4, 3, 3)
    )
    # the parent's sampler follows the child's writes: every stored item is drawn
    assert set(rbs["frb"].sample(200)["x"].tolist()) == {0, 7, 9}


def _both(rbs, q):
    out = {}
    for name, rb in rbs.items():
        inner = _Box()
        _writes(rb, inner)
        out[name] = inner.value
    q.put(out)


class _Box:
    def put(self, value):
        self.value = value


@pytest.mark.parametrize("share, via", [(True, "arg"), (False, "queue")])
def test_forked_child_writes_reach_the_parent(share, via):
    """fork: a share(True)-ed buffer is moved to shared memory before the fork; one sent
    through a queue is moved when it is pickled. The parent sees the data, the length, the
    revision (so a sampler's cached trajectory boundaries are rebuilt) and the cursor."""
    ctx = mp.get_context("fork")
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(8),
        sampler=A.SliceSampler(slice_len=2, strict_length=False),
        batch_size=8,
    ).share(share)
    rb.extend(
        TensorDict(
            {
                "x": torch.arange(6),
                ("next", "done"): torch.tensor([False, False, False, True, False, True]),
            },
            [6],
        )
    )
    rb.sample()  # the sampler caches the boundaries at revision 1
    q = ctx.Queue()
    if via == "arg":
        got = _run(ctx, _writes, rb, q)
    else:
        q_in = ctx.Queue()
        q_in.put(rb)
        got = _run(ctx, _from_queue, q_in, q)
    assert got == ("ok", 3)
    assert _seen(rb) == (
        [0, 9, 2, 3, 4, 5, 7, 7],
        [False, True, False, True, False, True, False, False],
        8,
        3,
        7,
    )
    # the child's done at 1 is seen: no slice crosses from row 1 to row 2 any more
    pairs = {tuple(r) for _ in range(10) for r in rb.sample()["x"].reshape(-1, 2).tolist()}
    assert (9, 2) not in pairs and (0, 9) in pairs


def test_forked_copy_of_an_unshared_buffer_refuses_writes():
    ctx = mp.get_context("fork")
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(8))  # not share(True)-ed
    rb.extend(_td(torch.arange(2)))
    status, msg = _run(ctx, _writes, rb, ctx.Queue())
    assert status == "error"
    assert msg.startswith("RuntimeError: LazyTensorStorage.set: this LazyTensorStorage is a copy")
    assert "would never reach process" in msg and "rb.share(True)" in msg
    assert "LazyMemmapStorage" in msg
    assert len(rb) == 2 and rb[:]["x"].tolist() == [0, 1]  # nothing half-written here


@pytest.mark.parametrize("storage", ["ListStorage", "LazyTensorStorage"])
def test_copies_sent_through_a_queue_refuse_writes_when_nothing_can_be_shared(storage):
    """A ListStorage (Python objects) and a LazyTensorStorage with no data yet cannot be
    shared: the copy a worker receives raises on its first write, naming the fix."""
    ctx = mp.get_context("fork")
    rb = A.TensorDictReplayBuffer(storage=getattr(A, storage)(8))
    if storage == "ListStorage":
        rb.extend(_td(torch.arange(2)))
    q_in, q = ctx.Queue(), ctx.Queue()
    q_in.put(rb)
    status, msg = _run(ctx, _from_queue, q_in, q)
    assert status == "error" and f"{storage}.set: this {storage} is a copy" in msg
    assert "sent through a multiprocessing queue" in msg
    fix = (
        "cannot be shared between processes"
        if storage == "ListStorage"
        else "extend it once in this process"
    )
    assert fix in msg
    assert len(rb) == (2 if storage == "ListStorage" else 0)


def test_plain_copies_are_independent_and_writable():
    """pickle / deepcopy (a snapshot, not a hand-over): the copy is this process's own, even
    of a storage shared with other processes; the original is unchanged by its writes."""
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(8)).share(True)
    rb.extend(_td(torch.arange(2)))
    st = rb.storage.share_memory_()
    assert st.shares_writes and st.revision == 1 and len(st) == 2
    rb.extend(_td(5))
    for other in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert not other.shares_writes
        assert (len(other), other.revision, other._last_cursor_index) == (4, 2, 3)
        other.set(torch.tensor([4, 5]), _td(8))
        assert len(other) == 6 and len(st) == 4
    assert st[:]["x"].tolist() == [0, 1, 5, 5]


def test_share_memory_refusals():
    with pytest.raises(RuntimeError, match="Cowardly refusing.*shared_init=True"):
        A.LazyTensorStorage(4).share_memory_()
    st = A.LazyTensorStorage(4, device="meta")
    st.set(torch.arange(2), _td(1).to("meta"))
    with pytest.raises(RuntimeError, match="on meta, which has no memory processes can share"):
        st.share_memory_()


@pytest.mark.parametrize("lib", ["torchrl", "frb"])
def test_prioritized_sampler_sent_to_a_spawned_process_names_sync_false(lib, monkeypatch):
    """TorchRL's test: the module's get_spawning_popen stands for a spawn in progress."""
    name = (
        "torchrl.data.replay_buffers.samplers.prioritized"
        if lib == "torchrl"
        else "functional_rb.adapters.samplers.prioritized"
    )
    module = pytest.importorskip(name)
    sampler = module.PrioritizedSampler.__new__(module.PrioritizedSampler)
    monkeypatch.setattr(module, "get_spawning_popen", lambda: object())
    with pytest.raises(RuntimeError, match="cannot be shared between processes.*sync=False"):
        sampler.__getstate__()


def _extend_in_worker(rb):
    rb.extend(TensorDict(x=torch.arange(2), batch_size=[2]))


# (a LazyTensorStorage is shared, in shared memory: the tests above)
@pytest.mark.parametrize("storage", ["ListStorage", "LazyStackStorage"])
def test_in_memory_storages_refuse_to_be_shared_at_start_never_hang(storage):
    rb = A.TensorDictReplayBuffer(storage=getattr(A, storage)(8)).share(True)
    rb.extend(TensorDict(x=torch.arange(2), batch_size=[2]))
    proc = mp.get_context("spawn").Process(target=_extend_in_worker, args=(rb,))
    with pytest.raises(
        RuntimeError,
        match=f"Cannot share a storage of type {storage}.*LazyMemmapStorage.*shared_init=True",
    ):
        within(proc.start)  # (pickled before any child exists: nothing is left running)
