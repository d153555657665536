"""Samplers: which items come out (the protocol: :class:`functional_rb.base.Sampler`).

A sampler is a frozen, hashable config with pure functions (``ctx`` is a
:class:`functional_rb._internal.layout.Context`, ``record`` a :class:`functional_rb.base.WriteRecord`)::

    init(item_spec, layout)                          -> state
    on_add(state, record, items, ctx)                -> state   # ctx: after the write
    can_sample(state, ctx, batch_size)               -> bool []
    sample(state, key, batch_size, ctx, **options)   -> (Drawn, state)
    update(state, indices, priorities, ctx)          -> state
    finalize(data, drawn, ctx)                       -> data    # post-process gathered data

Samplers never return out-of-range indices: where nothing can be drawn they return valid
indices with ``mask`` False and ``weight`` 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import enforce
from functional_rb._internal.layout import Context, Layout
from functional_rb._internal.random import bits32
from functional_rb.base import Drawn, Sampler
from functional_rb.checkpoint.names import stable
from functional_rb.samplers import epochs

__all__ = (
    "Drawn",
    "EmptySamplerState",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "WithoutReplacementState",
    "uniform_index",
)


@stable("EmptySamplerState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmptySamplerState:
    """Samplers without dynamic state carry this (no leaves)."""


# Below this many items one 32-bit word per draw maps to [0, n) with a relative bias of at most
# n / 2**32 <= 2.4e-4 (Lemire's multiply-shift), undetectable by any test of practical size;
# above it the exact (two-word) jax.random.randint is used.
_ONE_WORD_MAX = 1 << 20


def _mulhi_u32(a: jax.Array, b: jax.Array) -> jax.Array:
    """``floor(a * b / 2**32)`` for uint32 arrays, exactly, without 64-bit integers."""
    m16 = jnp.uint32(0xFFFF)
    s16 = jnp.uint32(16)
    al, ah = a & m16, a >> s16
    bl, bh = b & m16, b >> s16
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> s16) + (lh & m16) + (hl & m16)
    return hh + (lh >> s16) + (hl >> s16) + (mid >> s16)


def uniform_index(key: jax.Array, shape: tuple, n: jax.Array, max_n: int) -> jax.Array:
    """int32 ``shape``: uniform draws in ``[0, n)`` for a traced int32 ``n`` in ``[1, max_n]``.

    ``max_n`` is static (the capacity). Up to 2**20 this costs one hashed random word per draw
    (:func:`functional_rb._internal.random.bits32`: about a fifth of ``jax.random.bits``' cost on CPU,
    where the draw dominates a small sample); above, it is ``jax.random.randint``.
    """
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    if max_n > _ONE_WORD_MAX:
        return jax.random.randint(key, shape, 0, n, dtype=jnp.int32)
    bits = bits32(key, shape)
    return _mulhi_u32(bits, n.astype(jnp.uint32)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomSampler(Sampler):
    """Uniform sampling with replacement over the stored items.

    ``indices[i]`` is uniform over stored positions, independently for each ``i``; weights are 1.
    """

    state_types = (EmptySamplerState,)

    def init(self, item_spec, layout: Layout) -> EmptySamplerState:
        del item_spec, layout
        return EmptySamplerState()

    def sample(self, state, key, batch_size: int, ctx: Context):
        size = ctx.size
        u = uniform_index(key, (batch_size,), size, ctx.layout.capacity)
        ok = jnp.broadcast_to(size > 0, (batch_size,))
        idx = ctx.layout.rank_to_flat(u, ctx.filled)
        return Drawn(idx, ok.astype(jnp.float32), ok), state


@stable("WithoutReplacementState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithoutReplacementState:
    perm: jax.Array  # int32 [capacity]: ranks in [0, epoch_size) in draw order
    pos: jax.Array  # int32 []: how many of `perm` were drawn this epoch
    epoch_size: jax.Array  # int32 []: items stored when this epoch began (0: no epoch yet)
    epoch: jax.Array  # int32 []: epochs begun so far


@dataclasses.dataclass(frozen=True)
class SamplerWithoutReplacement(Sampler):
    """Each stored item once per epoch (TorchRL's SamplerWithoutReplacement).

    An epoch (:mod:`functional_rb.samplers.epochs`) is a permutation of the items stored when it began
    (in storage order when ``shuffle=False``). A new epoch begins when the previous one is
    exhausted, when the number of stored items changed since it began (as TorchRL does), or,
    with ``drop_last=True``, when fewer than ``batch_size`` items remain. With
    ``drop_last=False`` the last batch of an epoch holds the remaining items followed by padding
    with ``mask`` False and weight 0 (shapes are static under jit, so the batch cannot shrink).

    A batch larger than the items stored (``drop_last=False``; with ``drop_last=True`` nothing
    can be sampled then) cannot hold each item at most once: eagerly ``sample`` raises
    ``ValueError``, as for an empty buffer; under ``jit`` the batch holds the stored items
    followed by padding (``mask`` False, weight 0), as at the end of an epoch.
    """

    drop_last: bool = False
    shuffle: bool = True
    state_types = (WithoutReplacementState,)

    def init(self, item_spec, layout: Layout) -> WithoutReplacementState:
        del item_spec
        return WithoutReplacementState(
            perm=jnp.arange(layout.capacity, dtype=jnp.int32),
            pos=jnp.int32(0),
            epoch_size=jnp.int32(0),
            epoch=jnp.int32(0),
        )

    def validate(self, *, capacity: int, batch_size: int, ndim: int):
        del ndim
        if self.drop_last and batch_size > capacity:
            raise ValueError(
                f"SamplerWithoutReplacement: batch_size={batch_size} exceeds capacity="
                f"{capacity} with drop_last=True, so no batch could ever be drawn. Use a "
                "batch_size <= capacity or drop_last=False."
            )

    def can_sample(self, state, ctx: Context, batch_size: int):
        del state
        if self.drop_last:
            return ctx.size >= batch_size
        return ctx.size > 0

    def sample(self, state: WithoutReplacementState, key, batch_size: int, ctx: Context):
        size = ctx.size
        cap = state.perm.shape[0]
        self.validate(capacity=cap, batch_size=batch_size, ndim=ctx.layout.ndim)
        enforce(
            (size > 0) & (size < batch_size),
            lambda i, n: (
                f"SamplerWithoutReplacement.sample: batch_size={batch_size} but only {int(size)} "
                "items are stored, and without replacement a batch holds each item at most once. "
                f"Add items first (sample once rb.size(state) >= {batch_size}), ask for fewer "
                "(rb.sample(state, key, batch_size=n)), or use RandomSampler (with replacement). "
                "Under jax.jit the batch holds the stored items followed by padding with mask "
                "False and weight 0."
            ),
        )

        def begin():
            ar = jnp.arange(cap, dtype=jnp.int32)
            return (epochs.shuffled(key, ar < size) if self.shuffle else ar), size

        epoch = epochs.Epoch(state.perm, state.pos, state.epoch_size, state.epoch)
        ranks, ok, epoch = epochs.next_batch(
            epoch, batch_size, stale=state.epoch_size != size, drop_last=self.drop_last, begin=begin
        )
        idx = ctx.layout.rank_to_flat(ranks, ctx.filled)
        new_state = WithoutReplacementState(
            perm=epoch.order, pos=epoch.pos, epoch_size=epoch.size, epoch=epoch.count
        )
        return Drawn(idx, ok.astype(jnp.float32), ok), new_state
