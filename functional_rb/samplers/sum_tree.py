"""A fast, exact, jittable sum tree (with a min tree alongside) for prioritized sampling.

Pure functions over a :class:`SumTreeState` PyTree::

    init(capacity)                           -> SumTreeState      # all leaves 0
    set(tree, indices int32[N], values f32[N], unique=False) -> SumTreeState  # last duplicate wins
    set_run(tree, start int32[], values f32[N], mask=None) -> SumTreeState # slots start, start+1, ...
    get(tree, indices int32[...])            -> float32[...]
    total(tree)                              -> float32[]         # sum of all leaves
    min(tree)                                -> float32[]         # min over leaves > 0 (inf if none)
    find(tree, targets float32[N])           -> int32[N]          # inverse CDF
    sample(tree, key, n, stratified=False)   -> int32[n]
    sample_with_values(tree, key, n, stratified=False) -> (int32[n], float32[n])
    sample_with_stats(tree, key, n, stratified=False)  -> (int32[n], float32[n], total, min)
    last_occurrence(indices int32[N])        -> bool[N]           # not repeated later in the batch
    rebuild(tree)                            -> SumTreeState      # every node from the leaves

Structure: a *wide* tree stored in three arrays (see :class:`SumTreeState`). The leaves
are level 0; level ``k + 1`` holds the sums (and, alongside, the minima over positive leaves)
of blocks of ``fanout`` consecutive nodes of level ``k``, each level padded with zeros to a
multiple of ``fanout``; the last level is a single block whose sum is the total. With the
default ``fanout=16`` a tree over 10^6 leaves has 5 levels, so ``set`` and ``find`` are 5
small ``[N, fanout]`` gathers each instead of the 20 dependent steps of a binary tree, which
is what makes them fast on CPU. The internal levels share two arrays at static offsets (the
large lower levels in ``nodes``, the small upper ones in ``top``), sums and minima as the two
halves of each, so a buffer state carries three tree buffers whatever the depth: fewer
buffers is less per-call dispatch time (see ``benchmarks/w2_prioritized.py``).
``sample_with_stats`` returns the total and the minimum read during the search itself, so a
fused add/sample/update step does not need a second pass (or a copy) of the tree.

Exactness: ``set`` recomputes every touched internal node from its children (a sum over a
``[fanout]`` block), never by adding deltas, so the total cannot drift however many updates
are made: it is always a float32 pairwise-style sum of the current leaves. Recomputing is also
idempotent, which is why duplicate parents within one batch need no special care; duplicate
*leaves* are resolved before the scatter (the last occurrence wins) so the result is the same
on every backend.

Values must be finite and >= 0 when they reach ``set`` (callers sanitize). Indices outside
``[0, capacity)`` given to ``set`` are ignored (this is how callers mask entries out).
The functions are ``jax.jit``-wrapped so that eager calls are one dispatch each; inside a
caller's ``jit``/``scan`` they inline (donate the caller's state for in-place updates).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from functional_rb._internal import hugepages
from functional_rb._internal.errors import config_int
from functional_rb._internal.jit import read_whole
from functional_rb._internal.random import uniform01
from functional_rb.samplers.sum_tree_state import (
    EMPTY_ROW,
    SumTreeState,
    level_sizes,
    offsets,
    rows_of,
    split,
)

DEFAULT_FANOUT = 16
# ``last_occurrence`` (for callers that dedupe their own arrays, and for ``set`` batches too
# large for its scratch encoding) sorts above this size instead of comparing all pairs.
_DEDUP_QUADRATIC_MAX = 512
# Batch positions are encoded as float32 in ``set``'s duplicate resolution: exact below 2**24.
_DEDUP_SCRATCH_MAX = 1 << 24


def init(capacity: int, fanout: int = DEFAULT_FANOUT) -> SumTreeState:
    """A tree over ``capacity`` leaves, all 0. ``fanout`` (>= 2) is the children per node."""
    config_int("sum_tree.init", "capacity", capacity)
    config_int("sum_tree.init", "fanout", fanout, minimum=2)
    sizes = level_sizes(capacity, fanout)
    inner = sum(sizes[1:])
    cut = split(capacity, fanout)
    # large trees on huge pages on the CPU: a descent is a chain of dependent random loads
    return SumTreeState(
        values=hugepages.zeros((sizes[0],), jnp.float32),
        nodes=hugepages.full((2, cut, fanout), EMPTY_ROW, jnp.float32),
        top=jnp.full((2, inner // fanout - cut, fanout), EMPTY_ROW, jnp.float32),
        capacity=capacity,
        fanout=fanout,
    )


def last_occurrence(indices: jax.Array) -> jax.Array:
    """bool [N]: True where ``indices[i]`` does not occur again later in the batch."""
    n = indices.shape[0]
    if n <= 1:
        return jnp.ones((n,), bool)
    if n <= _DEDUP_QUADRATIC_MAX:
        ar = jnp.arange(n, dtype=jnp.int32)
        later_same = (indices[:, None] == indices[None, :]) & (ar[None, :] > ar[:, None])
        return ~jnp.any(later_same, axis=1)
    order = jnp.argsort(indices, stable=True)
    s = indices[order]
    last_in_run = jnp.concatenate([s[1:] != s[:-1], jnp.ones((1,), bool)])
    return jnp.zeros((n,), bool).at[order].set(last_in_run, unique_indices=True)


def _fold(block: jax.Array, op) -> jax.Array:
    """Reduce the last axis with ``op`` by halving it (pairwise; any length).

    Elementwise ops on static slices rather than an XLA reduce: on CPU a float reduce over a
    small axis becomes a call into a kernel library (a few us each, two per level of a
    ``set``), while the halving compiles to one plain loop fusion. The association order is
    fixed, so ``set`` and a full rebuild store bit-identical sums.
    """
    while block.shape[-1] > 1:
        n = block.shape[-1]
        h = n // 2
        head = op(block[..., :h], block[..., h : 2 * h])
        block = jnp.concatenate([head, block[..., 2 * h :]], axis=-1) if n % 2 else head
    return block[..., 0]


def _sum_and_min(a: jax.Array, b: jax.Array) -> jax.Array:
    """``_fold``'s op over rows ``[2, M, h]``: sums in the first half, minima in the second.
    ``set``, ``set_run`` and ``rebuild`` all fold with it, so they store bit-identical nodes."""
    is_sum = (jnp.arange(2) == 0)[:, None, None]
    return jnp.where(is_sum, a + b, jnp.minimum(a, b))


def _leaf_rows(block: jax.Array) -> jax.Array:
    """Blocks of leaves ``[M, f]`` as rows ``[2, M, f]``: the values, and the same with
    non-positive ones as ``inf`` (the minimum is over positive leaves)."""
    return jnp.stack([block, jnp.where(block > 0, block, jnp.inf)])


def _level_rows(both: jax.Array, size: int, f: int) -> jax.Array:
    """A level's ``[2, n]`` sums and minima, padded to ``size`` nodes (sums 0, minima
    ``inf``), as rows ``[2, size / f, f]``."""
    pad = size - both.shape[1]
    new_sum = jnp.pad(both[0], (0, pad))
    new_min = jnp.pad(both[1], (0, pad), constant_values=jnp.inf)
    return jnp.stack([new_sum.reshape(-1, f), new_min.reshape(-1, f)])


@functools.partial(jax.jit, static_argnames=("unique",))
def set(
    tree: SumTreeState,
    indices: jax.Array,
    values: jax.Array,  # noqa: A001
    unique: bool = False,
) -> SumTreeState:
    """Set ``leaves[indices] = values``. indices int32 ``[N]``, values float32 ``[N]``.

    Duplicates: the last occurrence wins, deterministically. ``unique=True`` promises that the
    in-range indices are distinct (a writer's positions) and skips resolving duplicates (one
    more scatter and gather over the targeted leaves); a broken promise leaves the result
    backend-dependent. Indices outside ``[0, capacity)`` are ignored (any number of them).
    Values must be finite and >= 0 (not checked here). In place when ``tree`` is donated.
    """
    indices = jnp.asarray(indices, jnp.int32).reshape(-1)
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    if values.shape != indices.shape:
        raise ValueError(
            f"sum_tree.set: values have shape {values.shape}, expected the shape "
            f"of indices {indices.shape}."
        )
    f = tree.fanout
    sizes = level_sizes(tree.capacity, f)
    offs = offsets(tree.capacity, f)
    n0 = sizes[0]
    valid = (indices >= 0) & (indices < tree.capacity)
    n = indices.shape[0]
    # Losing duplicates and ignored indices go to an out-of-range slot and are dropped, so the
    # final scatter sees unique indices and its result cannot depend on the write order.
    pos = jnp.arange(n, dtype=jnp.int32)
    oob = n0 + pos
    leaves = tree.values
    if not unique and n >= _DEDUP_SCRATCH_MAX:
        valid = valid & last_occurrence(indices)
    elif not unique and n > 1:
        # The batch's own leaf slots serve as scratch, since each is about to be overwritten:
        # a scatter-min of -(position + 1) (leaves are >= 0, so a negative always wins) leaves
        # -(last position + 1) in every targeted slot. min is commutative, so the result does
        # not depend on the backend's write order; this is O(N) where comparing all pairs is
        # O(N^2) (about a third of a 256-index update at 10^6 leaves on CPU).
        leaves = leaves.at[jnp.where(valid, indices, oob)].min(
            -(pos + 1).astype(jnp.float32), mode="drop"
        )
        mine = _read(leaves, lambda x: x[jnp.clip(indices, 0, n0 - 1)], indices)
        winner = -mine.astype(jnp.int32) - 1
        valid = valid & (winner == pos)
    leaf_idx = jnp.where(valid, indices, oob)
    leaves = leaves.at[leaf_idx].set(values, mode="drop", unique_indices=True)
    if n * f >= n0 and len(sizes) > 1:
        return _rebuild_full(leaves, tree.capacity, f)
    # Parents of ignored indices are recomputed too (clipped into range): recomputing a node
    # from its children is idempotent, so that is harmless and keeps shapes static.
    node = jnp.clip(indices, 0, tree.capacity - 1)
    arrays = [tree.nodes, tree.top]
    cut = split(tree.capacity, f)
    for k in range(1, len(sizes)):
        node = node // f  # level-k node
        if k > 1 and sizes[k] <= n:
            # A level with no more nodes than the batch has indices (the top levels) is
            # recomputed whole: contiguous reads of its children and one slice write, where
            # per-index rows would read as much, scattered, and then scatter.
            src, lo = rows_of(k - 1, offs, f, cut)
            rows = arrays[src][:, lo : lo + sizes[k - 1] // f]
            new = _level_rows(_fold(rows, _sum_and_min), sizes[k], f)
            dst, at = rows_of(k, offs, f, cut)
            arrays[dst] = arrays[dst].at[:, at : at + sizes[k] // f].set(new)
            continue
        arrays = _recompute(leaves, arrays, k, node, offs, f, cut)
    return SumTreeState(
        values=leaves, nodes=arrays[0], top=arrays[1], capacity=tree.capacity, fanout=f
    )


def _read(x: jax.Array, read, node: jax.Array) -> jax.Array:
    """``read(x)``, a few rows of a level at ``node``, read by one thread on the CPU
    (:func:`~functional_rb._internal.jit.read_whole`)."""
    return read_whole(lambda: read(x), x, node)


def _recompute(leaves, arrays: list, k: int, node: jax.Array, offs: tuple, f: int, cut: int):
    """``[nodes, top]`` with level-``k`` nodes ``node`` (int32 ``[M]``, level-``k`` indices)
    recomputed from their children (each a ``[f]`` block of level ``k - 1``): one gather of
    the children's rows and one scatter of each node's sum and minimum."""
    if k == 1:
        rows = _leaf_rows(_read(leaves.reshape(-1, f), lambda x: x[node], node))  # [2, M, f]
    else:
        src, lo = rows_of(k - 1, offs, f, cut)
        rows = _read(arrays[src], lambda x: x[:, lo + node], node)  # [2, M, f]
    new = _fold(rows, _sum_and_min)  # [2, M]: one kernel for both halves
    dst, at = rows_of(k, offs, f, cut)
    half = jnp.arange(2, dtype=jnp.int32)[:, None]
    out = list(arrays)
    out[dst] = arrays[dst].at[half, (at + node // f)[None, :], (node % f)[None, :]].set(new)
    return out


@jax.jit
def set_run(
    tree: SumTreeState, start: jax.Array, values: jax.Array, mask: jax.Array | None = None
) -> SumTreeState:
    """Set ``leaves[(start + i) % capacity] = values[i]`` where ``mask[i]`` (default all).

    start: int32 ``[]`` (taken modulo ``capacity``); values float32 ``[N]``; mask bool ``[N]``.
    The same tree as ``set`` with those positions, for the common case of a ring writer's
    slots: the touched nodes of level ``k`` form at most two runs (the second after a
    wrap-around), so each level recomputes ``ceil(N / fanout**k) + 2`` nodes found by
    arithmetic, not one node per item (a 256-slot add at 10^6 leaves: ~5x cheaper on CPU).
    As with ``set``, a slot written twice (``N > capacity``) keeps its last unmasked value.
    Values must be finite and >= 0 (not checked here). In place when ``tree`` is donated.
    """
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    n = values.shape[0]
    mask = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask, bool).reshape(-1)
    if mask.shape != values.shape:
        raise ValueError(
            f"sum_tree.set_run: mask has shape {mask.shape}, expected the shape "
            f"of values {values.shape}."
        )
    f, cap = tree.fanout, tree.capacity
    sizes = level_sizes(cap, f)
    offs = offsets(cap, f)
    ar = jnp.arange(n, dtype=jnp.int32)
    start = jnp.asarray(start, jnp.int32) % jnp.int32(cap)
    pos = (start + ar) % jnp.int32(cap)
    if n > cap:  # the run laps the ring: slots repeat, so the last unmasked entry must win
        return set(tree, jnp.where(mask, pos, -1), values)
    leaves = tree.values.at[jnp.where(mask, pos, sizes[0] + ar)].set(
        values, mode="drop", unique_indices=True
    )
    if n * f >= sizes[0] and len(sizes) > 1:
        return _rebuild_full(leaves, cap, f)
    arrays = [tree.nodes, tree.top]
    cut = split(cap, f)
    span = f  # leaves under one level-k node
    for k in range(1, len(sizes)):
        last = (cap - 1) // span  # the last level-k node over real leaves
        m = -(-n // span) + 2  # (``min`` is this module's)
        m = last + 1 if m > last + 1 else m
        first = start // span
        node = first + jnp.arange(m, dtype=jnp.int32)
        # the run of nodes from ``first`` on, wrapping after ``last`` to node 0; nodes it
        # covers beyond the touched ones are recomputed unchanged (recomputing is idempotent)
        node = jnp.where(node <= last, node, node - (last + 1))
        arrays = _recompute(leaves, arrays, k, node, offs, f, cut)
        span *= f
    return SumTreeState(values=leaves, nodes=arrays[0], top=arrays[1], capacity=cap, fanout=f)


def _rebuild_full(leaves: jax.Array, capacity: int, f: int) -> SumTreeState:
    sizes = level_sizes(capacity, f)
    rows = _leaf_rows(leaves.reshape(-1, f))
    levels = []
    for k in range(1, len(sizes)):
        rows = _level_rows(_fold(rows, _sum_and_min), sizes[k], f)
        levels.append(rows)
    rows = jnp.concatenate(levels, axis=1) if levels else jnp.zeros((2, 0, f), jnp.float32)
    cut = split(capacity, f)
    return SumTreeState(
        values=leaves, nodes=rows[:, :cut], top=rows[:, cut:], capacity=capacity, fanout=f
    )


@jax.jit
def rebuild(tree: SumTreeState) -> SumTreeState:
    """The tree with every internal node recomputed from its leaves: bit-identical to ``tree``
    whenever ``tree`` was built by this module's functions (a consistency check)."""
    return _rebuild_full(tree.values, tree.capacity, tree.fanout)


def _top(tree: SumTreeState):
    """``(sums, mins)`` of the top block, float32 ``[fanout]`` each (static slices)."""
    if tree.top.shape[1] == 0:
        return tree.values, jnp.where(tree.values > 0, tree.values, jnp.inf)
    return tree.top[0, -1], tree.top[1, -1]


@jax.jit
def get(tree: SumTreeState, indices: jax.Array) -> jax.Array:
    """float32 ``[...]``: the leaf values at int32 ``indices`` (any shape)."""
    return tree.values[jnp.asarray(indices, jnp.int32)]


@jax.jit
def total(tree: SumTreeState) -> jax.Array:
    """float32 []: the sum of all leaves (recomputed from the top block)."""
    return jnp.sum(_top(tree)[0])


@jax.jit
def min(tree: SumTreeState) -> jax.Array:  # noqa: A001
    """float32 []: the smallest positive leaf (``inf`` when no leaf is positive)."""
    return jnp.min(_top(tree)[1])


@jax.jit
def find(tree: SumTreeState, targets: jax.Array) -> jax.Array:
    """int32 ``[N]``: for each target, the smallest ``i`` with ``cumsum(leaves)[i] > target``.

    Targets are clipped to ``[0, total)``; the result is never a zero-valued leaf (unless all
    leaves are 0, then it is 0) and never ``>= capacity``.
    """
    return _find(tree, targets=targets)[0]


def _find(tree: SumTreeState, targets=None, fractions=None):
    """``find`` of ``targets``, or of ``fractions * total`` (float32 in ``[0, 1)``), returning
    ``(nodes, values, total, min)``: the found leaves' values from the search's own gather and
    the tree's total and minimum.

    The leaves' values come from the search's last gather, so a later in-place ``set`` of the
    leaves depends on that read through the data and XLA needs no defensive copy of the
    leaves inside a fused step. The top-level reads (total, min) are tiny.
    """
    f = tree.fanout
    top_sums, top_mins = _top(tree)
    tot = jnp.sum(top_sums)
    vmin = jnp.min(top_mins)
    t = targets if fractions is None else jnp.asarray(fractions, jnp.float32) * tot
    t = jnp.asarray(t, jnp.float32)
    shape = t.shape
    t = t.reshape(-1)
    n = t.shape[0]
    # t clipped to [0, total) (the top level below clips it to its block's total again), as a
    # reduce: XLA stores a reduce's result rather than fusing it into its consumers. Fused, the
    # random draws were recomputed in each of the f comparisons of a row at the top level, in a
    # kernel costly enough that XLA's CPU backend split it across threads (~7% of a step
    # inside a scan at 10^6 items, measured).
    bound = jnp.nextafter(tot, 0.0)
    t = jnp.min(jnp.stack([jnp.maximum(t, 0.0), jnp.broadcast_to(bound, (n,))], axis=1), axis=1)
    node = jnp.zeros((n,), jnp.int32)
    ar = jnp.arange(f, dtype=jnp.int32)
    # In-block inclusive prefix sums as a [N, f] @ [f, f] product: on CPU this is several times
    # faster than jnp.cumsum (a reduce-window) and it is monotone in k (same terms, same order).
    upper = (ar[:, None] <= ar[None, :]).astype(jnp.float32)
    offs = offsets(tree.capacity, f)
    for k in reversed(range(len(offs))):
        if k == len(offs) - 1:
            block = jnp.broadcast_to(top_sums, (n, f))  # the top: one block
        elif k == 0:
            block = _read(tree.values.reshape(-1, f), lambda x, i=node: x[i], node)  # [N, f]
        else:
            src, lo = rows_of(k, offs, f, split(tree.capacity, f))
            # the sums, the first half of the array's [2 R, f] view
            sums = (tree.nodes, tree.top)[src].reshape(-1, f)
            block = _read(sums, lambda x, i=lo + node: x[i], node)  # [N, f]
        cs = jnp.dot(block, upper, precision=jax.lax.Precision.HIGHEST)
        # Keep t strictly below the block's total so that rounding (the parent's stored sum
        # and this cumsum may differ by an ulp) can never step past the last positive child.
        t = jnp.minimum(t, jnp.nextafter(cs[:, -1], 0.0))
        below = cs <= t[:, None]
        # smallest child with cs > t: its cs jumps there, so its value is positive.
        child = jnp.minimum(jnp.sum(below.astype(jnp.int32), axis=1), f - 1)
        # t minus the mass of the children before ``child``, taken by an [N] gather (cheaper
        # on CPU than a masked max-reduce over [N, f]). Gathering the difference, rather than
        # subtracting a gathered value, makes each level's t a stored array: otherwise XLA
        # fuses the whole chain of earlier levels (and the random draws) into every consumer
        # and recomputes it per element of the [N, f] comparisons.
        excl = jnp.pad(cs[:, :-1], ((0, 0), (1, 0)))  # exclusive prefix sums
        t = jnp.take_along_axis(t[:, None] - excl, child[:, None], axis=1)[:, 0]
        node = node * f + child
    value = jnp.take_along_axis(block, child[:, None], axis=1)[:, 0]
    # (vmin > 0 always holds when tot > 0; it makes the indices depend on the read of the
    # mins, so that a later in-place set of the tree needs no defensive copy of them)
    ok = (tot > 0) & (vmin > 0)
    node = jnp.where(ok, jnp.minimum(node, tree.capacity - 1), 0)
    value = jnp.where(ok, value, 0.0)
    return node.reshape(shape), value.reshape(shape), tot, vmin


@functools.partial(jax.jit, static_argnames=("n", "stratified"))
def sample(tree: SumTreeState, key: jax.Array, n: int, stratified: bool = False) -> jax.Array:
    """int32 ``[n]``: leaves drawn proportionally to their values (with replacement).

    ``stratified=True`` draws one target in each of ``n`` equal slices of ``[0, total)``
    (lower variance; the marginal of each draw is no longer the leaf distribution, the batch
    as a whole is). When every leaf is 0 the result is all 0 (callers mask it).
    """
    return sample_with_values(tree, key, n, stratified)[0]


@functools.partial(jax.jit, static_argnames=("n", "stratified"))
def sample_with_values(tree: SumTreeState, key: jax.Array, n: int, stratified: bool = False):
    """``sample`` that also returns the drawn leaves' values: ``(int32 [n], float32 [n])``.

    Prefer it to ``sample`` followed by ``get``: the values come from the search's own read.
    """
    u = uniform01(key, (n,))
    if stratified:
        u = (jnp.arange(n, dtype=jnp.float32) + u) / jnp.float32(n)
    return _find(tree, fractions=u)[:2]


@functools.partial(jax.jit, static_argnames=("n", "stratified"))
def sample_with_stats(tree: SumTreeState, key: jax.Array, n: int, stratified: bool = False):
    """``sample_with_values`` that also returns the tree's total and its minimum positive leaf:
    ``(int32 [n], float32 [n], float32 [], float32 [])`` (what importance weights need)."""
    u = uniform01(key, (n,))
    if stratified:
        u = (jnp.arange(n, dtype=jnp.float32) + u) / jnp.float32(n)
    return _find(tree, fractions=u)
