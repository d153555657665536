"""A fast, exact, jittable sum tree (with a min tree alongside) for prioritized sampling.

Pure functions over a :class:`SumTreeState` PyTree::

    init(capacity)                           -> SumTreeState      # all leaves 0
    set(tree, indices int32[N], values f32[N], unique=False) -> SumTreeState  # last duplicate wins
    get(tree, indices int32[...])            -> float32[...]
    total(tree)                              -> float32[]         # sum of all leaves
    min(tree)                                -> float32[]         # min over leaves > 0 (inf if none)
    find(tree, targets float32[N])           -> int32[N]          # inverse CDF
    sample(tree, key, n, stratified=False)   -> int32[n]
    sample_with_values(tree, key, n, stratified=False) -> (int32[n], float32[n])

Structure: a *wide* tree. Level 0 holds the leaves, level ``k + 1`` holds the sums of blocks of
``fanout`` consecutive nodes of level ``k`` (each level is padded with zeros to a multiple of
``fanout``); the top level is a single block whose sum is the total. With ``fanout=32`` a
tree over 10^6 leaves has 4 levels, so ``set`` and ``find`` are 4 small ``[N, fanout]`` gathers
each instead of the 20 dependent steps of a binary tree, which is what makes them fast on CPU
(see ``benchmarks/w2_prioritized.py`` for the measurements behind the default).

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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from functional_rb._random import uniform01

DEFAULT_FANOUT = 16
# Above this batch size duplicate resolution uses a sort instead of an [N, N] comparison.
_DEDUP_QUADRATIC_MAX = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SumTreeState:
    """A sum tree over ``capacity`` float32 leaves.

    sums: tuple of float32 arrays; ``sums[0]`` are the leaves ``[n_0]`` (``n_0`` = capacity
      rounded up to a multiple of ``fanout``, padding is 0), ``sums[k+1][j]`` is the sum of block
      ``j`` of ``sums[k]``, i.e. ``sums[k][j*fanout:(j+1)*fanout].sum()``. The last level has
      exactly ``fanout`` entries.
    mins: tuple of float32 arrays, ``mins[k]`` aligned with ``sums[k+1]``: the minimum over the
      positive leaves below that node (``inf`` if none); the last one, ``[1]``, is the minimum
      over all positive leaves.
    capacity, fanout: static.
    """

    sums: tuple
    mins: tuple
    capacity: int = dataclasses.field(metadata=dict(static=True))
    fanout: int = dataclasses.field(metadata=dict(static=True))

    @property
    def leaves(self) -> jax.Array:
        """float32 [capacity]: the leaf values."""
        return self.sums[0][: self.capacity]


def _level_sizes(capacity: int, fanout: int) -> list[int]:
    sizes = [math.ceil(capacity / fanout) * fanout]
    while sizes[-1] > fanout:
        sizes.append(math.ceil(sizes[-1] // fanout / fanout) * fanout)
    return sizes


def init(capacity: int, fanout: int = DEFAULT_FANOUT) -> SumTreeState:
    """A tree over ``capacity`` leaves, all 0. ``fanout`` (>= 2) is the children per node."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"sum_tree.init: capacity must be a Python int >= 1, got {capacity!r}.")
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 2:
        raise ValueError(f"sum_tree.init: fanout must be a Python int >= 2, got {fanout!r}.")
    sizes = _level_sizes(capacity, fanout)
    sums = tuple(jnp.zeros((n,), jnp.float32) for n in sizes)
    # mins[k] is aligned with sums[k + 1]; the last entry ([1]) is the overall minimum.
    mins = tuple(jnp.full((n,), jnp.inf, jnp.float32) for n in sizes[1:] + [1])
    return SumTreeState(sums=sums, mins=mins, capacity=capacity, fanout=fanout)


def _last_occurrence(indices: jax.Array) -> jax.Array:
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


def _block_min(block: jax.Array, from_leaves: bool) -> jax.Array:
    if from_leaves:
        block = jnp.where(block > 0, block, jnp.inf)
    return jnp.min(block, axis=-1)


@functools.partial(jax.jit, static_argnames=("unique",))
def set(tree: SumTreeState, indices: jax.Array, values: jax.Array,  # noqa: A001
        unique: bool = False) -> SumTreeState:
    """Set ``leaves[indices] = values``. indices int32 ``[N]``, values float32 ``[N]``.

    Duplicates: the last occurrence wins, deterministically. ``unique=True`` promises that the
    in-range indices are distinct (a writer's positions) and skips resolving duplicates (an
    ``[N, N]`` comparison; a fifth of a 256-leaf ``set`` at 10^6 leaves on CPU); a broken
    promise leaves the result backend-dependent. Indices outside ``[0, capacity)`` are
    ignored (any number of them). Values must be finite and >= 0 (not checked here).
    In place when ``tree`` is donated.
    """
    indices = jnp.asarray(indices, jnp.int32).reshape(-1)
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    if values.shape != indices.shape:
        raise ValueError(f"sum_tree.set: values have shape {values.shape}, expected the shape "
                         f"of indices {indices.shape}.")
    f = tree.fanout
    n0 = tree.sums[0].shape[0]
    valid = (indices >= 0) & (indices < tree.capacity)
    if not unique:
        valid = valid & _last_occurrence(indices)
    # Losing duplicates and ignored indices go to an out-of-range slot and are dropped, so the
    # scatter sees unique indices and its result cannot depend on the backend's write order.
    leaf_idx = jnp.where(valid, indices, n0 + jnp.arange(indices.shape[0], dtype=jnp.int32))
    sums0 = tree.sums[0].at[leaf_idx].set(values, mode="drop", unique_indices=True)
    if indices.shape[0] * f >= n0 and len(tree.sums) > 1:
        return _rebuild_full(sums0, tree)
    # Parents of ignored indices are recomputed too (clipped into range): recomputing a node
    # from its children is idempotent, so that is harmless and keeps shapes static.
    node = jnp.clip(indices, 0, tree.capacity - 1)
    sums = [sums0]
    mins = []
    for k in range(1, len(tree.sums)):
        node = node // f
        block = sums[k - 1].reshape(-1, f)[node]                     # [N, f]
        sums.append(tree.sums[k].at[node].set(jnp.sum(block, axis=1)))
        mblock = block if k == 1 else mins[k - 2].reshape(-1, f)[node]
        mins.append(tree.mins[k - 1].at[node].set(_block_min(mblock, k == 1)))
    top_from = sums[-1] if len(tree.sums) == 1 else mins[-1]
    mins.append(_block_min(top_from.reshape(1, -1), len(tree.sums) == 1))
    return SumTreeState(sums=tuple(sums), mins=tuple(mins), capacity=tree.capacity, fanout=f)


def _rebuild_full(sums0: jax.Array, tree: SumTreeState) -> SumTreeState:
    f = tree.fanout
    sums = [sums0]
    mins = []
    for k in range(1, len(tree.sums)):
        blocks = sums[k - 1].reshape(-1, f)
        pad = tree.sums[k].shape[0] - blocks.shape[0]
        sums.append(jnp.pad(jnp.sum(blocks, axis=1), (0, pad)))
        mblocks = blocks if k == 1 else mins[k - 2].reshape(-1, f)
        mins.append(jnp.pad(_block_min(mblocks, k == 1), (0, pad), constant_values=jnp.inf))
    mins.append(_block_min(mins[-1].reshape(1, -1), False))
    return SumTreeState(sums=tuple(sums), mins=tuple(mins), capacity=tree.capacity, fanout=f)


@jax.jit
def get(tree: SumTreeState, indices: jax.Array) -> jax.Array:
    """float32 ``[...]``: the leaf values at int32 ``indices`` (any shape)."""
    return tree.sums[0][jnp.asarray(indices, jnp.int32)]


@jax.jit
def total(tree: SumTreeState) -> jax.Array:
    """float32 []: the sum of all leaves (recomputed from the top block)."""
    return jnp.sum(tree.sums[-1])


@jax.jit
def min(tree: SumTreeState) -> jax.Array:  # noqa: A001
    """float32 []: the smallest positive leaf (``inf`` when no leaf is positive)."""
    return tree.mins[-1][0]


@jax.jit
def find(tree: SumTreeState, targets: jax.Array) -> jax.Array:
    """int32 ``[N]``: for each target, the smallest ``i`` with ``cumsum(leaves)[i] > target``.

    Targets are clipped to ``[0, total)``; the result is never a zero-valued leaf (unless all
    leaves are 0, then it is 0) and never ``>= capacity``.
    """
    return _find(tree, targets)[0]


def _find(tree: SumTreeState, targets: jax.Array):
    """``find`` that also returns the found leaves' values (float32, same shape), read from the
    same gather: a later in-place ``set`` of the leaves then depends on this read through the
    data, so XLA needs no defensive copy of the leaves inside a fused step."""
    targets = jnp.asarray(targets, jnp.float32)
    shape = targets.shape
    t = jnp.maximum(targets.reshape(-1), 0.0)
    f = tree.fanout
    n = t.shape[0]
    node = jnp.zeros((n,), jnp.int32)
    ar = jnp.arange(f, dtype=jnp.int32)
    # In-block inclusive prefix sums as a [N, f] @ [f, f] product: on CPU this is several times
    # faster than jnp.cumsum (a reduce-window) and it is monotone in k (same terms, same order).
    upper = (ar[:, None] <= ar[None, :]).astype(jnp.float32)
    for level in reversed(tree.sums):
        block = level.reshape(-1, f)[node]                           # [N, f]
        cs = jnp.dot(block, upper, precision=jax.lax.Precision.HIGHEST)
        # Keep t strictly below the block's total so that rounding (the parent's stored sum
        # and this cumsum may differ by an ulp) can never step past the last positive child.
        t = jnp.minimum(t, jnp.nextafter(cs[:, -1], 0.0))
        below = cs <= t[:, None]
        # smallest child with cs > t: its cs jumps there, so its value is positive.
        child = jnp.minimum(jnp.sum(below.astype(jnp.int32), axis=1), f - 1)
        t = t - jnp.max(jnp.where(below, cs, 0.0), axis=1)       # cs is nondecreasing
        node = node * f + child
    value = jnp.sum(jnp.where(ar[None, :] == child[:, None], block, 0.0), axis=1)
    ok = jnp.sum(tree.sums[-1]) > 0
    node = jnp.where(ok, jnp.minimum(node, tree.capacity - 1), 0)
    value = jnp.where(ok, value, 0.0)
    return node.reshape(shape), value.reshape(shape)


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
    return _find(tree, u * jnp.sum(tree.sums[-1]))
