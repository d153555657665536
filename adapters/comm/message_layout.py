"""The layout of a payload: its structure and, per leaf, kind, shape and dtype.

The distributed transport preallocates receive buffers, so both ends must agree on what a
message holds before it is sent. A :class:`MessageLayout` is that agreement: the torch pytree spec of
the value (for a TensorDict it records keys, batch size, names and class) and one
:class:`Leaf` per pytree leaf. Tensors travel as they are; NumPy arrays and Python scalars
travel as tensors and come back as what they were; any other leaf (a string, an object) is a
constant carried by the layout itself, which only replies may hold (a request's layout is
bound once, so a constant in it could not change).

A layout crosses the wire as JSON (:func:`to_wire` / :func:`from_wire`), never pickled: the
containers are named from a fixed list (dict, list, tuple, TensorDict), dtypes from a fixed
table, constants are JSON scalars, and :func:`from_wire` checks every field, the nesting depth,
the number of leaves and the bytes the tensors would take before anything is built or
allocated. A value of any other container, or a constant of any other type, cannot travel:
the sender gets a ``TypeError`` saying so (``transport='ray'`` carries such values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict

from functional_rb.adapters.comm import wire

__all__ = ["MessageLayout", "Leaf", "conform", "flatten", "from_wire", "to_wire", "unflatten"]

_SCALARS = {bool: ("bool", torch.bool), int: ("int", torch.int64), float: ("float", torch.float64)}


@dataclass(frozen=True)
class Leaf:
    path: str
    kind: str  # "tensor" | "numpy" | "bool" | "int" | "float" | "const"
    shape: tuple = ()
    dtype: Any = None  # a torch.dtype for the kinds that travel
    value: Any = None  # the constant itself, for kind "const"

    @property
    def sent(self) -> bool:
        return self.kind != "const"

    def describe(self) -> str:
        if not self.sent:
            return f"{self.path}: constant {self.value!r}"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.path}: {dtype}{list(self.shape)}"


@dataclass(frozen=True)
class MessageLayout:
    spec: Any  # torch.utils._pytree.TreeSpec
    leaves: tuple

    def empty(self, device) -> list[torch.Tensor]:
        """Receive buffers for the leaves that travel."""
        return [
            torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            for leaf in self.leaves
            if leaf.sent
        ]

    def __reduce__(self):
        # (Ray carries bound layouts): as its JSON, so that no class travels by reference
        return from_wire, (to_wire(self),)

    @property
    def nbytes(self) -> int:
        """The bytes of the leaves that travel."""
        # (Python ints: a hostile shape must not wrap around to a small number)
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in self.leaves if leaf.sent)

    def describe(self) -> str:
        batch = "".join(f" {path}={bs}" for path, bs in _batches(self.spec))
        return (
            f"{self.spec.type.__name__}{batch} with "
            f"{', '.join(leaf.describe() for leaf in self.leaves) or 'no leaves'}"
        )


def _children(spec) -> list:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _child_names(spec) -> list[str]:
    context, n = spec.context, len(_children(spec))
    if isinstance(context, dict) and "keys" in context:  # TensorDict and its subclasses
        return [f"[{k!r}]" for k in context["keys"]]
    if spec.type is dict or isinstance(context, list) and len(context) == n:
        return [f"[{k!r}]" for k in context]
    if isinstance(context, type) and hasattr(context, "_fields"):  # a namedtuple
        return [f".{f}" for f in context._fields]
    return [f"[{i}]" for i in range(n)]


def _paths(spec, prefix: str = "") -> list[str]:
    if spec.is_leaf():
        return [prefix or "<value>"]
    out = []
    for name, child in zip(_child_names(spec), _children(spec)):
        out.extend(_paths(child, prefix + name))
    return out


def _batches(spec, prefix: str = ""):
    """(path, batch_size) of every TensorDict node of the spec."""
    context = spec.context
    if isinstance(context, dict) and "batch_size" in context:
        yield f"{prefix}.batch_size" if prefix else "batch_size", list(context["batch_size"])
    if not spec.is_leaf():
        for name, child in zip(_child_names(spec), _children(spec)):
            yield from _batches(child, prefix + name)


def _leaf(path: str, value, strict: bool, where: str) -> tuple[Leaf, torch.Tensor | None]:
    if isinstance(value, torch.Tensor):
        return Leaf(path, "tensor", tuple(value.shape), value.dtype), value.detach()
    if isinstance(value, np.ndarray) and value.dtype != object:
        tensor = torch.from_numpy(np.ascontiguousarray(value))
        return Leaf(path, "numpy", tuple(tensor.shape), tensor.dtype), tensor
    if type(value) in _SCALARS:
        kind, dtype = _SCALARS[type(value)]
        return Leaf(path, kind, (), dtype), torch.tensor(value, dtype=dtype)
    if strict and value is not None:  # (None: an empty request, e.g. stats())
        raise TypeError(
            f"{where}: the distributed transport sends tensors; the leaf {path} is a "
            f"{type(value).__name__} ({value!r:.60}). Send tensor-only data (a TensorDict "
            "without non-tensor entries, a tensor), or use transport='ray', which pickles "
            "anything."
        )
    return Leaf(path, "const", value=value), None


def flatten(value, *, where: str, strict: bool) -> tuple[list[torch.Tensor], MessageLayout]:
    """The tensors of ``value`` to send, in order, and its layout. ``strict``: every leaf
    must travel (requests); otherwise other leaves become constants of the layout."""
    values, spec = pytree.tree_flatten(value)
    context = spec.context if isinstance(spec.context, dict) else {}
    if strict and context.get("non_tensor_data"):
        raise TypeError(
            f"{where}: the distributed transport sends tensors; this TensorDict "
            f"holds non-tensor entries {list(dict(context['non_tensor_data']))}. "
            "Drop them before sending, or use transport='ray'."
        )
    leaves, tensors = [], []
    for path, leaf_value in zip(_paths(spec), values):
        leaf, tensor = _leaf(path, leaf_value, strict, where)
        leaves.append(leaf)
        if tensor is not None:
            tensors.append(tensor)
    return tensors, MessageLayout(spec, tuple(leaves))


def unflatten(tensors: list[torch.Tensor], layout: MessageLayout):
    """The value rebuilt from the received tensors (in :func:`flatten`'s order)."""
    received = iter(tensors)
    values = []
    for leaf in layout.leaves:
        if leaf.kind == "const":
            values.append(leaf.value)
        elif leaf.kind == "tensor":
            values.append(next(received))
        elif leaf.kind == "numpy":
            values.append(next(received).numpy())
        else:
            values.append(next(received).item())
    return pytree.tree_unflatten(values, layout.spec)


def conform(
    bound: MessageLayout, got: MessageLayout, tensors: list[torch.Tensor], *, where: str
) -> list[torch.Tensor]:
    """``tensors`` (flattened with layout ``got``) in the order of ``bound``: the same leaves
    (paths, kinds, shapes, dtypes) and batch sizes, in any key order. ``ValueError`` saying
    what differs otherwise. (Devices and dim names are not compared: the receiver rebuilds
    the value with the bound layout's.)"""
    if bound == got:
        return tensors
    by_path = {leaf.path: leaf for leaf in got.leaves}
    missing = [leaf.path for leaf in bound.leaves if leaf.path not in by_path]
    extra = sorted(set(by_path) - {leaf.path for leaf in bound.leaves})
    if missing or extra:
        raise ValueError(
            f"{where}: keys differ from the bound layout: missing {missing}, unexpected {extra}."
        )
    for leaf in bound.leaves:
        if by_path[leaf.path] != leaf:
            raise ValueError(
                f"{where}: expected {leaf.describe()}, got {by_path[leaf.path].describe()}."
            )
    if dict(_batches(bound.spec)) != dict(_batches(got.spec)):
        raise ValueError(
            f"{where}: batch size differs: expected "
            f"{dict(_batches(bound.spec))}, got {dict(_batches(got.spec))}."
        )
    position, sent = {}, 0
    for leaf in got.leaves:
        if leaf.sent:
            position[leaf.path], sent = sent, sent + 1
    return [tensors[position[leaf.path]] for leaf in bound.leaves if leaf.sent]


# ---------------------------------------------------------------------- on the wire (JSON)
_MAX_DEPTH = 32
_MAX_LEAVES = 100_000
_MAX_DIMS = 32
_MAX_DIM = 1 << 40
_SENT_KINDS = ("tensor", "numpy", "bool", "int", "float")
_CONSTANTS = (type(None), bool, int, float, str)  # exact types: JSON's scalars
_SCALAR_DTYPES = dict(_SCALARS.values())  # "int" -> torch.int64, ...
# what tensordict's unflatten needs beside the keys (its constructor and class)
_TD_CONTEXT = pytree.tree_flatten(TensorDict({}, []))[1].context


def _refuse(path: str, what: str) -> TypeError:
    return TypeError(
        f"{path}: {what} cannot travel over the distributed transport, which "
        "carries tensors, NumPy arrays, numbers, strings and None in dicts "
        "(string keys), lists, tuples and TensorDicts. Use transport='ray', "
        "which carries any picklable value."
    )


def to_wire(layout: MessageLayout) -> dict:
    """``layout`` as JSON-serialisable data; ``TypeError`` naming the leaf or container that
    cannot travel.

    Examples:
      >>> import torch
      >>> from functional_rb.adapters.comm.message_layout import flatten, from_wire, to_wire
      >>> layout = flatten({"obs": torch.zeros(4, 3), "n": 7}, where="demo", strict=False)[1]
      >>> [(leaf["path"], leaf["dtype"], leaf["shape"]) for leaf in to_wire(layout)["leaves"]]
      [("['obs']", 'float32', [4, 3]), ("['n']", 'int64', [])]
      >>> from_wire(to_wire(layout)) == layout
      True
    """
    return {
        "spec": _spec_to_wire(layout.spec, ""),
        "leaves": [_leaf_to_wire(leaf) for leaf in layout.leaves],
    }


def _spec_to_wire(spec, path: str):
    if spec.is_leaf():
        return None
    children = [
        _spec_to_wire(child, path + name)
        for name, child in zip(_child_names(spec), _children(spec))
    ]
    where = path or "<value>"
    if spec.type is dict:
        keys = list(spec.context)
        if not all(type(k) is str for k in keys):
            raise _refuse(where, f"a dict with non-string keys {keys!r:.60}")
        return {"node": "dict", "keys": keys, "children": children}
    if spec.type in (list, tuple):
        return {"node": spec.type.__name__, "children": children}
    if spec.type is TensorDict:
        ctx = spec.context
        if ctx.get("non_tensor_data"):
            keys = [k for k, _ in ctx["non_tensor_data"]]
            raise _refuse(where, f"a TensorDict holding non-tensor entries {keys}")
        names, device = ctx.get("names"), ctx.get("device")
        return {
            "node": "TensorDict",
            "keys": [str(k) for k in ctx["keys"]],
            "batch_size": [int(d) for d in ctx["batch_size"]],
            "names": None if names is None else list(names),
            "device": None if device is None else str(device),
            "children": children,
        }
    raise _refuse(where, f"a {spec.type.__name__}")


def _leaf_to_wire(leaf: Leaf) -> dict:
    if not leaf.sent:
        if type(leaf.value) not in _CONSTANTS:
            raise _refuse(leaf.path, f"a {type(leaf.value).__name__} ({leaf.value!r:.60})")
        return {"path": leaf.path, "kind": "const", "value": leaf.value}
    return {
        "path": leaf.path,
        "kind": leaf.kind,
        "shape": [int(d) for d in leaf.shape],
        "dtype": wire.dtype_name(leaf.dtype),
    }


def from_wire(data) -> MessageLayout:
    """The :class:`MessageLayout` that :func:`to_wire` encoded; :class:`~.wire.ProtocolError` for
    anything else (checked field by field, with bounds on depth, leaves and bytes, before a
    buffer is allocated)."""
    if not isinstance(data, dict):
        raise wire.ProtocolError(f"a layout must be a JSON object, got {type(data).__name__}.")
    described = wire.field(data, "leaves", list, where="layout")
    if len(described) > _MAX_LEAVES:
        raise wire.ProtocolError(
            f"a layout of {len(described)} leaves exceeds the limit of {_MAX_LEAVES}."
        )
    leaves = tuple(_leaf_from_wire(d) for d in described)
    slots = [0]
    spec = _spec_from_wire(data.get("spec"), 0, slots)
    if slots[0] != len(leaves):
        raise wire.ProtocolError(
            f"the layout's tree has {slots[0]} leaves, its leaf list {len(leaves)}."
        )
    layout = MessageLayout(spec, leaves)
    if layout.nbytes > wire.MAX_MESSAGE_BYTES:
        raise wire.ProtocolError(
            f"a layout of {layout.nbytes} bytes exceeds the limit of "
            f"{wire.MAX_MESSAGE_BYTES} bytes per message."
        )
    return layout


def _shape(value) -> tuple:
    if (
        not isinstance(value, list)
        or len(value) > _MAX_DIMS
        or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in value)
    ):
        raise wire.ProtocolError(
            f"a shape must be a list of at most {_MAX_DIMS} ints in "
            f"[0, {_MAX_DIM}], got {value!r:.60}."
        )
    return tuple(value)


def _leaf_from_wire(data) -> Leaf:
    if not isinstance(data, dict):
        raise wire.ProtocolError(f"a leaf must be a JSON object, got {type(data).__name__}.")
    path = wire.field(data, "path", str, where="leaf")
    kind = data.get("kind")
    if kind == "const":
        value = data.get("value")
        if type(value) not in _CONSTANTS:
            raise wire.ProtocolError(f"leaf {path:.60}: a constant must be a JSON scalar.")
        return Leaf(path, "const", value=value)
    if kind not in _SENT_KINDS:
        raise wire.ProtocolError(f"leaf {path:.60}: unknown kind {kind!r:.40}.")
    shape, dtype = _shape(data.get("shape")), wire.dtype_from_name(data.get("dtype"))
    scalar = _SCALAR_DTYPES.get(kind)
    if scalar is not None and (shape != () or dtype != scalar):
        raise wire.ProtocolError(
            f"leaf {path:.60}: a Python {kind} travels as a 0-d {scalar}, not {dtype}{list(shape)}."
        )
    return Leaf(path, kind, shape, dtype)


def _spec_from_wire(node, depth: int, slots: list):
    if node is None:
        slots[0] += 1
        return pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()
    if depth >= _MAX_DEPTH or not isinstance(node, dict):
        raise wire.ProtocolError(
            f"a layout node must be a JSON object nested at most {_MAX_DEPTH} deep."
        )
    kind = node.get("node")
    if kind not in ("dict", "list", "tuple", "TensorDict"):
        raise wire.ProtocolError(
            f"unknown layout node {kind!r:.40}; expected dict, list, tuple or TensorDict."
        )
    children = [
        _spec_from_wire(c, depth + 1, slots)
        for c in wire.field(node, "children", list, where="layout node")
    ]
    if kind in ("list", "tuple"):
        return pytree.TreeSpec(list if kind == "list" else tuple, None, children)
    keys = wire.field(node, "keys", list, where="layout node")
    if len(keys) != len(children) or not all(type(k) is str for k in keys):
        raise wire.ProtocolError(f"a {kind!r:.20} node needs one string key per child.")
    if kind == "dict":
        return pytree.TreeSpec(dict, keys, children)
    return pytree.TreeSpec(TensorDict, _td_context(node, keys), children)


def _td_context(node: dict, keys: list) -> dict:
    batch = _shape(node.get("batch_size"))
    names, device = node.get("names"), node.get("device")
    if names is not None and not (
        isinstance(names, list)
        and len(names) == len(batch)
        and all(n is None or type(n) is str for n in names)
    ):
        raise wire.ProtocolError(
            "a TensorDict's names must be null or one name per batch dimension."
        )
    try:
        device = None if device is None else torch.device(wire.field(node, "device", str))
    except RuntimeError:
        raise wire.ProtocolError(f"not a device: {device!r:.40}.") from None
    return dict(
        _TD_CONTEXT,
        keys=keys,
        batch_size=torch.Size(batch),
        names=names,
        device=device,
        non_tensor_data=(),
    )
