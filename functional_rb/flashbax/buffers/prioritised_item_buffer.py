"""flashbax's prioritised item buffer (``flashbax.buffers.prioritised_item_buffer``):
independent items in one row, drawn by priority (sequence length 1)."""

from __future__ import annotations

import jax

from functional_rb.flashbax.buffers import _adding
from functional_rb.flashbax.buffers.item_buffer import validate_item_buffer_args
from functional_rb.flashbax.buffers.prioritised_flat_buffer import validate_priority_exponent
from functional_rb.flashbax.buffers.prioritised_trajectory_buffer import (
    PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferSample,
    PrioritisedTrajectoryBufferState,
    make_prioritised_trajectory_buffer,
    validate_device,
)

__all__ = ("create_prioritised_item_buffer", "make_prioritised_item_buffer")


def create_prioritised_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batches: bool,
    priority_exponent: float,
    device: str,
    *,
    drawable_only: bool = False,
    drop_stale_updates: bool = False,
) -> PrioritisedTrajectoryBuffer:
    """The prioritised item buffer (see :func:`make_prioritised_item_buffer`)."""
    validate_item_buffer_args(max_length, min_length, sample_batch_size)
    validate_priority_exponent(priority_exponent)
    validate_device(device)
    buffer = make_prioritised_trajectory_buffer(
        max_length_time_axis=max_length,
        min_length_time_axis=min_length,
        add_batch_size=1,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=1,
        period=1,
        priority_exponent=priority_exponent,
        device=device,
        drawable_only=drawable_only,
        drop_stale_updates=drop_stale_updates,
    )

    def sample_fn(
        state: PrioritisedTrajectoryBufferState, rng_key
    ) -> PrioritisedTrajectoryBufferSample:
        s = buffer.sample(state, rng_key)
        return s.replace(
            experience=jax.tree_util.tree_map(lambda x: x.squeeze(axis=1), s.experience)
        )

    add_fn = _adding.with_axes(_adding.as_one_row(buffer.add), add_batches, add_sequences)
    return buffer.replace(add=add_fn, sample=sample_fn)


def make_prioritised_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    *,
    drawable_only: bool = False,
    drop_stale_updates: bool = False,
) -> PrioritisedTrajectoryBuffer:
    """A prioritised item buffer (flashbax's ``make_prioritised_item_buffer``; same
    arguments; ``drawable_only`` and ``drop_stale_updates``, not in flashbax, as in
    :func:`~functional_rb.flashbax.buffers.prioritised_trajectory_buffer.make_prioritised_trajectory_buffer`).

    >>> buffer = make_prioritised_item_buffer(max_length=16, min_length=2, sample_batch_size=3,
    ...                                       add_batches=True)
    >>> state = buffer.add(buffer.init({"x": jnp.zeros(())}), {"x": jnp.arange(4.0)})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> s.experience["x"].shape, s.indices.shape
    ((3,), (3,))
    """
    return create_prioritised_item_buffer(
        max_length,
        min_length,
        sample_batch_size,
        add_sequences,
        add_batches,
        priority_exponent,
        device,
        drawable_only=drawable_only,
        drop_stale_updates=drop_stale_updates,
    )
