"""functional_rb: replay buffers as pure functions over JAX PyTrees."""

from functional_rb.buffer import BufferState
from functional_rb.buffer import ReplayBuffer
from functional_rb.buffer import Sample
from functional_rb.layout import Context
from functional_rb.layout import Layout
from functional_rb.samplers import Drawn
from functional_rb.samplers import RandomSampler
from functional_rb.samplers import SamplerWithoutReplacement
from functional_rb.storages import DeviceStorage
from functional_rb.writers import ImmutableWriter
from functional_rb.writers import MaxValueWriter
from functional_rb.writers import RoundRobinWriter
# -- prioritized (issue 3) --
from functional_rb import sum_tree
from functional_rb.prioritized import PrioritizedSampler
# -- slices (issue 4) --
from functional_rb.slices import PrioritizedSliceSampler
from functional_rb.slices import SliceSampler
from functional_rb.slices import SliceSamplerWithoutReplacement
# -- ted (issue 5) --
# -- memmap / checkpoint --
from functional_rb.memmap import MemmapStorage
from functional_rb import checkpoint

__version__ = "0.1.0"

__all__ = (
    "BufferState",
    "Context",
    "DeviceStorage",
    "Drawn",
    "ImmutableWriter",
    "Layout",
    "MaxValueWriter",
    "RandomSampler",
    "ReplayBuffer",
    "RoundRobinWriter",
    "Sample",
    "SamplerWithoutReplacement",
    # -- prioritized (issue 3) --
    "PrioritizedSampler",
    "sum_tree",
    # -- slices (issue 4) --
    "PrioritizedSliceSampler",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    # -- ted (issue 5) --
    # -- memmap / checkpoint --
    "MemmapStorage",
    "checkpoint",
)
