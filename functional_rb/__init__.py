"""functional_rb: replay buffers as pure functions over JAX PyTrees.

The names below are imported on first use, so ``import functional_rb.adapters`` (whose common
paths run on torch and NumPy) does not pay for importing JAX until a core name is touched.
"""

from typing import TYPE_CHECKING

from functional_rb._internal.lazy import lazy_exports_from_type_checking

__version__ = "0.1.0"

# The public names, each written once: type checkers and the API docs read these imports;
# at run time they do not run, lazy_exports_from_type_checking reads them from this file and
# imports each name the first time it is read (``__all__`` is these names).
if TYPE_CHECKING:
    from functional_rb import checkpoint, errors, mixer, protocol, sharded, ted, vault
    from functional_rb.buffer import ReplayBuffer
    from functional_rb.mixer import Mixer
    from functional_rb.protocol import BufferState, Sample
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
    from functional_rb.storages.host import HostStorage, HostStorageState
    from functional_rb.storages.memmap import MemmapStorage, MemmapStorageState
    from functional_rb.ted import TEDStorage, TEDStorageState
    from functional_rb.writers import (
        ImmutableWriter,
        MaxValueState,
        MaxValueWriter,
        RoundRobinState,
        RoundRobinWriter,
    )

__all__, __getattr__, __dir__ = lazy_exports_from_type_checking(__name__)

from functional_rb._moved import install as _install_old_paths  # noqa: E402

_install_old_paths()
