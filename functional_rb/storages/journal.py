"""The commit record of a :class:`~functional_rb.MemmapStorage` directory (NumPy only).

A directory holds, per leaf, a data file ``[C, *item]`` and an undo file of the same shape,
and one journal, ``journal.npy`` (int64 ``[8 + 3 C]``):

- ``header`` ``[8]``: magic, format version, ``committed`` (the write count at the last
  checkpoint), ``current`` (writes completed), ``n_undo`` (undo entries in use), capacity;
- ``stamps`` ``[C]``: per slot, the number of the write that last completed there (0: never
  written, or rolled back);
- ``undo`` ``[C, 2]``: per undo entry ``i < n_undo``, the slot and its stamp before the
  write; the slot's old row is row ``i`` of each undo file.

A write of rows at slots ``P`` is numbered ``w = current + 1`` and runs, in this order:
(1) the old rows of the slots of ``P`` that hold committed items (``0 < stamp <= committed``),
never saved since the checkpoint, are copied to the undo files and listed, then ``n_undo``
grows to cover them; (2) the new rows are written; (3) ``stamps[P] = w``; (4) ``current = w``.
Large writes run steps (1)-(3) per chunk of rows, each chunk's undo entries before its rows.

Rolling back to ``committed`` (:func:`recover`): each undo entry's row and stamp are put back,
every other stamp above ``committed`` becomes 0 (the slot held nothing at the checkpoint),
then ``n_undo = 0`` and ``current = committed``. A process killed at any point of a write
leaves every committed item either untouched or listed in the undo entries, so rolling back
gives exactly the checkpoint's items; rolling back is idempotent, so a process killed while
rolling back is rolled back again by the next one. Each slot is saved at most once per
checkpoint interval (its stamp then exceeds ``committed``), so ``C`` undo rows always suffice.

Stores to a shared mapping reach the page cache in program order and survive the death of the
process, so no fsync is needed for a killed process; ``flush`` makes the files durable (the
checkpoint calls it). A machine that loses its page cache (power loss) between two
checkpoints may lose writes in any order: the checkpoint itself (``frb.checkpoint``-style,
atomic and fsynced) stays readable, the rows rolled back to may not be.
"""

from __future__ import annotations

import os

import numpy as np

JOURNAL = "journal.npy"
_MAGIC = 0x6A726E6C66726200  # "frbjrnl" as an int64
_VERSION = 1
_MAGIC_I, _VERSION_I, _COMMITTED, _CURRENT, _N_UNDO, _CAPACITY = range(6)
_HEADER = 8
_CHUNK_BYTES = 1 << 26  # rows copied per step: bounded temporaries for any write size


def create(directory: str, capacity: int) -> np.memmap:
    """A fresh journal (nothing written, nothing committed) at ``directory/journal.npy``."""
    j = np.lib.format.open_memmap(
        os.path.join(directory, JOURNAL), mode="w+", dtype=np.int64, shape=(_HEADER + 3 * capacity,)
    )
    j[_MAGIC_I], j[_VERSION_I], j[_CAPACITY] = _MAGIC, _VERSION, capacity
    j.flush()
    return j


def map_npy(path: str, shape: tuple, dtype) -> tuple[np.memmap | None, str]:
    """``(writable memory map, "")`` of the ``.npy`` file ``path`` holding ``dtype[shape]``,
    or ``(None, what is wrong)``. The file's size is checked first: NumPy maps a truncated
    file without complaint, and reading past its end kills the process (SIGBUS)."""
    dtype = np.dtype(dtype)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = (
                np.lib.format.read_array_header_1_0(f)
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0(f)
            )
            offset = f.tell()
        size = os.path.getsize(path)
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, ValueError) as e:
        return None, f"is not a .npy file ({e})"
    got_shape, fortran, got_dtype = header
    if tuple(got_shape) != tuple(shape) or got_dtype != dtype or fortran:
        return None, (f"holds {got_dtype}{list(got_shape)}, expected {dtype.name}{list(shape)}")
    want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != want:
        return None, f"has {size} bytes, expected {want} for {dtype.name}{list(shape)}"
    return np.load(path, mmap_mode="r+"), ""


def open_journal(directory: str, capacity: int) -> tuple[np.memmap | None, str]:
    """``(journal, "")``, or ``(None, what is wrong)`` when the file is not a journal for
    ``capacity`` slots."""
    want = (_HEADER + 3 * capacity,)
    j, problem = map_npy(os.path.join(directory, JOURNAL), want, np.int64)
    if j is None:
        return None, problem
    if j[_MAGIC_I] != _MAGIC or j[_VERSION_I] != _VERSION or j[_CAPACITY] != capacity:
        return None, "has a damaged header"
    return j, ""


def _parts(j: np.memmap):
    capacity = int(j[_CAPACITY])
    stamps = j[_HEADER : _HEADER + capacity]
    undo = j[_HEADER + capacity :].reshape(capacity, 2)
    return stamps, undo


def current(j: np.ndarray) -> int:
    return int(j[_CURRENT])


def committed(j: np.memmap) -> int:
    return int(j[_COMMITTED])


def stamps(j: np.memmap) -> np.ndarray:
    """A copy of the per-slot stamps (0: the slot holds no completed write)."""
    return np.array(_parts(j)[0])


def _row_bytes(data: list) -> int:
    return sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in data)


def _chunks(positions: np.ndarray, row_bytes: int):
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, len(positions), step):
        yield slice(start, min(start + step, len(positions)))


def write(j: np.memmap, data: list, undo_files: list, positions: np.ndarray, rows: list) -> int:
    """Write ``rows[k][i]`` to ``data[k][positions[i]]`` for every leaf ``k`` as one journaled
    write (``positions`` unique); returns the new write count."""
    stamps_, undo = _parts(j)
    positions = np.asarray(positions, np.int64).reshape(-1)
    w = int(j[_CURRENT]) + 1
    last = int(j[_COMMITTED])
    for part in _chunks(positions, _row_bytes(data)):
        pos = positions[part]
        old = stamps_[pos]
        keep = pos[(old > 0) & (old <= last)]
        if keep.size:
            base = int(j[_N_UNDO])
            end = base + keep.size
            for a, u in zip(data, undo_files):
                u[base:end] = a[keep]
            undo[base:end, 0] = keep
            undo[base:end, 1] = stamps_[keep]
            j[_N_UNDO] = end  # from here on these rows come back on a roll back
        for a, r in zip(data, rows):
            a[pos] = r[part]
        stamps_[pos] = w
    j[_CURRENT] = w
    return w


def recover(j: np.memmap, data: list, undo_files: list) -> None:
    """Roll back every write after ``committed``; idempotent."""
    stamps_, undo = _parts(j)
    last = int(j[_COMMITTED])
    n = int(j[_N_UNDO])
    for part in _chunks(np.arange(n), _row_bytes(data)):
        slots = undo[part, 0]
        for a, u in zip(data, undo_files):
            a[slots] = u[part]
        stamps_[slots] = undo[part, 1]
    stamps_[stamps_ > last] = 0
    j[_N_UNDO] = 0
    j[_CURRENT] = last


def commit(j: np.memmap, count: int) -> None:
    """Make the writes up to ``count`` (== ``current``) the ones a roll back returns to."""
    j[_N_UNDO] = 0
    j[_COMMITTED] = count
    j.flush()


def adopt(j: np.memmap, saved: int) -> str:
    """Reconcile the journal with the write count ``saved`` recorded by the last saved state
    (before rolling back); returns what is wrong ("" when nothing is).

    A checkpoint saves its state, then commits the journal: a process killed in between
    leaves ``saved == current > committed``, and the saved state is the one to keep.
    """
    c, cur = int(j[_COMMITTED]), int(j[_CURRENT])
    if saved == c:
        return ""
    if saved == cur and saved > c:
        commit(j, saved)
        return ""
    return (
        f"the saved state was taken after write {saved}, but the journal's last checkpoint "
        f"is write {c} (and {cur} writes completed): the state directory does not belong "
        "to these files"
    )
