"""Storages: where items live (the protocol: :class:`functional_rb.protocol.Storage`).

:mod:`~functional_rb.storages.device` keeps items in JAX arrays (packed rows or one array per
leaf); :mod:`~functional_rb.storages.host` in NumPy arrays in this process's memory;
:mod:`~functional_rb.storages.memmap` in NumPy memory-mapped files, committed through
the record of :mod:`~functional_rb.storages.journal`. TED's storage is in :mod:`functional_rb.ted`.
"""

from functional_rb._internal.item_spec import PACK_MAX_WIDTH, ItemSpec
from functional_rb.storages.device import (
    DeviceStorage,
    DeviceStorageState,
    LeafStorage,
    PackedStorage,
    PackedStorageState,
    gather_rows,
    scatter_rows,
)
from functional_rb.storages.host import HostStorage, HostStorageState
from functional_rb.storages.memmap import MemmapStorage, MemmapStorageState

__all__ = (
    "PACK_MAX_WIDTH",
    "DeviceStorage",
    "DeviceStorageState",
    "HostStorage",
    "HostStorageState",
    "ItemSpec",
    "LeafStorage",
    "MemmapStorage",
    "MemmapStorageState",
    "PackedStorage",
    "PackedStorageState",
    "gather_rows",
    "scatter_rows",
)
