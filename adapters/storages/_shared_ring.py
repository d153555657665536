"""A ring shared by processes: the part of a tensor storage that several processes write.

:class:`SharedRing` is a mixin of :class:`~functional_rb.adapters.LazyTensorStorage` (and so of
:class:`~functional_rb.adapters.LazyMemmapStorage`). While the storage belongs to one process
it does nothing (``_cursor`` is None: every method defers to :class:`TensorStorage`). Once the
storage is shared (a ``LazyMemmapStorage`` from its first write; a ``LazyTensorStorage`` when
it is handed to another process, its tensors then in shared memory) it owns one
:class:`~functional_rb.adapters.storages._shared_cursor.SharedCursor` (a counter file with
commit marks and row stamps) from which ring writers :meth:`reserve` disjoint slots, and to
which they :meth:`commit` them once written. :meth:`committed` tells a buffer which steps are
written, so its sampler follows every process's writes in order; the mutation ``revision`` is
counted in the cursor file too, so every process sees every write.

What a reader sees while rows are rewritten (the row stamps, a seqlock per row): a row is
*drawable* when its stamp is even (its last write was committed). A row whose stamp is odd is
being written by a live process, or was left half-written by a dead one (a *hole*); samplers
never draw it (uniform draws redraw, a bounded number of times, then draw among the committed
rows directly; without-replacement skips it; prioritized ones give a dead writer's rows priority
0; slice samplers cut trajectories there). A row a writer starts to overwrite after it was
drawn is caught by :meth:`read_checked` (its stamp changed across the gather): the buffer then
puts another drawn item (or slice) of the same batch in its place, with its index and info, so a
sample never holds a torn row, nor a row of a dead writer; its previous value is gone (the ring
is rewritten in place), so the row is simply not drawn. ``storage.get`` reads rows as they are
(:meth:`read_checked` says which were torn); ``storage[index]`` and ``rb[index]`` reach every
reserved row (a writer reads its own rows back at once) and refuse the rows still in flight.
``len(storage)`` is the rows samplers index (the committed prefix of the ring);
:meth:`committed_len` (and ``len(buffer)``) counts the rows drawable now.

A writer that dies before committing never blocks the others: its reservation is abandoned under
the cursor's lock (by whichever process meets it first) and its rows keep their odd stamps, so
every process treats them as holes until a later write fills them. Nothing but NumPy runs under
the lock, and a storage inherited by ``fork`` makes torch single-threaded in the child before
its first call (OpenMP's thread pool does not survive ``fork``; a parallel torch op in the
child would wait for ever on the parent's threads). Bounds: ``reserve`` waits at most
``SharedCursor.overrun_wait_s`` for a row another live writer still copies a whole ring later
(then raises), and a sample redraws at most ``replay_buffers._processes.REDRAWS`` times (then raises); nothing
waits for a dead process.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.storages._shared_cursor import SharedCursor

__all__ = ["SharedRing"]

_REDRAWS = 4  # uniform draws that fell in a hole are redrawn this often, then drawn directly

_NOTHING_DRAWABLE = (
    "{name}.sample: no stored row is drawable: every row is being written by another process "
    "or was left half-written by a writer that died. Keep the ring larger than what the "
    "writers have in flight, or sample after they commit."
)


def _fork_safe_torch() -> None:
    """In a child forked from a process whose torch may have started OpenMP threads: run torch
    single-threaded (a parallel region would wait on threads the child does not have)."""
    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)


class SharedRing:
    """Cross-process ring bookkeeping over a :class:`TensorStorage` (see the module docstring).
    Subclasses give the cursor file's path (:meth:`_cursor_path`)."""

    _cursor: SharedCursor | None = None
    _shared_base = 0  # steps written before the ring was shared (the sampler knows them)
    _local_revision = 0  # writes counted before sharing (the cursor counts the rest)

    def _ring_init(self) -> None:
        self._cursor = None
        self._pid = os.getpid()  # differs in a forked copy (see _after_fork)
        self._reserved = None  # (start, n) of this process's reservation being written
        self._shared_base = 0
        self._forget_snapshot()
        self._new_holes: list = []

    def _cursor_path(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _open_cursor(self, reset: bool) -> None:
        rows = self.max_size_along_dim0()
        self._cursor = SharedCursor(self._cursor_path(), slots=rows)
        self._forget_snapshot()
        if reset:
            self._cursor.reset(0)

    def _forget_snapshot(self) -> None:
        """Drop this process's copy of the ring's state (the next read takes a new one)."""
        self._prefix = 0  # committed steps seen so far (a cache of _written)
        self._epoch = None  # the cursor's epoch when _dead was scanned
        self._dead = np.zeros(0, np.int64)  # rows dead writers left (odd stamps)
        self._holes = None  # bool [rows]: rows not drawable now (dead or being written)
        self._settled = False  # nothing was in flight at the last snapshot

    def _ring_state(self, state: dict) -> dict:
        """``state`` (a ``__getstate__``) without this process's view of the ring."""
        state.update(
            _reserved=None,
            _prefix=0,
            _epoch=None,
            _dead=np.zeros(0, np.int64),
            _holes=None,
            _settled=False,
            _new_holes=[],
        )
        return state

    # ------------------------------------------------------------------ revision
    @property
    def revision(self) -> int:
        """Writes so far; once shared, by every process (TorchRL's ``_mutation_revision``)."""
        cursor = self._cursor
        return self._local_revision + (0 if cursor is None else cursor.revision())

    @revision.setter
    def revision(self, value: int) -> None:
        self._local_revision = int(value) - (0 if self._cursor is None else self._cursor.revision())

    def _bump(self) -> None:
        if self._cursor is None:
            self._local_revision += 1
        else:
            self._cursor.bump_revision()

    # ------------------------------------------------------------------ length
    def _set_len(self, n: int) -> None:
        if self._cursor is None:
            super()._set_len(n)
        else:
            self._reset_count(-(int(n) // -self.row_numel()))

    def _reset_count(self, steps: int) -> None:
        self._cursor.reset(steps)
        self._shared_base = min(self._shared_base, int(steps))
        self._forget_snapshot()

    def _grow(self, cursor, data) -> None:
        if self._cursor is None:
            return super()._grow(cursor, data)
        if self._reserved is not None:
            return None  # a ring writer's reservation already counts these steps
        steps = 1 if isinstance(cursor, int) else D.batch_len(data)
        start = self._cursor.reserve(steps)  # counted as every process sees it
        self._cursor.commit(start, steps)
        return None

    def _written(self) -> int:
        """Steps of the ring, counted from its first write, that every process has finished
        writing: the committed prefix of the reservations (a step reserved after one still
        being written waits for it, so nothing half-written is ever read)."""
        self._after_fork()
        cur = self._cursor
        head = cur.peek_head()
        if self._settled and head == (self._prefix, self._epoch):
            return self._prefix  # nothing reserved since a quiet snapshot (one pread)
        rows = self.max_size_along_dim0()
        since = max(self._prefix, head[0] - rows)
        done, count, epoch, busy, dead = cur.snapshot(since, self._epoch)
        self._prefix = done
        if dead is not None:
            self._dead, self._epoch = dead, epoch
        for start, n in cur.take_abandoned():  # a dead writer's rows: their priority drops
            self._new_holes.append(torch.from_numpy(cur.slots_of(start, n)))
        odd = np.union1d(busy, self._dead) if self._dead.size else busy
        if odd.size:
            mask = np.zeros(rows, bool)
            mask[odd] = True
            self._holes = torch.from_numpy(mask)
        else:
            self._holes = None
        self._settled = done == count and not busy.size
        return self._prefix

    def __len__(self) -> int:
        if self._cursor is None:
            return super().__len__()
        return min(self._written(), self.max_size_along_dim0()) * self.row_numel()

    def _after_fork(self) -> None:
        """First use in a child that inherited this storage by ``fork``: the parent's OpenMP
        threads are gone, so torch runs single-threaded here (see the module docstring)."""
        if self._pid != os.getpid():
            _fork_safe_torch()
            self._pid = os.getpid()

    def readable_rows(self) -> int:
        """Every row reserved so far, by any process: a writer reads back its own rows at
        once, although rows reserved before them may still be in flight (``__len__`` counts
        only the finished prefix); :meth:`check_readable` refuses the rows in flight."""
        if self._cursor is None:
            return super().readable_rows()
        return min(int(self._cursor.peek_head()[0]), self.max_size_along_dim0())

    def check_readable(self, index) -> None:
        rows = D.as_long_index(index[0] if isinstance(index, tuple) else index)
        if (
            self._cursor is None
            or not isinstance(rows, torch.Tensor)
            or rows.dtype == torch.bool
            or not rows.numel()
        ):
            return
        self._written()  # refreshes which rows are in flight
        if self._holes is None:
            return
        rows = rows.cpu() % self.max_size_along_dim0()
        busy = rows[self._holes[rows]]
        if busy.numel():
            raise RuntimeError(
                f"{type(self).__name__}.get: rows {sorted(set(busy.flatten().tolist()))[:8]} are "
                "being written by another process (or were left half-written by one that died); "
                "read them once their writer has finished (len(storage) counts the rows every "
                "writer has finished)."
            )

    def committed_len(self) -> int:
        """Elements drawable now: the rows of :meth:`__len__` less those being written or left
        by a dead writer."""
        if self._cursor is None:
            return super().committed_len()
        n = min(self._written(), self.max_size_along_dim0())
        if self._holes is not None:
            n -= int(self._holes[:n].sum())
        return n * self.row_numel()

    def next_row(self) -> int:
        if self._cursor is None:
            return super().next_row()
        return self._written() % self.max_size_along_dim0()

    def _empty(self) -> None:
        super()._empty()
        if self._cursor is not None:
            self._reset_count(0)

    def align_count(self, cursor: int) -> None:
        if self._cursor is None:
            return
        rows, held = self.max_size_along_dim0(), self.len_along_dim0
        self._reset_count(held if held < rows else rows + int(cursor) % rows)

    # ------------------------------------------------------------------ cross-process ring
    def reserve(self, n: int):
        if self._cursor is None:
            return None
        self._after_fork()
        start = self._cursor.reserve(n)
        self._reserved = (start, n)
        return start

    def commit(self, start: int, n: int) -> None:
        if self._cursor is not None:
            self._cursor.commit(start, n)
        self._reserved = None

    def holes(self):
        if self._cursor is None:
            return None
        self._written()
        return self._holes

    def new_holes(self) -> list:
        out, self._new_holes = self._new_holes, []
        return out

    def random_index(self, batch_size: int, generator=None):
        index = super().random_index(batch_size, generator)
        holes = self.holes()
        if holes is None:
            return index
        first = (index[0] if isinstance(index, tuple) else index).clone()
        for _ in range(_REDRAWS):  # redraw the draws that fell in a hole
            bad = holes[first]
            if not bool(bad.any()):
                break
            again = super().random_index(int(bad.sum()), generator)
            first[bad] = again[0] if isinstance(again, tuple) else again
        else:  # then draw directly among the rows drawable now
            bad = holes[first]
            if bool(bad.any()):
                ok = (~holes[: self.len_along_dim0]).nonzero().flatten()
                if not ok.numel():
                    raise RuntimeError(_NOTHING_DRAWABLE.format(name=type(self).__name__))
                first[bad] = ok[torch.randint(ok.numel(), (int(bad.sum()),), generator=generator)]
        return (first, *index[1:]) if isinstance(index, tuple) else first

    def read_checked(self, index):
        """``(get(index), torn)``: ``torn`` bool, shaped like the dim-0 rows of ``index``,
        True where the row read was not one whole committed item (a writer was copying it, or
        started to during the read, or died in it), or None when every row was whole."""
        if self._cursor is None:
            return self.get(index), None
        rows = index[0] if isinstance(index, tuple) else torch.as_tensor(index)
        if self.ndim > 1 and not isinstance(index, tuple) and rows.ndim > 1:
            rows = rows[..., 0]
        rows = rows % self.max_size_along_dim0()
        cur = self._cursor
        head = cur.peek_head()
        if self._settled and head == (self._prefix, self._epoch):
            data = self.get(index)
            if cur.peek_head() == head:  # nothing reserved, so nothing written, meanwhile
                bad = None if self._holes is None else self._holes[rows]
                return data, bad if bad is not None and bool(bad.any()) else None
        at = rows.reshape(-1).cpu().numpy()
        before = self._cursor.stamps[at]
        data = self.get(index)
        cur.peek_head()  # (a system call between the gather and the stamps' second read)
        after = self._cursor.stamps[at]
        bad = (before != after) | ((before & 1) == 1) | (before == 0)
        return data, torch.from_numpy(bad).reshape(rows.shape) if bad.any() else None

    def committed(self, since: int):
        """``(since, end)``: the steps written by every process since ``since`` that this
        process's buffer has not been told of (a storage shared after some writes: those
        were told already), or None while the storage belongs to one process."""
        if self._cursor is None:
            return None
        since = max(int(since), self._shared_base)
        return since, max(since, self._written())

    @property
    def reserved(self):
        """Steps reserved so far by every process (written or being written), or None while
        the storage belongs to one process."""
        return None if self._cursor is None else self._cursor.count()
