"""The storages' base: TorchRL's ``Storage`` protocol, where the data lives, in torch.

A storage stands alone, as TorchRL's do: ``set(cursor, data)``, ``get(index)``, ``len``,
``state_dict`` / ``load_state_dict``, ``dumps`` / ``loads`` (through its checkpointer, which owns
the on-disk format), ``attach(buffer)``. The data stays in torch tensors (or memory-mapped
tensors) exactly as TorchRL keeps it: ``[max_size, ...]`` for ``ndim=1`` and
``[ceil(max_size / n), n, ...]`` (time, then the other batch dims) for ``ndim=2``. Nothing is
copied through JAX on the way in or out; the functional core only keeps, in the samplers and
writers, the bookkeeping it is best at (sum trees, slice records, ranks).

Storages allocate lazily and like TorchRL: ``LazyTensorStorage`` with ``torch.empty`` at the
first write (the OS commits pages as they are written, so a large capacity costs nothing
up front), ``LazyMemmapStorage`` as memory-mapped files.

Cross-process writes: a storage may coordinate the ring positions of several processes
(``reserve`` / ``commit`` / ``committed``): :class:`LazyMemmapStorage` always, and
:class:`LazyTensorStorage` once its tensors are in shared memory (:meth:`share_memory_`, done
when it is handed to another process). Every other storage belongs to the process that built
it: a copy of it in another process (inherited by ``fork``, or sent through a
``multiprocessing`` queue or pipe) refuses writes, which would never reach the original.
"""

from __future__ import annotations

import os
from multiprocessing.reduction import ForkingPickler

import torch

from functional_rb.adapters import checkpointers, errors
from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase

__all__ = ["Storage"]


class Storage:
    """Base of the storages: TorchRL's ``Storage`` protocol.

    Subclasses implement ``set``, ``get``, ``__len__``, ``state_dict``, ``load_state_dict``,
    ``_empty`` and ``contains``.

    Args:
      max_size: the capacity, in elements.
      checkpointer: the on-disk format of ``dumps`` / ``loads`` (default: the class's).
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.

    Example:
        >>> from functional_rb.adapters import LazyTensorStorage, Storage
        >>> isinstance(LazyTensorStorage(10), Storage)
        True
    """

    ndim = 1
    supports_conditional_update = False  # patch_leaf / validate_patch / apply_patch
    _default_checkpointer = StorageCheckpointerBase

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # handed to another process (a spawned Process's arguments, a queue, a pipe): shared
        # when the storage can be, else a copy that knows it is one (see _for_process)
        ForkingPickler.register(cls, _reduce_for_process)

    def __init__(
        self,
        max_size: int,
        checkpointer: StorageCheckpointerBase | None = None,
        compilable: bool = False,
    ):
        self._home_pid = os.getpid()  # the process whose data this is (see _check_home)
        self.max_size = int(max_size)
        self._compilable = compilable
        self._attached: list = []
        self.last_cursor = None
        self.rng: torch.Generator | None = None
        self.revision = 0  # bumped by every write: samplers that cache derived data follow it
        self.slot_generations = None  # a RoundRobinWriter(track_generations=True)'s stamps
        self.checkpointer = checkpointer

    @staticmethod
    def default_collate(data):
        """How a buffer merges what ``get`` returns into a batch (TorchRL's default per
        storage): tensor storages return batches already."""
        return data

    # ------------------------------------------------------------------ protocol
    def set(self, cursor, data, *, set_cursor: bool = True):  # pragma: no cover - abstract
        raise NotImplementedError

    def get(self, index):  # pragma: no cover - abstract
        raise NotImplementedError

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index):
        self.check_readable(index)
        return self.get(index)

    def check_readable(self, index) -> None:
        """Raises if ``storage[index]`` would read a row that cannot be read now (a shared
        ring's rows in flight); ``get`` itself reads what is there, as TorchRL's."""

    def __setitem__(self, index, value):
        """Write without moving the cursor or the length (TorchRL's ``storage[i] = x``)."""
        return self.set(index, value, set_cursor=False)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __contains__(self, item):
        return self.contains(item)

    def attach(self, buffer) -> None:
        """Register an object reading this storage (a buffer): its ``mark_update(index)`` is
        called when items are overwritten in place."""
        if all(b is not buffer for b in self._attached):
            self._attached.append(buffer)

    @property
    def attached(self) -> tuple:
        return tuple(self._attached)

    def mark_update(self, index) -> None:
        """Tell the attached buffers that the items at ``index`` changed."""
        for ent in self._attached:
            ent.mark_update(index)

    def _bump(self) -> None:
        self.revision += 1

    @property
    def _mutation_revision(self) -> int:  # TorchRL's name
        return self.revision

    @property
    def _is_full(self) -> bool:  # TorchRL's name, for TorchRL code given ours
        return self.is_full

    @property
    def _last_cursor_index(self) -> int | None:  # TorchRL's name: the dim-0 row written last
        return (
            None if self.last_cursor is None else (self.next_row() - 1) % self.max_size_along_dim0()
        )

    def touched(self) -> None:
        """The data was changed in place through a view (``rb.set_``, ``rb["key"] = ...``):
        samplers that derive records from it rebuild them."""
        self._bump()

    def empty(self) -> None:
        """Forget every item (TorchRL's ``_empty``)."""
        self._empty()

    def _empty(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def len_along_dim0(self) -> int:
        return len(self)

    def next_row(self) -> int:
        """The dim-0 row after the one written last (where a ring writer goes next)."""
        rows = self.max_size_along_dim0()
        lc = self.last_cursor
        if lc is None:
            return self.len_along_dim0 % rows
        if isinstance(lc, tuple):
            lc = lc[0]
        if isinstance(lc, list):  # a ListStorage's written positions
            if not lc:
                return self.len_along_dim0 % rows
            lc = lc[-1]
        if isinstance(lc, slice):
            last = range(*lc.indices(rows))[-1]
        elif isinstance(lc, torch.Tensor):
            last = int(lc.reshape(-1)[-1])
        else:
            last = int(lc)
        return (last + 1) % rows

    def align_count(self, cursor: int) -> None:
        """A ring writer restored its cursor (loads): storages that count the steps written
        by every process (``reserve``) align their count with it."""
        del cursor

    def grow_to(self, rows: int) -> None:
        """Rows ``[0, rows)`` hold items now (``write_at``): the length covers them."""
        del rows

    # ------------------------------------------------------------------ cross-process rings
    def reserve(self, n: int):
        """Ring positions for ``n`` new steps along dim 0, coordinated across processes:
        returns the number of steps reserved before them (by every process), or None when
        this storage belongs to one process (the writer keeps its own cursor)."""
        del n
        return None

    def commit(self, start: int, n: int) -> None:
        """Mark the steps ``[start, start + n)`` of a :meth:`reserve` as written."""
        del start, n

    def holes(self):
        """bool ``[rows]``: dim-0 rows whose data a writer that died may have torn (never
        drawn), or None when there is none."""
        return None

    def read_checked(self, index):
        """``(get(index), torn)``: ``torn`` marks the rows read while another process was
        writing them (a bool tensor over the dim-0 rows of ``index``), or None when every row
        was whole, as always for a storage of one process."""
        return self.get(index), None

    def committed_len(self) -> int:
        """Elements that can be drawn now (``len`` less the rows other processes are writing
        or left half-written)."""
        return len(self)

    def new_holes(self) -> list:
        """The rows that became holes since the last call (index tensors)."""
        return []

    @property
    def reserved(self):
        """Steps reserved by every process (a storage shared by processes), else None."""
        return None

    def committed(self, since: int):
        """``(since, end)``: the steps written by every process since ``since`` (absolute step
        numbers), or None for a storage of one process."""
        del since
        return None

    # ------------------------------------------------------------------ shape
    @property
    def is_full(self) -> bool:
        return len(self) >= self.max_size

    def max_size_along_dim0(self, *, single_data=None, batched_data=None) -> int:
        del single_data, batched_data
        return self.max_size

    _max_size_along_dim0 = max_size_along_dim0  # TorchRL's name, for TorchRL code given ours

    def random_index(self, batch_size: int, generator=None):
        """Uniform indices of stored elements, drawn with torch as TorchRL does (the same
        generator and seed give the same indices)."""
        return torch.randint(
            0, len(self), (batch_size,), generator=generator, device=getattr(self, "device", None)
        )

    @property
    def shape(self):
        return torch.Size([self.max_size])

    def flatten(self):
        """This storage with its element dims merged into one (TorchRL's ``flatten``): itself
        when ``ndim == 1``; storages with more dims override it."""
        if self.ndim == 1:
            return self
        raise RuntimeError(
            f"storage.flatten is not supported for storages of type {type(self)} when ndim > 1."
        )

    # ------------------------------------------------------------------ persistence
    @property
    def checkpointer(self):
        return self._checkpointer

    @checkpointer.setter
    def checkpointer(self, value) -> None:
        if value is None:
            value = self._default_checkpointer()
        elif isinstance(value, type):
            value = value()
        if not isinstance(value, StorageCheckpointerBase):
            name = type(value).__name__
            instead = (
                f"use functional_rb.adapters.checkpointers.{name} (the adapters' classes "
                "of the same names)"
                if hasattr(checkpointers, name)
                else f"{name} is not provided by the adapters; use one of "
                f"{', '.join(checkpointers.__all__)}"
            )
            raise errors.not_an_adapter(
                type(self).__name__,
                "checkpointer",
                "checkpointer (StorageCheckpointerBase subclass)",
                value,
                fix=f"TorchRL's checkpointers read TorchRL's private attributes: {instead}.",
            )
        self._checkpointer = value

    def register_save_hook(self, hook) -> None:
        """``hook(data, path=path) -> data`` runs on the data before it is written."""
        self._checkpointer.register_save_hook(hook)

    def register_load_hook(self, hook) -> None:
        """``hook(data, out=None) -> data`` runs on the data read back before it is stored."""
        self._checkpointer.register_load_hook(hook)

    def dumps(self, path) -> None:
        self._checkpointer.dumps(self, path)

    def loads(self, path) -> None:
        self._checkpointer.loads(self, path)
        self._bump()

    def save(self, *args, **kwargs):
        return self.dumps(*args, **kwargs)

    dump = save

    def load(self, *args, **kwargs):
        return self.loads(*args, **kwargs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["rng"] = None
        state["_attached"] = []
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._home_pid = os.getpid()  # unpickled (a copy): its data is this process's

    # ------------------------------------------------------------------ processes
    @property
    def shares_writes(self) -> bool:
        """Whether writes made by any process holding this storage reach every other (a
        storage in files or shared memory whose ring is coordinated across processes)."""
        return False

    def _check_home(self, what: str) -> None:
        """Refuse a write to a copy of this storage in another process (inherited by ``fork``
        or sent through a queue or pipe): it would never reach the process that reads it."""
        if torch.compiler.is_compiling():
            return  # (os.getpid cannot be traced: writes inside torch.compile are not checked)
        home = getattr(self, "_home_pid", None)
        if home is not None and home != os.getpid() and not self.shares_writes:
            name = type(self).__name__
            raise RuntimeError(
                _FOREIGN_WRITE.format(
                    name=name, what=what, home=home, pid=os.getpid(), fix=self._share_fix()
                )
            )

    def _share_fix(self) -> str:
        return (
            f"A {type(self).__name__} cannot be shared between processes (its data is "
            "this process's memory): to fill one buffer from several processes use "
            "LazyTensorStorage or LazyMemmapStorage, or build a separate buffer in each "
            "process."
        )

    def _for_process(self) -> dict:
        """The state sent to another process (see :func:`_reduce_for_process`)."""
        return self.__getstate__()


def _reduce_for_process(storage):
    """``ForkingPickler``'s reduction of a storage: the state :meth:`Storage._for_process`
    gives (storages that can be shared are shared first), rebuilt in the other process as a
    copy that remembers the process it came from."""
    return _rebuild_in_process, (type(storage), storage._for_process(), storage._home_pid)


def _rebuild_in_process(cls, state, home):
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    obj._home_pid = home
    return obj


ForkingPickler.register(Storage, _reduce_for_process)

_FOREIGN_WRITE = (
    "{name}.{what}: this {name} is a copy, in process {pid}, of a storage of process {home} "
    "(inherited by fork, or sent through a multiprocessing queue or pipe). Its data is not "
    "shared, so writes made here would never reach process {home}: refusing to lose them. "
    "{fix}"
)


_UNSHAREABLE = (
    "Cannot share a storage of type {name} between processes: a {name} cannot be shared between "
    "processes because its data lives in this process's memory, so another process's writes "
    "would never reach it. To fill one buffer from several processes use LazyTensorStorage or "
    "LazyMemmapStorage (extend it once in this process first) or "
    "LazyTensorStorage(max_size, shared_init=True) (memory maps any process may initialize), "
    "or build a separate buffer in each process."
)
