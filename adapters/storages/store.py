"""TorchRL's ``StoreStorage``: a storage whose data lives in a Redis-compatible key-value server
(Redis, Dragonfly, KeyDB), through tensordict's ``TensorDictStore``.

Several processes, on several machines, can read the same data: ``state_dict`` records the
server and the store's id, and ``load_state_dict`` reconnects to it. Requires the ``redis``
package and a tensordict with ``tensordict.store`` (``pip install redis``).
"""

from __future__ import annotations

import importlib.util
import textwrap
from typing import Any

import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
from functional_rb.adapters.storages.base import Storage

__all__ = ["StoreStorage"]

_TENSOR = "_tensor"  # raw tensors are kept under this key of the store


def _has_store() -> bool:
    return (
        importlib.util.find_spec("redis") is not None
        and importlib.util.find_spec("tensordict.store") is not None
    )


class StoreStorage(Storage):
    """Items in a ``TensorDictStore`` on a Redis-compatible server (TorchRL's ``StoreStorage``).

    The store is created at the first write, ``[max_size]`` along dim 0, from the first
    item's structure: TensorDicts (nested, with non-tensor entries), tensorclasses, or plain
    tensors.

    Args:
      max_size: capacity in items.
      backend: ``"redis"`` (default), ``"dragonfly"``, ``"keydb"`` or another server speaking
        Redis's protocol (recorded; they share one client).
      host: the server's host name.
      port: the server's port.
      db: the server's database number.
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      checkpointer: the on-disk format for ``dumps`` (none by default: the data stays in the
        server; ``state_dict`` records how to reconnect).
      **store_kwargs: ``TensorDictStore``'s other arguments, e.g. ``client=`` (an existing
        ``redis.asyncio.Redis`` client), ``prefix=``, ``unix_socket_path=``.
    """

    def __init__(
        self,
        max_size: int,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        compilable: bool = False,
        checkpointer: StorageCheckpointerBase | None = None,
        **store_kwargs,
    ):
        if not _has_store():
            raise ModuleNotFoundError(
                "StoreStorage requires both the `redis` package and a version of tensordict "
                "that includes `tensordict.store`. Install redis with: pip install redis"
            )
        if isinstance(max_size, bool) or int(max_size) < 1:
            raise ValueError(f"StoreStorage: max_size must be a positive int, got {max_size!r}.")
        super().__init__(max_size, checkpointer=checkpointer, compilable=compilable)
        self._backend, self._host, self._port, self._db = backend, host, port, db
        self._store_kwargs = store_kwargs
        self._storage = None
        self.initialized = False
        self._len = 0
        self._is_tensor = False
        self._tensorclass_type = None

    # ------------------------------------------------------------------ the store
    def _connect(self, td_id: str | None = None):
        from tensordict.store import TensorDictStore

        return TensorDictStore(
            batch_size=[self.max_size],
            backend=self._backend,
            host=self._host,
            port=self._port,
            db=self._db,
            td_id=td_id,
            **self._store_kwargs,
        )

    def _init(self, item) -> None:
        if isinstance(item, torch.Tensor) and not is_tensor_collection(item):
            self._is_tensor = True
        elif is_tensor_collection(item):
            self._tensorclass_type = type(item) if is_tensorclass(item) else None
        else:
            raise TypeError(
                f"StoreStorage: cannot store a {type(item).__name__}; store "
                "TensorDicts, tensorclasses or tensors (use ListStorage for other "
                "objects)."
            )
        self._storage = self._connect()
        self.initialized = True

    @property
    def td_id(self) -> str | None:
        """The store's id on the server (None before the first write)."""
        return None if self._storage is None else self._storage._td_id

    def close(self) -> None:
        """Close the connection to the server (the data stays there)."""
        if self._storage is not None:
            self._storage.close()

    # ------------------------------------------------------------------ write / read
    def set(self, cursor, data, *, set_cursor: bool = True):
        if isinstance(data, list):
            data = D.stack_items(data)
        cursor = D.as_long_index(cursor)
        single = isinstance(cursor, int)
        if not self.initialized:
            self._init(data if single else D.first(data))
        if isinstance(cursor, torch.Tensor) and cursor.ndim == 1 and cursor.numel() > self.max_size:
            # a batch longer than the ring overwrites itself: only its last items stay
            keep = self.max_size
            cursor, data = cursor[-keep:], D.index(data, slice(-keep, None))
        if set_cursor:
            self.last_cursor = cursor
            n = 1 if single else D.batch_len(data)
            self._len = min(self._len + n, self.max_size)
        if is_tensorclass(data):
            data = data.to_tensordict()
        if self._is_tensor:
            data = TensorDict({_TENSOR: data}, batch_size=data.shape[: 0 if single else 1])
        self._storage[cursor] = data
        self._bump()

    def _stored_index(self, index):
        """Slices select among the stored items (as the tensor storages do)."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, slice):
            return torch.arange(self._len)[index]
        return D.as_long_index(index)

    def get(self, index) -> Any:
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        out = self._storage[self._stored_index(index)]
        if self._is_tensor:
            return out.get(_TENSOR)
        if self._tensorclass_type is not None:
            return self._tensorclass_type.from_tensordict(out)
        return out

    def __len__(self) -> int:
        return self._len

    def _empty(self) -> None:
        self._len = 0
        self.last_cursor = None
        self._bump()

    def contains(self, item):
        n = self._len
        if isinstance(item, int):
            item = item + n if item < 0 else item
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            if item.dtype == torch.bool:
                return item.sum() <= n
            return (item >= -n) & (item < n)
        raise NotImplementedError(
            f"StoreStorage.contains: type {type(item).__name__} is not "
            "supported; pass an int or a tensor of indices."
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """How to reconnect: the server, the store's id and the length (not the data)."""
        return {
            "initialized": self.initialized,
            "_len": self._len,
            "_backend": self._backend,
            "_host": self._host,
            "_port": self._port,
            "_db": self._db,
            "_store_kwargs": {k: v for k, v in self._store_kwargs.items() if k != "client"},
            "_td_id": self.td_id,
            "_is_tensor": self._is_tensor,
            "_tensorclass_type": self._tensorclass_type,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reconnect to the store a ``state_dict`` names (this storage's own connection
        arguments, e.g. ``client=``, are kept)."""
        self._len = int(state_dict["_len"])
        self.initialized = bool(state_dict["initialized"])
        self._is_tensor = bool(state_dict.get("_is_tensor", False))
        self._tensorclass_type = state_dict.get("_tensorclass_type")
        td_id = state_dict.get("_td_id")
        if td_id is not None and self.initialized:
            self._storage = self._connect(td_id)
        elif self.initialized:
            raise ValueError(
                "StoreStorage.load_state_dict: the state says the storage was "
                "initialized but names no store (_td_id is None); pass a "
                "state_dict saved by StoreStorage.state_dict()."
            )
        self._bump()

    def __repr__(self) -> str:
        data = f"data=TensorDictStore(td_id={self.td_id!r})" if self.initialized else "data=<empty>"
        lines = [
            data,
            f"len={len(self)}",
            f"max_size={self.max_size}",
            f"backend={self._backend!r}, host={self._host!r}, port={self._port}",
        ]
        body = ", \n".join(textwrap.indent(x, 4 * " ") for x in lines)
        return f"{type(self).__name__}(\n{body})"
