"""A write cursor shared by several processes: disjoint positions for concurrent extends.

TorchRL lets worker processes extend one ``LazyMemmapStorage``-backed buffer (the storage
files are memory-mapped in every process). For no write to be lost, two workers that extend at
the same time must receive disjoint positions. ``SharedCursor`` provides exactly that: a small
file holding an int64 counter of items ever reserved, updated under an exclusive ``fcntl`` lock::

    cursor = SharedCursor(os.path.join(scratch_dir, "cursor.bin"), slots=capacity)
    start = cursor.reserve(n)                       # int: first of n consecutive reservations
    positions = (start + np.arange(n)) % capacity   # ring positions of these n items
    # or: positions, keep = cursor.reserve_positions(n, capacity)
    ... write the n items at `positions` into the shared memmap files ...
    cursor.commit(start, n)                         # the n items are now readable
    end = cursor.committed(since)                   # items [since, end) are all written
    len_ = cursor.size(capacity)                    # min(cursor.count(), capacity)

Commit marks (with ``slots``): ``reserve`` hands out positions; it does not say the data is
there yet. ``commit`` records, for each of the ``slots`` ring positions, the newest item
(reservation number) fully written there, in ``<path>.marks`` (int64 ``[slots]``, -1: none).
``committed(since)`` returns the first item ``k >= since`` not yet written (``marks[k % slots]
< k``), so a reader that replays the items ``[since, committed(since))`` in order never reads a
slot a writer is still filling, whatever order the writers finish in. Marks are written and
read under the same ``flock`` as the counter (a full memory barrier), after the data.

Writers that die: each reservation is recorded, with the reserving process's id, in
``<path>.inflight`` (``_INFLIGHT`` rows of ``(start, n, pid)``) until it is committed. When
``committed`` meets a reservation whose process no longer exists, it *abandons* it: its items
count as written (so a dead writer never blocks or hides the writes reserved after it) and its
range is returned by :meth:`take_abandoned`, so the storage can mark those slots as holes (their
data may be torn) until a later write fills them.

Notes:
- When more than ``slots`` items are in flight (reserved, not yet committed) two writers may
  fill the same slot at once; keep the ring larger than what is in flight (TorchRL has the same
  rule). An item whose slot a later committed item already reuses counts as written (its data
  is gone: the slot holds the later item).
- The object pickles as its path (and ``slots``), so it can be handed to ``multiprocessing``
  workers (fork or spawn); each process opens its own file descriptor (a forked child reopens
  the file on first use: ``flock`` does not exclude holders of one inherited descriptor).
- POSIX only (``fcntl.flock``); on other systems construction raises.
"""
from __future__ import annotations

import os
import struct
import threading

import numpy as np

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["SharedCursor"]


class _Locked:
    """``with cursor._locked(mode) as fd``: the cursor's thread lock, then its file lock."""

    __slots__ = ("cursor", "mode")

    def __init__(self, cursor, mode):
        self.cursor, self.mode = cursor, mode

    def __enter__(self):
        cursor = self.cursor
        cursor._fileno()  # after a fork: a fresh description and thread lock first
        cursor._thread_lock.acquire()
        try:
            fd = cursor._fileno()
            fcntl.flock(fd, self.mode)
        except BaseException:
            cursor._thread_lock.release()
            raise
        return fd

    def __exit__(self, *exc):
        try:
            fcntl.flock(self.cursor._fd, fcntl.LOCK_UN)
        finally:
            self.cursor._thread_lock.release()


_FMT = "<q"  # one little-endian int64: items reserved so far
_SIZE = struct.calcsize(_FMT)
_INFLIGHT = 1024  # reservations in flight at once (a writer holds one while it copies)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class SharedCursor:
    """An int64 counter in the file ``path``, incremented atomically across processes.

    Args:
      path: the counter file; created holding 0 if missing, reused (continuing its count) if it
        exists.
      slots: ring size for commit marks (``commit`` / ``committed``), kept in
        ``<path>.marks``; ``None``: counter only.
    """

    def __init__(self, path, slots: int | None = None):
        if fcntl is None:  # pragma: no cover
            raise OSError("SharedCursor needs fcntl (POSIX); on this system share the buffer "
                          "with a single writer process instead.")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)
                                  or slots < 1):
            raise ValueError(f"SharedCursor: slots must be an int >= 1 or None, got {slots!r}.")
        self.path = os.fspath(path)
        self.slots = slots
        self._fd = None
        self._marks = None
        self._inflight = None
        self._abandoned: list = []  # (start, n) of dead writers' reservations, not yet taken
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self._open()

    def _open(self):
        # flock excludes open file descriptions, not processes: a forked child inherits this
        # process's description and must open its own (see _fileno)
        self._pid = os.getpid()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.pwrite(fd, struct.pack(_FMT, 0), 0)
            if self.slots is not None:
                marks = self.path + ".marks"
                size = self.slots * 8
                if not os.path.exists(marks) or os.path.getsize(marks) != size:
                    np.full(self.slots, -1, np.int64).tofile(marks)
                self._marks = np.memmap(marks, dtype=np.int64, mode="r+", shape=(self.slots,))
                inflight = self.path + ".inflight"
                if not os.path.exists(inflight) or os.path.getsize(inflight) != _INFLIGHT * 24:
                    np.zeros((_INFLIGHT, 3), np.int64).tofile(inflight)
                self._inflight = np.memmap(inflight, dtype=np.int64, mode="r+",
                                           shape=(_INFLIGHT, 3))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd

    def __getstate__(self):
        return {"path": self.path, "slots": self.slots}

    def __setstate__(self, state):
        self.path = state["path"]
        self.slots = state.get("slots")
        self._fd = None
        self._marks = None
        self._inflight = None
        self._abandoned = []
        self._thread_lock = threading.Lock()
        self._open()

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        self._marks = None
        self._inflight = None
        if fd is not None and getattr(self, "_pid", None) == os.getpid():
            os.close(fd)

    def _fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"SharedCursor({self.path!r}) is closed.")
        if self._pid != os.getpid():  # inherited by fork: the parent's lock is not ours
            self._fd = None
            self._thread_lock = threading.Lock()
            self._open()
        return self._fd

    def _locked(self, mode):
        return _Locked(self, mode)

    @staticmethod
    def _read(fd) -> int:
        return struct.unpack(_FMT, os.pread(fd, _SIZE, 0))[0]

    def reserve(self, n: int) -> int:
        """Reserve ``n`` consecutive slots; returns the count before them (the first slot)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"SharedCursor.reserve: n must be an int >= 0, got {n!r}.")
        with self._locked(fcntl.LOCK_EX) as fd:
            start = self._read(fd)
            os.pwrite(fd, struct.pack(_FMT, start + int(n)), 0)
            if self._inflight is not None and n:
                free = np.flatnonzero(self._inflight[:, 2] == 0)
                if not free.size:
                    raise RuntimeError(f"SharedCursor({self.path!r}): more than {_INFLIGHT} "
                                       "writes in flight at once.")
                self._inflight[free[0]] = (start, int(n), os.getpid())
        return start

    def reserve_positions(self, n: int, capacity: int):
        """Reserve ``n`` items of a ring of ``capacity`` slots.

        Returns ``(positions, keep)``: int64 ``[n]`` ring positions and bool ``[n]``, False for
        items that the same call would overwrite itself (only the last ``capacity`` of a call
        larger than the ring are kept, as the core RoundRobinWriter does). Write
        ``items[keep]`` at ``positions[keep]``.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"SharedCursor.reserve_positions: capacity must be an int >= 1, "
                             f"got {capacity!r}.")
        start = self.reserve(n)
        positions = (start + np.arange(n, dtype=np.int64)) % capacity
        keep = np.arange(n) >= n - capacity
        return positions, keep

    def _need_marks(self, where):
        if self._marks is None:
            raise ValueError(f"SharedCursor.{where}: this cursor keeps no commit marks; build it "
                             "with SharedCursor(path, slots=ring_size).")

    def commit(self, start: int, n: int) -> None:
        """Mark the items ``[start, start + n)`` (one ``reserve``) as fully written."""
        self._need_marks("commit")
        start, n = int(start), int(n)
        if n <= 0:
            return
        slots = self.slots
        first = max(start, start + n - slots)  # only the last `slots` items occupy a slot
        items = np.arange(first, start + n, dtype=np.int64)
        pos = items % slots
        with self._locked(fcntl.LOCK_EX):
            # max: a late commit of an older item never hides a newer one in the same slot
            self._marks[pos] = np.maximum(self._marks[pos], items)
            self._inflight[self._inflight[:, 0] == start] = 0

    def committed(self, since: int, until: int | None = None) -> int:
        """The first item in ``[since, until)`` not yet committed, or ``until`` when all are
        (``until`` defaults to :meth:`count`). Reservations of writers that died are abandoned
        on the way (see the module docstring)."""
        self._need_marks("committed")
        with self._locked(fcntl.LOCK_EX) as fd:
            until = self._read(fd) if until is None else int(until)
            since = int(since)
            while True:
                if until <= since:
                    return until
                items = np.arange(since, until, dtype=np.int64)
                ok = self._marks[items % self.slots] >= items
                bad = np.flatnonzero(~ok)
                if not bad.size:
                    return until
                first = int(items[bad[0]])
                if not self._abandon_dead(first):
                    return first
                since = first

    def _abandon_dead(self, item: int) -> bool:
        """Abandon the reservation holding ``item`` if its writer died (lock held)."""
        rows = self._inflight
        hit = np.flatnonzero((rows[:, 2] != 0) & (rows[:, 0] <= item) &
                             (item < rows[:, 0] + rows[:, 1]))
        if not hit.size:
            return False
        start, n, pid = (int(v) for v in rows[hit[0]])
        if _alive(pid):
            return False
        first = max(start, start + n - self.slots)
        items = np.arange(first, start + n, dtype=np.int64)
        self._marks[items % self.slots] = np.maximum(self._marks[items % self.slots], items)
        rows[hit[0]] = 0
        self._abandoned.append((start, n))
        return True

    def take_abandoned(self) -> list:
        """``[(start, n)]``: the reservations this object abandoned since the last call."""
        out, self._abandoned = self._abandoned, []
        return out

    def size(self, capacity: int) -> int:
        """Items stored in a ring of ``capacity`` slots: ``min(count(), capacity)``."""
        return min(self.count(), capacity)

    def peek(self) -> int:
        """:meth:`count` without the lock: an aligned 8-byte read, never torn on the platforms
        flock exists on; a caller that finds it changed takes the locked path."""
        return struct.unpack(_FMT, os.pread(self._fileno(), _SIZE, 0))[0]

    def count(self) -> int:
        """Items reserved so far (by every process)."""
        with self._locked(fcntl.LOCK_SH) as fd:
            return self._read(fd)

    def reset(self, value: int = 0) -> None:
        """Set the counter (e.g. after ``loads`` restored a buffer with ``value`` writes); the
        commit marks say that every item before ``value`` is written."""
        value = int(value)
        with self._locked(fcntl.LOCK_EX) as fd:
            os.pwrite(fd, struct.pack(_FMT, value), 0)
            if self._marks is not None:
                slot = np.arange(self.slots, dtype=np.int64)
                # newest item < value in each slot, -1 when there is none
                newest = value - 1 - (value - 1 - slot) % self.slots
                self._marks[:] = np.where(slot < value, newest, -1)
                self._inflight[:] = 0

    def __repr__(self):
        return f"SharedCursor({self.path!r}, slots={self.slots})"
