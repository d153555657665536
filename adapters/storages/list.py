"""List storages: any Python objects, one list slot per item (TorchRL's ``ListStorage``,
``LazyStackStorage`` and ``CompressedListStorage``)."""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensor_collection, lazy_stack

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
from functional_rb.adapters.checkpointers.list import (
    CompressedListStorageCheckpointer,
    ListStorageCheckpointer,
)
from functional_rb.adapters.storages.base import _UNSHAREABLE, Storage

_UNBOUNDED = int(torch.iinfo(torch.int64).max)


class ListStorage(Storage):
    """Items in a Python list: tensors, TensorDicts, or any objects (TorchRL's ``ListStorage``).

    Args:
      max_size: capacity in items; None: unbounded (a ring writer then never wraps).
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      device: where stored items are moved (None: left where they are).
      checkpointer: the on-disk format of ``dumps`` / ``loads`` (default
        :class:`~functional_rb.adapters.ListStorageCheckpointer`).

    Example:
        >>> from functional_rb.adapters import ListStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=ListStorage(10), batch_size=2)
        >>> index = rb.extend(["a", {"b": 1}, 3])
        >>> rb[1]
        {'b': 1}
    """

    _default_checkpointer = ListStorageCheckpointer

    def __init__(
        self,
        max_size: int | None = None,
        *,
        compilable: bool = False,
        device: torch.device | str | None = None,
        checkpointer: StorageCheckpointerBase | None = None,
    ):
        if max_size is not None and (isinstance(max_size, bool) or int(max_size) < 1):
            raise ValueError(
                f"{type(self).__name__}: max_size must be a positive int or None, got {max_size!r}."
            )
        super().__init__(
            _UNBOUNDED if max_size is None else max_size,
            checkpointer=checkpointer,
            compilable=compilable,
        )
        self._storage: list = []
        self.device = device
        self.initialized = True

    @staticmethod
    def default_collate(items):
        """TorchRL's ``_stack_anything``: TensorDicts and tensors stacked (TensorDicts of
        different shapes lazily), PyTrees of tensors leaf by leaf; other objects stay a list."""
        return D.stack_or_list(items)

    def _to_device(self, item):
        if self.device is None or not hasattr(item, "to"):
            return item
        return item.to(self.device)

    def set(self, cursor, data, *, set_cursor: bool = True):
        self._check_home("set")
        if isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0:
            cursor = int(cursor)
        if isinstance(cursor, (int, np.integer)):
            self._set_one(int(cursor), data)
        elif isinstance(cursor, slice):
            self._set_slice(cursor, data)
        else:
            cursor = cursor.tolist() if hasattr(cursor, "tolist") else list(cursor)
            items = self._items_of(data)
            if len(items) != len(cursor):
                raise ValueError(
                    f"{type(self).__name__}.set: {len(cursor)} positions for {len(items)} items."
                )
            for c, item in zip(cursor, items):
                self._set_one(int(c), item)
        if set_cursor:
            self.last_cursor = cursor
        self._bump()

    @staticmethod
    def _items_of(data) -> list:
        if isinstance(data, (list, tuple, range, set)):
            return list(data)
        if isinstance(data, (torch.Tensor, np.ndarray)) or is_tensor_collection(data):
            return list(data.unbind(0)) if hasattr(data, "unbind") else list(data)
        raise TypeError(
            f"ListStorage: cannot extend with a {type(data).__name__}; provide a "
            "list, tuple, range, set, array, tensor or TensorDict of items."
        )

    def _set_one(self, cursor: int, item) -> None:
        if cursor > len(self._storage):
            raise RuntimeError(
                f"Cannot append data located more than one item away from the "
                f"storage size: the storage holds {len(self._storage)} items and "
                f"the index of the item to be set is {cursor}."
            )
        if cursor >= self.max_size:
            raise RuntimeError(
                f"Cannot append data to the list storage: maximum capacity is "
                f"{self.max_size} and the index of the item to be set is "
                f"{cursor}."
            )
        item = self._to_device(item)
        if cursor == len(self._storage):
            self._storage.append(self._encode(item))
        else:
            self._storage[cursor] = self._encode(item)

    def _set_slice(self, cursor: slice, data) -> None:
        items = self._items_of(data)
        for c, item in zip(
            range(*cursor.indices(max(len(self._storage), cursor.stop or 0))), items
        ):
            self._set_one(c, item)

    def _encode(self, item):
        return item

    def _decode(self, stored):
        return stored

    def get(self, index):
        if isinstance(index, tuple):
            if len(index) > 1:
                raise RuntimeError(
                    f"{type(self).__name__} can only be indexed with one-length tuples."
                )
            index = index[0]
        if isinstance(index, (int, np.integer)) or (
            isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim == 0
        ):
            return self._decode(self._storage[int(index)])
        if isinstance(index, slice):
            return [self._decode(x) for x in self._storage[index]]
        if isinstance(index, torch.Tensor):
            index = index.cpu()
        if hasattr(index, "tolist"):
            index = index.tolist()
        return [self._decode(self._storage[int(i)]) for i in index]

    def __len__(self) -> int:
        return len(self._storage)

    def _empty(self) -> None:
        self._check_home("empty")
        self._storage = []
        self._bump()

    def contains(self, item):
        n = len(self._storage)
        if isinstance(item, int):
            item = item + n if item < 0 else item
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            return torch.tensor(
                [self.contains(int(i)) for i in item.reshape(-1).tolist()], dtype=torch.bool
            ).reshape(item.shape)
        raise NotImplementedError(f"contains: type {type(item).__name__} is not supported.")

    def state_dict(self) -> dict[str, Any]:
        return {
            "_storage": [x.state_dict() if hasattr(x, "state_dict") else x for x in self._storage]
        }

    def load_state_dict(self, state_dict) -> None:
        self._check_home("load_state_dict")
        items = []
        for x in state_dict["_storage"]:
            if isinstance(x, torch.Tensor):
                items.append(x.clone())
            elif isinstance(x, dict):
                items.append(TensorDict().load_state_dict(x, strict=False).clone())
            else:
                items.append(x)
        self._storage = items
        self._bump()

    def __getstate__(self):
        import multiprocessing.context as mpc

        if mpc.get_spawning_popen() is not None:
            raise RuntimeError(_UNSHAREABLE.format(name=type(self).__name__))
        return super().__getstate__()

    def __repr__(self):
        return f"{type(self).__name__}(len={len(self)}, max_size={self.max_size})"


class LazyStackStorage(ListStorage):
    """A :class:`ListStorage` whose reads come back as one lazily stacked TensorDict
    (TorchRL's ``LazyStackStorage``): items may have different shapes or keys.

    Args:
      max_size: capacity in items; None: unbounded.
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      stack_dim: the dim the items are stacked along.
      device: where stored items are moved (None: left where they are).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import LazyStackStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyStackStorage(10), batch_size=2)
        >>> index = rb.extend([TensorDict({"x": torch.zeros(n)}) for n in (2, 3)])
        >>> rb[0:2].batch_size
        torch.Size([2])
    """

    def __init__(
        self,
        max_size: int | None = None,
        *,
        compilable: bool = False,
        stack_dim: int = 0,
        device: torch.device | str | None = None,
    ):
        super().__init__(max_size, compilable=compilable, device=device)
        self.stack_dim = stack_dim

    default_collate = staticmethod(lambda data: data)

    def get(self, index):
        out = super().get(index)
        if isinstance(out, list):
            dim = self.stack_dim
            if dim < 0:
                dim = out[0].ndim + 1 + dim
            return lazy_stack(list(out), dim)
        return out


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _leaf_or_non_tensor(cls) -> bool:
    """Leaves of a TensorDict, non-tensor entries (``NonTensorData``) included: a compressed
    TensorDict keeps its strings and other objects as they are."""
    return not is_tensor_collection(cls) or issubclass(cls, (NonTensorData, NonTensorStack))


class CompressedListStorage(ListStorage):
    """A :class:`ListStorage` that keeps each tensor compressed (TorchRL's
    ``CompressedListStorage``), e.g. for image observations.

    The default codec is zlib at ``compression_level`` on the CPU; TorchRL's GPU path (nvcomp) is
    not provided. ``compression_fn(tensor) -> uint8 tensor`` and
    ``decompression_fn(uint8 tensor, metadata) -> tensor`` replace it (``metadata`` holds the
    original ``shape``, ``dtype`` and ``device``).

    Args:
      max_size: capacity in items.
      compression_fn: ``tensor -> uint8 tensor`` (default: zlib).
      decompression_fn: ``(uint8 tensor, metadata) -> tensor`` (default: zlib's inverse).
      compression_level: zlib's level, 0 to 9.
      device: where decompressed items are moved.
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import CompressedListStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=CompressedListStorage(10), batch_size=2)
        >>> index = rb.extend(torch.zeros(4, 84, 84, dtype=torch.uint8))
        >>> rb[0].shape
        torch.Size([84, 84])
    """

    _default_checkpointer = CompressedListStorageCheckpointer

    def __init__(
        self,
        max_size: int,
        *,
        compression_fn: Callable | None = None,
        decompression_fn: Callable | None = None,
        compression_level: int = 3,
        device: torch.device | str = "cpu",
        compilable: bool = False,
    ):
        super().__init__(max_size, compilable=compilable, device=device)
        self.compression_level = int(compression_level)
        self.compression_fn = compression_fn or self._zlib_compress
        self.default_collate = lazy_stack
        self.decompression_fn = decompression_fn or self._zlib_decompress

    def _zlib_compress(self, tensor: torch.Tensor) -> torch.Tensor:
        raw = zlib.compress(_to_bytes(tensor), level=self.compression_level)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @staticmethod
    def _zlib_decompress(compressed: torch.Tensor, metadata: dict) -> torch.Tensor:
        raw = bytearray(zlib.decompress(compressed.cpu().numpy().tobytes()))
        dtype = metadata["dtype"]
        view = torch.bfloat16 if dtype == torch.bfloat16 else None
        t = torch.frombuffer(raw, dtype=torch.int16 if view else dtype)
        if view:
            t = t.view(torch.bfloat16)
        return t.reshape(metadata["shape"]).to(metadata["device"])

    @staticmethod
    def _meta(t: torch.Tensor) -> dict:
        return {"type": "tensor", "shape": t.shape, "dtype": t.dtype, "device": t.device}

    def _encode(self, item):
        if isinstance(item, torch.Tensor):
            return self.compression_fn(item), self._meta(item)
        if is_tensor_collection(item):
            fields, meta = {}, {"type": "tensordict", "batch_size": item.batch_size, "fields": {}}
            for key, value in item.items(
                include_nested=True, leaves_only=True, is_leaf=_leaf_or_non_tensor
            ):
                if isinstance(value, torch.Tensor):
                    fields[key] = self.compression_fn(value)
                    meta["fields"][key] = self._meta(value)
                else:
                    fields[key] = value
                    # TorchRL's record of a non-tensor entry: its value in the metadata
                    meta["fields"][key] = {"type": "non_tensor", "value": value}
            return fields, meta
        return item, {"type": "other"}

    def _decode(self, stored):
        data, meta = stored
        if meta["type"] == "tensor":
            return self.decompression_fn(data, meta)
        if meta["type"] == "tensordict":
            out = TensorDict({}, batch_size=meta.get("batch_size", ()))
            for key, m in meta["fields"].items():
                out.set(
                    key,
                    data[key]
                    if m["type"] in ("other", "non_tensor")
                    else self.decompression_fn(data[key], m),
                )
            if "batch_size" not in meta:  # TorchRL's dumps do not record it
                out.auto_batch_size_()
            return out
        return data

    def to_bytestream(self, data_to_bytestream) -> bytes:
        """The bytes of ``data_to_bytestream`` (TorchRL's helper): a tensor's or numpy array's
        raw buffer (C order; bfloat16 as its 16-bit patterns), anything else pickled."""
        if isinstance(data_to_bytestream, torch.Tensor):
            return _to_bytes(data_to_bytestream)
        if isinstance(data_to_bytestream, np.ndarray):
            return data_to_bytestream.tobytes()
        return pickle.dumps(data_to_bytestream)

    def compressed_items(self) -> tuple:
        """``(compressed data, metadata)`` of every stored item, in slot order."""
        return [d for d, _ in self._storage], [m for _, m in self._storage]

    def restore_compressed(self, items: list) -> None:
        """Install ``[(compressed data, metadata)]`` (what :meth:`compressed_items` gave)."""
        self._check_home("restore_compressed")
        self._storage = list(items)
        self._bump()

    def bytes(self) -> int:
        """Bytes held by the compressed tensors."""
        total = 0
        for data, meta in self._storage:
            if meta["type"] == "tensor":
                total += data.numel()
            elif meta["type"] == "tensordict":
                total += sum(v.numel() for k, v in data.items() if isinstance(v, torch.Tensor))
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"_storage": list(self._storage)}

    def load_state_dict(self, state_dict) -> None:
        self._storage = list(state_dict["_storage"])
        self._bump()
