"""Slice samplers: contiguous sub-trajectories that never cross an episode boundary.

Three samplers, TorchRL's names and arguments: :class:`SliceSampler`,
:class:`SliceSamplerWithoutReplacement` and :class:`PrioritizedSliceSampler`. Each draws
``num_slices`` slices of ``slice_len`` consecutive time steps; ``Sample.indices``, ``weights``
and ``mask`` are ``[num_slices, slice_len]`` and ``Sample.data`` leaves are
``[num_slices, slice_len, ...]``.

What a trajectory is (the same as TorchRL's ``find_start_stop_traj`` on the storage as it is)
----------------------------------------------------------------------------------------------
* A step ends its trajectory when its ``end_key`` flag is True (``end_key`` mode), or when the
  next stored step carries another id under ``traj_key`` (``traj_key`` mode, e.g.
  ``("collector", "traj_ids")``). Trajectory ids are compared between consecutive steps only.
* The newest stored step always ends a trajectory: the still-running episode (no done yet) is
  a valid trajectory ending at the newest step. When later steps of the same episode arrive,
  that trajectory simply grows (it stays one trajectory across ``add`` calls).
* A ring buffer overwrites the oldest steps first. When the oldest episode has been partly
  overwritten, its surviving tail is a trajectory that starts at the oldest stored step
  (TorchRL treats the storage contents as they are, and so do we): its length is the number of
  its steps still stored. Overwritten steps are never returned.
* With ``ndim=2`` (storage ``[num_envs, time]``) trajectories live inside one env row and the
  ring wraps inside each row; slices run along time within one row.

How it stays fast and jittable
------------------------------
Episode boundaries are tracked incrementally in ``on_add`` (sampling never rescans storage).
Because a FIFO ring stores time in order, the stored trajectories of a row form a queue: new
trajectories are appended at the tail, overwritten ones leave at the head. The state keeps, per
row, a ring of trajectory records (the absolute step number at which each one starts) and the
``head``/``tail`` record counters; ``on_add`` appends the starts found in the new steps and
moves ``head`` with a binary search. A record's length follows from its start and the next
record's start (or the newest step), clipped by the oldest stored step. ``add`` costs
``O(T + log capacity)`` per row, ``sample`` ``O(num_slices * slice_len)``.

These samplers assume a FIFO writer (:class:`~functional_rb.RoundRobinWriter`, or
``ReplayBuffer.init_from_data``): they follow time through the ring and are meaningless with
:class:`~functional_rb.MaxValueWriter`, whose positions are not in time order.

Counters are int32. Step counts are compared by wrapping differences, but record ids index the
record ring by ``id % row_capacity``, so a row may receive at most 2**31 steps over the
buffer's life (about 60 hours at 10,000 steps/s into one row); beyond that, re-initialize.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._random import bits32
from functional_rb._errors import describe_structure
from functional_rb._tree import Key, get_key, has_key, normalize_key, set_key
from functional_rb.layout import Context, Layout
from functional_rb.samplers import Drawn, SamplerBase

# Candidate trajectories drawn per slice before falling back to an exact O(capacity) draw
# (strict_length=True only): with a fraction p of trajectories long enough, the fallback runs
# for a batch with probability about num_slices * (1 - p) ** _TRIES.
_TRIES = 8
# Newest records per row checked by the cheap path of ``can_sample`` (strict_length=True).
_QUICK = 8


# ---------------------------------------------------------------------------------- state
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SliceState:
    """Trajectory bookkeeping of a slice sampler (``E = num_envs``, ``R = row capacity``)."""

    rec_start: jax.Array  # int32 [E, R]: absolute step at which record k starts, slot k % R
    head: jax.Array       # int32 [E]: id of the oldest record with a stored step
    tail: jax.Array       # int32 [E]: records created so far (alive: head <= k < tail)
    total: jax.Array      # int32 []: steps written per row so far (wrapping counter)
    last_done: jax.Array  # bool [E]: end flag of the newest step (end_key mode)
    last_id: jax.Array    # [E] (traj id dtype): id of the newest step (traj_key mode)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SliceWithoutReplacementState:
    slices: SliceState
    perm: jax.Array         # int32 [E * R]: flat record slots (e * R + k % R) in draw order
    pos: jax.Array          # int32 []: slices drawn in this epoch
    epoch_size: jax.Array   # int32 []: eligible trajectories when the epoch began
    epoch_total: jax.Array  # int32 []: `slices.total` when the epoch began (adds end it)
    epoch: jax.Array        # int32 []: epochs begun so far


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrioritizedSliceState:
    slices: SliceState
    tree: object            # sum tree over flat positions: prio ** alpha where a start is valid
    prio: jax.Array         # float32 [capacity]: (priority + eps) ** alpha of each step
    valid: jax.Array        # bool [capacity]: the step can start a slice of slice_len
    max_priority: jax.Array  # float32 []: largest priority seen (new steps get it)
    # The slice length `valid` and `tree` are kept for (static: a batch_size implying another
    # one is refused at trace time). num_slices mode: the buffer's batch_size // num_slices.
    slice_len: int = dataclasses.field(metadata=dict(static=True))


# ---------------------------------------------------------------------------------- helpers
def _check_slice_args(name: str, num_slices, slice_len):
    if (num_slices is None) == (slice_len is None):
        raise ValueError(
            f"{name}: pass exactly one of num_slices and slice_len, got num_slices="
            f"{num_slices!r} and slice_len={slice_len!r}. E.g. {name}(slice_len=64) draws "
            "batch_size // 64 slices of 64 steps; "
            f"{name}(num_slices=32) draws 32 slices of batch_size // 32 steps.")
    for arg, v in (("num_slices", num_slices), ("slice_len", slice_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or v < 1):
            raise ValueError(f"{name}: {arg} must be a positive Python int, got {v!r}.")


def _slice_shape(name: str, num_slices, slice_len, batch_size: int):
    """``(num_slices, slice_len)`` for a batch of ``batch_size`` steps, or a ValueError."""
    if num_slices is not None:
        if batch_size % num_slices:
            raise ValueError(
                f"{name}: batch_size={batch_size} is not divisible by num_slices={num_slices}; "
                f"batch_size = num_slices * slice_len, e.g. batch_size="
                f"{max(batch_size // num_slices, 1) * num_slices}.")
        return int(num_slices), batch_size // num_slices
    if batch_size % slice_len:
        raise ValueError(
            f"{name}: batch_size={batch_size} is not divisible by slice_len={slice_len}; "
            f"batch_size = num_slices * slice_len, e.g. batch_size="
            f"{max(batch_size // slice_len, 1) * slice_len}.")
    return batch_size // slice_len, int(slice_len)


def _below(bits, n):
    """int32 in ``[0, max(n, 1))`` from uint32 ``bits`` (``bits % n``: the bias, at most
    ``n / 2**32`` relative, is far below anything a test or a learner can see)."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.uint32)
    return (bits % n).astype(jnp.int32)


def _rows(x, num_envs: int):
    """``[E * T, ...]`` -> ``[E, T, ...]`` (the flat items on_add receives)."""
    return x.reshape((num_envs, x.shape[0] // num_envs) + x.shape[1:])


class _SliceCore(SamplerBase):
    """Shared machinery. Subclasses are frozen dataclasses with the fields
    ``num_slices, slice_len, end_key, traj_key, truncated_key, strict_length``."""

    _name = "SliceSampler"

    def _post_init(self):
        _check_slice_args(self._name, self.num_slices, self.slice_len)
        object.__setattr__(self, "end_key", normalize_key(self.end_key))
        if self.traj_key is not None:
            object.__setattr__(self, "traj_key", normalize_key(self.traj_key))
        if self.truncated_key is not None:
            object.__setattr__(self, "truncated_key", normalize_key(self.truncated_key))

    # -------------------------------------------------------------- the sampler protocol
    # Each call goes through a jitted implementation with the (hashable) sampler and layout
    # static: under an outer jit it is inlined; used eagerly it is compiled once instead of
    # re-tracing its lax.cond / fori_loop bodies on every call.
    def on_add(self, state, positions, mask, items, ctx: Context):
        del positions, mask  # a FIFO writer: the new steps follow the newest stored one
        return _jit_on_add(self, state, items, ctx.layout, ctx.filled, ctx.cursor)

    def can_sample(self, state, ctx: Context, batch_size: int):
        self._shape(batch_size)
        return _jit_can_sample(self, state, ctx.layout, ctx.filled, ctx.cursor, batch_size)

    def sample(self, state, key, batch_size: int, ctx: Context):
        """``(Drawn, state)``; ``Drawn`` fields are ``[num_slices, slice_len]``."""
        self._shape(batch_size)  # a clear error for a batch_size that does not divide
        return _jit_sample(self, state, key, ctx.layout, ctx.filled, ctx.cursor, batch_size)

    # -------------------------------------------------------------- configuration checks
    def validate(self, *, capacity: int, batch_size: int, ndim: int):
        del capacity, ndim
        _slice_shape(self._name, self.num_slices, self.slice_len, batch_size)

    @property
    def _signal_key(self):
        return self.traj_key if self.traj_key is not None else self.end_key

    def _check_spec(self, item_spec, layout: Layout, slice_len=None):
        """The spec of the boundary signal leaf, after checking the items can carry slices;
        ``slice_len``: the fixed slice length, if any (default: the ``slice_len`` field)."""
        slice_len = self.slice_len if slice_len is None else slice_len
        key = self._signal_key
        what = "traj_key" if self.traj_key is not None else "end_key"
        if not has_key(item_spec, key):
            raise ValueError(
                f"{self._name}.init: {what}={key!r} is not in the stored items, whose leaves "
                f"are {describe_structure(item_spec)}. Pass the key under which episode "
                f"{'ids' if self.traj_key is not None else 'ends (done flags)'} are stored, "
                "e.g. end_key=('next', 'done') or traj_key=('collector', 'traj_ids').")
        spec = get_key(item_spec, key, where=f"{self._name}.init")
        if not hasattr(spec, "shape"):
            raise ValueError(f"{self._name}.init: {what}={key!r} is a sub-tree "
                             f"{describe_structure(spec)}, not an array leaf.")
        if self.traj_key is not None and int(np.prod(spec.shape)) != 1:
            raise ValueError(
                f"{self._name}.init: the trajectory ids under traj_key={key!r} must be one "
                f"number per step (shape () or (1,)), got shape {tuple(spec.shape)}.")
        if (self.truncated_key is not None and not isinstance(item_spec, Mapping)):
            raise ValueError(
                f"{self._name}.init: truncated_key={self.truncated_key!r} needs items that are "
                "(nested) dicts so the slice ends can be marked; pass truncated_key=None.")
        if self.strict_length and slice_len is not None and slice_len > layout.row_capacity:
            raise ValueError(
                f"{self._name}.init: slice_len={slice_len} exceeds the number of time "
                f"steps a row can hold ({layout.row_capacity}), so no slice could ever be "
                "drawn with strict_length=True. Use a shorter slice_len or a larger capacity.")
        return spec

    def _init_slices(self, item_spec, layout: Layout, slice_len=None) -> SliceState:
        spec = self._check_spec(item_spec, layout, slice_len)
        e, r = layout.num_envs, layout.row_capacity
        id_dtype = spec.dtype if self.traj_key is not None else jnp.int32
        return SliceState(
            rec_start=jnp.zeros((e, r), jnp.int32), head=jnp.zeros((e,), jnp.int32),
            tail=jnp.zeros((e,), jnp.int32), total=jnp.int32(0),
            last_done=jnp.zeros((e,), bool), last_id=jnp.zeros((e,), id_dtype))

    # -------------------------------------------------------------- on_add
    def _add_slices(self, st: SliceState, items, ctx: Context) -> SliceState:
        """Append the trajectory starts found in new steps; advance ``head``."""
        layout = ctx.layout
        ne, cap = layout.num_envs, layout.row_capacity
        sig = get_key(items, self._signal_key, where=f"{self._name}.on_add")
        sig = _rows(jnp.asarray(sig), ne)
        steps = sig.shape[1]
        if steps == 0:
            return st
        sig = sig.reshape(ne, steps, -1)
        kept = min(steps, cap)  # earlier steps of this call are overwritten within the call
        skipped = steps - kept
        no_record = st.tail == st.head
        if self.traj_key is not None:
            ids = sig[:, :, 0]
            inner = ids[:, skipped + 1:] != ids[:, skipped:-1]
            first = (ids[:, skipped] != st.last_id.astype(ids.dtype)) | no_record
            last_done, last_id = st.last_done, ids[:, -1].astype(st.last_id.dtype)
        else:
            done = jnp.any(sig != 0, axis=-1)
            inner = done[:, skipped:-1]
            first = st.last_done | no_record
            last_done, last_id = done[:, -1], st.last_id
        if skipped:
            first = jnp.ones_like(first)  # everything before it is gone: it starts a record
        is_start = jnp.concatenate([first[:, None], inner], axis=1)          # [E, kept]
        csum = jnp.cumsum(is_start.astype(jnp.int32), axis=1)
        rec_id = st.tail[:, None] + csum - 1
        row = jnp.arange(ne, dtype=jnp.int32)[:, None]
        flat = row * jnp.int32(cap) + jnp.remainder(rec_id, cap)
        # distinct out-of-range slots for non-starts: dropped, and the indices stay unique
        oob = jnp.int32(ne * cap) + jnp.arange(ne * kept, dtype=jnp.int32).reshape(ne, kept)
        flat = jnp.where(is_start, flat, oob)
        abs_step = st.total + jnp.int32(skipped) + jnp.arange(kept, dtype=jnp.int32)
        rec_start = st.rec_start.reshape(-1).at[flat.reshape(-1)].set(
            jnp.broadcast_to(abs_step[None, :], (ne, kept)).reshape(-1), mode="drop",
            unique_indices=True).reshape(ne, cap)
        tail = st.tail + csum[:, -1]
        total = st.total + jnp.int32(steps)
        head = _find_head(rec_start, st.head, tail, total, ctx.filled, cap)
        return SliceState(rec_start=rec_start, head=head, tail=tail, total=total,
                          last_done=last_done, last_id=last_id)

    # -------------------------------------------------------------- record geometry
    @staticmethod
    def _record(st: SliceState, e, k, filled):
        """Age of the oldest stored step and length of record ``k`` of row ``e``.

        Ages count back from the newest step (age 1). Shapes follow ``e``/``k``.
        """
        cap = st.rec_start.shape[1]
        age_hi = jnp.minimum(st.total - st.rec_start[e, jnp.remainder(k, cap)], filled)
        nxt = k + 1
        age_lo = jnp.where(nxt != st.tail[e],
                           st.total - st.rec_start[e, jnp.remainder(nxt, cap)] + 1, 1)
        return age_hi, age_hi - age_lo + 1

    def _eligible(self, length, seq_len: int):
        if self.strict_length:
            return length >= seq_len
        return length >= 1

    def _all_records(self, st: SliceState, filled, seq_len: int):
        """Per record slot ``[E, R]``: its record id, length and eligibility (exact, O(capacity))."""
        ne, cap = st.rec_start.shape
        slot = jnp.arange(cap, dtype=jnp.int32)[None, :]
        d = jnp.remainder(slot - st.head[:, None], cap)
        alive = d < (st.tail - st.head)[:, None]
        k = st.head[:, None] + d
        e = jnp.broadcast_to(jnp.arange(ne, dtype=jnp.int32)[:, None], (ne, cap))
        _, length = self._record(st, e, k, filled)
        return k, length, alive & self._eligible(length, seq_len)

    def _uniform_records(self, st: SliceState, bits):
        """Records uniform over all alive records of all rows: ``(e, k, any_alive)``, shaped
        like the uint32 random ``bits``."""
        n = st.tail - st.head
        cum = jnp.cumsum(n)
        total = cum[-1]
        u = _below(bits, total)
        shape = bits.shape
        if n.shape[0] == 1:
            e = jnp.zeros(shape, jnp.int32)
        else:
            e = jnp.searchsorted(cum, u, side="right").astype(jnp.int32)
            e = jnp.minimum(e, n.shape[0] - 1)
        k = st.head[e] + u - (cum[e] - n[e])
        return e, k, total > 0

    def _draw_records(self, st: SliceState, bits, seq_len: int, filled):
        """Records uniform among eligible ones: ``(e, k, ok)``, each ``[num]``; ``bits`` are
        uint32 ``[num, _TRIES + 1]``.

        Eligible: every alive trajectory (strict_length=False) or those with at least
        ``seq_len`` stored steps. Exact: candidates are drawn uniformly and the first eligible
        one is kept; slices whose ``_TRIES`` candidates all fail are redrawn from the exact
        cumulative count over all records (``lax.cond``: only when needed, except under vmap).
        """
        num = bits.shape[0]
        if not self.strict_length:
            e, k, ok = self._uniform_records(st, bits[:, 0])
            return e, k, jnp.broadcast_to(ok, (num,))
        e, k, _ = self._uniform_records(st, bits[:, :_TRIES])
        _, length = self._record(st, e, k, filled)
        good = (length >= seq_len) & ((st.tail - st.head)[e] > 0)
        pick = jnp.argmax(good, axis=1)[:, None]
        e = jnp.take_along_axis(e, pick, axis=1)[:, 0]
        k = jnp.take_along_axis(k, pick, axis=1)[:, 0]
        found = jnp.any(good, axis=1)

        def exact(_):
            ks, _, elig = self._all_records(st, filled, seq_len)
            cap = ks.shape[1]
            cum = jnp.cumsum(elig.reshape(-1).astype(jnp.int32))
            n_elig = cum[-1]
            u = _below(bits[:, _TRIES], n_elig)
            flat = jnp.minimum(jnp.searchsorted(cum, u, side="right"), cum.shape[0] - 1)
            flat = flat.astype(jnp.int32)
            ef, kf = flat // cap, ks.reshape(-1)[flat]
            return (jnp.where(found, e, ef), jnp.where(found, k, kf),
                    found | (n_elig > 0))

        return jax.lax.cond(jnp.all(found), lambda _: (e, k, found), exact, None)

    def _any_eligible(self, st: SliceState, filled, seq_len: int):
        """bool []: some stored trajectory is eligible (cheap check first, exact fallback)."""
        if not self.strict_length:
            return jnp.any(st.tail != st.head)
        ne = st.head.shape[0]
        q = jnp.arange(_QUICK, dtype=jnp.int32)[None, :]
        k = st.tail[:, None] - 1 - q
        alive = (1 + q) <= (st.tail - st.head)[:, None]
        e = jnp.broadcast_to(jnp.arange(ne, dtype=jnp.int32)[:, None], k.shape)
        _, length = self._record(st, e, k, filled)
        quick = jnp.any(alive & (length >= seq_len))
        return jax.lax.cond(quick, lambda _: jnp.bool_(True),
                            lambda _: jnp.any(self._all_records(st, filled, seq_len)[2]), None)

    def _slice_indices(self, st: SliceState, bits, e, k, ok, seq_len: int, ctx: Context):
        """Indices/mask ``[num, seq_len]`` of a slice starting uniformly inside record (e, k).

        The start offset is uniform in ``[0, L - min(L, seq_len)]`` (TorchRL's
        ``floor(rand * (L - seq_len + 1))``); padding repeats the last valid step.
        """
        layout = ctx.layout
        cap = layout.row_capacity
        age_hi, length = self._record(st, e, k, ctx.filled)
        length = jnp.where(ok, jnp.maximum(length, 1), 1)
        eff = jnp.minimum(length, seq_len)
        off = _below(bits, length - eff + 1)
        start_age = age_hi - off
        j = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        jj = jnp.minimum(j, (eff - 1)[:, None])
        t = jnp.remainder(ctx.cursor - start_age[:, None] + jj, cap)
        idx = layout.to_flat(e[:, None], t)
        mask = (j < eff[:, None]) & ok[:, None]
        idx = jnp.where(ok[:, None], idx, 0)
        return idx.astype(jnp.int32), mask

    def _shape(self, batch_size: int):
        return _slice_shape(self._name, self.num_slices, self.slice_len, batch_size)

    # -------------------------------------------------------------- finalize
    def finalize(self, data, drawn: Drawn, ctx: Context):
        """Mark the last valid step of every slice True under ``truncated_key`` (OR-ed with the
        stored flag; False on padding), and OR the same marker into the sibling ``done`` entry
        when the items have one (as TorchRL does). If the items have no ``truncated_key`` entry
        it is added, bool ``[num_slices, slice_len]`` (plus the end flag's trailing shape)."""
        del ctx
        if self.truncated_key is None:
            return data
        m = drawn.mask
        nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
        last = m & ~nxt

        def mark(leaf):
            extra = leaf.shape[2:]
            mk = jnp.broadcast_to(last.reshape(last.shape + (1,) * len(extra)), leaf.shape)
            mm = jnp.broadcast_to(m.reshape(m.shape + (1,) * len(extra)), leaf.shape)
            return ((leaf.astype(bool) & mm) | mk).astype(leaf.dtype)

        tk = self.truncated_key
        if has_key(data, tk):
            data = set_key(data, tk, mark(get_key(data, tk, where=self._name)))
        else:
            extra = ()
            if self.traj_key is None and has_key(data, self.end_key):
                extra = get_key(data, self.end_key, where=self._name).shape[2:]
            data = set_key(data, tk, mark(jnp.zeros(last.shape + tuple(extra), bool)))
        done_key = tk[:-1] + ("done",)
        if done_key != tk and has_key(data, done_key):
            data = set_key(data, done_key, mark(get_key(data, done_key, where=self._name)))
        return data


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_on_add(sampler, state, items, layout, filled, cursor):
    return sampler._on_add(state, items, Context(layout, jnp.asarray(filled, jnp.int32),
                                                 jnp.asarray(cursor, jnp.int32)))


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _jit_can_sample(sampler, state, layout, filled, cursor, batch_size):
    return sampler._can_sample(state, Context(layout, jnp.asarray(filled, jnp.int32),
                                              jnp.asarray(cursor, jnp.int32)), batch_size)


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _jit_sample(sampler, state, key, layout, filled, cursor, batch_size):
    return sampler._sample(state, key, batch_size, Context(
        layout, jnp.asarray(filled, jnp.int32), jnp.asarray(cursor, jnp.int32)))


def _find_head(rec_start, head, tail, total, filled, cap: int):
    """The last record (per row) starting at or before the oldest stored step.

    Only the newest ``cap`` records can be alive (each holds >= 1 stored step), and their slots
    are intact, so the search runs over ``[max(head, tail - cap), tail)``, where record start
    ages decrease monotonically.
    """
    lo = jnp.where(tail - head > cap, tail - jnp.int32(cap), head)
    row = jnp.arange(rec_start.shape[0], dtype=jnp.int32)
    return _last_started(rec_start, total, row, lo, tail - lo, filled)


def _last_started(rec_start, total, row, lo, m, age):
    """The last of the ``m`` records ``lo, lo + 1, ...`` of ``row`` (ring slots mod the record
    capacity) that started at least ``age`` steps ago (start ages decrease along records);
    ``lo`` if none. Binary search; arrays of any common shape."""
    cap = rec_start.shape[1]

    def body(_, c):
        a, b = c
        mid = (a + b) // 2
        started = total - rec_start[row, jnp.remainder(lo + mid, cap)]
        go = (started >= age) & (a < b)
        return jnp.where(go, mid + 1, a), jnp.where(go | (a >= b), b, mid)

    n_iter = int(np.ceil(np.log2(cap + 1))) + 1
    a, _ = jax.lax.fori_loop(0, n_iter, body, (jnp.zeros_like(m), m))
    return lo + jnp.maximum(a - 1, 0)


# ---------------------------------------------------------------------------------- samplers
@dataclasses.dataclass(frozen=True)
class SliceSampler(_SliceCore):
    """Slices of consecutive steps, with replacement (TorchRL's ``SliceSampler``).

    Args:
      num_slices / slice_len: exactly one; ``batch_size = num_slices * slice_len``.
      end_key: key of the per-step end flag (default ``("next", "done")``); a step with a True
        flag (any True over trailing axes) ends its trajectory.
      traj_key: key of per-step trajectory ids; when given, boundaries come from id changes
        between consecutive steps and ``end_key`` is not used.
      truncated_key: where the returned data marks each slice's last valid step (see
        :meth:`finalize`); ``None`` leaves the data untouched.
      strict_length: True: only trajectories with at least ``slice_len`` stored steps are
        drawn. False: every trajectory may be drawn; a shorter one yields a slice of its whole
        length, padded at the end (``mask`` False, weight 0, index and data repeat the last
        valid step).

    Distribution (TorchRL's, from ``SliceSampler._sample_slices``/``_get_index``): the
    ``num_slices`` slices are independent; each picks a trajectory uniformly among the
    eligible stored trajectories (not weighted by length), then a start offset uniform in
    ``[0, L - min(L, slice_len)]`` of that trajectory of ``L`` stored steps, so the slice
    ``[start, start + min(L, slice_len))`` lies inside it. Weights are 1 (0 on padding).
    TorchRL returns a shorter, ragged batch for short trajectories; here the shape is static
    and short slices are padded. When no trajectory is eligible: eagerly a ``ValueError``;
    under jit ``mask`` False everywhere.
    """

    num_slices: Optional[int] = None
    slice_len: Optional[int] = None
    end_key: Key = ("next", "done")
    traj_key: Optional[Key] = None
    truncated_key: Optional[Key] = ("next", "truncated")
    strict_length: bool = True
    requires_fifo = True  # ReplayBuffer refuses a writer that does not write in time order

    def __post_init__(self):
        self._post_init()

    def init(self, item_spec, layout: Layout) -> SliceState:
        return self._init_slices(item_spec, layout)

    def _on_add(self, state, items, ctx: Context):
        return self._add_slices(state, items, ctx)

    def _can_sample(self, state, ctx: Context, batch_size: int):
        _, seq_len = self._shape(batch_size)
        return (ctx.size > 0) & self._any_eligible(state, ctx.filled, seq_len)

    def _sample(self, state, key, batch_size: int, ctx: Context):
        num, seq_len = self._shape(batch_size)
        bits = bits32(key, (num, _TRIES + 2))
        e, k, ok = self._draw_records(state, bits[:, :_TRIES + 1], seq_len, ctx.filled)
        idx, mask = self._slice_indices(state, bits[:, -1], e, k, ok, seq_len, ctx)
        return Drawn(idx, mask.astype(jnp.float32), mask), state


@dataclasses.dataclass(frozen=True)
class SliceSamplerWithoutReplacement(_SliceCore):
    """Slices without replacement (TorchRL's ``SliceSamplerWithoutReplacement``).

    Epochs, as in TorchRL: an epoch is a permutation of the eligible trajectories stored when
    it began (storage order, oldest first per row, when ``shuffle=False``); each batch takes
    the next ``num_slices`` of them and one slice from each (start uniform as in
    :class:`SliceSampler`). So within an epoch a trajectory yields at most one slice, and no
    slice start (indeed no trajectory) is drawn twice. A new epoch begins when the previous
    one is exhausted, when anything was added since it began (TorchRL resets on extend), or,
    with ``drop_last=True``, when fewer than ``num_slices`` trajectories remain. With
    ``drop_last=False`` the last batch of an epoch holds the remaining slices followed by
    fully masked slices (weight 0). Deviation: TorchRL draws short trajectories and then drops
    them (its batch shrinks); with ``strict_length=True`` this epoch only contains trajectories
    with at least ``slice_len`` stored steps.
    """

    num_slices: Optional[int] = None
    slice_len: Optional[int] = None
    end_key: Key = ("next", "done")
    traj_key: Optional[Key] = None
    truncated_key: Optional[Key] = ("next", "truncated")
    strict_length: bool = True
    drop_last: bool = False
    shuffle: bool = True

    _name = "SliceSamplerWithoutReplacement"
    requires_fifo = True  # ReplayBuffer refuses a writer that does not write in time order

    def __post_init__(self):
        self._post_init()

    def init(self, item_spec, layout: Layout) -> SliceWithoutReplacementState:
        return SliceWithoutReplacementState(
            slices=self._init_slices(item_spec, layout),
            perm=jnp.arange(layout.capacity, dtype=jnp.int32), pos=jnp.int32(0),
            epoch_size=jnp.int32(0), epoch_total=jnp.int32(0), epoch=jnp.int32(0))

    def _on_add(self, state, items, ctx: Context):
        return dataclasses.replace(state, slices=self._add_slices(state.slices, items, ctx))

    def _can_sample(self, state, ctx: Context, batch_size: int):
        num, seq_len = self._shape(batch_size)
        if self.drop_last:
            _, _, elig = self._all_records(state.slices, ctx.filled, seq_len)
            return jnp.sum(elig, dtype=jnp.int32) >= num
        return (ctx.size > 0) & self._any_eligible(state.slices, ctx.filled, seq_len)

    def _sample(self, state: SliceWithoutReplacementState, key, batch_size: int, ctx: Context):
        num, seq_len = self._shape(batch_size)
        st = state.slices
        k_perm, k_off = jax.random.split(key)
        cap_all = state.perm.shape[0]
        remaining = state.epoch_size - state.pos
        need = (state.epoch_total != st.total) | (remaining <= 0) | (state.epoch == 0)
        if self.drop_last:
            need = need | (remaining < num)

        def new_epoch(_):
            ks, _, elig = self._all_records(st, ctx.filled, seq_len)
            elig = elig.reshape(-1)
            if self.shuffle:
                score = jax.random.uniform(k_perm, (cap_all,))
            else:  # oldest first per row
                ne, cap = ks.shape
                rank = (ks - st.head[:, None]).astype(jnp.float32)
                score = (jnp.arange(ne, dtype=jnp.float32)[:, None] * cap + rank).reshape(-1)
                score = score / jnp.float32(cap_all)
            perm = jnp.argsort(jnp.where(elig, score, 2.0)).astype(jnp.int32)
            return perm, jnp.int32(0), jnp.sum(elig, dtype=jnp.int32), state.epoch + 1

        def keep(_):
            return state.perm, state.pos, state.epoch_size, state.epoch

        perm, pos, epoch_size, epoch = jax.lax.cond(need, new_epoch, keep, None)
        slot = pos + jnp.arange(num, dtype=jnp.int32)
        ok = slot < epoch_size
        if self.drop_last:
            ok = ok & (epoch_size - pos >= num)
        flat = perm[jnp.minimum(slot, cap_all - 1)]
        cap = st.rec_start.shape[1]
        e = flat // cap
        k = st.head[e] + jnp.remainder(flat % cap - st.head[e], cap)
        e = jnp.where(ok, e, 0)
        idx, mask = self._slice_indices(
            st, bits32(k_off, (num,)), e, k, ok, seq_len, ctx)
        taken = jnp.minimum(jnp.int32(num), jnp.maximum(epoch_size - pos, 0))
        new_state = SliceWithoutReplacementState(
            slices=st, perm=perm, pos=pos + taken, epoch_size=epoch_size,
            epoch_total=st.total, epoch=epoch)
        return Drawn(idx, mask.astype(jnp.float32), mask), new_state


def _find_record(st: SliceState, e, age):
    """Record id holding the stored step of age ``age`` (1 = newest) in row ``e``: the last
    alive record that started at least ``age`` steps ago (binary search, any shape)."""
    head = st.head[e]
    return _last_started(st.rec_start, st.total, e, head, st.tail[e] - head, age)


@dataclasses.dataclass(frozen=True)
class PrioritizedSliceSampler(_SliceCore):
    """Slices whose start is drawn by priority (TorchRL's ``PrioritizedSliceSampler``).

    Every stored step has a priority ``p`` (new steps get the largest priority seen so far,
    initially 1). A step is a *valid start* when a slice of ``slice_len`` steps starting there
    stays inside its trajectory (at least ``slice_len`` steps remain to the trajectory end),
    or, with ``strict_length=False``, when it is the first stored step of its trajectory (that
    slice is then padded, ``mask`` False on the padding): TorchRL's rule. Each slice start is
    drawn independently with ``P(i) = (p_i + eps) ** alpha / sum_j (p_j + eps) ** alpha`` over
    the valid starts ``j``; the slice is the next ``slice_len`` steps. Weights (one per slice,
    repeated over its steps, 0 on padding) are ``w_i = (N P(i)) ** -beta / max_j (N P(j)) **
    -beta`` with ``N`` and ``j`` over the valid starts, i.e. ``(min_j P(j) / P(i)) ** beta``
    (TorchRL normalizes by the minimum over all stored steps instead; ours keeps the largest
    possible weight at 1). ``sample(..., beta=b)`` overrides ``beta``.

    ``update(indices, priorities)`` takes the ``[num_slices, slice_len]`` indices of a sample
    (or any flat positions) and sets the priority of each step; within a slice, padding
    repeats the last valid index and is ignored (the first occurrence in a row counts), and
    across the batch the last occurrence wins. As TorchRL warns, only start points are drawn
    by priority: aggregate priorities over a slice yourself if that is what you want.
    NaN/negative priorities are treated as 0 (the step keeps ``eps ** alpha``).

    Slice length. Valid starts are maintained incrementally in ``add`` for one slice length
    (so ``sample`` costs ``O(num_slices * (log capacity + slice_len))``, where TorchRL rescans
    the storage on every call), which is fixed when the state is built and kept in it
    (``PrioritizedSliceState.slice_len``, static). With ``slice_len=L`` any ``batch_size`` that
    is a multiple of ``L`` works (``batch_size // L`` slices). With ``num_slices=n`` (TorchRL's
    ``slice_len = batch_size // n``), ``ReplayBuffer.init`` passes the buffer's ``batch_size``
    and the slice length is ``batch_size // n``; ``sample(..., batch_size=m)`` with
    ``m // n`` different from it raises ``ValueError`` at trace time. :meth:`with_slice_len`
    converts a state to another slice length in ``O(capacity)``, keeping the priorities
    (the TorchRL adapter does so when ``sample`` is called with such a batch size).
    The sum tree is :mod:`functional_rb.sum_tree` (O(log capacity) per draw and update).
    """

    alpha: float
    beta: float
    eps: float = 1e-8
    num_slices: Optional[int] = None
    slice_len: Optional[int] = None
    end_key: Key = ("next", "done")
    traj_key: Optional[Key] = None
    truncated_key: Optional[Key] = ("next", "truncated")
    strict_length: bool = True

    _name = "PrioritizedSliceSampler"
    requires_fifo = True  # ReplayBuffer refuses a writer that does not write in time order
    # ReplayBuffer.init passes its batch_size to init when a sampler sets this: with
    # num_slices, the slice length the valid starts are kept for is batch_size // num_slices.
    init_takes_batch_size = True

    def __post_init__(self):
        self._post_init()
        for name in ("alpha", "beta", "eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.floating, np.integer)) or not np.isfinite(v) \
                    or v < 0:
                raise ValueError(f"PrioritizedSliceSampler: {name} must be a finite number "
                                 f">= 0, got {v!r}.")
        if self.eps <= 0:
            raise ValueError("PrioritizedSliceSampler: eps must be > 0 so that every valid "
                             f"start keeps a positive probability, got {self.eps!r}.")

    def init(self, item_spec, layout: Layout, batch_size: Optional[int] = None
             ) -> PrioritizedSliceState:
        """An empty state. ``batch_size`` (the buffer's default, a Python int) fixes the slice
        length with ``num_slices``: ``batch_size // num_slices``; it is ignored with
        ``slice_len``."""
        from functional_rb import sum_tree
        if self.slice_len is not None:
            slice_len = int(self.slice_len)
        elif batch_size is None:
            raise ValueError(
                f"PrioritizedSliceSampler(num_slices={self.num_slices}).init: the slice length "
                "(batch_size // num_slices) is fixed when the state is built, but no batch_size "
                "was given. Build the state with ReplayBuffer(..., batch_size=B).init(example) "
                "(it passes B), call init(item_spec, layout, batch_size=B), or pass slice_len "
                "instead of num_slices.")
        else:
            slice_len = _slice_shape(self._name, self.num_slices, None, int(batch_size))[1]
        return PrioritizedSliceState(
            slices=self._init_slices(item_spec, layout, slice_len),
            tree=sum_tree.init(layout.capacity),
            prio=jnp.zeros((layout.capacity,), jnp.float32),
            valid=jnp.zeros((layout.capacity,), bool), max_priority=jnp.float32(1.0),
            slice_len=slice_len)

    def _shape_for(self, state: PrioritizedSliceState, batch_size: int):
        """``(num_slices, slice_len)`` for ``batch_size``, or a ValueError when that slice length
        is not the one the state keeps valid starts for."""
        num, seq_len = self._shape(batch_size)
        if seq_len == state.slice_len:
            return num, seq_len
        if self.num_slices is None:
            raise ValueError(
                f"PrioritizedSliceSampler(slice_len={self.slice_len}): the sampler state keeps "
                f"valid starts for slice_len={state.slice_len}, so it was built for another "
                "sampler; use a state made by this buffer's init.")
        fixed = state.slice_len * self.num_slices
        raise ValueError(
            f"PrioritizedSliceSampler(num_slices={self.num_slices}): batch_size={batch_size} "
            f"means slices of {seq_len} steps, but this state keeps valid slice starts for "
            f"slice_len={state.slice_len}, i.e. batch_size={fixed} (set at init from the "
            f"buffer's batch_size). Sample with batch_size={fixed}; for {seq_len}-step slices "
            f"build the buffer with batch_size={batch_size}, or convert the state: "
            f"rb.sampler.with_slice_len(state.sampler, rb.context(state), {seq_len}) "
            f"(O(capacity)); to vary the number of slices per call use slice_len="
            f"{state.slice_len} instead of num_slices.")

    def with_slice_len(self, state: PrioritizedSliceState, ctx: Context, slice_len: int
                       ) -> PrioritizedSliceState:
        """``state`` with its valid starts and sum tree recomputed for ``slice_len`` (a Python
        int); priorities, the max priority and the trajectory records are kept. O(capacity),
        jittable. With a buffer ``rb``: ``state = dataclasses.replace(state,
        sampler=rb.sampler.with_slice_len(state.sampler, rb.context(state), L))``; ``sample``
        then takes ``batch_size = num_slices * L``. Only for ``num_slices`` samplers (with
        ``slice_len`` the length is the sampler's)."""
        _check_slice_args(self._name, None, slice_len)
        if self.slice_len is not None and slice_len != self.slice_len:
            raise ValueError(
                f"PrioritizedSliceSampler(slice_len={self.slice_len}).with_slice_len: the slice "
                f"length is the sampler's ({self.slice_len}), got {slice_len}; use "
                f"PrioritizedSliceSampler(..., num_slices=n) for a slice length set per state.")
        if self.strict_length and slice_len > ctx.layout.row_capacity:
            raise ValueError(
                f"PrioritizedSliceSampler.with_slice_len: slice_len={slice_len} exceeds the "
                f"number of time steps a row can hold ({ctx.layout.row_capacity}), so no slice "
                "could be drawn with strict_length=True.")
        return _jit_rebuild(self, state, ctx.layout, ctx.filled, ctx.cursor, int(slice_len))

    def _weight_of(self, p):
        return (p + jnp.float32(self.eps)) ** jnp.float32(self.alpha)

    def _on_add(self, state: PrioritizedSliceState, items, ctx: Context):
        from functional_rb import sum_tree
        st = self._add_slices(state.slices, items, ctx)
        layout = ctx.layout
        ne, cap = layout.num_envs, layout.row_capacity
        steps = jax.tree_util.tree_leaves(items)[0].shape[0] // ne
        if steps == 0:
            return dataclasses.replace(state, slices=st)
        kept = min(steps, cap)
        # Steps whose start validity can change: the new ones, the slice_len - 1 before them
        # (their trajectory may have grown) and the oldest stored one (it may now begin its
        # trajectory).
        w = min(kept + state.slice_len - 1, cap)
        age = jnp.concatenate([jnp.arange(1, w + 1, dtype=jnp.int32),
                               ctx.filled[None]])[None, :]
        age = jnp.broadcast_to(age, (ne, w + 1))
        pos, valid = self._starts(st, age, ctx, state.slice_len)
        pos, valid = pos.reshape(-1), valid.reshape(-1)
        new = (age <= kept).reshape(-1)
        prio = state.prio.at[jnp.where(new, pos, layout.capacity)].set(
            self._weight_of(state.max_priority), mode="drop")
        valid_all = state.valid.at[pos].set(valid, mode="drop")
        vals = jnp.where(valid, prio[jnp.minimum(pos, layout.capacity - 1)], 0.0)
        tree = sum_tree.set(state.tree, pos, vals)
        return dataclasses.replace(state, slices=st, tree=tree, prio=prio, valid=valid_all)

    def _starts(self, st: SliceState, age, ctx: Context, slice_len: int):
        """For the steps of age ``age`` (int32 ``[E, W]``, 1 = newest of row ``e``): their flat
        positions (``capacity`` where nothing is stored) and whether each is a valid start
        (bool ``[E, W]``): at least ``slice_len`` steps remain to its trajectory's end or, with
        ``strict_length=False``, it is the first stored step of its trajectory."""
        layout = ctx.layout
        e = jnp.broadcast_to(jnp.arange(layout.num_envs, dtype=jnp.int32)[:, None], age.shape)
        stored = age <= ctx.filled
        k = _find_record(st, e, age)
        age_hi, length = self._record(st, e, k, ctx.filled)
        remaining = age - (age_hi - length + 1) + 1
        valid = remaining >= slice_len
        if not self.strict_length:
            valid = valid | (age == age_hi)
        t = jnp.remainder(ctx.cursor - age, layout.row_capacity)
        pos = jnp.where(stored, layout.to_flat(e, t), jnp.int32(layout.capacity))
        return pos, valid & stored

    def _rebuild(self, state: PrioritizedSliceState, ctx: Context, slice_len: int):
        from functional_rb import sum_tree
        layout = ctx.layout
        age = jnp.broadcast_to(jnp.arange(1, layout.row_capacity + 1, dtype=jnp.int32)[None, :],
                               (layout.num_envs, layout.row_capacity))
        pos, valid = self._starts(state.slices, age, ctx, slice_len)
        valid_all = jnp.zeros((layout.capacity,), bool).at[pos.reshape(-1)].set(
            valid.reshape(-1), mode="drop")
        tree = sum_tree.set(state.tree, jnp.arange(layout.capacity, dtype=jnp.int32),
                            jnp.where(valid_all, state.prio, 0.0), unique=True)
        return dataclasses.replace(state, tree=tree, valid=valid_all, slice_len=slice_len)

    def can_sample(self, state, ctx: Context, batch_size: int):
        self._shape_for(state, batch_size)
        return _jit_can_sample(self, state, ctx.layout, ctx.filled, ctx.cursor, batch_size)

    def _can_sample(self, state, ctx: Context, batch_size: int):
        from functional_rb import sum_tree
        self._shape_for(state, batch_size)
        return (ctx.size > 0) & (sum_tree.total(state.tree) > 0)

    def sample(self, state, key, batch_size: int, ctx: Context, beta=None):
        """``(Drawn, state)``; ``Drawn`` fields are ``[num_slices, slice_len]``."""
        self._shape_for(state, batch_size)
        beta = jnp.float32(self.beta if beta is None else beta)
        return _jit_psample(self, state, key, ctx.layout, ctx.filled, ctx.cursor, batch_size,
                            beta)

    def _sample(self, state: PrioritizedSliceState, key, batch_size: int, ctx: Context, beta):
        from functional_rb import sum_tree
        num, seq_len = self._shape_for(state, batch_size)
        st = state.slices
        layout = ctx.layout
        cap = layout.row_capacity
        # total and min from the search's own reads (no copy of the tree in a fused step)
        start, v, total, vmin = sum_tree.sample_with_stats(state.tree, key, num)
        ok = (total > 0) & (ctx.size > 0) & (v > 0)
        e, t = layout.from_flat(start)
        age = jnp.remainder(ctx.cursor - 1 - t, cap) + 1
        k = _find_record(st, e, age)
        age_hi, length = self._record(st, e, k, ctx.filled)
        remaining = age - (age_hi - length + 1) + 1
        eff = jnp.clip(remaining, 1, seq_len)
        j = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        tt = jnp.remainder(t[:, None] + jnp.minimum(j, (eff - 1)[:, None]), cap)
        idx = jnp.where(ok[:, None], layout.to_flat(e[:, None], tt), 0).astype(jnp.int32)
        mask = (j < eff[:, None]) & ok[:, None]
        w = jnp.where(ok, (vmin / jnp.where(ok, v, 1.0)) ** beta, 0.0)
        weights = jnp.where(mask, w[:, None], 0.0).astype(jnp.float32)
        return Drawn(idx, weights, mask), state

    def update(self, state: PrioritizedSliceState, indices, priorities, ctx: Context):
        """Set step priorities; ``indices`` ``[num_slices, slice_len]`` from a sample (padding,
        which repeats a slice's last valid index, is ignored) or flat ``[N]`` positions."""
        return _jit_pupdate(self, state, jnp.asarray(indices, jnp.int32),
                            jnp.asarray(priorities, jnp.float32), ctx.layout)

    def _update(self, state: PrioritizedSliceState, indices, priorities, layout: Layout):
        from functional_rb import sum_tree
        from functional_rb.sum_tree import _last_occurrence
        priorities = jnp.broadcast_to(priorities, indices.shape)
        keep = jnp.ones(indices.shape, bool)
        if indices.ndim == 2:
            keep = keep.at[:, 1:].set(indices[:, 1:] != indices[:, :-1])
        idx = indices.reshape(-1)
        p = priorities.reshape(-1)
        p = jnp.where(jnp.isfinite(p) & (p > 0), p, 0.0)
        n = layout.capacity
        keep = keep.reshape(-1) & (idx >= 0) & (idx < n)
        idx = jnp.where(keep, idx, n)
        last = _last_occurrence(idx)
        idx = jnp.where(last, idx, n)
        val = self._weight_of(p)
        oob = n + jnp.arange(idx.shape[0], dtype=jnp.int32)
        prio = state.prio.at[jnp.where(idx < n, idx, oob)].set(val, mode="drop",
                                                                unique_indices=True)
        valid = state.valid[jnp.minimum(idx, n - 1)]
        # idx is deduplicated above (losers sent out of range): no second resolution
        tree = sum_tree.set(state.tree, idx, jnp.where(valid, val, 0.0), unique=True)
        max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(keep, p, 0.0)))
        return dataclasses.replace(state, prio=prio, tree=tree, max_priority=max_p)


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _jit_psample(sampler, state, key, layout, filled, cursor, batch_size, beta):
    return sampler._sample(state, key, batch_size, Context(
        layout, jnp.asarray(filled, jnp.int32), jnp.asarray(cursor, jnp.int32)), beta)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _jit_pupdate(sampler, state, indices, priorities, layout):
    return sampler._update(state, indices, priorities, layout)


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _jit_rebuild(sampler, state, layout, filled, cursor, slice_len):
    return sampler._rebuild(state, Context(layout, jnp.asarray(filled, jnp.int32),
                                           jnp.asarray(cursor, jnp.int32)), slice_len)
