"""Torch data as TorchRL's storages hold it: TensorDicts, tensorclasses, tensors, and PyTrees of
tensors (``torch.utils._pytree``: dicts keep their insertion order and may have non-string keys,
e.g. ``{30: tensor}``; tuples are structure, a top-level list is a list of items).

Every helper takes and returns torch objects: data never goes through JAX on its way in or out
of a storage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, is_tensor_collection
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "batch_len",
    "first",
    "index",
    "assign",
    "stack_items",
    "transpose",
    "is_tc",
    "as_long_index",
    "leaves",
    "tree_map",
    "tree_flatten",
    "tree_unflatten",
    "data_device",
    "expand_leading",
]

is_tc = is_tensor_collection


def leaves(data) -> list:
    """The tensors of ``data`` (a TensorDict's leaves, or a PyTree's)."""
    if is_tc(data):
        return list(data.values(include_nested=True, leaves_only=True))
    return tree_leaves(data)


def batch_len(data) -> int:
    """Items along dim 0: a list's length, else the leading size of the (first) tensor."""
    if isinstance(data, list):
        return len(data)
    if is_tc(data) or isinstance(data, torch.Tensor):
        if not data.shape:
            raise ValueError(
                f"expected a batch (a leading dimension), got a "
                f"{type(data).__name__} with shape {tuple(data.shape)}."
            )
        return int(data.shape[0])
    first_leaf = next(iter(tree_leaves(data)), None)
    if first_leaf is None:
        raise ValueError(f"the data {type(data).__name__} holds no tensor.")
    if isinstance(first_leaf, torch.Tensor):
        return int(first_leaf.shape[0])
    return len(first_leaf)


def index(data, idx):
    """``data[idx]`` for a TensorDict, tensor or PyTree of tensors."""
    if is_tc(data) or isinstance(data, torch.Tensor):
        return data[idx]
    return tree_map(lambda x: x[idx], data)


def first(data):
    return index(data, 0)


def assign(store, idx, data) -> None:
    """``store[idx] = data`` in place (PyTrees leaf by leaf; a lazy stack item by item)."""
    if is_tc(store):
        if isinstance(data, LazyStackedTensorDict) and not isinstance(idx, slice):
            store.update_at_(data, idx)
        else:
            store[idx] = data
        return
    if isinstance(store, torch.Tensor):
        store[idx] = data
        return
    dst, spec = tree_flatten(store)
    src, spec_in = tree_flatten(data)
    if spec != spec_in:
        raise ValueError(f"the data's structure {spec_in} differs from the stored one {spec}.")
    for d, s in zip(dst, src):
        d[idx] = s


def stack_items(items: list):
    """One batch from a list of items (TorchRL's list-as-items rule): tensors and TensorDicts are
    stacked (TensorDicts of different key sets into a lazy stack), PyTrees leaf by leaf."""
    if not items:
        raise ValueError("an empty list holds no item to write.")
    if all(is_tc(x) for x in items):
        try:
            return torch.stack(items)
        except RuntimeError:
            return LazyStackedTensorDict.lazy_stack(list(items))
    if all(isinstance(x, torch.Tensor) for x in items):
        try:
            return torch.stack(items)
        except RuntimeError as e:
            raise RuntimeError(
                f"Stacking the elements of the list resulted in an error ({e})."
                " The items of a list must have the same shape."
            ) from e
    flat = [tree_flatten(x) for x in items]
    spec = flat[0][1]
    try:
        if any(s != spec for _, s in flat):
            raise ValueError("the items have different tree structures")
        cols = zip(*(leaves_ for leaves_, _ in flat))
        return tree_unflatten(
            [torch.stack([torch.as_tensor(v) for v in col]) for col in cols], spec
        )
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(
            f"Stacking the elements of the list resulted in an error ({e}). Storages of "
            "tensors expect every item of a list to have the same structure and shapes; a "
            "list is a list of items: for a batch whose leaves are already stacked, pass a "
            "tuple or a dict."
        ) from e


def stack_or_list(items):
    """A batch from items read out of a list storage, or the list itself when they are not
    tensors (TorchRL's collate for ``ListStorage``)."""
    if not isinstance(items, list):
        return items
    if items and all(is_tc(x) for x in items):
        return LazyStackedTensorDict.maybe_dense_stack(items)
    if items and all(isinstance(x, torch.Tensor) for x in items):
        return torch.stack(items)
    try:
        return stack_items(items) if items else items
    except (ValueError, TypeError, RuntimeError):
        return items


def transpose(data, dim: int):
    """Swap dims 0 and ``dim`` (TorchRL's ``dim_extend``)."""
    if dim == 0:
        return data
    if is_tc(data) or isinstance(data, torch.Tensor):
        return data.transpose(dim, 0)
    return tree_map(lambda x: x.transpose(dim, 0), data)


def expand_leading(x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` ``[*shape[:k]]`` broadcast to ``shape`` by adding trailing dims."""
    return x.reshape(tuple(x.shape) + (1,) * (len(shape) - x.ndim)).expand(shape)


def data_device(data) -> torch.device | None:
    if is_tc(data) or isinstance(data, torch.Tensor):
        return data.device
    first_leaf = next(iter(tree_leaves(data)), None)
    return getattr(first_leaf, "device", None)


def as_long_index(index, device=None) -> Any:
    """An index for torch indexing: ints and slices stay; sequences and arrays become int64
    tensors; tuples are indexed per dimension."""
    if isinstance(index, (int, np.integer)):
        return int(index)
    if isinstance(index, slice) or index is Ellipsis or index is None:
        return index
    if isinstance(index, tuple):
        return tuple(as_long_index(i, device) for i in index)
    if isinstance(index, range):
        index = torch.arange(index.start, index.stop, index.step)
    t = torch.as_tensor(index)
    if t.dtype == torch.bool:
        return t if device is None else t.to(device)
    t = t.long()
    return t if device is None else t.to(device)
