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
exported here as ``torchrl`` exports them, and the distributed transport). ``boundaries`` is
the one home of TorchRL's trajectory-boundary rule and ``DEFAULT_DONE_KEYS``
(``find_start_stop_traj``, shared by the slice samplers and ``query``); ``ted_hooks``,
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
        "installed. Install the torch extra: pip install \"functional_rb[torch]\" (from a clone "
        "of the repository: pip install -c constraints.txt \".[torch]\").",
        name=_missing.name) from _missing
del _tensordict, _torch

from functional_rb.adapters import _compilation_cache

# Before any adapter compiles: JAX decides at its first compilation whether to use the
# persistent cache (opt out with FRB_COMPILATION_CACHE=0; see _compilation_cache.py).
_compilation_cache.enable_default()

from functional_rb.adapters import checkpointers
from functional_rb.adapters import comm
from functional_rb.adapters import query
from functional_rb.adapters import replay_buffers
from functional_rb.adapters import sample_units
from functional_rb.adapters import samplers
from functional_rb.adapters import storages
from functional_rb.adapters import ted_hooks
from functional_rb.adapters import writers
from functional_rb.adapters import boundaries
from functional_rb.adapters import postprocs
from functional_rb.adapters import scheduler
from functional_rb.adapters.boundaries import DEFAULT_DONE_KEYS
from functional_rb.adapters.boundaries import find_start_stop_traj
from functional_rb.adapters.checkpointers import CompressedListStorageCheckpointer
from functional_rb.adapters.comm import service_backend
from functional_rb.adapters.comm import transport_backend
from functional_rb.adapters.postprocs import DensifyReward
from functional_rb.adapters.postprocs import MultiStep
from functional_rb.adapters.scheduler import LambdaScheduler
from functional_rb.adapters.scheduler import LinearScheduler
from functional_rb.adapters.scheduler import ParameterScheduler
from functional_rb.adapters.scheduler import SchedulerList
from functional_rb.adapters.scheduler import StepScheduler
from functional_rb.adapters.map import BinaryToDecimal
from functional_rb.adapters.map import HashToInt
from functional_rb.adapters.map import QueryModule
from functional_rb.adapters.map import RandomProjectionHash
from functional_rb.adapters.map import SipHash
from functional_rb.adapters.map import TensorDictMap
from functional_rb.adapters.map import TensorMap
from functional_rb.adapters.replay_buffers import ConditionalUpdateResult
from functional_rb.adapters.samplers import ConsumingSampler
from functional_rb.adapters.replay_buffers import ReplayBufferEnsemble
from functional_rb.adapters.replay_buffers import ReplayBufferTrainer
from functional_rb.adapters.her import HERReplayBuffer
from functional_rb.adapters.her import HindsightStrategy
from functional_rb.adapters.offline_to_online import OfflineToOnlineReplayBuffer
from functional_rb.adapters.offline_to_online import prefill_replay_buffer
from functional_rb.adapters.replay_buffers import PrioritizedReplayBuffer
from functional_rb.adapters.replay_buffers import RayReplayBuffer
from functional_rb.adapters.replay_buffers import RemoteTensorDictReplayBuffer
from functional_rb.adapters.replay_buffers import TensorDictPrioritizedReplayBuffer
from functional_rb.adapters.replay_buffers import TensorDictReplayBuffer
from functional_rb.adapters.checkpointers import FlatStorageCheckpointer
from functional_rb.adapters.checkpointers import H5StorageCheckpointer
from functional_rb.adapters.checkpointers import ListStorageCheckpointer
from functional_rb.adapters.checkpointers import NestedStorageCheckpointer
from functional_rb.adapters.checkpointers import StorageCheckpointerBase
from functional_rb.adapters.checkpointers import StorageEnsembleCheckpointer
from functional_rb.adapters.checkpointers import TensorStorageCheckpointer
from functional_rb.adapters.query import Trajectory
from functional_rb.adapters.query import TrajectoryPredicate
from functional_rb.adapters.query import filter_trajectories
from functional_rb.adapters.query import iter_trajectories
from functional_rb.adapters.query import traj
from functional_rb.adapters.replay_buffers import ReplayBuffer
from functional_rb.adapters.sample_units import SampleUnit
from functional_rb.adapters.sample_units import Sequence
from functional_rb.adapters.sample_units import Transition
from functional_rb.adapters.samplers import PrioritizedSampler
from functional_rb.adapters.samplers import PrioritizedSliceSampler
from functional_rb.adapters.samplers import PromptGroupSampler
from functional_rb.adapters.samplers import RandomSampler
from functional_rb.adapters.samplers import Sampler
from functional_rb.adapters.samplers import SamplerEnsemble
from functional_rb.adapters.samplers import SamplerWithoutReplacement
from functional_rb.adapters.samplers import SliceSampler
from functional_rb.adapters.samplers import SliceSamplerWithoutReplacement
from functional_rb.adapters.samplers import StalenessAwareSampler
from functional_rb.adapters.samplers import StreamingSliceSampler
from functional_rb.adapters.storages import CompressedListStorage
from functional_rb.adapters.storages import LazyMemmapStorage
from functional_rb.adapters.storages import LazyStackStorage
from functional_rb.adapters.storages import LazyTensorStorage
from functional_rb.adapters.storages import ListStorage
from functional_rb.adapters.storages import Storage
from functional_rb.adapters.storages import StorageEnsemble
from functional_rb.adapters.storages import StoreStorage
from functional_rb.adapters.storages import TensorStorage
from functional_rb.adapters.ted_hooks import Flat2TED
from functional_rb.adapters.ted_hooks import H5Combine
from functional_rb.adapters.ted_hooks import H5Split
from functional_rb.adapters.ted_hooks import Nested2TED
from functional_rb.adapters.ted_hooks import TED2Flat
from functional_rb.adapters.ted_hooks import TED2Nested
from functional_rb.adapters.writers import ImmutableDatasetWriter
from functional_rb.adapters.writers import RoundRobinWriter
from functional_rb.adapters.writers import TensorDictMaxValueWriter
from functional_rb.adapters.writers import TensorDictRoundRobinWriter
from functional_rb.adapters.writers import Writer
from functional_rb.adapters.writers import WriterEnsemble

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
