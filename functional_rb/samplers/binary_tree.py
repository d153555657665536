"""An exact sum tree in the binary, root-first layout of dopamine and flashbax.

The same functions as :mod:`functional_rb.samplers.sum_tree` (``init``, ``set``, ``get``,
``total``, ``min``, ``find``, ``sample_with_stats``) over another layout: one float32 array
``nodes`` of ``2 ** (depth + 1) - 1`` entries, level by level from the root
(``nodes[2 ** level - 1 + i]`` is node ``i`` of ``level``; the leaves are the last
``2 ** depth``). It is the layout flashbax keeps in its prioritised buffers' states
(``SumTreeState.nodes``), so a state written by flashbax holds such a tree and
``functional_rb.flashbax`` keeps it as it is.

Exactness, as in the wide tree: ``set`` writes the leaves and then recomputes every touched
parent from its two children, level by level, never by adding a delta, so the root is always
the float32 sum of the current leaves in a fixed order and cannot drift (flashbax's own tree
adds deltas and does). ``find`` never returns a leaf of value 0 unless every leaf is 0.

The wide tree is faster on CPU (16 children per node: a quarter of the levels). Use this one
where the layout itself is the contract, for flashbax's states and checkpoints.

>>> tree = set(init(5), jnp.array([0, 4]), jnp.array([1.0, 3.0]))
>>> float(total(tree)), tree.nodes.shape, int(find(tree, jnp.array([2.5]))[0])
(4.0, (15,), 4)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import config_int
from functional_rb._internal.names import stable
from functional_rb._internal.random import uniform01

# the CPU's per-index loop up to this many indices a set (it grows linearly, the per-level
# path slowly: measured at 2**17 leaves, 44 vs 33 us at 512 indices, 8 vs 43 us at 8)
_EACH_MAX = 256

__all__ = (
    "BinaryTreeState",
    "depth_of",
    "find",
    "get",
    "init",
    "min",
    "sample_with_stats",
    "set",
    "total",
)


@stable("BinaryTreeState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BinaryTreeState:
    """A binary sum tree over ``capacity`` float32 leaves.

    nodes: float32 ``[2 ** (depth + 1) - 1]``: the root first, then each level left to right;
      the leaves are the last ``2 ** depth`` entries (those past ``capacity`` stay 0).
    capacity, depth: static; ``depth = ceil(log2(capacity))``.
    """

    nodes: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    depth: int = dataclasses.field(metadata=dict(static=True))

    @property
    def leaves(self) -> jax.Array:
        """float32 ``[capacity]``: the leaf values."""
        first = 2**self.depth - 1
        return self.nodes[first : first + self.capacity]


def depth_of(capacity: int) -> int:
    """``ceil(log2(capacity))``: the levels below the root of a tree over ``capacity`` leaves.

    >>> depth_of(1000), depth_of(1)
    (10, 0)
    """
    return int(math.ceil(math.log2(capacity)))


def init(capacity: int) -> BinaryTreeState:
    """A tree over ``capacity`` leaves, all 0.

    >>> init(8).nodes.shape
    (15,)
    """
    config_int("binary_tree.init", "capacity", capacity)
    depth = depth_of(capacity)
    return BinaryTreeState(
        nodes=jnp.zeros((2 ** (depth + 1) - 1,), jnp.float32), capacity=capacity, depth=depth
    )


@functools.partial(jax.jit, static_argnames=("unique",))
def set(  # noqa: A001
    tree: BinaryTreeState, indices: jax.Array, values: jax.Array, unique: bool = False
) -> BinaryTreeState:
    """Set ``leaves[indices] = values`` (int32 ``[N]``, float32 ``[N]``) and recompute their
    ancestors. The last of duplicate indices wins (``unique=True`` promises none); indices
    outside ``[0, capacity)`` are ignored; values must be finite and >= 0 (not checked here).

    On the CPU a batch of at most ``_EACH_MAX`` indices is taken one index after the other (a
    loop of scalar steps, 2-4x faster there than gathering and scattering ``N`` rows per
    level); larger batches, and every batch elsewhere, level by level.

    >>> float(total(set(init(4), jnp.array([1, 1]), jnp.array([2.0, 5.0]))))
    5.0
    """
    indices = jnp.asarray(indices, jnp.int32).reshape(-1)
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    if values.shape != indices.shape:
        raise ValueError(
            f"binary_tree.set: values have shape {values.shape}, expected the shape of "
            f"indices {indices.shape}."
        )
    if jax.default_backend() == "cpu" and indices.shape[0] <= _EACH_MAX:
        nodes = _set_each(tree, indices, values)
    else:
        nodes = _set_levels(tree, indices, values, unique)
    return dataclasses.replace(tree, nodes=nodes)


def _parents(tree: BinaryTreeState, nodes, node, levels: int):
    """``nodes`` with the ``levels`` ancestors of the level-``depth`` ``node`` (any shape)
    recomputed from their children, the deepest first."""

    def up(i, carry):
        nodes, node = carry
        level = tree.depth - 1 - i
        node = node // 2
        left = 2 * (2**level) - 1 + 2 * node
        return nodes.at[2**level - 1 + node].set(nodes[left] + nodes[left + 1]), node

    return jax.lax.fori_loop(0, levels, up, (nodes, node))[0]


def _set_each(tree: BinaryTreeState, indices, values):
    """Each index in turn: its leaf, then its ancestors (the last duplicate wins by order)."""
    first = 2**tree.depth - 1

    def one(i, nodes):
        leaf = indices[i]
        inside = (leaf >= 0) & (leaf < tree.capacity)
        nodes = nodes.at[jnp.where(inside, first + leaf, nodes.shape[0])].set(
            values[i], mode="drop"
        )
        return _parents(tree, nodes, jnp.clip(leaf, 0, tree.capacity - 1), tree.depth)

    return jax.lax.fori_loop(0, indices.shape[0], one, tree.nodes)


def _set_levels(tree: BinaryTreeState, indices, values, unique: bool):
    """The whole batch level by level; a level with fewer nodes than the batch has indices is
    recomputed whole from its (contiguous) children. Parents shared by several indices get
    the same value from each, so the scatters' order does not matter."""
    valid = (indices >= 0) & (indices < tree.capacity)
    first, size = 2**tree.depth - 1, tree.nodes.shape[0]
    nodes = tree.nodes
    if not unique and indices.shape[0] > 1:
        # the last occurrence wins: each targeted leaf, about to be overwritten, is scratch for
        # a scatter-min of -(position + 1) (values are >= 0, so a negative always wins); O(N)
        # where comparing all pairs is O(N^2), and independent of the scatter's order
        pos = jnp.arange(indices.shape[0], dtype=jnp.int32)
        nodes = nodes.at[jnp.where(valid, first + indices, size)].min(
            -(pos + 1).astype(jnp.float32), mode="drop"
        )
        winner = -nodes[first + jnp.clip(indices, 0, tree.capacity - 1)].astype(jnp.int32) - 1
        valid = valid & (winner == pos)
    nodes = nodes.at[jnp.where(valid, first + indices, size)].set(
        values, mode="drop", unique_indices=True
    )
    # (this module's ``min`` is the tree's, hence no builtin min here)
    whole = sorted((0, indices.shape[0].bit_length() - 1, tree.depth))[1]
    node = jnp.clip(indices, 0, tree.capacity - 1)
    nodes = _parents(tree, nodes, node, tree.depth - whole)
    for level in reversed(range(whole)):
        children = jax.lax.dynamic_slice_in_dim(nodes, 2 * (2**level) - 1, 2 * (2**level))
        nodes = jax.lax.dynamic_update_slice_in_dim(
            nodes, children[0::2] + children[1::2], 2**level - 1, 0
        )
    return nodes


@jax.jit
def get(tree: BinaryTreeState, indices: jax.Array) -> jax.Array:
    """float32 ``[...]``: the leaf values at int32 ``indices`` (any shape).

    >>> get(set(init(4), jnp.array([2]), jnp.array([3.0])), jnp.array([2, 3])).tolist()
    [3.0, 0.0]
    """
    return tree.nodes[2**tree.depth - 1 + jnp.asarray(indices, jnp.int32)]


@jax.jit
def total(tree: BinaryTreeState) -> jax.Array:
    """float32 ``[]``: the sum of all leaves (the root).

    >>> float(total(set(init(3), jnp.array([0, 2]), jnp.array([1.0, 2.0]))))
    3.0
    """
    return tree.nodes[0]


@jax.jit
def min(tree: BinaryTreeState) -> jax.Array:  # noqa: A001
    """float32 ``[]``: the smallest positive leaf (``inf`` when none is positive); a pass over
    the leaves (the layout keeps no minima).

    >>> float(min(set(init(4), jnp.array([0, 1]), jnp.array([0.5, 2.0]))))
    0.5
    """
    leaves = tree.leaves
    return jnp.min(jnp.where(leaves > 0, leaves, jnp.inf), initial=jnp.inf)


def _descend(tree: BinaryTreeState, t: jax.Array):
    """``(leaves, values)``: for each target ``t`` (float32 ``[N]``, in ``[0, total)``), the
    smallest leaf whose inclusive prefix sum exceeds it, never one of value 0 while the total
    is positive.

    The descent reads the left child only, as flashbax's does (a loop over the levels:
    unrolled, XLA fused the chain of levels into each one, 3x slower). Float rounding of
    ``t - left`` (or a tree written by a drifting writer, whose parents are not their
    children's sums) can send a target past the mass of a subtree and onto a leaf of value 0;
    those targets, rare, are descended again reading both children and keeping ``t`` below
    their sum."""

    def left_only(level, carry):
        node, t = carry
        left = tree.nodes[2 * (2**level) - 1 + 2 * node]
        go_right = t >= left
        return 2 * node + go_right.astype(jnp.int32), jnp.where(go_right, t - left, t)

    def clipped(level, carry):
        node, t = carry
        left_at = 2 * (2**level) - 1 + 2 * node
        left, right = tree.nodes[left_at], tree.nodes[left_at + 1]
        t = jnp.minimum(t, jnp.nextafter(left + right, 0.0))
        go_right = (t >= left) & (right > 0)
        t = jnp.where(go_right, jnp.minimum(t - left, jnp.nextafter(right, 0.0)), t)
        return 2 * node + go_right.astype(jnp.int32), t

    def descend(step, t):
        start = (jnp.zeros(t.shape, jnp.int32), t)
        node = jax.lax.fori_loop(0, tree.depth, step, start)[0]
        node = jnp.minimum(node, tree.capacity - 1)
        return node, get(tree, node)

    node, value = descend(left_only, t)
    lost = (value <= 0) & (total(tree) > 0)
    return jax.lax.cond(
        jnp.any(lost),
        lambda: tuple(jnp.where(lost, a, b) for a, b in zip(descend(clipped, t), (node, value))),
        lambda: (node, value),
    )


@jax.jit
def find(tree: BinaryTreeState, targets: jax.Array) -> jax.Array:
    """int32 ``[N]``: for each target, the smallest ``i`` with ``cumsum(leaves)[i] > target``
    (targets clipped to ``[0, total)``; never a zero-valued leaf unless all are 0).

    >>> find(set(init(4), jnp.array([1, 3]), jnp.array([1.0, 1.0])), jnp.array([0.5, 1.5]))
    Array([1, 3], dtype=int32)
    """
    t = jnp.asarray(targets, jnp.float32)
    tot = total(tree)
    t = jnp.clip(t, 0.0, jnp.nextafter(tot, 0.0))
    node, value = _descend(tree, t.reshape(-1))
    return jnp.where(tot > 0, node, 0).reshape(t.shape)


@functools.partial(jax.jit, static_argnames=("n", "stratified"))
def sample_with_stats(tree: BinaryTreeState, key: jax.Array, n: int, stratified: bool = False):
    """``(int32 [n], float32 [n], float32 [], float32 [])``: ``n`` leaves drawn in proportion to
    their values (``stratified``: one in each of ``n`` equal slices of the total), their values,
    the total and the smallest positive leaf, as the wide tree's ``sample_with_stats``.

    >>> tree = set(init(4), jnp.array([2]), jnp.array([1.0]))
    >>> sample_with_stats(tree, jax.random.key(0), 2)[0].tolist()
    [2, 2]
    """
    u = uniform01(key, (n,))
    if stratified:
        u = (jnp.arange(n, dtype=jnp.float32) + u) / jnp.float32(n)
    tot = total(tree)
    t = jnp.minimum(u * tot, jnp.nextafter(tot, 0.0))
    node, value = _descend(tree, t)
    ok = tot > 0
    return jnp.where(ok, node, 0), jnp.where(ok, value, 0.0), tot, min(tree)
