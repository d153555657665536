"""Storages under TorchRL's names: where the data lives, in torch.

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
(``reserve`` / ``commit`` / ``committed``). Only :class:`LazyMemmapStorage` does; every other
storage belongs to the process that holds it.
"""
from __future__ import annotations

from typing import Any

import torch

from functional_rb.adapters import _data as D
from functional_rb.adapters.checkpointers import (StorageCheckpointerBase,
                                                  TensorStorageCheckpointer)

__all__ = ["Storage", "TensorStorage", "LazyTensorStorage", "LazyMemmapStorage", "ListStorage",
           "LazyStackStorage", "CompressedListStorage", "StoreStorage", "StorageEnsemble"]

_EMPTY_GET = "Cannot get elements out of a non-initialized storage."


class Storage:
    """Base of the storages: TorchRL's ``Storage`` protocol.

    Subclasses implement ``set``, ``get``, ``__len__``, ``state_dict``, ``load_state_dict``,
    ``_empty`` and ``contains``. ``max_size`` is the capacity in elements.
    """

    ndim = 1
    shared_ok = False  # whether processes other than the owner may write (see reserve)
    supports_conditional_update = False  # patch_leaf / validate_patch / apply_patch
    _default_checkpointer = StorageCheckpointerBase

    def __init__(self, max_size: int, checkpointer=None, compilable: bool = False):
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
        return self.get(index)

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
        return None if self.last_cursor is None else \
            (self.next_row() - 1) % self.max_size_along_dim0()

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
        return torch.randint(0, len(self), (batch_size,), generator=generator,
                             device=getattr(self, "device", None))

    @property
    def shape(self):
        return torch.Size([self.max_size])

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
            from functional_rb.adapters import checkpointers
            name = type(value).__name__
            instead = (f"use functional_rb.adapters.checkpointers.{name} (the adapters' classes "
                       "of the same names)" if hasattr(checkpointers, name) else
                       f"{name} is not provided by the adapters; use one of "
                       f"{', '.join(checkpointers.__all__)}")
            raise TypeError(
                f"{type(self).__name__}: checkpointer must be a functional_rb.adapters "
                f"checkpointer (StorageCheckpointerBase subclass), got "
                f"{type(value).__module__}.{name}. TorchRL's checkpointers read TorchRL's "
                f"private attributes: {instead}.")
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


def _lead_numel(data, k: int) -> int:
    """Elements in the first ``k`` dims of ``data`` (a batch's item count)."""
    if isinstance(data, list):
        return len(data)
    shape = data.shape if (D.is_tc(data) or isinstance(data, torch.Tensor)) else \
        D.leaves(data)[0].shape
    return int(torch.Size(shape[:k]).numel())


class TensorStorage(Storage):
    """Data in one TensorDict, tensorclass, tensor or PyTree of tensors with leading dim
    ``max_size`` (``ndim=2``: ``[max_size // n, n]``), as TorchRL's ``TensorStorage``.

    Args:
      storage: the pre-allocated data; the buffer starts full of it. None for the lazy
        subclasses.
      max_size: the capacity; taken from ``storage`` when not given.
      device: where sampled data goes ("auto": the data's device).
      ndim: how many leading dims count as elements (``2``: ``[time, env]``).
    """

    _default_checkpointer = TensorStorageCheckpointer

    def __init__(self, storage, max_size=None, *, device="cpu", ndim: int = 1,
                 compilable: bool = False, checkpointer=None):
        if storage is None and max_size is None:
            raise ValueError("TensorStorage: Expected storage to be non-null: pass the data "
                             "(storage=...) or, for a lazy storage, use "
                             "LazyTensorStorage(max_size).")
        if storage is not None:
            rows = D.batch_len(storage)
            if max_size is not None and max_size != rows:
                raise ValueError(f"TensorStorage: The max-size and the storage shape mismatch: "
                                 f"max_size={max_size} but the storage has {rows} rows along "
                                 "dim 0. Leave max_size out (it is the data's length).")
            max_size = _lead_numel(storage, ndim)
        if int(max_size) < 1:
            raise ValueError(f"{type(self).__name__}: max_size must be >= 1, got {max_size}.")
        if ndim < 1:
            raise ValueError(f"{type(self).__name__}: ndim must be >= 1, got {ndim}.")
        self.ndim = int(ndim)
        super().__init__(max_size, checkpointer=checkpointer, compilable=compilable)
        self._storage = storage
        self._stored_keys = None  # (the data they were read from, its entry keys)
        self.initialized = storage is not None
        self._len = self.max_size if self.initialized else 0
        if device == "auto":
            self.device = D.data_device(storage) if storage is not None else "auto"
        else:
            self.device = torch.device(device)

    # ------------------------------------------------------------------ data
    @property
    def data(self):
        """The whole allocated storage (None before the first write)."""
        return self._storage

    def restore(self, data, length: int) -> None:
        """Install ``data`` (the whole storage, as :attr:`data` gives it) holding ``length``
        elements: what checkpointers and ``load_state_dict`` call."""
        self._storage = data
        self.initialized = data is not None
        self._set_len(length)
        self._bump()

    def _set_len(self, n: int) -> None:
        self._len = int(n)

    def grow_to(self, rows: int) -> None:
        self._set_len(min(max(len(self), rows * self.row_numel()), self.max_size))

    def row_numel(self) -> int:
        """Elements per dim-0 row (1 for ``ndim=1``)."""
        if self.ndim == 1 or not self.initialized:
            return 1
        return int(self.total_shape[1:].numel())

    @property
    def total_shape(self) -> torch.Size:
        """The allocated shape over the ``ndim`` element dims (not how full it is)."""
        if not self.initialized:
            return None
        if D.is_tc(self._storage) or isinstance(self._storage, torch.Tensor):
            return self._storage.shape[:self.ndim]
        return D.leaves(self._storage)[0].shape[:self.ndim]

    @property
    def len_along_dim0(self) -> int:
        return -(len(self) // -self.row_numel())

    def max_size_along_dim0(self, *, single_data=None, batched_data=None) -> int:
        if self.ndim == 1:
            return self.max_size
        if self.initialized:
            return -(self.max_size // -self.row_numel())
        data = single_data if single_data is not None else batched_data
        if data is None:
            raise ValueError(f"{type(self).__name__}: the rows of an uninitialized ndim="
                             f"{self.ndim} storage depend on the data; pass it.")
        shape = (data.shape if (D.is_tc(data) or isinstance(data, torch.Tensor))
                 else D.leaves(data)[0].shape)
        inner = shape[1:self.ndim] if batched_data is not None else shape[:self.ndim - 1]
        return -(self.max_size // -int(torch.Size(inner).numel()))

    _max_size_along_dim0 = max_size_along_dim0

    @property
    def shape(self):
        """The stored shape over the element dims: ``[len_along_dim0, ...]``."""
        total = self.total_shape
        if total is None:
            return None
        return torch.Size([self.len_along_dim0, *total[1:]])

    def random_index(self, batch_size: int, generator=None):
        if self.ndim == 1:
            return super().random_index(batch_size, generator)
        return tuple(torch.randint(d, (batch_size,), generator=generator, device=self.device)
                     for d in self.shape)

    # ------------------------------------------------------------------ write / read
    def _init(self, item) -> None:
        raise RuntimeError(f"{type(self).__name__} must be given its data when built; use "
                           "LazyTensorStorage to allocate at the first write.")

    def _grow(self, cursor, data) -> None:
        """The length after writing ``data`` at ``cursor`` (TorchRL: + its element count,
        capped by the capacity)."""
        k = self.ndim - int(isinstance(cursor, int))
        n = _lead_numel(data, k) if k else 1
        self._set_len(min(len(self) + n, self.max_size))

    def _check_keys(self, data) -> None:
        """TensorDict data must carry every stored key: a missing key would leave the slot's
        old value beside the new item's others (TorchRL writes it silently)."""
        if not (D.is_tc(data) and D.is_tc(self._storage)):
            return
        stored = self._stored_keys
        if stored is None or stored[0] is not self._storage:
            keys = set(self._storage.keys(include_nested=True, leaves_only=True))
            keys.discard("index")
            self._stored_keys = stored = (self._storage, frozenset(keys))
        missing = stored[1].difference(data.keys(include_nested=True, leaves_only=True))
        if missing:
            raise KeyError(f"{type(self).__name__}.set: the data lacks the stored entries "
                           f"{sorted(map(str, missing))} (missing entries would keep the "
                           "previous item's values). Write every entry the storage holds.")

    def set(self, cursor, data, *, set_cursor: bool = True):
        if isinstance(data, list):
            data = D.stack_items(data)
        cursor = D.as_long_index(cursor)
        if not self.initialized:
            self._init(data if isinstance(cursor, int) else D.first(data))
        else:
            self._check_keys(data)
        if set_cursor:
            self.last_cursor = cursor
            self._grow(cursor, data)
        rows = D.batch_len(self._storage)
        if isinstance(cursor, torch.Tensor) and cursor.ndim == 1 and cursor.numel() > rows:
            # a batch longer than the ring overwrites itself: only its last `rows` items stay
            # (torch leaves the winner among duplicate indices unspecified)
            n = cursor.numel()
            cursor, data = cursor[n - rows:], D.index(data, slice(n - rows, None))
        try:
            D.assign(self._storage, cursor, data)
        except RuntimeError as e:
            if "shape mismatch" in str(e) or "must match" in str(e):
                raise ValueError(f"{type(self).__name__}.set: an entry's item shape differs "
                                 f"from the stored one ({e}).") from e
            raise
        self._bump()

    def _stored(self):
        if not self.initialized:
            raise RuntimeError(_EMPTY_GET)
        if self.is_full:
            return self._storage
        return D.index(self._storage, slice(0, self.len_along_dim0))

    def get(self, index):
        if isinstance(index, tuple) and len(index) == 1 and self.ndim == 1:
            index = index[0]
        index = D.as_long_index(index)
        if isinstance(index, torch.Tensor) and index.dtype != torch.bool and index.numel() and \
                self.initialized and index.device.type != "meta" and 0 <= int(index.min()) and \
                int(index.max()) < self.len_along_dim0:
            return D.index(self._storage, index)  # stored rows: no view of the stored part
        return D.index(self._stored(), index)

    def __len__(self) -> int:
        return self._len

    def _empty(self) -> None:
        self._set_len(0)
        self.last_cursor = None
        self._bump()

    def contains(self, item):
        n = self.len_along_dim0
        if isinstance(item, int):
            item = item + n if item < 0 else item
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            flat = item.reshape(-1, *([item.shape[-1]] if self.ndim > 1 and item.ndim > 1
                                      else []))
            shape = self.shape
            if self.ndim > 1 and item.ndim > 1:
                ok = torch.stack([(flat[:, d] >= -s) & (flat[:, d] < s)
                                  for d, s in enumerate(shape)], -1).all(-1)
                return ok.reshape(item.shape[:-1])
            return ((item >= -n) & (item < n))
        raise NotImplementedError(f"contains: type {type(item).__name__} is not supported.")

    # ------------------------------------------------------------------ state_dict
    def state_dict(self) -> dict[str, Any]:
        data = self._storage
        if data is None:
            data = {}
        elif D.is_tc(data):
            data = data.state_dict()
        elif not isinstance(data, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.state_dict: PyTree storages are not "
                            "supported by state_dict (TorchRL's rule); save them with "
                            "dumps/loads.")
        return {"_storage": data, "initialized": self.initialized, "_len": len(self)}

    def load_state_dict(self, state_dict) -> None:
        data = state_dict["_storage"]
        from tensordict import TensorDict
        if isinstance(data, torch.Tensor):
            if isinstance(self._storage, torch.Tensor):
                self._storage.copy_(data)
            elif self._storage is None:
                self._storage = self._adopt(data.clone())
            else:
                raise RuntimeError(f"{type(self).__name__}.load_state_dict: cannot copy a "
                                   f"tensor storage onto a {type(self._storage).__name__}.")
        elif isinstance(data, dict):
            if D.is_tc(self._storage):
                self._storage.load_state_dict(data, strict=False)
            elif self._storage is None:
                self._storage = self._adopt(
                    TensorDict().load_state_dict(data, strict=False).clone()) if data else None
            else:
                raise RuntimeError(f"{type(self).__name__}.load_state_dict: cannot load a "
                                   "TensorDict state onto a PyTree storage; use dumps/loads.")
        else:
            raise TypeError(f"{type(self).__name__}.load_state_dict: unsupported storage "
                            f"state of type {type(data).__name__}.")
        self.initialized = bool(state_dict["initialized"])
        self._set_len(int(state_dict["_len"]))
        self._bump()

    def _adopt(self, data):
        """Loaded data as this storage keeps it (a memmap storage maps it to files)."""
        return data

    # ------------------------------------------------------------------ conditional updates
    supports_conditional_update = True

    def patch_leaf(self, key) -> torch.Tensor:
        """The whole stored tensor of entry ``key`` (for in-place patches)."""
        if not self.initialized:
            raise RuntimeError("Conditional updates require an initialized storage. Write some "
                               "data to the buffer before calling update_if_present.")
        leaf = self._storage.get(key, None) if D.is_tc(self._storage) else None
        if leaf is None:
            raise KeyError(f"Key {key} does not exist in the storage. Conditional patches can "
                           "only target existing tensor fields of a tensordict storage.")
        return leaf

    def validate_patch(self, index: torch.Tensor, patch: dict) -> dict:
        """``patch`` checked (keys exist, dtypes equal, shapes ``[n, *feature]``) and moved
        to the storage's device; raises before anything is written."""
        n_coords = index.shape[-1] if index.ndim > 1 else 1
        n = index.shape[0] if index.ndim > 1 else index.numel()
        out = {}
        for key, value in patch.items():
            leaf = self.patch_leaf(key)
            value = torch.as_tensor(value)
            if value.dtype != leaf.dtype:
                raise ValueError(f"dtype mismatch for patch key {key}: got {value.dtype}, the "
                                 f"storage holds {leaf.dtype}.")
            feature = leaf.shape[n_coords:]
            try:
                value = value.reshape((n, *feature))
            except RuntimeError:
                raise ValueError(f"shape mismatch for patch key {key}: got "
                                 f"{tuple(value.shape)}, expected {n} records with feature "
                                 f"shape {tuple(feature)}.") from None
            out[key] = value.to(leaf.device)
        return out

    def apply_patch(self, index: torch.Tensor, patch: dict) -> None:
        coords = tuple(index.unbind(-1)) if index.ndim > 1 else (index,)
        for key, value in patch.items():
            self.patch_leaf(key)[coords] = value
        self._bump()

    def __repr__(self):
        shape = self.shape if self.initialized else None
        return (f"{type(self).__name__}(shape={shape}, len={len(self)}, "
                f"max_size={self.max_size}, device={self.device})")


class LazyTensorStorage(TensorStorage):
    """A :class:`TensorStorage` allocated at the first write from the first item (TorchRL's
    ``LazyTensorStorage``): ``torch.empty`` of ``[max_size, *item.shape]`` on ``device``, so
    memory is committed by the OS only as items are written.

    ``shared_init=True`` (TorchRL's): any process holding the storage may be the first to
    write, so the data cannot live in one process's memory: the result is a
    :class:`LazyMemmapStorage` over a temporary directory (CPU; another ``device`` is refused
    with a warning), which processes share.
    """

    def __new__(cls, *args, shared_init: bool = False, **kwargs):
        if shared_init and cls is LazyTensorStorage:
            # TorchRL's rule: a storage any process may initialize is backed by memory maps
            from functional_rb.adapters._memmap_storage import LazyMemmapStorage
            return LazyMemmapStorage.shared_in_memory(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, max_size: int, *, device="cpu", ndim: int = 1, compilable: bool = False,
                 consolidated: bool = False, shared_init: bool = False,
                 cleanup_memmap: bool = True, checkpointer=None):
        super().__init__(None, max_size, device=device, ndim=ndim, compilable=compilable,
                         checkpointer=checkpointer)
        self.consolidated = consolidated
        self.shared_init = bool(shared_init)

    def _rows_shape(self, item_shape) -> tuple:
        """``(rows, *item_shape)``; for ``ndim > 1`` the capacity is rounded up to whole rows
        of ``item_shape[:ndim - 1]`` elements, as TorchRL does (``max_size`` changes)."""
        if self.ndim == 1:
            return (self.max_size, *item_shape)
        inner = int(torch.Size(item_shape[:self.ndim - 1]).numel())
        rows = -(self.max_size // -inner)
        self.max_size = rows * inner
        return (rows, *item_shape)

    def _init(self, item) -> None:
        if self.device == "auto":
            self.device = D.data_device(item) or torch.device("cpu")
        if D.is_tc(item):
            out = torch.empty_like(item.to(self.device).expand(self._rows_shape(item.shape)))
            if self.consolidated:
                out = out.consolidate()
        else:
            out = D.tree_map(lambda x: torch.empty(self._rows_shape(torch.as_tensor(x).shape),
                                                   dtype=torch.as_tensor(x).dtype,
                                                   device=self.device), item)
        self._storage = out
        self.initialized = True

    def __getstate__(self):
        import multiprocessing.context as mpc
        if mpc.get_spawning_popen() is not None and not self.shared_ok:
            raise RuntimeError(_UNSHAREABLE.format(name=type(self).__name__))
        return super().__getstate__()

    def adopt_loaded(self, data, path):
        """Storage data for a loaded TensorDict dump (this storage was empty): allocated like
        its first item, then filled."""
        del path
        self._init(data[0] if self.ndim == 1 else data[0])
        self._storage.update_(data)
        return self._storage


_UNSHAREABLE = (
    "Cannot share a storage of type {name} between processes: a {name} cannot be shared between "
    "processes because its data lives in this process's memory, so another process's writes "
    "would never reach it. To fill one buffer from several processes use LazyMemmapStorage "
    "(extend it once in this process first, so its files exist), or build a separate buffer "
    "in each process.")


from functional_rb.adapters._list_storage import (CompressedListStorage,  # noqa: E402
                                                  LazyStackStorage, ListStorage)
from functional_rb.adapters._memmap_storage import LazyMemmapStorage  # noqa: E402
from functional_rb.adapters._store_storage import StoreStorage  # noqa: E402


def __getattr__(name):
    # Its module imports the samplers and writers (which may import this one): bound on use.
    if name == "StorageEnsemble":
        from functional_rb.adapters._ensemble_parts import StorageEnsemble
        return StorageEnsemble
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
