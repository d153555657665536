"""torch <-> JAX conversion at the adapter boundary.

TensorDicts become nested ``dict`` PyTrees for the core (``("next", "done")`` ->
``{"next": {"done": ...}}``) and come back as TensorDicts. Every leaf remembers its torch dtype
(:class:`LeafSpec`) so that what comes out of the buffer has the dtype that went in.

dtype rule (JAX runs with ``jax_enable_x64`` off by default):

=============  ==========================  ======================================================
torch          stored in the core as       returned as
=============  ==========================  ======================================================
bool, uint8,   same                        same
int8, int16,
int32, f16,
f32
bfloat16       ``jnp.bfloat16``            ``torch.bfloat16`` (bit-exact)
int64          int32, after a range check  int64 (exact: values outside int32 raise OverflowError)
float64        float32                     float64 (rounded to float32 precision)
=============  ==========================  ======================================================

With ``jax.config.update("jax_enable_x64", True)`` int64/float64 are stored as they are.
Complex and non-tensor leaves are not supported by tensor storages (a clear TypeError).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_dtypes
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection

from functional_rb._tree import nest as _nest

_INT32 = np.iinfo(np.int32)

_TORCH_TO_NP = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a torch dtype is stored as in the core (see the module docstring)."""
    if dtype not in _TORCH_TO_NP:
        raise TypeError(f"functional_rb.adapters: torch dtype {dtype} is not supported by tensor "
                        f"storages (supported: {sorted(str(d) for d in _TORCH_TO_NP)}). Cast it, "
                        "or use ListStorage for arbitrary Python objects.")
    np_dtype = _TORCH_TO_NP[dtype]
    if not x64_enabled():
        if np_dtype == np.int64:
            return np.dtype(np.int32)
        if np_dtype == np.float64:
            return np.dtype(np.float32)
    return np_dtype


def torch_dtype_of_np(dtype) -> torch.dtype:
    return _NP_TO_TORCH[np.dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One stored leaf: its nested key, its per-item shape and its torch dtype."""

    key: tuple          # nested key, e.g. ("next", "done")
    shape: tuple        # per-item shape (no batch axes)
    dtype: torch.dtype  # the dtype users put in and get back


def tensor_to_numpy(x: torch.Tensor, key=("",), where: str = "extend") -> np.ndarray:
    """A host numpy array in the storage dtype for ``x`` (any shape)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: leaf {key!r} is a {type(x).__name__}, not a tensor; tensor "
                        "storages only hold tensors. Drop it, or use ListStorage.")
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    target = storage_dtype(x.dtype)
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if x.dtype == torch.int64 and target == np.int32 and x.numel():
        lo, hi = int(x.min()), int(x.max())
        if lo < _INT32.min or hi > _INT32.max:
            raise OverflowError(
                f"{where}: int64 leaf {key!r} holds values in [{lo}, {hi}], outside int32 range; "
                "JAX stores int64 as int32 while jax_enable_x64 is off. Enable it with "
                "jax.config.update('jax_enable_x64', True) or store the values as float/int32.")
    return x.numpy().astype(target, copy=False)


def numpy_to_tensor(x, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A torch tensor with ``dtype`` from a numpy/JAX array ``x`` (copies: the result owns its
    memory, so later in-place buffer updates never alias it)."""
    a = np.array(x, copy=True)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    if t.dtype != dtype:
        t = t.to(dtype)
    if device is not None and torch.device(device).type != "cpu":
        t = t.to(device)
    return t


def _get_nested(tree: dict, key: tuple):
    for k in key:
        tree = tree[k]
    return tree


def td_leaves(td: TensorDictBase, where: str) -> dict:
    """``{nested key tuple: tensor}`` for every leaf of a TensorDict (non-tensors raise)."""
    out = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        v = td.get(key)
        if not isinstance(v, torch.Tensor) or is_tensor_collection(v):
            raise TypeError(
                f"{where}: entry {key!r} is a {type(v).__name__} (non-tensor data); tensor "
                "storages only hold tensors. Remove it (td.exclude(...)) or use ListStorage.")
        out[key] = v
    return out


def specs_of(leaves: dict, batch_ndim: int) -> tuple:
    return tuple(LeafSpec(key=k, shape=tuple(v.shape[batch_ndim:]), dtype=v.dtype)
                 for k, v in leaves.items())


def leaves_to_tree(leaves: dict, where: str) -> dict:
    """Nested dict of numpy arrays (storage dtypes) from ``{key: tensor}``."""
    return _nest({k: tensor_to_numpy(v, k, where) for k, v in leaves.items()})


def tree_to_td(tree: dict, specs, batch_size, device=None) -> TensorDict:
    """A TensorDict with ``batch_size`` from a nested dict of arrays, torch dtypes from specs."""
    flat = {s.key: numpy_to_tensor(_get_nested(tree, s.key), s.dtype, device) for s in specs}
    td = TensorDict({}, batch_size=batch_size, device=device)
    for key, t in flat.items():
        td.set(key if len(key) > 1 else key[0], t)
    return td


# ------------------------------------------------------------------ generic (non-TD) data
def pytree_to_leaves(data: Any, where: str):
    """``(treedef, {("0",), ...: tensor})`` for a torch PyTree (a tensor, tuple, dict...)."""
    flat, treedef = jax.tree_util.tree_flatten(
        data, is_leaf=lambda x: isinstance(x, torch.Tensor))
    leaves = {}
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: leaf {i} of the data is a {type(x).__name__}, not a "
                            "tensor. Tensor storages hold tensors; use ListStorage for "
                            "arbitrary objects.")
        leaves[(f"{i}",)] = x
    return treedef, leaves


def leaves_to_pytree(treedef, tree: dict, specs, device=None):
    flat = [numpy_to_tensor(_get_nested(tree, s.key), s.dtype, device) for s in specs]
    return jax.tree_util.tree_unflatten(treedef, flat)


def to_index_tensor(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.int64, copy=True))
