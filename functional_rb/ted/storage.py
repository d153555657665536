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

How a write proceeds is :mod:`functional_rb.ted.write` (named pure steps). The ``frb.ted``
namespace also gives, from their own modules:

- :func:`n_step_returns` (:mod:`functional_rb.ted.nstep`): TorchRL's MultiStep targets computed
  from sampled indices, for any storage.
- :func:`ted_to_flat` / :func:`flat_to_ted` and :func:`ted_to_flat_lines` /
  :func:`flat_to_ted_lines` (:mod:`functional_rb.ted.flat`): TorchRL's ``TED2Flat`` /
  ``Flat2TED`` on NumPy PyTrees; the torch hooks ``functional_rb.adapters.TED2Flat`` /
  ``Flat2TED`` call the ``*_lines`` functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal import hugepages, words
from functional_rb._internal.errors import (
    config_int,
    describe_structure,
    enforce,
    keystr,
    shape_mismatch,
)
from functional_rb._internal.jit import compiled
from functional_rb._internal.tree import del_key, get_key, has_key, normalize_key, set_key
from functional_rb.protocol import Context, Layout, Storage, WriteRecord
from functional_rb.storages.device import gather_rows, scatter_rows
from functional_rb.ted import rows as ted_rows
from functional_rb.ted import write as ted_write
from functional_rb.ted.flat import flat_to_ted, flat_to_ted_lines, ted_to_flat, ted_to_flat_lines
from functional_rb.ted.nstep import n_step_returns
from functional_rb.ted.state import TEDStorageState
from functional_rb.ted.write import mod as _mod

PyTree = Any

__all__ = (
    "TEDStorage",
    "TEDStorageState",
    "flat_to_ted",
    "flat_to_ted_lines",
    "n_step_returns",
    "ted_to_flat",
    "ted_to_flat_lines",
)

_END_KEYS = (("next", "done"), ("next", "truncated"))
_NOT_PAIRED = ("done", "terminated", "truncated", "reward")


# ---------------------------------------------------------------------------- small helpers
def _paths(tree) -> list:
    """The key tuple of every leaf of a nested dict, in flatten order."""
    return [tuple(p.key for p in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ---------------------------------------------------------------------------- storage
@dataclasses.dataclass(frozen=True)
class TEDStorage(Storage):
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

    pairs: tuple | None = None
    end_keys: tuple = _END_KEYS
    min_episode_len: int = 32
    side_capacity: int | None = None
    frame_stack: int = 1
    stack_pad: str = "first"
    stack_keys: tuple | None = None
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
                        "'observation'), 'observation'),)."
                    )
            object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "end_keys", tuple(normalize_key(k) for k in self.end_keys))
        if self.stack_keys is not None:
            object.__setattr__(self, "stack_keys", tuple(normalize_key(k) for k in self.stack_keys))
        config_int("TEDStorage", "frame_stack", self.frame_stack)
        if self.stack_pad not in ("first", "zeros"):
            raise ValueError(
                f"TEDStorage: stack_pad must be 'first' or 'zeros', got {self.stack_pad!r}."
            )
        config_int("TEDStorage", "min_episode_len", self.min_episode_len)
        config_int("TEDStorage", "side_capacity", self.side_capacity, none_ok=True)

    # ------------------------------------------------------------------ static structure
    def _pairs_for(self, item) -> tuple:
        if not isinstance(item, Mapping):
            raise TypeError(
                f"TEDStorage.init: items must be nested dicts (TED), got {type(item).__name__}."
            )
        if self.pairs is not None:
            for n, r in self.pairs:
                for k in (n, r):
                    if not has_key(item, k):
                        raise KeyError(
                            f"TEDStorage.init: pair key {k!r} is not in the item; the item has "
                            f"leaves {describe_structure(item)}. Fix `pairs`."
                        )
                a, b = get_key(item, n, where="TEDStorage"), get_key(item, r, where="TEDStorage")
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(
                        f"TEDStorage.init: pair {n!r} / {r!r} must share shape and dtype, got "
                        f"{a.shape} {a.dtype} vs {b.shape} {b.dtype}."
                    )
            return self.pairs
        pairs = []
        nxt = item.get("next", {})
        for path, x in jax.tree_util.tree_flatten_with_path(nxt)[0]:
            keys = tuple(getattr(p, "key", None) for p in path)
            sub = tuple(s for s in keys if isinstance(s, str))
            if len(sub) != len(keys) or sub[-1] in _NOT_PAIRED:
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
                raise ValueError(
                    f"TEDStorage: stack key {k!r} is not a paired root key "
                    f"{roots}; frame stacking applies to paired observations."
                )
        return self.stack_keys

    def _pairs_of_state(self, state: TEDStorageState) -> tuple:
        # The state's data lacks the next leaves; pairs were resolved at init and `pending`
        # holds exactly the paired root keys.
        if self.pairs is not None:
            return self.pairs
        return tuple((("next",) + sub, sub) for sub in _paths(state.pending))

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
                "'observation'). Pass pairs=... explicitly."
            )
        k = self.frame_stack
        if k > 1 and not any(has_key(item, e) for e in self.end_keys):
            raise KeyError(
                f"TEDStorage.init: frame_stack={k} needs episode ends, but none of "
                f"end_keys={self.end_keys} is in the item {describe_structure(item)}."
            )
        self._stacked(pairs)
        cap, e = layout.capacity, layout.num_envs
        s = self.side_capacity or self._side_rows(layout, self.min_episode_len)
        rows = cap + s + e * (k - 1)
        data = item
        for n, _ in pairs:
            data = del_key(data, n)
        roots = {r for _, r in pairs}
        stacks = k > 1
        packed = ted_rows.choose(
            [
                (key, tuple(jnp.shape(x)), jnp.asarray(x).dtype.name)
                for key, x in zip(_paths(data), jax.tree_util.tree_leaves(data))
                if key not in roots
            ],
            stacks,
        )
        data = ted_rows.without(data, packed)

        def alloc(path, x):
            key = tuple(getattr(p, "key", None) for p in path)
            n = rows if key in roots else cap
            return hugepages.zeros((n,) + tuple(jnp.shape(x)), jnp.asarray(x).dtype)

        data = jax.tree_util.tree_map_with_path(alloc, data)
        pending: dict = {}
        for _, r in pairs:
            x = get_key(item, r, where="TEDStorage.init")
            pending = set_key(
                pending, r, jnp.zeros((e,) + tuple(jnp.shape(x)), jnp.asarray(x).dtype)
            )
        empty = ted_rows.empty_row(packed, stacks)
        return TEDStorageState(
            data=data,
            rows=hugepages.full((cap, empty.shape[0]), jnp.asarray(empty), jnp.int32),
            owner=hugepages.full((s,), -1, jnp.int32),
            counts=jnp.zeros((2,), jnp.int32),
            carry=jnp.zeros((e, 2), jnp.int32).at[:, 1].set(1),
            pending=pending,
            packed=packed,
        )

    def check_state(self, state: TEDStorageState, capacity: int, num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items in ``num_envs``
        rows (None if it can)."""
        if state.pending is None:
            return (
                "state.storage.pending is None: a TEDStorageState in the layout saved "
                "before pending next observations had a leaf of their own; load the file "
                "with functional_rb.checkpoint.load, which converts it"
            )
        return shape_mismatch(
            [
                ("state.storage.rows", state.rows, (capacity,), False, f" (capacity={capacity})"),
                (
                    "state.storage.carry",
                    state.carry,
                    (num_envs, 2),
                    True,
                    f" (num_envs={num_envs})",
                ),
            ]
            + [
                (
                    f"state.storage.pending{keystr(path)}",
                    x,
                    (num_envs,),
                    False,
                    f" (num_envs={num_envs})",
                )
                for path, x in jax.tree_util.tree_flatten_with_path(state.pending)[0]
            ]
        )

    def item_spec(self, state: TEDStorageState) -> PyTree:
        """The user's full TED item (single frames), as given to ``init``."""
        spec = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.data
        )
        for key, shape, dtype in state.packed:
            spec = set_key(spec, key, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
        for n, r in self._pairs_of_state(state):
            spec = set_key(spec, n, get_key(spec, r, where="TEDStorage.item_spec"))
        return spec

    def memory_bytes(self, state: TEDStorageState) -> int:
        """Bytes held by every leaf of the state."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))

    def plan(self, state: TEDStorageState) -> ted_write.Plan:
        """The static facts a write needs (pairs, stacked keys, frame stack, side rows)."""
        pairs = self._pairs_of_state(state)
        return ted_write.Plan(
            pairs=pairs,
            stacked=self._stacked(pairs),
            frame_stack=self.frame_stack,
            end_keys=self.end_keys,
            side=state.owner.shape[0],
        )

    def set(
        self, state: TEDStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> TEDStorageState:
        """Write ``items`` (leaves ``[B, ...]``) at ``record.positions`` (a FIFO ring's
        positions); ``ctx``: the buffer before the write. A side-table overflow: eagerly
        ``ValueError``, under jit counted in ``lost`` (see the class docstring)."""
        new = self._write(state, record, items, ctx)
        s_n = new.owner.shape[0]
        enforce(
            new.lost > 0,
            lambda i, n: (
                f"TEDStorage.set: the side table ({s_n} rows) overflowed: {int(new.lost)} stored "
                "steps lost their final next observation (more episode ends arrived while they "
                "were stored than min_episode_len allows). Use a smaller min_episode_len or a "
                "larger side_capacity (side_capacity=capacity is always exact); under jax.jit "
                "state.storage.lost counts them."
            ),
        )
        return new

    def rewrite(
        self, state: TEDStorageState, positions: jax.Array, mask: jax.Array, values: PyTree
    ) -> TEDStorageState:
        """``state`` with stored steps' leaves replaced: ``values`` (nested dicts, leaves
        ``[B, ...]``) holds some of the leaves stored as they are (an action, a reward; not
        the paired observations, nor with frame stacks the end flags, which the stacks
        follow), written at flat ``positions`` (int32 ``[B]``, distinct) where ``mask``.
        Nothing else changes: no step is added. In place when the state is donated.

        >>> import functional_rb as frb
        >>> rb = frb.ReplayBuffer(capacity=4, storage=frb.TEDStorage())
        >>> item = {"obs": jnp.zeros(2), "reward": jnp.float32(0), "next": {"obs": jnp.ones(2)}}
        >>> state = rb.init(item)
        >>> state = rb.add(state, jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), item))
        >>> st = rb.storage.rewrite(state.storage, jnp.array([1]), jnp.array([True]),
        ...                         {"reward": jnp.array([5.0])})
        >>> rb.get(dataclasses.replace(state, storage=st), jnp.arange(3))["reward"].tolist()
        [0.0, 5.0, 0.0]
        """
        fixed = {r for _, r in self._pairs_of_state(state)}
        if self.frame_stack > 1:
            fixed |= set(self.end_keys)
        cols = {key: (c, w) for key, _, _, c, w in ted_rows.columns(state.packed, state.stacks)}
        data, rows = state.data, state.rows
        oob = jnp.int32(rows.shape[0]) + jnp.arange(positions.shape[0], dtype=jnp.int32)
        pos = jnp.where(mask, jnp.asarray(positions, jnp.int32), oob)
        for path, v in jax.tree_util.tree_flatten_with_path(values)[0]:
            key = tuple(p.key for p in path)
            if key in cols:
                c, w = cols[key]
                at = (pos[:, None], c + jnp.arange(w, dtype=jnp.int32)[None, :])
                rows = rows.at[at].set(words.to_words(v, 1), mode="drop", unique_indices=True)
            elif key not in fixed and has_key(data, key):
                leaf = get_key(data, key, where="TEDStorage.rewrite")
                data = set_key(data, key, scatter_rows(leaf, positions, v, mask))
            else:
                raise KeyError(
                    f"TEDStorage.rewrite: {key!r} is not a leaf stored as it is; it can rewrite "
                    f"{sorted(cols) + sorted(k for k in _paths(data) if k not in fixed)}. "
                    "Observations are stored once and stacks follow the end flags as added."
                )
        return dataclasses.replace(state, data=data, rows=rows)

    @compiled()
    def _write(
        self, state: TEDStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> TEDStorageState:
        """The write as the named steps of :mod:`functional_rb.ted.write`."""
        plan = self.plan(state)
        b = ted_write.split_rows(state, record, items, ctx, plan)
        need, slots = ted_write.side_needs(b, ctx, plan)
        side = ted_write.allocate_side(state, need, slots, ctx, plan.side)
        owner = ted_write.link_side(state, slots, side)
        pre = ted_write.pre_history(b, ctx, plan)
        data = ted_write.write_tables(state, b, side, pre, ctx, plan)
        dist, carry_dist, carry_end = ted_write.episode_distance(state, b, plan)
        rows = ted_write.write_rows(state, b, side, slots, dist, state.packed)
        return TEDStorageState(
            data=data,
            rows=rows,
            owner=owner,
            counts=jnp.stack([_mod(state.head + side.n_need, plan.side), side.lost]),
            carry=jnp.stack([carry_dist, carry_end.astype(jnp.int32)], axis=-1),
            pending=ted_write.pending_after(b, plan),
            packed=state.packed,
        )

    def get(self, state: TEDStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        """Items at flat ``indices`` (int32 ``[...]``), leaves ``[..., ...]``; stacked keys
        ``[..., k, *frame]``. Next entries are rebuilt from the successor, side or pending row."""
        return self._get(state, jnp.asarray(indices, jnp.int32), ctx)

    @compiled()
    def _get(self, state: TEDStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        lay = ctx.layout
        cap, r_cap = lay.capacity, lay.row_capacity
        s_n = state.owner.shape[0]
        k = self.frame_stack
        pairs = self._pairs_of_state(state)
        stacked = self._stacked(pairs)
        idx = jnp.clip(jnp.asarray(indices, jnp.int32), 0, cap - 1)
        env, t = lay.from_flat(idx)
        cols = gather_rows(state.rows, idx)  # one row: pointer, distance, small leaves
        p = cols[..., 0]
        # the next frame: the side row, else the pending one (newest step), else the successor
        from_pending = (p < 0) & (t == _mod(ctx.cursor - 1, r_cap)) & (ctx.filled > 0)
        next_src = jnp.where(p >= 0, jnp.int32(cap) + p, lay.to_flat(env, _mod(t + 1, r_cap)))

        def next_frame(successor, pend):  # [..., *frame]: the table's row, or pending
            m = from_pending.reshape(from_pending.shape + (1,) * (pend.ndim - 1))
            return jnp.where(m, gather_rows(pend, env), successor)

        roots = {r for _, r in pairs}
        out = jax.tree_util.tree_map_with_path(
            lambda path, leaf: (
                leaf if tuple(p.key for p in path) in roots else gather_rows(leaf, idx)
            ),
            state.data,
        )
        for key, leaf in ted_rows.decode(cols, state.packed, state.stacks).items():
            out = set_key(out, key, leaf)
        if stacked:
            d = cols[..., 1]
            age = _mod(t - (ctx.cursor - ctx.filled), r_cap)
            j = jnp.arange(k - 1, -1, -1, dtype=jnp.int32).reshape((1,) * idx.ndim + (k,))
            jj = jnp.minimum(j, d[..., None])
            back_age = age[..., None] - jj
            pre = (
                jnp.int32(cap + s_n)
                + env[..., None] * jnp.int32(k - 1)
                + jnp.int32(k - 1)
                + jnp.maximum(back_age, -(k - 1))
            )
            src = jnp.where(
                back_age >= 0, lay.to_flat(env[..., None], _mod(t[..., None] - jj, r_cap)), pre
            )
            pad = j > d[..., None]  # [..., k]
        for n, r in pairs:
            tab = get_key(state.data, r, where="TEDStorage.get")
            pend = get_key(state.pending, r, where="TEDStorage.get")
            # the step's frames and the next one in one read of the table: one kernel, which
            # XLA splits across threads once the table is large (NOTES, "Split kernels")
            ax = idx.ndim
            if r in stacked:
                frames = gather_rows(tab, jnp.concatenate([src, next_src[..., None]], axis=ax))
                root = jax.lax.slice_in_dim(frames, 0, k, axis=ax)  # [..., k, *f]
                last = next_frame(jax.lax.index_in_dim(frames, k, axis=ax, keepdims=False), pend)
                nxt = jnp.concatenate(
                    [jax.lax.slice_in_dim(root, 1, k, axis=ax), jnp.expand_dims(last, ax)], axis=ax
                )
                if self.stack_pad == "zeros":
                    padm = pad.reshape(pad.shape + (1,) * (tab.ndim - 1))
                    padn = jnp.concatenate([pad[..., 1:], jnp.zeros_like(pad[..., :1])], axis=-1)
                    padn = padn.reshape(padm.shape)
                    root = jnp.where(padm, jnp.zeros((), tab.dtype), root)
                    nxt = jnp.where(padn, jnp.zeros((), tab.dtype), nxt)
            else:
                frames = gather_rows(tab, jnp.stack([idx, next_src]))
                root, nxt = frames[0], next_frame(frames[1], pend)
            out = set_key(out, r, root)
            out = set_key(out, n, nxt)
        return out
