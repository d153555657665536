"""Sharded buffers, per shard: what ``ReplayBuffer`` methods do when given ``axis_name=``.

Inside ``jax.shard_map`` (or ``jax.pmap``) over a mesh axis, each device holds one shard: an
ordinary :class:`~functional_rb.BufferState` of ``rb.capacity`` items. The functions here take
that local state and use collectives over the axis, so that the shards behave as one buffer
holding their union (:class:`~functional_rb.ShardedReplayBuffer` is a thin layer over them)::

    sample, local = rb.sample(local, key, axis_name="data")            # a global draw
    local = rb.update(local, sample.indices, priorities, axis_name="data")
    rb.size(local, axis_name="data"); rb.can_sample(local, axis_name="data")

What is communicated, and when
------------------------------
* ``add``: nothing (each device writes its own items into its own shard).
* ``sample``, global (``rb.sample(..., axis_name=...)``): an all-gather of two scalars per
  shard (its mass and, prioritized, its smallest value) and of shard 0's key (so every device
  plans with the same randomness, whatever key it was given); then the rows themselves, by
  ``all_to_all`` (:mod:`functional_rb.collectives.exchange`): about the rows that live on other
  devices, and nothing else. Without replacement, a third scalar per shard (its epoch's state).
* ``sample``, local (:func:`sample` with ``sampling="local"``): each device draws from its own
  shard; only the two scalars per shard are gathered, for the weights.
* ``update``: an all-gather of the batch's indices and priorities (``n * B`` of each), so each
  shard applies those it owns in the global order (the last occurrence of an index wins, as
  in one buffer) and every shard tracks the global maximum priority (new items get it, as in
  one buffer).
* ``size``, ``can_sample``, ``can_insert``: a ``psum`` of a few scalars.

Global indices: ``shard * rb.capacity + position`` (int32), for the shard of the device at
that position of the axis. Exactness of a global draw (distribution, weights) is argued in
:mod:`functional_rb.collectives.exchange` and :mod:`functional_rb.collectives.draws`; local draws'
weights are those of the distribution they follow (see :func:`sample`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from functional_rb import generations as _generations
from functional_rb import rate_limiter as _rate_limiter
from functional_rb.collectives import draws as sharded_draws
from functional_rb.collectives import exchange as sharded_exchange
from functional_rb.collectives.exchange import fold
from functional_rb.protocol import Drawn, Sample
from functional_rb.samplers.epochs import Epoch

_F32_MAX = float(jnp.finfo(jnp.float32).max)
SAMPLING = ("global", "local")
# rows per pair and round, as a multiple of the even share U / n: stratified counts exceed
# the share only by an uneven mass (>25% above the mean: more rounds); multinomial counts
# vary by chance, and 1.5 needs a second round in about 5% of the draws at U = 256, n = 8
DEFAULT_CAPACITY_FACTOR = {"stratified": 1.25, "multinomial": 1.5}


def require_axis(axis_name, where: str) -> int:
    """The size of mesh axis ``axis_name``; a clear ``NameError`` when it is not bound here."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise NameError(
            f"{where}: axis_name={axis_name!r} is not a bound mesh axis here. Per-shard calls "
            "run inside jax.shard_map(..., mesh=mesh) or jax.pmap(..., axis_name=...) over "
            "an axis whose devices each hold one shard; outside, use "
            "frb.ShardedReplayBuffer(rb, mesh, axis_name=...), which does that for you."
        ) from e


def _me(axis_name) -> jax.Array:
    return jax.lax.axis_index(axis_name).astype(jnp.int32)


def _key_words(key) -> jax.Array:
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return jnp.asarray(data, jnp.uint32).reshape(-1)


def _gather_stats(rb, draws, state, ctx, bs, axis_name, key=None, local=False):
    """One all-gather of every shard's numbers: ``(stats float32 [n, 3], epoch int32 [n, 3]
    or None, shared key)``. Per shard: its mass, smallest value and (``local``) whether it can
    draw a batch alone; without replacement, whether its epoch is stale, what the epoch has
    left and how many elements a new one would hold (exact int32); with ``key``, shard 0's
    key, so every device plans a global draw with the same randomness (whatever key each was
    given). One collective rather than several: each has a fixed cost."""
    if draws.epochs:
        avail = draws.available(rb.sampler, state.sampler, ctx, bs).astype(jnp.int32)
        mass = avail.astype(jnp.float32)
    else:
        mass = draws.mass(rb.sampler, state.sampler, ctx, bs)
    alone = (
        jnp.asarray(rb.sampler.can_sample(state.sampler, ctx, bs), jnp.float32)
        if local
        else jnp.float32(0)
    )
    mine = jnp.stack([mass, draws.vmin(rb.sampler, state.sampler), alone]).astype(jnp.float32)
    words = [jax.lax.bitcast_convert_type(mine, jnp.uint32)]
    if draws.epochs:
        ep = draws.epoch(state.sampler)
        extra = jnp.stack(
            [draws.stale(rb.sampler, state.sampler, ctx).astype(jnp.int32), ep.size - ep.pos, avail]
        )
        words.append(jax.lax.bitcast_convert_type(extra, jnp.uint32))
    if key is not None:
        words.append(_key_words(key))
    got = jax.lax.all_gather(jnp.concatenate(words), axis_name)
    stats = jax.lax.bitcast_convert_type(got[:, :3], jnp.float32)
    epoch = jax.lax.bitcast_convert_type(got[:, 3:6], jnp.int32) if draws.epochs else None
    if key is None:
        return stats, epoch, None
    shared = got[0, 6 if draws.epochs else 3 :]
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        shared = jax.random.wrap_key_data(
            shared.reshape(jax.random.key_data(key).shape), impl=jax.random.key_impl(key)
        )
    return stats, epoch, shared


def _beta(rb, draws, options, where):
    if not draws.prioritized:
        return None
    return rb.sampler.prioritization.beta_for(options.get("beta"), where=where)


def _expand(flag, like):
    return flag.reshape(flag.shape + (1,) * (like.ndim - flag.ndim))


# ------------------------------------------------------------------------------ sample
def sample(
    rb,
    state,
    key,
    batch_size: int,
    axis_name,
    options: dict,
    *,
    sampling: str = "global",
    counts: str = "stratified",
    capacity_factor: float | None = None,
):
    """``(Sample, new local state)``: this device's ``batch_size`` items (``Sample`` leaves
    ``[B, ...]``, slices ``[num_slices, slice_len, ...]``) with global indices.

    ``sampling="global"``: drawn from the union of the shards as one buffer holding them
    would (``counts``, ``capacity_factor``: :mod:`functional_rb.collectives.exchange`);
    prioritized weights ``(vmin / v) ** beta`` with the global minimum. ``"local"``: from
    this device's shard alone (no rows move); the weights are those of the distribution
    actually used, in which shard ``s`` (mass ``T_s``: items, eligible trajectories or total
    priority) gives each device all its rows: prioritized, ``P(i) = v_i / (n T_s)`` and
    ``w_i = (min_j P(j) / P(i)) ** beta`` over all shards' items; otherwise ``w_i = T_s /
    max_t T_t`` (``P(i) ~ 1 / T_s``, fully corrected), so that weighted averages over the
    devices' batches estimate the union's. Without replacement, local epochs are each shard's
    own.
    """
    smp, new_state, _ = sample_and_ok(
        rb,
        state,
        key,
        batch_size,
        axis_name,
        options,
        sampling=sampling,
        counts=counts,
        capacity_factor=capacity_factor,
    )
    return smp, new_state


def sample_and_ok(
    rb,
    state,
    key,
    batch_size: int,
    axis_name,
    options: dict,
    *,
    sampling: str = "global",
    counts: str = "stratified",
    capacity_factor: float | None = None,
):
    """:func:`sample` and a bool ``[]`` that is the same on every device: something could be
    drawn (global), every shard could draw its batch (local). Eager callers raise on it."""
    if sampling not in SAMPLING:
        raise ValueError(f"sharded sample: sampling must be one of {SAMPLING}, got {sampling!r}.")
    draws = sharded_draws.for_sampler(rb.sampler, "ReplayBuffer.sample")
    where = "ReplayBuffer.sample"
    beta = _beta(rb, draws, options, where)
    ctx = rb.context(state)
    if sampling == "local":
        stats, _, _ = _gather_stats(rb, draws, state, ctx, batch_size, axis_name, local=True)
        smp, new_state = _local(rb, draws, state, key, batch_size, axis_name, options, beta, stats)
        return smp, new_state, jnp.all(stats[:, 2] > 0)
    stats, epoch, shared = _gather_stats(rb, draws, state, ctx, batch_size, axis_name, key)
    if capacity_factor is None:
        capacity_factor = DEFAULT_CAPACITY_FACTOR[counts]
    if draws.epochs:
        (data, gens), idx, w, mask, sampler_state, ok = _global_epoch(
            rb, draws, state, shared, batch_size, axis_name, capacity_factor, epoch
        )
    else:
        (data, gens), idx, w, mask, ok = _global_draw(
            rb, draws, state, shared, batch_size, axis_name, beta, counts, capacity_factor, stats
        )
        sampler_state = state.sampler
    mask = mask & ok
    weights = jnp.where(mask, w, 0.0).astype(jnp.float32)
    data = rb.sampler.finalize(data, Drawn(idx, weights, mask), rb.context(state))
    limiter = _rate_limiter.sampled(rb.rate_limiter, state.limiter, jnp.where(ok, batch_size, 0))
    new_state = dataclasses.replace(state, sampler=sampler_state, limiter=limiter)
    if gens is not None:  # the owner's stamps, travelled with the rows
        gens = jnp.where(mask, gens, jnp.int32(_generations.NO_ITEM))
    return Sample(data, idx, weights, mask, gens), new_state, ok


def _rows(rb, state, idx, ctx):
    """What travels for local rows ``idx``: ``(items, their generations or None)``."""
    gens = None if state.generations is None else state.generations.slots[idx]
    return rb.storage.get(state.storage, idx, ctx), gens


def _local(rb, draws, state, key, bs, axis_name, options, beta, stats):
    """Each device samples its own shard; the weights take the shards' shares into account."""
    me = _me(axis_name)
    smp, new_state = rb.sample(state, jax.random.fold_in(key, me), bs, **options)
    mass, vmin = stats[me, 0], stats[me, 1]
    masses = stats[:, 0]
    if draws.prioritized:
        # w_i = (X T_s / v_i) ** beta with X = min_t vmin_t / T_t; smp.weights = (vmin_s / v_i)
        # ** beta, hence the factor (X T_s / vmin_s) ** beta
        ratio = jnp.where(masses > 0, stats[:, 1] / jnp.where(masses > 0, masses, 1.0), jnp.inf)
        x = jnp.min(ratio)
        factor = jnp.where(jnp.isfinite(vmin) & (mass > 0), (x * mass / vmin) ** beta, 0.0)
    else:
        factor = mass / jnp.maximum(jnp.max(masses), jnp.float32(1e-30))
    weights = jnp.where(smp.mask, smp.weights * factor, 0.0).astype(jnp.float32)
    idx = me * jnp.int32(rb.capacity) + smp.indices
    return smp._replace(indices=idx, weights=weights), new_state


def _global_draw(rb, draws, state, shared, bs, axis_name, beta, counts, capacity_factor, stats):
    """With replacement: ``(data, indices, weights, mask, ok)`` of this device's units."""
    ctx = rb.context(state)
    n, me = jax.lax.axis_size(axis_name), _me(axis_name)
    units, seq = draws.units(rb.sampler, bs)
    masses = stats[:, 0]
    ok = jnp.sum(masses) > 0
    plan = sharded_exchange.composition(fold(shared, 0), masses, units, me, counts)
    k = sharded_exchange.pair_capacity(units, n, capacity_factor)
    if draws.prioritized:  # the shard's weights (vmin_s / v) ** beta, rescaled to the global min
        vmin = stats[me, 1]
        rescale = jnp.where(jnp.isfinite(vmin), (jnp.min(stats[:, 1]) / vmin) ** beta, 0.0)
    cap = jnp.int32(rb.capacity)

    def make_round(r):
        key = fold(shared, 1, r, me)
        d = draws.draw(rb.sampler, state.sampler, key, n * k, ctx, bs, beta)
        shape = (n, k) + ((seq,) if seq else ())
        idx, w, m = (x.reshape(shape) for x in d)
        wanted = (r * k + jnp.arange(k, dtype=jnp.int32))[None, :] < plan.counts[me][:, None]
        m = m & _expand(wanted, m)
        if draws.prioritized:
            w = w * rescale
        return _rows(rb, state, idx, ctx), me * cap + idx, jnp.where(m, w, 0.0), m

    data, idx, w, m = sharded_exchange.exchange(make_round, plan, k, axis_name)
    return data, idx, w, m, ok


def _global_epoch(rb, draws, state, shared, bs, axis_name, capacity_factor, g):
    """Without replacement, global epochs: ``(data, indices, weights, mask, sampler state,
    ok)``. A new epoch begins on every shard when any shard's elements changed since it began,
    when the global epoch is exhausted or (``drop_last``) cannot fill a global batch."""
    sampler = rb.sampler
    ctx = rb.context(state)
    n, me = jax.lax.axis_size(axis_name), _me(axis_name)
    units, _ = draws.units(sampler, bs)
    ep = draws.epoch(state.sampler)
    # g [n, 3]: every shard's (stale, left in its epoch, elements a new epoch would hold)
    left = jnp.sum(g[:, 1])
    need = jnp.any(g[:, 0] != 0) | (left <= 0)
    if sampler.drop_last:
        need = need | (left < n * units)
    k_begin = fold(shared, 2, me)

    def begin(_):
        order, size = draws.begin(sampler, state.sampler, k_begin, ctx, bs)
        # adding a per-device zero makes every field vary over the axis, as the other
        # branch's do (shard_map's check_vma requires equal types; shuffle=False orders are
        # the same on every device)
        zero = ep.pos - ep.pos
        return Epoch(
            order.astype(jnp.int32) + zero, zero, jnp.asarray(size, jnp.int32) + zero, ep.count + 1
        )

    ep = jax.lax.cond(need, begin, lambda _: ep, None)
    remaining = jnp.where(need, g[:, 2], g[:, 1])
    total = jnp.sum(remaining)
    take = jnp.minimum(jnp.int32(n * units), total)
    if sampler.drop_last:
        take = jnp.where(total >= n * units, take, 0)
    quotas = sharded_exchange.epoch_quotas(fold(shared, 3), remaining, take, sampler.shuffle)
    plan, send = sharded_exchange.epoch_plan(fold(shared, 4), quotas, units, me, sampler.shuffle)
    k = sharded_exchange.pair_capacity(units, n, capacity_factor)
    send = jnp.pad(send, ((0, 0), (0, k)), constant_values=-1)
    current = draws.with_epoch(state.sampler, ep, ctx)
    cap = jnp.int32(rb.capacity)

    def make_round(r):
        ranks = jax.lax.dynamic_slice_in_dim(send, r * k, k, axis=1)  # [n, k]
        key = fold(shared, 5, r, me)
        idx, m = draws.take(sampler, current, key, ep.pos + ranks, ranks >= 0, ctx, bs)
        return _rows(rb, state, idx, ctx), me * cap + idx, m.astype(jnp.float32), m

    data, idx, w, m = sharded_exchange.exchange(make_round, plan, k, axis_name)
    m = m & _expand(plan.valid, m)
    new = draws.with_epoch(state.sampler, ep._replace(pos=ep.pos + quotas[me]), ctx)
    return data, idx, w, m, new, take > 0


# ------------------------------------------------------------------------------ update
def _padding_kept(indices):
    """bool: False on a slice's padding (a ``[num_slices, slice_len]`` row repeats its last
    valid index), as ``PrioritizedSliceSampler.update`` ignores it."""
    keep = jnp.ones(indices.shape, bool)
    if indices.ndim == 2 and indices.shape[1] > 1:
        keep = jnp.concatenate([keep[:, :1], indices[:, 1:] != indices[:, :-1]], axis=1)
    return keep


def update(rb, state, indices, priorities, axis_name, generations=None):
    """Set priorities of global ``indices`` (this device's part of a global batch, any shape;
    ``priorities`` of that shape or a scalar). Each shard applies the entries it owns, in the
    global order (device 0's first), so the last occurrence of an index wins; each shard also
    takes the global maximum of the accepted priorities as its running maximum. Entries that
    a single buffer would ignore (index out of ``[0, n * capacity)``, slot empty, priority
    NaN, infinite or negative, a slice's padding) are ignored. No-op for samplers without
    priorities.

    ``generations`` (from the sample, the shape of ``indices``): each shard compares those of
    the entries it owns with its slots' stamps, drops (and counts, in its own state) the
    entries whose slot was rewritten since the draw; the running maximum then needs one
    ``pmax``, since only the owner knows whether an entry was accepted."""
    draws = sharded_draws.for_sampler(rb.sampler, "ReplayBuffer.update")
    if not draws.prioritized:
        return state
    n, me = jax.lax.axis_size(axis_name), _me(axis_name)
    cap = rb.capacity
    ctx = rb.context(state)
    idx = jnp.asarray(indices)
    pri = jnp.broadcast_to(jnp.asarray(priorities), idx.shape)
    gi = jax.lax.all_gather(idx, axis_name, tiled=True)
    gp = jax.lax.all_gather(pri, axis_name, tiled=True)
    filled = jax.lax.all_gather(ctx.filled, axis_name)
    in_range = (gi >= 0) & (gi < n * cap)  # in the indices' own dtype
    gi32 = jnp.where(in_range, gi, 0).astype(jnp.int32)
    owner = gi32 // jnp.int32(cap)
    pos = gi32 - owner * jnp.int32(cap)
    keep = (
        _padding_kept(gi)
        if isinstance(draws, sharded_draws.PrioritizedSlices)
        else jnp.ones(gi.shape, bool)
    )
    if jnp.issubdtype(gp.dtype, jnp.floating):
        good = jnp.isfinite(gp) & (gp >= 0)
    else:
        good = gp >= 0
    _, t = ctx.layout.from_flat(pos)
    accepted = keep & in_range & good & (t < filled[owner])
    p32 = jnp.where(good, jnp.minimum(gp, _F32_MAX), 0).astype(jnp.float32)
    mine = in_range & (owner == me)
    gens = state.generations
    if generations is not None:
        gg = jax.lax.all_gather(jnp.asarray(generations, jnp.int32), axis_name, tiled=True)
        found = _generations.check(gens.slots, jnp.where(mine, pos, -1), gg)
        mine = mine & found.keep
        gens = _generations.count_dropped(gens, found.stale)
        seen = jax.lax.pmax(jnp.max(jnp.where(accepted & mine, p32, 0.0), initial=0.0), axis_name)
    else:
        seen = jnp.max(jnp.where(accepted, p32, 0.0), initial=0.0)
    local = jnp.where(mine, pos, jnp.int32(cap))
    new = rb.sampler.update(state.sampler, local, gp, ctx)
    new = dataclasses.replace(new, max_priority=jnp.maximum(state.sampler.max_priority, seen))
    return dataclasses.replace(state, sampler=new, generations=gens)


# ------------------------------------------------------------------------------ figures
def size(rb, state, axis_name) -> jax.Array:
    """int32 ``[]``: items stored in all shards."""
    return jax.lax.psum(rb.context(state).size, axis_name)


def _global_limiter(state, axis_name):
    if state.limiter is None:
        return None
    return jax.tree_util.tree_map(lambda x: jax.lax.psum(x, axis_name), state.limiter)


def can_sample(
    rb, state, axis_name, sampling: str = "global", *, batch_size=None, limiter: bool = True
) -> jax.Array:
    """bool ``[]``, the same on every device: a global draw of ``batch_size`` (default
    ``rb.batch_size``) per device can be made (``"local"``: every shard can draw its own),
    and (``limiter``) the rate limiter, counting all shards' inserts and samples, allows
    ``n * batch_size`` samples."""
    n = jax.lax.axis_size(axis_name)
    ctx = rb.context(state)
    bs = rb.batch_size if batch_size is None else batch_size
    total_size = jax.lax.psum(ctx.size, axis_name)
    if sampling == "local":
        mine = jnp.asarray(rb.sampler.can_sample(state.sampler, ctx, bs))
        ok = jax.lax.pmin(mine.astype(jnp.int32), axis_name) > 0
    else:
        draws = sharded_draws.for_sampler(rb.sampler, "ReplayBuffer.can_sample")
        units, _ = draws.units(rb.sampler, bs)
        mass = jax.lax.psum(draws.mass(rb.sampler, state.sampler, ctx, bs), axis_name)
        if draws.epochs and rb.sampler.drop_last:
            ok = mass >= n * units
        else:
            ok = mass > 0
        ok = ok & (total_size > 0)
    if not limiter:
        return ok
    return ok & _rate_limiter.allows_sample(
        rb.rate_limiter, _global_limiter(state, axis_name), total_size, n * bs
    )


def can_insert(rb, state, num_items, axis_name) -> jax.Array:
    """bool ``[]``: the rate limiter (global counts) allows every shard to add ``num_items``."""
    n = jax.lax.axis_size(axis_name)
    total_size = jax.lax.psum(rb.context(state).size, axis_name)
    return _rate_limiter.allows_insert(
        rb.rate_limiter, _global_limiter(state, axis_name), total_size, n * num_items
    )
