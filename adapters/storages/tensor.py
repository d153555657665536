"""TorchRL's ``TensorStorage`` and ``LazyTensorStorage``: the data in one TensorDict,
tensorclass, tensor or PyTree of tensors of leading dim ``max_size`` (``ndim=2``: ``[rows, n]``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
from functional_rb.adapters.checkpointers.tensor import TensorStorageCheckpointer
from functional_rb.adapters.storages._hugepages import advise_tensors
from functional_rb.adapters.storages._in_shared_memory import InSharedMemory
from functional_rb.adapters.storages._shared_ring import SharedRing
from functional_rb.adapters.storages._write_errors import missing_entries, shape_mismatch
from functional_rb.adapters.storages.base import Storage

__all__ = ["TensorStorage", "LazyTensorStorage"]


_EMPTY_GET = "Cannot get elements out of a non-initialized storage."


def _lead_numel(data, k: int) -> int:
    """Elements in the first ``k`` dims of ``data`` (a batch's item count)."""
    if isinstance(data, list):
        return len(data)
    shape = (
        data.shape if (D.is_tc(data) or isinstance(data, torch.Tensor)) else D.leaves(data)[0].shape
    )
    return int(torch.Size(shape[:k]).numel())


class TensorStorage(Storage):
    """Data in one TensorDict, tensorclass, tensor or PyTree of tensors with leading dim
    ``max_size`` (``ndim=2``: ``[max_size // n, n]``), as TorchRL's ``TensorStorage``.

    Args:
      storage: the pre-allocated data; the buffer starts full of it. None for the lazy
        subclasses.
      max_size: the capacity; taken from ``storage`` when not given.
      device: where sampled data goes (``"auto"``: the data's device).
      ndim: how many leading dims count as elements (``2``: ``[time, env]``).
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      checkpointer: the on-disk format of ``dumps`` / ``loads`` (default
        :class:`~functional_rb.adapters.TensorStorageCheckpointer`).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import TensorStorage
        >>> storage = TensorStorage(TensorDict({"obs": torch.zeros(4, 2)}, [4]))
        >>> len(storage), storage.get(torch.tensor([0, 1]))["obs"].shape
        (4, torch.Size([2, 2]))
    """

    _default_checkpointer = TensorStorageCheckpointer

    def __init__(
        self,
        storage: Any,
        max_size: int | None = None,
        *,
        device: torch.device | str = "cpu",
        ndim: int = 1,
        compilable: bool = False,
        checkpointer: StorageCheckpointerBase | None = None,
    ):
        if storage is None and max_size is None:
            raise ValueError(
                "TensorStorage: Expected storage to be non-null: pass the data "
                "(storage=...) or, for a lazy storage, use "
                "LazyTensorStorage(max_size)."
            )
        if storage is not None:
            rows = D.batch_len(storage)
            if max_size is not None and max_size != rows:
                raise ValueError(
                    f"TensorStorage: The max-size and the storage shape mismatch: "
                    f"max_size={max_size} but the storage has {rows} rows along "
                    "dim 0. Leave max_size out (it is the data's length)."
                )
            max_size = _lead_numel(storage, ndim)
        if int(max_size) < 1:
            raise ValueError(f"{type(self).__name__}: max_size must be >= 1, got {max_size}.")
        if ndim < 1:
            raise ValueError(f"{type(self).__name__}: ndim must be >= 1, got {ndim}.")
        self.ndim = int(ndim)
        super().__init__(max_size, checkpointer=checkpointer, compilable=compilable)
        self._storage = storage
        if storage is not None:  # random rows of a large buffer: fewer TLB misses on huge pages
            advise_tensors(storage)
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
            return self._storage.shape[: self.ndim]
        return D.leaves(self._storage)[0].shape[: self.ndim]

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
            raise ValueError(
                f"{type(self).__name__}: the rows of an uninitialized ndim="
                f"{self.ndim} storage depend on the data; pass it."
            )
        shape = (
            data.shape
            if (D.is_tc(data) or isinstance(data, torch.Tensor))
            else D.leaves(data)[0].shape
        )
        inner = shape[1 : self.ndim] if batched_data is not None else shape[: self.ndim - 1]
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
        return tuple(
            torch.randint(d, (batch_size,), generator=generator, device=self.device)
            for d in self.shape
        )

    # ------------------------------------------------------------------ write / read
    def _init(self, item) -> None:
        raise RuntimeError(
            f"{type(self).__name__} must be given its data when built; use "
            "LazyTensorStorage to allocate at the first write."
        )

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
            raise missing_entries(type(self).__name__, missing)

    def set(self, cursor, data, *, set_cursor: bool = True):
        self._check_home("set")
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
            cursor, data = cursor[n - rows :], D.index(data, slice(n - rows, None))
        try:
            D.assign(self._storage, cursor, data)
        except RuntimeError as e:  # TorchRL's error (torch's), and the entry at fault
            raise shape_mismatch(
                type(self).__name__,
                self._storage,
                data,
                ndim=self.ndim,
                batched=not isinstance(cursor, int),
                error=e,
            ) from e
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
        if (
            isinstance(index, torch.Tensor)
            and index.dtype != torch.bool
            and index.numel()
            and self.initialized
            and index.device.type != "meta"
            and int(index.min()) >= 0
            and int(index.max()) < self.readable_rows()
        ):
            return D.index(self._storage, index)  # stored rows: no view of the stored part
        return D.index(self._stored(), index)

    def readable_rows(self) -> int:
        """Dim-0 rows that an explicit index may read (the stored ones)."""
        return self.len_along_dim0

    def __len__(self) -> int:
        return self._len

    def _empty(self) -> None:
        self._check_home("empty")
        self._set_len(0)
        self.last_cursor = None
        self._bump()

    def contains(self, item):
        n = self.len_along_dim0
        if isinstance(item, int):
            item = item + n if item < 0 else item
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            flat = item.reshape(-1, *([item.shape[-1]] if self.ndim > 1 and item.ndim > 1 else []))
            shape = self.shape
            if self.ndim > 1 and item.ndim > 1:
                ok = torch.stack(
                    [(flat[:, d] >= -s) & (flat[:, d] < s) for d, s in enumerate(shape)], -1
                ).all(-1)
                return ok.reshape(item.shape[:-1])
            return (item >= -n) & (item < n)
        raise NotImplementedError(f"contains: type {type(item).__name__} is not supported.")

    def flatten(self):
        """A :class:`TensorStorage` of the stored elements with the ``ndim`` element dims
        merged into one (TorchRL's ``flatten``; itself when ``ndim == 1``). It holds the stored
        rows (a view where the data allows) and keeps this storage's device."""
        if self.ndim == 1:
            return self
        if not self.initialized:
            raise RuntimeError("Cannot flatten a non-initialized storage.")
        data, dims = self._stored(), self.ndim - 1
        if D.is_tc(data) or isinstance(data, torch.Tensor):
            flat = data.flatten(0, dims)
        else:
            flat = D.tree_map(lambda x: x.flatten(0, dims), data)
        return TensorStorage(flat, device=self.device)

    # ------------------------------------------------------------------ state_dict
    def state_dict(self) -> dict[str, Any]:
        data = self._storage
        if data is None:
            data = {}
        elif D.is_tc(data):
            data = data.state_dict()
        elif not isinstance(data, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.state_dict: PyTree storages are not "
                "supported by state_dict (TorchRL's rule); save them with "
                "dumps/loads."
            )
        return {"_storage": data, "initialized": self.initialized, "_len": len(self)}

    def load_state_dict(self, state_dict) -> None:
        self._check_home("load_state_dict")
        data = state_dict["_storage"]
        from tensordict import TensorDict

        if isinstance(data, torch.Tensor):
            if isinstance(self._storage, torch.Tensor):
                self._storage.copy_(data)
            elif self._storage is None:
                self._storage = self._adopt(data.clone())
            else:
                raise RuntimeError(
                    f"{type(self).__name__}.load_state_dict: cannot copy a "
                    f"tensor storage onto a {type(self._storage).__name__}."
                )
        elif isinstance(data, dict):
            if D.is_tc(self._storage):
                self._storage.load_state_dict(data, strict=False)
            elif self._storage is None:
                self._storage = (
                    self._adopt(TensorDict().load_state_dict(data, strict=False).clone())
                    if data
                    else None
                )
            else:
                raise RuntimeError(
                    f"{type(self).__name__}.load_state_dict: cannot load a "
                    "TensorDict state onto a PyTree storage; use dumps/loads."
                )
        else:
            raise TypeError(
                f"{type(self).__name__}.load_state_dict: unsupported storage "
                f"state of type {type(data).__name__}."
            )
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
            raise RuntimeError(
                "Conditional updates require an initialized storage. Write some "
                "data to the buffer before calling update_if_present."
            )
        leaf = self._storage.get(key, None) if D.is_tc(self._storage) else None
        if leaf is None:
            raise KeyError(
                f"Key {key} does not exist in the storage. Conditional patches can "
                "only target existing tensor fields of a tensordict storage."
            )
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
                raise ValueError(
                    f"dtype mismatch for patch key {key}: got {value.dtype}, the "
                    f"storage holds {leaf.dtype}."
                )
            feature = leaf.shape[n_coords:]
            try:
                value = value.reshape((n, *feature))
            except RuntimeError:
                raise ValueError(
                    f"shape mismatch for patch key {key}: got "
                    f"{tuple(value.shape)}, expected {n} records with feature "
                    f"shape {tuple(feature)}."
                ) from None
            out[key] = value.to(leaf.device)
        return out

    def apply_patch(self, index: torch.Tensor, patch: dict) -> None:
        self._check_home("apply_patch")
        coords = tuple(index.unbind(-1)) if index.ndim > 1 else (index,)
        for key, value in patch.items():
            self.patch_leaf(key)[coords] = value
        self._bump()

    def __repr__(self):
        shape = self.shape if self.initialized else None
        return (
            f"{type(self).__name__}(shape={shape}, len={len(self)}, "
            f"max_size={self.max_size}, device={self.device})"
        )


class LazyTensorStorage(InSharedMemory, SharedRing, TensorStorage):
    """A :class:`TensorStorage` allocated at the first write from the first item (TorchRL's
    ``LazyTensorStorage``): ``torch.empty`` of ``[max_size, *item.shape]`` on ``device``, so
    memory is committed by the OS only as items are written.

    Shared by processes as TorchRL's is: handed to another process after its first write (a
    ``multiprocessing`` / ``torch.multiprocessing`` Process's argument, a queue, a pipe), its
    tensors move to shared memory (:meth:`share_memory_`) and every process writes to the same
    ring (disjoint slots, the length and the mutation revision counted across processes, as
    for :class:`LazyMemmapStorage`). A child started by ``fork`` shares it when its buffer was
    ``share(True)``-ed before the fork (or after ``storage.share_memory_()``); any other copy
    of it in another process refuses writes, which would never reach this process.

    ``shared_init=True`` (TorchRL's): any process holding the storage may be the first to
    write, so the data cannot live in one process's memory: the result is a
    :class:`LazyMemmapStorage` over a temporary directory (CPU; another ``device`` is refused
    with a warning), which processes share.

    Args:
      max_size: the capacity, in elements.
      device: where the tensors are allocated (``"auto"``: the first item's device).
      ndim: how many leading dims count as elements (``2``: ``[time, env]``).
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      consolidated: store a TensorDict consolidated (one buffer for all its leaves), as
        TorchRL's option.
      shared_init: any process may be the first to write (see above).
      cleanup_memmap: with ``shared_init``, TorchRL's flag to remove the files; accepted (the
        temporary directory is removed with the storage).
      checkpointer: the on-disk format of ``dumps`` / ``loads``.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=8)
        >>> index = rb.extend(torch.randn(10, 3))
        >>> len(rb), rb.sample().shape
        (10, torch.Size([8, 3]))
    """

    # The subclass whose data processes share (LazyMemmapStorage, which names itself with
    # ``class LazyMemmapStorage(LazyTensorStorage, shared_backing=True)``).
    _shared_backing: type | None = None

    def __init_subclass__(cls, shared_backing: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if shared_backing:
            LazyTensorStorage._shared_backing = cls

    def __new__(cls, *args, shared_init: bool = False, **kwargs):
        if shared_init and cls is LazyTensorStorage:
            # TorchRL's rule: a storage any process may initialize is backed by memory maps
            return LazyTensorStorage._shared_backing.shared_in_memory(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        max_size: int,
        *,
        device: torch.device | str = "cpu",
        ndim: int = 1,
        compilable: bool = False,
        consolidated: bool = False,
        shared_init: bool = False,
        cleanup_memmap: bool = True,
        checkpointer: StorageCheckpointerBase | None = None,
    ):
        super().__init__(
            None,
            max_size,
            device=device,
            ndim=ndim,
            compilable=compilable,
            checkpointer=checkpointer,
        )
        self.consolidated = consolidated
        self.shared_init = bool(shared_init)
        self._ring_init()
        self._memory_init()

    def _rows_shape(self, item_shape) -> tuple:
        """``(rows, *item_shape)``; for ``ndim > 1`` the capacity is rounded up to whole rows
        of ``item_shape[:ndim - 1]`` elements, as TorchRL does (``max_size`` changes)."""
        if self.ndim == 1:
            return (self.max_size, *item_shape)
        inner = int(torch.Size(item_shape[: self.ndim - 1]).numel())
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
            out = D.tree_map(
                lambda x: torch.empty(
                    self._rows_shape(torch.as_tensor(x).shape),
                    dtype=torch.as_tensor(x).dtype,
                    device=self.device,
                ),
                item,
            )
        advise_tensors(out, fresh=True)  # huge pages from the first write on (fresh: empty)
        self._storage = out
        self.initialized = True

    # ------------------------------------------------------------------ processes
    @property
    def shares_writes(self) -> bool:
        return self._cursor is not None

    def _for_process(self) -> dict:
        self._before_sending()
        state = self._ring_state(super().__getstate__())
        state["_share_finalizer"] = None  # (only this process removes the cursor's directory)
        return state

    def __getstate__(self):
        # a plain pickle (a copy, deepcopy, a file): this process's view, detached from the
        # other processes (their shared ring is not pickled with the data)
        return self._plain_state(super().__getstate__())

    def _plain_state(self, state: dict) -> dict:
        return self._detached_state(self._ring_state(state))

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pid = os.getpid()

    def adopt_loaded(self, data, path):
        """Storage data for a loaded TensorDict dump (this storage was empty): allocated like
        its first item, then filled."""
        del path
        self._init(data[0] if self.ndim == 1 else data[0])
        self._storage.update_(data)
        return self._storage
