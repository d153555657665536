"""The component protocol, for writing or driving storages, writers and samplers.

Users of :class:`~functional_rb.ReplayBuffer` never need these names; code that builds its own
component, or calls components directly (the torch adapters, sharded buffers), does. The
definitions and their contracts are in :mod:`functional_rb.base`.
"""

from functional_rb._internal.layout import Context, Layout
from functional_rb.base import Drawn, Sampler, Storage, Writer, WriteRecord

__all__ = (
    "Context",
    "Drawn",
    "Layout",
    "Sampler",
    "Storage",
    "WriteRecord",
    "Writer",
)
