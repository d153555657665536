"""flashbax's item buffer (``flashbax.buffers.item_buffer``): independent items in one row
of a trajectory buffer, sampled one at a time (sequence length 1).

Opt-in beyond flashbax: ``make_item_buffer(..., sample_once=True)``: each item is drawn at most
once until it is overwritten (flashbax issue #59; :mod:`functional_rb.flashbax.buffers._once`):
``sample`` returns ``(MaskedTrajectoryBufferSample, state)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from functional_rb.flashbax import _core
from functional_rb.flashbax.buffers import _adding, _once
from functional_rb.flashbax.buffers._once import SampleOnceBufferState
from functional_rb.flashbax.buffers.trajectory_buffer import (
    MaskedTrajectoryBufferSample,
    TrajectoryBuffer,
    TrajectoryBufferSample,
    TrajectoryBufferState,
    make_trajectory_buffer,
)

__all__ = (
    "MaskedTrajectoryBufferSample",
    "SampleOnceBufferState",
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
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batches: bool,
    *,
    sample_once: bool = False,
) -> TrajectoryBuffer:
    """The item buffer (see :func:`make_item_buffer`)."""
    if not isinstance(sample_once, bool):
        raise _core.FlashbaxArgumentError(
            f"make_item_buffer: sample_once must be a Python bool, got {sample_once!r} "
            f"({type(sample_once).__name__}). Pass sample_once=True to draw each item at most "
            "once until it is overwritten, or leave it out."
        )
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

    sample_impl: Callable = sample_fn
    if sample_once:
        buffer = _once.sample_once_buffer(
            buffer,
            rows=1,
            length=max_length,
            batch_size=sample_batch_size,
            pairs=False,
            end_key=None,
            where="make_item_buffer",
        )
        once_sample = buffer.sample

        def once_sample_fn(state: SampleOnceBufferState, rng_key):
            sample, state = once_sample(state, rng_key)
            items = jax.tree_util.tree_map(lambda x: x.squeeze(axis=1), sample.experience)
            return MaskedTrajectoryBufferSample(experience=items, mask=sample.mask), state

        sample_impl = once_sample_fn

    add_fn = _adding.with_axes(_adding.as_one_row(buffer.add), add_batches, add_sequences)
    return buffer.replace(add=add_fn, sample=sample_impl)


def make_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
    *,
    sample_once: bool = False,
) -> TrajectoryBuffer:
    """An item buffer (flashbax's ``make_item_buffer``; same arguments): ``add`` takes one
    item, a sequence, a batch or a batch of sequences, all stored as independent items;
    ``sample`` returns ``sample_batch_size`` items drawn uniformly.

    ``sample_once=True`` (not in flashbax): each item is drawn at most once until it is
    overwritten. The state is then a :class:`SampleOnceBufferState`, and
    ``sample(state, rng_key)`` returns ``(MaskedTrajectoryBufferSample, new_state)``: keep the
    new state, which records what was drawn. Each batch holds ``sample_batch_size`` distinct
    items, uniformly without replacement among those not drawn yet; ``can_sample`` is True only
    when that many are stored. A ``sample`` when fewer are raises ``ValueError`` eagerly and,
    under ``jit``, returns ``mask`` all False and marks nothing drawn.

    >>> buffer = make_item_buffer(max_length=16, min_length=2, sample_batch_size=3,
    ...                           add_batches=True)
    >>> state = buffer.add(buffer.init({"x": jnp.zeros(())}), {"x": jnp.arange(4.0)})
    >>> buffer.sample(state, jax.random.PRNGKey(0)).experience["x"].shape
    (3,)

    >>> buffer = make_item_buffer(max_length=16, min_length=1, sample_batch_size=2,
    ...                           add_batches=True, sample_once=True)
    >>> state = buffer.add(buffer.init({"x": jnp.int32(0)}), {"x": jnp.arange(4)})
    >>> a, state = buffer.sample(state, jax.random.PRNGKey(0))
    >>> b, state = buffer.sample(state, jax.random.PRNGKey(1))
    >>> sorted(a.experience["x"].tolist() + b.experience["x"].tolist())
    [0, 1, 2, 3]
    >>> state = buffer.add(state, {"x": jnp.array([4, 5])})     # new items: drawable
    >>> sorted(buffer.sample(state, jax.random.PRNGKey(2))[0].experience["x"].tolist())
    [4, 5]
    """
    return create_item_buffer(
        max_length,
        min_length,
        sample_batch_size,
        add_sequences,
        add_batches,
        sample_once=sample_once,
    )
