"""TorchRL's ``TensorStorage`` on-disk layout, written and read without TorchRL.

Signatures::

    dump_storage(data, path, *, length=None, last_cursor=None, is_full=None, save_hooks=())
        -> None
    load_storage(path, *, load_hooks=(), out=None)
        -> LoadedStorage(data, length, is_pytree)

``dump_storage`` writes what TorchRL's ``TensorStorageCheckpointer.dumps`` (used by
``TensorStorage.dumps`` / ``LazyMemmapStorage.dumps`` and so by ``ReplayBuffer.dumps(path)``
into ``path/"storage"``) writes for the same storage contents:

- ``data`` a ``TensorDict`` (the whole storage, batch ``[max_size, ...]``; rows past ``length``
  are whatever the storage holds, zeros for a fresh one): after the save hooks, the TensorDict
  is memory-mapped to ``path`` (``meta.json`` per (sub-)TensorDict plus one raw ``<key>.memmap``
  file per tensor) and ``storage_metadata.json`` says
  ``{"metadata": {}, "is_pytree": false, "len": length}``.
- ``data`` any other PyTree (a tensor, a nested dict/list of arrays; leaves may be torch
  tensors, NumPy or JAX arrays): one raw ``<k0>/<k1>.memmap`` file per leaf and
  ``storage_metadata.json`` with ``{"metadata": {"k0.k1": {"dtype", "shape"}}, "is_pytree":
  true, "len": length}``; a single tensor is stored as ``_-single-tensor-_.memmap``.
  (Like TorchRL, hooks are only applied to TensorDict data.)

Arguments mirror the storage attributes TorchRL reads: ``length`` is ``len(storage)`` (default:
``max_size``, the TensorDict's batch numel or a PyTree's leading size); ``last_cursor`` is
``storage._last_cursor`` (the index or indices written last: int, slice, range, tensor or
array); TorchRL's checkpointer gives every save hook that has them ``hook.shift = last_cursor +
1`` (the last element) and ``hook.is_full = length == max_size``; ``is_full`` overrides the
latter.

``load_storage`` reads such a directory (written by TorchRL or by ``dump_storage``): the
TensorDict is loaded memory-mapped (``TensorDict.load_memmap``; writing into it writes the
files) and each load hook is called as ``data = hook(data, out=out)``; PyTree dumps come back as
nested dicts of memory-mapped tensors keyed like the metadata (or a single tensor).

Compatibility (tested against TorchRL 0.14.1's own dumps of the same data): the same file set,
byte-identical ``.memmap`` files, and JSON files equal once parsed. JSON key *order* is the one
thing that may differ: it follows the order the TensorDict's (or dict's) keys were inserted,
and TorchRL's own ``TED2Flat`` output orders root keys by iterating a Python ``set``, which
varies between processes (``PYTHONHASHSEED``); TorchRL reads JSON by key, so order is irrelevant
to loading.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import MemoryMappedTensor, TensorDict, is_tensor_collection

from functional_rb._internal.lazy import lazy_module

_dlpack = lazy_module("functional_rb.adapters.dlpack")  # JAX, only for JAX leaves

__all__ = ["LoadedStorage", "dump_storage", "load_storage", "STORAGE_METADATA"]

STORAGE_METADATA = "storage_metadata.json"
SINGLE_TENSOR_NAME = os.environ.get("SINGLE_TENSOR_BUFFER_NAME", "_-single-tensor-_")


class LoadedStorage(NamedTuple):
    data: Any  # TensorDict (memory-mapped) or PyTree of memory-mapped tensors
    length: int  # len(storage) when it was dumped
    is_pytree: bool  # True when the dump used TorchRL's pytree layout


def _to_torch(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if (
        type(x).__module__.startswith("jax")
        or hasattr(x, "__dlpack__")
        and not isinstance(x, np.ndarray)
    ):
        return _dlpack.jax_to_torch(x)
    if isinstance(x, (np.ndarray, np.generic)):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise TypeError(
        f"dump_storage: leaf of type {type(x).__name__} is not an array; the "
        "storage must hold tensors/arrays only."
    )


def _shift_from_last_cursor(last_cursor) -> int:
    # TorchRL's StorageCheckpointerBase._get_shift_from_last_cursor
    if isinstance(last_cursor, slice):
        return last_cursor.stop + 1
    if isinstance(last_cursor, (int, np.integer)):
        return int(last_cursor) + 1
    if isinstance(last_cursor, range):
        return last_cursor[-1] + 1
    if isinstance(last_cursor, torch.Tensor):
        return last_cursor.reshape(-1)[-1].item() + 1
    if isinstance(last_cursor, np.ndarray) or hasattr(last_cursor, "__array__"):
        return np.asarray(last_cursor).reshape(-1)[-1].item() + 1
    raise ValueError(
        f"dump_storage: unrecognised last_cursor type {type(last_cursor)}; pass "
        "the index (int, slice, range, tensor or array) written last."
    )


def _max_size(data) -> int:
    """Items the storage holds when full: the batch numel (TorchRL's ``max_size``; a
    ``[T, num_envs]`` storage with ``ndim=2`` holds ``T * num_envs``) or a PyTree's leading size."""
    if is_tensor_collection(data):
        return int(data.batch_size.numel())
    leaves = _tree_leaves(data)
    if not leaves:
        raise ValueError("dump_storage: the storage has no tensors.")
    return int(leaves[0][1].shape[0])


def _tree_leaves(tree, prefix=()):
    """[(path tuple of str, leaf)] in insertion order (torch.utils._pytree order for dicts)."""
    if isinstance(tree, Mapping):
        out = []
        for k, v in tree.items():
            if not isinstance(k, (int, str, bytes)):
                raise ValueError(
                    f"dump_storage: PyTree map keys must be int, str or bytes, got {k!r}."
                )
            out.extend(_tree_leaves(v, prefix + (str(k),)))
        return out
    if isinstance(tree, (list, tuple)):
        out = []
        for i, v in enumerate(tree):
            out.extend(_tree_leaves(v, prefix + (str(i),)))
        return out
    return [(prefix, tree)]


def dump_storage(
    data: Any,
    path,
    *,
    length: int | None = None,
    last_cursor: Any = None,
    is_full: bool | None = None,
    save_hooks: Sequence = (),
) -> None:
    """Write ``data`` (the whole storage) in TorchRL's ``TensorStorage.dumps`` layout."""
    path = Path(path)
    path.mkdir(exist_ok=True)
    max_size = _max_size(data)
    length = max_size if length is None else int(length)
    if not 0 <= length <= max_size:
        raise ValueError(
            f"dump_storage: length={length} must be in [0, {max_size}] (the "
            "storage's max_size: its batch numel)."
        )
    if is_full is None:
        is_full = length == max_size
    if save_hooks:
        if last_cursor is None:
            warnings.warn(
                "dump_storage: last_cursor is None; save hooks get shift=0 (as in "
                "TorchRL). Pass the index written last for a faithful TED2Flat dump.",
                stacklevel=2,
            )
            shift = 0
        else:
            shift = _shift_from_last_cursor(last_cursor)
        for hook in save_hooks:
            if hasattr(hook, "is_full"):
                hook.is_full = is_full
            if hasattr(hook, "shift"):
                hook.shift = shift
    metadata: dict = {}
    for hook in save_hooks:  # (every storage's data, a PyTree's too, as TorchRL's)
        data = hook(data, path=path)
    if is_tensor_collection(data):
        if (
            data.is_memmap()
            and data.saved_path
            and Path(data.saved_path).absolute() == path.absolute()
        ):
            data.memmap_refresh_()
        else:
            data.memmap(path, copy_existing=True)
        is_pytree = False
    else:
        for keys, leaf in _tree_leaves(data):
            tensor = _to_torch(leaf)
            rel = "/".join(keys) if keys else SINGLE_TENSOR_NAME
            file = path / (rel + ".memmap")
            if file.exists():
                MemoryMappedTensor.from_filename(
                    shape=tensor.shape, filename=file, dtype=tensor.dtype
                ).copy_(tensor)
            else:
                os.makedirs(file.parent, exist_ok=True)
                MemoryMappedTensor.from_tensor(
                    tensor, filename=file, copy_existing=True, copy_data=True
                )
            key = rel.replace("/", ".")
            if key in metadata:
                raise KeyError(
                    "dump_storage: two leaves map to the same file name "
                    f"{key!r}; rename one of them."
                )
            metadata[key] = {"dtype": str(tensor.dtype), "shape": list(tensor.shape)}
        is_pytree = True
    with open(path / STORAGE_METADATA, "w") as file:
        json.dump({"metadata": metadata, "is_pytree": is_pytree, "len": length}, file)


def load_storage(path, *, load_hooks: Sequence = (), out: Any = None) -> LoadedStorage:
    """Read a storage directory written by TorchRL's ``dumps`` or by :func:`dump_storage`."""
    path = Path(path)
    meta_file = path / STORAGE_METADATA
    if not meta_file.exists():
        raise FileNotFoundError(
            f"load_storage: {meta_file} does not exist; pass the storage directory of a dump "
            "(for ReplayBuffer.dumps(p) that is p/'storage')."
        )
    with open(meta_file) as file:
        metadata = json.load(file)
    length = int(metadata["len"])
    if metadata["is_pytree"]:
        if load_hooks:
            raise RuntimeError(
                "load_storage: loading hooks are not compatible with PyTree "
                "storages (as in TorchRL)."
            )
        tree: dict = {}
        for key, md in metadata["metadata"].items():
            dtype = getattr(torch, md["dtype"].replace("torch.", ""))
            tensor = MemoryMappedTensor.from_filename(
                filename=path / (key.replace(".", "/") + ".memmap"),
                shape=torch.Size(md["shape"]),
                dtype=dtype,
            )
            if key == SINGLE_TENSOR_NAME:
                return LoadedStorage(tensor, length, True)
            parts = [p.replace("_<dot>_", ".") for p in key.split(".")]
            node = tree
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = tensor
        return LoadedStorage(tree, length, True)
    data = TensorDict.load_memmap(path)
    for hook in load_hooks:
        data = hook(data, out=out)
    return LoadedStorage(data, length, False)
