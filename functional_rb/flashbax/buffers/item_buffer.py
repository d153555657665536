"""flashbax's item buffer (``flashbax.buffers.item_buffer``): independent items in one row
of a trajectory buffer, sampled one at a time (sequence length 1)."""

from __future__ import annotations

import jax

from functional_rb.flashbax.buffers import _adding
from functional_rb.flashbax.buffers.trajectory_buffer import (
    TrajectoryBuffer,
    TrajectoryBufferSample,
    TrajectoryBufferState,
    make_trajectory_buffer,
)

__all__ = (
    "create_item_buffer",
    "make_item_buffer",
    "validate_item_buffer_args",
    "validate_min_length",
    "validate_sample_batch_size",
)


def validate_sample_batch_size(sample_batch_size: int, max_length: int):
    """flashbax's check: ``sample_batch_size <= max_length``."""
    if sample_batch_size > max_length:
        raise ValueError("sample_batch_size must be less than or equal to max_length")


def validate_min_length(min_length: int, max_length: int):
    """flashbax's check: ``min_length <= max_length``."""
    if min_length > max_length:
        raise ValueError("min_length used cannot be larger than max_length.")


def validate_item_buffer_args(max_length: int, min_length: int, sample_batch_size: int):
    """flashbax's argument checks of the item buffer."""
    validate_sample_batch_size(sample_batch_size, max_length)
    validate_min_length(min_length, max_length)


def create_item_buffer(
    max_length: int, min_length: int, sample_batch_size: int, add_sequences: bool, add_batches: bool
) -> TrajectoryBuffer:
    """The item buffer (see :func:`make_item_buffer`)."""
    validate_item_buffer_args(max_length, min_length, sample_batch_size)
    buffer = make_trajectory_buffer(
        max_length_time_axis=max_length,
        min_length_time_axis=min_length,
        add_batch_size=1,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=1,
        period=1,
    )

    def sample_fn(state: TrajectoryBufferState, rng_key) -> TrajectoryBufferSample:
        data = buffer.sample(state, rng_key).experience
        return TrajectoryBufferSample(
            experience=jax.tree_util.tree_map(lambda x: x.squeeze(axis=1), data)
        )

    add_fn = _adding.with_axes(_adding.as_one_row(buffer.add), add_batches, add_sequences)
    return buffer.replace(add=add_fn, sample=sample_fn)


def make_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
) -> TrajectoryBuffer:
    """An item buffer (flashbax's ``make_item_buffer``; same arguments): ``add`` takes one
    item, a sequence, a batch or a batch of sequences, all stored as independent items;
    ``sample`` returns ``sample_batch_size`` items drawn uniformly.

    >>> buffer = make_item_buffer(max_length=16, min_length=2, sample_batch_size=3,
    ...                           add_batches=True)
    >>> state = buffer.add(buffer.init({"x": jnp.zeros(())}), {"x": jnp.arange(4.0)})
    >>> buffer.sample(state, jax.random.PRNGKey(0)).experience["x"].shape
    (3,)
    """
    return create_item_buffer(max_length, min_length, sample_batch_size, add_sequences, add_batches)
