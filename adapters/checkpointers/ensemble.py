"""TorchRL's ``StorageEnsembleCheckpointer``: TorchRL's layout, ``path/<i>/`` per non-empty
member, ``metadata.json`` listing the empty ones, ``<i>_transform.pt`` per member transform."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase

__all__ = ["StorageEnsembleCheckpointer"]


class StorageEnsembleCheckpointer(StorageCheckpointerBase):
    """Checkpointer of a :class:`StorageEnsemble` (TorchRL's layout, see the module)."""

    def dumps(self, storage, path) -> None:
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        empty = [i for i, member in enumerate(storage.storages) if not len(member)]
        with open(path / "metadata.json", "w") as f:
            json.dump({"empty_members": empty}, f)
        for i, member in enumerate(storage.storages):
            if i not in empty:
                member.dumps(path / str(i))
        for i, transform in enumerate(storage.transforms or ()):
            if transform is not None:
                torch.save(transform.state_dict(), path / f"{i}_transform.pt")

    def loads(self, storage, path) -> None:
        path = Path(path).absolute()
        meta = path / "metadata.json"
        try:
            empty = set(json.loads(meta.read_text())["empty_members"]) if meta.exists() else set()
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RuntimeError(
                f"StorageEnsembleCheckpointer.loads: {meta} is damaged ({e}); "
                'expected {"empty_members": [...]}.'
            ) from None
        for i, member in enumerate(storage.storages):
            if i in empty:
                member.empty()
            else:
                member.loads(path / str(i))
        for i, transform in enumerate(storage.transforms or ()):
            if transform is not None:
                transform.load_state_dict(torch.load(path / f"{i}_transform.pt"))
