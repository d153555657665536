"""``sample_once=True`` of the flat and item buffers (not in flashbax; flashbax issue #59):
each item is drawn at most once until its step is rewritten, on the core's
:class:`~functional_rb.SampleOnceSampler`.

The state gains one flag per stored step (:class:`SampleOnceBufferState`, ``used``, in
flashbax's ``[add_batch_size, max_length_time_axis]`` layout): set when the item starting at
that step is drawn, cleared when ``add`` writes the step. For the flat buffer an item is the
transition ``(s_t, s_t+1)`` starting at step ``t``: it can be drawn once ``t + 1`` is stored
(``t`` is not the newest step of its row), and with ``end_key`` only if step ``t`` does not end
an episode. Batches are full or nothing (the core sampler's ``drop_last=True``): ``sample``
returns ``(sample, new_state)`` with ``sample_batch_size`` distinct items, uniformly without
replacement among those not drawn yet; when fewer remain it raises eagerly and, under ``jit``,
returns ``mask`` all False and marks nothing drawn. ``can_sample`` says whether a full batch
is there (and flashbax's minimum length is reached).
"""

from __future__ import annotations

from typing import Generic

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import enforce
from functional_rb._internal.tree import get_key
from functional_rb.flashbax import _core
from functional_rb.flashbax._records import record
from functional_rb.flashbax.buffers.trajectory_buffer import (
    Experience,
    MaskedTrajectoryBufferSample,
    TrajectoryBuffer,
    TrajectoryBufferState,
    init,
)
from functional_rb.samplers.once import SampleOnceSampler, SampleOnceState

__all__ = ("SampleOnceBufferState", "sample_once_buffer")

_SAMPLER = SampleOnceSampler(drop_last=True)


@record
class SampleOnceBufferState(TrajectoryBufferState, Generic[Experience]):
    """State of a flat or item buffer built with ``sample_once=True`` (not in flashbax).

    used: bool ``[add_batch_size, max_length_time_axis]``: the item (flat buffer: the
      transition) starting at this step was drawn since the step was written, or nothing is
      stored there. ``add`` clears the flags of the steps it writes; ``sample`` sets those of
      the items it returns.
    """

    used: jax.Array


def _sampler_state(used: jax.Array) -> SampleOnceState:
    """The core sampler's state of the flags ``used`` ``[rows, length]`` (its counter is
    recomputed: this state keeps only the flags, flashbax-shaped)."""
    flat = used.reshape(-1)
    return SampleOnceState(used=flat, left=jnp.sum(~flat, dtype=jnp.int32))


def sample_once_buffer(
    base: TrajectoryBuffer,
    *,
    rows: int,
    length: int,
    batch_size: int,
    pairs: bool,
    end_key: object | None,
    where: str,
) -> TrajectoryBuffer:
    """``base`` (a trajectory buffer of ``rows`` rows of ``length`` steps, whose
    ``can_sample`` holds flashbax's minimum-length rule) with ``sample_once`` functions:
    ``add`` takes ``[rows, T, ...]``; ``sample(state, key)`` returns
    ``(MaskedTrajectoryBufferSample, state)`` whose experience leaves are
    ``[batch_size, 2 if pairs else 1, ...]`` and whose mask is ``[batch_size]``.

    >>> from functional_rb.flashbax.buffers.trajectory_buffer import make_trajectory_buffer
    >>> base = make_trajectory_buffer(add_batch_size=1, sample_batch_size=2,
    ...     sample_sequence_length=1, period=1, min_length_time_axis=1, max_length_time_axis=4)
    >>> buffer = sample_once_buffer(base, rows=1, length=4, batch_size=2, pairs=False,
    ...                             end_key=None, where="example")
    >>> state = buffer.add(buffer.init({"x": jnp.int32(0)}), {"x": jnp.arange(3)[None]})
    >>> s, state = buffer.sample(state, jax.random.PRNGKey(0))
    >>> s.experience["x"].shape, int((~state.used).sum())   # one of three left to draw
    ((2, 1), 1)
    """
    most = rows * (length - 1) if pairs else rows * length
    what = "transitions" if pairs else "items"
    if batch_size > most:
        raise _core.FlashbaxArgumentError(
            f"{where}: with sample_once=True every batch holds sample_batch_size distinct "
            f"{what}, but sample_batch_size={batch_size} exceeds the {most} {what} the buffer "
            f"can hold at once, so no batch could ever be drawn. Use sample_batch_size <= "
            f"{most}, or a larger max_length."
        )
    steps = 2 if pairs else 1

    def init_fn(experience):
        state = init(experience, rows, length)
        if end_key is not None:
            try:
                get_key(state.experience, end_key, where=f"{where}(end_key={end_key!r}).init")
            except KeyError as e:
                raise _core.FlashbaxArgumentError(e.args[0]) from None
        return SampleOnceBufferState(
            experience=state.experience,
            current_index=state.current_index,
            is_full=state.is_full,
            used=jnp.ones((rows, length), bool),
        )

    def add_fn(state, batch):
        experience, cursor, full, st, _ = _core.write(
            state.experience,
            state.current_index,
            state.is_full,
            batch,
            where="add",
            sampler=_SAMPLER,
            sampler_state=_sampler_state(state.used),
        )
        return state.replace(
            experience=experience,
            current_index=cursor,
            is_full=full,
            used=st.used.reshape(rows, length),
        )

    def drawable(state, used):
        """``slots -> bool``: the item starting at each flat slot may be drawn now."""
        done = None
        if end_key is not None:
            flags = get_key(state.experience, end_key, where=where)
            done = jnp.any(flags.reshape(rows * length, -1) != 0, axis=-1)
        newest = jnp.mod(jnp.asarray(state.current_index, jnp.int32) - 1, length)

        def fn(slots):
            ok = ~used[slots]
            if pairs:  # the next step is stored: not the newest step of the row
                ok = ok & (slots % length != newest)
            if done is not None:  # the transition stays inside its episode
                ok = ok & ~done[slots]
            return ok

        return fn

    def sample_fn(state, rng_key):
        st = _sampler_state(state.used)
        fn = drawable(state, st.used)
        drawn, st = _SAMPLER.draw(st, rng_key, batch_size, fn)
        enforce(
            ~jnp.all(drawn.mask),
            lambda i, n: (
                f"{where}(sample_once=True): sample: a batch holds sample_batch_size="
                f"{batch_size} {what} not drawn since they were written, but only "
                f"{int(jnp.sum(fn(jnp.arange(rows * length))))} are stored. Add more first "
                "(check buffer.can_sample(state)); under jax.jit the sample comes back with "
                "mask all False and nothing is marked drawn."
            ),
        )
        slots = drawn.indices
        t = slots % length
        nxt = slots - t + (t + 1) % length
        idx = jnp.stack([slots, nxt], axis=1) if pairs else slots[:, None]
        data = _core.read(state.experience, state.current_index, state.is_full, idx[:, :steps])
        sample = MaskedTrajectoryBufferSample(experience=data, mask=drawn.mask)
        return sample, state.replace(used=st.used.reshape(rows, length))

    def can_sample_fn(state):
        fn = drawable(state, state.used.reshape(-1))
        n = jnp.sum(fn(jnp.arange(rows * length, dtype=jnp.int32)), dtype=jnp.int32)
        return base.can_sample(state) & (n >= batch_size)

    return TrajectoryBuffer(init=init_fn, add=add_fn, sample=sample_fn, can_sample=can_sample_fn)
