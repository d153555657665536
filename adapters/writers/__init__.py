"""Writers under TorchRL's names (``torchrl.data.replay_buffers.writers``): where new items go.
One module per family: :mod:`.base` (``Writer``), :mod:`.round_robin`, :mod:`.max_value`,
:mod:`.immutable`, :mod:`.ensemble`."""

from functional_rb.adapters.writers.base import Writer
from functional_rb.adapters.writers.ensemble import WriterEnsemble
from functional_rb.adapters.writers.immutable import ImmutableDatasetWriter
from functional_rb.adapters.writers.max_value import TensorDictMaxValueWriter
from functional_rb.adapters.writers.round_robin import RoundRobinWriter, TensorDictRoundRobinWriter

__all__ = [
    "Writer",
    "RoundRobinWriter",
    "TensorDictRoundRobinWriter",
    "TensorDictMaxValueWriter",
    "ImmutableDatasetWriter",
    "WriterEnsemble",
]
