"""Moving sampled rows between shards: who takes how many rows from whom, and the all-to-all.

A global draw gives each of the ``n`` devices ``U`` units (items or slices). Which shard a
unit comes from is decided first, from the shards' masses (a few scalars, all-gathered), the
same way on every device (one shared key); then each shard draws its rows locally and the
rows travel by ``all_to_all``. Nothing else is communicated.

Counts (``counts[s, d]``: units device ``d`` takes from shard ``s``; every column sums to
``U``), two ways (:func:`composition`):

* ``"stratified"`` (default): systematic sampling of the shards for each device, with its own
  uniform offset: device ``d`` takes ``U * p_s`` units of shard ``s``, rounded down or up at
  random so that the expectation is exactly ``U * p_s`` (``p_s = mass_s / sum(mass)``). Its
  slots are then put in a uniformly random order, so every slot is marginally a draw from the
  union (exactly the single buffer's distribution), and the units of one shard are
  independent draws from it. The batch is *stratified* over shards (the ``stratified``
  option of ``PrioritizedSampler`` does the same over the sum tree): lower variance than
  independent draws, and balanced traffic: a pair of devices exchanges ``ceil(U * p_s)`` units
  at most.
* ``"multinomial"``: each device draws the shard of each slot independently (categorical over
  ``p``), so its batch is exactly ``U`` independent draws from the union, jointly as well as
  marginally. The counts are then multinomial, so the traffic between two devices varies from
  step to step (a little more is moved on average: see ``benchmarks/NOTES.md``).

Transfer (:func:`exchange`): each round moves ``K = ceil(capacity_factor * U / n)`` units
from every shard to every device (one ``all_to_all`` per leaf of ``[n, K, ...]``). A device
sends its rows destined to each device in ranks ``[r K, (r + 1) K)`` in round ``r``; the first
round always runs, further rounds (a ``while_loop`` whose trip count every device computes
alike) only when some pair needs more than ``K``: when one shard holds much more than its
share of the mass (``p_s > capacity_factor / n``), or by chance with ``"multinomial"``.
So nothing is ever dropped: the result is exact whatever the imbalance; only the traffic grows
with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from functional_rb._internal.random import bits32, uniform01

COUNTS = ("stratified", "multinomial")


def fold(key, *salts) -> jax.Array:
    """Raw ``uint32[2]`` key data of a sub-stream of ``key`` for the integers ``salts`` (Python
    ints or int32 scalars, may be traced): a keyed hash (:func:`functional_rb._internal.random.bits32`),
    far cheaper to compile and run than threefry's ``fold_in``, as the core's draws are. The
    salts are combined into one word first (an injective map for the small values used here:
    each lies below 2**10)."""
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = jnp.asarray(words, jnp.uint32).reshape(-1)
    salt = jnp.uint32(0)
    for i, x in enumerate(salts):
        salt = salt | (jnp.asarray(x).astype(jnp.uint32) << jnp.uint32(10 * i))
    return bits32(words ^ (salt * jnp.uint32(0x9E3779B9)), (2,))


class Plan(NamedTuple):
    """Who sends what to whom in one global draw (computed alike on every device).

    counts: int32 ``[n, n]``: ``counts[s, d]`` units device ``d`` takes from shard ``s``.
    owner: int32 ``[U]``: for each of this device's slots, the shard its unit comes from.
    rank: int32 ``[U]``: its rank among the units this device takes from that shard (the
      position in the owner's send order).
    valid: bool ``[U]``: the slot holds a unit (False: padding of a last epoch batch).
    """

    counts: jax.Array
    owner: jax.Array
    rank: jax.Array
    valid: jax.Array


def pair_capacity(units: int, n: int, capacity_factor: float) -> int:
    """``K``: units one round moves between each pair of devices (a Python int >= 1)."""
    return max(1, min(units, math.ceil(capacity_factor * units / n)))


def _probabilities(masses: jax.Array) -> jax.Array:
    total = jnp.sum(masses)
    n = masses.shape[0]
    return jnp.where(total > 0, masses / jnp.where(total > 0, total, 1.0), 1.0 / n)


def composition(key, masses: jax.Array, units: int, me, mode: str) -> Plan:
    """The plan of a with-replacement draw: ``U = units`` slots per device, shard ``s`` chosen
    with probability ``masses[s] / sum(masses)`` (uniform when all are 0; the caller masks).

    ``key`` must be the same on every device; ``me``: this device's index on the axis."""
    n = masses.shape[0]
    p = _probabilities(masses)
    ar = jnp.arange(units, dtype=jnp.int32)
    if mode == "stratified":
        # units k + u_d (k = 0..U-1) falling below U * cumsum(p)[s]: exactly U in total, and
        # U * p_s in expectation for each s
        u = uniform01(fold(key, 1), (n,))
        cum = (jnp.cumsum(p) * jnp.float32(units)).at[-1].set(jnp.float32(units))
        upto = jnp.clip(jnp.ceil(cum[:, None] - u[None, :]), 0, units).astype(jnp.int32)
        counts = jnp.diff(upto, axis=0, prepend=jnp.zeros((1, n), jnp.int32))
        mine = counts[:, me]
        ends = jnp.cumsum(mine)
        owner = jnp.minimum(jnp.searchsorted(ends, ar, side="right"), n - 1).astype(jnp.int32)
        rank = ar - (ends - mine)[owner]
        perm = jnp.argsort(uniform01(fold(key, 2, me), (units,)))
        owner, rank = owner[perm], rank[perm]
    elif mode == "multinomial":
        # inverse CDF; a shard without mass is never chosen (its cumulative step is empty)
        cum = jnp.cumsum(p).at[-1].set(jnp.inf)
        u = uniform01(fold(key, 3), (n, units))
        owners = jnp.minimum(jnp.searchsorted(cum, u, side="right"), n - 1).astype(jnp.int32)
        hot = jax.nn.one_hot(owners, n, dtype=jnp.int32)  # [d, U, s]
        counts = jnp.sum(hot, axis=1).T
        owner = owners[me]
        rank = jnp.take_along_axis(jnp.cumsum(hot[me], axis=0) - 1, owner[:, None], 1)[:, 0]
    else:
        raise ValueError(f"sharded: counts must be one of {COUNTS}, got {mode!r}.")
    return Plan(counts=counts, owner=owner, rank=rank, valid=jnp.ones((units,), bool))


# ------------------------------------------------------------------------------ epochs
def epoch_quotas(key, remaining: jax.Array, m, shuffle: bool) -> jax.Array:
    """int32 ``[n]``: elements each shard gives to the next ``m`` (int32 ``[]``, at most
    ``sum(remaining)``) of a global epoch; each at most its ``remaining``, together ``m``.

    ``shuffle``: in proportion to ``remaining`` (systematic, one shared offset: the epoch
    interleaves the shards evenly); else shard by shard in order (storage order)."""
    m = jnp.asarray(m, jnp.int32)
    r = remaining.astype(jnp.int32)
    before = jnp.cumsum(r) - r
    if not shuffle:
        return jnp.clip(m - before, 0, r)
    total = jnp.sum(r)
    scale = m.astype(jnp.float32) / jnp.maximum(total, 1).astype(jnp.float32)
    cum = (jnp.cumsum(r).astype(jnp.float32) * scale).at[-1].set(m.astype(jnp.float32))
    u = uniform01(key, ())
    upto = jnp.clip(jnp.ceil(cum - u), 0, m).astype(jnp.int32)
    k = jnp.minimum(jnp.diff(upto, prepend=jnp.zeros((1,), jnp.int32)), r)
    # float rounding may leave a few short: give them to the shards with elements to spare,
    # in order (exact in integers)
    spare = r - k
    deficit = m - jnp.sum(k)
    return k + jnp.clip(deficit - (jnp.cumsum(spare) - spare), 0, spare)


def epoch_plan(key, quotas: jax.Array, units: int, me, shuffle: bool):
    """``(Plan, send)`` for the next ``sum(quotas)`` elements of a global epoch.

    Global positions ``j < n * U`` hold the elements shard by shard (shard ``s`` the next
    ``quotas[s]`` of its order, its local rank ``j - start_s``). ``shuffle``: position ``j``
    goes to device ``(j + rho) % n``, slot ``j // n`` (``rho`` shared and random), so every
    device takes about ``quotas[s] / n`` from each shard; else device ``j // U``, slot
    ``j % U`` (the single buffer's order for a batch of ``n * U``). ``send``: int32 ``[n,
    units]``: for this device as owner, the local rank (in its epoch order, from its current
    position) of the unit it sends to device ``d`` at pair rank ``q`` (-1: none).
    """
    n = quotas.shape[0]
    total = n * units
    j = jnp.arange(total, dtype=jnp.int32)
    ends = jnp.cumsum(quotas)
    m = ends[-1]
    owner = jnp.minimum(jnp.searchsorted(ends, j, side="right"), n - 1).astype(jnp.int32)
    local = j - (ends - quotas)[owner]
    valid = j < m
    if shuffle:
        rho = (bits32(key, ()) % jnp.uint32(n)).astype(jnp.int32)
        dev, slot = (j + rho) % n, j // n
    else:
        dev, slot = j // units, j % units
    pair = owner * n + dev
    hot = jax.nn.one_hot(jnp.where(valid, pair, n * n), n * n, dtype=jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(hot, axis=0) - 1, pair[:, None], 1)[:, 0]
    counts = jnp.sum(hot, axis=0).reshape(n, n)
    mine = dev == me
    # this device's slots, in slot order: position j of slot t
    pos = jnp.zeros((units,), jnp.int32).at[jnp.where(mine, slot, units)].set(j, mode="drop")
    plan = Plan(counts=counts, owner=owner[pos], rank=rank[pos], valid=valid[pos])
    sending = valid & (owner == me)
    send = (
        jnp.full((n, units), -1, jnp.int32)
        .at[jnp.where(sending, dev, n), jnp.where(sending, rank, 0)]
        .set(local, mode="drop")
    )
    return plan, send


# ------------------------------------------------------------------------------ transfer
def rounds(plan: Plan, pair_cap: int) -> jax.Array:
    """int32 ``[]``: rounds of ``pair_cap`` units per pair needed to move ``plan``'s counts
    (>= 1). Every device computes the same counts from the same gathered numbers and key, so
    every device loops alike (no collective needed to agree)."""
    need = (jnp.max(plan.counts) + pair_cap - 1) // pair_cap
    return jnp.maximum(need, 1).astype(jnp.int32)


def _to_bytes(x: jax.Array) -> jax.Array:
    """uint8 ``[n, k, bytes]`` of a leaf ``[n, k, ...]`` (bit-exact)."""
    flat = x.reshape(x.shape[:2] + (-1,))
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if flat.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(flat, jnp.uint8)
    return jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(x.shape[:2] + (-1,))


def _from_bytes(b: jax.Array, shape: tuple, dtype) -> jax.Array:
    """The leaf of ``shape`` (after the leading axis of ``b``) and ``dtype`` from its bytes."""
    dtype = jnp.dtype(dtype)
    lead = b.shape[:1]
    if dtype == jnp.bool_:
        return (b != 0).reshape(lead + shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype).reshape(lead + shape)
    return jax.lax.bitcast_convert_type(b.reshape(lead + (-1, dtype.itemsize)), dtype).reshape(
        lead + shape
    )


def exchange(make_round: Callable, plan: Plan, pair_cap: int, axis_name):
    """This device's units, leaves ``[U, ...]``.

    ``make_round(r)``: the tree this device sends in round ``r`` (an int32 scalar), leaves
    ``[n, pair_cap, ...]``: row ``d`` for device ``d``, its units of pair ranks ``[r K, (r + 1)
    K)``. The leaves travel as the bytes of one array (one ``all_to_all`` per round, whatever
    the number of leaves: each collective has a fixed cost). Rounds ``0 .. rounds(plan) - 1``
    run in one ``while_loop`` (traced once: the program holds one copy of the round)."""
    spec = jax.eval_shape(make_round, jnp.int32(0))
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    widths = [jnp.dtype(x.dtype).itemsize * math.prod(x.shape[2:]) for x in leaves]
    units = plan.owner.shape[0]

    def body(r, acc):
        payload = jax.tree_util.tree_leaves(make_round(r))
        send = jnp.concatenate([_to_bytes(x) for x in payload], axis=-1)
        recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [n, K, bytes]
        q = plan.rank - r * pair_cap
        here = (q >= 0) & (q < pair_cap)
        return jnp.where(here[:, None], recv[plan.owner, jnp.clip(q, 0, pair_cap - 1)], acc)

    # the bytes before any round: zeros that vary over the axis as the rounds' results do
    # (a shard_map with check_vma requires a loop's carry to keep its type)
    zero = (plan.owner[0] * 0).astype(jnp.uint8)
    acc = jnp.broadcast_to(zero, (units, sum(widths)))
    if pair_cap >= units:  # one round always suffices
        acc = body(jnp.int32(0), acc)
    else:
        acc = jax.lax.fori_loop(jnp.int32(0), rounds(plan, pair_cap), body, acc)
    out, at = [], 0
    for x, w in zip(leaves, widths):
        out.append(_from_bytes(acc[:, at : at + w], tuple(x.shape[2:]), x.dtype))
        at += w
    return jax.tree_util.tree_unflatten(treedef, out)
