"""Stable-Baselines3's replay buffers on functional_rb's core: change one import.

``from functional_rb.sb3 import ReplayBuffer`` replaces
``from stable_baselines3.common.buffers import ReplayBuffer`` (CleanRL's scripts), and each
class works as ``replay_buffer_class=`` of SB3's and sb3-contrib's off-policy algorithms
(they subclass SB3's own). Beyond SB3: prioritized replay (:class:`PrioritizedReplayBuffer`,
:func:`use_priorities`), frame stacks stored once (``frame_stack=``), samples as JAX arrays
(``output="jax"``) and crash-safe checkpoints (``save_checkpoint``). Needs the ``sb3`` extra
(``pip install -c constraints.txt ".[sb3]"``); see ``docs/sb3.md``.
"""

from functional_rb.sb3.buffers import DictReplayBuffer, ReplayBuffer
from functional_rb.sb3.her import HerReplayBuffer
from functional_rb.sb3.nstep import NStepReplayBuffer
from functional_rb.sb3.prioritized import (
    DictPrioritizedReplayBuffer,
    PrioritizedReplayBuffer,
    PrioritizedReplayBufferSamples,
    use_priorities,
)

__all__ = [
    "DictPrioritizedReplayBuffer",
    "DictReplayBuffer",
    "HerReplayBuffer",
    "NStepReplayBuffer",
    "PrioritizedReplayBuffer",
    "PrioritizedReplayBufferSamples",
    "ReplayBuffer",
    "use_priorities",
]
