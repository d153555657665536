"""Storage checkpointers under TorchRL's names: each owns a storage's on-disk format.

A storage's ``dumps(path)`` / ``loads(path)`` call ``storage.checkpointer.dumps(storage, path)``
/ ``loads(storage, path)``; the hooks a buffer registers (``register_save_hook``) belong to the
checkpointer, as in TorchRL. The files are TorchRL's, byte for byte (see
:mod:`functional_rb.adapters.serialization`), so TorchRL loads what we write and we load what it
writes.

A checkpointer reads and writes a storage through its public surface only: ``initialized``,
``data`` (the whole allocated storage), ``len``, ``last_cursor``, ``is_full``, ``_init`` is
not used: ``storage.allocate_like(item)`` and ``storage.restore(data, length)`` are.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from tensordict import NonTensorData, is_tensor_collection

from functional_rb.adapters.serialization import (SINGLE_TENSOR_NAME, dump_storage,
                                                  load_storage)

__all__ = ["StorageCheckpointerBase", "ListStorageCheckpointer", "TensorStorageCheckpointer",
           "FlatStorageCheckpointer", "CompressedListStorageCheckpointer",
           "StorageEnsembleCheckpointer", "NestedStorageCheckpointer", "H5StorageCheckpointer"]


class StorageCheckpointerBase:
    """Base of the checkpointers: holds the save and load hooks."""

    def __init__(self):
        self._save_hooks: list = []
        self._load_hooks: list = []

    @property
    def save_hooks(self) -> tuple:
        return tuple(self._save_hooks)

    @property
    def load_hooks(self) -> tuple:
        return tuple(self._load_hooks)

    def register_save_hook(self, hook) -> None:
        self._save_hooks.append(hook)

    def register_load_hook(self, hook) -> None:
        self._load_hooks.append(hook)

    def dumps(self, storage, path) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not write storages.")

    def loads(self, storage, path) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not read storages.")


class ListStorageCheckpointer(StorageCheckpointerBase):
    """ListStorage has no on-disk format in TorchRL: ``dumps`` / ``loads`` raise as TorchRL's."""

    _MSG = ("ListStorage doesn't support serialization via `dumps` - `loads` API (as in "
            "TorchRL); use state_dict / load_state_dict, or a tensor storage.")

    def dumps(self, storage, path) -> None:
        raise NotImplementedError(self._MSG)

    def loads(self, storage, path) -> None:
        raise NotImplementedError(self._MSG)


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
                raise KeyError(f"the dump holds a leaf at {'.'.join(parts)!r}, which the "
                               "storage's data structure does not have.")
        else:
            raise KeyError(f"the dump holds a leaf at {'.'.join(parts)!r}, which the storage's "
                           "data structure does not have.")
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
        if storage.last_cursor is None and any(
                hasattr(h, "shift") for h in self._save_hooks):
            warnings.warn("last_cursor is None: save hooks get shift=0 (as in TorchRL).")
        dump_storage(storage.data, Path(path), length=len(storage),
                     last_cursor=storage.last_cursor, is_full=storage.is_full,
                     save_hooks=self._save_hooks)

    def loads(self, storage, path) -> None:
        path = Path(path)
        dest = storage.data if storage.initialized else None
        loaded = load_storage(path, load_hooks=self._load_hooks, out=dest)
        if loaded.is_pytree:
            if not storage.initialized:
                raise RuntimeError("Cannot fill a non-initialized pytree-based TensorStorage: "
                                   "extend the buffer once with data of the same structure "
                                   "before loads() (TorchRL's rule).")
            if isinstance(loaded.data, torch.Tensor):
                target = storage.data
                if not isinstance(target, torch.Tensor):
                    raise RuntimeError(f"loads: {path} holds a single tensor "
                                       f"({SINGLE_TENSOR_NAME}); the storage holds a PyTree.")
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
        raise RuntimeError(f"loads: {file} holds {source.dtype}{list(source.shape)}; the "
                           f"storage holds {target.dtype}{list(target.shape)} there. Load into "
                           "a buffer built like the one that was dumped.")
    target.copy_(source)


def _copy_td_checked(target, source, path: Path) -> None:
    tk = set(target.keys(True, True))
    sk = set(source.keys(True, True))
    if tk != sk or target.batch_size != source.batch_size:
        raise RuntimeError(
            f"loads: the storage dump in {path} has batch size {tuple(source.batch_size)} and "
            f"keys {sorted(map(str, sk))}; this storage has {tuple(target.batch_size)} and "
            f"{sorted(map(str, tk))}. Load into a buffer built like the one that was dumped "
            "(same capacity and ndim).")
    target.update_(source)


class FlatStorageCheckpointer(TensorStorageCheckpointer):
    """TorchRL's ``FlatStorageCheckpointer``: TED data saved flat (each observation once) with
    the ``TED2Flat`` / ``Flat2TED`` hooks. Arguments: ``done_keys``, ``reward_keys``."""

    def __init__(self, done_keys=None, reward_keys=None):
        super().__init__()
        from functional_rb.adapters.ted_hooks import Flat2TED, TED2Flat
        kwargs = {}
        if done_keys is not None:
            kwargs["done_keys"] = done_keys
        if reward_keys is not None:
            kwargs["reward_keys"] = reward_keys
        self._save_hooks = [TED2Flat(**kwargs)]
        self._load_hooks = [Flat2TED(**kwargs)]


_TYPES = {"torch.Size": (torch.Size, lambda v: torch.Size(v), list),
          "torch.dtype": (torch.dtype, lambda v: getattr(torch, v.replace("torch.", "")), str),
          "torch.device": (torch.device, torch.device, str)}


def _to_json(item):
    if isinstance(item, NonTensorData):
        return {"__type__": "NonTensorData", "value": _to_json(item.data)}
    for name, (cls, _, dump) in _TYPES.items():
        if isinstance(item, cls):
            return {"__type__": name, "value": dump(item)}
    if isinstance(item, dict):
        return {k if isinstance(k, str) else json.dumps(k): _to_json(v) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return [_to_json(v) for v in item]
    if isinstance(item, (str, int, float, bool)) or item is None:
        return item
    raise TypeError(f"CompressedListStorageCheckpointer: cannot save a {type(item).__name__} "
                    "in the items' metadata; store it in a tensor or a TensorDict entry.")


def _from_json(item):
    if isinstance(item, dict):
        if item.get("__type__") == "NonTensorData":
            return _from_json(item["value"])
        if "__type__" in item:
            return _TYPES[item["__type__"]][1](item["value"])
        return {k: _from_json(v) for k, v in item.items()}
    if isinstance(item, list):
        return [_from_json(v) for v in item]
    return item


class CompressedListStorageCheckpointer(StorageCheckpointerBase):
    """TorchRL's layout for a ``CompressedListStorage``: the compressed items as a lazily
    stacked, memory-mapped TensorDict under ``compressed_data/``, their metadata (shape, dtype,
    device of each tensor) in ``metadata.json`` and the slot of each item in
    ``data_indices.json``."""

    def dumps(self, storage, path) -> None:
        from tensordict import TensorDict, lazy_stack
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        items, metas = storage.compressed_items()
        tds = []
        for data, meta in zip(items, metas):
            if meta["type"] == "tensordict":
                nested = [k for k, f in meta["fields"].items()
                          if f["type"] != "tensor" and isinstance(k, tuple)]
                if nested:  # tensordict's memmap of a lazy stack drops them
                    raise TypeError(
                        f"CompressedListStorageCheckpointer.dumps: the non-tensor entries "
                        f"{nested} are nested and would not be saved; keep non-tensor entries "
                        "at the top level of the TensorDict (TorchRL cannot dump nested "
                        "TensorDicts of a CompressedListStorage either).")
                td = TensorDict(dict(data), [])  # non-tensor entries: memmapped as TorchRL's
            elif meta["type"] == "tensor":
                td = TensorDict({"data": data}, [])
            else:
                raise TypeError(f"CompressedListStorageCheckpointer: item of type "
                                f"{type(data).__name__} is not a tensor or a TensorDict.")
            tds.append(td)
        if tds:
            lazy_stack(tds).memmap_(path / "compressed_data")
        metas = [dict(m, fields={str(k) if isinstance(k, str) else "/".join(k): f
                                 for k, f in m["fields"].items()}) if m["type"] == "tensordict"
                 else m for m in metas]
        (path / "metadata.json").write_text(json.dumps(_to_json(metas)))
        (path / "data_indices.json").write_text(json.dumps(list(range(len(tds)))))

    def loads(self, storage, path) -> None:
        from tensordict import TensorDict
        path = Path(path)
        try:
            metas = _from_json(json.loads((path / "metadata.json").read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path / 'metadata.json'} does not exist: not a "
                                    "CompressedListStorage dump.") from None
        stacked = TensorDict.load_memmap(path / "compressed_data").tolist() \
            if (path / "compressed_data").exists() else []
        if len(stacked) != len(metas):
            raise RuntimeError(f"loads: {path / 'compressed_data'} holds {len(stacked)} items, "
                               f"{path / 'metadata.json'} describes {len(metas)}.")
        items = []
        for td, meta in zip(stacked, metas):
            if meta["type"] == "tensor":
                items.append((td["data"].clone(), meta))
            else:
                fields = {tuple(k.split("/")) if "/" in k else k: f
                          for k, f in meta["fields"].items()}
                data = {k: td[k].clone() if fields[k]["type"] == "tensor" else
                        td.get(k, fields[k].get("value")) for k in fields}
                items.append((data, dict(meta, fields=fields)))
        storage.restore_compressed(items)


def read_storage_metadata(path) -> dict:
    """``storage_metadata.json`` of a storage dump, with an error naming the file."""
    file = Path(path) / "storage_metadata.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} does not exist: not a storage dump.") from None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{file} is damaged (not valid JSON: {e}).") from None


def __getattr__(name):
    # Its module imports the storages, which import this module: bound on first use.
    if name == "StorageEnsembleCheckpointer":
        from functional_rb.adapters._ensemble_parts import StorageEnsembleCheckpointer
        return StorageEnsembleCheckpointer
    if name in ("NestedStorageCheckpointer", "H5StorageCheckpointer"):
        # built on FlatStorageCheckpointer, defined above: bound on first use
        from functional_rb.adapters import _nested_h5
        return getattr(_nested_h5, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
