"""TorchRL's checkpointers of the list storages: ``ListStorageCheckpointer`` (no on-disk
format, as in TorchRL) and ``CompressedListStorageCheckpointer``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import NonTensorData, TensorDict, lazy_stack

from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase

__all__ = ["ListStorageCheckpointer", "CompressedListStorageCheckpointer"]


class ListStorageCheckpointer(StorageCheckpointerBase):
    """ListStorage has no on-disk format in TorchRL: ``dumps`` / ``loads`` raise as TorchRL's."""

    _MSG = (
        "ListStorage doesn't support serialization via `dumps` - `loads` API (as in "
        "TorchRL); use state_dict / load_state_dict, or a tensor storage."
    )

    def dumps(self, storage, path) -> None:
        raise NotImplementedError(self._MSG)

    def loads(self, storage, path) -> None:
        raise NotImplementedError(self._MSG)


_TYPES = {
    "torch.Size": (torch.Size, lambda v: torch.Size(v), list),
    "torch.dtype": (torch.dtype, lambda v: getattr(torch, v.replace("torch.", "")), str),
    "torch.device": (torch.device, torch.device, str),
}


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
    raise TypeError(
        f"CompressedListStorageCheckpointer: cannot save a {type(item).__name__} "
        "in the items' metadata; store it in a tensor or a TensorDict entry."
    )


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
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        items, metas = storage.compressed_items()
        tds = []
        for data, meta in zip(items, metas):
            if meta["type"] == "tensordict":
                nested = [
                    k
                    for k, f in meta["fields"].items()
                    if f["type"] != "tensor" and isinstance(k, tuple)
                ]
                if nested:  # tensordict's memmap of a lazy stack drops them
                    raise TypeError(
                        f"CompressedListStorageCheckpointer.dumps: the non-tensor entries "
                        f"{nested} are nested and would not be saved; keep non-tensor entries "
                        "at the top level of the TensorDict (TorchRL cannot dump nested "
                        "TensorDicts of a CompressedListStorage either)."
                    )
                td = TensorDict(dict(data), [])  # non-tensor entries: memmapped as TorchRL's
            elif meta["type"] == "tensor":
                td = TensorDict({"data": data}, [])
            else:
                raise TypeError(
                    f"CompressedListStorageCheckpointer: item of type "
                    f"{type(data).__name__} is not a tensor or a TensorDict."
                )
            tds.append(td)
        if tds:
            lazy_stack(tds).memmap_(path / "compressed_data")
        metas = [
            dict(
                m,
                fields={
                    str(k) if isinstance(k, str) else "/".join(k): f for k, f in m["fields"].items()
                },
            )
            if m["type"] == "tensordict"
            else m
            for m in metas
        ]
        (path / "metadata.json").write_text(json.dumps(_to_json(metas)))
        (path / "data_indices.json").write_text(json.dumps(list(range(len(tds)))))

    def loads(self, storage, path) -> None:
        path = Path(path)
        try:
            metas = _from_json(json.loads((path / "metadata.json").read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path / 'metadata.json'} does not exist: not a CompressedListStorage dump."
            ) from None
        stacked = (
            TensorDict.load_memmap(path / "compressed_data").tolist()
            if (path / "compressed_data").exists()
            else []
        )
        if len(stacked) != len(metas):
            raise RuntimeError(
                f"loads: {path / 'compressed_data'} holds {len(stacked)} items, "
                f"{path / 'metadata.json'} describes {len(metas)}."
            )
        items = []
        for td, meta in zip(stacked, metas):
            if meta["type"] == "tensor":
                items.append((td["data"].clone(), meta))
            else:
                fields = {
                    tuple(k.split("/")) if "/" in k else k: f for k, f in meta["fields"].items()
                }
                data = {
                    k: td[k].clone()
                    if fields[k]["type"] == "tensor"
                    else td.get(k, fields[k].get("value"))
                    for k in fields
                }
                items.append((data, dict(meta, fields=fields)))
        storage.restore_compressed(items)
