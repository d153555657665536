"""How :class:`~functional_rb.ted.TEDStorage` writes a batch: named pure steps.

A write of ``T`` steps per row (``E`` rows, ``w = min(T, R)`` of them kept) runs, in order:

1. :func:`split_rows`: the items per row, the kept positions, the pair leaves;
2. :func:`side_needs`: which steps need their next observation in the side table (the
   previous newest step of each row, and every new step whose successor's root observation
   differs from its next observation), in time-major order;
3. :func:`allocate_side`: the side rows they get (a ring), and the side rows lost because
   they still belonged to a stored step;
4. :func:`link_side`: the side row -> step links (``owner``);
5. :func:`pre_history`: for frame stacks, the ``k - 1`` frames before each row's oldest
   stored step (read before this write overwrites them);
6. :func:`write_tables`: pre-history, stored steps and side rows into the frame tables,
   and the other leaves into their arrays;
7. :func:`pending_after`: each row's newest next frame, the new pending leaf;
8. :func:`episode_distance`: for frame stacks, each step's distance to its episode start;
9. :func:`write_rows`: ``rows`` in one scatter: each stored step's row (pointer, distance,
   small leaves), and the pointers of the steps that lose or gain a side row.

Every step reads the state before the write (and ``ctx``, the buffer before the write).

In place, or O(capacity). The jitted add donates the state, and XLA writes a donated table in
place only when every read of its old value is computed before the first write into it (an
operand, directly or not, of that write); any other read makes XLA copy the whole table on
entry and back on exit. Hence: each row's pending next frame lives in a leaf of its own
(``state.pending``), so the side candidates and the continuity check never read the tables;
the pre-history, read from a table, is its first write; the read of ``rows`` (which side rows
are still in use, and the rows whose pointers change) and the read of ``owner`` each feed the
values of their table's one write. ``tests/core/ted/test_ted_inplace.py`` reads the compiled
HLO for copies.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from functional_rb._internal import folds
from functional_rb._internal.tree import get_key, has_key, set_key
from functional_rb.protocol import Context, WriteRecord
from functional_rb.storages.device import gather_rows, scatter_rows
from functional_rb.ted import rows as ted_rows

PyTree = Any


def mod(x, m: int):
    return jnp.mod(x, jnp.int32(m))


def _bits(x: jax.Array) -> jax.Array:
    """A view of ``x`` whose ``==`` is bitwise (so NaN == NaN and -0.0 != 0.0)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x


def _all_equal(a: jax.Array, b: jax.Array, lead: int) -> jax.Array:
    """bool ``a.shape[:lead]``: whether ``a[i] == b[i]`` bitwise for every trailing element."""
    eq = _bits(a) == _bits(b)
    return folds.all_(eq.reshape(eq.shape[:lead] + (-1,)), axis=-1)


class Plan(NamedTuple):
    """Static facts of a TED state: ``pairs`` ``((next_key, root_key), ...)``, the
    ``stacked`` root keys, ``frame_stack`` (``k``), ``end_keys`` and ``side`` (``S``)."""

    pairs: tuple
    stacked: tuple
    frame_stack: int
    end_keys: tuple
    side: int


class Rows(NamedTuple):
    """One write, per row. ``steps``: ``T``; ``drop``: steps overwritten within the call
    (``T - w``); ``items``: leaves ``[E, T, ...]``; ``pos``/``mask``: int32/bool ``[E, w]``;
    ``nxt``/``root``: pair leaves of the kept steps ``{key: [E, w, ...]}``; ``root_all``: the
    root leaves of all ``T`` steps; ``frames``: the state's frame tables ``{root key: table}``;
    ``pend``: each row's pending next frame before the write ``{root key: [E, ...]}``."""

    steps: int
    drop: int
    items: PyTree
    pos: jax.Array
    mask: jax.Array
    nxt: dict
    root: dict
    root_all: dict
    frames: dict
    pend: dict


def split_rows(state, record: WriteRecord, items: PyTree, ctx: Context, plan: Plan) -> Rows:
    e_n, r_cap = ctx.layout.num_envs, ctx.layout.row_capacity
    t_all = record.positions.shape[0] // e_n
    drop = t_all - min(t_all, r_cap)

    def rows(x):  # [E*T, ...] -> [E, T, ...]
        return x.reshape((e_n, t_all) + x.shape[1:])

    items_r = jax.tree_util.tree_map(rows, items)
    root_all = {r: get_key(items_r, r, where="TEDStorage.set") for _, r in plan.pairs}
    return Rows(
        steps=t_all,
        drop=drop,
        items=items_r,
        pos=rows(record.positions)[:, drop:],
        mask=rows(record.mask)[:, drop:],
        nxt={n: get_key(items_r, n, where="TEDStorage.set")[:, drop:] for n, _ in plan.pairs},
        root={r: x[:, drop:] for r, x in root_all.items()},
        root_all=root_all,
        frames={r: get_key(state.data, r, where="TEDStorage.set") for _, r in plan.pairs},
        pend={r: get_key(state.pending, r, where="TEDStorage.set") for _, r in plan.pairs},
    )


def side_needs(b: Rows, ctx: Context, plan: Plan):
    """``(need, slots)``, bool/int32 ``[(w + 1) * E]`` in time-major order (older steps
    first): whether the previous newest step and each new step needs a side row, and its
    flat slot."""
    e_n, r_cap = ctx.layout.num_envs, ctx.layout.row_capacity
    w = b.pos.shape[1]
    match_in = jnp.ones((e_n, max(w - 1, 0)), bool)
    match_prev = jnp.ones((e_n,), bool)
    for n, r in plan.pairs:
        if w > 1:
            match_in = match_in & _all_equal(b.nxt[n][:, :-1], b.root[r][:, 1:], 2)
        match_prev = match_prev & _all_equal(b.pend[r], b.root[r][:, 0], 1)
    env = jnp.arange(e_n, dtype=jnp.int32)
    prev_slot = ctx.layout.to_flat(env, mod(ctx.cursor - 1, r_cap))
    prev_alive = (ctx.filled > 0) if w < r_cap else jnp.zeros((), bool)
    need = jnp.concatenate(
        [(prev_alive & ~match_prev)[:, None], ~match_in, jnp.zeros((e_n, 1), bool)], axis=1
    )
    need = need & jnp.concatenate([jnp.ones((e_n, 1), bool), b.mask], axis=1)
    slots = jnp.concatenate([prev_slot[:, None], b.pos], axis=1)  # [E, w+1]
    return need.T.reshape(-1), slots.T.reshape(-1)


class Side(NamedTuple):
    """Side rows of one write: ``keep`` (bool: the step gets a row; the last ``S`` needs),
    ``entry`` (int32: its row), ``n_need`` (int32 []: rows taken), ``old_owner`` (int32: the
    slot that owned the row before), ``lost_now`` (bool: that slot still needed it), ``lost``
    (int32 []: the state's new lost count), ``old_rows`` (int32 ``[(w + 1) * E + E, width]``:
    the rows of ``rows`` at the old owners, then at each row's previous newest step, as they
    were before the write)."""

    keep: jax.Array
    entry: jax.Array
    n_need: jax.Array
    old_owner: jax.Array
    lost_now: jax.Array
    lost: jax.Array
    old_rows: jax.Array


def allocate_side(state, need: jax.Array, slots: jax.Array, ctx: Context, side: int) -> Side:
    """The side rows of the steps that ``need`` one (``slots``: :func:`side_needs`'), and
    the stored steps that lose theirs."""
    e_n, r_cap = ctx.layout.num_envs, ctx.layout.row_capacity
    w = slots.shape[0] // e_n - 1
    n_need = folds.sum_(need)
    rank = folds.cumsum(need) - 1
    keep = need & (rank >= n_need - jnp.int32(side))
    entry = mod(state.head + rank, side)
    # a side row reused while its step is still stored (and not rewritten now) is lost. The
    # old owners' rows and the previous newest steps' rows are read in one gather: write_rows
    # rewrites their pointers from it (one read and one write of `rows`; XLA splits a kernel
    # on a large array across threads, the write here, not the reads: gather_rows)
    old_owner = gather_rows(state.owner, entry)
    old_rows = gather_rows(state.rows, jnp.concatenate([jnp.maximum(old_owner, 0), slots[:e_n]]))
    owner_live = (old_owner >= 0) & (old_rows[: old_owner.shape[0], 0] == entry)
    rewritten = mod(mod(old_owner, r_cap) - ctx.cursor, r_cap) < jnp.int32(w)
    lost_now = keep & owner_live & ~rewritten
    lost = state.lost + folds.sum_(lost_now) + folds.sum_(need & ~keep)
    return Side(keep, entry, n_need, old_owner, lost_now, lost, old_rows)


def link_side(state, slots: jax.Array, s: Side) -> jax.Array:
    """``owner`` after the write: each kept side row's new owner (its step's slot).

    Its one scatter takes the old owners as the values of its dropped rows, which changes
    nothing but orders the read before the write (in place: see the module docstring)."""
    return scatter_rows(state.owner, s.entry, jnp.where(s.keep, slots, s.old_owner), s.keep)


def write_rows(state, b: Rows, s: Side, slots: jax.Array, dist, packed: tuple):
    """``rows`` after the write, in one scatter: each stored step's row (its pointer: its side
    row or -1, its distance, ``dist``, None without frame stacks, and its packed leaves,
    :mod:`functional_rb.ted.rows`); each lost side row's old step unlinked (pointer -1); each
    row's previous newest step linked to its side row.

    The three sets of slots never meet, so the indices stay unique: a lost row's old step is
    not rewritten now and was not the previous newest (whose next frame is pending, never in
    a side row), and the previous newest is rewritten only when the write fills the whole
    row, when it needs no side row. The unlinked and linked rows are the old ones
    (``s.old_rows``) with a new pointer: that read feeds the scatter's values, so ``rows`` is
    written in place (see the module docstring)."""
    e_n, w = b.pos.shape
    # side needs are time-major: the first E are the previous newest steps, then each new step
    keep, entry = s.keep.reshape(w + 1, e_n), s.entry.reshape(w + 1, e_n)
    ptr = jnp.where(keep[1:].T, entry[1:].T, jnp.int32(-1))  # [E, w]
    leaves = []
    for key, _, _ in packed:
        x = get_key(b.items, key, where="TEDStorage.set")[:, b.drop :]
        leaves.append(x.reshape((-1,) + x.shape[2:]))
    values = ted_rows.encode(
        ptr.reshape(-1), None if dist is None else dist.reshape(-1), leaves, lead=1
    )
    link = jnp.concatenate([jnp.full(s.old_owner.shape, -1, jnp.int32), entry[0]])
    relinked = s.old_rows.at[:, 0].set(link)
    return scatter_rows(
        state.rows,
        jnp.concatenate([s.old_owner, slots[:e_n], b.pos.reshape(-1)]),
        jnp.concatenate([relinked, values]),
        jnp.concatenate([s.lost_now, keep[0], b.mask.reshape(-1)]),
    )


def pre_history(b: Rows, ctx: Context, plan: Plan) -> dict:
    """``{root key: (frames [E, k-1, ...], base rows int32 [E, 1])}``: for each stacked key
    the ``k - 1`` frames before each row's oldest stored step after this write, from the
    tables as they are before it (the old pre-history or the old oldest steps) or from the
    new items."""
    k = plan.frame_stack
    if k == 1:
        return {}
    lay = ctx.layout
    cap, e_n, r_cap = lay.capacity, lay.num_envs, lay.row_capacity
    filled, env = ctx.filled, jnp.arange(e_n, dtype=jnp.int32)
    new_filled = jnp.minimum(filled + jnp.int32(b.steps), jnp.int32(r_cap))
    oldest = mod(ctx.cursor - filled, r_cap)
    g = (filled + jnp.int32(b.steps) - new_filled) + jnp.arange(k - 1, dtype=jnp.int32)
    pre_base = jnp.int32(cap + plan.side) + env[:, None] * jnp.int32(k - 1)
    src_pre = pre_base + jnp.minimum(g, k - 2)[None, :]
    src_old = lay.to_flat(env[:, None], mod(oldest + g - jnp.int32(k - 1), r_cap)[None, :])
    item_i = jnp.clip(g - jnp.int32(k - 1) - filled, 0, b.steps - 1)
    in_pre = g < jnp.int32(k - 1)
    in_old = g < jnp.int32(k - 1) + filled
    out = {}
    for r in plan.stacked:
        from_tab = gather_rows(b.frames[r], jnp.where(in_pre[None, :], src_pre, src_old))
        from_new = jnp.take(b.root_all[r], item_i, axis=1)
        sel = (in_pre | in_old)[None, :].reshape((1, k - 1) + (1,) * (from_tab.ndim - 2))
        out[r] = (jnp.where(sel, from_tab, from_new), pre_base)
    return out


def write_tables(state, b: Rows, s: Side, pre: dict, ctx: Context, plan: Plan) -> PyTree:
    """The state's data after the write: each frame table gets the pre-history (first: it was
    read from the table), the stored steps' root frames and the side rows' next frames; every
    other leaf gets the stored steps' values. The three row ranges are disjoint."""
    e_n, k, cap = ctx.layout.num_envs, plan.frame_stack, ctx.layout.capacity
    flat_pos, flat_mask = b.pos.reshape(-1), b.mask.reshape(-1)
    data = state.data
    for n, r in plan.pairs:
        tab = b.frames[r]
        if r in pre:
            vals, base = pre[r]
            idx = base + jnp.arange(k - 1, dtype=jnp.int32)[None, :]
            tab = scatter_rows(
                tab,
                idx.reshape(-1),
                vals.reshape((-1,) + vals.shape[2:]),
                jnp.ones((e_n * (k - 1),), bool),
            )
        # side candidates, time-major like the side needs: the pending frame, then each step's
        cand = jnp.concatenate([b.pend[r][:, None], b.nxt[n]], axis=1)  # [E, w+1, ...]
        side_vals = jnp.swapaxes(cand, 0, 1).reshape((-1,) + cand.shape[2:])
        # the stored steps' rows and the side rows in one scatter (disjoint ranges, so the
        # indices stay unique): one pass over the table, one kernel on a GPU
        tab = scatter_rows(
            tab,
            jnp.concatenate([flat_pos, jnp.int32(cap) + s.entry]),
            jnp.concatenate([b.root[r].reshape((-1,) + b.root[r].shape[2:]), side_vals]),
            jnp.concatenate([flat_mask, s.keep]),
        )
        data = set_key(data, r, tab)
    roots = {r for _, r in plan.pairs}

    def put(path, leaf):
        key = tuple(p.key for p in path)
        if key in roots:
            return leaf
        x = get_key(b.items, key, where="TEDStorage.set")[:, b.drop :]
        return scatter_rows(leaf, flat_pos, x.reshape((-1,) + x.shape[2:]), flat_mask)

    return jax.tree_util.tree_map_with_path(put, data)


def pending_after(b: Rows, plan: Plan) -> PyTree:
    """The new ``state.pending``: each row's newest step's next frame, ``{root key: [E,
    ...]}`` nested like the data."""
    out: dict = {}
    for n, r in plan.pairs:
        out = set_key(out, r, b.nxt[n][:, -1].astype(b.pend[r].dtype))
    return out


def episode_distance(state, b: Rows, plan: Plan):
    """``(dist, carry_dist, carry_end)`` after the write: each kept step's distance to its
    episode start, capped at ``k - 1`` (int32 ``[E, w]``; frame stacks only: None and the
    carries unchanged otherwise)."""
    k = plan.frame_stack
    if k == 1:
        return None, state.carry_dist, state.carry_end
    e_n, t_all = b.pos.shape[0], b.steps
    end = jnp.zeros((e_n, t_all), bool)
    for key in plan.end_keys:
        if has_key(b.items, key):
            x = get_key(b.items, key, where="TEDStorage.set")
            end = end | jnp.any(x.reshape((e_n, t_all, -1)) != 0, axis=-1)
    starts = jnp.concatenate([state.carry_end[:, None], end[:, :-1]], axis=1)
    i = jnp.arange(t_all, dtype=jnp.int32)[None, :]
    last_start = jax.lax.cummax(jnp.where(starts, i, -1), axis=1)
    d = jnp.where(last_start >= 0, i - last_start, state.carry_dist[:, None] + 1 + i)
    d = jnp.minimum(d, jnp.int32(k - 1))
    return d[:, b.drop :], d[:, -1], end[:, -1]
