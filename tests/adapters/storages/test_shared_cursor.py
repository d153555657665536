"""SharedCursor: concurrent reservations from several processes are disjoint and complete."""

import fcntl
import multiprocessing as mp
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _kill_trials import die

from functional_rb.adapters.storages import _shared_cursor
from functional_rb.adapters.storages._shared_cursor import SharedCursor

ROUNDS = 300
WORKERS = 3


def _sizes(wid):
    return [1 + (r + wid) % 3 for r in range(ROUNDS)]


# Workers load only the cursor module (not JAX) so that the processes start fast; each opens
# its own descriptor on the same file.
_WORKER = """
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("_shared_cursor", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
cursor = mod.SharedCursor(sys.argv[2])
data_path, total, wid, rounds = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
data = np.memmap(data_path, dtype=np.int64, mode="r+", shape=(total,))
for r in range(rounds):
    n = 1 + (r + wid) % 3
    start = cursor.reserve(n)
    data[start:start + n] = wid * 1_000_000 + r * 10 + np.arange(n)
data.flush()
"""


def test_processes_get_disjoint_positions(tmp_path):
    total = sum(sum(_sizes(w)) for w in range(WORKERS))
    data_path = str(tmp_path / "data.bin")
    np.memmap(data_path, dtype=np.int64, mode="w+", shape=(total,))[:] = -1
    cursor = SharedCursor(tmp_path / "cursor.bin")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                _shared_cursor.__file__,
                cursor.path,
                data_path,
                str(total),
                str(w),
                str(ROUNDS),
            ]
        )
        for w in range(WORKERS)
    ]
    assert [p.wait(60) for p in procs] == [0] * WORKERS
    assert cursor.count() == total
    data = np.array(np.memmap(data_path, dtype=np.int64, mode="r", shape=(total,)))
    assert (data >= 0).all(), "a slot was reserved by nobody (lost write)"
    want = np.sort(
        np.concatenate(
            [
                w * 1_000_000 + r * 10 + np.arange(n)
                for w in range(WORKERS)
                for r, n in enumerate(_sizes(w))
            ]
        )
    )
    np.testing.assert_array_equal(np.sort(data), want)  # every item once: no overlap


def test_threads_and_reopen(tmp_path):
    path = tmp_path / "c.bin"
    cursor = SharedCursor(path)
    starts = []
    lock = threading.Lock()

    def run():
        for _ in range(200):
            s = cursor.reserve(2)
            with lock:
                starts.append(s)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(starts) == list(range(0, 1600, 2))
    again = pickle.loads(pickle.dumps(cursor))  # continues the same count
    assert again.reserve(5) == 1600 and cursor.count() == 1605
    again.reset(7)
    assert SharedCursor(path).count() == 7
    with pytest.raises(ValueError, match="n must be an int"):
        cursor.reserve(-1)
    cursor.close()
    with pytest.raises(ValueError, match="closed"):
        cursor.count()


def test_reserve_positions_ring(tmp_path):
    cursor = SharedCursor(tmp_path / "ring.bin")
    pos, keep = cursor.reserve_positions(3, capacity=4)
    np.testing.assert_array_equal(pos, [0, 1, 2])
    assert keep.all()
    pos, keep = cursor.reserve_positions(6, capacity=4)  # larger than the ring: last 4 kept
    np.testing.assert_array_equal(pos, [3, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(keep, [False, False, True, True, True, True])
    assert cursor.count() == 9 and cursor.size(4) == 4 and cursor.size(100) == 9
    with pytest.raises(ValueError, match="capacity must be"):
        cursor.reserve_positions(1, capacity=0)


def test_commit_marks_give_the_written_prefix(tmp_path):
    cursor = SharedCursor(tmp_path / "m.bin", slots=4)
    a = cursor.reserve(1)  # item 0: a slow writer
    b = cursor.reserve(2)  # items 1, 2
    assert cursor.committed(0) == 0
    cursor.commit(b, 2)  # finishes first: nothing is readable before item 0 is
    assert cursor.committed(0) == 0 and cursor.committed(1) == 3
    cursor.commit(a, 1)
    assert cursor.committed(0) == 3
    c = cursor.reserve(3)  # items 3, 4, 5: 4 and 5 reuse the slots of 0 and 1
    cursor.commit(c, 3)
    assert cursor.committed(0) == 6
    np.testing.assert_array_equal(np.memmap(cursor.path + ".marks", np.int64, "r"), [4, 5, 2, 3])
    d = cursor.reserve(6)  # larger than the ring: only its last 4 items occupy slots
    cursor.commit(d, 6)
    assert cursor.committed(6) == 12
    again = pickle.loads(pickle.dumps(cursor))  # the marks are shared through the file
    assert again.committed(0) == 12 and again._marks.tolist() == [8, 9, 10, 11]
    cursor.reset(6)  # e.g. after loads: items 2..5 are in the ring
    np.testing.assert_array_equal(again._marks, [4, 5, 2, 3])
    assert again.count() == 6 and again.committed(2) == 6
    cursor.reset(2)
    np.testing.assert_array_equal(again._marks, [0, 1, -1, -1])
    with pytest.raises(ValueError, match="no commit marks"):
        SharedCursor(tmp_path / "plain.bin").commit(0, 1)
    with pytest.raises(ValueError, match="slots must be"):
        SharedCursor(tmp_path / "bad.bin", slots=0)


def _reserve_and_report(cursor, queue):
    cursor.reserve(1)
    queue.put(time.monotonic())


def test_forked_children_lock_against_the_parent(tmp_path):
    """A forked child inherits the parent's file description, on which ``flock`` would not
    exclude the parent: the child reopens the file and waits for the parent's lock."""
    cursor = SharedCursor(tmp_path / "f.bin", slots=4)
    cursor.reserve(1)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with cursor._locked(fcntl.LOCK_EX):  # the parent is inside a reservation
        child = ctx.Process(target=_reserve_and_report, args=(cursor, queue))
        child.start()
        time.sleep(0.5)
        released = time.monotonic()
    reserved = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert reserved >= released, "the child reserved while the parent held the lock"
    assert cursor.count() == 2


def _reserve_and_die(cursor, n):
    cursor.reserve(n)
    die()


def test_row_stamps_are_a_seqlock_per_slot(tmp_path):
    """Odd while an item is written (from reserve), even once committed; a late commit never
    marks a slot that a newer reservation holds; a dead writer's slots stay odd (holes) in
    every process until rewritten, and the epoch tells readers when to rescan."""
    cursor = SharedCursor(tmp_path / "s.bin", slots=4)
    stamps = cursor.stamps
    assert stamps.tolist() == [0, 0, 0, 0]
    a = cursor.reserve(3)  # items 0, 1, 2
    assert stamps.tolist() == [1, 3, 5, 0]  # 2k + 1: being written
    cursor.commit(a, 3)
    assert stamps.tolist() == [2, 4, 6, 0]  # 2k + 2: committed
    b = cursor.reserve(3)  # items 3, 4, 5 at slots 3, 0, 1
    cursor.overrun_wait_s = 0.05
    with pytest.raises(RuntimeError, match="make the storage larger"):
        cursor.reserve(2)  # slot 3 is still being written by b
    assert cursor.count() == 6  # (nothing was reserved)
    c = cursor.reserve(1)  # item 6 at slot 2
    assert stamps.tolist() == [9, 11, 13, 7]
    done, count, epoch, busy, dead = cursor.snapshot(0)
    assert (done, count) == (3, 7) and busy.tolist() == [0, 1, 2, 3] and dead.tolist() == []
    assert cursor.snapshot(0, epoch)[4] is None  # same epoch: no rescan
    cursor.commit(c, 1)
    cursor.commit(b, 3)
    late = cursor.reserve(1)  # item 7 at slot 3
    assert stamps.tolist() == [10, 12, 14, 15]
    cursor.commit(late - 4, 1)  # a late commit of item 3: slot 3 stays odd
    assert stamps.tolist() == [10, 12, 14, 15]
    cursor.commit(late, 1)
    assert stamps.tolist() == [10, 12, 14, 16]
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_reserve_and_die, args=(cursor, 2))  # items 8, 9
    child.start()
    child.join(30)
    assert child.exitcode == -9
    other = pickle.loads(pickle.dumps(cursor))  # another process's view
    done, count, epoch2, busy, dead = other.snapshot(8, epoch)
    assert (done, count) == (10, 10) and busy.tolist() == [] and dead.tolist() == [0, 1]
    assert epoch2 != epoch and other.take_abandoned() == [(8, 2)]
    assert cursor.snapshot(10, epoch2)[4] is None  # the same holes for everyone
    d = cursor.reserve(2)  # items 10, 11 rewrite slots 2, 3
    cursor.commit(d, 2)
    e = cursor.reserve(1)  # item 12 rewrites the hole at slot 0
    assert cursor.peek_head()[1] != epoch2  # readers rescan
    cursor.commit(e, 1)
    assert cursor.snapshot(0, epoch2)[4].tolist() == [1]
    cursor.reset(5)  # loads: items 1..4 committed
    assert stamps.tolist() == [10, 4, 6, 8]


def test_records_of_writers_that_died_under_the_lock(tmp_path):
    """A record left by a writer killed before it counted its items is dropped by the next
    reserve; one killed after counting is abandoned (its slots are holes)."""
    cursor = SharedCursor(tmp_path / "r.bin", slots=8)
    cursor.commit(cursor.reserve(2), 2)
    dead_pid = 2**22 + 12345  # (no such process)
    cursor._inflight[5] = (2, 3, dead_pid)  # died before counting
    start = cursor.reserve(1)
    assert start == 2 and (cursor._inflight[5] == 0).all()
    cursor.commit(start, 1)
    cursor._inflight[6] = (3, 2, dead_pid)  # counted, stamps set, then died
    import os
    import struct

    os.pwrite(cursor._fd, struct.pack("<q", 5), 0)
    cursor.stamps[3:5] = [7, 9]
    done, count, _, busy, dead = cursor.snapshot(0)
    assert (done, count) == (5, 5) and dead.tolist() == [3, 4] and busy.tolist() == []
    assert (cursor._inflight == 0).all()
