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

Row stamps (a seqlock per slot, with ``slots``): ``<path>.stamps`` holds an int64 per slot,
``2 * k + 1`` while item ``k`` is being written there (set by ``reserve``, under the lock, before
the writer touches the data) and ``2 * k + 2`` once it is committed (set by ``commit``, under
the lock, after the data; only if the slot still holds ``2 * k + 1``, so a late commit never
makes a newer reservation's slot look written); 0: never written. A reader reads the stamps of
the rows it gathers before and after the gather and keeps a row only if its stamp is even,
non-zero and unchanged: it then holds one whole committed item (on x86-64 loads are not
reordered with loads nor stores with stores, so the seqlock needs no fence).

Writers that die: each reservation is recorded, with the reserving process's id, in
``<path>.inflight`` (``_INFLIGHT`` rows of ``(start, n, pid)``) until it is committed. When
``committed`` or ``snapshot`` meets a reservation whose process no longer exists, it *abandons*
it: its items count as written (so a dead writer never blocks or hides the writes reserved
after it) and its range is returned by :meth:`take_abandoned`. Its slots keep the odd stamps
``reserve`` gave them, so they are *holes* (never drawn) in every process until a later write
fills them: nothing is recorded outside the lock, and nothing but NumPy runs under it.

Revision: a third int64 of the counter file counts the writes made to the storage by every
process (:meth:`bump_revision`), so caches derived from the data (a sampler's trajectory
boundaries) are invalidated by another process's writes too.

Crash atomicity: every change is made under the lock in an order that leaves a consistent
state wherever the process dies (the lock dies with it). ``reserve`` writes the in-flight
record, then the count, then the odd stamps (a writer killed in between has written no data, so
rows still even still hold their old item); ``commit`` writes the even stamps, then the marks,
then clears the record; abandoning bumps the epoch (second int64 of the counter file: readers
rescan the stamps for holes when it changes), then writes the marks, then clears the record. A
record left behind by a process that died under the lock is abandoned again (it is
idempotent); a record with ``start`` at or past the count (killed before counting) is dropped
by the next ``reserve``.

Notes:
- A slot is never written by two writers at once: when a reservation reaches a slot that a live
  writer reserved a whole ring ago and still copies (more items in flight than the ring holds,
  or a writer stalled while the others went round the ring), ``reserve`` waits for that commit,
  at most ``overrun_wait_s`` (10 s), then raises naming the fix (a larger ring). A dead
  writer's slot is abandoned and reused at once. An item whose slot a later committed item
  already reuses counts as written (its data is gone: the slot holds the later item).
- The object pickles as its path (and ``slots``), so it can be handed to ``multiprocessing``
  workers (fork or spawn); each process opens its own file descriptor (a forked child reopens
  the file on first use: ``flock`` does not exclude holders of one inherited descriptor).
- POSIX only (``fcntl.flock``); on other systems construction raises.
"""

from __future__ import annotations

import os
import struct
import threading
import time

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
_HEAD = "<qq"  # the count, then the epoch (bumped when the holes may have changed)
_HEAD_SIZE = struct.calcsize(_HEAD)
_REVISION_AT = _HEAD_SIZE  # third int64: the storage's mutation revision (every process's)
_INFLIGHT = 1024  # reservations in flight at once (a writer holds one while it copies)


_OVERRUN = (
    "SharedCursor({path!r}).reserve: a slot of the ring ({slots} slots) is still being written "
    "by a live writer that reserved it a whole ring ago, and it did not commit within {wait} s. "
    "More items are in flight than the ring holds: make the storage larger than what the "
    "writers have in flight at once (or extend in smaller batches)."
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _committed_stamps(count: int, slots: int) -> np.ndarray:
    """The stamps of a ring whose ``count`` first items are all committed."""
    slot = np.arange(slots, dtype=np.int64)
    newest = count - 1 - (count - 1 - slot) % slots
    return np.where(slot < count, 2 * newest + 2, 0)


class SharedCursor:
    """An int64 counter in the file ``path``, incremented atomically across processes.

    Args:
      path: the counter file; created holding 0 if missing, reused (continuing its count) if it
        exists.
      slots: ring size for commit marks (``commit`` / ``committed``), kept in
        ``<path>.marks``; ``None``: counter only.
    """

    overrun_wait_s = 10.0  # how long reserve waits for a slot another writer still copies

    def __init__(self, path, slots: int | None = None):
        if fcntl is None:  # pragma: no cover
            raise OSError(
                "SharedCursor needs fcntl (POSIX); on this system share the buffer "
                "with a single writer process instead."
            )
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
        ):
            raise ValueError(f"SharedCursor: slots must be an int >= 1 or None, got {slots!r}.")
        self.path = os.fspath(path)
        self.slots = slots
        self._fd = None
        self._marks = None
        self._inflight = None
        self._stamps = None
        self._abandoned: list = []  # (start, n) of dead writers' reservations, not yet taken
        self._records: dict = {}  # start -> in-flight row, of this object's reservations
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self._open()

    def _open(self):
        # flock excludes open file descriptions, not processes: a forked child inherits this
        # process's description and must open its own (see _fileno)
        self._pid = os.getpid()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size < _SIZE:
                os.pwrite(fd, struct.pack(_FMT, 0), 0)
            if size < _HEAD_SIZE:  # (a counter file written before the epoch existed)
                os.pwrite(fd, struct.pack(_FMT, 0), _SIZE)
            if size < _REVISION_AT + _SIZE:  # (... or before the revision existed)
                os.pwrite(fd, struct.pack(_FMT, 0), _REVISION_AT)
            if self.slots is not None:
                marks = self.path + ".marks"
                size = self.slots * 8
                if not os.path.exists(marks) or os.path.getsize(marks) != size:
                    np.full(self.slots, -1, np.int64).tofile(marks)
                # plain ndarray views of the maps: no np.memmap subclass overhead per op
                self._marks = np.memmap(marks, dtype=np.int64, mode="r+", shape=(self.slots,)).view(
                    np.ndarray
                )
                inflight = self.path + ".inflight"
                if not os.path.exists(inflight) or os.path.getsize(inflight) != _INFLIGHT * 24:
                    np.zeros((_INFLIGHT, 3), np.int64).tofile(inflight)
                self._inflight = np.memmap(
                    inflight, dtype=np.int64, mode="r+", shape=(_INFLIGHT, 3)
                ).view(np.ndarray)
                stamps = self.path + ".stamps"
                if not os.path.exists(stamps) or os.path.getsize(stamps) != size:
                    # the items already counted are written (a cursor from before the stamps)
                    _committed_stamps(self._read(fd), self.slots).tofile(stamps)
                self._stamps = np.memmap(
                    stamps, dtype=np.int64, mode="r+", shape=(self.slots,)
                ).view(np.ndarray)
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
        self._stamps = None
        self._abandoned = []
        self._records = {}
        self._thread_lock = threading.Lock()
        self._open()

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        self._marks = None
        self._inflight = None
        self._stamps = None
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

    @staticmethod
    def _bump_epoch(fd) -> int:
        epoch = struct.unpack(_FMT, os.pread(fd, _SIZE, _SIZE))[0] + 1
        os.pwrite(fd, struct.pack(_FMT, epoch), _SIZE)
        return epoch

    @property
    def stamps(self):
        """int64 ``[slots]``: the row stamps (see the module docstring), or None."""
        return self._stamps

    def reserve(self, n: int) -> int:
        """Reserve ``n`` consecutive slots; returns the count before them (the first slot)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"SharedCursor.reserve: n must be an int >= 0, got {n!r}.")
        n = int(n)
        deadline = None
        while True:
            with self._locked(fcntl.LOCK_EX) as fd:
                start = self._reserve(fd, n)
            if start is not None:
                return start
            # a slot of this reservation is still being written by a live writer that
            # reserved it a whole ring ago: wait for it (bounded), never write over it
            now = time.monotonic()
            deadline = now + self.overrun_wait_s if deadline is None else deadline
            if now > deadline:
                raise RuntimeError(
                    _OVERRUN.format(path=self.path, slots=self.slots, wait=self.overrun_wait_s)
                )
            time.sleep(0.0005)

    def _reserve(self, fd, n: int):
        """``reserve`` under the lock: the first item, or None when a slot is busy."""
        start = self._read(fd)
        if self._inflight is None or not n:
            os.pwrite(fd, struct.pack(_FMT, start + n), 0)
            return start
        rows = self._inflight
        used = np.flatnonzero(rows[:, 2])
        # a record at or past the count: its writer died before counting it (it wrote no
        # data); every live record starts below the count
        rows[used[rows[used, 0] >= start]] = 0
        runs = self._runs(start, n)
        stamps = self._stamps
        odd = any((stamps[sl] & 1).any() for sl, _ in runs)
        if odd:
            at = np.concatenate([np.arange(sl.start, sl.stop) for sl, _ in runs])
            owners = (stamps[at][(stamps[at] & 1) == 1] - 1) // 2  # items being written there
            live = np.flatnonzero(rows[:, 2] != 0)
            for r in live:
                first, k, pid = (int(v) for v in rows[r])
                if ((owners >= first) & (owners < first + k)).any():
                    if _alive(pid):
                        return None
                    self._abandon(r)
        free = int(np.argmin(rows[:, 2] != 0))
        if rows[free, 2]:
            raise RuntimeError(
                f"SharedCursor({self.path!r}): more than {_INFLIGHT} "
                "writes in flight at once; keep fewer writers, or commit "
                "each reservation before the next."
            )
        rows[free] = (start, n, os.getpid())  # 1. the record (a death is seen)
        self._records[start] = free
        os.pwrite(fd, struct.pack(_FMT, start + n), 0)  # 2. the count
        if odd:  # a hole is rewritten: readers rescan
            self._bump_epoch(fd)
        for sl, first in runs:  # 3. odd: being written
            stamps[sl] = 2 * np.arange(first, first + sl.stop - sl.start) + 1
        return start

    def _runs(self, start: int, n: int):
        """``[(slot slice, first item)]``: the one or two runs of slots that the items of a
        reservation occupy (its last ``slots`` items)."""
        first, end = max(start, start + n - self.slots), start + n
        p, m = first % self.slots, end - first
        if p + m <= self.slots:
            return [(slice(p, p + m), first)]
        k = self.slots - p
        return [(slice(p, self.slots), first), (slice(0, m - k), first + k)]

    def _items(self, start: int, n: int) -> np.ndarray:
        """The items of a reservation that occupy a slot (its last ``slots``)."""
        return np.arange(max(start, start + n - self.slots), start + n, dtype=np.int64)

    def reserve_positions(self, n: int, capacity: int):
        """Reserve ``n`` items of a ring of ``capacity`` slots.

        Returns ``(positions, keep)``: int64 ``[n]`` ring positions and bool ``[n]``, False for
        items that the same call would overwrite itself (only the last ``capacity`` of a call
        larger than the ring are kept, as the core RoundRobinWriter does). Write
        ``items[keep]`` at ``positions[keep]``.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(
                f"SharedCursor.reserve_positions: capacity must be an int >= 1, got {capacity!r}."
            )
        start = self.reserve(n)
        positions = (start + np.arange(n, dtype=np.int64)) % capacity
        keep = np.arange(n) >= n - capacity
        return positions, keep

    def _need_marks(self, where):
        if self._marks is None:
            raise ValueError(
                f"SharedCursor.{where}: this cursor keeps no commit marks; build it "
                "with SharedCursor(path, slots=ring_size)."
            )

    def commit(self, start: int, n: int) -> None:
        """Mark the items ``[start, start + n)`` (one ``reserve``) as fully written."""
        self._need_marks("commit")
        start, n = int(start), int(n)
        if n <= 0:
            return
        runs = [
            (sl, np.arange(first, first + sl.stop - sl.start)) for sl, first in self._runs(start, n)
        ]  # only the last `slots` items
        with self._locked(fcntl.LOCK_EX):
            stamps, marks = self._stamps, self._marks
            for sl, items in runs:
                odd = 2 * items + 1
                mine = stamps[sl] == odd  # not reserved again since (a dead writer's slot)
                # 1. even: committed
                stamps[sl] = odd + 1 if mine.all() else np.where(mine, odd + 1, stamps[sl])
                # 2. max: a late commit of an older item never hides a newer one in its slot
                np.maximum(marks[sl], items, out=marks[sl])
            rows = self._inflight
            row = self._records.pop(start, None)  # 3. no longer in flight
            if row is not None and rows[row, 0] == start and rows[row, 2] == os.getpid():
                rows[row] = 0
            else:
                used = np.flatnonzero(rows[:, 2])
                rows[used[rows[used, 0] == start]] = 0

    def committed(self, since: int, until: int | None = None) -> int:
        """The first item in ``[since, until)`` not yet committed, or ``until`` when all are
        (``until`` defaults to :meth:`count`). Reservations of writers that died are abandoned
        on the way (see the module docstring)."""
        self._need_marks("committed")
        with self._locked(fcntl.LOCK_EX) as fd:
            return self._committed(fd, since, until)

    def _committed(self, fd, since, until) -> int:
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
        hit = np.flatnonzero(
            (rows[:, 2] != 0) & (rows[:, 0] <= item) & (item < rows[:, 0] + rows[:, 1])
        )
        if not hit.size or _alive(int(rows[hit[0], 2])):
            return False
        self._abandon(hit[0])
        return True

    def _abandon(self, row: int) -> None:
        """Abandon the in-flight record ``row`` (lock held; its writer is dead). Its slots keep
        their odd stamps: they are holes, in every process, until rewritten."""
        start, n = int(self._inflight[row, 0]), int(self._inflight[row, 1])
        self._bump_epoch(self._fd)  # 1. readers rescan the stamps for holes
        items = self._items(start, n)
        pos = items % self.slots
        self._marks[pos] = np.maximum(self._marks[pos], items)  # 2. counts as written
        self._inflight[row] = 0  # 3. gone (a death before this abandons it again)
        self._abandoned.append((start, n))

    def snapshot(self, since: int, epoch: int | None = None):
        """One locked look at the ring for a reader: ``(committed, count, epoch, busy,
        holes)``. ``committed``: as :meth:`committed` ``(since)``; ``count``: items reserved;
        ``busy``: int64 slots being written now (odd stamps of live reservations); ``holes``:
        int64 slots a dead writer left (odd stamps outside ``busy``), rescanned only when the
        epoch differs from ``epoch`` (else None: the caller's copy is current). Dead writers'
        reservations are abandoned on the way."""
        self._need_marks("snapshot")
        with self._locked(fcntl.LOCK_EX) as fd:
            rows = self._inflight
            live = np.flatnonzero(rows[:, 2])
            for row in live:
                if not _alive(int(rows[row, 2])):
                    self._abandon(row)
            done = self._committed(fd, since, None)
            count, now = struct.unpack(_HEAD, os.pread(fd, _HEAD_SIZE, 0))
            live = np.flatnonzero(rows[:, 2]) if live.size else live
            if live.size:
                items = np.concatenate(
                    [self._items(int(rows[r, 0]), int(rows[r, 1])) for r in live]
                )
                busy = np.unique(items % self.slots)
                busy = busy[(self._stamps[busy] & 1) == 1]
            else:
                busy = np.zeros(0, np.int64)
            holes = None
            if now != epoch:
                holes = np.flatnonzero(self._stamps & 1)
                holes = holes[~np.isin(holes, busy)]
        return done, count, now, busy, holes

    def slots_of(self, start: int, n: int) -> np.ndarray:
        """int64 slots that the reservation ``(start, n)`` occupies (its last ``slots``)."""
        return self._items(int(start), int(n)) % self.slots

    def take_abandoned(self) -> list:
        """``[(start, n)]``: the reservations this object abandoned since the last call."""
        out, self._abandoned = self._abandoned, []
        return out

    def size(self, capacity: int) -> int:
        """Items stored in a ring of ``capacity`` slots: ``min(count(), capacity)``."""
        return min(self.count(), capacity)

    def peek_head(self) -> tuple:
        """``(count, epoch)`` without the lock (as :meth:`peek`)."""
        return struct.unpack(_HEAD, os.pread(self._fileno(), _HEAD_SIZE, 0))

    def peek(self) -> int:
        """:meth:`count` without the lock: an aligned 8-byte read, never torn on the platforms
        flock exists on; a caller that finds it changed takes the locked path."""
        return struct.unpack(_FMT, os.pread(self._fileno(), _SIZE, 0))[0]

    def revision(self) -> int:
        """Writes to the storage so far, by every process (its mutation revision): an aligned
        8-byte read without the lock, as :meth:`peek`."""
        return struct.unpack(_FMT, os.pread(self._fileno(), _SIZE, _REVISION_AT))[0]

    def bump_revision(self) -> int:
        """Count one more write (by any process); returns the new revision."""
        with self._locked(fcntl.LOCK_EX) as fd:
            value = struct.unpack(_FMT, os.pread(fd, _SIZE, _REVISION_AT))[0] + 1
            os.pwrite(fd, struct.pack(_FMT, value), _REVISION_AT)
        return value

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
                self._bump_epoch(fd)
                slot = np.arange(self.slots, dtype=np.int64)
                # newest item < value in each slot, -1 when there is none
                newest = value - 1 - (value - 1 - slot) % self.slots
                self._marks[:] = np.where(slot < value, newest, -1)
                self._stamps[:] = _committed_stamps(value, self.slots)
                self._inflight[:] = 0

    def __repr__(self):
        return f"SharedCursor({self.path!r}, slots={self.slots})"
