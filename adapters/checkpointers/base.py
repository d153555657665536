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
from pathlib import Path

__all__ = ["StorageCheckpointerBase", "read_storage_metadata"]


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


def read_storage_metadata(path) -> dict:
    """``storage_metadata.json`` of a storage dump, with an error naming the file."""
    file = Path(path) / "storage_metadata.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} does not exist: not a storage dump.") from None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{file} is damaged (not valid JSON: {e}).") from None
