"""The layout of a payload: its structure and, per leaf, kind, shape and dtype.

The distributed transport preallocates receive buffers, so both ends must agree on what a
message holds before it is sent. A :class:`Layout` is that agreement: the torch pytree spec of
the value (for a TensorDict it records keys, batch size, names and class) and one
:class:`Leaf` per pytree leaf. Tensors travel as they are; NumPy arrays and Python scalars
travel as tensors and come back as what they were; any other leaf (a string, an object) is a
constant carried by the layout itself, which only replies may hold (a request's layout is
bound once, so a constant in it could not change).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

__all__ = ["Layout", "Leaf", "conform", "flatten", "unflatten"]

_SCALARS = {bool: ("bool", torch.bool), int: ("int", torch.int64),
            float: ("float", torch.float64)}


@dataclass(frozen=True)
class Leaf:
    path: str
    kind: str              # "tensor" | "numpy" | "bool" | "int" | "float" | "const"
    shape: tuple = ()
    dtype: Any = None      # a torch.dtype for the kinds that travel
    value: Any = None      # the constant itself, for kind "const"

    @property
    def sent(self) -> bool:
        return self.kind != "const"

    def describe(self) -> str:
        if not self.sent:
            return f"{self.path}: constant {self.value!r}"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.path}: {dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    spec: Any              # torch.utils._pytree.TreeSpec
    leaves: tuple

    def empty(self, device) -> list[torch.Tensor]:
        """Receive buffers for the leaves that travel."""
        return [torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
                for leaf in self.leaves if leaf.sent]

    def __reduce__(self):
        # the spec as plain tuples: unpickling a TreeSpec builds deprecated LeafSpec objects
        return _rebuild, (_encode(self.spec), self.leaves)

    def describe(self) -> str:
        batch = "".join(f" {path}={bs}" for path, bs in _batches(self.spec))
        return (f"{self.spec.type.__name__}{batch} with "
                f"{', '.join(leaf.describe() for leaf in self.leaves) or 'no leaves'}")


def _encode(spec):
    return None if spec.is_leaf() else (spec.type, spec.context,
                                        [_encode(c) for c in _children(spec)])


def _decode(encoded):
    if encoded is None:
        leaf = getattr(pytree, "treespec_leaf", None)
        return leaf() if leaf is not None else pytree.LeafSpec()
    kind, context, children = encoded
    return pytree.TreeSpec(kind, context, [_decode(c) for c in children])


def _rebuild(encoded, leaves) -> "Layout":
    return Layout(_decode(encoded), leaves)


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
            "anything.")
    return Leaf(path, "const", value=value), None


def flatten(value, *, where: str, strict: bool) -> tuple[list[torch.Tensor], Layout]:
    """The tensors of ``value`` to send, in order, and its layout. ``strict``: every leaf
    must travel (requests); otherwise other leaves become constants of the layout."""
    values, spec = pytree.tree_flatten(value)
    context = spec.context if isinstance(spec.context, dict) else {}
    if strict and context.get("non_tensor_data"):
        raise TypeError(f"{where}: the distributed transport sends tensors; this TensorDict "
                        f"holds non-tensor entries {list(dict(context['non_tensor_data']))}. "
                        "Drop them before sending, or use transport='ray'.")
    leaves, tensors = [], []
    for path, leaf_value in zip(_paths(spec), values):
        leaf, tensor = _leaf(path, leaf_value, strict, where)
        leaves.append(leaf)
        if tensor is not None:
            tensors.append(tensor)
    return tensors, Layout(spec, tuple(leaves))


def unflatten(tensors: list[torch.Tensor], layout: Layout):
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


def conform(bound: Layout, got: Layout, tensors: list[torch.Tensor], *,
            where: str) -> list[torch.Tensor]:
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
        raise ValueError(f"{where}: keys differ from the bound layout: missing {missing}, "
                         f"unexpected {extra}.")
    for leaf in bound.leaves:
        if by_path[leaf.path] != leaf:
            raise ValueError(f"{where}: expected {leaf.describe()}, got "
                             f"{by_path[leaf.path].describe()}.")
    if dict(_batches(bound.spec)) != dict(_batches(got.spec)):
        raise ValueError(f"{where}: batch size differs: expected "
                         f"{dict(_batches(bound.spec))}, got {dict(_batches(got.spec))}.")
    position, sent = {}, 0
    for leaf in got.leaves:
        if leaf.sent:
            position[leaf.path], sent = sent, sent + 1
    return [tensors[position[leaf.path]] for leaf in bound.leaves if leaf.sent]
