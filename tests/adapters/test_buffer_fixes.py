"""Buffers that cannot hang, checkpoints that keep the prefetch queue, writers' generations,
callers' TensorDicts left untouched, memmap cleanup, save hooks, TorchRL's map over our
storages, and the errors a TorchRL user meets; each checked beside TorchRL where it runs.

Every test that could hang runs its body in a thread joined with a timeout: a deadlock fails
the test instead of stopping the suite."""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402

HANG_S = 60  # far above what any of these bodies takes (a few seconds on a busy machine)


def _within(fn, seconds: float = HANG_S):
    """``fn()`` in a thread; fails (instead of hanging) when it does not return in time."""
    out, err = [], []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if err:
        raise err[0]
    return out[0]


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


def _same_batches(a, b, n=4):
    for _ in range(n):
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
        _same_batches(source, restored)

    _within(body)


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
        _same_batches(source, restored)

    _within(body)


def test_prefetch_pickle_round_trip():
    source = _prefetching(A)
    source.sample()
    _same_batches(source, _within(lambda: pickle.loads(pickle.dumps(source))))


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
            _within(lambda: rb.load_state_dict(state))
        elif op == "loads":
            _within(lambda: rb.loads(tmp_path))
        elif op == "state_dict":
            saved = _within(rb.state_dict)
            assert len(saved["_prefetch_state"]["queue"]) == 2  # the settled draws
        else:
            _within(rb.empty)
            assert len(rb) == 0 and rb.stats()["prefetch_queue_size"] == 0
    finally:
        collate.release.set()
        releaser.join()
    assert collate.release.is_set()
    if op in ("load_state_dict", "loads"):
        _same_batches(source, rb)


# ----------------------------------------------------------------------------- writers
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_generations_survive_writer_dumps_loads_without_a_storage(L, tmp_path):
    rb = L.ReplayBuffer(
        storage=L.LazyTensorStorage(4), writer=L.RoundRobinWriter(track_generations=True)
    )
    rb.extend(torch.arange(6))  # slots 0, 1 written twice
    rb.writer.dumps(tmp_path)
    fresh = L.RoundRobinWriter(track_generations=True)
    fresh.loads(tmp_path)  # no storage yet
    expected = rb.writer.generations_of(torch.arange(4))
    assert fresh.generations_of(torch.arange(4)).tolist() == expected.tolist()
    if L is A:  # and the buffer it joins uses them
        rb2 = A.ReplayBuffer(storage=A.LazyTensorStorage(4), writer=fresh)
        assert rb2.writer.generations_of(torch.arange(4)).tolist() == expected.tolist()


def test_generations_state_dict_of_a_writer_without_a_storage():
    rb = A.ReplayBuffer(
        storage=A.LazyTensorStorage(4), writer=A.RoundRobinWriter(track_generations=True)
    )
    rb.extend(torch.arange(5))
    fresh = A.RoundRobinWriter(track_generations=True)
    fresh.load_state_dict(rb.writer.state_dict())
    assert fresh.generations_of(torch.arange(4)).tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_consuming_list_storage_state_dict_round_trip(L):
    torch.manual_seed(0)
    make = functools.partial(
        L.ReplayBuffer, storage=L.ListStorage(5), batch_size=5, consume_after_n_samples=2
    )
    rb = make()
    rb.extend([torch.tensor(i) for i in range(5)])
    assert set(rb.sample().tolist()) == set(range(5))
    state = rb.state_dict()
    rb2 = make()
    rb2.load_state_dict(state)
    for v in state["_sampler"].values():  # the loaded sampler shares nothing with the dict
        if isinstance(v, torch.Tensor):
            v.fill_(0)
    assert len(rb2) == 5
    assert set(rb2.sample().tolist()) == set(range(5))
    assert len(rb2) == 0


# ----------------------------------------------------------------------------- callers' data
@pytest.mark.parametrize("cls", ["TensorDictReplayBuffer", "ReplayBuffer"])
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_extend_and_add_leave_the_callers_tensordict_untouched(L, cls):
    kw = {} if cls == "TensorDictReplayBuffer" else {"writer": L.TensorDictRoundRobinWriter()}
    rb = getattr(L, cls)(storage=L.LazyTensorStorage(10), **kw)
    batch = TensorDict({"a": torch.arange(4)}, [4])
    one = TensorDict({"a": torch.tensor(7)}, [])
    rb.extend(batch)
    rb.add(one)
    assert len(rb) == 5
    if L is T and cls == "ReplayBuffer":
        # TorchRL's plain buffer hands the caller's TensorDict itself to the writer, which
        # writes "index" into it; ours gives the writer a shallow copy, as TorchRL's
        # TensorDictReplayBuffer does
        assert "index" in batch.keys()
        return
    assert set(batch.keys()) == {"a"} and set(one.keys()) == {"a"}


def test_prioritized_extend_leaves_the_callers_tensordict_untouched():
    rb = A.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=A.LazyTensorStorage(10))
    batch = TensorDict({"a": torch.arange(4), "td_error": torch.rand(4)}, [4])
    rb.extend(batch)
    assert set(batch.keys()) == {"a", "td_error"}
    assert rb.sample(4)["index"].max() < 4  # the buffer's copy got its indices


def test_next_walks_epochs_like_torchrl_and_pickles():
    def epochs(L):
        torch.manual_seed(0)
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(10), batch_size=3, sampler=L.SamplerWithoutReplacement()
        )
        rb.extend(TensorDict(a=torch.arange(7), batch_size=[7]))
        out = [rb.next() for _ in range(6)]
        return rb, [None if o is None else (o["a"].tolist(), o.device) for o in out]

    (_, theirs), (ours_rb, ours) = epochs(T), epochs(A)
    assert ours == theirs and ours[3] is None and ours[0][1] is None
    pickle.loads(pickle.dumps(ours_rb))  # (TorchRL's holds a generator and cannot)


# ----------------------------------------------------------------------------- storages
def _fill(storage):
    rb = A.ReplayBuffer(storage=storage)
    rb.extend(TensorDict(a=torch.randn(10), batch_size=[10]))
    return rb


def test_memmap_cleanup_and_auto_cleanup(tmp_path):
    mine = tmp_path / "mine"
    st = A.LazyMemmapStorage(100, scratch_dir=mine, auto_cleanup=True)
    _fill(st)
    assert any(mine.iterdir())
    assert st.cleanup() is True and not mine.exists() and st.cleanup() is False
    kept = tmp_path / "kept"
    st = A.LazyMemmapStorage(100, scratch_dir=kept)  # a chosen directory: kept by default
    _fill(st)
    del st
    gc.collect()
    assert any(kept.iterdir())
    st = A.LazyMemmapStorage(100)  # a temporary one: removed with the storage
    _fill(st)
    temp = st.scratch_dir
    assert os.path.isdir(temp)
    del st
    gc.collect()
    assert not os.path.exists(temp)
    assert A.LazyMemmapStorage(100, auto_cleanup=True).cleanup() is False  # never written
    with pytest.raises(TypeError, match="auto_cleanup"):
        A.LazyMemmapStorage(10, auto_cleanup="yes")


def _clean_up_and_collect(storage):
    storage.cleanup()  # (explicitly, then at collection and exit: none of them may remove)
    del storage
    gc.collect()


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_memmap_cleanup_in_another_process_removes_nothing(tmp_path, how):
    st = A.LazyMemmapStorage(100, scratch_dir=tmp_path / "m", auto_cleanup=True)
    _fill(st)
    proc = mp.get_context(how).Process(target=_clean_up_and_collect, args=(st,))
    proc.start()
    proc.join(HANG_S)
    assert proc.exitcode == 0 and (tmp_path / "m").exists()
    assert st.cleanup() is True and not (tmp_path / "m").exists()  # the creator removes


_SCRIPT = """
import sys, time, torch
from tensordict import TensorDict
from functional_rb.adapters import LazyMemmapStorage, ReplayBuffer
st = LazyMemmapStorage(100, scratch_dir=sys.argv[1], auto_cleanup=sys.argv[2] == "1")
ReplayBuffer(storage=st).extend(TensorDict(a=torch.randn(10), batch_size=[10]))
print("READY", flush=True)
if sys.argv[3] == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("end", ["exit", "sigterm", "sigint"])
def test_memmap_auto_cleanup_at_exit_and_on_signals(tmp_path, end):
    for auto in ("1", "0"):
        where = tmp_path / f"{end}{auto}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(where), auto, "exit" if end == "exit" else "wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert "READY" in proc.stdout.readline()
            if end != "exit":
                proc.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGINT)
            proc.wait(HANG_S)
        finally:
            proc.kill()
            proc.communicate()
        assert where.exists() == (auto == "0"), (end, auto)


class _SaveHook:
    shift = None
    is_full = None

    def __init__(self):
        self.seen = []

    def __call__(self, data, path=None):
        self.seen.append((self.shift, self.is_full))
        return data


@pytest.mark.parametrize("storage", ["LazyMemmapStorage", "LazyTensorStorage"])
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_save_hooks_are_called_with_shift_and_is_full(L, storage, tmp_path):
    hook = _SaveHook()
    rb = L.ReplayBuffer(storage=getattr(L, storage)(10))
    rb.register_save_hook(hook)
    rb.extend(torch.arange(5))
    rb.dumps(tmp_path / "a")
    rb.extend(torch.arange(7))
    rb.dumps(tmp_path / "b")
    assert hook.seen == [(5, False), (2, True)]


def test_ted2flat_keys_are_torchrl_sets():
    for name in ("TED2Flat", "Flat2TED"):
        ours, theirs = getattr(A, name)(), getattr(T, name)()
        assert ours.done_keys == theirs.done_keys and isinstance(ours.done_keys, set)
        assert ours.reward_keys == theirs.reward_keys
    custom = dict(done_keys=[("done",), ("next", "stop")], reward_keys=["r"])
    assert A.TED2Flat(**custom).done_keys == T.TED2Flat(**custom).done_keys
    with pytest.raises(TypeError, match=r"pass \('done',\)"):
        A.TED2Flat(done_keys="done")


def _query_module():
    from torchrl.data.map import QueryModule, SipHash

    return QueryModule(in_keys=["key1", "key2"], index_key="index", hash_module=SipHash())


@pytest.mark.parametrize("storage", ["ListStorage", "LazyTensorStorage", "LazyMemmapStorage"])
def test_torchrl_tensordict_map_over_our_storages(storage):
    from torchrl.data.map import TensorDictMap

    keys = TensorDict(
        {
            "key1": torch.tensor([[-1.0], [1.0], [3.0], [-3.0]]),
            "key2": torch.tensor([[0.0], [2.0], [4.0], [-4.0]]),
        },
        [4],
    )
    values = TensorDict({"v": torch.tensor([[10.0], [20.0], [30.0], [40.0]])}, [4])
    got = []
    for L in (T, A):
        st = getattr(L, storage)(100)
        kw = {} if L is T else {"collate_fn": st.default_collate}  # (see the module docs)
        tdm = TensorDictMap(query_module=_query_module(), storage=st, **kw)
        tdm[keys] = values
        assert tdm.contains(keys).all() and len(tdm) == 4
        assert not tdm.contains(keys + 100).any()
        got.append(tdm[keys]["v"])
    assert torch.equal(*got)


def test_torchrl_mcts_forest_over_our_storage():
    from torchrl.data.map import MCTSForest, TensorDictMap

    def rollout(states, actions):
        s, n = torch.tensor(states), len(actions)
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[-1] = True
        return TensorDict(
            {
                "observation": s[:-1],
                "action": torch.tensor(actions),
                "done": torch.zeros(n, 1, dtype=torch.bool),
                "next": {"observation": s[1:], "done": done, "reward": torch.ones(n, 1)},
            },
            [n],
        )

    rollouts = [
        rollout([0, 1, 2, 3, 4], [0, 0, 0, 0]),
        rollout([0, 1, 2, 6, 7], [0, 0, 1, 1]),
        rollout([0, 9, 10], [1, 1]),
    ]

    def tree(storage):
        forest = MCTSForest()
        if storage is not None:
            st = storage(1000)
            r0 = rollouts[0]
            forest.data_map = TensorDictMap.from_tensordict_pair(
                r0.exclude("next"),
                r0.get("next"),
                in_keys=[*forest.observation_keys, *forest.action_keys],
                storage_constructor=lambda: st,
                collate_fn=st.default_collate,
            )
        for r in rollouts:
            forest.extend(r)
        t = forest.get_tree(rollouts[0][0])
        return t.num_vertices(), [
            t.rollout_from_path(p)["action"].tolist() for p in ((0, 0), (0, 1), (1,))
        ]

    assert tree(A.LazyTensorStorage) == tree(None) == tree(A.LazyMemmapStorage)


def _extend_in_worker(rb):
    rb.extend(TensorDict(x=torch.arange(2), batch_size=[2]))


# (a LazyTensorStorage is shared, in shared memory: tests/adapters/test_shared_tensor_storage.py)
@pytest.mark.parametrize("storage", ["ListStorage", "LazyStackStorage"])
def test_in_memory_storages_refuse_to_be_shared_at_start_never_hang(storage):
    rb = A.TensorDictReplayBuffer(storage=getattr(A, storage)(8)).share(True)
    rb.extend(TensorDict(x=torch.arange(2), batch_size=[2]))
    proc = mp.get_context("spawn").Process(target=_extend_in_worker, args=(rb,))
    with pytest.raises(
        RuntimeError,
        match=f"Cannot share a storage of type {storage}.*LazyMemmapStorage.*shared_init=True",
    ):
        _within(proc.start)  # (pickled before any child exists: nothing is left running)


# ----------------------------------------------------------------------------- errors
def _td(obs_dim=4, reward_dim=1):
    return TensorDict(
        {"obs": torch.zeros(8, obs_dim), "next": {"reward": torch.zeros(8, reward_dim)}}, [8]
    )


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_wrong_trailing_shape_names_the_entry(storage):
    for bad, entry, want, got in (
        (_td(obs_dim=5), "'obs'", "[4]", "[5]"),
        (_td(reward_dim=2), "('next', 'reward')", "[1]", "[2]"),
    ):
        caught = []
        for L in (T, A):
            rb = L.TensorDictReplayBuffer(storage=getattr(L, storage)(100))
            rb.extend(_td())
            with pytest.raises(RuntimeError) as info:
                rb.extend(bad)
            caught.append(str(info.value))
        theirs, ours = caught
        assert ours.startswith(theirs)  # TorchRL's type and phrase first
        for part in (
            entry,
            f"shape {want} there",
            f"have shape {got}",
            f"Give the entry shape {want}",
        ):
            assert part in ours, (part, ours)
    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(10))
    rb.extend(torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match=r"shape mismatch.*items of shape \[4\].*\[5\]"):
        rb.extend(torch.zeros(3, 5))


def test_missing_key_prints_cleanly():
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(100))
    rb.extend(_td())
    with pytest.raises(KeyError) as info:
        rb.extend(TensorDict({"obs": torch.zeros(8, 4)}, [8]))
    text = str(info.value)
    assert (
        "\\" not in text
        and "('next', 'reward')" in text
        and text.startswith("LazyTensorStorage.set")
    )


@pytest.mark.parametrize("storage", ["ListStorage", "LazyTensorStorage"])
def test_sampling_an_empty_buffer_says_which_and_how_to_fix(storage):
    for L in (T, A):
        rb = L.ReplayBuffer(storage=getattr(L, storage)(10), batch_size=2)
        with pytest.raises(
            RuntimeError, match=re.escape("Cannot sample from an empty storage.")
        ) as info:
            rb.sample()
    text = str(info.value)
    assert f"ReplayBuffer.sample: the buffer is empty: its {storage} holds no items" in text
    assert "extend()" in text and "len(buffer) > 0" in text
    rb = A.ReplayBuffer(storage=A.ListStorage(10), batch_size=2, consume_after_n_samples=1)
    rb.extend(torch.arange(2))
    rb.sample()
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage.*consumed"):
        rb.sample()


_NO_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import functional_rb  # the core needs no torch
try:
    import functional_rb.adapters
except ImportError as e:
    print(type(e).__name__, "|", e.name, "|", e)
"""


def test_importing_the_adapters_without_torch_names_the_extra():
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 0, out.stderr
    kind, name, message = out.stdout.strip().split(" | ")
    assert kind == "ModuleNotFoundError" and name == "torch"
    assert 'pip install "functional_rb[torch]"' in message and "'torch' is not" in message


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(storage_ndim=2, consume_after_n_samples=1), "only supports 1-dimensional storages"),
        (dict(sampler=A.SamplerWithoutReplacement(drop_last=True)), "predictable batch-size"),
    ],
)
def test_a_buffer_that_fails_to_build_leaves_its_storage_unattached(kwargs, error):
    # the storage is the caller's: a buffer whose components do not combine must not stay
    # registered on it (its mark_update would be called on every in-place write)
    kwargs = dict(kwargs)
    storage = A.LazyTensorStorage(10, ndim=kwargs.pop("storage_ndim", 1))
    with pytest.raises((ValueError, TypeError), match=error):
        A.ReplayBuffer(storage=storage, **kwargs)
    assert storage.attached == ()
    ok = A.ReplayBuffer(storage=storage, batch_size=2)
    assert storage.attached == (ok,)
