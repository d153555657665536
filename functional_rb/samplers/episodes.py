"""Whole episodes, padded to a fixed length with a mask (flashbax issue #23).

:class:`EpisodeSampler` is a slice sampler (:class:`~functional_rb.samplers.slices.RecordSampler`:
the same arguments, the same trajectory records of :mod:`functional_rb.samplers.trajectories`)
whose slices are whole episodes: each one starts at the first step of an episode that has
ended and whose steps are all still stored, and runs to its end, padded to ``slice_len``
steps. Where :class:`~functional_rb.SliceSampler` with ``strict_length=False`` returns a short
trajectory whole but a window of a long one, and counts the running episode and the surviving
tail of an overwritten one as trajectories, this sampler returns only episodes a learner can
use whole (Monte Carlo returns, a recurrent state from the reset).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from functional_rb._internal.jit import compiled
from functional_rb._internal.random import bits32
from functional_rb._internal.tree import Key
from functional_rb.protocol import Context, Drawn
from functional_rb.samplers import trajectories
from functional_rb.samplers.slices import RecordSampler

__all__ = ("EpisodeSampler",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSampler(RecordSampler):
    """Whole episodes from their first step, padded to ``slice_len`` steps with ``mask`` False.

    Args:
      num_slices / slice_len: exactly one, as for :class:`~functional_rb.SliceSampler`;
        ``batch_size = num_slices * slice_len``: ``num_slices`` episodes per batch, each padded
        (or cut) to ``slice_len`` steps.
      end_key: key of the per-step end flag (default ``("next", "done")``); a step with a True
        flag (any True over trailing axes) ends its episode.
      traj_key: key of per-step episode ids; when given, an episode ends where the next step of
        its env row carries another id (so the newest episode of a row is never complete).

    Which episodes are drawn: those that have ended (a step with the end flag, or a later
    episode in the same row) and whose first step is still stored. The running episode and the
    surviving tail of one the ring has partly overwritten are not drawn (use
    :class:`~functional_rb.SliceSampler` for those). Each batch row picks one such episode
    uniformly (not weighted by length), independently, with replacement, and returns its steps
    from the first: ``mask`` is True on the episode's ``min(L, slice_len)`` steps and False on
    the padding after them (weight 0; index and data repeat the last valid step). An episode
    longer than ``slice_len`` comes back cut to its first ``slice_len`` steps, every entry
    valid: its last returned step has no end flag, which tells it from an episode of exactly
    ``slice_len`` steps. When no episode is complete yet: eagerly a ``ValueError``, under
    ``jit`` ``mask`` all False (the core's policy for an empty buffer).

    Needs a FIFO writer, like every slice sampler. ``Sample.indices``, ``weights`` and
    ``mask`` are ``[num_slices, slice_len]``; data leaves ``[num_slices, slice_len, ...]``.

    >>> import functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=32, batch_size=4 * 6,
    ...                       sampler=frb.EpisodeSampler(slice_len=6, end_key="done"))
    >>> state = rb.init({"t": jnp.int32(0), "done": jnp.bool_(False)})
    >>> t = jnp.arange(10, dtype=jnp.int32)                  # episodes 0-2, 3-6, then 7-9 runs
    >>> state = rb.add(state, {"t": t, "done": (t == 2) | (t == 6)})
    >>> s, state = rb.sample(state, jax.random.key(0))
    >>> sorted({tuple(row[m].tolist()) for row, m in zip(s.data["t"], s.mask)})
    [(0, 1, 2), (3, 4, 5, 6)]
    """

    # what slice samplers take but whole episodes fix: every episode may be drawn (however
    # short), it is never shifted over its ends, and its end is its own (no truncation mark)
    strict_length: bool = dataclasses.field(default=False, init=False, repr=False)
    span: Any = dataclasses.field(default=False, init=False, repr=False)
    truncated_key: Key | None = dataclasses.field(default=None, init=False, repr=False)

    whole_episodes = True

    @compiled("batch_size")
    def _sample(self, state, key, batch_size: int, ctx: Context):
        num, seq_len = self.shape(batch_size)
        bits = bits32(key, (num, trajectories.TRIES + 1))
        e, k, ok, rec = trajectories.draw_records_read(
            state, bits, seq_len, ctx.filled, False, complete=True
        )
        # offset 0: every slice starts at its episode's first step (no random start)
        idx, mask = trajectories.slice_indices(
            state, jnp.zeros((num,), jnp.uint32), e, k, ok, seq_len, ctx, rec=rec
        )
        return Drawn(idx, mask.astype(jnp.float32), mask), state
