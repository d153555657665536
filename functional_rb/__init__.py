"""functional_rb: replay buffers as pure functions over JAX PyTrees."""
from functional_rb import checkpoint
from functional_rb import protocol
from functional_rb import sharded
from functional_rb import ted
from functional_rb.base import BufferState
from functional_rb.base import Sample
from functional_rb.buffer import ReplayBuffer
from functional_rb.rate_limiter import RateLimiter
from functional_rb.rate_limiter import RateLimiterState
from functional_rb.samplers import priorities
from functional_rb.samplers import sum_tree
from functional_rb.samplers.prioritized import PrioritizedSampler
from functional_rb.samplers.prioritized import PrioritizedState
from functional_rb.samplers.prioritized_slices import PrioritizedSliceSampler
from functional_rb.samplers.prioritized_slices import PrioritizedSliceState
from functional_rb.samplers.slices import SliceSampler
from functional_rb.samplers.slices import SliceSamplerWithoutReplacement
from functional_rb.samplers.slices import SliceWithoutReplacementState
from functional_rb.samplers.staleness import StalenessAwareSampler
from functional_rb.samplers.staleness import StalenessState
from functional_rb.samplers.trajectories import SliceState
from functional_rb.samplers.uniform import EmptySamplerState
from functional_rb.samplers.uniform import RandomSampler
from functional_rb.samplers.uniform import SamplerWithoutReplacement
from functional_rb.samplers.uniform import WithoutReplacementState
from functional_rb.sharded import ShardedReplayBuffer
from functional_rb.sharded import ShardedState
from functional_rb.storages.device import DeviceStorage
from functional_rb.storages.device import DeviceStorageState
from functional_rb.storages.device import PackedStorageState
from functional_rb.storages.memmap import MemmapStorage
from functional_rb.storages.memmap import MemmapStorageState
from functional_rb.ted import TEDStorage
from functional_rb.ted import TEDStorageState
from functional_rb.writers import ImmutableWriter
from functional_rb.writers import MaxValueState
from functional_rb.writers import MaxValueWriter
from functional_rb.writers import RoundRobinState
from functional_rb.writers import RoundRobinWriter
from functional_rb import _moved  # noqa: F401  (registers the old module paths)

__version__ = "0.1.0"

__all__ = (
    # the buffer
    "BufferState",
    "ReplayBuffer",
    "Sample",
    "ShardedReplayBuffer",
    "ShardedState",
    "RateLimiter",
    # samplers
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "StalenessAwareSampler",
    # writers
    "ImmutableWriter",
    "MaxValueWriter",
    "RoundRobinWriter",
    # storages
    "DeviceStorage",
    "MemmapStorage",
    "TEDStorage",
    # component states
    "DeviceStorageState",
    "EmptySamplerState",
    "MaxValueState",
    "MemmapStorageState",
    "PackedStorageState",
    "PrioritizedSliceState",
    "PrioritizedState",
    "RateLimiterState",
    "RoundRobinState",
    "SliceState",
    "SliceWithoutReplacementState",
    "StalenessState",
    "TEDStorageState",
    "WithoutReplacementState",
    # namespaces
    "checkpoint",
    "priorities",
    "protocol",
    "sharded",
    "sum_tree",
    "ted",
)
