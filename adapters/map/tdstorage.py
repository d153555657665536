"""TorchRL's ``TensorMap`` and ``TensorDictMap`` (``torchrl.data.map.tdstorage``): a dictionary
from some entries of a TensorDict (the key rows) to a TensorDict of values, kept in one of our
storages.

A write hashes the key rows with the map's :class:`~functional_rb.adapters.QueryModule`, which
numbers new keys from the front of the storage, and writes the values at those slots; a read
hashes the rows the same way and reads the slots. Where TorchRL differs, ours is the map's own
count: an overwrite does not grow ``len`` (TorchRL's ``LazyTensorStorage`` counts every write,
after which ``contains`` takes an unknown key for a stored one), ``clear`` empties the storage
and forgets the keys (TorchRL's raises ``AttributeError``), reading an unknown key raises an
``IndexError`` that says so, and a write of more new keys than the storage holds raises before
anything is recorded.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from tensordict import NestedKey, TensorDictBase, is_tensor_collection, unravel_key_list
from tensordict.nn.common import TensorDictModuleBase

from functional_rb.adapters.map.hash import (
    N_COMPONENTS_DEFAULT,
    RandomProjectionHash,
    SipHash,
)
from functional_rb.adapters.map.query import QueryModule
from functional_rb.adapters.storages import LazyTensorStorage, TensorStorage

__all__ = ["TensorDictMap", "TensorMap"]

K = TypeVar("K")
V = TypeVar("V")


class TensorMap(abc.ABC, Generic[K, V]):
    """What a map from tensors to values does (TorchRL's ``TensorMap``): ``m[key]``,
    ``m[key] = value``, ``len(m)``, ``m.contains(key)`` (one boolean per row; also ``key in
    m``) and ``m.clear()``."""

    @abc.abstractmethod
    def clear(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def __getitem__(self, item: K) -> V:
        raise NotImplementedError

    @abc.abstractmethod
    def __setitem__(self, key: K, value: V) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def __len__(self) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def contains(self, item: K) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, item) -> bool:
        return self.contains(item)


def _default_collate(storage) -> Callable:
    collate = getattr(storage, "default_collate", None)
    if collate is None:
        raise NotImplementedError(
            f"Could not find a default collate_fn for storage {type(storage)}. TensorDictMap: "
            "use a functional_rb.adapters storage (LazyTensorStorage, ListStorage, ...) or "
            "pass collate_fn=..."
        )
    return collate


class TensorDictMap(TensorDictModuleBase, TensorMap[TensorDictModuleBase, TensorDictModuleBase]):
    """A map from the ``in_keys`` entries of a TensorDict's rows to a TensorDict of values
    (TorchRL's ``TensorDictMap``).

    Keyword Args:
      query_module: the :class:`~functional_rb.adapters.QueryModule` that gives each row its
        slot; its ``in_keys`` are the map's.
      storage: where the values live (:class:`~functional_rb.adapters.LazyTensorStorage`,
        :class:`~functional_rb.adapters.ListStorage`, ...); its ``max_size`` is the map's.
      collate_fn: merges what the storage returns into a batch. Defaults to the storage's
        ``default_collate`` (identity for tensor storages, a stack for ``ListStorage``).
      out_keys: the value entries that are stored (others are dropped at writes). Defaults
        to the keys of the stored TensorDict, known after the first write to a tensor
        storage.
      write_fn: when given, writes store ``write_fn(new)`` for new keys and
        ``write_fn(new, stored)`` for keys already in the map (e.g. to accumulate visits).

    ``m[td] = values`` writes the slot and hash into ``td`` (at the query module's
    ``index_key`` and ``hash_key``), as TorchRL's does; a TensorDict without batch dims is one
    row. Rows with the same key in one write: the last one wins (each one in turn with a
    ``write_fn``).
    """

    def __init__(
        self,
        *,
        query_module: QueryModule,
        storage,
        collate_fn: Callable[[Any], Any] | None = None,
        out_keys: list[NestedKey] | None = None,
        write_fn: Callable[[Any, Any], Any] | None = None,
    ):
        super().__init__()
        self.in_keys = query_module.in_keys
        if out_keys is not None:
            self.out_keys = out_keys
        self.query_module = query_module
        self.index_key = query_module.index_key
        self.storage = storage
        self.collate_fn = _default_collate(storage) if collate_fn is None else collate_fn
        self.write_fn = write_fn

    @property
    def max_size(self) -> int:
        return self.storage.max_size

    @property
    def out_keys(self) -> list[NestedKey]:
        known = self.__dict__.get("_out_keys_and_lazy")
        if known is not None:
            return known[0]
        data = self.storage.data if isinstance(self.storage, TensorStorage) else None
        if is_tensor_collection(data):  # learnt from the storage once it holds a TensorDict
            keys = list(data.keys(True, True))
            self._out_keys_and_lazy = (keys, True)
            return keys
        raise AttributeError(f"No out-keys found in the storage of type {type(self.storage)}")

    @out_keys.setter
    def out_keys(self, value) -> None:
        self._out_keys_and_lazy = (unravel_key_list(list(value)), False)

    def _has_lazy_out_keys(self) -> bool:
        """Whether the out-keys are (or will be) read from the storage, not given."""
        known = self.__dict__.get("_out_keys_and_lazy")
        return known is None or known[1]

    @classmethod
    def from_tensordict_pair(
        cls,
        source,
        dest,
        in_keys: list[NestedKey],
        out_keys: list[NestedKey] | None = None,
        max_size: int | None = None,
        storage_constructor: Callable | None = None,
        hash_module: Callable | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        write_fn: Callable[[Any, Any], Any] | None = None,
        consolidated: bool | None = None,
    ) -> TensorDictMap:
        """A map from ``source``'s ``in_keys`` to TensorDicts like ``dest`` (TorchRL's rules).

        Args:
          source: an example key TensorDict (its in-key entries choose the hash modules).
          dest: an example value TensorDict.
          in_keys: the key entries.
          out_keys: the value entries to store (all of them when None).
          max_size: the capacity of the default storage, a
            :class:`~functional_rb.adapters.LazyTensorStorage` (1000 when None). Not with
            ``storage_constructor``, whose storage sets its own.
          storage_constructor: builds the storage, called with no argument (and
            ``consolidated=`` when given).
          hash_module: the query's hash module; by default per in-key a
            :class:`SipHash`, or a :class:`RandomProjectionHash` for entries of more than 16
            features.
          collate_fn: as the constructor's.
          write_fn: as the constructor's.
          consolidated: whether the storage keeps its TensorDict consolidated.
        """
        del dest  # TorchRL's signature: the storage learns the values' layout at the first write
        if storage_constructor is not None and max_size is not None:
            raise ValueError(
                f"TensorDictMap.from_tensordict_pair: max_size={max_size} is used only by the "
                "default storage, and storage_constructor was given. Set the capacity in the "
                "constructor (functools.partial(LazyTensorStorage, max_size)) and leave "
                "max_size out."
            )
        if hash_module is None:
            hash_module = [_default_hash(source, key) for key in in_keys]
        query_module = QueryModule(in_keys, hash_module=hash_module)
        if storage_constructor is None:
            storage_constructor = functools.partial(
                LazyTensorStorage,
                1000 if max_size is None else max_size,
                consolidated=bool(consolidated),
            )
        elif consolidated is not None:
            storage_constructor = functools.partial(storage_constructor, consolidated=consolidated)
        return cls(
            query_module=query_module,
            storage=storage_constructor(),
            collate_fn=collate_fn,
            out_keys=out_keys,
            write_fn=write_fn,
        )

    def clear(self) -> None:
        """Empties the storage and forgets every key."""
        hash_to_int = self.query_module.hash_to_int
        if not callable(getattr(hash_to_int, "clear", None)):
            raise TypeError(
                f"TensorDictMap.clear: the query module's hash_to_int "
                f"({type(hash_to_int).__name__}) has no clear() method, so the keys it has "
                "numbered would point into the emptied storage. Give it a clear() method, or "
                "build a new map."
            )
        self.storage.empty()
        hash_to_int.clear()

    def _query(self, item: TensorDictBase, extend: bool, clone: bool | None):
        return self.query_module(item, extend=extend, clone=clone)

    def __getitem__(self, item: TensorDictBase) -> TensorDictBase:
        item, unbatched = _batched(item.copy())
        index = self._query(item, extend=False, clone=False)[self.index_key]
        found = self.storage.contains(index)
        if not bool(torch.as_tensor(found).all()):
            missing = int((~torch.as_tensor(found)).sum())
            raise IndexError(
                f"TensorDictMap.__getitem__: {missing} of the {index.numel()} queried keys are "
                f"not in the map (it holds {len(self)}). Check with map.contains(td) first, or "
                "write them with map[td] = values."
            )
        res = self.collate_fn(self.storage[index])
        return res.squeeze(0) if unbatched else res

    def __setitem__(self, item: TensorDictBase, value: TensorDictBase) -> None:
        if not self._has_lazy_out_keys():
            value = value.select(*self.out_keys, strict=False)
        item, unbatched = _batched(item)
        if unbatched:
            value = value.unsqueeze(0)
        self._check_room(item)
        index = self._query(item, extend=True, clone=None)[self.index_key]
        if index.unique().numel() < index.numel():
            self._write_duplicates(item, value, index)
            return
        self._write(index, value)

    def _check_room(self, item: TensorDictBase) -> None:
        """Raises before any key is numbered when the new keys would not fit."""
        free = self.max_size - len(self)
        if item.shape[0] <= free:
            return
        probe = self.query_module(item, extend=False, clone=True)
        hashes = probe.get(self.query_module.hash_key)
        new = ~torch.as_tensor(self.storage.contains(probe[self.index_key]))
        n_new = hashes[new].unique().numel() if isinstance(hashes, torch.Tensor) else int(new.sum())
        if n_new > free:
            raise IndexError(
                f"TensorDictMap.__setitem__: {n_new} new keys do not fit: the map holds "
                f"{len(self)} of max_size={self.max_size}. Use a larger storage, or clear() "
                "the map."
            )

    def _write_duplicates(self, item, value, index) -> None:
        if self.write_fn is not None:  # each row sees the previous rows' writes
            for it, val in zip(item.split(1), value.split(1)):
                self[it] = val
            return
        # the last row of each key wins, as writing them in turn would leave it
        uniq, inverse = index.unique(return_inverse=True)
        rows = torch.arange(index.numel(), device=index.device)
        last = torch.zeros_like(uniq).scatter_reduce(0, inverse, rows, reduce="amax")
        self._write(index[last], value[last])

    def _write(self, index: torch.Tensor, value: TensorDictBase) -> None:
        stored = (
            torch.as_tensor(self.storage.contains(index))
            if len(self)
            else torch.zeros(index.shape, dtype=torch.bool, device=index.device)
        )
        if self.write_fn is not None:
            value = self._apply_write_fn(index, value, stored)
        if stored.all():
            self.storage[index] = value  # an overwrite: the count stays
        elif not stored.any():
            self.storage.set(index, value)
        else:
            self.storage[index[stored]] = value[stored]
            self.storage.set(index[~stored], value[~stored])

    def _apply_write_fn(self, index, value, stored):
        if not stored.any():
            return self.write_fn(value)
        previous = self.collate_fn(self.storage[index[stored]])
        result = value.empty()
        result[stored] = self.write_fn(value[stored], previous)
        if not stored.all():
            result[~stored] = self.write_fn(value[~stored])
        return result

    def __len__(self) -> int:
        return len(self.storage)

    def contains(self, item: TensorDictBase) -> torch.Tensor:
        """One boolean per row of ``item``: whether its key is in the map (a 0-dim tensor for
        a TensorDict without batch dims)."""
        item, unbatched = _batched(item)
        index = self._query(item, extend=False, clone=True)[self.index_key]
        res = self.storage.contains(index)
        return res.squeeze(0) if unbatched else res


def _batched(item: TensorDictBase) -> tuple[TensorDictBase, bool]:
    """A TensorDict without batch dims is one row."""
    if item.batch_dims == 0:
        return item.unsqueeze(0), True
    return item, False


def _default_hash(source: TensorDictBase, key: NestedKey):
    """TorchRL's rule: a projection for entries of more features than it keeps."""
    entry = source[key]
    n_feat = 0 if entry.ndim == source.ndim else entry.shape[-1]
    if n_feat > N_COMPONENTS_DEFAULT:
        return RandomProjectionHash()
    return SipHash()
