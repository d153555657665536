"""Samplers under TorchRL's names (``torchrl.data.replay_buffers.samplers``): which items come
out. One module per family: :mod:`.base` (``Sampler``), :mod:`.random`, :mod:`.prioritized`,
:mod:`.slice`, :mod:`.slice_without_replacement`, :mod:`.prioritized_slice`,
:mod:`.streaming`, :mod:`.consuming`, :mod:`.staleness`, :mod:`.llm`, :mod:`.ensemble`."""

from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, Sampler, ravel, unravel
from functional_rb.adapters.samplers.consuming import ConsumingSampler
from functional_rb.adapters.samplers.ensemble import SamplerEnsemble
from functional_rb.adapters.samplers.llm import PromptGroupSampler
from functional_rb.adapters.samplers.prioritized import (
    LoadedPriorities,
    PrioritizedSampler,
    read_priority_files,
    write_priority_files,
)
from functional_rb.adapters.samplers.prioritized_slice import PrioritizedSliceSampler
from functional_rb.adapters.samplers.random import RandomSampler, SamplerWithoutReplacement
from functional_rb.adapters.samplers.slice import SliceSampler
from functional_rb.adapters.samplers.slice_without_replacement import SliceSamplerWithoutReplacement
from functional_rb.adapters.samplers.staleness import StalenessAwareSampler
from functional_rb.adapters.samplers.streaming import StreamingSliceSampler

__all__ = [
    "Sampler",
    "ConsumingSampler",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "PrioritizedSampler",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "PrioritizedSliceSampler",
    "StalenessAwareSampler",
    "PromptGroupSampler",
    "StreamingSliceSampler",
    "SamplerEnsemble",
]
