"""Samplers: which items come out (the protocol: :class:`functional_rb.protocol.Sampler`).

A sampler is a frozen, hashable config with pure functions (``ctx`` is a
:class:`functional_rb.protocol.Context`, ``record`` a :class:`functional_rb.protocol.WriteRecord`)::

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
from functional_rb._internal.names import stable
from functional_rb._internal.random import bits32
from functional_rb.protocol import Context, Drawn, Layout, Sampler
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


# Up to this many items one 32-bit word per draw maps to [0, n) with a relative bias of at most
# n / 2**32 <= 2.4e-4 (Lemire's multiply-shift), undetectable by any test of practical size;
# above it two words (a 64-bit fraction) per draw: bias at most n / 2**64 < 1.2e-10.
# Not jax.random.randint: on CPU a jitted call of 256 of its draws costs ~50 us more (threefry's
# loop and its rejection arithmetic), more than the gather of a 256-item sample at 10^8 items.
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


def _scale_u64(hi: jax.Array, lo: jax.Array, n: jax.Array) -> jax.Array:
    """``floor((hi * 2**32 + lo) * n / 2**64)`` for uint32 arrays, exactly, in uint32: the
    high word of ``hi * n`` plus the carry out of its low word plus ``floor(lo * n / 2**32)``
    (the rest of ``lo * n`` is below ``2**32`` and cannot carry)."""
    low = hi * n  # wraps: the low word of hi * n
    mid = _mulhi_u32(lo, n)
    carry = (low + mid < low).astype(jnp.uint32)
    return _mulhi_u32(hi, n) + carry


def uniform_index(key: jax.Array, shape: tuple, n: jax.Array, max_n: int) -> jax.Array:
    """int32 ``shape``: uniform draws in ``[0, n)`` for a traced int32 ``n`` in ``[1, max_n]``.

    ``max_n`` is static (the capacity). Draws are hashed random words
    (:func:`functional_rb._internal.random.bits32`: about a fifth of ``jax.random.bits``' cost
    on CPU, where the draw dominates a small sample) mapped to ``[0, n)`` by a multiply-shift:
    one word per draw up to ``2**20`` (relative bias at most ``n / 2**32``), two above (at most
    ``n / 2**64``).

    >>> import jax, jax.numpy as jnp
    >>> from functional_rb.samplers import uniform_index
    >>> i = uniform_index(jax.random.key(0), (4,), jnp.int32(300_000_000), 2**30)
    >>> bool(((i >= 0) & (i < 300_000_000)).all()), i.dtype
    (True, dtype('int32'))
    """
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.uint32)
    if max_n > _ONE_WORD_MAX:
        words = bits32(key, (*shape, 2))
        return _scale_u64(words[..., 0], words[..., 1], n).astype(jnp.int32)
    return _mulhi_u32(bits32(key, shape), n).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomSampler(Sampler):
    """Uniform sampling with replacement over the stored items.

    ``indices[i]`` is uniform over stored positions, independently for each ``i``; weights are 1.
    """

    state_types = (EmptySamplerState,)

    def init(self, item_spec, layout: Layout) -> EmptySamplerState:
        del item_spec, layout
        return EmptySamplerState()

    def sample(self, state, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
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

    def sample(self, state: WithoutReplacementState, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
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
