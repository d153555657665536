"""flashbax's flat buffer (``flashbax.buffers.flat_buffer``): transitions ``(s_t, s_t+1)``
from a trajectory buffer sampled in pairs (sequence length 2, period 1).

Opt-ins beyond flashbax: ``make_flat_buffer(..., end_key="done")``: a pair whose first step
ends an episode is never drawn (its second step belongs to the next episode).
``make_flat_buffer(..., sample_once=True)``: each transition is drawn at most once until its
first step is rewritten (flashbax issue #59; :mod:`functional_rb.flashbax.buffers._once`):
``sample`` returns ``(MaskedTransitionSample, state)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, NamedTuple

import jax

from functional_rb.flashbax import _core
from functional_rb.flashbax._records import Record, record
from functional_rb.flashbax.buffers import _adding, _once
from functional_rb.flashbax.buffers._once import SampleOnceBufferState
from functional_rb.flashbax.buffers.trajectory_buffer import (
    Experience,
    TrajectoryBuffer,
    TrajectoryBufferState,
    make_trajectory_buffer,
)

__all__ = (
    "ExperiencePair",
    "MaskedTransitionSample",
    "SampleOnceBufferState",
    "TransitionSample",
    "create_flat_buffer",
    "make_flat_buffer",
    "validate_flat_buffer_args",
    "validate_max_length_add_batch_size",
    "validate_min_length",
    "validate_sample_batch_size",
)


class ExperiencePair(NamedTuple, Generic[Experience]):
    """A transition: ``first`` (step t) and ``second`` (step t + 1), leaves ``[B, ...]``."""

    first: Experience
    second: Experience


@record
class TransitionSample(Record, Generic[Experience]):
    """A batch of transitions: ``experience`` is an :class:`ExperiencePair`."""

    experience: ExperiencePair


@record
class MaskedTransitionSample(TransitionSample, Generic[Experience]):
    """A batch of transitions drawn with ``sample_once=True`` (not in flashbax).

    experience: an :class:`ExperiencePair`, leaves ``[sample_batch_size, ...]``.
    mask: bool ``[sample_batch_size]``: all True, or (a sample under ``jit`` when fewer than
      ``sample_batch_size`` undrawn transitions were stored) all False.
    """

    mask: jax.Array


def validate_sample_batch_size(sample_batch_size: int, max_length: int):
    """flashbax's check: ``sample_batch_size <= max_length``."""
    if sample_batch_size > max_length:
        raise ValueError("sample_batch_size must be less than or equal to max_length")


def validate_min_length(min_length: int, add_batch_size: int, max_length: int):
    """flashbax's check: the per-row minimum ``min_length // add_batch_size + 1`` fits."""
    if min_length // add_batch_size + 1 > max_length:
        raise ValueError("min_length used is too large for the buffer size.")


def validate_max_length_add_batch_size(max_length: int, add_batch_size: int):
    """flashbax's check: every row holds at least 2 steps."""
    if max_length // add_batch_size < 2:
        raise ValueError(
            f"max_length//add_batch_size must be greater than 2. It is currently "
            f"{max_length}//{add_batch_size} = {max_length // add_batch_size}"
        )


def validate_flat_buffer_args(
    max_length: int, min_length: int, sample_batch_size: int, add_batch_size: int
):
    """flashbax's argument checks of the flat buffer."""
    validate_sample_batch_size(sample_batch_size, max_length)
    validate_min_length(min_length, add_batch_size, max_length)
    validate_max_length_add_batch_size(max_length, add_batch_size)


def create_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batch_size: int | None,
    *,
    end_key=None,
    sample_once: bool = False,
) -> TrajectoryBuffer:
    """The flat buffer (see :func:`make_flat_buffer`)."""
    if not isinstance(sample_once, bool):
        raise _core.FlashbaxArgumentError(
            f"make_flat_buffer: sample_once must be a Python bool, got {sample_once!r} "
            f"({type(sample_once).__name__}). Pass sample_once=True to draw each transition "
            "at most once until it is overwritten, or leave it out."
        )
    add_batches = add_batch_size is not None
    add_batch_size = add_batch_size if add_batch_size is not None else 1  # (add_batches)
    validate_flat_buffer_args(max_length, min_length, sample_batch_size, add_batch_size)
    buffer = make_trajectory_buffer(
        max_length_time_axis=max_length // add_batch_size,
        min_length_time_axis=min_length // add_batch_size + 1,
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=2,
        period=1,
        end_key=None if sample_once else end_key,  # sample_once reads the flags itself
    )

    def sample_fn(state: TrajectoryBufferState, rng_key) -> TransitionSample:
        return TransitionSample(experience=pair(buffer.sample(state, rng_key).experience))

    sample_impl: Callable = sample_fn
    if sample_once:
        buffer = _once.sample_once_buffer(
            buffer,
            rows=add_batch_size,
            length=max_length // add_batch_size,
            batch_size=sample_batch_size,
            pairs=True,
            end_key=end_key,
            where="make_flat_buffer",
        )
        once_sample = buffer.sample

        def once_sample_fn(state: SampleOnceBufferState, rng_key):
            sample, state = once_sample(state, rng_key)
            return MaskedTransitionSample(
                experience=pair(sample.experience), mask=sample.mask
            ), state

        sample_impl = once_sample_fn

    return buffer.replace(
        add=_adding.with_axes(buffer.add, add_batches, add_sequences, add_batch_size),
        sample=sample_impl,
    )


def pair(sequences) -> ExperiencePair:
    """The :class:`ExperiencePair` of sequences of 2 steps (leaves ``[B, 2, ...]``)."""
    return ExperiencePair(
        first=jax.tree_util.tree_map(lambda x: x[:, 0], sequences),
        second=jax.tree_util.tree_map(lambda x: x[:, 1], sequences),
    )


def make_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batch_size: int | None = None,
    *,
    end_key=None,
    sample_once: bool = False,
) -> TrajectoryBuffer:
    """A flat buffer of transitions (flashbax's ``make_flat_buffer``; same arguments).

    ``add`` takes one transition (``add_batch_size=None``, ``add_sequences=False``), a
    sequence, a batch of ``add_batch_size``, or a batch of sequences; ``sample`` returns a
    :class:`TransitionSample` of ``sample_batch_size`` pairs of consecutive steps of one row.
    ``end_key`` (not in flashbax): pairs whose first step ends an episode are never drawn.

    ``sample_once=True`` (not in flashbax): each transition is drawn at most once until its
    first step is overwritten. The state is then a :class:`SampleOnceBufferState`, and
    ``sample(state, rng_key)`` returns ``(MaskedTransitionSample, new_state)``: keep the new
    state, which records what was drawn. Each batch holds ``sample_batch_size`` distinct
    transitions, uniformly without replacement among those not drawn yet; ``can_sample`` is
    True only when that many are stored. A ``sample`` when fewer are raises ``ValueError``
    eagerly and, under ``jit``, returns ``mask`` all False and marks nothing drawn.

    >>> buffer = make_flat_buffer(max_length=32, min_length=2, sample_batch_size=4)
    >>> state = buffer.init({"obs": jnp.zeros(2)})
    >>> for t in range(4):
    ...     state = buffer.add(state, {"obs": jnp.full(2, t, jnp.float32)})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> bool((s.experience.second["obs"] - s.experience.first["obs"] == 1).all())
    True

    >>> buffer = make_flat_buffer(max_length=32, min_length=2, sample_batch_size=2,
    ...                           sample_once=True)
    >>> state = buffer.init({"t": jnp.int32(0)})
    >>> for t in range(5):                                  # 4 transitions: (0, 1) ... (3, 4)
    ...     state = buffer.add(state, {"t": jnp.int32(t)})
    >>> a, state = buffer.sample(state, jax.random.PRNGKey(0))
    >>> b, state = buffer.sample(state, jax.random.PRNGKey(1))
    >>> sorted(a.experience.first["t"].tolist() + b.experience.first["t"].tolist())
    [0, 1, 2, 3]
    >>> bool(buffer.can_sample(state))                      # all drawn: wait for new steps
    False
    """
    return create_flat_buffer(
        max_length,
        min_length,
        sample_batch_size,
        add_sequences,
        add_batch_size,
        end_key=end_key,
        sample_once=sample_once,
    )
