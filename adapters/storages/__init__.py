"""Storages under TorchRL's names (``torchrl.data.replay_buffers.storages``): where the data
lives, in torch. One module per family: :mod:`.base` (``Storage``), :mod:`.tensor`,
:mod:`.memmap`, :mod:`.list`, :mod:`.store`, :mod:`.ensemble`."""

from functional_rb.adapters.storages.base import Storage
from functional_rb.adapters.storages.ensemble import StorageEnsemble
from functional_rb.adapters.storages.list import (
    CompressedListStorage,
    LazyStackStorage,
    ListStorage,
)
from functional_rb.adapters.storages.memmap import LazyMemmapStorage
from functional_rb.adapters.storages.store import StoreStorage
from functional_rb.adapters.storages.tensor import LazyTensorStorage, TensorStorage

__all__ = [
    "Storage",
    "TensorStorage",
    "LazyTensorStorage",
    "LazyMemmapStorage",
    "ListStorage",
    "LazyStackStorage",
    "CompressedListStorage",
    "StoreStorage",
    "StorageEnsemble",
]
