"""Small PyTree utilities shared by the core modules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from functional_rb._internal.errors import describe_structure

Key = str | Sequence[str]


def normalize_key(key: Key) -> tuple:
    """``"a"`` -> ``("a",)``; ``("next", "done")`` stays; used for nested-mapping keys."""
    if isinstance(key, str):
        return (key,)
    key = tuple(key)
    if not key or not all(isinstance(k, str) for k in key):
        raise ValueError(f"a key must be a string or a non-empty tuple of strings, got {key!r}")
    return key


def has_key(tree: Any, key: Key) -> bool:
    node = tree
    for k in normalize_key(key):
        if not isinstance(node, Mapping) or k not in node:
            return False
        node = node[k]
    return True


def get_key(tree: Any, key: Key, *, where: str) -> Any:
    """``tree[k0][k1]...`` for a nested-mapping key; a clear KeyError naming what exists."""
    node = tree
    for i, k in enumerate(normalize_key(key)):
        if not isinstance(node, Mapping) or k not in node:
            raise KeyError(
                f"{where}: key {normalize_key(key)!r} is not in the stored items (missing "
                f"{k!r} at depth {i}). The items have leaves {describe_structure(tree)}. "
                "Pass the key under which that entry is stored, or add it to your items."
            )
        node = node[k]
    return node


def set_key(tree: Mapping, key: Key, value: Any) -> dict:
    """A copy of a nested mapping with ``tree[k0][k1]... = value`` (creates sub-dicts)."""
    key = normalize_key(key)
    out = dict(tree)
    if len(key) == 1:
        out[key[0]] = value
    else:
        out[key[0]] = set_key(tree.get(key[0], {}), key[1:], value)
    return out


def del_key(tree: Mapping, key: tuple) -> dict:
    """A copy of a nested mapping without ``key`` (a tuple of keys); sub-dicts left empty are
    dropped.

    >>> del_key({"a": 1, "next": {"b": 2}}, ("next", "b"))
    {'a': 1}
    """
    out = dict(tree)
    if len(key) == 1:
        del out[key[0]]
    else:
        sub = del_key(tree[key[0]], key[1:])
        if sub:
            out[key[0]] = sub
        else:
            del out[key[0]]
    return out


def flat_items(tree: Mapping, prefix: tuple = ()) -> dict:
    """``{key tuple: leaf}`` of a nested mapping, in iteration order."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flat_items(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def nest(flat: Mapping) -> dict:
    """``{key tuple: leaf}`` -> nested dicts (insertion order kept); inverts :func:`flat_items`."""
    out: dict = {}
    for key, v in flat.items():
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = v
    return out


def loaded(x) -> np.ndarray:
    """A leaf of a loaded checkpoint as one NumPy array: a leaf saved shard by shard
    (``functional_rb.checkpoint``'s split leaves, read when placed) is read whole. For the
    ``from_saved`` conversions of older state layouts.

    >>> loaded([1, 2]).tolist()
    [1, 2]
    """
    return x.whole() if hasattr(x, "whole") else np.asarray(x)


def saved_columns(fields: dict, names: tuple) -> np.ndarray:
    """int32 ``[..., len(names)]``: the loaded arrays ``fields[name]`` (popped, one shape),
    side by side in the last axis: how the ``from_saved`` conversions build one array from
    counters a file kept apart.

    >>> fields = {"cursor": np.int32(3), "filled": np.int32(5)}
    >>> saved_columns(fields, ("cursor", "filled")).tolist(), fields
    ([3, 5], {})
    """
    return np.stack([loaded(fields.pop(k)).astype(np.int32) for k in names], axis=-1)
