"""flashbax's trajectory buffer (``flashbax.buffers.trajectory_buffer``) on the core.

The state is flashbax's: ``experience`` leaves ``[add_batch_size, max_length_time_axis, ...]``,
``current_index``, ``is_full``. Underneath, ``experience`` is the core's ``ndim=2`` storage
(a :class:`~functional_rb.storages.device.LeafStorage` whose flat ``[E * R, ...]`` leaves are
this array reshaped, which costs nothing), ``current_index`` and ``is_full`` are the
:class:`~functional_rb.RoundRobinWriter`'s cursor and fill level, and sequences are drawn by
:class:`~functional_rb.SequenceSampler`. :mod:`functional_rb.flashbax._core` converts.

Opt-ins beyond flashbax:

- ``make_trajectory_buffer(..., end_key="done")``: sampled sequences never cross an episode
  end. The state is then an :class:`EpisodeTrajectoryBufferState`, whose sum tree holds 1 for
  every drawable sequence and 0 for the others, and every drawable sequence is equally likely
  (period-spaced in the ring's own time indices, as prioritised buffers are).
- ``make_trajectory_buffer(..., end_key="done", episodes=True)``: each sampled row is one whole
  episode from its first step, padded to ``sample_sequence_length`` steps, with a mask
  (flashbax issue #23): the core's :class:`~functional_rb.EpisodeSampler`
  (:func:`make_episode_buffer`). The state is a :class:`WholeEpisodeBufferState`, samples are
  :class:`MaskedTrajectoryBufferSample`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import enforce
from functional_rb.flashbax import _core, _notices
from functional_rb.flashbax._records import Record, record
from functional_rb.flashbax.buffers import sum_tree
from functional_rb.samplers.episodes import EpisodeSampler
from functional_rb.samplers.trajectories import SliceState

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


@record
class WholeEpisodeBufferState(TrajectoryBufferState, Generic[Experience]):
    """State of a trajectory buffer built with ``episodes=True`` (not in flashbax).

    episodes: the core's :class:`~functional_rb.SliceState`: per row, where each stored
      episode starts (kept up to date by ``add``, so ``sample`` never scans the storage).
    """

    episodes: SliceState


@record
class MaskedTrajectoryBufferSample(TrajectoryBufferSample, Generic[Experience]):
    """A sample with a mask (``episodes=True``; the item buffer's ``sample_once=True``).

    experience: leaves ``[sample_batch_size, sample_sequence_length, ...]`` (episodes: padding
      repeats an episode's last step) or ``[sample_batch_size, ...]`` (items).
    mask: bool, ``experience``'s leading shape: False marks padding, and every entry of a
      sample drawn under ``jit`` when nothing could be drawn.
    """

    mask: jax.Array


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
    max_length_time_axis: int | None, max_size: int | None, add_batch_size: int
) -> None:
    """flashbax's check: at most one of ``max_size`` and ``max_length_time_axis``."""
    if max_size is not None and max_length_time_axis is not None:
        raise ValueError("Cannot specify both `max_size` and `max_length_time_axis` arguments.")
    if max_size is not None:
        _notices.warn(
            "Setting max_size dynamically sets the `max_length_time_axis` to "
            f"be `max_size`//`add_batch_size = {max_size // add_batch_size}`."
            "This allows one to control exactly how many timesteps are stored in the buffer."
            "Note that this overrides the `max_length_time_axis` argument."
        )


def validate_trajectory_buffer_args(
    max_length_time_axis: int | None,
    min_length_time_axis: int,
    add_batch_size: int,
    sample_sequence_length: int,
    period: int,
    max_size: int | None,
) -> None:
    """flashbax's argument checks (its warnings included)."""
    validate_size(max_length_time_axis, max_size, add_batch_size)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if sample_sequence_length > min_length_time_axis:
        _notices.warn(
            "`sample_sequence_length` greater than `min_length_time_axis`, therefore "
            "overriding `min_length_time_axis`"
            "to be set to `sample_sequence_length`, as we need at least `sample_sequence_length` "
            "timesteps added to the buffer before we can sample."
        )
        min_length_time_axis = sample_sequence_length
    if period > sample_sequence_length:
        _notices.warn(
            "Setting period greater than sample_sequence_length will result in no overlap between"
            f"trajectories, however, {period - sample_sequence_length} transitions will "
            "never be sampled. Setting period to be equal to sample_sequence_length will "
            "also result in no overlap between trajectories, however, all transitions will "
            "be sampled. Setting period to be `sample_sequence_length - 1` is generally "
            "desired to ensure that only starting and ending transitions are shared "
            "between trajectories allowing for utilising last transitions for bootstrapping."
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
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
    *,
    end_key=None,
    episodes: bool = False,
) -> TrajectoryBuffer:
    """A trajectory buffer (flashbax's ``make_trajectory_buffer``; same arguments).

    ``end_key`` (not in flashbax): the key of a per-step done flag in the experience (e.g.
    ``"done"``); sampled sequences then never cross an episode end.

    ``episodes=True`` (not in flashbax; needs ``end_key``): ``sample`` returns whole episodes
    padded to ``sample_sequence_length`` steps, with a mask (:func:`make_episode_buffer`).

    >>> buffer = make_trajectory_buffer(add_batch_size=2, sample_batch_size=4,
    ...     sample_sequence_length=3, period=1, min_length_time_axis=3, max_length_time_axis=16)
    >>> state = buffer.add(buffer.init({"obs": jnp.zeros(())}), {"obs": jnp.ones((2, 5))})
    >>> buffer.sample(state, jax.random.PRNGKey(0)).experience["obs"].shape
    (4, 3)
    """
    if not isinstance(episodes, bool):
        raise _core.FlashbaxArgumentError(
            f"make_trajectory_buffer: episodes must be a Python bool, got {episodes!r} "
            f"({type(episodes).__name__}). Pass episodes=True (with end_key) to sample whole "
            "episodes, or leave it out."
        )
    if episodes:
        return make_episode_buffer(
            add_batch_size,
            sample_batch_size,
            sample_sequence_length,
            min_length_time_axis,
            max_size,
            max_length_time_axis,
            end_key=end_key,
        )
    validate_trajectory_buffer_args(
        max_length_time_axis,
        min_length_time_axis,
        add_batch_size,
        sample_sequence_length,
        period,
        max_size,
    )
    min_length_time_axis = max(min_length_time_axis, sample_sequence_length)
    max_length_time_axis = _core.time_axis(
        max_length_time_axis, max_size, add_batch_size, "make_trajectory_buffer"
    )
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
            sum_tree_state=state.sum_tree_state.with_tree(st.tree),
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


# ------------------------------------------------------------------ episodes (not in flashbax)
def make_episode_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    min_length_time_axis: int,
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
    *,
    end_key,
) -> TrajectoryBuffer:
    """The buffer of ``make_trajectory_buffer(..., end_key=..., episodes=True)`` (flashbax
    issue #23), on the core's :class:`~functional_rb.EpisodeSampler`.

    ``sample(state, rng_key)`` returns a :class:`MaskedTrajectoryBufferSample`: row ``i`` of
    ``experience`` (leaves ``[sample_batch_size, sample_sequence_length, ...]``) is one whole
    episode from its first step, and ``mask[i]`` is True on its steps and False on the padding
    after them (which repeats its last step). An episode can be drawn once it has ended (a step
    whose ``end_key`` flag is True) and while its first step is stored: the running episode and
    the surviving tail of one the ring has partly overwritten are never returned. Each row
    picks one uniformly, with replacement. An episode longer than ``sample_sequence_length``
    comes back cut to its first ``sample_sequence_length`` steps (mask all True, and no end
    flag at its last step): choose the longest episode length to have every episode whole.
    ``period`` does not apply (each row starts at an episode's first step), and
    ``sample_sequence_length`` may exceed ``max_length_time_axis``.

    ``can_sample(state)``: flashbax's rule with ``min_length_time_axis`` as given (not raised to
    ``sample_sequence_length``), and some episode can be drawn. ``sample`` when none can be:
    eagerly ``ValueError``; under ``jit`` ``mask`` all False (the core's policy for an empty
    buffer). The state is a :class:`WholeEpisodeBufferState`.

    >>> buffer = make_trajectory_buffer(add_batch_size=1, sample_batch_size=4,
    ...     sample_sequence_length=5, period=1, min_length_time_axis=1,
    ...     max_length_time_axis=16, end_key="done", episodes=True)
    >>> state = buffer.init({"t": jnp.int32(0), "done": jnp.bool_(False)})
    >>> t = jnp.arange(8, dtype=jnp.int32)[None]               # episodes 0-2, 3-5; 6-7 runs
    >>> state = buffer.add(state, {"t": t, "done": t % 3 == 2})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> s.experience["t"].shape, s.mask.shape
    ((4, 5), (4, 5))
    >>> sorted({tuple(row[m].tolist()) for row, m in zip(s.experience["t"], s.mask)})
    [(0, 1, 2), (3, 4, 5)]
    """
    where = "make_trajectory_buffer"
    if end_key is None:
        raise _core.FlashbaxArgumentError(
            f"{where}: episodes=True needs end_key, the key of the per-step done flag that "
            "ends an episode, got end_key=None. Pass e.g. end_key='done'."
        )
    validate_size(max_length_time_axis, max_size, add_batch_size)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if max_length_time_axis is not None and min_length_time_axis > max_length_time_axis:
        raise ValueError(
            "`min_length_time_axis` must be less than or equal to `max_length_time_axis`."
        )
    sampler = EpisodeSampler(slice_len=sample_sequence_length, end_key=end_key)
    steps = sample_batch_size * sample_sequence_length

    def init_fn(experience):
        state = init(experience, add_batch_size, max_length_time_axis)
        spec = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), experience
        )
        try:
            records = sampler.init(spec, _core.layout_of(state.experience))
        except (KeyError, ValueError) as e:
            raise _core.FlashbaxArgumentError(
                f"{where}(episodes=True).init: {e.args[0] if e.args else e}"
            ) from None
        return WholeEpisodeBufferState(
            experience=state.experience,
            current_index=state.current_index,
            is_full=state.is_full,
            episodes=records,
        )

    def add_fn(state, batch):
        experience, cursor, full, records, _ = _core.write(
            state.experience,
            state.current_index,
            state.is_full,
            batch,
            where="add",
            sampler=sampler,
            sampler_state=state.episodes,
        )
        return state.replace(
            experience=experience, current_index=cursor, is_full=full, episodes=records
        )

    def sample_fn(state, rng_key):
        data, drawn = _core.sample_with(
            sampler,
            state.episodes,
            state.experience,
            state.current_index,
            state.is_full,
            rng_key,
            steps,
        )
        enforce(
            ~jnp.any(drawn.mask),
            lambda i, n: (
                f"{where}(episodes=True): sample: no whole episode is stored yet (an episode "
                f"can be drawn once a step with its {end_key!r} flag is added, while its "
                "first step is still stored). Add steps until buffer.can_sample(state) is "
                "True; under jax.jit the sample comes back with mask all False."
            ),
        )
        return MaskedTrajectoryBufferSample(experience=data, mask=drawn.mask)

    def can_sample_fn(state):
        return can_sample(state, min_length_time_axis) & _core.can_sample_with(
            sampler, state.episodes, state.experience, state.current_index, state.is_full, steps
        )

    return TrajectoryBuffer(init=init_fn, add=add_fn, sample=sample_fn, can_sample=can_sample_fn)
