"""TorchRL's ``TensorStorageCheckpointer`` (the files of
:mod:`functional_rb.adapters.serialization`, byte for byte) and ``FlatStorageCheckpointer``
(TED data saved flat with the ``TED2Flat`` / ``Flat2TED`` hooks)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
from functional_rb.adapters.serialization import SINGLE_TENSOR_NAME, dump_storage, load_storage
from functional_rb.adapters.ted_hooks import Flat2TED, TED2Flat

__all__ = ["TensorStorageCheckpointer", "FlatStorageCheckpointer"]


def _pytree_slot(tree, parts):
    """The leaf of a stored PyTree at the dump's path ``parts`` (strings: digits index lists,
    tuples and int-keyed dicts)."""
    node = tree
    for p in parts:
        if isinstance(node, (list, tuple)):
            node = node[int(p)]
        elif isinstance(node, dict):
            if p in node:
                node = node[p]
            elif p.lstrip("-").isdigit() and int(p) in node:
                node = node[int(p)]
            else:
                raise KeyError(
                    f"the dump holds a leaf at {'.'.join(parts)!r}, which the "
                    "storage's data structure does not have."
                )
        else:
            raise KeyError(
                f"the dump holds a leaf at {'.'.join(parts)!r}, which the storage's "
                "data structure does not have."
            )
    return node


def _flat_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_paths(v, prefix + (str(k),))
    else:
        yield prefix, tree


class TensorStorageCheckpointer(StorageCheckpointerBase):
    """TorchRL's ``TensorStorageCheckpointer``: a TensorDict storage as a memory-mapped
    TensorDict (``meta.json`` + one ``.memmap`` per leaf), a PyTree storage as one ``.memmap``
    per leaf, and ``storage_metadata.json`` (``{"metadata", "is_pytree", "len"}``)."""

    def dumps(self, storage, path) -> None:
        if not storage.initialized:
            raise RuntimeError("Cannot save a non-initialized storage.")
        if storage.last_cursor is None and any(hasattr(h, "shift") for h in self._save_hooks):
            warnings.warn(
                "last_cursor is None: save hooks get shift=0 (as in TorchRL).", stacklevel=2
            )
        dump_storage(
            storage.data,
            Path(path),
            length=len(storage),
            last_cursor=storage.last_cursor,
            is_full=storage.is_full,
            save_hooks=self._save_hooks,
        )

    def loads(self, storage, path) -> None:
        path = Path(path)
        dest = storage.data if storage.initialized else None
        loaded = load_storage(path, load_hooks=self._load_hooks, out=dest)
        if loaded.is_pytree:
            if not storage.initialized:
                raise RuntimeError(
                    "Cannot fill a non-initialized pytree-based TensorStorage: "
                    "extend the buffer once with data of the same structure "
                    "before loads() (TorchRL's rule)."
                )
            if isinstance(loaded.data, torch.Tensor):
                target = storage.data
                if not isinstance(target, torch.Tensor):
                    raise RuntimeError(
                        f"loads: {path} holds a single tensor "
                        f"({SINGLE_TENSOR_NAME}); the storage holds a PyTree."
                    )
                _copy_checked(target, loaded.data, path / f"{SINGLE_TENSOR_NAME}.memmap")
            else:
                for parts, tensor in _flat_paths(loaded.data):
                    target = _pytree_slot(storage.data, parts)
                    _copy_checked(target, tensor, path / ("/".join(parts) + ".memmap"))
            storage.restore(storage.data, loaded.length)
            return
        data = loaded.data
        if storage.initialized:
            if not _same_files(storage.data, path):
                _copy_td_checked(storage.data, data, path)
            storage.restore(storage.data, loaded.length)
            return
        storage.restore(storage.adopt_loaded(data, path), loaded.length)


def _same_files(data, path: Path) -> bool:
    """Whether ``data`` is the memory-mapped TensorDict saved at ``path`` (nothing to copy)."""
    saved = getattr(data, "saved_path", None) if is_tensor_collection(data) else None
    if saved and data.is_memmap() and Path(saved).absolute() == Path(path).absolute():
        data.memmap_refresh_()
        return True
    return False


def _copy_checked(target: torch.Tensor, source: torch.Tensor, file) -> None:
    if tuple(target.shape) != tuple(source.shape) or target.dtype != source.dtype:
        raise RuntimeError(
            f"loads: {file} holds {source.dtype}{list(source.shape)}; the "
            f"storage holds {target.dtype}{list(target.shape)} there. Load into "
            "a buffer built like the one that was dumped."
        )
    target.copy_(source)


def _copy_td_checked(target, source, path: Path) -> None:
    tk = set(target.keys(True, True))
    sk = set(source.keys(True, True))
    if tk != sk or target.batch_size != source.batch_size:
        raise RuntimeError(
            f"loads: the storage dump in {path} has batch size {tuple(source.batch_size)} and "
            f"keys {sorted(map(str, sk))}; this storage has {tuple(target.batch_size)} and "
            f"{sorted(map(str, tk))}. Load into a buffer built like the one that was dumped "
            "(same capacity and ndim)."
        )
    target.update_(source)


class FlatStorageCheckpointer(TensorStorageCheckpointer):
    """TorchRL's ``FlatStorageCheckpointer``: TED data saved flat (each observation once) with
    the ``TED2Flat`` / ``Flat2TED`` hooks.

    Args:
      done_keys: the ``"next"`` entries that are done flags (default
        :data:`~functional_rb.adapters.DEFAULT_DONE_KEYS`), as for ``TED2Flat``.
      reward_keys: the ``"next"`` entries that are rewards (default ``("reward",)``).

    Example:
        >>> from functional_rb.adapters import FlatStorageCheckpointer, LazyTensorStorage
        >>> storage = LazyTensorStorage(100, checkpointer=FlatStorageCheckpointer())
    """

    def __init__(
        self,
        done_keys: Sequence[NestedKey] | None = None,
        reward_keys: Sequence[NestedKey] | None = None,
    ):
        super().__init__()
        kwargs = {}
        if done_keys is not None:
            kwargs["done_keys"] = done_keys
        if reward_keys is not None:
            kwargs["reward_keys"] = reward_keys
        self._save_hooks = [TED2Flat(**kwargs)]
        self._load_hooks = [Flat2TED(**kwargs)]
