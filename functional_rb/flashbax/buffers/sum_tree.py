"""flashbax's sum-tree functions (``flashbax.buffers.sum_tree``) over the core's exact binary
tree (:mod:`functional_rb.samplers.binary_tree`).

:class:`SumTreeState` is flashbax's, field for field: ``nodes`` (float32, the binary tree root
first, leaves last), ``max_recorded_priority`` and the static ``tree_depth`` and ``capacity``,
so a state, a structure comparison or a checkpoint written with flashbax does not notice the
switch. The difference is in ``set``: every touched parent is recomputed from its two children
instead of by adding a delta, so the total never drifts (flashbax's float32 tree does, its
issue #52), and a NaN, infinite or negative value never reaches the tree through the buffers
(see their ``set_priorities``). As in flashbax, these functions accept any leaf of the binary
tree, ``[0, 2 ** tree_depth)``, also those past ``capacity``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from functional_rb.flashbax._records import Record, record
from functional_rb.samplers import binary_tree as _tree


@record(sort_fields=False)
class SumTreeState(Record):
    """flashbax's sum tree state.

    nodes: float32 ``[2 ** (tree_depth + 1) - 1]``: the binary tree, root first, leaves last.
    max_recorded_priority: float32 ``[]``: the largest value ever set (new buffer items get it).
    tree_depth, capacity: static.
    """

    nodes: jax.Array
    max_recorded_priority: jax.Array
    tree_depth: int = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))

    @property
    def tree(self) -> _tree.BinaryTreeState:
        """The core's view of ``nodes`` (the same array)."""
        return _tree.BinaryTreeState(
            nodes=self.nodes, capacity=self.capacity, depth=self.tree_depth
        )

    @classmethod
    def from_saved(cls, **fields) -> SumTreeState:
        """The state from a checkpoint's fields; a file written before the state held
        flashbax's ``nodes`` holds the core's wide tree (``tree``): the same leaves are laid
        out in ``nodes``."""
        wide = fields.pop("tree", None)
        if wide is None:
            return cls(**fields)
        capacity = wide.capacity
        leaves = jnp.asarray(wide.values)[..., :capacity]  # leading axes: a vmapped state's
        empty = _tree.init(capacity)

        def build(values):
            return _tree.set(empty, jnp.arange(capacity), values).nodes

        flat = jax.vmap(build)(leaves.reshape((-1, capacity)))
        nodes = flat.reshape(leaves.shape[:-1] + flat.shape[-1:])
        return cls(nodes=nodes, tree_depth=empty.depth, capacity=capacity, **fields)

    def with_tree(self, tree: _tree.BinaryTreeState, max_recorded_priority=None) -> SumTreeState:
        """This state with the core tree's ``nodes`` (and ``max_recorded_priority``)."""
        top = self.max_recorded_priority if max_recorded_priority is None else max_recorded_priority
        return self.replace(nodes=tree.nodes, max_recorded_priority=top)


def get_tree_depth(capacity: int) -> int:
    """The depth flashbax's binary tree would have: ``ceil(log2(capacity))``.

    >>> get_tree_depth(1000)
    10
    """
    return _tree.depth_of(capacity)


def init(capacity: int) -> SumTreeState:
    """An empty tree (every leaf 0, ``max_recorded_priority`` 1).

    >>> float(init(8).nodes[0]), float(init(8).max_recorded_priority)
    (0.0, 1.0)
    """
    tree = _tree.init(capacity)
    return SumTreeState(
        nodes=tree.nodes,
        max_recorded_priority=jnp.float32(1.0),
        tree_depth=tree.depth,
        capacity=capacity,
    )


def get_tree_index(depth_level, node_index):
    """The index in ``nodes`` of node ``node_index`` at ``depth_level`` (the root is level 0).

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
    index = get_tree_index(state.tree_depth, jnp.asarray(node_index, jnp.int32))
    return state.nodes[index]


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


def _whole(state: SumTreeState) -> _tree.BinaryTreeState:
    """The core tree over every leaf of the binary layout (flashbax's functions reach them)."""
    return dataclasses.replace(state.tree, capacity=2**state.tree_depth)


def _set(state: SumTreeState, indices, values) -> SumTreeState:
    """Set leaves (the last of duplicate indices wins) and raise ``max_recorded_priority``."""
    indices = jnp.asarray(indices, jnp.int32).reshape(-1)
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    inside = (indices >= 0) & (indices < 2**state.tree_depth)
    top = jnp.max(jnp.where(inside, values, -jnp.inf), initial=-jnp.inf)
    tree = _tree.set(_whole(state), jnp.where(inside, indices, -1), values)
    return state.with_tree(tree, jnp.maximum(state.max_recorded_priority, top))


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


def sample(state: SumTreeState, rng_key=None, query_value: jax.Array | None = None):
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
    return _tree.find(_whole(state), target.reshape(1))[0]


def stratified_sample(state: SumTreeState, batch_size: int, rng_key) -> jax.Array:
    """``batch_size`` leaves, one from each of ``batch_size`` equal slices of the total.

    >>> tree = set_batch_scan(init(4), jnp.array([0, 3]), jnp.array([1.0, 1.0]))
    >>> stratified_sample(tree, 2, jax.random.PRNGKey(0)).tolist()
    [0, 3]
    """
    return _tree.sample_with_stats(_whole(state), rng_key, batch_size, stratified=True)[0]
