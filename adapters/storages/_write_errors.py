"""The errors a storage write raises about the data's structure, in TorchRL's types with its
phrase first (see :mod:`functional_rb.adapters.errors`), then the entry at fault (its leaf
path), what the storage holds there, what came, and the fix."""

from __future__ import annotations

import torch
from tensordict import is_tensor_collection
from torch.utils._pytree import keystr, tree_flatten_with_path

__all__ = ["EntryKeyError", "missing_entries", "shape_mismatch", "key_str"]


class EntryKeyError(KeyError):
    """A ``KeyError`` that prints its message as written (``KeyError`` prints the repr of its
    argument, which escapes every quote of a nested key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def key_str(key) -> str:
    """A TensorDict key as a user writes it: ``"obs"`` or ``("next", "reward")``."""
    return repr(key) if isinstance(key, (str, tuple)) else str(key)


def missing_entries(owner: str, missing) -> EntryKeyError:
    keys = ", ".join(key_str(k) for k in sorted(missing, key=str))
    return EntryKeyError(
        f"{owner}.set: the data lacks the stored entries {keys} (a missing entry would keep "
        "the previous item's values in the slots written). Write every entry the storage "
        "holds, or exclude the entry from every batch, starting with the first one."
    )


def _items(tree, batch_dims: int) -> list:
    """``[(leaf path, item shape)]``: each leaf's shape past its first ``batch_dims`` dims."""
    if is_tensor_collection(tree):
        return [
            (key_str(k), tuple(v.shape[batch_dims:]))
            for k, v in tree.items(include_nested=True, leaves_only=True)
            if isinstance(v, torch.Tensor)
        ]
    if isinstance(tree, torch.Tensor):
        return [("<the stored tensor>", tuple(tree.shape[batch_dims:]))]
    leaves, _ = tree_flatten_with_path(tree)
    return [
        (keystr(p) or "<root>", tuple(v.shape[batch_dims:]))
        for p, v in leaves
        if isinstance(v, torch.Tensor)
    ]


def shape_mismatch(
    owner: str, stored, data, *, ndim: int, batched: bool, error: Exception
) -> Exception:
    """The ``RuntimeError`` of a write whose entries have another item shape than the stored
    ones (TorchRL's torch message first), naming the first such entry; ``error`` itself when
    no entry differs (the failure was something else)."""
    data_dims = ndim if batched else ndim - 1
    held = dict(_items(stored, ndim))
    for path, shape in _items(data, data_dims):
        want = held.get(path)
        if want is not None and want != shape:
            phrase = str(error).rstrip()
            phrase += "" if phrase.endswith(".") else "."
            return RuntimeError(
                f"{phrase} {owner}.set: entry {path}: the storage holds items of shape "
                f"{list(want)} there (set by the first write), this batch's items have shape "
                f"{list(shape)}. Give the entry shape {list(want)} per item, or store data of "
                "the new shape in a new storage."
            )
    return error
