"""flashbax's prioritised trajectory buffer (``flashbax.buffers.prioritised_trajectory_buffer``)
on the core's :class:`~functional_rb.PrioritizedSequenceSampler` and its exact binary sum tree
in flashbax's layout (:mod:`functional_rb.samplers.binary_tree`).

An *item* is a sequence start on the period grid: item ``i`` starts at time index
``(i % items_per_row) * period`` of row ``i // items_per_row`` (``items_per_row =
max_length_time_axis // period``); its priority lives in ``state.sum_tree_state``. An item
becomes drawable at the largest value recorded so far when its whole sequence is stored, and
gets value 0 when the ring overwrites it (flashbax's rules, kept by the core sampler).
``set_priorities`` stores ``priority ** priority_exponent`` (0 for a zero priority).

Differences from flashbax, each a fix: the tree is exact (its total never drifts); an index
outside the tree or a NaN, infinite or negative priority raises ``ValueError`` eagerly (under
``jit`` the entry is ignored) instead of corrupting the tree; new items get
the largest recorded value itself (flashbax rounds it down to an integer, filling their values
with ``jnp.full_like`` over their integer indices). As in flashbax,
``set_priorities`` sets any item it is given, even one whose sequence was overwritten since it
was drawn (which brings it back); pass ``drawable_only=True`` to the builder to leave such items
alone.

Opt-ins beyond flashbax (keyword arguments of the builders):

- ``end_key="done"``: sequences that cross an episode end are never drawn (value 0).
- ``drop_stale_updates=True``: the state keeps a write generation per slot
  (:mod:`functional_rb.generations`) and samples carry the generations of their items;
  ``set_priorities(state, sample, priorities)`` (or ``generations=sample.generations``) then
  drops every entry whose sequence was overwritten since the draw, even when a newer sequence
  now starts in the same slot, and counts it in ``state.generations.dropped``.
- ``drawable_only=True``: ``set_priorities`` leaves alone items that are not drawable now.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic

import jax
import jax.numpy as jnp

from functional_rb import generations as _generations
from functional_rb.flashbax import _core, _notices
from functional_rb.flashbax._records import record
from functional_rb.flashbax.buffers import sum_tree
from functional_rb.flashbax.buffers.sum_tree import SumTreeState
from functional_rb.flashbax.buffers.trajectory_buffer import (
    BufferSample,
    BufferState,
    Experience,
    TrajectoryBuffer,
    TrajectoryBufferSample,
    TrajectoryBufferState,
    can_sample,
    validate_trajectory_buffer_args,
)
from functional_rb.generations import GenerationState
from functional_rb.samplers.sequences import item_ranges

Priorities = jax.Array
Probabilities = jax.Array
Indices = jax.Array

__all__ = (
    "GenerationalPrioritisedTrajectoryBufferSample",
    "GenerationalPrioritisedTrajectoryBufferState",
    "PrioritisedTrajectoryBuffer",
    "PrioritisedTrajectoryBufferSample",
    "PrioritisedTrajectoryBufferState",
    "get_invalid_indices",
    "get_max_divisible_length",
    "get_num_items_in_row",
    "get_sum_tree_capacity",
    "make_prioritised_trajectory_buffer",
    "prioritised_add",
    "prioritised_init",
    "prioritised_sample",
    "set_priorities",
    "validate_device",
    "validate_priority_exponent",
)


@record
class PrioritisedTrajectoryBufferState(TrajectoryBufferState, Generic[Experience]):
    """State of a prioritised trajectory buffer (flashbax's fields).

    sum_tree_state: the priority value of every item (:class:`SumTreeState`).
    running_index: int32 ``[]``: time steps added per row since ``init`` (never wraps).
    """

    sum_tree_state: SumTreeState
    running_index: jax.Array

    @classmethod
    def from_saved(cls, **fields) -> PrioritisedTrajectoryBufferState:
        """The state from a checkpoint's fields: files written before the opt-in had a class
        of its own hold ``generations`` (None unless ``drop_stale_updates=True``)."""
        if "generations" not in fields:
            return cls(**fields)
        generations = fields.pop("generations")
        if generations is None:
            return PrioritisedTrajectoryBufferState(**fields)
        return GenerationalPrioritisedTrajectoryBufferState(**fields, generations=generations)


@record
class GenerationalPrioritisedTrajectoryBufferState(PrioritisedTrajectoryBufferState[Experience]):
    """The state of a buffer built with ``drop_stale_updates=True`` (not in flashbax): flashbax's
    fields and ``generations``, the write generation of every slot."""

    generations: GenerationState


@record
class PrioritisedTrajectoryBufferSample(TrajectoryBufferSample, Generic[Experience]):
    """A batch of sequences with the item ``indices`` (pass them to ``set_priorities``) and
    the ``probabilities`` they were drawn with (value / total)."""

    indices: Indices
    probabilities: Probabilities


@record
class GenerationalPrioritisedTrajectoryBufferSample(PrioritisedTrajectoryBufferSample[Experience]):
    """A sample of a buffer built with ``drop_stale_updates=True``: flashbax's fields and
    ``generations``, the write generation of each drawn item (checked by ``set_priorities``)."""

    generations: jax.Array


def generations_of(record) -> Any:
    """The ``generations`` of a state or sample built with ``drop_stale_updates=True``, else
    None."""
    return getattr(record, "generations", None)


def get_max_divisible_length(max_length_time_axis: int, period: int) -> int:
    """The largest multiple of ``period`` not above ``max_length_time_axis``.

    >>> get_max_divisible_length(10, 3)
    9
    """
    return int(max_length_time_axis - max_length_time_axis % period)


def get_num_items_in_row(max_length_time_axis: int, period: int) -> int:
    """Items (period-spaced starts) per row.

    >>> get_num_items_in_row(12, 3)
    4
    """
    return int(max_length_time_axis // period)


def get_sum_tree_capacity(max_length_time_axis: int, period: int, add_batch_size: int) -> int:
    """Items in the whole buffer: ``add_batch_size * items_per_row``.

    >>> get_sum_tree_capacity(12, 3, 2)
    8
    """
    return get_num_items_in_row(max_length_time_axis, period) * int(add_batch_size)


def prioritised_init(
    experience: Experience,
    add_batch_size: int,
    max_length_time_axis: int,
    period: int,
    *,
    drop_stale_updates: bool = False,
) -> PrioritisedTrajectoryBufferState[Experience]:
    """An empty state (``max_length_time_axis`` should be a multiple of ``period``, as the
    builder makes it; see :class:`~functional_rb.PrioritizedSequenceSampler` otherwise);
    ``drop_stale_updates``: with a write generation per slot (see the module docstring).

    >>> state = prioritised_init({"obs": jnp.zeros(())}, 2, 8, 2)
    >>> state.sum_tree_state.capacity, int(state.running_index)
    (8, 0)
    """
    fields = dict(
        experience=_core.empty_experience(experience, add_batch_size, max_length_time_axis),
        current_index=_core.zero_index(),
        is_full=_core.false(),
        sum_tree_state=sum_tree.init(
            get_sum_tree_capacity(max_length_time_axis, period, add_batch_size)
        ),
        running_index=jnp.int32(0),
    )
    if drop_stale_updates:
        return GenerationalPrioritisedTrajectoryBufferState(
            **fields, generations=_generations.init(add_batch_size * max_length_time_axis)
        )
    return PrioritisedTrajectoryBufferState(**fields)


def _sequence_state(state, end_key):
    return _core.sequence_state(
        state.running_index,
        state.sum_tree_state.tree,
        state.sum_tree_state.max_recorded_priority,
        state.experience,
        end_key,
    )


def prioritised_add(
    state: PrioritisedTrajectoryBufferState[Experience],
    batch: Experience,
    sample_sequence_length: int,
    period: int,
    device: str = "cpu",
    *,
    end_key=None,
) -> PrioritisedTrajectoryBufferState[Experience]:
    """Append ``batch`` (leaves ``[add_batch_size, T, ...]``); items whose sequences become
    complete get the largest recorded value, items the write breaks get 0.

    >>> state = prioritised_init({"obs": jnp.zeros(())}, 1, 8, 1)
    >>> state = prioritised_add(state, {"obs": jnp.ones((1, 4))}, 2, 1)
    >>> float(sum_tree.total(state.sum_tree_state)), int(state.running_index)
    (3.0, 4)
    """
    del device
    sampler = _core.prioritised_sampler(sample_sequence_length, period, end_key)
    experience, cursor, full, st, generations = _core.write(
        state.experience,
        state.current_index,
        state.is_full,
        batch,
        where="prioritised_add",
        sampler=sampler,
        sampler_state=_sequence_state(state, end_key),
        generations=generations_of(state),
    )
    state = state.replace(
        experience=experience,
        current_index=cursor,
        is_full=full,
        running_index=st.steps,
        sum_tree_state=state.sum_tree_state.with_tree(st.tree),
    )
    return state if generations is None else state.replace(generations=generations)


def prioritised_sample(
    state: PrioritisedTrajectoryBufferState[Experience],
    rng_key,
    batch_size: int,
    sequence_length: int,
    period: int,
    *,
    end_key=None,
) -> PrioritisedTrajectoryBufferSample[Experience]:
    """``batch_size`` sequences drawn by priority (stratified over the total).

    >>> state = prioritised_init({"obs": jnp.zeros(())}, 1, 8, 1)
    >>> state = prioritised_add(state, {"obs": jnp.arange(4.0)[None]}, 2, 1)
    >>> s = prioritised_sample(state, jax.random.PRNGKey(0), 3, 2, 1)
    >>> s.experience["obs"].shape, s.probabilities.tolist()
    ((3, 2), [0.3333333432674408, 0.3333333432674408, 0.3333333432674408])
    """
    sampler = _core.prioritised_sampler(sequence_length, period, end_key)
    data, items, probabilities, drawn = _core.sample_prioritised(
        state.experience,
        state.current_index,
        state.is_full,
        _sequence_state(state, end_key),
        rng_key,
        batch_size,
        sampler,
    )
    kept = generations_of(state)
    if kept is None:
        return PrioritisedTrajectoryBufferSample(
            experience=data, indices=items, probabilities=probabilities
        )
    generations = _generations.drawn(kept, drawn.indices[:, 0], drawn.mask[:, 0])
    return GenerationalPrioritisedTrajectoryBufferSample(
        experience=data, indices=items, probabilities=probabilities, generations=generations
    )


def set_priorities(
    state: PrioritisedTrajectoryBufferState[Experience],
    indices: Indices,
    priorities: Priorities,
    priority_exponent: float,
    device: str = "cpu",
    *,
    sample_sequence_length: int | None = None,
    period: int | None = None,
    end_key=None,
    drawable_only: bool = False,
    generations=None,
) -> PrioritisedTrajectoryBufferState[Experience]:
    """Store ``priorities ** priority_exponent`` (0 for a zero priority) for the items
    ``indices``; raises ``max_recorded_priority``. ``drawable_only`` (not in flashbax): only
    for the items still drawable now (an overwritten or broken sequence stays out).

    ``indices`` may be the sample itself (``set_priorities(state, sample, priorities)``): with a
    state built with ``drop_stale_updates=True`` its ``generations`` are then checked, and the
    entries whose sequence was overwritten since the draw are dropped (``generations=`` passes
    them separately).

    ``sample_sequence_length`` and ``period`` (not in flashbax, which needs neither): given by
    the buffer's own ``set_priorities``; without them the sequence length is taken as 1 (an
    item is drawable while its first step is stored) and the period from the tree's size.

    >>> state = prioritised_init({"obs": jnp.zeros(())}, 1, 8, 1)
    >>> state = prioritised_add(state, {"obs": jnp.ones((1, 4))}, 2, 1)
    >>> state = set_priorities(state, jnp.array([1]), jnp.array([4.0]), 0.5)
    >>> tree = state.sum_tree_state
    >>> float(sum_tree.get(tree, 1)), float(tree.max_recorded_priority)
    (2.0, 2.0)
    """
    del device
    if hasattr(indices, "indices") and hasattr(indices, "probabilities"):  # a sample
        if generations is not None:
            raise ValueError(
                "set_priorities: got a sample and generations=; a sample carries "
                "its own generations: pass one or the other."
            )
        indices, generations = indices.indices, generations_of(indices)
    if generations is not None and generations_of(state) is None:
        raise ValueError(
            "set_priorities: generations were given but this state keeps none; build the "
            "buffer with drop_stale_updates=True to drop updates of overwritten sequences."
        )
    rows, steps = jax.tree_util.tree_leaves(state.experience)[0].shape[:2]
    if period is None:
        period = steps * rows // state.sum_tree_state.capacity
    sampler = _core.prioritised_sampler(sample_sequence_length or 1, period, end_key)
    priorities = jnp.asarray(priorities, jnp.float32)
    values = jnp.where(priorities == 0, 0.0, priorities ** jnp.float32(priority_exponent))
    st, gens = _core.set_item_values(
        state.experience,
        state.current_index,
        state.is_full,
        _sequence_state(state, end_key),
        indices,
        values,
        sampler,
        where="set_priorities",
        drawable_only=drawable_only,
        generations=generations_of(state),
        drawn_generations=generations,
    )
    state = state.replace(sum_tree_state=state.sum_tree_state.with_tree(st.tree, st.max_priority))
    return state if gens is None else state.replace(generations=gens)


def get_invalid_indices(
    state: TrajectoryBufferState[Experience],
    sample_sequence_length: int,
    period: int,
    add_batch_size: int,
    max_length_time_axis: int,
):
    """int32 ``[add_batch_size, sample_sequence_length // period + 1]``: the items whose
    sequence would cross the write head now (the same time indices in every row).

    >>> state = prioritised_init({"obs": jnp.zeros(())}, 1, 8, 1)
    >>> get_invalid_indices(state, 2, 1, 1, 8).tolist()
    [[7, 0, 1]]
    """
    per_row = max_length_time_axis // period
    first = (state.current_index - sample_sequence_length) % max_length_time_axis
    first = jnp.minimum(first, per_row * period - 1) // period + 1
    count = sample_sequence_length // period + 1
    items = (jnp.arange(count) + first) % per_row
    return items[None, :] + jnp.arange(add_batch_size)[:, None] * per_row


def _calculate_new_item_indices(
    index_before_writing,
    add_sequence_length: int,
    period: int,
    max_length_time_axis: int,
    sample_sequence_length: int,
    add_batch_size: int,
):
    """flashbax's private helper, kept for code that calls it: the items an add of
    ``add_sequence_length`` steps makes drawable and those it breaks, flattened over rows,
    padded with an index past the tree. Computed by the core's
    :func:`~functional_rb.samplers.sequences.item_ranges`."""
    (new_lo, new_hi), (gone_lo, gone_hi) = item_ranges(
        jnp.asarray(index_before_writing, jnp.int32),
        add_sequence_length,
        period,
        max_length_time_axis,
        sample_sequence_length,
    )
    per_row = get_num_items_in_row(max_length_time_axis, period)
    pad = 2 ** (sum_tree.get_tree_depth(per_row * add_batch_size) + 1)
    k = jnp.arange(add_sequence_length // period + 1) * period
    rows = jnp.arange(add_batch_size)[:, None] * per_row

    def items(lo, hi):
        start = (lo + k)[None, :]
        idx = (start % max_length_time_axis) // period + rows
        return jnp.where(start < hi, idx, pad).reshape(-1)

    return items(new_lo, new_hi), items(gone_lo, gone_hi)


@record(pytree=False)
class PrioritisedTrajectoryBuffer(TrajectoryBuffer, Generic[Experience, BufferState, BufferSample]):
    """A prioritised trajectory buffer: :class:`TrajectoryBuffer`'s functions plus
    ``set_priorities(state, indices, priorities) -> state``."""

    set_priorities: Callable


def validate_priority_exponent(priority_exponent: float) -> None:
    """flashbax's check: ``0 <= priority_exponent <= 1``."""
    if priority_exponent < 0 or priority_exponent > 1:
        raise ValueError(
            "Priority exponent must be greater than or equal to 0 and less than "
            f"or equal to 1, got {priority_exponent}"
        )


def validate_device(device: str) -> bool:
    """flashbax's check of ``device`` (warns and returns False when it is not one of "cpu",
    "gpu", "tpu" or not available). The core's tree is the same on every device, so the
    value only decides the warning."""
    if device not in ("cpu", "gpu", "tpu"):
        _notices.warn(
            f"Device must be one of 'cpu', 'gpu' or 'tpu', got '{device}'. Defaulting to 'cpu'"
        )
        return False
    try:
        jax.devices(device)
    except RuntimeError:
        _notices.warn(
            f"You have specified device={device}, however this device is not available."
            " Defaulting to 'cpu'"
        )
        return False
    return True


def make_prioritised_trajectory_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    period: int,
    min_length_time_axis: int,
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    *,
    end_key=None,
    drawable_only: bool = False,
    drop_stale_updates: bool = False,
) -> PrioritisedTrajectoryBuffer:
    """A prioritised trajectory buffer (flashbax's ``make_prioritised_trajectory_buffer``;
    same arguments). Not in flashbax: ``end_key``, the key of a per-step done flag: sequences
    that cross an episode end are never drawn; ``drawable_only``: ``set_priorities`` leaves
    alone the items that are not drawable any more (overwritten since they were drawn);
    ``drop_stale_updates``: ``set_priorities(state, sample, priorities)`` drops the entries whose
    sequence was overwritten since the draw (write generations, see the module docstring).

    >>> buffer = make_prioritised_trajectory_buffer(add_batch_size=2, sample_batch_size=4,
    ...     sample_sequence_length=3, period=1, min_length_time_axis=3, max_length_time_axis=16)
    >>> state = buffer.add(buffer.init({"obs": jnp.zeros(())}), {"obs": jnp.ones((2, 5))})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> state = buffer.set_priorities(state, s.indices, jnp.ones(4))
    >>> s.experience["obs"].shape, s.indices.shape
    ((4, 3), (4,))
    """
    validate_trajectory_buffer_args(
        max_length_time_axis,
        min_length_time_axis,
        add_batch_size,
        sample_sequence_length,
        period,
        max_size,
    )
    validate_priority_exponent(priority_exponent)
    validate_device(device)
    min_length_time_axis = max(min_length_time_axis, sample_sequence_length)
    max_length_time_axis = _core.time_axis(
        max_length_time_axis, max_size, add_batch_size, "make_prioritised_trajectory_buffer"
    )
    trimmed = get_max_divisible_length(max_length_time_axis, period)
    if trimmed != max_length_time_axis:
        # flashbax says this with print, not a warning (a -W error suite must not fail here)
        lost = (max_length_time_axis - trimmed) * add_batch_size
        print(
            f"""Setting max_length_time_axis to {trimmed} to make divisible by
            period argument. This results in a total reduction in capacity of {lost}.""",
        )
    common = dict(period=period, end_key=end_key)
    return PrioritisedTrajectoryBuffer(
        init=functools.partial(
            prioritised_init,
            add_batch_size=add_batch_size,
            max_length_time_axis=trimmed,
            period=period,
            drop_stale_updates=drop_stale_updates,
        ),
        add=functools.partial(
            prioritised_add, sample_sequence_length=sample_sequence_length, **common
        ),
        sample=functools.partial(
            prioritised_sample,
            batch_size=sample_batch_size,
            sequence_length=sample_sequence_length,
            **common,
        ),
        can_sample=functools.partial(can_sample, min_length_time_axis=min_length_time_axis),
        set_priorities=functools.partial(
            set_priorities,
            priority_exponent=priority_exponent,
            sample_sequence_length=sample_sequence_length,
            drawable_only=drawable_only,
            **common,
        ),
    )
