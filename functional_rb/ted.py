"""TorchRL's Episode Data format (TED) in the core: store each observation once.

TED items keep step ``t`` at the root and what follows the action under ``"next"``::

    {"observation": o_t, "action": a_t, "done": ...,
     "next": {"observation": o_{t+1}, "reward": r_t, "done": d_t, "terminated": ..., "truncated": ...}}

Within an episode ``("next", "observation")`` of step ``t`` is the ``"observation"`` of step
``t + 1``, so a plain buffer stores every observation twice. :class:`TEDStorage` stores it once
and rebuilds the ``"next"`` entry at sample time from the following slot of the same env row
(ring-aware: slot ``(t + 1) % row_capacity``). The few steps whose successor slot does not hold
their next observation (episode ends, or any step whose data says so) keep it in a small side
table; the newest step of each row keeps it in a per-row "pending" slot until its successor
arrives. Optionally it stores single frames and rebuilds ``k``-frame stacks at sample time
(:attr:`TEDStorage.frame_stack`), the Atari convention, for ~one frame of memory per step.

Also here:

- :func:`n_step_returns`: TorchRL's MultiStep targets computed from sampled indices.
- :func:`ted_to_flat` / :func:`flat_to_ted`: TorchRL's ``TED2Flat`` / ``Flat2TED`` on NumPy
  PyTrees (host functions: the flat length depends on the number of episodes). The torch hooks
  ``functional_rb.adapters.TED2Flat`` / ``Flat2TED`` are thin wrappers over the same code.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._errors import describe_structure, is_traced, shape_mismatch
from functional_rb._tree import Key, flat_items as _flat_items, get_key, has_key, nest as _nest
from functional_rb._tree import normalize_key, set_key
from functional_rb.layout import Context, Layout
from functional_rb.storages import gather_rows, scatter_rows

PyTree = Any

_END_KEYS = (("next", "done"), ("next", "truncated"))
_NOT_PAIRED = ("done", "terminated", "truncated", "reward")


# ---------------------------------------------------------------------------- small helpers
def _del_key(tree: Mapping, key: tuple) -> dict:
    """A copy of a nested mapping without ``key``; empty sub-dicts are dropped."""
    out = dict(tree)
    if len(key) == 1:
        del out[key[0]]
    else:
        sub = _del_key(tree[key[0]], key[1:])
        if sub:
            out[key[0]] = sub
        else:
            del out[key[0]]
    return out


def _bits(x: jax.Array) -> jax.Array:
    """A view of ``x`` whose ``==`` is bitwise (so NaN == NaN and -0.0 != 0.0)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x


def _all_equal(a: jax.Array, b: jax.Array, lead: int) -> jax.Array:
    """bool ``a.shape[:lead]``: whether ``a[i] == b[i]`` bitwise for every trailing element."""
    eq = _bits(a) == _bits(b)
    return jnp.all(eq.reshape(eq.shape[:lead] + (-1,)), axis=-1)


def _mod(x, m: int):
    return jnp.mod(x, jnp.int32(m))


# ---------------------------------------------------------------------------- storage
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TEDStorageState:
    """State of a :class:`TEDStorage` (``C = capacity``, ``E = num_envs``, ``S`` side rows,
    ``k`` = frame_stack).

    data:       the item without its paired ``"next"`` leaves. Other leaves are ``[C, ...]``;
                each paired root leaf is a frame table ``[C + S + E + E*(k-1), ...]``: rows
                ``[0, C)`` are the stored steps, ``[C, C+S)`` the side table (real next
                observations of episode ends), ``[C+S, C+S+E)`` the pending next observation
                of each row's newest step, the last ``E*(k-1)`` the ``k-1`` frames that
                preceded the oldest stored step of each row (for stacks across the ring wrap).
    ptr:        int32 ``[C]``: side-table row holding the step's next observation, or -1.
    owner:      int32 ``[S]``: flat slot owning each side row, or -1.
    head:       int32 ``[]``: next side row to allocate (the side table is a ring).
    lost:       int32 ``[]``: side rows overwritten while their step was still stored
                (0 unless ``min_episode_len`` was too optimistic; see :class:`TEDStorage`).
    dist:       int32 ``[C]`` (``[0]`` when ``frame_stack == 1``): steps since the episode
                start, capped at ``k - 1``.
    carry_dist: int32 ``[E]``: ``dist`` of each row's newest step.
    carry_end:  bool ``[E]``: whether each row's newest step ended its episode (True at init,
                so the first step added starts an episode).
    """

    data: PyTree
    ptr: jax.Array
    owner: jax.Array
    head: jax.Array
    lost: jax.Array
    dist: jax.Array
    carry_dist: jax.Array
    carry_end: jax.Array


@dataclasses.dataclass(frozen=True)
class TEDStorage:
    """A device storage for TED items that stores each repeated observation once.

    Args:
      pairs: ``((next_key, root_key), ...)``: leaves under ``"next"`` that repeat a root leaf
        one step later, e.g. ``((("next", "observation"), "observation"),)``. ``None``
        (default): every ``("next", *k)`` leaf with a root leaf ``k`` of the same shape and
        dtype, except done/terminated/truncated/reward.
      end_keys: leaves marking an episode end (used for frame stacks); those absent from the
        item are ignored. Default ``(("next", "done"), ("next", "truncated"))``.
      min_episode_len: sizes the side table: ``S = min(capacity, num_envs *
        (ceil(row_capacity / min_episode_len) + 2))`` rows of one observation each. With
        every episode at least this long (counting as an "end" any step whose successor's
        root observation differs from its next observation), no side row is ever overwritten
        while needed and samples are exact. ``min_episode_len=1`` makes it exact for any data
        (side table = capacity: no memory saving).
      side_capacity: set ``S`` directly (overrides ``min_episode_len``).
      frame_stack: ``k``; with ``k > 1`` items carry single frames (the user's item spec) and
        ``get`` returns, for each stacked key, ``[..., k, *frame]`` stacks of the last ``k``
        frames of the same episode (oldest first), and for its next key the stack ending with
        the next frame: what a FrameStack env wrapper fills on reset and step.
      stack_pad: before an episode start, ``"first"`` repeats the episode's first frame
        (Atari / gym FrameStack), ``"zeros"`` uses zeros.
      stack_keys: root keys to stack (a subset of the paired root keys); ``None``: all.

    Exactness: ``get`` returns exactly what a :class:`DeviceStorage` holding the full items
    (with stacks computed as above) returns, for every index, whatever the data, as long as
    ``state.lost == 0``. A side row is lost when more than ``S`` episode ends arrive while its
    step is still stored. Overflow behaviour: eagerly ``set`` raises ``ValueError``; under jit
    ``state.storage.lost`` counts the lost rows and those steps' next observation becomes their
    successor's observation (the reset observation). Check ``lost`` in your loop if episodes
    may be shorter than ``min_episode_len``.

    Requires a FIFO ring writer (:class:`RoundRobinWriter`, or ``init_from_data``); items are
    nested dicts. The next observation of a step is rebuilt from its successor only when the
    two agree bitwise at write time, so exactness does not rely on done flags.
    """

    pairs: Optional[tuple] = None
    end_keys: tuple = _END_KEYS
    min_episode_len: int = 32
    side_capacity: Optional[int] = None
    frame_stack: int = 1
    stack_pad: str = "first"
    stack_keys: Optional[tuple] = None
    requires_fifo = True  # ReplayBuffer refuses a writer that does not write in time order
    state_types = (TEDStorageState,)  # what init builds

    def __post_init__(self):
        if self.pairs is not None:
            pairs = tuple((normalize_key(n), normalize_key(r)) for n, r in self.pairs)
            for n, r in pairs:
                if n[0] != "next" or r[0] == "next":
                    raise ValueError(
                        f"TEDStorage: each pair is (next_key, root_key) with next_key under "
                        f"'next' and root_key outside it, got {(n, r)}; e.g. pairs=((('next', "
                        "'observation'), 'observation'),).")
            object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "end_keys", tuple(normalize_key(k) for k in self.end_keys))
        if self.stack_keys is not None:
            object.__setattr__(self, "stack_keys",
                               tuple(normalize_key(k) for k in self.stack_keys))
        if not isinstance(self.frame_stack, int) or self.frame_stack < 1:
            raise ValueError(f"TEDStorage: frame_stack must be an int >= 1, got "
                             f"{self.frame_stack!r}.")
        if self.stack_pad not in ("first", "zeros"):
            raise ValueError(f"TEDStorage: stack_pad must be 'first' or 'zeros', got "
                             f"{self.stack_pad!r}.")
        if not isinstance(self.min_episode_len, int) or self.min_episode_len < 1:
            raise ValueError(f"TEDStorage: min_episode_len must be an int >= 1, got "
                             f"{self.min_episode_len!r}.")
        if self.side_capacity is not None and (not isinstance(self.side_capacity, int)
                                               or self.side_capacity < 1):
            raise ValueError(f"TEDStorage: side_capacity must be an int >= 1 or None, got "
                             f"{self.side_capacity!r}.")

    # ------------------------------------------------------------------ static structure
    def _pairs_for(self, item) -> tuple:
        if not isinstance(item, Mapping):
            raise TypeError(f"TEDStorage.init: items must be nested dicts (TED), got "
                            f"{type(item).__name__}.")
        if self.pairs is not None:
            for n, r in self.pairs:
                for k in (n, r):
                    if not has_key(item, k):
                        raise KeyError(
                            f"TEDStorage.init: pair key {k!r} is not in the item; the item has "
                            f"leaves {describe_structure(item)}. Fix `pairs`.")
                a, b = get_key(item, n, where="TEDStorage"), get_key(item, r, where="TEDStorage")
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(
                        f"TEDStorage.init: pair {n!r} / {r!r} must share shape and dtype, got "
                        f"{a.shape} {a.dtype} vs {b.shape} {b.dtype}.")
            return self.pairs
        pairs = []
        nxt = item.get("next", {})
        for path, x in jax.tree_util.tree_flatten_with_path(nxt)[0]:
            sub = tuple(getattr(p, "key", None) for p in path)
            if any(not isinstance(s, str) for s in sub) or sub[-1] in _NOT_PAIRED:
                continue
            if has_key(item, sub):
                y = get_key(item, sub, where="TEDStorage")
                if hasattr(y, "shape") and y.shape == x.shape and y.dtype == x.dtype:
                    pairs.append((("next",) + sub, sub))
        return tuple(pairs)

    def _stacked(self, pairs) -> tuple:
        roots = tuple(r for _, r in pairs)
        if self.frame_stack == 1:
            return ()
        if self.stack_keys is None:
            return roots
        for k in self.stack_keys:
            if k not in roots:
                raise ValueError(f"TEDStorage: stack key {k!r} is not a paired root key "
                                 f"{roots}; frame stacking applies to paired observations.")
        return self.stack_keys

    def _pairs_of_state(self, state: TEDStorageState) -> tuple:
        # The state's data lacks the next leaves; pairs were resolved at init and the frame
        # tables are the leaves with more rows than `ptr`.
        if self.pairs is not None:
            return self.pairs
        cap = state.ptr.shape[0]
        pairs = []
        for path, x in jax.tree_util.tree_flatten_with_path(state.data)[0]:
            if x.shape[0] != cap:
                sub = tuple(p.key for p in path)
                pairs.append((("next",) + sub, sub))
        return tuple(pairs)

    @staticmethod
    def _side_rows(layout: Layout, min_len: int) -> int:
        e, r = layout.num_envs, layout.row_capacity
        return min(layout.capacity, e * (math.ceil(r / min_len) + 2))

    # ------------------------------------------------------------------ protocol
    def init(self, item: PyTree, layout: Layout) -> TEDStorageState:
        pairs = self._pairs_for(item)
        if not pairs:
            raise ValueError(
                "TEDStorage.init: no (next, root) pair found in the item "
                f"{describe_structure(item)}; TED items have e.g. 'observation' and ('next', "
                "'observation'). Pass pairs=... explicitly.")
        k = self.frame_stack
        if k > 1 and not any(has_key(item, e) for e in self.end_keys):
            raise KeyError(f"TEDStorage.init: frame_stack={k} needs episode ends, but none of "
                           f"end_keys={self.end_keys} is in the item {describe_structure(item)}.")
        self._stacked(pairs)
        cap, e = layout.capacity, layout.num_envs
        s = self.side_capacity or self._side_rows(layout, self.min_episode_len)
        rows = cap + s + e + e * (k - 1)
        data = item
        for n, _ in pairs:
            data = _del_key(data, n)
        roots = {r for _, r in pairs}

        def alloc(path, x):
            key = tuple(getattr(p, "key", None) for p in path)
            n = rows if key in roots else cap
            return jnp.zeros((n,) + tuple(jnp.shape(x)), jnp.asarray(x).dtype)

        data = jax.tree_util.tree_map_with_path(alloc, data)
        return TEDStorageState(
            data=data, ptr=jnp.full((cap,), -1, jnp.int32), owner=jnp.full((s,), -1, jnp.int32),
            head=jnp.int32(0), lost=jnp.int32(0),
            dist=jnp.zeros((cap if k > 1 else 0,), jnp.int32),
            carry_dist=jnp.zeros((e,), jnp.int32), carry_end=jnp.ones((e,), bool))

    def check_state(self, state: TEDStorageState, capacity: int, num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items in ``num_envs``
        rows (None if it can)."""
        return shape_mismatch([
            ("state.storage.ptr", state.ptr, (capacity,), True, f" (capacity={capacity})"),
            ("state.storage.carry_end", state.carry_end, (num_envs,), True,
             f" (num_envs={num_envs})")])

    def item_spec(self, state: TEDStorageState) -> PyTree:
        """The user's full TED item (single frames), as given to ``init``."""
        spec = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                      state.data)
        for n, r in self._pairs_of_state(state):
            spec = set_key(spec, n, get_key(spec, r, where="TEDStorage.item_spec"))
        return spec

    def memory_bytes(self, state: TEDStorageState) -> int:
        """Bytes held by every leaf of the state."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))

    def set(self, state: TEDStorageState, positions: jax.Array, items: PyTree,
            mask: jax.Array, ctx: Context) -> TEDStorageState:
        # One compiled function per shape: eager callers pay one compilation, not one per op
        # (under an outer jit this inlines).
        new = _set_jit(self, ctx.layout, state, positions, items, mask, ctx.filled, ctx.cursor)
        lost, s_n = new.lost, new.owner.shape[0]
        if not is_traced(lost) and int(lost) > 0:
            raise ValueError(
                f"TEDStorage.set: the side table ({s_n} rows) overflowed: {int(lost)} stored "
                "steps lost their final next observation (more episode ends arrived while they "
                "were stored than min_episode_len allows). Use a smaller min_episode_len or a "
                "larger side_capacity (side_capacity=capacity is always exact).")
        return new

    def _set(self, state: TEDStorageState, positions: jax.Array, items: PyTree,
             mask: jax.Array, ctx: Context) -> TEDStorageState:
        lay = ctx.layout
        cap, e_n, r_cap = lay.capacity, lay.num_envs, lay.row_capacity
        s_n = state.owner.shape[0]
        k = self.frame_stack
        pairs = self._pairs_of_state(state)
        n_items = positions.shape[0]
        t_all = n_items // e_n
        w = min(t_all, r_cap)          # items actually written per row (the last w)
        drop = t_all - w
        cursor, filled = ctx.cursor, ctx.filled

        def rows(x):                   # [E*T, ...] -> [E, T, ...]
            return x.reshape((e_n, t_all) + x.shape[1:])

        items_r = jax.tree_util.tree_map(rows, items)
        pos_w = rows(positions)[:, drop:]
        mask_w = rows(mask)[:, drop:]
        env = jnp.arange(e_n, dtype=jnp.int32)
        pend_rows = jnp.int32(cap + s_n) + env

        nf = {n: get_key(items_r, n, where="TEDStorage.set")[:, drop:] for n, _ in pairs}
        rf_all = {r: get_key(items_r, r, where="TEDStorage.set") for _, r in pairs}
        rf = {r: x[:, drop:] for r, x in rf_all.items()}
        frames = {r: get_key(state.data, r, where="TEDStorage.set") for _, r in pairs}

        # --- which steps need their next observation in the side table
        match_in = jnp.ones((e_n, max(w - 1, 0)), bool)
        match_prev = jnp.ones((e_n,), bool)
        for n, r in pairs:
            if w > 1:
                match_in = match_in & _all_equal(nf[n][:, :-1], rf[r][:, 1:], 2)
            pend = gather_rows(frames[r], pend_rows)
            match_prev = match_prev & _all_equal(pend, rf[r][:, 0], 1)
        prev_t = _mod(cursor - 1, r_cap)
        prev_slot = lay.to_flat(env, prev_t)
        prev_alive = (filled > 0) if w < r_cap else jnp.zeros((), bool)
        need_prev = prev_alive & ~match_prev
        need = jnp.concatenate(
            [need_prev[:, None], ~match_in, jnp.zeros((e_n, 1), bool)], axis=1)
        need = need & jnp.concatenate([jnp.ones((e_n, 1), bool), mask_w], axis=1)
        slots = jnp.concatenate([prev_slot[:, None], pos_w], axis=1)       # [E, w+1]
        # Time-major order: older steps get older side rows.
        need_f = need.T.reshape(-1)
        slots_f = slots.T.reshape(-1)
        n_need = jnp.sum(need_f, dtype=jnp.int32)
        rank = jnp.cumsum(need_f.astype(jnp.int32)) - 1
        keep = need_f & (rank >= n_need - jnp.int32(s_n))
        entry = _mod(state.head + rank, s_n)

        # --- side rows reused while their step is still stored are lost
        old_owner = state.owner[entry]
        owner_live = (old_owner >= 0) & (state.ptr[jnp.maximum(old_owner, 0)] == entry)
        owner_t = _mod(old_owner, r_cap)
        rewritten = _mod(owner_t - cursor, r_cap) < jnp.int32(w)
        lost_now = keep & owner_live & ~rewritten
        lost = (state.lost + jnp.sum(lost_now, dtype=jnp.int32)
                + jnp.sum(need_f & ~keep, dtype=jnp.int32))

        ptr = scatter_rows(state.ptr, pos_w.reshape(-1), jnp.full((e_n * w,), -1, jnp.int32),
                           mask_w.reshape(-1))
        ptr = scatter_rows(ptr, old_owner, jnp.full_like(old_owner, -1), lost_now)
        ptr = scatter_rows(ptr, slots_f, entry, keep)
        owner = scatter_rows(state.owner, entry, slots_f, keep)

        # --- frames before the oldest stored step (read before this write overwrites them)
        data = state.data
        new_pre = {}
        if k > 1:
            new_filled = jnp.minimum(filled + jnp.int32(t_all), jnp.int32(r_cap))
            oldest = _mod(cursor - filled, r_cap)
            g = (filled + jnp.int32(t_all) - new_filled) + jnp.arange(k - 1, dtype=jnp.int32)
            pre_base = jnp.int32(cap + s_n + e_n) + env[:, None] * jnp.int32(k - 1)
            src_pre = pre_base + jnp.minimum(g, k - 2)[None, :]
            src_old = lay.to_flat(env[:, None], _mod(oldest + g - jnp.int32(k - 1), r_cap)[None, :])
            item_i = jnp.clip(g - jnp.int32(k - 1) - filled, 0, t_all - 1)
            in_pre = g < jnp.int32(k - 1)
            in_old = g < jnp.int32(k - 1) + filled
            for r in rf:
                if r not in self._stacked(pairs):
                    continue
                from_tab = gather_rows(frames[r], jnp.where(in_pre[None, :], src_pre, src_old))
                from_new = jnp.take(rf_all[r], item_i, axis=1)
                sel = (in_pre | in_old)[None, :].reshape((1, k - 1) + (1,) * (from_tab.ndim - 2))
                new_pre[r] = (jnp.where(sel, from_tab, from_new), pre_base)

        # --- write: stored steps, side rows, pending rows, pre-history
        side_vals = {}
        for n, r in pairs:
            pend = gather_rows(frames[r], pend_rows)
            cand = jnp.concatenate([pend[:, None], nf[n]], axis=1)          # [E, w+1, ...]
            side_vals[r] = jnp.swapaxes(cand, 0, 1).reshape((-1,) + cand.shape[2:])
        flat_pos = pos_w.reshape(-1)
        flat_mask = mask_w.reshape(-1)
        for n, r in pairs:
            tab = frames[r]
            tab = scatter_rows(tab, flat_pos, rf[r].reshape((-1,) + rf[r].shape[2:]), flat_mask)
            tab = scatter_rows(tab, jnp.int32(cap) + entry, side_vals[r], keep)
            tab = scatter_rows(tab, pend_rows, nf[n][:, -1], jnp.ones((e_n,), bool))
            if r in new_pre:
                vals, base = new_pre[r]
                idx = base + jnp.arange(k - 1, dtype=jnp.int32)[None, :]
                tab = scatter_rows(tab, idx.reshape(-1), vals.reshape((-1,) + vals.shape[2:]),
                                   jnp.ones((e_n * (k - 1),), bool))
            data = set_key(data, r, tab)
        roots = {r for _, r in pairs}

        def put(path, leaf):
            key = tuple(p.key for p in path)
            if key in roots:
                return leaf
            x = get_key(items_r, key, where="TEDStorage.set")[:, drop:]
            return scatter_rows(leaf, flat_pos, x.reshape((-1,) + x.shape[2:]), flat_mask)

        data = jax.tree_util.tree_map_with_path(put, data)

        # --- steps since the episode start, for frame stacks
        dist, carry_dist, carry_end = state.dist, state.carry_dist, state.carry_end
        if k > 1:
            end = jnp.zeros((e_n, t_all), bool)
            for key in self.end_keys:
                if has_key(items_r, key):
                    x = get_key(items_r, key, where="TEDStorage.set")
                    end = end | jnp.any(x.reshape((e_n, t_all, -1)) != 0, axis=-1)
            starts = jnp.concatenate([carry_end[:, None], end[:, :-1]], axis=1)
            i = jnp.arange(t_all, dtype=jnp.int32)[None, :]
            last_start = jax.lax.cummax(jnp.where(starts, i, -1), axis=1)
            d = jnp.where(last_start >= 0, i - last_start, carry_dist[:, None] + 1 + i)
            d = jnp.minimum(d, jnp.int32(k - 1))
            dist = scatter_rows(dist, flat_pos, d[:, drop:].reshape(-1), flat_mask)
            carry_dist = d[:, -1]
            carry_end = end[:, -1]

        return TEDStorageState(data=data, ptr=ptr, owner=owner,
                               head=_mod(state.head + n_need, s_n), lost=lost, dist=dist,
                               carry_dist=carry_dist, carry_end=carry_end)

    def get(self, state: TEDStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        """Items at flat ``indices`` (int32 ``[...]``), leaves ``[..., ...]``; stacked keys
        ``[..., k, *frame]``. Next entries are rebuilt from the successor, side or pending row."""
        return _get_jit(self, ctx.layout, state, jnp.asarray(indices, jnp.int32), ctx.filled,
                        ctx.cursor)

    def _get(self, state: TEDStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        lay = ctx.layout
        cap, e_n, r_cap = lay.capacity, lay.num_envs, lay.row_capacity
        s_n = state.owner.shape[0]
        k = self.frame_stack
        pairs = self._pairs_of_state(state)
        stacked = self._stacked(pairs)
        idx = jnp.clip(jnp.asarray(indices, jnp.int32), 0, cap - 1)
        env, t = lay.from_flat(idx)
        newest = (t == _mod(ctx.cursor - 1, r_cap)) & (ctx.filled > 0)
        p = state.ptr[idx]
        next_src = jnp.where(p >= 0, jnp.int32(cap) + p,
                             jnp.where(newest, jnp.int32(cap + s_n) + env,
                                       lay.to_flat(env, _mod(t + 1, r_cap))))
        roots = {r for _, r in pairs}
        out = jax.tree_util.tree_map_with_path(
            lambda path, leaf: leaf if tuple(p.key for p in path) in roots
            else gather_rows(leaf, idx), state.data)
        if stacked:
            d = state.dist[idx]
            age = _mod(t - (ctx.cursor - ctx.filled), r_cap)
            j = jnp.arange(k - 1, -1, -1, dtype=jnp.int32).reshape((1,) * idx.ndim + (k,))
            jj = jnp.minimum(j, d[..., None])
            back_age = age[..., None] - jj
            pre = (jnp.int32(cap + s_n + e_n) + env[..., None] * jnp.int32(k - 1)
                   + jnp.int32(k - 1) + jnp.maximum(back_age, -(k - 1)))
            src = jnp.where(back_age >= 0, lay.to_flat(env[..., None], _mod(t[..., None] - jj, r_cap)),
                            pre)
            pad = j > d[..., None]                                          # [..., k]
        for n, r in pairs:
            tab = get_key(state.data, r, where="TEDStorage.get")
            if r in stacked:
                root = gather_rows(tab, src)                               # [..., k, *f]
                ax = idx.ndim
                nxt = jnp.concatenate(
                    [jax.lax.slice_in_dim(root, 1, k, axis=ax),
                     jnp.expand_dims(gather_rows(tab, next_src), ax)], axis=ax)
                if self.stack_pad == "zeros":
                    padm = pad.reshape(pad.shape + (1,) * (tab.ndim - 1))
                    padn = jnp.concatenate([pad[..., 1:], jnp.zeros_like(pad[..., :1])], axis=-1)
                    padn = padn.reshape(padm.shape)
                    root = jnp.where(padm, jnp.zeros((), tab.dtype), root)
                    nxt = jnp.where(padn, jnp.zeros((), tab.dtype), nxt)
            else:
                root = gather_rows(tab, idx)
                nxt = gather_rows(tab, next_src)
            out = set_key(out, r, root)
            out = set_key(out, n, nxt)
        return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _set_jit(storage, layout, state, positions, items, mask, filled, cursor):
    return storage._set(state, positions, items, mask, Context(layout, filled, cursor))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _get_jit(storage, layout, state, indices, filled, cursor):
    return storage._get(state, indices, Context(layout, filled, cursor))


# ---------------------------------------------------------------------------- n-step returns
def n_step_returns(rb, state, indices, *, n: int, gamma, data: PyTree = None,
                   reward_key: Key = ("next", "reward"),
                   end_keys: Sequence[Key] = _END_KEYS) -> PyTree:
    """TorchRL's MultiStep targets for sampled steps, read from the buffer (jittable).

    For each sampled step ``t`` (flat ``indices``, int32 ``[...]``, e.g. ``Sample.indices``)
    let ``m`` be the number of steps summed: the steps ``t, t+1, ..., t+m-1`` of the same env
    row, at most ``n``, stopping after the first episode end (any of ``end_keys`` True) and at
    the newest stored step. Returns the items at ``indices`` (``data`` if given, e.g.
    ``Sample.data``; else ``rb.get``) with:

    - ``reward_key``: ``sum_{i<m} gamma**i * r_{t+i}`` (shape of the reward leaf);
    - ``("next", "original_reward")``: the one-step reward (TorchRL's name);
    - every other ``"next"`` leaf (next observation or its frame stack, done, terminated,
      truncated) taken from step ``t+m-1``: the n-step successor and its flags;
    - ``"steps_to_next_obs"``: int32 ``[...]``, ``m``;
    - ``"gamma"``: float32 ``[...]``, ``gamma ** m``: bootstrap with
      ``r_n + gamma_n * (1 - terminated) * V(next)``.

    Same sums, ``steps_to_next_obs`` and next observations as TorchRL's ``MultiStepTransform``
    (``n_steps=n``); where TorchRL leaves the done flags of step ``t`` untouched, here they are
    those of step ``t+m-1``, which is what the bootstrap needs. TorchRL delays writing a step
    until ``n`` successors exist; here the newest steps use the ones stored so far
    (``steps_to_next_obs`` < n) and their real next observation, so the target stays valid.
    Works with any storage (the TED storage rebuilds the next observations) and ``ndim=2``.
    ``n`` is a Python int; ``gamma`` may be traced.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n_step_returns: n must be a Python int >= 1, got {n!r}.")
    idx = jnp.asarray(indices, jnp.int32)
    if data is None:
        data = rb.get(state, idx)
    return _n_step_jit(rb, n, normalize_key(reward_key),
                       tuple(normalize_key(k) for k in end_keys), state, idx, data,
                       jnp.asarray(gamma, jnp.float32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _n_step_jit(rb, n, reward_key, end_keys, state, idx, data, gamma):
    ctx = rb.context(state)
    lay = ctx.layout
    r_cap = lay.row_capacity
    env, t = lay.from_flat(idx)
    age = _mod(t - (ctx.cursor - ctx.filled), r_cap)
    i = jnp.arange(n, dtype=jnp.int32).reshape((1,) * idx.ndim + (n,))
    steps = lay.to_flat(env[..., None], _mod(t[..., None] + i, r_cap))    # [..., n]
    window = rb.get(state, steps)
    reward = jnp.asarray(get_key(window, reward_key, where="n_step_returns"))
    end = jnp.zeros(steps.shape, bool)
    for key in end_keys:
        if has_key(window, key):
            x = jnp.asarray(get_key(window, key, where="n_step_returns"))
            end = end | jnp.any(x.reshape(steps.shape + (-1,)) != 0, axis=-1)
    stored = (age[..., None] + i) < ctx.filled
    ended_before = jnp.concatenate(
        [jnp.zeros(end.shape[:-1] + (1,), bool),
         jax.lax.cummax(end.astype(jnp.int32), axis=end.ndim - 1)[..., :-1] > 0], axis=-1)
    cont = stored & ~ended_before
    cont = cont.at[..., 0].set(True)                 # the sampled step itself always counts
    m = jnp.sum(cont, axis=-1, dtype=jnp.int32)
    disc = jnp.where(cont, gamma ** i.astype(jnp.float32), 0.0)
    disc = disc.reshape(disc.shape + (1,) * (reward.ndim - disc.ndim))
    summed = jnp.sum(disc * reward.astype(jnp.float32), axis=idx.ndim).astype(reward.dtype)
    last = jnp.take_along_axis(steps, (m - 1)[..., None], axis=-1)[..., 0]
    later = rb.get(state, last)
    out = dict(data)
    out["next"] = dict(later["next"])
    out = set_key(out, ("next", "original_reward"),
                  get_key(data, reward_key, where="n_step_returns"))
    out = set_key(out, reward_key, summed)
    out["steps_to_next_obs"] = m
    out["gamma"] = gamma ** m.astype(jnp.float32)
    return out


# ---------------------------------------------------------------------------- TED <-> flat
# The flat layout (TorchRL's TED2Flat / Flat2TED files, byte for byte), in this library's
# terms. A storage holds R env lines of T ring slots; here as arrays [R, T, ...] ("line
# layout": this library's [env, time] order; ndim=1 is R = 1). Read each line oldest step
# first (a full ring from slot `shift`, else from slot 0) and concatenate the lines: step j
# of line r is flat row p = r * T + j (N = R * T rows). A row ends a trajectory when its done
# flag is set or it is the step written last. A key present at the root and under "next" is
# stored once per row plus once more, right after it, for each end row ("paired": [N + E]);
# the "next" value of every other row is the following row's root value.
_FLAT_DONE_KEYS = ("done", "truncated", "terminated")
_FLAT_REWARD_KEYS = ("reward",)
_META = ("shift", "is_full", "_storage_shape")
_PAST_LEN = ("torchrl", "saved")


def _to_lines(x: np.ndarray, shift: int, is_full: bool) -> np.ndarray:
    """Line layout ``[R, T, ...]`` -> flat row order ``[R * T, ...]`` (oldest step first).

    A view when no rotation is needed; a rotated ring costs one copy (two block copies, not a
    gather)."""
    steps = x.shape[1]
    first = shift % steps if is_full and steps else 0
    if first:
        x = np.concatenate((x[:, first:], x[:, :first]), axis=1)
    return x.reshape((x.shape[0] * steps,) + x.shape[2:])


def _from_lines(x: np.ndarray, lines: int, shift: int, is_full: bool) -> np.ndarray:
    """Flat row order ``[R * T, ...]`` -> line layout ``[R, T, ...]``; inverts :func:`_to_lines`."""
    x = x.reshape((lines, x.shape[0] // max(lines, 1)) + x.shape[1:])
    steps = x.shape[1]
    first = shift % steps if is_full and steps else 0
    if first:
        x = np.concatenate((x[:, steps - first:], x[:, :steps - first]), axis=1)
    return x


def _line_position(lines: int, steps: int) -> np.ndarray:
    """int64 ``[R * T]``: each flat row's step within its line."""
    return np.tile(np.arange(steps), lines)


def _last_written(lines: int, steps: int, shift: int, is_full: bool) -> np.ndarray:
    """bool ``[R * T]``: the flat rows holding each line's newest step: line position ``T - 1``
    for a full ring (its lines are rotated to end there), ``shift - 1`` otherwise (none when
    ``shift == 0``: nothing written)."""
    return _line_position(lines, steps) == (steps - 1 if is_full else shift - 1)


def _done_flags(done: np.ndarray) -> np.ndarray:
    """bool ``[N]`` from done flags ``[N, ...]``: any element set."""
    done = np.asarray(done)
    return done.reshape(done.shape[0], -1).any(-1)


def _root_positions(ends: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: where flat row ``i``'s root value lies in a ``[N + E]`` paired leaf: ``i``
    plus the number of end rows before ``i`` (each stored one extra row, its "next" value)."""
    ends = ends.astype(np.int64)
    return np.arange(ends.shape[0]) + np.cumsum(ends) - ends


def _next_positions(at: np.ndarray, has_next: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: where flat row ``i``'s "next" value lies in a ``[N + E]`` paired leaf:
    right after its root value (its own next row for an end, the following row's root value
    otherwise), or -1 where ``has_next`` is False (loaded as zeros)."""
    return np.where(has_next, at + 1, -1)


def _roles(root_keys: Sequence[tuple], next_keys: Sequence[tuple], done_keys, reward_keys,
           who: str):
    """Split TED keys by how the flat layout stores them (``next_keys`` without ``"next"``).

    Returns ``(plain, from_next, paired)``: other root keys (``[N]``), done/reward keys taken
    from ``"next"`` (``[N]``), keys at the root and under ``"next"`` (``[N + E]``)."""
    dones = _keyset(done_keys)
    special = dones | _keyset(reward_keys)
    root_set = set(root_keys)
    from_next, paired = [], []
    for key in next_keys:
        if key in special:
            from_next.append(key)
        elif key in root_set:
            paired.append(key)
        else:
            raise KeyError(
                f"{who}: {('next', *key)} has no root counterpart {key}. The flat format "
                "stores a 'next' entry only as the following step's root entry (or as a "
                "done/reward key). Add the key to reward_keys/done_keys, or store a root "
                f"{key} entry too.")
    missing = [k for k in root_keys if k in dones and k not in from_next]
    if missing:
        raise KeyError(f"{who}: root done key(s) {missing} have no 'next' counterpart; the "
                       "flat format stores done keys from 'next' only. Add "
                       f"{[('next', *k) for k in missing]} or drop the key from done_keys.")
    paired_set = set(paired)
    plain = [k for k in root_keys if k not in paired_set and k not in dones]
    return plain, from_next, paired


def _keyset(keys) -> set:
    return {normalize_key(k) for k in keys}


def _ted_to_flat_lines(leaves: dict, done_key: tuple, shift: int, is_full: bool,
                       done_keys, reward_keys, who: str, time_major: bool = False) -> dict:
    """The flat leaves ``{key tuple: [N or N + E, ...]}`` of TED leaves given in line layout
    ``{key tuple: [R, T, ...]}`` (arrays or array views), or ``[T, R, ...]`` with
    ``time_major`` (TorchRL's storage order; read in place). Ordered plain, from_next, paired."""
    def lines_of(x):
        return x.swapaxes(0, 1) if time_major else x

    if not any(k[0] == "next" for k in leaves):
        raise KeyError(f"{who}: the data has no 'next' entry; TED data (TorchRL's collector "
                       "output) keeps each step's successor entries under 'next'. Remove the "
                       "hook (or skip this conversion) for data that is not TED.")
    root_keys = [k for k in leaves if k[0] != "next"]
    next_keys = [k[1:] for k in leaves if k[0] == "next"]
    plain, from_next, paired = _roles(root_keys, next_keys, done_keys, reward_keys, who)
    if done_key not in leaves:
        raise KeyError(f"{who}: done_key {done_key} is not in the data (keys "
                       f"{sorted(leaves)}); pass the key of the step's done flags.")
    done = lines_of(leaves[done_key])
    lines, steps = done.shape[0], done.shape[1]
    ends = _done_flags(_to_lines(done, shift, is_full)) | _last_written(lines, steps, shift,
                                                                        is_full)
    flat = {}
    for key in plain:
        flat[key] = _to_lines(lines_of(leaves[key]), shift, is_full)
    for key in from_next:
        flat[key] = _to_lines(lines_of(leaves[("next", *key)]), shift, is_full)
    if paired:
        # Scatter straight from the storage order (no rotated copy of the paired leaves): each
        # stored step's root row goes to `at`, an end's next row right after it.
        at = _from_lines(_root_positions(ends), lines, shift, is_full)           # [R, T]
        with_next = _from_lines(ends, lines, shift, is_full)                     # [R, T]
        if time_major:
            at, with_next = at.T, with_next.T
        total = lines * steps + int(ends.sum())
        for key in paired:
            root, nxt = leaves[key], leaves[("next", *key)]
            out = np.empty((total,) + root.shape[2:], root.dtype)
            out[at] = root
            out[at[with_next] + 1] = nxt[with_next]
            flat[key] = out
    return flat


def ted_to_flat(data: PyTree, *, shift: int, is_full: bool, ndim: int = 1,
                done_key: Key = ("next", "done"), done_keys: Sequence[Key] = _FLAT_DONE_KEYS,
                reward_keys: Sequence[Key] = _FLAT_REWARD_KEYS) -> dict:
    """TorchRL's ``TED2Flat`` on a NumPy PyTree (a host function; sizes depend on the data).

    ``data`` is a storage's full content: nested dicts with leaves ``[T, ...]`` (``ndim=1``)
    or ``[num_envs, T, ...]`` (``ndim=2``, this library's ``[env, time]`` layout; TorchRL's
    ``[time, env]`` storage is its transpose). ``shift`` is the number of steps written before
    the cursor (TorchRL's ``last_cursor + 1``; for a functional_rb state
    ``((cursor - 1) % row_capacity) + 1``) and ``is_full`` whether the ring wrapped.

    Layout (byte-identical to TorchRL 0.14's files): each env line is read oldest step first
    (a full ring from slot ``shift``, else from slot 0; slots past the newest are written too)
    and the lines are concatenated, ``N = num_envs * T`` rows. A step ends a trajectory when
    ``done_key`` is set (any element) or it is its line's newest step. Returns a flat dict:

    - done and reward keys (``done_keys``, ``reward_keys``, matched on the whole key below
      ``"next"``): their ``"next"`` values, ``[N, ...]`` (root done keys are dropped);
    - keys at the root and under ``"next"``: ``[N + E, ...]`` (``E`` trajectory ends): each
      step's root value followed, for an end only, by its ``"next"`` value;
    - other root keys: ``[N, ...]``;
    - ``"shift"`` (int), ``"is_full"`` (bool), ``"_storage_shape"`` (tuple, TorchRL's
      ``[time, env]`` order).

    Raises ``KeyError`` naming the key for a ``"next"`` key with no root counterpart that is
    not a done/reward key, a root done key without its ``"next"`` counterpart, or no ``"next"``.
    """
    if ndim not in (1, 2):
        raise ValueError(f"ted_to_flat: ndim must be 1 or 2, got {ndim!r}.")
    leaves = {k: np.asarray(v) for k, v in _flat_items(data).items()}
    if ndim == 1:
        leaves = {k: v[None] for k, v in leaves.items()}
    flat = _ted_to_flat_lines(leaves, normalize_key(done_key), int(shift), bool(is_full),
                              done_keys, reward_keys, "ted_to_flat")
    out = _nest(flat)
    out["shift"] = int(shift)
    out["is_full"] = bool(is_full)
    done = leaves[normalize_key(done_key)]
    out["_storage_shape"] = (done.shape[1],) if ndim == 1 else (done.shape[1], done.shape[0])
    return out


def _flat_to_ted_lines(items: dict, storage_shape: Sequence[int], shift: int, is_full: bool,
                       done_key: tuple, done_keys, reward_keys, past_len: str,
                       who: str, time_major: bool = False) -> dict:
    """TED leaves ``{key tuple: [R, T, ...]}`` (line layout, ``R = prod(storage_shape[1:])``;
    ``[T, R, ...]`` with ``time_major``, gathered in that order, no transposed copy) from flat
    leaves ``{key tuple: [N or N + E, ...]}``. Ordered as the flat keys."""
    if past_len not in _PAST_LEN:
        raise ValueError(f"{who}: past_len must be one of {_PAST_LEN}, got {past_len!r}.")
    steps = int(storage_shape[0])
    lines = 1
    for s in storage_shape[1:]:
        lines *= int(s)
    rows = steps * lines
    if done_key not in items:
        raise KeyError(f"{who}: done_key {done_key} is not in the flat data (keys "
                       f"{sorted(items)}); pass the flat key of the done flags.")
    flags = _done_flags(items[done_key])
    ends = flags | _last_written(lines, steps, shift, is_full)
    total = rows + int(ends.sum())
    at = _root_positions(ends)
    last_in_line = _line_position(lines, steps) == steps - 1
    if past_len == "saved":
        has_next = ends | ~last_in_line
    else:
        # TorchRL 0.14's Flat2TED reads positions from the stored done flags only, so past a
        # non-full line's newest step (whose end was forced on save) it reads one row early,
        # and the last slot of a non-full line always gets zeros as its next values.
        forced = (ends & ~flags).astype(np.int64).reshape(lines, steps)
        at = at - (np.cumsum(forced, axis=1) - forced).reshape(-1)
        has_next = ~last_in_line if not is_full else np.ones_like(last_in_line)
    nxt = _next_positions(at, has_next)
    # where each stored slot's values are, as flat (or paired) row indices, [R, T]
    from_flat = _from_lines(np.arange(rows), lines, shift, is_full)
    from_root = _from_lines(at, lines, shift, is_full)
    from_next = _from_lines(nxt, lines, shift, is_full)
    if time_major:
        from_flat, from_root, from_next = from_flat.T, from_root.T, from_next.T
    no_next = from_next < 0
    from_next = np.maximum(from_next, 0)
    dones = _keyset(done_keys)
    to_next = dones | _keyset(reward_keys)

    def take(x, source, zero=None):
        out = np.take(x, source, axis=0)
        if zero is not None and zero.any():
            out[zero] = 0
        return out

    ted = {}
    for key, x in items.items():
        if x.shape[0] == rows:
            if key in to_next:
                ted[("next", *key)] = take(x, from_flat)
                if key in dones:  # TED root done flags are False (steps are not done yet)
                    ted[key] = np.zeros(from_flat.shape + x.shape[1:], x.dtype)
            else:
                ted[key] = take(x, from_flat)
        elif x.shape[0] == total:
            ted[key] = take(x, from_root)
            ted[("next", *key)] = take(x, from_next, no_next)
        else:
            raise ValueError(
                f"{who}: {key} has {x.shape[0]} rows; expected {rows} (the storage "
                f"{list(storage_shape)}) or {total} (one more per trajectory end). The "
                "dump's done flags, shift or is_full do not match its data; was it written "
                "with a different done_key?")
    return ted


def flat_to_ted(flat: PyTree, *, done_key: Key = "done",
                done_keys: Sequence[Key] = _FLAT_DONE_KEYS,
                reward_keys: Sequence[Key] = _FLAT_REWARD_KEYS,
                past_len: str = "torchrl") -> dict:
    """TorchRL's ``Flat2TED`` on a NumPy PyTree: the inverse of :func:`ted_to_flat`.

    ``flat``: the flat dict (with ``"shift"``, ``"is_full"``, ``"_storage_shape"``); ``done_key``
    its key of the done flags (the ``"next"`` done values). Returns TED nested dicts in storage
    order, leaves ``[T, ...]`` (``[num_envs, T, ...]`` when the flat data came from an
    ``ndim=2`` storage). For TED data (``"next"`` values equal the following step's root values
    within a trajectory) every written step comes back exactly; root done keys come back as
    zeros (the flat format keeps only the ``"next"`` ones). Full ``ndim=2`` dumps load too.

    ``past_len`` chooses the slots a non-full storage never wrote (past its newest step):
    ``"torchrl"`` (default): as TorchRL 0.14's ``Flat2TED`` gives them (read one row early,
    the last slot's ``"next"`` values zeros); ``"saved"``: as they were saved (only a last slot
    that does not end a trajectory gets zeros as its ``"next"`` values: it has no successor).
    """
    for key in _META:
        if key not in flat:
            raise KeyError(f"flat_to_ted: the data has no {key!r} entry, so it was not "
                           "written by ted_to_flat / TED2Flat.")
    shape = tuple(int(s) for s in flat["_storage_shape"])
    items = {k: np.asarray(v) for k, v in _flat_items(
        {k: v for k, v in flat.items() if k not in _META}).items()}
    ted = _flat_to_ted_lines(items, shape, int(flat["shift"]), bool(flat["is_full"]),
                             normalize_key(done_key), done_keys, reward_keys, past_len,
                             "flat_to_ted")
    if len(shape) == 1:
        ted = {k: v[0] for k, v in ted.items()}
    return _nest(ted)
