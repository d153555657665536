"""A write cursor shared by several processes: disjoint positions for concurrent extends.

TorchRL lets worker processes extend one ``LazyMemmapStorage``-backed buffer (the storage
files are memory-mapped in every process). For no write to be lost, two workers that extend at
the same time must receive disjoint positions. ``SharedCursor`` provides exactly that: a small
file holding an int64 counter of items ever reserved, updated under an exclusive ``fcntl`` lock::

    cursor = SharedCursor(os.path.join(scratch_dir, "cursor.bin"))   # every process, same path
    start = cursor.reserve(n)                       # int: first of n consecutive reservations
    positions = (start + np.arange(n)) % capacity   # ring positions of these n items
    # or: positions, keep = cursor.reserve_positions(n, capacity)
    ... write the n items at `positions` into the shared memmap files ...
    len_ = cursor.size(capacity)                    # min(cursor.count(), capacity)

Notes:
- ``reserve`` hands out positions; it does not say the data is there yet. A reader that needs
  fully written items only should wait until the workers are done (TorchRL has the same rule).
- When more than ``capacity`` items are reserved concurrently, later reservations overwrite
  earlier ones in ring order, as a single process's round-robin writer would.
- The object pickles as its path, so it can be handed to ``multiprocessing`` workers (fork or
  spawn); each process opens its own file descriptor.
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

_FMT = "<q"  # one little-endian int64: items reserved so far
_SIZE = struct.calcsize(_FMT)


class SharedCursor:
    """An int64 counter in the file ``path``, incremented atomically across processes.

    Args:
      path: the counter file; created holding 0 if missing, reused (continuing its count) if it
        exists.
    """

    def __init__(self, path):
        if fcntl is None:  # pragma: no cover
            raise OSError("SharedCursor needs fcntl (POSIX); on this system share the buffer "
                          "with a single writer process instead.")
        self.path = os.fspath(path)
        self._fd = None
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self._open()

    def _open(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.pwrite(fd, struct.pack(_FMT, 0), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        self._fd = None
        self._thread_lock = threading.Lock()
        self._open()

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def _fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"SharedCursor({self.path!r}) is closed.")
        return self._fd

    def reserve(self, n: int) -> int:
        """Reserve ``n`` consecutive slots; returns the count before them (the first slot)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"SharedCursor.reserve: n must be an int >= 0, got {n!r}.")
        with self._thread_lock:
            fd = self._fileno()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                (start,) = struct.unpack(_FMT, os.pread(fd, _SIZE, 0))
                os.pwrite(fd, struct.pack(_FMT, start + n), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
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

    def size(self, capacity: int) -> int:
        """Items stored in a ring of ``capacity`` slots: ``min(count(), capacity)``."""
        return min(self.count(), capacity)

    def count(self) -> int:
        """Items reserved so far (by every process)."""
        with self._thread_lock:
            fd = self._fileno()
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                (value,) = struct.unpack(_FMT, os.pread(fd, _SIZE, 0))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return value

    def reset(self, value: int = 0) -> None:
        """Set the counter (e.g. after ``loads`` restored a buffer with ``value`` writes)."""
        with self._thread_lock:
            fd = self._fileno()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.pwrite(fd, struct.pack(_FMT, int(value)), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def __repr__(self):
        return f"SharedCursor({self.path!r})"
