"""flashbax's sum-tree functions (``flashbax.buffers.sum_tree``) over the core's exact tree.

The prioritised buffers of ``functional_rb.flashbax`` keep their priorities in the core's
:mod:`functional_rb.samplers.sum_tree`: a wide tree (16 children per node) whose every internal
node is recomputed from its children, so its total never drifts (flashbax's float32 binary
tree adds deltas and drifts). This module gives that tree flashbax's functions and
:class:`SumTreeState` fields: ``max_recorded_priority``, ``capacity``, ``tree_depth`` and
``nodes``. ``nodes`` is a read-only view whose element 0 is the total, followed by the
internal sums and the leaves; flashbax's own node indexing (``get_tree_index``) does not
apply to it (it is computed for a binary tree of that capacity, and only that function and
tests of flashbax's private layout use it).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from functional_rb.flashbax._records import Record, record
from functional_rb.samplers import sum_tree as _tree


@record
class SumTreeState(Record):
    """A sum tree over ``capacity`` leaves with flashbax's fields.

    tree: the core :class:`~functional_rb.samplers.sum_tree.SumTreeState`.
    max_recorded_priority: float32 ``[]``: the largest value ever set (new buffer items get it).
    """

    tree: _tree.SumTreeState
    max_recorded_priority: jax.Array

    @property
    def capacity(self) -> int:
        return self.tree.capacity

    @property
    def tree_depth(self) -> int:
        return get_tree_depth(self.capacity)

    @property
    def nodes(self) -> jax.Array:
        """float32 ``[2 ** (tree_depth + 1) - 1]``: the tree in flashbax's binary layout (root
        first), computed from the leaves when read."""
        width = 2**self.tree_depth
        level = (
            jnp.zeros(width, jnp.float32).at[: self.capacity].set(self.tree.values[: self.capacity])
        )
        levels = [level]
        while level.shape[0] > 1:
            level = level[0::2] + level[1::2]
            levels.append(level)
        return jnp.concatenate(levels[::-1])


def get_tree_depth(capacity: int) -> int:
    """The depth flashbax's binary tree would have: ``ceil(log2(capacity))``.

    >>> get_tree_depth(1000)
    10
    """
    return int(math.ceil(math.log2(capacity)))


def init(capacity: int) -> SumTreeState:
    """An empty tree (every leaf 0, ``max_recorded_priority`` 1).

    >>> float(init(8).nodes[0]), float(init(8).max_recorded_priority)
    (0.0, 1.0)
    """
    return SumTreeState(tree=_tree.init(capacity), max_recorded_priority=jnp.float32(1.0))


def get_tree_index(depth_level, node_index):
    """flashbax's flat index of ``node_index`` at ``depth_level`` in a binary tree (kept for
    code that computes it; the core tree's :attr:`SumTreeState.nodes` is laid out otherwise).

    >>> int(get_tree_index(2, 1))
    4
    """
    return 2**depth_level - 1 + node_index


def total(state: SumTreeState) -> jax.Array:
    """float32 ``[]``: the sum of every leaf (not in flashbax, which reads ``nodes[0]``).

    >>> float(total(set_batch_scan(init(4), jnp.array([0, 1]), jnp.array([1.0, 3.0]))))
    4.0
    """
    return _tree.total(state.tree)


_total_priority = total


def get(state: SumTreeState, node_index) -> jax.Array:
    """The value of leaf ``node_index`` (any integer shape).

    >>> float(get(set_non_batched(init(8), 3, 2.5), 3))
    2.5
    """
    return _tree.get(state.tree, jnp.asarray(node_index, jnp.int32))


def get_batch(state: SumTreeState, node_indices) -> jax.Array:
    """The values of leaves ``node_indices``.

    >>> get_batch(init(8), jnp.array([0, 1])).tolist()
    [0.0, 0.0]
    """
    return get(state, node_indices)


def get_probability(state: SumTreeState, node_index) -> jax.Array:
    """``value / total`` of leaf ``node_index``.

    >>> float(get_probability(set_batch_scan(init(4), jnp.array([0, 1]),
    ...                                      jnp.array([1.0, 3.0])), 1))
    0.75
    """
    return get(state, node_index) / _total_priority(state)


def _set(state: SumTreeState, indices, values) -> SumTreeState:
    """Set leaves (the last of duplicate indices wins) and raise ``max_recorded_priority``."""
    indices = jnp.asarray(indices, jnp.int32).reshape(-1)
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    inside = (indices >= 0) & (indices < state.capacity)
    top = jnp.max(jnp.where(inside, values, -jnp.inf), initial=-jnp.inf)
    return SumTreeState(
        tree=_tree.set(state.tree, jnp.where(inside, indices, -1), values),
        max_recorded_priority=jnp.maximum(state.max_recorded_priority, top),
    )


def set_non_batched(state: SumTreeState, node_index, value) -> SumTreeState:
    """Set one leaf.

    >>> float(set_non_batched(init(8), 2, 10.0).nodes[0])
    10.0
    """
    return _set(state, node_index, value)


def set_batch_bincount(state: SumTreeState, node_indices, values) -> SumTreeState:
    """Set many leaves at once (the last of duplicate indices wins; the core tree resolves
    duplicates the same way on every backend, so this and :func:`set_batch_scan` agree).

    >>> float(set_batch_bincount(init(8), jnp.array([1, 1]), jnp.array([2.0, 5.0])).nodes[0])
    5.0
    """
    return _set(state, node_indices, values)


def set_batch_scan(state: SumTreeState, node_indices, values) -> SumTreeState:
    """Same as :func:`set_batch_bincount`.

    >>> float(set_batch_scan(init(8), jnp.array([1, 2]), jnp.array([2.0, 5.0])).nodes[0])
    7.0
    """
    return _set(state, node_indices, values)


def sample(state: SumTreeState, rng_key=None, query_value: Optional[jax.Array] = None):
    """One leaf drawn with probability ``value / total`` (or the leaf at ``query_value`` in
    ``[0, 1)`` of the total).

    >>> tree = set_batch_scan(init(4), jnp.array([0, 3]), jnp.array([1.0, 3.0]))
    >>> int(sample(tree, query_value=jnp.float32(0.5)))
    3
    """
    if query_value is None:
        if rng_key is None:
            raise ValueError(
                "sum_tree.sample: either the `rng_key` or the `query_value` must be specified."
            )
        query_value = jax.random.uniform(rng_key)
    target = jnp.asarray(query_value, jnp.float32) * _total_priority(state)
    return _tree.find(state.tree, target.reshape(1))[0]


def stratified_sample(state: SumTreeState, batch_size: int, rng_key) -> jax.Array:
    """``batch_size`` leaves, one from each of ``batch_size`` equal slices of the total.

    >>> tree = set_batch_scan(init(4), jnp.array([0, 3]), jnp.array([1.0, 1.0]))
    >>> stratified_sample(tree, 2, jax.random.PRNGKey(0)).tolist()
    [0, 3]
    """
    return _tree.sample(state.tree, rng_key, batch_size, stratified=True)
