"""flashbax's prioritised flat buffer (``flashbax.buffers.prioritised_flat_buffer``):
transitions drawn by priority from a prioritised trajectory buffer (sequence length 2,
period 1).

Opt-in beyond flashbax: ``end_key="done"``: a pair whose first step ends an episode is never
drawn.
"""

from __future__ import annotations

import jax

from functional_rb.flashbax._records import record
from functional_rb.flashbax.buffers import _adding
from functional_rb.flashbax.buffers.flat_buffer import (
    TransitionSample,
    pair,
    validate_flat_buffer_args,
)
from functional_rb.flashbax.buffers.prioritised_trajectory_buffer import (
    Indices,
    PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferState,
    Probabilities,
    generations_of,
    make_prioritised_trajectory_buffer,
    validate_device,
)

__all__ = (
    "GenerationalPrioritisedTransitionSample",
    "PrioritisedTransitionSample",
    "make_prioritised_flat_buffer",
    "validate_priority_exponent",
)


@record
class PrioritisedTransitionSample(TransitionSample):
    """Transitions with their item ``indices`` and draw ``probabilities``."""

    indices: Indices
    probabilities: Probabilities


@record
class GenerationalPrioritisedTransitionSample(PrioritisedTransitionSample):
    """A sample of a buffer built with ``drop_stale_updates=True`` (not in flashbax): flashbax's
    fields and the drawn items' write ``generations``."""

    generations: jax.Array


def validate_priority_exponent(priority_exponent: float) -> None:
    """flashbax's check: ``0 <= priority_exponent <= 1``."""
    if not 0 <= priority_exponent <= 1:
        raise ValueError(
            f"priority_exponent must be in the range [0, 1], but was {priority_exponent}"
        )


def make_prioritised_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batch_size: int | None = None,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    *,
    end_key=None,
    drawable_only: bool = False,
    drop_stale_updates: bool = False,
) -> PrioritisedTrajectoryBuffer:
    """A prioritised flat buffer (flashbax's ``make_prioritised_flat_buffer``; same
    arguments). Not in flashbax: ``end_key``: pairs whose first step ends an episode are never
    drawn; ``drawable_only`` and ``drop_stale_updates`` as in
    :func:`~functional_rb.flashbax.buffers.prioritised_trajectory_buffer.make_prioritised_trajectory_buffer`.

    >>> buffer = make_prioritised_flat_buffer(max_length=32, min_length=2, sample_batch_size=4)
    >>> state = buffer.init({"obs": jnp.zeros(2)})
    >>> for t in range(4):
    ...     state = buffer.add(state, {"obs": jnp.full(2, t, jnp.float32)})
    >>> s = buffer.sample(state, jax.random.PRNGKey(0))
    >>> state = buffer.set_priorities(state, s.indices, jnp.full(4, 2.0))
    >>> s.indices.shape, s.probabilities.shape
    ((4,), (4,))
    """
    add_batches = add_batch_size is not None
    add_batch_size = add_batch_size if add_batch_size is not None else 1  # (add_batches)
    validate_priority_exponent(priority_exponent)
    validate_flat_buffer_args(max_length, min_length, sample_batch_size, add_batch_size)
    validate_device(device)
    buffer = make_prioritised_trajectory_buffer(
        max_length_time_axis=max_length // add_batch_size,
        min_length_time_axis=min_length // add_batch_size + 1,
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=2,
        period=1,
        priority_exponent=priority_exponent,
        device=device,
        end_key=end_key,
        drawable_only=drawable_only,
        drop_stale_updates=drop_stale_updates,
    )

    def sample_fn(state: PrioritisedTrajectoryBufferState, rng_key) -> PrioritisedTransitionSample:
        s = buffer.sample(state, rng_key)
        fields = dict(
            experience=pair(s.experience), indices=s.indices, probabilities=s.probabilities
        )
        generations = generations_of(s)
        if generations is None:
            return PrioritisedTransitionSample(**fields)
        return GenerationalPrioritisedTransitionSample(**fields, generations=generations)

    return buffer.replace(
        add=_adding.with_axes(buffer.add, add_batches, add_sequences, add_batch_size),
        sample=sample_fn,
    )
