"""Reading and writing a buffer's stored items in place: ``rb[index]`` and ``rb[index] =
value`` (``rb[i, j]`` over the items seen as ``rb[:]``, TorchRL's view; a key or keys: the
entries of every item), and, in storage order, TorchRL's ``read_all_in_order``, ``write_all``,
``set_``, ``set_at_`` and ``update_``.

These are methods of :class:`~functional_rb.adapters.ReplayBuffer`, bound by name in its class
body; all but ``rb[...]`` itself go through ``rb[...]``, ``storage`` and ``lock``.
"""

from __future__ import annotations

import torch
from tensordict import is_tensor_collection

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.samplers.base import unravel

__all__ = [
    "getitem",
    "read_all_in_order",
    "set_",
    "set_at_",
    "setitem",
    "update_",
    "write_all",
]


def _storage_index(self, index):
    if self.dim_extend > 0:
        return (slice(None),) * self.dim_extend + (index,)
    return index


def _by_keys(index) -> bool:
    return isinstance(index, str) or (
        isinstance(index, tuple) and bool(index) and all(isinstance(k, str) for k in index)
    )


def getitem(self, index):
    """``rb[index]``: the items at ``index`` (storage order), collated and transformed."""
    if _by_keys(index):
        return self[:][index]
    if isinstance(index, tuple):
        return self[index[0]] if len(index) == 1 else self[:][index]
    with self.lock:
        data = self.storage[_storage_index(self, D.as_long_index(index))]
    if self.dim_extend > 0:
        data = D.transpose(data, self.dim_extend)
    if not isinstance(index, int):
        data = self._collate_fn(data)
    if len(self.transform):
        data = self.transform(data)
    return data


def setitem(self, index, value) -> None:
    """``rb[index] = value``, the inverse transforms applied first."""
    if _by_keys(index):
        self[:][index] = value  # writes through the storage's view
        self.storage.touched()
        return
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if len(self.transform):
        value = self.transform.inv(value)
    if isinstance(index, tuple):
        with self.lock:
            return _set_multi(self.storage, self.dim_extend, index, value, type(self).__name__)
    if self.dim_extend > 0:
        value = D.transpose(value, self.dim_extend)
    with self.lock:
        self.storage[_storage_index(self, D.as_long_index(index))] = value


def read_all_in_order(self, end: int | None = None):
    """The stored items in storage order (``rb[:end]``)."""
    return self[:] if end is None else self[:end]


def write_all(self, data, end: int | None = None) -> None:
    """Write ``data`` back in storage order (``rb[:end] = data``)."""
    if end is None:
        if len(self) == self.storage.max_size:
            self[:] = data
            return
        end = data.shape[0] if is_tensor_collection(data) else len(data)
    self[:end] = data


def _edit_all(self, edit):
    with self.lock:
        edit(self.storage[:])
        self.storage.touched()
    return self


def set_at_(self, key, value, index):
    """Set entry ``key`` of the items at ``index`` in place."""
    return _edit_all(self, lambda td: td.set_at_(key, value, D.as_long_index(index)))


def set_(self, key, value):
    """Set entry ``key`` of every stored item in place."""
    return _edit_all(self, lambda td: td.set_(key, value))


def update_(self, input_dict_or_td, clone: bool = False, *, keys_to_update=None):
    """Update the stored items in place from a dict or TensorDict."""
    return _edit_all(
        self, lambda td: td.update_(input_dict_or_td, clone=clone, keys_to_update=keys_to_update)
    )


def _set_multi(storage, dim_extend: int, index: tuple, value, name: str) -> None:
    """``rb[i, j] = value`` over the stored items seen as ``rb[:]`` (TorchRL's view), the
    value broadcast to the selection; the caller holds the buffer's lock."""
    shape = storage.shape
    if shape is None:
        raise RuntimeError(f"{name}[{index!r}] = ...: the storage is empty.")
    grid = torch.arange(shape.numel()).reshape(shape)
    flat = D.transpose(grid, dim_extend)[index]
    if is_tensor_collection(value) and tuple(value.batch_size) != tuple(flat.shape):
        value = value.expand(flat.shape)
    elif not is_tensor_collection(value) and tuple(value.shape[: flat.ndim]) != tuple(flat.shape):
        raise ValueError(
            f"{name}[{index!r}] = value: the selection has "
            f"shape {tuple(flat.shape)}, the value {tuple(value.shape)}; give a "
            "value whose leading dims match it (or a TensorDict to broadcast)."
        )
    value = (
        value.reshape(-1)
        if is_tensor_collection(value)
        else value.reshape(-1, *value.shape[flat.ndim :])
    )
    storage[unravel(flat.reshape(-1), shape)] = value
