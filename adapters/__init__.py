"""functional_rb.adapters: TorchRL's replay-buffer classes, for PyTorch users.

The same names, arguments and behaviour as ``torchrl.data``: switch by changing imports. These
are TorchRL's algorithms written again over torch data, not wrappers of the JAX core: the
storages keep the data as TorchRL does (torch tensors, memory-mapped tensors, Python lists), the
samplers keep their bookkeeping on the host (NumPy segment trees, a host copy of the trajectory
signal) and ask the random generators exactly what TorchRL's ask, so a seed gives TorchRL's
batches. The JAX core serves only ``TensorDictMaxValueWriter``'s ranks, ``HERReplayBuffer``'s
goals, ``MultiStep``'s n-step sums and the TED flat conversions, imported on first use
(``_utils/core.py``): a program that never reaches them never imports JAX.

The packages ``storages``, ``writers``, ``samplers``, ``checkpointers`` and ``replay_buffers``
(the base class in ``base``, one module per family) and the modules ``her``,
``offline_to_online``, ``query``, ``sample_units``, ``scheduler`` mirror
``torchrl.data.replay_buffers``'s; ``postprocs`` mirrors ``torchrl.data.postprocs``, ``map``
``torchrl.data.map``, ``comm`` ``torchrl._comm`` (``service_backend`` / ``transport_backend``,
exported here as ``torchrl`` exports them, and the distributed transport). TorchRL's
trajectory-boundary rule is written once, beside the slice samplers that draw by it
(``samplers.slice``, as in TorchRL); ``boundaries`` applies it for ``find_start_stop_traj`` and
``query``, and ``DEFAULT_DONE_KEYS`` is ``ted_hooks``'s; ``ted_hooks``,
``dlpack`` (torch <-> JAX without copies), ``serialization`` and ``datasets`` (the offline
dataset loaders) complete it. Errors follow one rule (:mod:`functional_rb.adapters.errors`).

Importing this package requires torch and tensordict (from a clone of the repository:
``pip install -c constraints.txt ".[torch]"``).
"""

try:  # first: a bare ModuleNotFoundError from deep in a module would not name the fix
    import tensordict as _tensordict
    import torch as _torch
except ModuleNotFoundError as _missing:
    raise ModuleNotFoundError(
        f"functional_rb.adapters needs PyTorch and TensorDict, and {_missing.name!r} is not "
        'installed. Install the torch extra: pip install "functional_rb[torch]" (from a clone '
        'of the repository: pip install -c constraints.txt ".[torch]").',
        name=_missing.name,
    ) from _missing
del _tensordict, _torch

from functional_rb.adapters import _compilation_cache

# Before any adapter compiles: JAX decides at its first compilation whether to use the
# persistent cache (opt out with FRB_COMPILATION_CACHE=0; see _compilation_cache.py).
_compilation_cache.enable_default()

from functional_rb.adapters import (
    boundaries,
    checkpointers,
    comm,
    postprocs,
    query,
    replay_buffers,
    sample_units,
    samplers,
    scheduler,
    storages,
    ted_hooks,
    writers,
)
from functional_rb.adapters.boundaries import DEFAULT_DONE_KEYS, find_start_stop_traj
from functional_rb.adapters.checkpointers import (
    CompressedListStorageCheckpointer,
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    ListStorageCheckpointer,
    NestedStorageCheckpointer,
    StorageCheckpointerBase,
    StorageEnsembleCheckpointer,
    TensorStorageCheckpointer,
)
from functional_rb.adapters.comm import service_backend, transport_backend
from functional_rb.adapters.her import HERReplayBuffer, HindsightStrategy
from functional_rb.adapters.map import (
    BinaryToDecimal,
    HashToInt,
    QueryModule,
    RandomProjectionHash,
    SipHash,
    TensorDictMap,
    TensorMap,
)
from functional_rb.adapters.offline_to_online import (
    OfflineToOnlineReplayBuffer,
    prefill_replay_buffer,
)
from functional_rb.adapters.postprocs import DensifyReward, MultiStep
from functional_rb.adapters.query import (
    Trajectory,
    TrajectoryPredicate,
    filter_trajectories,
    iter_trajectories,
    traj,
)
from functional_rb.adapters.replay_buffers import (
    ConditionalUpdateResult,
    PrioritizedReplayBuffer,
    RayReplayBuffer,
    RemoteTensorDictReplayBuffer,
    ReplayBuffer,
    ReplayBufferEnsemble,
    ReplayBufferTrainer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from functional_rb.adapters.sample_units import SampleUnit, Sequence, Transition
from functional_rb.adapters.samplers import (
    ConsumingSampler,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    PromptGroupSampler,
    RandomSampler,
    Sampler,
    SamplerEnsemble,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
    StreamingSliceSampler,
)
from functional_rb.adapters.scheduler import (
    LambdaScheduler,
    LinearScheduler,
    ParameterScheduler,
    SchedulerList,
    StepScheduler,
)
from functional_rb.adapters.storages import (
    CompressedListStorage,
    LazyMemmapStorage,
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    Storage,
    StorageEnsemble,
    StoreStorage,
    TensorStorage,
)
from functional_rb.adapters.ted_hooks import (
    Flat2TED,
    H5Combine,
    H5Split,
    Nested2TED,
    TED2Flat,
    TED2Nested,
)
from functional_rb.adapters.writers import (
    ImmutableDatasetWriter,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictRoundRobinWriter,
    Writer,
    WriterEnsemble,
)

__all__ = (
    "CompressedListStorage",
    "ConditionalUpdateResult",
    "ConsumingSampler",
    "Flat2TED",
    "FlatStorageCheckpointer",
    "H5Combine",
    "H5Split",
    "H5StorageCheckpointer",
    "HERReplayBuffer",
    "HindsightStrategy",
    "ImmutableDatasetWriter",
    "LazyMemmapStorage",
    "LazyStackStorage",
    "LazyTensorStorage",
    "ListStorage",
    "ListStorageCheckpointer",
    "Nested2TED",
    "NestedStorageCheckpointer",
    "OfflineToOnlineReplayBuffer",
    "PrioritizedReplayBuffer",
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "PromptGroupSampler",
    "RandomSampler",
    "RayReplayBuffer",
    "RemoteTensorDictReplayBuffer",
    "ReplayBuffer",
    "ReplayBufferEnsemble",
    "ReplayBufferTrainer",
    "RoundRobinWriter",
    "SampleUnit",
    "Sampler",
    "SamplerEnsemble",
    "Sequence",
    "SamplerWithoutReplacement",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "StalenessAwareSampler",
    "StreamingSliceSampler",
    "Storage",
    "StorageCheckpointerBase",
    "StorageEnsemble",
    "StorageEnsembleCheckpointer",
    "StoreStorage",
    "TED2Flat",
    "TED2Nested",
    "TensorDictMaxValueWriter",
    "TensorDictPrioritizedReplayBuffer",
    "TensorDictReplayBuffer",
    "TensorDictRoundRobinWriter",
    "TensorStorage",
    "TensorStorageCheckpointer",
    "Trajectory",
    "TrajectoryPredicate",
    "Transition",
    "Writer",
    "WriterEnsemble",
    "checkpointers",
    "filter_trajectories",
    "iter_trajectories",
    "prefill_replay_buffer",
    "query",
    "sample_units",
    "samplers",
    "storages",
    "traj",
    "writers",
    "boundaries",
    "postprocs",
    "scheduler",
    "CompressedListStorageCheckpointer",
    "DEFAULT_DONE_KEYS",
    "DensifyReward",
    "LambdaScheduler",
    "LinearScheduler",
    "MultiStep",
    "ParameterScheduler",
    "SchedulerList",
    "StepScheduler",
    "find_start_stop_traj",
    "comm",
    "service_backend",
    "transport_backend",
    "BinaryToDecimal",
    "HashToInt",
    "QueryModule",
    "RandomProjectionHash",
    "SipHash",
    "TensorDictMap",
    "TensorMap",
)
