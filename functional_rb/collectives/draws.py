"""What each sampler contributes to a draw over several shards (:mod:`functional_rb.collectives.ops`).

A sharded draw needs three things of a shard's sampler, for any sampler:

* its **mass**: what the shard's share of a global draw is proportional to. A single buffer
  holding every shard's items draws an item uniformly (``RandomSampler``: the stored items), a
  trajectory uniformly (slice samplers: the eligible trajectories) or a value proportionally
  (prioritized samplers: the sum tree's total); so shard ``s`` is chosen with probability
  ``mass_s / sum(mass)`` and then draws as it would alone. Without-replacement samplers draw
  in proportion to what their epoch has left (:class:`Epochs`).
* for prioritized samplers, its smallest positive stored value (``vmin``): the importance
  weights of a single buffer, ``(vmin / v) ** beta``, use the minimum over all shards.
* **local draws**: ``count`` independent draws from the shard alone (with replacement), or
  the elements at given ranks of its epoch (without).

:class:`ShardDraws` writes this down; :func:`for_sampler` finds the one of a sampler. The
built-in samplers' are here (they call the samplers' public methods and the public functions
of :mod:`functional_rb.samplers.sum_tree`, :mod:`functional_rb.samplers.trajectories` and
:mod:`functional_rb.samplers.epochs`); a sampler of one's own registers its own with :func:`register`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from functional_rb._internal.random import bits32
from functional_rb.protocol import Context, Drawn
from functional_rb.samplers import epochs, sum_tree, trajectories
from functional_rb.samplers.prioritized import PrioritizedSampler
from functional_rb.samplers.prioritized_slices import PrioritizedSliceSampler
from functional_rb.samplers.slices import SliceSampler, SliceSamplerWithoutReplacement, SliceSpec
from functional_rb.samplers.uniform import RandomSampler, SamplerWithoutReplacement

__all__ = (
    "Epochs",
    "ItemEpochs",
    "Prioritized",
    "ShardDraws",
    "SliceEpochs",
    "Slices",
    "Uniform",
    "for_sampler",
    "register",
)


class ShardDraws(Protocol):
    """How a sampler takes part in a draw over shards.

    ``units(sampler, batch_size)``: ``(U, L)``: units per device (items, or slices) and steps
      per unit (None for items); ``batch_size = U * (L or 1)``.
    ``mass(sampler, state, ctx, batch_size)``: float32 ``[]``: the shard's weight in a global
      draw (0: nothing drawable).
    ``vmin(sampler, state)``: float32 ``[]``: smallest positive stored value (prioritized), else
      1.
    ``draw(sampler, state, key, count, ctx, batch_size, beta)``: ``Drawn`` of ``count``
      independent local draws, leading shape ``[count]`` (``[count, L]``); prioritized weights
      are the shard's own ``(vmin_s / v) ** beta``.

    Declared facts: ``prioritized`` (weights follow values; ``update`` sets priorities and the
    state has a ``max_priority``), ``epochs`` (without replacement: an :class:`Epochs`).
    """

    prioritized: bool
    epochs: bool

    def units(self, sampler, batch_size: int) -> tuple: ...

    def mass(self, sampler, state, ctx: Context, batch_size: int) -> jax.Array: ...

    def vmin(self, sampler, state) -> jax.Array: ...

    def draw(
        self, sampler, state, key, count: int, ctx: Context, batch_size: int, beta
    ) -> Drawn: ...


@dataclasses.dataclass(frozen=True)
class Uniform:
    """``RandomSampler``: items uniformly; mass = items stored."""

    prioritized = False
    epochs = False

    def units(self, sampler, batch_size):
        return batch_size, None

    def mass(self, sampler, state, ctx, batch_size):
        return ctx.size.astype(jnp.float32)

    def vmin(self, sampler, state):
        return jnp.float32(1)

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        return sampler.sample(state, key, count, ctx)[0]


@dataclasses.dataclass(frozen=True)
class Prioritized:
    """``PrioritizedSampler``: values proportionally; mass = the sum tree's total."""

    prioritized = True
    epochs = False

    def units(self, sampler, batch_size):
        return batch_size, None

    def mass(self, sampler, state, ctx, batch_size):
        return jnp.where(ctx.size > 0, sum_tree.total(state.tree), 0.0)

    def vmin(self, sampler, state):
        return sum_tree.min(state.tree)

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        return sampler.sample(state, key, count, ctx, beta=beta)[0]


def _fixed_length(sampler: SliceSpec, slice_len: int) -> SliceSpec:
    """The sampler with ``slice_len`` fixed (so any number of slices can be drawn)."""
    if sampler.slice_len == slice_len:
        return sampler
    return dataclasses.replace(sampler, num_slices=None, slice_len=slice_len)


def eligible_trajectories(
    sampler: SliceSpec, st: trajectories.SliceState, ctx: Context, slice_len: int
) -> jax.Array:
    """int32 ``[]``: stored trajectories a slice of ``slice_len`` steps can be drawn from."""
    if not sampler.strict_length:
        return jnp.sum(st.tail - st.head)
    return trajectories.count_eligible(st, ctx.filled, slice_len, True)


@dataclasses.dataclass(frozen=True)
class Slices:
    """``SliceSampler``: trajectories uniformly; mass = eligible trajectories (counted over the
    trajectory records, O(capacity) elementwise)."""

    prioritized = False
    epochs = False

    def units(self, sampler, batch_size):
        return sampler.shape(batch_size)

    def mass(self, sampler, state, ctx, batch_size):
        _, seq = sampler.shape(batch_size)
        return jnp.where(ctx.size > 0, eligible_trajectories(sampler, state, ctx, seq), 0).astype(
            jnp.float32
        )

    def vmin(self, sampler, state):
        return jnp.float32(1)

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        _, seq = sampler.shape(batch_size)
        return _fixed_length(sampler, seq).sample(state, key, count * seq, ctx)[0]


@dataclasses.dataclass(frozen=True)
class PrioritizedSlices:
    """``PrioritizedSliceSampler``: slice starts by value; mass = the sum tree's total."""

    prioritized = True
    epochs = False

    def units(self, sampler, batch_size):
        return sampler.shape(batch_size)

    def mass(self, sampler, state, ctx, batch_size):
        return jnp.where(ctx.size > 0, sum_tree.total(state.tree), 0.0)

    def vmin(self, sampler, state):
        return sum_tree.min(state.tree)

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        _, seq = sampler.shape(batch_size)
        return _fixed_length(sampler, seq).sample(state, key, count * seq, ctx, beta=beta)[0]


# ------------------------------------------------------------------------------ epochs
@dataclasses.dataclass(frozen=True)
class Epochs:
    """Without replacement: a shard's epoch is an order of its elements (items, or eligible
    trajectories); a global epoch begins on every shard at once and takes from each shard in
    proportion to what it has left (:func:`functional_rb.collectives.exchange.epoch_quotas`).

    ``available(sampler, state, ctx, batch_size)``: int32 ``[]``: elements a new epoch would
    hold (its ``mass``, exactly); ``epoch(state)``: the :class:`functional_rb.samplers.epochs.Epoch` of
    a sampler state;
    ``stale(sampler, state)``: bool ``[]``: this shard wants a new epoch (its elements
    changed); ``begin(sampler, state, key, ctx, batch_size)``: ``(order, size)`` of a new
    epoch; ``take(sampler, state, key, ranks, ok, ctx, batch_size)``: ``(indices, mask)`` of
    the elements at ``ranks`` (int32 ``[...]``, positions in the current epoch's order);
    ``with_epoch(state, epoch, ctx)``: the sampler state holding ``epoch``.
    """

    prioritized = False
    epochs = True

    def vmin(self, sampler, state):
        return jnp.float32(1)

    def mass(self, sampler, state, ctx, batch_size):
        return self.available(sampler, state, ctx, batch_size).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ItemEpochs(Epochs):
    """``SamplerWithoutReplacement``: an epoch orders the items stored when it began."""

    def units(self, sampler, batch_size):
        return batch_size, None

    def available(self, sampler, state, ctx, batch_size):
        return ctx.size

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        raise NotImplementedError  # epochs take by rank (take), never independent draws

    def epoch(self, state):
        return epochs.Epoch(state.perm, state.pos, state.epoch_size, state.epoch)

    def stale(self, sampler, state, ctx):
        return state.epoch_size != ctx.size

    def begin(self, sampler, state, key, ctx, batch_size):
        ar = jnp.arange(state.perm.shape[0], dtype=jnp.int32)
        order = epochs.shuffled(key, ar < ctx.size) if sampler.shuffle else ar
        return order, ctx.size

    def take(self, sampler, state, key, ranks, ok, ctx, batch_size):
        ep = self.epoch(state)
        slot = jnp.clip(ranks, 0, ep.order.shape[0] - 1)
        idx = ctx.layout.rank_to_flat(jnp.where(ok, ep.order[slot], 0), ctx.filled)
        return idx, ok

    def with_epoch(self, state, ep, ctx):
        return dataclasses.replace(
            state, perm=ep.order, pos=ep.pos, epoch_size=ep.size, epoch=ep.count
        )


@dataclasses.dataclass(frozen=True)
class SliceEpochs(Epochs):
    """``SliceSamplerWithoutReplacement``: an epoch orders the eligible trajectories stored when
    it began (oldest first per row when ``shuffle=False``); each yields one slice."""

    def units(self, sampler, batch_size):
        return sampler.shape(batch_size)

    def available(self, sampler, state, ctx, batch_size):
        _, seq = sampler.shape(batch_size)
        return eligible_trajectories(sampler, state.slices, ctx, seq)

    def draw(self, sampler, state, key, count, ctx, batch_size, beta):
        raise NotImplementedError

    def epoch(self, state):
        return epochs.Epoch(state.perm, state.pos, state.epoch_size, state.epoch)

    def stale(self, sampler, state, ctx):
        return (state.epoch_total != state.slices.total) | (state.epoch == 0)

    def begin(self, sampler, state, key, ctx, batch_size):
        _, seq = sampler.shape(batch_size)
        st = state.slices
        ks, _, elig = trajectories.all_records(st, ctx.filled, seq, sampler.strict_length)
        elig = elig.reshape(-1)
        if sampler.shuffle:
            order = epochs.shuffled(key, elig)
        else:  # oldest first per row, as the sampler orders a single buffer's epoch
            ne, cap = ks.shape
            rank = (ks - st.head[:, None]).astype(jnp.float32)
            score = (jnp.arange(ne, dtype=jnp.float32)[:, None] * cap + rank).reshape(-1)
            order = epochs.ordered(score / jnp.float32(ne * cap), elig)
        return order, jnp.sum(elig, dtype=jnp.int32)

    def take(self, sampler, state, key, ranks, ok, ctx, batch_size):
        _, seq = sampler.shape(batch_size)
        st = state.slices
        ep = self.epoch(state)
        flat = jnp.where(ok, ep.order[jnp.clip(ranks, 0, ep.order.shape[0] - 1)], 0)
        cap = st.rec_start.shape[1]
        e = flat // cap
        k = st.head[e] + jnp.remainder(flat % cap - st.head[e], cap)
        shape = ranks.shape
        idx, mask = trajectories.slice_indices(
            st, bits32(key, (flat.size,)), e.reshape(-1), k.reshape(-1), ok.reshape(-1), seq, ctx
        )
        return idx.reshape(shape + (seq,)), mask.reshape(shape + (seq,))

    def with_epoch(self, state, ep, ctx):
        return dataclasses.replace(
            state,
            perm=ep.order,
            pos=ep.pos,
            epoch_size=ep.size,
            epoch_total=state.slices.total,
            epoch=ep.count,
        )


_REGISTRY: dict = {
    RandomSampler: Uniform(),
    PrioritizedSampler: Prioritized(),
    SliceSampler: Slices(),
    PrioritizedSliceSampler: PrioritizedSlices(),
    SamplerWithoutReplacement: ItemEpochs(),
    SliceSamplerWithoutReplacement: SliceEpochs(),
}


def register(sampler_type: type, draws: ShardDraws) -> None:
    """Make samplers of ``sampler_type`` (and its subclasses) drawable over shards."""
    if not isinstance(sampler_type, type):
        raise TypeError(
            f"sharded_draws.register: sampler_type must be a class, got {sampler_type!r}."
        )
    _REGISTRY[sampler_type] = draws


def for_sampler(sampler, where: str = "sharded") -> ShardDraws:
    """The :class:`ShardDraws` of ``sampler`` (its class's, or its nearest base class's)."""
    for klass in type(sampler).__mro__:
        found: ShardDraws | None = _REGISTRY.get(klass)
        if found is not None:
            return found
    raise TypeError(
        f"{where}: the sampler {type(sampler).__name__} cannot draw over shards: no "
        "ShardDraws is registered for it. Built-in samplers have one; for a sampler of your "
        "own, implement functional_rb.collectives.draws.ShardDraws and call "
        "functional_rb.collectives.draws.register(YourSampler, draws)."
    )
