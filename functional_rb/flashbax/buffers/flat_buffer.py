"""flashbax's flat buffer (``flashbax.buffers.flat_buffer``): transitions ``(s_t, s_t+1)``
from a trajectory buffer sampled in pairs (sequence length 2, period 1).

Opt-in beyond flashbax: ``make_flat_buffer(..., end_key="done")``: a pair whose first step
ends an episode is never drawn (its second step belongs to the next episode).
"""

from __future__ import annotations

from typing import Generic, NamedTuple, Optional

import jax

from functional_rb.flashbax._records import Record, record
from functional_rb.flashbax.buffers import _adding
from functional_rb.flashbax.buffers.trajectory_buffer import (
    Experience,
    TrajectoryBuffer,
    TrajectoryBufferState,
    make_trajectory_buffer,
)

__all__ = (
    "ExperiencePair",
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
    add_batch_size: Optional[int],
    *,
    end_key=None,
) -> TrajectoryBuffer:
    """The flat buffer (see :func:`make_flat_buffer`)."""
    add_batches = add_batch_size is not None
    add_batch_size = add_batch_size if add_batches else 1
    validate_flat_buffer_args(max_length, min_length, sample_batch_size, add_batch_size)
    buffer = make_trajectory_buffer(
        max_length_time_axis=max_length // add_batch_size,
        min_length_time_axis=min_length // add_batch_size + 1,
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=2,
        period=1,
        end_key=end_key,
    )

    def sample_fn(state: TrajectoryBufferState, rng_key) -> TransitionSample:
        return TransitionSample(experience=pair(buffer.sample(state, rng_key).experience))

    return buffer.replace(
        add=_adding.with_axes(buffer.add, add_batches, add_sequences), sample=sample_fn
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
    add_batch_size: Optional[int] = None,
    *,
    end_key=None,
) -> TrajectoryBuffer:
    """A flat buffer of transitions (flashbax's ``make_flat_buffer``; same arguments).

    ``add`` takes one transition (``add_batch_size=None``, ``add_sequences=False``), a
    sequence, a batch of ``add_batch_size``, or a batch of sequences; ``sample`` returns a
    :class:`TransitionSample` of ``sample_batch_size`` pairs of consecutive steps of one row.
    ``end_key`` (not in flashbax): pairs whose first step ends an episode are never drawn.

    >>> buffer = make_flat_buffer(max_length=32, min_length=2, sample_batch_size=4)
    >>> state = buffer.init({"obs": jnp.zeros(2)})
    >>> for t in range(4):
    ...     state = buffer.add(state, {"obs": jnp.full(2, t, jnp.float32)})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> bool((s.experience.second["obs"] - s.experience.first["obs"] == 1).all())
    True
    """
    return create_flat_buffer(
        max_length, min_length, sample_batch_size, add_sequences, add_batch_size, end_key=end_key
    )
