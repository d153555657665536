"""Replay buffers under TorchRL's names (``torchrl.data.replay_buffers.replay_buffers``): a
storage, a writer and a sampler composed. One module per family: :mod:`.base`
(``ReplayBuffer``), :mod:`.tensordict`, :mod:`.prioritized`, :mod:`.remote`, :mod:`.ensemble`,
:mod:`.conditional` (``update_if_present``'s result), :mod:`.ray` (``RayReplayBuffer``)."""

from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.replay_buffers.conditional import ConditionalUpdateResult
from functional_rb.adapters.replay_buffers.ensemble import ReplayBufferEnsemble, ReplayBufferTrainer
from functional_rb.adapters.replay_buffers.prioritized import (
    PrioritizedReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
)
from functional_rb.adapters.replay_buffers.ray import RayReplayBuffer
from functional_rb.adapters.replay_buffers.remote import RemoteTensorDictReplayBuffer
from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer

__all__ = [
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "TensorDictPrioritizedReplayBuffer",
    "RemoteTensorDictReplayBuffer",
    "RayReplayBuffer",
    "ReplayBufferEnsemble",
    "ReplayBufferTrainer",
    "ConditionalUpdateResult",
]
