"""functional_rb.adapters: TorchRL-compatible classes backed by the functional core.

Importing this package requires torch and tensordict (``pip install functional-rb[torch]``).
The classes take TorchRL's constructor arguments and offer its methods; the data lives in the
functional core's state (JAX arrays), in numpy memmaps (LazyMemmapStorage) or in a Python list
(ListStorage), and every write/sample/priority update is a jitted call of the core's pure
functions.
"""
from functional_rb.adapters._buffer import PrioritizedReplayBuffer
from functional_rb.adapters._buffer import ReplayBuffer
from functional_rb.adapters._buffer import TensorDictPrioritizedReplayBuffer
from functional_rb.adapters._buffer import TensorDictReplayBuffer
from functional_rb.adapters._components import ImmutableDatasetWriter
from functional_rb.adapters._components import LazyMemmapStorage
from functional_rb.adapters._components import LazyTensorStorage
from functional_rb.adapters._components import ListStorage
from functional_rb.adapters._components import PrioritizedSampler
from functional_rb.adapters._components import PrioritizedSliceSampler
from functional_rb.adapters._components import RandomSampler
from functional_rb.adapters._components import RoundRobinWriter
from functional_rb.adapters._components import Sampler
from functional_rb.adapters._components import SamplerWithoutReplacement
from functional_rb.adapters._components import SliceSampler
from functional_rb.adapters._components import SliceSamplerWithoutReplacement
from functional_rb.adapters._components import Storage
from functional_rb.adapters._components import TensorDictMaxValueWriter
from functional_rb.adapters._components import TensorDictRoundRobinWriter
from functional_rb.adapters._components import TensorStorage
from functional_rb.adapters._components import Writer
from functional_rb.adapters._ensemble import ReplayBufferEnsemble
from functional_rb.adapters._ensemble import ReplayBufferTrainer
# -- interop --
from functional_rb.adapters.ted_hooks import Flat2TED, TED2Flat

__all__ = (
    "ImmutableDatasetWriter",
    "LazyMemmapStorage",
    "LazyTensorStorage",
    "ListStorage",
    "PrioritizedReplayBuffer",
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "RandomSampler",
    "ReplayBuffer",
    "ReplayBufferEnsemble",
    "ReplayBufferTrainer",
    "RoundRobinWriter",
    "Sampler",
    "SamplerWithoutReplacement",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "Storage",
    "TensorDictMaxValueWriter",
    "TensorDictPrioritizedReplayBuffer",
    "TensorDictReplayBuffer",
    "TensorDictRoundRobinWriter",
    "TensorStorage",
    "Writer",
    # -- interop --
    "Flat2TED",
    "TED2Flat",
)
