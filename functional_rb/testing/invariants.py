"""``assert_invariants(rb, state)``: one call that checks everything a state must satisfy.

Rules (each failure is an :class:`InvariantError`, an ``AssertionError`` whose message starts
``assert_invariants: rule "<name>" is broken`` and ends with how to fix it):

* ``state matches the buffer``: the buffer's own layout checks pass;
* ``size within capacity``: ``0 <= rb.size(state) <= capacity``;
* ``writer counters in range``: ``0 <= filled <= row_capacity``, ``0 <= cursor <
  row_capacity``;
* ``ring cursor follows filled``: a ring that has not wrapped writes next at ``filled``;
* ``max-value ranks match the stored items``: ``MaxValueWriter``'s rank table holds the stored
  items' ranks, and ``cursor == filled % capacity``;
* ``sum-tree layout``: array sizes as ``functional_rb.samplers.sum_tree`` documents them; padding 0;
* ``sum-tree leaves finite and non-negative``;
* ``sum-tree node sums``: each internal node is the sum of its children (relative 1e-6);
* ``sum-tree node minima``: ... and the exact minimum of their positive leaves (so the root
  minimum is exact);
* ``sum-tree total``: the root total equals the float64 sum of the leaves (relative 1e-6);
* ``priorities only on stored items``: no priority (or valid start) where no item is stored;
* ``priorities at most the running maximum``: no stored value above the value of
  ``max_priority``, which is at least ``max_priority_init``;
* ``without-replacement epoch``: the epoch order is a permutation; an epoch covers stored
  items only, each once;
* ``slice counters``: ``head <= tail <= head + row_capacity``, ``filled == min(total,
  row_capacity)``;
* ``slice records tile the stored steps``: the trajectory records cover every stored step once;
* ``slice records match the stored episode boundaries``: records start exactly where the
  stored end flags (or trajectory ids) start trajectories;
* ``prioritized slice starts``: valid starts follow TorchRL's rule on the stored data, and the
  tree holds the priorities of valid starts (0 elsewhere);
* ``TED side table links``: ``ptr`` and ``owner`` link each side row to one stored step and
  back; empty slots own none;
* ``TED next observations not lost``: ``lost == 0`` (otherwise samples are inexact);
* ``TED episode carry``: with frame stacks, each row's carry is its newest stored step's;
* ``TED frame-stack distances``: steps since the episode start follow the stored end flags;
* ``write generations``: with a sampler that tracks them, every stamp is in ``[0, clock]``,
  slots that hold no item were never stamped, a FIFO ring's stamps never decrease from its
  oldest item to its newest, and the dropped-update counter is ``>= 0``
  (:mod:`functional_rb.generations`).

Dynamic state is read through the state PyTree (the state classes are public dataclasses:
``state.writer.cursor``, ``state.sampler.tree``, ...). A state whose leaves are traced (inside
``jax.jit``, ``lax.scan`` or ``jax.vmap``) is checked on the host by ``jax.debug.callback``
when the computation runs; a broken rule then surfaces as a ``JaxRuntimeError`` carrying the
message (a debug mode for training loops).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from functional_rb.samplers import sum_tree
from functional_rb.samplers.prioritized import PrioritizedState
from functional_rb.samplers.prioritized_slices import PrioritizedSliceState
from functional_rb.samplers.slices import SliceState, SliceWithoutReplacementState
from functional_rb.samplers.uniform import WithoutReplacementState
from functional_rb.ted.storage import TEDStorageState
from functional_rb.testing import reference as ref
from functional_rb.testing._data import get_path
from functional_rb.testing.generation_checks import generation_problem
from functional_rb.writers import MaxValueState, RoundRobinState

PyTree = Any
REL_TOL = 1e-6


class InvariantError(AssertionError):
    """A broken invariant; ``rule`` names it."""

    def __init__(self, rule: str, detail: str, fix: str, where: str = "assert_invariants"):
        self.rule = rule
        super().__init__(f'{where}: rule "{rule}" is broken: {detail}. {fix}')


def assert_invariants(rb, state) -> None:
    """Raise :class:`InvariantError` (an ``AssertionError``) naming the first broken rule.

    ``state`` is one buffer's state (from ``rb.init``/``add``/``sample``/``update``). For a
    population built with ``jax.vmap(rb.init)`` call it inside ``jax.vmap`` (each member is
    checked) or on one member, ``jax.tree.map(lambda x: x[i], states)``. Under ``jax.jit`` the
    check runs on the host when the compiled code runs (``jax.debug.callback``).
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(state)):
        jax.debug.callback(functools.partial(_check, rb), state)
        return
    _check(rb, state)


# ------------------------------------------------------------------ driver
def _check(rb, state) -> None:
    try:
        size = int(rb.size(state))
    except (TypeError, ValueError) as e:
        raise InvariantError(
            "state matches the buffer", str(e), "Check the state that was built by this buffer."
        ) from e
    lay = rb.layout(state)
    if not 0 <= size <= rb.capacity:
        raise InvariantError(
            "size within capacity",
            f"rb.size(state) is {size}, capacity {rb.capacity}",
            "The writer's `filled` counter is corrupt.",
        )
    st = ref.host(state)
    cursor, filled = _check_writer(rb, state, st.writer, lay)
    ctx = _Ctx(rb, state, lay, cursor, filled)
    for path, tree in _find(st.sampler, sum_tree.SumTreeState, "state.sampler"):
        check_sum_tree(tree, path)
    sampler = st.sampler
    if isinstance(sampler, PrioritizedState):
        _check_prioritized(ctx, sampler)
    if isinstance(sampler, WithoutReplacementState):
        _check_epoch(ctx, sampler)
    for path, slices in _find(sampler, SliceState, "state.sampler"):
        _check_slices(ctx, slices, path)
    if isinstance(sampler, SliceWithoutReplacementState):
        _check_permutation("state.sampler.perm", sampler.perm, lay.capacity)
        if not 0 <= int(sampler.pos) <= int(sampler.epoch_size) <= lay.capacity:
            raise InvariantError(
                "without-replacement epoch",
                f"pos={int(sampler.pos)}, epoch_size="
                f"{int(sampler.epoch_size)}, expected 0 <= pos <= epoch_size <= {lay.capacity}",
                "A slice epoch cannot hand out more slices than it holds.",
            )
    if isinstance(sampler, PrioritizedSliceState):
        _check_prioritized_slices(ctx, sampler)
    if isinstance(st.storage, TEDStorageState):
        _check_ted(ctx, st.storage)
    if st.generations is not None:
        _check_generations(ctx, st.generations, st.writer)


# ------------------------------------------------------------------ write generations
def _check_generations(ctx, gens, ws) -> None:
    problem = generation_problem(
        gens,
        ctx.stored,
        ref.ring_positions(ctx.rb, ctx.state) if isinstance(ws, RoundRobinState) else None,
    )
    if problem is not None:
        raise InvariantError("write generations", *problem)


@dataclasses.dataclass
class _Ctx:
    rb: Any
    state: Any
    lay: Any
    cursor: int
    filled: int
    _rows: Any = None

    @property
    def stored(self) -> np.ndarray:
        t = np.arange(self.lay.capacity) % self.lay.row_capacity
        return t < self.filled

    def rows(self):
        """Per row ``(positions, items)`` of the stored steps, oldest first (a FIFO ring)."""
        if self._rows is None:
            pos = ref.ring_positions(self.rb, self.state)
            items = ref.read(self.rb, self.state, np.concatenate(pos))
            f = self.filled
            self._rows = [
                (p, jax.tree_util.tree_map(lambda x, e=e: x[e * f : (e + 1) * f], items))
                for e, p in enumerate(pos)
            ]
        return self._rows


def _find(node, cls, path: str):
    """``(path, node)`` for every instance of ``cls`` inside dataclasses, dicts and tuples."""
    if isinstance(node, cls):
        yield path, node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from _find(getattr(node, f.name), cls, f"{path}.{f.name}")
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _find(v, cls, f"{path}[{k!r}]")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _find(v, cls, f"{path}[{i}]")


# ------------------------------------------------------------------ writers
def _check_writer(rb, state, ws, lay) -> tuple[int, int]:
    cursor, filled = int(ws.cursor), int(ws.filled)
    r = lay.row_capacity
    if not (0 <= filled <= r and 0 <= cursor < r):
        raise InvariantError(
            "writer counters in range",
            f"state.writer has cursor={cursor}, filled={filled}; "
            f"expected 0 <= filled <= {r} and 0 <= cursor < {r} (row capacity)",
            f"{type(rb.writer).__name__}.write must keep both counters inside the row.",
        )
    if isinstance(ws, RoundRobinState) and filled < r and cursor != filled:
        raise InvariantError(
            "ring cursor follows filled",
            f"state.writer has filled={filled} < row capacity {r} but cursor={cursor}",
            "Until a ring wraps, its next slot is `filled`: "
            "the writer advanced one counter without the other.",
        )
    if isinstance(ws, MaxValueState):
        if cursor != filled % lay.capacity:
            raise InvariantError(
                "max-value ranks match the stored items",
                f"cursor={cursor}, expected filled % capacity = {filled % lay.capacity}",
                "MaxValueWriter keeps cursor == filled % capacity.",
            )
        if filled:
            items = ref.read(rb, state, np.arange(filled, dtype=np.int32))
            want = np.asarray(rb.writer.item_ranks(items), np.float32)
            got = np.asarray(ws.ranks[:filled], np.float32)
            bad = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))))
            if bad.size:
                i = int(bad[0])
                raise InvariantError(
                    "max-value ranks match the stored items",
                    f"state.writer.ranks[{i}] is {got[i]!r} but the item stored at {i} has "
                    f"rank {want[i]!r} ({bad.size} of {filled} slots differ)",
                    "The rank table must be written with the same positions as the storage.",
                )
    return cursor, filled


# ------------------------------------------------------------------ sum trees
def _levels(capacity: int, fanout: int) -> list[int]:
    """Nodes per level (leaves first), as sum_tree documents its layout."""
    sizes = [math.ceil(capacity / fanout) * fanout]
    while sizes[-1] > fanout:
        sizes.append(math.ceil(sizes[-1] // fanout / fanout) * fanout)
    return sizes


def check_sum_tree(tree, where: str = "tree") -> None:
    """Check one :class:`functional_rb.samplers.sum_tree.SumTreeState` (rules ``sum-tree ...``)."""
    f, cap = tree.fanout, tree.capacity
    values = np.asarray(tree.values, np.float32)
    sizes = _levels(cap, f)
    cut, rows = sum_tree.split(cap, f), sum(sizes[1:]) // f
    for name, want in (("nodes", (2, cut, f)), ("top", (2, rows - cut, f))):
        got = tuple(np.shape(getattr(tree, name)))
        if got != want:
            raise InvariantError(
                "sum-tree layout",
                f"{where}.{name} has shape {list(got)}; capacity {cap} with fanout {f} needs "
                f"{list(want)}",
                "Build trees with sum_tree.init(capacity).",
            )
    sums, mins = np.asarray(tree.sums, np.float32), np.asarray(tree.mins, np.float32)
    if values.shape != (sizes[0],) or sums.shape != (sum(sizes[1:]),) or mins.shape != sums.shape:
        raise InvariantError(
            "sum-tree layout",
            f"{where} has values{list(values.shape)}, sums{list(sums.shape)}"
            f", mins{list(mins.shape)}; capacity {cap} with fanout {f} needs values[{sizes[0]}] "
            f"and sums/mins[{sum(sizes[1:])}]",
            "Build trees with sum_tree.init(capacity).",
        )
    if np.any(values[cap:] != 0):
        raise InvariantError(
            "sum-tree layout",
            f"{where}.values past capacity {cap} are {values[cap:].tolist()}, expected 0",
            "Only sum_tree.set / set_run may write leaves, within capacity.",
        )
    leaves = values[:cap]
    bad = np.flatnonzero(~np.isfinite(leaves) | (leaves < 0))
    if bad.size:
        i = int(bad[0])
        raise InvariantError(
            "sum-tree leaves finite and non-negative",
            f"{where}.leaves[{i}] = {leaves[i]!r} ({bad.size} bad leaves)",
            "Sanitize values before sum_tree.set: priorities are finite and >= 0.",
        )
    below_sum, below_min = values.astype(np.float64), np.where(values > 0, values, np.inf)
    offset = 0
    for k, n in enumerate(sizes[1:], start=1):
        node_sum, node_min = sums[offset : offset + n], mins[offset : offset + n]
        m = sizes[k - 1] // f
        want_sum = np.zeros(n)
        want_sum[:m] = below_sum.reshape(m, f).sum(axis=1)
        want_min = np.full(n, np.inf, np.float32)
        want_min[:m] = below_min.reshape(m, f).min(axis=1)
        off = np.abs(node_sum - want_sum) > REL_TOL * np.abs(want_sum)
        if off.any():
            j = int(np.flatnonzero(off)[0])
            raise InvariantError(
                "sum-tree node sums",
                f"{where} level {k} node {j} holds {node_sum[j]!r}, the "
                f"sum of its {f} children is {want_sum[j]!r}",
                "Internal nodes must be "
                "recomputed from their children whenever a leaf below them changes.",
            )
        if not np.array_equal(node_min, want_min):
            j = int(np.flatnonzero(node_min != want_min)[0])
            raise InvariantError(
                "sum-tree node minima",
                f"{where} level {k} node {j} holds minimum "
                f"{node_min[j]!r}, its children's positive minimum is {want_min[j]!r}",
                "Minima must be recomputed with the sums.",
            )
        below_sum, below_min = node_sum.astype(np.float64), node_min
        offset += n
    total = float(sum_tree.total(tree))
    exact = float(leaves.astype(np.float64).sum())
    if abs(total - exact) > REL_TOL * abs(exact):
        raise InvariantError(
            "sum-tree total",
            f"{where} total is {total!r}, the float64 sum of its leaves is "
            f"{exact!r} (relative error {abs(total - exact) / max(exact, 1e-300):.2e} > "
            f"{REL_TOL})",
            "The total must be recomputed from the leaves, never accumulated "
            "from deltas (which drift).",
        )


# ------------------------------------------------------------------ samplers
def _unstored_priority(ctx, leaves, where: str):
    bad = np.flatnonzero(~ctx.stored & (np.asarray(leaves) != 0))
    if bad.size:
        i = int(bad[0])
        raise InvariantError(
            "priorities only on stored items",
            f"{where}[{i}] is {np.asarray(leaves)[i]!r} "
            f"but position {i} holds no item (filled={ctx.filled} per row)",
            "Only written "
            "positions may get a priority; an update of an empty position must be ignored.",
        )


def _check_prioritized(ctx, sp) -> None:
    leaves = np.asarray(sp.tree.values)[: sp.tree.capacity]
    _unstored_priority(ctx, leaves, "state.sampler.tree.leaves")
    _check_running_max(ctx, sp, leaves, "state.sampler.tree.leaves")


def _check_running_max(ctx, sp, values, where: str) -> None:
    """No stored value above the value of the running maximum priority (the value of a
    priority ``p`` is ``min((p + eps) ** alpha, finfo(float32).max / (2 C))``)."""
    sampler = ctx.rb.sampler
    maxp = np.float32(sp.max_priority)
    init = getattr(sampler, "max_priority_init", 0.0)
    if not (np.isfinite(maxp) and maxp >= np.float32(init)):
        raise InvariantError(
            "priorities at most the running maximum",
            f"state.sampler.max_priority is {maxp!r}"
            f", expected a finite value >= max_priority_init={init}",
            "The running maximum only ever grows from its initial value.",
        )
    alpha, eps = getattr(sampler, "alpha", None), getattr(sampler, "eps", None)
    if alpha is None or eps is None:
        return
    with np.errstate(over="ignore"):
        top = (maxp + np.float32(eps)) ** np.float32(alpha)
    top = min(top, np.float32(ref.F32_MAX / (2.0 * ctx.lay.capacity)))
    over = np.flatnonzero(ctx.stored & (np.asarray(values) > top * (1 + REL_TOL)))
    if over.size:
        i = int(over[0])
        raise InvariantError(
            "priorities at most the running maximum",
            f"{where}[{i}] = {values[i]!r} exceeds the value of max_priority={maxp!r}, {top!r}",
            "update must raise max_priority to every priority it accepts.",
        )


def _check_permutation(where: str, perm, n: int) -> None:
    perm = np.asarray(perm)
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
        raise InvariantError(
            "without-replacement epoch",
            f"{where} is not a permutation of range({n}): {perm.tolist()}",
            "Epochs permute positions; never write the permutation partially.",
        )


def _check_epoch(ctx, sp) -> None:
    n = ctx.lay.capacity
    _check_permutation("state.sampler.perm", sp.perm, n)
    pos, size = int(sp.pos), int(sp.epoch_size)
    stored = ctx.filled * ctx.lay.num_envs
    if not 0 <= pos <= size <= stored:
        raise InvariantError(
            "without-replacement epoch",
            f"pos={pos}, epoch_size={size} with {stored} items "
            f"stored; expected 0 <= pos <= epoch_size <= stored",
            "An epoch covers the items stored when it began (the number stored never shrinks).",
        )
    head = np.sort(np.asarray(sp.perm)[:size])
    if not np.array_equal(head, np.arange(size)):
        raise InvariantError(
            "without-replacement epoch",
            f"the first epoch_size={size} entries of "
            f"state.sampler.perm are not the ranks 0..{size - 1}: {head.tolist()}",
            "An epoch must draw each stored item exactly once.",
        )


def _record_ages(ss, e: int, filled: int, cap: int):
    """Per alive record of row ``e``: (age of its first stored step, of its last), ages
    counted back from the newest step (1), as the slice samplers document their records."""
    head, tail, total = int(ss.head[e]), int(ss.tail[e]), int(ss.total)
    rec = np.asarray(ss.rec_start)[e]
    out = []
    for k in range(head, tail):
        hi = min(total - int(rec[k % cap]), filled)
        lo = total - int(rec[(k + 1) % cap]) + 1 if k + 1 < tail else 1
        out.append((hi, lo))
    return out


def _check_slices(ctx, ss, path: str) -> None:
    lay, filled = ctx.lay, ctx.filled
    e_n, cap = lay.num_envs, lay.row_capacity
    head, tail, total = np.asarray(ss.head), np.asarray(ss.tail), int(ss.total)
    if np.asarray(ss.rec_start).shape != (e_n, cap) or head.shape != (e_n,):
        raise InvariantError(
            "slice counters",
            f"{path}.rec_start has shape {np.asarray(ss.rec_start).shape}, expected {(e_n, cap)}",
            "Build the state with the buffer's init.",
        )
    n_alive = tail - head
    if np.any(n_alive < 0) or np.any(n_alive > cap) or (total >= 0 and filled != min(total, cap)):
        raise InvariantError(
            "slice counters",
            f"{path}: head={head.tolist()}, tail={tail.tolist()}, total="
            f"{total}, writer filled={filled}; expected head <= tail <= head + {cap} and "
            f"filled == min(total, {cap})",
            "on_add must count every step it is given.",
        )
    if filled == 0:
        if np.any(n_alive != 0):
            raise InvariantError(
                "slice records tile the stored steps",
                f"{path} has {n_alive.tolist()} records but nothing is stored",
                "Records are created by on_add only.",
            )
        return
    sampler = ctx.rb.sampler
    by_ids = getattr(sampler, "traj_key", None) is not None
    key = sampler.traj_key if by_ids else sampler.end_key
    for e, (_, items) in enumerate(ctx.rows()):
        ages = _record_ages(ss, e, filled, cap)
        tiles = (
            bool(ages)
            and ages[0][0] == filled
            and ages[-1][1] == 1
            and all(hi >= lo for hi, lo in ages)
            and all(a[1] == b[0] + 1 for a, b in zip(ages, ages[1:]))
        )
        if not tiles:
            raise InvariantError(
                "slice records tile the stored steps",
                f"row {e}: the records of {path} span "
                f"ages {ages} (first, last stored step; 1 = newest) over {filled} stored steps",
                "Each stored step must belong to exactly one record: on_add must move `head` "
                "past records whose steps were all overwritten.",
            )
        signal = ref.step_signal(items, sampler.end_key, sampler.traj_key)
        lengths = ref.trajectories(signal, by_ids)
        want = list(filled - np.cumsum([0] + lengths[:-1]))
        got = [hi for hi, _ in ages]
        if got != [int(a) for a in want]:
            raise InvariantError(
                "slice records match the stored episode boundaries",
                f"row {e}: the stored "
                f"{'ids' if by_ids else 'end flags'} at {key} start trajectories at ages "
                f"{[int(a) for a in want]} (1 = newest step), the records in {path} start them "
                f"at {got}",
                f"{type(sampler).__name__}.on_add must start a record after each "
                "end flag (or id change) and only there.",
            )
        last = np.asarray(ss.last_id if by_ids else ss.last_done)[e]
        if (last != signal[-1]) if by_ids else (bool(last) != bool(signal[-1])):
            raise InvariantError(
                "slice records match the stored episode boundaries",
                f"row {e}: {path}."
                f"{'last_id' if by_ids else 'last_done'} is {last!r}, the newest stored step "
                f"has {signal[-1]!r}",
                "on_add must remember the newest step's signal.",
            )


def _check_prioritized_slices(ctx, sp) -> None:
    leaves = np.asarray(sp.tree.values)[: sp.tree.capacity]
    valid = np.asarray(sp.valid)
    _unstored_priority(ctx, leaves, "state.sampler.tree.leaves")
    _unstored_priority(ctx, valid, "state.sampler.valid")
    _check_running_max(ctx, sp, np.asarray(sp.prio), "state.sampler.prio")
    want_leaves = np.where(valid, np.asarray(sp.prio), np.float32(0))
    if not np.array_equal(leaves, want_leaves):
        i = int(np.flatnonzero(leaves != want_leaves)[0])
        raise InvariantError(
            "prioritized slice starts",
            f"state.sampler.tree.leaves[{i}] = {leaves[i]!r}, "
            f"expected {want_leaves[i]!r} (valid={bool(valid[i])}, prio={sp.prio[i]!r})",
            "The tree holds the priority of each valid start and 0 elsewhere.",
        )
    sampler = ctx.rb.sampler
    by_ids = getattr(sampler, "traj_key", None) is not None
    if ctx.filled == 0:
        return
    for e, (pos, items) in enumerate(ctx.rows()):
        signal = ref.step_signal(items, sampler.end_key, sampler.traj_key)
        rem, first = ref.remaining_steps(ref.trajectories(signal, by_ids))
        want = (rem >= sp.slice_len) | (first & (not sampler.strict_length))
        got = valid[pos]
        if not np.array_equal(got, want):
            j = int(np.flatnonzero(got != want)[0])
            raise InvariantError(
                "prioritized slice starts",
                f"row {e}: the step at position {int(pos[j])} "
                f"({filled_age(ctx, j)}) has {int(rem[j])} steps left in its trajectory, so "
                f"with slice_len={sp.slice_len} it is {'a' if want[j] else 'not a'} valid "
                f"start, but state.sampler.valid says {bool(got[j])}",
                "on_add must "
                "refresh the validity of the newest slice_len - 1 steps and of the oldest one.",
            )


def filled_age(ctx, j: int) -> str:
    return f"age {ctx.filled - j}, 1 = newest"


# ------------------------------------------------------------------ TED
def _check_ted(ctx, ts) -> None:
    lay, filled = ctx.lay, ctx.filled
    ptr, owner = np.asarray(ts.ptr), np.asarray(ts.owner)
    s_n, cap = owner.shape[0], lay.capacity
    head, lost = int(ts.head), int(ts.lost)
    if (
        ptr.min(initial=-1) < -1
        or ptr.max(initial=-1) >= s_n
        or owner.min(initial=-1) < -1
        or owner.max(initial=-1) >= cap
        or not 0 <= head < s_n
        or lost < 0
    ):
        raise InvariantError(
            "TED side table links",
            f"ptr in [{ptr.min()}, {ptr.max()}], owner in "
            f"[{owner.min()}, {owner.max()}], head={head}, lost={lost}; expected ptr in "
            f"[-1, {s_n}), owner in [-1, {cap}), 0 <= head < {s_n}, lost >= 0",
            "Side rows and slots are indexed within their tables.",
        )
    stored = ctx.stored
    if np.any(ptr[~stored] != -1):
        i = int(np.flatnonzero(ptr[~stored] != -1)[0])
        i = int(np.flatnonzero(~stored)[i])
        raise InvariantError(
            "TED side table links",
            f"slot {i} holds no step but state.storage.ptr[{i}] = {ptr[i]}",
            "Only stored steps own side rows.",
        )
    linked = np.flatnonzero(stored & (ptr >= 0))
    back = owner[ptr[linked]]
    if np.any(back != linked):
        j = int(np.flatnonzero(back != linked)[0])
        i = int(linked[j])
        raise InvariantError(
            "TED side table links",
            f"stored slot {i} points at side row {ptr[i]}, whose owner is slot {back[j]}",
            "A side row reused for another step must unlink the old one "
            "(and count it in `lost` if that step is still stored).",
        )
    if lost:
        raise InvariantError(
            "TED next observations not lost",
            f"state.storage.lost = {lost}: that many stored "
            "steps lost their final next observation, so samples are no longer exact",
            "Use TEDStorage(min_episode_len=...) no larger than the shortest episode, or a "
            "larger side_capacity (side_capacity=capacity is always exact).",
        )
    storage, k = ctx.rb.storage, ctx.rb.storage.frame_stack
    if filled == 0 or k == 1:  # the episode carry is kept for frame stacks only
        return
    dist = np.asarray(ts.dist)
    for e, (pos, items) in enumerate(ctx.rows()):
        end = np.zeros(filled, bool)
        for key in storage.end_keys:
            x = get_path(items, key)
            if x is not None:
                end |= np.asarray(x).reshape(filled, -1).astype(bool).any(axis=1)
        if bool(ts.carry_end[e]) != bool(end[-1]):
            raise InvariantError(
                "TED episode carry",
                f"row {e}: state.storage.carry_end is "
                f"{bool(ts.carry_end[e])}, the newest stored step has end flag {bool(end[-1])}",
                "set must carry the newest step's end flag to the next call.",
            )
        d = dist[pos]
        want = np.where(end[:-1], 0, np.minimum(d[:-1] + 1, k - 1))
        if np.any(d < 0) or np.any(d > k - 1) or not np.array_equal(d[1:], want):
            raise InvariantError(
                "TED frame-stack distances",
                f"row {e}: steps since the episode start are "
                f"{d.tolist()} (oldest first) for end flags {end.astype(int).tolist()}",
                "dist counts steps since the last end flag, capped at frame_stack - 1.",
            )
        if int(ts.carry_dist[e]) != int(d[-1]):
            raise InvariantError(
                "TED episode carry",
                f"row {e}: carry_dist={int(ts.carry_dist[e])}, newest step's dist={int(d[-1])}",
                "set must carry the newest step's distance.",
            )
