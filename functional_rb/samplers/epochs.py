"""Epochs without replacement, shared by the samplers that draw each element once per epoch.

An epoch is an order (a permutation) of the elements eligible when it began: items for
:class:`~functional_rb.SamplerWithoutReplacement`, trajectories for
:class:`~functional_rb.SliceSamplerWithoutReplacement`. Each batch takes the next ``count``
entries of the order. A new epoch begins when the caller says so (``stale``: the stored
elements changed), when the order is exhausted, or, with ``drop_last``, when fewer than
``count`` entries remain. With ``drop_last=False`` the last batch of an epoch holds the
remaining entries followed by padding (``ok`` False): shapes are static under jit, so a batch
cannot shrink.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Epoch(NamedTuple):
    """The counters of an epoch, as the samplers' states store them.

    order: int32 ``[M]``: element ids in draw order; the first ``size`` are this epoch's.
    pos: int32 ``[]``: entries of ``order`` drawn so far this epoch.
    size: int32 ``[]``: elements in this epoch (0: no epoch begun yet).
    count: int32 ``[]``: epochs begun so far.
    """

    order: jax.Array
    pos: jax.Array
    size: jax.Array
    count: jax.Array  # type: ignore[assignment]  # the field shadows tuple.count


def shuffled(key: jax.Array, eligible: jax.Array) -> jax.Array:
    """int32 ``[M]``: the eligible ids (bool ``[M]``) in a uniformly random order, first."""
    score = jax.random.uniform(key, eligible.shape)
    return ordered(score, eligible)


def ordered(score: jax.Array, eligible: jax.Array) -> jax.Array:
    """int32 ``[M]``: the eligible ids sorted by ``score`` (float32 ``[M]`` in ``[0, 1)``),
    first; the others after them."""
    return jnp.argsort(jnp.where(eligible, score, 2.0)).astype(jnp.int32)


def next_batch(
    epoch: Epoch, count: int, *, stale: jax.Array, drop_last: bool, begin: Callable[[], tuple]
) -> tuple[jax.Array, jax.Array, Epoch]:
    """The next ``count`` (a Python int) entries of the epoch, beginning a new one if needed.

    stale: bool ``[]``: the caller's reason to begin a new epoch (e.g. items were added).
    begin: ``() -> (order int32 [M], size int32 [])``: a new epoch's order; traced only in
      the branch that runs it (``lax.cond``).
    Returns ``(ids int32 [count], ok bool [count], new Epoch)``: ``ids`` are 0 where ``ok`` is
    False (padding, or nothing to draw).
    """
    remaining = epoch.size - epoch.pos
    need = stale | (remaining <= 0)
    if drop_last:
        need = need | (remaining < count)

    def new_epoch(_):
        order, size = begin()
        return Epoch(order, jnp.int32(0), jnp.asarray(size, jnp.int32), epoch.count + 1)

    cur = jax.lax.cond(need, new_epoch, lambda _: epoch, None)
    slot = cur.pos + jnp.arange(count, dtype=jnp.int32)
    ok = slot < cur.size
    if drop_last:
        ok = ok & (cur.size - cur.pos >= count)
    ids = jnp.where(ok, cur.order[jnp.minimum(slot, cur.order.shape[0] - 1)], 0)
    taken = jnp.minimum(jnp.int32(count), jnp.maximum(cur.size - cur.pos, 0))
    return ids, ok, cur._replace(pos=cur.pos + taken)
