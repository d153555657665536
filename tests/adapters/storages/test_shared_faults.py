"""Faults caused on purpose in a shared ``LazyMemmapStorage`` buffer: live overwrites and
writers killed anywhere in ``extend``. A sample never holds a torn row nor a dead writer's row,
no call blocks longer than a bound, and every process exits.

Every item written carries its writer id, a sequence number, a payload derived from both and a
checksum; each drawn item is checked field by field. The writers extend a full ring (128 slots,
a dozen items in flight) while this process samples, updates priorities or iterates. The short
versions run in CI (a few seconds each); the long ones (``@pytest.mark.slow``, FRB_SLOW=1) draw
at least 10^5 items each, and one soak mixes everything for 10 minutes.
"""

import fcntl
import multiprocessing as mp
import os
import random
import signal
import struct
import time
import warnings

import numpy as np
import pytest
from _kill_trials import die

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
A = pytest.importorskip("functional_rb.adapters")

RING = 128
PAY = 32  # payload values per item
DEAD = 999  # the writer id a dying writer writes
BOUND_S = 5.0  # no sample or extend of this process may take longer (CI machines are busy;
#                   a sample waits for writers at most _processes.MAX_WAIT_S, about 0.2 s)
JOIN_S = 60


def _checksum(wid, seq):
    return (wid * 1_000_003 + seq * 7_919) % 2_147_483_647


def _items(wid: int, seq: torch.Tensor):
    n = seq.numel()
    w = torch.full((n,), wid, dtype=torch.int64)
    payload = (w * 1_000_000 + seq).double()[:, None] + torch.arange(PAY, dtype=torch.float64)
    return tensordict.TensorDict(
        {"wid": w, "seq": seq, "payload": payload, "check": _checksum(w, seq)}, [n]
    )


def _garbage(n: int):
    """What a writer killed mid-copy leaves: items that fail every check."""
    td = _items(DEAD, torch.arange(n))
    td["payload"].fill_(float("nan"))
    td["check"].zero_()
    return td


def _torn(td) -> int:
    """Items of ``td`` (flattened) whose fields are not those one writer wrote together."""
    td = td.reshape(-1)
    w, s = td["wid"], td["seq"]
    want = (w * 1_000_000 + s).double()[:, None] + torch.arange(PAY, dtype=torch.float64)
    bad = (td["payload"] != want).any(-1) | (td["check"] != _checksum(w, s)) | (w == DEAD)
    return int(bad.sum())


def _writer(rb, wid, rounds, seed):
    rng = random.Random(seed)
    seq = 0
    for _ in range(rounds):
        n = rng.randint(1, 12)
        rb.extend(_items(wid, torch.arange(seq, seq + n)))
        seq += n


def _buffer(tmp_path, kind):
    storage = A.LazyMemmapStorage(RING, scratch_dir=str(tmp_path / "rb"))
    if kind == "prioritized":  # workers write, this process keeps the priorities
        rb = A.TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=storage, batch_size=64, sync=False
        )
    elif kind == "wor":
        rb = A.TensorDictReplayBuffer(
            storage=storage, batch_size=64, sampler=A.SamplerWithoutReplacement()
        )
    else:
        rb = A.TensorDictReplayBuffer(storage=storage, batch_size=64)
    rb.extend(_items(-1, torch.arange(RING)))  # full before the writers start
    return rb


def _start(method, target, args_list):
    ctx = mp.get_context(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's "os.fork()" warning
        procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_list]
        for p in procs:
            p.start()
    return procs


def _stop(procs):
    """Join every process (bounded); kill what is left. Returns the exit codes."""
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    return codes


class _Reader:
    """This process's side: draws and checks, timing every call."""

    def __init__(self, rb, kind):
        self.rb, self.kind = rb, kind
        self.draws = self.torn = 0
        self.slowest = 0.0

    def _timed(self, fn, *args):
        t = time.monotonic()
        out = fn(*args)
        self.slowest = max(self.slowest, time.monotonic() - t)
        return out

    def _check(self, s):
        self.draws += s.numel()
        self.torn += _torn(s)

    def step(self):
        rb = self.rb
        if self.kind == "wor":
            it = iter(rb)
            for _ in range(4):
                s = self._timed(next, it, None)
                if s is None:
                    break
                self._check(s)
            return
        s = self._timed(rb.sample)
        self._check(s)
        if self.kind == "prioritized":
            assert torch.all(torch.isfinite(s["priority_weight"]))
            self._timed(rb.update_priority, s["index"], torch.rand(s.numel()) + 0.1)

    def run_while(self, procs, seconds=None, min_draws=0):
        t_end = None if seconds is None else time.monotonic() + seconds
        hard = time.monotonic() + 600
        while time.monotonic() < hard:
            alive = any(p.is_alive() for p in procs)
            if not alive and self.draws >= min_draws:
                break
            if t_end is not None and time.monotonic() > t_end and self.draws >= min_draws:
                break
            self.step()


def _overwrite(tmp_path, method, writers, kind, rounds, min_draws):
    rb = _buffer(tmp_path, kind)
    procs = _start(method, _writer, [(rb, w, rounds, w) for w in range(writers)])
    reader = _Reader(rb, kind)
    try:
        reader.run_while(procs, min_draws=min_draws)
    finally:
        codes = _stop(procs)
    assert codes == [0] * writers
    assert reader.torn == 0, f"{reader.torn} torn items of {reader.draws}"
    assert reader.slowest < BOUND_S
    data = rb[:]
    assert _torn(data) == 0 and len(rb) == RING  # all committed, all whole
    return reader


@pytest.mark.parametrize(
    "method, writers, kind",
    [("fork", 4, "random"), ("spawn", 2, "prioritized"), ("fork", 3, "wor")],
)
def test_live_overwrites_never_tear_a_sample(tmp_path, method, writers, kind):
    reader = _overwrite(
        tmp_path, method, writers, kind, rounds=300 if method == "fork" else 150, min_draws=2_000
    )
    assert reader.draws >= 2_000


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("writers", [2, 3, 4])
@pytest.mark.parametrize("kind", ["random", "prioritized", "wor"])
def test_live_overwrites_never_tear_a_sample_long(tmp_path, method, writers, kind):
    reader = _overwrite(tmp_path, method, writers, kind, rounds=20_000, min_draws=100_000)
    assert reader.draws >= 100_000


# ---------------------------------------------------------------------- writers killed
def _doomed(rb, phase, n):
    """Extend ``n`` items and die at ``phase`` of it (SIGKILL: no clean-up runs)."""
    st, cur = rb.storage, rb.storage._cursor
    reserve, commit = st.reserve, cur.commit

    if phase == "before_reserve":
        st.reserve = lambda k: die()
    elif phase == "in_reserve":  # under the cursor's lock, after counting, half the stamps set

        def st_reserve(k):
            with cur._locked(fcntl.LOCK_EX) as fd:
                start = cur._read(fd)
                free = np.flatnonzero(cur._inflight[:, 2] == 0)[0]
                cur._inflight[free] = (start, k, os.getpid())
                os.pwrite(fd, struct.pack("<q", start + k), 0)
                items = start + np.arange(k // 2)
                cur._stamps[items % cur.slots] = 2 * items + 1
                die()

        st.reserve = st_reserve
    elif phase == "in_reserve_before_count":  # the record written, nothing counted

        def st_reserve(k):
            with cur._locked(fcntl.LOCK_EX) as fd:
                free = np.flatnonzero(cur._inflight[:, 2] == 0)[0]
                cur._inflight[free] = (cur._read(fd), k, os.getpid())
                die()

        st.reserve = st_reserve
    elif phase == "after_reserve":
        st.reserve = lambda k: (reserve(k), die())
    elif phase == "mid_copy":  # half the rows garbage, then one field of the others

        def st_set(index, data, set_cursor=True):
            half = index.numel() // 2
            st._storage[index[:half]] = _garbage(half)
            st._storage["wid"][index[half:]] = DEAD
            die()

        st.set = st_set
    elif phase == "in_commit":  # under the lock, half the stamps committed

        def cur_commit(start, k):
            items = cur._items(start, k)
            with cur._locked(fcntl.LOCK_EX):
                half = items[: items.size // 2]
                cur._stamps[half % cur.slots] = 2 * half + 2
                die()

        cur.commit = cur_commit
    elif phase == "after_commit":
        cur.commit = lambda start, k: (commit(start, k), die())
    rb.extend(_items(100, torch.arange(n)))  # (whole items: drawn once committed)
    die()


def _doomed_loop(rb, seed):
    """Extend without end until killed (the parent kills at a random time): a row it was
    copying when killed mixes two items and fails the checks."""
    rng = random.Random(seed)
    seq = 0
    while True:
        n = rng.randint(1, 48)
        rb.extend(_items(200 + seed, torch.arange(seq, seq + n)))
        seq += n


PHASES = [
    "before_reserve",
    "in_reserve_before_count",
    "in_reserve",
    "after_reserve",
    "mid_copy",
    "in_commit",
    "after_commit",
]


def _kill_trials(tmp_path, method, kind, trials, random_kills, live_rounds, min_draws=0):
    """A live writer runs throughout; doomed writers die one after the other at each phase
    of ``trials`` (and ``random_kills`` more at random times); this process keeps sampling,
    and extends between deaths. Returns the reader."""
    rb = _buffer(tmp_path, kind)
    rng = random.Random(0)
    live = _start(method, _writer, [(rb, 7, live_rounds, 7)])
    reader = _Reader(rb, kind)
    doomed = []
    try:
        for phase in trials:
            (p,) = _start(method, _doomed, [(rb, phase, rng.randint(2, 12))])
            doomed.append(p)
            while p.is_alive():
                reader.step()
            assert p.exitcode == -signal.SIGKILL, (phase, p.exitcode)
            for _ in range(5):
                reader.step()
            t = time.monotonic()
            rb.extend(_items(-2, torch.arange(3)))  # this process's writes go on
            assert time.monotonic() - t < BOUND_S
        for k in range(random_kills):
            (p,) = _start(method, _doomed_loop, [(rb, k)])
            doomed.append(p)
            t_kill = time.monotonic() + (2.0 if method == "spawn" else 0.2) + rng.random() * 0.3
            while time.monotonic() < t_kill:
                reader.step()
            p.kill()
            p.join(JOIN_S)
            assert p.exitcode == -signal.SIGKILL
            for _ in range(5):
                reader.step()
        reader.run_while(live, min_draws=min_draws)  # (this process samples on after it)
    finally:
        codes = _stop(live + doomed)
    assert codes[0] == 0, f"the live writer failed: {codes[0]}"
    assert reader.torn == 0, f"{reader.torn} torn or dead items of {reader.draws}"
    assert reader.slowest < BOUND_S
    assert rb.storage.holes() is None or len(rb) < RING
    rb.extend(_items(-3, torch.arange(RING)))  # a whole ring rewritten: no hole is left
    assert rb.storage.holes() is None and _torn(rb[:]) == 0 and len(rb) == RING
    return reader


@pytest.mark.parametrize("method, kind", [("fork", "random"), ("spawn", "prioritized")])
def test_writers_killed_anywhere_in_extend(tmp_path, method, kind):
    # (a spawned worker takes seconds to import the libraries: fewer trials than with fork)
    trials = PHASES if method == "fork" else ["mid_copy", "in_commit"]
    _kill_trials(
        tmp_path,
        method,
        kind,
        trials,
        random_kills=2 if method == "fork" else 0,
        live_rounds=600 if method == "fork" else 300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", ["random", "prioritized", "wor"])
def test_writers_killed_anywhere_in_extend_long(tmp_path, method, kind):
    reader = _kill_trials(
        tmp_path, method, kind, PHASES * 3, random_kills=20, live_rounds=20_000, min_draws=100_000
    )
    assert reader.draws >= 100_000


@pytest.mark.slow
def test_soak(tmp_path):
    """10 minutes: writers overwrite, others die at random phases, this process samples and
    updates priorities."""
    t_end = time.monotonic() + 600
    rounds = 0
    while time.monotonic() < t_end - 60:
        method = "fork" if rounds % 2 == 0 else "spawn"
        _kill_trials(
            tmp_path / str(rounds),
            method,
            ["random", "prioritized", "wor"][rounds % 3],
            random.Random(rounds).sample(PHASES, 3),
            random_kills=3,
            live_rounds=3_000,
        )
        _overwrite(
            tmp_path / f"o{rounds}",
            method,
            2 + rounds % 3,
            "prioritized",
            rounds=2_000,
            min_draws=10_000,
        )
        rounds += 1


# ---------------------------------------------------------------------- large writes, few rows
def _extend(rb, data):
    rb.extend(data)


def _big_extend_killed(tmp_path, method, rows, delay):
    """A worker killed in the middle of a large extend (after it reserved its rows): the next
    worker's extend finishes (no OpenMP barrier waits for the parent's threads after fork),
    and this process never draws a row of the dead one."""
    (torch.randn(4_000_000) * 2).sum()  # this process has used torch's (OpenMP) threads
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(rows + 4, scratch_dir=str(tmp_path / "big")), batch_size=4096
    )
    rb.extend(_items(-1, torch.arange(4)))
    # built here: the workers run only the library's code. (Whole items: the first worker may
    # finish before it is killed; a row it was copying when killed mixes fields and fails.)
    first, second = _items(1, torch.arange(rows)), _items(2, torch.arange(rows))
    procs = []
    try:
        (p,) = _start(method, _extend, [(rb, first)])
        procs.append(p)
        time.sleep(delay)
        p.kill()
        p.join(JOIN_S)
        (q,) = _start(method, _extend, [(rb, second)])
        procs.append(q)
        q.join(JOIN_S)
        assert q.exitcode == 0, "the worker after the dead one did not finish its extend"
        t = time.monotonic()
        drawn = [rb.sample() for _ in range(5)]
        assert time.monotonic() - t < BOUND_S
        assert sum(_torn(s) for s in drawn) == 0
    finally:
        _stop(procs)


def test_a_large_extend_killed_in_a_forked_worker(tmp_path):
    _big_extend_killed(tmp_path, "fork", 100_000, random.uniform(0.005, 0.05))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_large_extend_killed_in_a_worker_long(tmp_path, method):
    for k in range(10):
        delay = random.Random(k).uniform(0.005, 0.15) + (4.0 if method == "spawn" else 0.0)
        _big_extend_killed(tmp_path / str(k), method, 400_000, delay)


def test_a_sample_among_few_drawable_rows_does_not_spin(tmp_path):
    """60 of 64 rows left by a dead writer: a sample draws the 4 others, at once."""
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(64, scratch_dir=str(tmp_path / "rb")), batch_size=4096
    )
    rb.extend(_items(-1, torch.arange(64)))
    (p,) = _start("fork", _doomed, [(rb, "mid_copy", 60)])
    _stop([p])
    assert p.exitcode == -signal.SIGKILL
    t = time.monotonic()
    s = rb.sample()
    assert time.monotonic() - t < BOUND_S
    assert _torn(s) == 0 and set(s["seq"].tolist()) == {60, 61, 62, 63}
    assert len(rb) == 4 and len(rb.storage) == 64
    (p,) = _start("fork", _doomed, [(rb, "mid_copy", 4)])  # and now the last 4 too
    _stop([p])
    with pytest.raises(RuntimeError, match="no stored row is drawable"):
        rb.sample()


def test_a_buffer_lock_held_by_a_parent_thread_does_not_block_a_forked_worker(tmp_path):
    """A prefetch or update thread may hold the buffer's lock when a worker is forked; the
    child has no such thread, so it gets a fresh lock."""
    import threading

    rb = _buffer(tmp_path, "random")
    held, release = threading.Event(), threading.Event()

    def hold():
        with rb.lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        (p,) = _start("fork", _writer, [(rb, 0, 5, 0)])
        p.join(20)
        code = p.exitcode
    finally:
        release.set()
        thread.join(10)
        _stop([p])
    assert code == 0
    assert not thread.is_alive()


def _sample_in_child(rb, queue):
    try:
        rb.sample()
    except RuntimeError as e:
        queue.put(str(e))
    else:
        queue.put("sampled")


def test_sampling_with_jax_in_a_forked_child_raises_naming_spawn(tmp_path):
    """A forked worker may extend, but a sampler that runs JAX there could wait for ever: it
    raises, naming the start methods that are safe. A uniform sampler (torch only) samples."""
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # this process runs JAX
    prio = _buffer(tmp_path / "p", "prioritized")
    prio.sample()
    uniform = _buffer(tmp_path / "u", "random")
    ctx = mp.get_context("fork")
    out = []
    for rb in (prio, uniform):
        queue = ctx.Queue()
        (p,) = _start("fork", _sample_in_child, [(rb, queue)])
        try:
            out.append(queue.get(timeout=JOIN_S))
        finally:
            _stop([p])
    assert "spawn" in out[0] and "forkserver" in out[0] and "JAX" in out[0]
    assert out[1] == "sampled"
