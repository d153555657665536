"""flashbax's trajectory buffer (``flashbax.buffers.trajectory_buffer``) on the core.

The state is flashbax's: ``experience`` leaves ``[add_batch_size, max_length_time_axis, ...]``,
``current_index``, ``is_full``. Underneath, ``experience`` is the core's ``ndim=2`` storage
(a :class:`~functional_rb.storages.device.LeafStorage` whose flat ``[E * R, ...]`` leaves are
this array reshaped, which costs nothing), ``current_index`` and ``is_full`` are the
:class:`~functional_rb.RoundRobinWriter`'s cursor and fill level, and sequences are drawn by
:class:`~functional_rb.SequenceSampler`. :mod:`functional_rb.flashbax._core` converts.

Opt-in beyond flashbax: ``make_trajectory_buffer(..., end_key="done")``: sampled sequences
never cross an episode end. The state is then an :class:`EpisodeTrajectoryBufferState`, whose
sum tree holds 1 for every drawable sequence and 0 for the others, and every drawable sequence
is equally likely (period-spaced in the ring's own time indices, as prioritised buffers are).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Generic, Optional, TypeVar

import jax
import jax.numpy as jnp

from functional_rb.flashbax import _core
from functional_rb.flashbax._records import Record, record
from functional_rb.flashbax.buffers import sum_tree

Experience = TypeVar("Experience")


@record
class TrajectoryBufferState(Record, Generic[Experience]):
    """State of a trajectory buffer (flashbax's fields).

    experience: the stored items, leaves ``[add_batch_size, max_length_time_axis, ...]``.
    current_index: int32 ``[]``: the time index the next ``add`` writes first.
    is_full: bool ``[]``: every time index holds data (the ring has wrapped).
    """

    experience: Experience
    current_index: jax.Array
    is_full: jax.Array


@record
class TrajectoryBufferSample(Record, Generic[Experience]):
    """A batch of sequences: ``experience`` leaves ``[sample_batch_size, sequence_length, ...]``."""

    experience: Experience


@record
class EpisodeTrajectoryBufferState(TrajectoryBufferState, Generic[Experience]):
    """State of a trajectory buffer built with ``end_key`` (not in flashbax).

    sum_tree_state: 1 for each sequence start that can be drawn, 0 for the others.
    running_index: int32 ``[]``: time steps added per row since ``init``.
    """

    sum_tree_state: sum_tree.SumTreeState
    running_index: jax.Array


BufferState = TypeVar("BufferState", bound=TrajectoryBufferState)
BufferSample = TypeVar("BufferSample", bound=TrajectoryBufferSample)


def init(
    experience: Experience, add_batch_size: int, max_length_time_axis: int
) -> TrajectoryBufferState[Experience]:
    """An empty state for items shaped like ``experience`` (ONE time step, no batch axes).

    >>> state = init({"obs": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=8)
    >>> state.experience["obs"].shape, int(state.current_index), bool(state.is_full)
    ((2, 8, 3), 0, False)
    """
    return TrajectoryBufferState(
        experience=_core.empty_experience(experience, add_batch_size, max_length_time_axis),
        current_index=_core.zero_index(),
        is_full=_core.false(),
    )


def add(
    state: TrajectoryBufferState[Experience], batch: Experience
) -> TrajectoryBufferState[Experience]:
    """Append ``batch`` (leaves ``[add_batch_size, T, ...]``, ``T <= max_length_time_axis``)
    along the time axis of every row, overwriting the oldest steps once full.

    >>> state = init({"obs": jnp.zeros(())}, 1, 4)
    >>> state = add(state, {"obs": jnp.arange(6.0).reshape(1, 6)[:, :3]})
    >>> state.experience["obs"].tolist(), int(state.current_index)
    ([[0.0, 1.0, 2.0, 0.0]], 3)
    """
    experience, cursor, full, _, _ = _core.write(
        state.experience, state.current_index, state.is_full, batch, where="add"
    )
    return state.replace(experience=experience, current_index=cursor, is_full=full)


def sample(
    state: TrajectoryBufferState[Experience],
    rng_key,
    batch_size: int,
    sequence_length: int,
    period: int,
) -> TrajectoryBufferSample[Experience]:
    """``batch_size`` sequences of ``sequence_length`` steps, each from a row drawn uniformly
    and a start drawn uniformly among the period-spaced starts (counted from the oldest
    stored step) whose whole sequence is stored and does not cross the write head.

    >>> state = add(init({"obs": jnp.zeros(())}, 2, 8), {"obs": jnp.ones((2, 5))})
    >>> sample(state, jax.random.PRNGKey(0), 4, 3, 1).experience["obs"].shape
    (4, 3)
    """
    data, _ = _core.sample_uniform(
        state.experience,
        state.current_index,
        state.is_full,
        rng_key,
        batch_size,
        sequence_length,
        period,
    )
    return TrajectoryBufferSample(experience=data)


def can_sample(state: TrajectoryBufferState[Experience], min_length_time_axis: int):
    """bool ``[]``: the rows hold at least ``min_length_time_axis`` steps (or are full).

    >>> bool(can_sample(init({"obs": jnp.zeros(())}, 1, 4), 1))
    False
    """
    return state.is_full | (state.current_index >= min_length_time_axis)


@record(pytree=False)
class TrajectoryBuffer(Record, Generic[Experience, BufferState, BufferSample]):
    """A trajectory buffer: a record of pure functions (flashbax's ``TrajectoryBuffer``).

    init: ``init(experience) -> state`` from ONE time step.
    add: ``add(state, batch) -> state``, batch leaves ``[add_batch_size, T, ...]``.
    sample: ``sample(state, rng_key) -> sample``.
    can_sample: ``can_sample(state) -> bool []``.

    ``buffer.replace(add=jax.jit(buffer.add, donate_argnums=0))`` gives a buffer whose ``add``
    updates the state in place.
    """

    init: Callable
    add: Callable
    sample: Callable
    can_sample: Callable


def validate_size(
    max_length_time_axis: Optional[int], max_size: Optional[int], add_batch_size: int
) -> None:
    """flashbax's check: at most one of ``max_size`` and ``max_length_time_axis``."""
    if max_size is not None and max_length_time_axis is not None:
        raise ValueError("Cannot specify both `max_size` and `max_length_time_axis` arguments.")
    if max_size is not None:
        warnings.warn(
            "Setting max_size dynamically sets the `max_length_time_axis` to be "
            f"`max_size`//`add_batch_size = {max_size // add_batch_size}`. This allows one to "
            "control exactly how many timesteps are stored in the buffer. Note that this "
            "overrides the `max_length_time_axis` argument.",
            stacklevel=2,
        )


def validate_trajectory_buffer_args(
    max_length_time_axis: Optional[int],
    min_length_time_axis: int,
    add_batch_size: int,
    sample_sequence_length: int,
    period: int,
    max_size: Optional[int],
) -> None:
    """flashbax's argument checks (its warnings included)."""
    validate_size(max_length_time_axis, max_size, add_batch_size)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if sample_sequence_length > min_length_time_axis:
        warnings.warn(
            "`sample_sequence_length` greater than `min_length_time_axis`, therefore overriding "
            "`min_length_time_axis` to be set to `sample_sequence_length`, as we need at least "
            "`sample_sequence_length` timesteps added to the buffer before we can sample.",
            stacklevel=2,
        )
        min_length_time_axis = sample_sequence_length
    if period > sample_sequence_length:
        warnings.warn(
            "Setting period greater than sample_sequence_length will result in no overlap "
            f"between trajectories, however, {period - sample_sequence_length} transitions will "
            "never be sampled. Setting period to be equal to sample_sequence_length will also "
            "result in no overlap between trajectories, however, all transitions will be "
            "sampled.",
            stacklevel=2,
        )
    if max_length_time_axis is not None:
        if sample_sequence_length > max_length_time_axis:
            raise ValueError(
                "`sample_sequence_length` must be less than or equal to `max_length_time_axis`."
            )
        if min_length_time_axis > max_length_time_axis:
            raise ValueError(
                "`min_length_time_axis` must be less than or equal to `max_length_time_axis`."
            )


def make_trajectory_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    period: int,
    min_length_time_axis: int,
    max_size: Optional[int] = None,
    max_length_time_axis: Optional[int] = None,
    *,
    end_key=None,
) -> TrajectoryBuffer:
    """A trajectory buffer (flashbax's ``make_trajectory_buffer``; same arguments).

    ``end_key`` (not in flashbax): the key of a per-step done flag in the experience (e.g.
    ``"done"``); sampled sequences then never cross an episode end.

    >>> buffer = make_trajectory_buffer(add_batch_size=2, sample_batch_size=4,
    ...     sample_sequence_length=3, period=1, min_length_time_axis=3, max_length_time_axis=16)
    >>> state = buffer.add(buffer.init({"obs": jnp.zeros(())}), {"obs": jnp.ones((2, 5))})
    >>> buffer.sample(state, jax.random.PRNGKey(0)).experience["obs"].shape
    (4, 3)
    """
    validate_trajectory_buffer_args(
        max_length_time_axis,
        min_length_time_axis,
        add_batch_size,
        sample_sequence_length,
        period,
        max_size,
    )
    min_length_time_axis = max(min_length_time_axis, sample_sequence_length)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if end_key is not None:
        return _episode_buffer(
            add_batch_size,
            sample_batch_size,
            sample_sequence_length,
            period,
            min_length_time_axis,
            max_length_time_axis,
            end_key,
        )
    return TrajectoryBuffer(
        init=functools.partial(
            init, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
        ),
        add=add,
        sample=functools.partial(
            sample,
            batch_size=sample_batch_size,
            sequence_length=sample_sequence_length,
            period=period,
        ),
        can_sample=functools.partial(can_sample, min_length_time_axis=min_length_time_axis),
    )


# ------------------------------------------------------------------ end_key (not in flashbax)
def _episode_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sequence_length: int,
    period: int,
    min_length: int,
    max_length: int,
    end_key,
) -> TrajectoryBuffer:
    """A uniform trajectory buffer whose sequences never cross an episode end: the core's
    :class:`~functional_rb.PrioritizedSequenceSampler` with every drawable value 1."""
    sampler = _core.prioritised_sampler(sequence_length, period, end_key)
    max_length -= max_length % period

    def init_fn(experience):
        state = init(experience, add_batch_size, max_length)
        items = add_batch_size * (max_length // period)
        return EpisodeTrajectoryBufferState(
            experience=state.experience,
            current_index=state.current_index,
            is_full=state.is_full,
            sum_tree_state=sum_tree.init(items),
            running_index=jnp.int32(0),
        )

    def add_fn(state, batch):
        st = _core.sequence_state(
            state.running_index,
            state.sum_tree_state.tree,
            state.sum_tree_state.max_recorded_priority,
            state.experience,
            end_key,
        )
        experience, cursor, full, st, _ = _core.write(
            state.experience,
            state.current_index,
            state.is_full,
            batch,
            where="add",
            sampler=sampler,
            sampler_state=st,
        )
        return state.replace(
            experience=experience,
            current_index=cursor,
            is_full=full,
            running_index=st.steps,
            sum_tree_state=state.sum_tree_state.replace(tree=st.tree),
        )

    def sample_fn(state, rng_key):
        st = _core.sequence_state(
            state.running_index,
            state.sum_tree_state.tree,
            state.sum_tree_state.max_recorded_priority,
            state.experience,
            end_key,
        )
        data, *_ = _core.sample_prioritised(
            state.experience,
            state.current_index,
            state.is_full,
            st,
            rng_key,
            sample_batch_size,
            sampler,
        )
        return TrajectoryBufferSample(experience=data)

    def can_sample_fn(state):
        return can_sample(state, min_length) & (sum_tree.total(state.sum_tree_state) > 0)

    return TrajectoryBuffer(init=init_fn, add=add_fn, sample=sample_fn, can_sample=can_sample_fn)
