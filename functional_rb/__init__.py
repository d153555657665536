"""functional_rb: replay buffers as pure functions over JAX PyTrees."""
import os as _os

# The top-level adapters/ directory is installed as functional_rb.adapters. Imported from a
# source checkout (the repository root on sys.path: `python -c`, `python -m pytest`, a forkserver
# child), this package has no adapters/ beside its modules; resolve functional_rb.adapters to the
# checkout's adapters/ as the install does. An installed package has its own and is untouched.
_pkg = __path__[0]
if (not _os.path.isdir(_os.path.join(_pkg, "adapters"))
        and _os.path.isfile(_os.path.join(_os.path.dirname(_pkg), "adapters", "__init__.py"))):
    __path__.append(_os.path.dirname(_pkg))
del _pkg

from functional_rb import checkpoint
from functional_rb import priorities
from functional_rb import protocol
from functional_rb import sharded
from functional_rb import sum_tree
from functional_rb import ted
from functional_rb.buffer import BufferState
from functional_rb.buffer import ReplayBuffer
from functional_rb.buffer import Sample
from functional_rb.memmap import MemmapStorage
from functional_rb.memmap import MemmapStorageState
from functional_rb.prioritized import PrioritizedSampler
from functional_rb.prioritized import PrioritizedState
from functional_rb.prioritized_slices import PrioritizedSliceSampler
from functional_rb.prioritized_slices import PrioritizedSliceState
from functional_rb.rate_limiter import RateLimiter
from functional_rb.rate_limiter import RateLimiterState
from functional_rb.samplers import EmptySamplerState
from functional_rb.samplers import RandomSampler
from functional_rb.samplers import SamplerWithoutReplacement
from functional_rb.samplers import WithoutReplacementState
from functional_rb.sharded import ShardedReplayBuffer
from functional_rb.sharded import ShardedState
from functional_rb.slices import SliceSampler
from functional_rb.slices import SliceSamplerWithoutReplacement
from functional_rb.slices import SliceWithoutReplacementState
from functional_rb.staleness import StalenessAwareSampler
from functional_rb.staleness import StalenessState
from functional_rb.storages import DeviceStorage
from functional_rb.storages import DeviceStorageState
from functional_rb.storages import PackedStorageState
from functional_rb.ted import TEDStorage
from functional_rb.ted import TEDStorageState
from functional_rb.trajectories import SliceState
from functional_rb.writers import ImmutableWriter
from functional_rb.writers import MaxValueState
from functional_rb.writers import MaxValueWriter
from functional_rb.writers import RoundRobinState
from functional_rb.writers import RoundRobinWriter

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
