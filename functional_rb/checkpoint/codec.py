"""How :mod:`functional_rb.checkpoint` describes a state tree in JSON, and compares two trees.

A tree is described node by node: ``None``, dicts (string keys, in sorted order as
``jax.tree_util`` flattens them), lists, tuples, array leaves (their bytes are stored apart,
in flatten order) and dataclasses registered under a stable name
(:mod:`functional_rb._internal.names`; your own with :func:`functional_rb.checkpoint.stable_name`),
with their static fields encoded so that tuples, dicts, tree definitions, dtypes and nested
static dataclasses (an ``ItemSpec``) come back equal. Nothing else is accepted, and decoding
rebuilds registered classes only: no pickle, no other import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import names
from functional_rb._internal.errors import keystr
from functional_rb._internal.item_spec import ItemSpec


@runtime_checkable
class HostBacked(Protocol):
    """A state node whose items live outside its array leaves (e.g. in files).

    ``snapshot_arrays()``: ``{name: numpy array}``, everything needed to rebuild the items
    (C-contiguous; may be memory maps). ``mismatch(other, where)``: why ``other`` (a node of
    the same class from a template, at path ``where``) cannot take this node's items (a
    sentence naming the difference), or None. ``restore_arrays(arrays)``: write the arrays of
    ``snapshot_arrays`` (read-only, possibly memory maps) back into this node's storage;
    returns the node to use from then on.
    """

    def snapshot_arrays(self) -> dict: ...

    def mismatch(self, other, where: str) -> str | None: ...

    def restore_arrays(self, arrays: dict) -> Any: ...


def is_host(x) -> bool:
    return dataclasses.is_dataclass(x) and isinstance(x, HostBacked)


def is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _class_name(cls, where: str) -> str:
    name = names.name_of(cls)
    if name is None:
        raise TypeError(
            f"checkpoint.save: {where} is a {cls.__module__}.{cls.__qualname__}, which has no "
            "stable name: loading rebuilds classes by the name they were registered under, "
            "never by module path. Register yours with the decorator "
            '@functional_rb.checkpoint.stable_name("MyState") (a name you never give another '
            "class), or convert the node to dicts/arrays."
        )
    return name


# ------------------------------------------------------------------------------ encoding
def _encode_static(value, where: str):
    """A static field's value as JSON that keeps tuples, dicts with any keys, tree
    definitions and functional_rb's frozen dataclasses (e.g. an item description)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, np.dtype):
        return {"dtype": value.name}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return {
            type(value).__name__: [_encode_static(v, f"{where}[{i}]") for i, v in enumerate(value)]
        }
    if isinstance(value, dict):
        return {
            "dict": [
                [_encode_static(k, where), _encode_static(v, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    if isinstance(value, jax.tree_util.PyTreeDef):
        stand_ins = jax.tree_util.tree_unflatten(value, [0] * value.num_leaves)
        return {"treedef": encode(stand_ins, [], [], where)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = names.name_of(type(value))
        if name is not None:
            return {
                "static_dataclass": name,
                "fields": {
                    f.name: _encode_static(getattr(value, f.name), f"{where}.{f.name}")
                    for f in dataclasses.fields(value)
                },
            }
    raise TypeError(
        f"checkpoint.save: static field {where}={value!r} cannot be stored (JSON "
        "scalars, tuples, lists, dicts, tree definitions and functional_rb "
        "dataclasses only)."
    )


def _decode_static(enc, where: str):
    if not isinstance(enc, dict):
        return enc
    if "static_dataclass" in enc:
        cls = names.lookup(enc["static_dataclass"], where)
        return cls(**{k: _decode_static(v, where) for k, v in enc["fields"].items()})
    ((kind, body),) = enc.items()
    if kind in ("list", "tuple"):
        out = [_decode_static(v, where) for v in body]
        return out if kind == "list" else tuple(out)
    if kind == "dict":
        return {_decode_static(k, where): _decode_static(v, where) for k, v in body}
    if kind == "dtype":
        return jnp.dtype(body)
    if kind == "treedef":
        return jax.tree_util.tree_structure(decode(body, _StandIns(), [], where))
    raise ValueError(f"{where}: unknown static value {enc!r} in the manifest.")


class _StandIns:
    """Leaves for a decoded tree definition: fresh objects (any non-container is a leaf)."""

    def pop(self, _=0):
        return object()


def encode(node, leaves: list, hosts: list, where: str):
    """JSON description of ``node``; appends its array leaves to ``leaves`` in flatten order
    and its host-backed nodes to ``hosts``."""
    if node is None:
        return {"t": "none"}
    if isinstance(node, dict):
        keys = sorted(node)  # jax flattens dicts in sorted-key order
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"checkpoint.save: dict keys must be strings at {where}, got {keys!r}")
        return {
            "t": "dict",
            "k": keys,
            "c": [encode(node[k], leaves, hosts, f"{where}[{k!r}]") for k in keys],
        }
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        return {
            "t": type(node).__name__,
            "c": [encode(v, leaves, hosts, f"{where}[{i}]") for i, v in enumerate(node)],
        }
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        cls = type(node)
        name = _class_name(cls, where)
        data, static = [], {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.metadata.get("static", False):
                static[f.name] = _encode_static(value, f"{where}.{f.name}")
            else:
                data.append([f.name, encode(value, leaves, hosts, f"{where}.{f.name}")])
        desc: dict[str, Any] = {"t": "dataclass", "cls": name, "data": data, "static": static}
        if is_host(node):
            desc["host"] = len(hosts)
            hosts.append((where, node))
        return desc
    if isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        leaves.append(node)
        return {"t": "leaf"}
    raise TypeError(
        f"checkpoint.save: cannot store {where} of type {type(node).__name__}; a "
        "state holds arrays in dicts, lists, tuples and functional_rb dataclasses."
    )


def decode(desc, leaves, hosts: list, where: str):
    t = desc["t"]
    if t == "none":
        return None
    if t == "leaf":
        return leaves.pop(0)
    if t == "dict":
        return {k: decode(c, leaves, hosts, where) for k, c in zip(desc["k"], desc["c"])}
    if t in ("list", "tuple"):
        out = [decode(c, leaves, hosts, where) for c in desc["c"]]
        return out if t == "list" else tuple(out)
    if t == "dataclass":
        cls = names.lookup(desc["cls"], where)
        kwargs = {name: decode(c, leaves, hosts, where) for name, c in desc["data"]}
        kwargs.update({name: _decode_static(v, where) for name, v in desc["static"].items()})
        # a class whose fields changed since a file was written converts that file's fields
        # in its ``from_saved`` classmethod (the fields as saved; static ones included)
        node = cls.from_saved(**kwargs) if hasattr(cls, "from_saved") else cls(**kwargs)
        if "host" in desc:
            hosts.append(node)
        return node
    raise ValueError(f"{where}: unknown node type {t!r} in the manifest.")


def spec_str(x) -> str:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return f"{jnp.dtype(dtype).name}{list(np.shape(x))}"


def _itemdifference(a, b, where: str) -> str:
    """A sentence naming how two item descriptions (``ItemSpec``-like) differ."""
    sa = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(a.shapes())[0]}
    sb = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(b.shapes())[0]}
    for p in sa:
        if p in sb and (sa[p].shape, sa[p].dtype) != (sb[p].shape, sb[p].dtype):
            return (
                f"the stored item's leaf {where}{p} is {spec_str(sa[p])} in the "
                f"checkpoint, expected {spec_str(sb[p])} from the template (a different "
                "example?)"
            )
    return (
        f"the stored item ({where}) has leaves {sorted(sa)} in the checkpoint, "
        f"{sorted(sb)} in the template (a different example?)"
    )


def _is_node(x) -> bool:
    """A container of the trees ``save`` stores (not a leaf)."""
    return (
        x is None
        or isinstance(x, (dict, list, tuple))
        or (dataclasses.is_dataclass(x) and not isinstance(x, type))
    )


def difference(saved, like, where: str) -> str | None:
    """The first difference between a loaded state and a template, as a sentence."""
    if is_host(saved) or is_host(like):
        if type(saved) is not type(like):
            return (
                f"{where} is a {type(saved).__name__} in the checkpoint, a "
                f"{type(like).__name__} in the template"
            )
        return saved.mismatch(like, where)
    if not (_is_node(saved) or _is_node(like)):
        if tuple(np.shape(saved)) != tuple(np.shape(like)) or spec_str(saved) != spec_str(like):
            return (
                f"leaf {where} is {spec_str(saved)} in the checkpoint, expected "
                f"{spec_str(like)} from the template (a different capacity or example?)"
            )
        return None
    if type(saved) is not type(like):
        return (
            f"{where} is a {type(saved).__name__} in the checkpoint, a "
            f"{type(like).__name__} in the template"
        )
    if saved is None:
        return None
    if isinstance(saved, dict):
        if sorted(saved) != sorted(like):
            return (
                f"{where} has keys only in the checkpoint: "
                f"{sorted(set(saved) - set(like))}, missing from the checkpoint: "
                f"{sorted(set(like) - set(saved))}"
            )
        for k in sorted(saved):
            found = difference(saved[k], like[k], f"{where}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(saved, (list, tuple)):
        if len(saved) != len(like):
            return (
                f"{where} has {len(saved)} entries in the checkpoint, {len(like)} in the template"
            )
        for i, (a, b) in enumerate(zip(saved, like)):
            found = difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    if dataclasses.is_dataclass(saved):  # static fields first: they explain the leaves
        fields = sorted(dataclasses.fields(saved), key=lambda f: not f.metadata.get("static"))
        for f in fields:
            a, b = getattr(saved, f.name), getattr(like, f.name)
            if not f.metadata.get("static", False):
                found = difference(a, b, f"{where}.{f.name}")
            elif a == b:
                found = None
            elif isinstance(a, ItemSpec) and isinstance(b, ItemSpec):
                found = _itemdifference(a, b, f"{where}.{f.name}")
            else:
                found = f"{where}.{f.name} is {a!r} in the checkpoint, {b!r} in the template"
            if found:
                return found
    return None
