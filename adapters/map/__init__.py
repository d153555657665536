"""TorchRL's ``torchrl.data.map``: maps from TensorDict entries to stored values, and the hash
modules that key them.

``hash`` holds the hash modules (``SipHash``, ``RandomProjectionHash``, ``BinaryToDecimal``),
whose values equal TorchRL's; ``query`` turns a TensorDict's entries into storage slots
(``QueryModule``, ``HashToInt``); ``tdstorage`` is the map itself (``TensorMap``,
``TensorDictMap``), kept in one of the adapters' storages. TorchRL's ``MCTSForest`` and ``Tree``
are not provided (TorchRL's own keep working with TorchRL's map).
"""

from functional_rb.adapters.map.hash import BinaryToDecimal, RandomProjectionHash, SipHash
from functional_rb.adapters.map.query import HashToInt, QueryModule
from functional_rb.adapters.map.tdstorage import TensorDictMap, TensorMap

__all__ = (
    "BinaryToDecimal",
    "HashToInt",
    "QueryModule",
    "RandomProjectionHash",
    "SipHash",
    "TensorDictMap",
    "TensorMap",
)
