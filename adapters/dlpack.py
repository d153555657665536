"""Zero-copy exchange between torch tensors / TensorDicts and JAX arrays / PyTrees (DLPack).

Functions::

    torch_to_jax(tensor)                   -> jax.Array       # shares memory when it can
    jax_to_torch(array)                    -> torch.Tensor    # shares memory when it can
    copy_reason(tensor)                    -> str | None      # why torch_to_jax would copy
    tensordict_to_pytree(td)               -> nested dict of jax.Array (same keys)
    pytree_to_tensordict(tree, batch_size) -> TensorDict (nested dicts become sub-TensorDicts)

When the memory is shared (``copy_reason(t) is None``), ``array.unsafe_buffer_pointer() ==
tensor.data_ptr()``. A copy happens, and ``copy_reason`` says so, when:

- the tensor is not contiguous (a slice with strides, a transposition): it is made contiguous
  first so that jitted code sees JAX's default row-major layout;
- the data pointer is not 64-byte aligned (a view starting mid-buffer, e.g. ``t[1:]``): XLA's
  CPU client only aliases aligned buffers;
- the dtype is 64-bit (int64, uint64, float64, complex128) while ``jax_enable_x64`` is off: JAX
  stores it as the 32-bit type (int64 -> int32: values outside int32 wrap, as in ``jnp.asarray``);
- the tensor lives on a device JAX does not use (a CUDA tensor with a CPU-only JAX): it is
  moved to the CPU.
bool, uint8, float16, bfloat16 and complex64 are shared without a copy.

Sharing memory means aliasing: a torch in-place op on the tensor (``t.add_(1)``) changes the
JAX array, which JAX assumes immutable, and donating a shared JAX array to a jitted function
lets XLA write into the tensor. Clone on one side if either may happen. In the other direction
``jax_to_torch`` returns a tensor aliasing the JAX buffer: do not write into it while the JAX
array is in use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "copy_reason",
    "jax_to_torch",
    "pytree_to_tensordict",
    "tensordict_to_pytree",
    "torch_to_jax",
]

_ALIGNMENT = 64  # bytes; XLA:CPU aliases external buffers only at this alignment
_WIDE = {torch.int64: "int32", torch.float64: "float32", torch.complex128: "complex64"}
if hasattr(torch, "uint64"):
    _WIDE[torch.uint64] = "uint32"


def _jax_platforms() -> set:
    return {d.platform for d in jax.devices()}


def copy_reason(tensor: torch.Tensor) -> str | None:
    """Why :func:`torch_to_jax` would copy ``tensor`` (a short sentence), or None if it will
    share memory."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_reason: expected a torch.Tensor, got {type(tensor).__name__}.")
    dev = tensor.device.type
    if dev == "cuda" and "gpu" not in _jax_platforms() and "cuda" not in _jax_platforms():
        return "device: the tensor is on CUDA but JAX has no GPU backend; moved to the CPU"
    if dev not in ("cpu", "cuda"):
        return f"device: JAX cannot import {dev} tensors via DLPack; moved to the CPU"
    if tensor.dtype in _WIDE and not jax.config.jax_enable_x64:
        return (
            f"dtype: {tensor.dtype} is stored as {_WIDE[tensor.dtype]} while jax_enable_x64 is off"
        )
    if tensor.numel() and not tensor.is_contiguous():
        return "layout: the tensor is not contiguous; made contiguous first"
    if dev == "cpu" and tensor.numel() and tensor.data_ptr() % _ALIGNMENT:
        return f"alignment: the data pointer is not {_ALIGNMENT}-byte aligned"
    return None


def torch_to_jax(tensor: torch.Tensor) -> jax.Array:
    """A JAX array with ``tensor``'s values, sharing its memory when :func:`copy_reason` is None.

    Shapes and dtypes are kept (64-bit types follow ``jax_enable_x64``); gradients are not
    tracked (the tensor is detached).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_to_jax: expected a torch.Tensor, got {type(tensor).__name__}.")
    t = tensor.detach()
    if (
        t.device.type != "cpu"
        and copy_reason(t) is not None
        and copy_reason(t).startswith("device")
    ):
        t = t.cpu()
    if t.dtype in _WIDE and not jax.config.jax_enable_x64:
        # Convert on the torch side (one copy) instead of JAX's canonicalisation.
        t = t.to(getattr(torch, _WIDE[t.dtype]))
    if t.numel() and not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return jnp.zeros(tuple(t.shape), _torch_dtype_name(t.dtype))
    if t.device.type == "cpu" and t.data_ptr() % _ALIGNMENT:
        t = t.clone()  # torch's allocator aligns fresh CPU buffers to 64 bytes
    return jax.dlpack.from_dlpack(t)


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def jax_to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor aliasing ``array``'s buffer (zero-copy for single-device arrays; arrays
    sharded over several devices are gathered to host first, a copy)."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    if not isinstance(array, jax.Array):
        raise TypeError(f"jax_to_torch: expected a jax.Array, got {type(array).__name__}.")
    if len(array.sharding.device_set) > 1:
        return torch.from_numpy(np.asarray(array))
    if array.size == 0:
        return torch.zeros(array.shape, dtype=getattr(torch, np.dtype(array.dtype).name))
    return torch.from_dlpack(array)


def tensordict_to_pytree(td: TensorDictBase) -> dict:
    """Nested dict of JAX arrays with ``td``'s keys (sub-TensorDicts become sub-dicts).

    Each leaf goes through :func:`torch_to_jax` (zero-copy where possible). Non-tensor entries
    (``NonTensorData``, strings) raise: a JAX PyTree leaf must be an array.
    """
    if not isinstance(td, (TensorDictBase, Mapping)):
        raise TypeError(f"tensordict_to_pytree: expected a TensorDict, got {type(td).__name__}.")
    out = {}
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, (TensorDictBase, Mapping)) and not _is_non_tensor(value):
            out[key] = tensordict_to_pytree(value)
        elif isinstance(value, torch.Tensor) and not _is_non_tensor(value):
            out[key] = torch_to_jax(value)
        else:
            raise TypeError(
                f"tensordict_to_pytree: entry {key!r} is a {type(value).__name__}, not a "
                "tensor; JAX PyTrees hold arrays only. Drop it first "
                f"(td.exclude({key!r})) or encode it as a tensor."
            )
    return out


def _is_non_tensor(value) -> bool:
    return type(value).__name__ in ("NonTensorData", "NonTensorStack")


def pytree_to_tensordict(
    tree: Any, batch_size: Sequence[int] = (), device: Any = None
) -> TensorDict:
    """A ``TensorDict(batch_size=batch_size)`` from a nested dict of arrays (JAX or NumPy).

    Leaves go through :func:`jax_to_torch` (zero-copy for JAX arrays on one device). Every leaf
    must start with ``batch_size``; TensorDict raises otherwise, naming the key.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(
            "pytree_to_tensordict: expected a (nested) dict of arrays, got "
            f"{type(tree).__name__}; wrap a single array as {{'data': x}}."
        )

    def convert(node, where):
        out = {}
        for k, v in node.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"pytree_to_tensordict: key {k!r} at {where or '<root>'} is "
                    "not a string; TensorDict keys are strings."
                )
            if isinstance(v, Mapping):
                out[k] = convert(v, f"{where}[{k!r}]")
            elif isinstance(v, (jax.Array, np.ndarray, np.generic)):
                out[k] = jax_to_torch(v if not isinstance(v, np.generic) else np.asarray(v))
            elif isinstance(v, torch.Tensor):
                out[k] = v
            else:
                raise TypeError(
                    f"pytree_to_tensordict: leaf {where}[{k!r}] is a "
                    f"{type(v).__name__}; expected a JAX or NumPy array."
                )
        return out

    return TensorDict(convert(tree, ""), batch_size=list(batch_size), device=device)
