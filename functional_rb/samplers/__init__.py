"""Samplers: which items come out (the protocol: :class:`functional_rb.base.Sampler`).

One module per family: :mod:`~functional_rb.samplers.uniform` (with and without replacement),
:mod:`~functional_rb.samplers.prioritized` over :mod:`~functional_rb.samplers.sum_tree` and
:mod:`~functional_rb.samplers.priorities`, :mod:`~functional_rb.samplers.slices` and
:mod:`~functional_rb.samplers.prioritized_slices` over
:mod:`~functional_rb.samplers.trajectories`, :mod:`~functional_rb.samplers.staleness`;
:mod:`~functional_rb.samplers.epochs` serves every sampler that draws each element once per epoch.
"""
from functional_rb.base import Drawn
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
from functional_rb.samplers.uniform import uniform_index

__all__ = (
    "Drawn", "EmptySamplerState", "PrioritizedSampler", "PrioritizedSliceSampler",
    "PrioritizedSliceState", "PrioritizedState", "RandomSampler", "SamplerWithoutReplacement",
    "SliceSampler", "SliceSamplerWithoutReplacement", "SliceState",
    "SliceWithoutReplacementState", "StalenessAwareSampler", "StalenessState",
    "WithoutReplacementState", "uniform_index",
)
