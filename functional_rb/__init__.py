"""functional_rb: replay buffers as pure functions over JAX PyTrees.

The names below are imported on first use, so ``import functional_rb.adapters`` (whose common
paths run on torch and NumPy) does not pay for importing JAX until a core name is touched.
"""

from typing import TYPE_CHECKING

from functional_rb._internal.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> "module" (a namespace) or "module:attribute"
_EXPORTS = {
    # the buffer
    "BufferState": "functional_rb.base:BufferState",
    "ReplayBuffer": "functional_rb.buffer:ReplayBuffer",
    "Sample": "functional_rb.base:Sample",
    "ShardedReplayBuffer": "functional_rb.sharded:ShardedReplayBuffer",
    "ShardedState": "functional_rb.sharded:ShardedState",
    "RateLimiter": "functional_rb.rate_limiter:RateLimiter",
    "Mixer": "functional_rb.mixer:Mixer",
    # the trajectory queue
    "QueueState": "functional_rb.queue:QueueState",
    "TrajectoryQueue": "functional_rb.queue:TrajectoryQueue",
    # samplers
    "EpisodeSampler": "functional_rb.samplers.episodes:EpisodeSampler",
    "PrioritizedSampler": "functional_rb.samplers.prioritized:PrioritizedSampler",
    "PrioritizedSequenceSampler": "functional_rb.samplers.sequences:PrioritizedSequenceSampler",
    "PrioritizedSliceSampler": "functional_rb.samplers.prioritized_slices:PrioritizedSliceSampler",
    "RandomSampler": "functional_rb.samplers.uniform:RandomSampler",
    "SampleOnceSampler": "functional_rb.samplers.once:SampleOnceSampler",
    "SamplerWithoutReplacement": "functional_rb.samplers.uniform:SamplerWithoutReplacement",
    "SequenceSampler": "functional_rb.samplers.sequences:SequenceSampler",
    "SliceSampler": "functional_rb.samplers.slices:SliceSampler",
    "SliceSamplerWithoutReplacement": "functional_rb.samplers.slices:SliceSamplerWithoutReplacement",
    "StalenessAwareSampler": "functional_rb.samplers.staleness:StalenessAwareSampler",
    # writers
    "ImmutableWriter": "functional_rb.writers:ImmutableWriter",
    "MaxValueWriter": "functional_rb.writers:MaxValueWriter",
    "RoundRobinWriter": "functional_rb.writers:RoundRobinWriter",
    # storages
    "DeviceStorage": "functional_rb.storages.device:DeviceStorage",
    "MemmapStorage": "functional_rb.storages.memmap:MemmapStorage",
    "TEDStorage": "functional_rb.ted:TEDStorage",
    # component states
    "DeviceStorageState": "functional_rb.storages.device:DeviceStorageState",
    "EmptySamplerState": "functional_rb.samplers.uniform:EmptySamplerState",
    "MaxValueState": "functional_rb.writers:MaxValueState",
    "MemmapStorageState": "functional_rb.storages.memmap:MemmapStorageState",
    "PackedStorageState": "functional_rb.storages.device:PackedStorageState",
    "PrioritizedSliceState": "functional_rb.samplers.prioritized_slices:PrioritizedSliceState",
    "PrioritizedState": "functional_rb.samplers.prioritized:PrioritizedState",
    "RateLimiterState": "functional_rb.rate_limiter:RateLimiterState",
    "RoundRobinState": "functional_rb.writers:RoundRobinState",
    "SampleOnceState": "functional_rb.samplers.once:SampleOnceState",
    "SequenceState": "functional_rb.samplers.sequences:SequenceState",
    "SliceState": "functional_rb.samplers.trajectories:SliceState",
    "SliceWithoutReplacementState": "functional_rb.samplers.slices:SliceWithoutReplacementState",
    "StalenessState": "functional_rb.samplers.staleness:StalenessState",
    "TEDStorageState": "functional_rb.ted:TEDStorageState",
    "WithoutReplacementState": "functional_rb.samplers.uniform:WithoutReplacementState",
    # namespaces
    "checkpoint": "functional_rb.checkpoint",
    "errors": "functional_rb.errors",
    "mixer": "functional_rb.mixer",
    "priorities": "functional_rb.samplers.priorities",
    "protocol": "functional_rb.protocol",
    "sharded": "functional_rb.sharded",
    "sum_tree": "functional_rb.samplers.sum_tree",
    "ted": "functional_rb.ted",
    "vault": "functional_rb.vault",
}

__all__ = tuple(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, imported, for type checkers and the API docs
    from functional_rb import checkpoint, errors, mixer, protocol, sharded, ted, vault
    from functional_rb.base import BufferState, Sample
    from functional_rb.buffer import ReplayBuffer
    from functional_rb.mixer import Mixer
    from functional_rb.queue import QueueState, TrajectoryQueue
    from functional_rb.rate_limiter import RateLimiter, RateLimiterState
    from functional_rb.samplers import priorities, sum_tree
    from functional_rb.samplers.episodes import EpisodeSampler
    from functional_rb.samplers.once import SampleOnceSampler, SampleOnceState
    from functional_rb.samplers.prioritized import PrioritizedSampler, PrioritizedState
    from functional_rb.samplers.prioritized_slices import (
        PrioritizedSliceSampler,
        PrioritizedSliceState,
    )
    from functional_rb.samplers.sequences import (
        PrioritizedSequenceSampler,
        SequenceSampler,
        SequenceState,
    )
    from functional_rb.samplers.slices import (
        SliceSampler,
        SliceSamplerWithoutReplacement,
        SliceWithoutReplacementState,
    )
    from functional_rb.samplers.staleness import StalenessAwareSampler, StalenessState
    from functional_rb.samplers.trajectories import SliceState
    from functional_rb.samplers.uniform import (
        EmptySamplerState,
        RandomSampler,
        SamplerWithoutReplacement,
        WithoutReplacementState,
    )
    from functional_rb.sharded import ShardedReplayBuffer, ShardedState
    from functional_rb.storages.device import DeviceStorage, DeviceStorageState, PackedStorageState
    from functional_rb.storages.memmap import MemmapStorage, MemmapStorageState
    from functional_rb.ted import TEDStorage, TEDStorageState
    from functional_rb.writers import (
        ImmutableWriter,
        MaxValueState,
        MaxValueWriter,
        RoundRobinState,
        RoundRobinWriter,
    )

from functional_rb._moved import install as _install_old_paths  # noqa: E402

_install_old_paths()
