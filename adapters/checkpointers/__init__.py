"""Storage checkpointers under TorchRL's names: each owns a storage's on-disk format.

A storage's ``dumps(path)`` / ``loads(path)`` call ``storage.checkpointer.dumps(storage, path)``
/ ``loads(storage, path)``; the hooks a buffer registers (``register_save_hook``) belong to the
checkpointer, as in TorchRL. The files are TorchRL's, byte for byte (see
:mod:`functional_rb.adapters.serialization`), so TorchRL loads what we write and we load what it
writes. One module per family: :mod:`.base` (``StorageCheckpointerBase``), :mod:`.tensor`,
:mod:`.list`, :mod:`.nested`, :mod:`.ensemble`.
"""

from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase, read_storage_metadata
from functional_rb.adapters.checkpointers.ensemble import StorageEnsembleCheckpointer
from functional_rb.adapters.checkpointers.list import (
    CompressedListStorageCheckpointer,
    ListStorageCheckpointer,
)
from functional_rb.adapters.checkpointers.nested import (
    H5StorageCheckpointer,
    NestedStorageCheckpointer,
)
from functional_rb.adapters.checkpointers.tensor import (
    FlatStorageCheckpointer,
    TensorStorageCheckpointer,
)

__all__ = [
    "StorageCheckpointerBase",
    "ListStorageCheckpointer",
    "TensorStorageCheckpointer",
    "FlatStorageCheckpointer",
    "CompressedListStorageCheckpointer",
    "StorageEnsembleCheckpointer",
    "NestedStorageCheckpointer",
    "H5StorageCheckpointer",
]
