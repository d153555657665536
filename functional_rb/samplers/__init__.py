"""Samplers: which items come out (the protocol: :class:`functional_rb.protocol.Sampler`).

One module per family: :mod:`~functional_rb.samplers.uniform` (with and without replacement),
:mod:`~functional_rb.samplers.prioritized` over :mod:`~functional_rb.samplers.sum_tree` and
:mod:`~functional_rb.samplers.priorities`, :mod:`~functional_rb.samplers.slices` and
:mod:`~functional_rb.samplers.prioritized_slices` over
:mod:`~functional_rb.samplers.trajectories` (and :mod:`~functional_rb.samplers.episodes`: whole
episodes over the same records), :mod:`~functional_rb.samplers.staleness`;
:mod:`~functional_rb.samplers.epochs` serves every sampler that draws each element once per epoch;
:mod:`~functional_rb.samplers.once` draws each item at most once until its slot is rewritten.
"""

from functional_rb.protocol import Drawn
from functional_rb.samplers.episodes import EpisodeSampler
from functional_rb.samplers.once import SampleOnceSampler, SampleOnceState
from functional_rb.samplers.prioritized import PrioritizedSampler, PrioritizedState
from functional_rb.samplers.prioritized_slices import PrioritizedSliceSampler, PrioritizedSliceState
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
    uniform_index,
)

__all__ = (
    "Drawn",
    "EmptySamplerState",
    "EpisodeSampler",
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "PrioritizedSliceState",
    "PrioritizedState",
    "RandomSampler",
    "SampleOnceSampler",
    "SampleOnceState",
    "SamplerWithoutReplacement",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "SliceState",
    "SliceWithoutReplacementState",
    "StalenessAwareSampler",
    "StalenessState",
    "WithoutReplacementState",
    "uniform_index",
)
