"""flashbax issue #52: its float32 sum tree adds a delta to every ancestor of an updated leaf, so
after many updates its total drifts from the sum of its leaves. functional_rb.flashbax's tree
(flashbax's layout) recomputes every ancestor from its children: after 10^6 random updates it
is bit for bit the tree built afresh from its leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functional_rb.flashbax.buffers import sum_tree as ours
from functional_rb.samplers import binary_tree

CAPACITY, BATCH, STEPS = 1000, 1000, 1000  # 10^6 updates


def updated(module):
    """``module``'s tree after ``STEPS`` batches of ``BATCH`` random updates (fixed seed)."""

    def step(tree, key):
        k_idx, k_val = jax.random.split(key)
        indices = jax.random.randint(k_idx, (BATCH,), 0, CAPACITY)
        values = jax.random.uniform(k_val, (BATCH,))
        return module.set_batch_bincount(tree, indices, values), None

    keys = jax.random.split(jax.random.PRNGKey(0), STEPS)
    with jax.numpy_rank_promotion("allow"):  # flashbax's code broadcasts ranks
        return jax.jit(lambda t, ks: jax.lax.scan(step, t, ks)[0])(module.init(CAPACITY), keys)


def leaves_of(tree) -> np.ndarray:
    first = 2**tree.tree_depth - 1
    return np.asarray(tree.nodes[first : first + CAPACITY])


def drift(tree) -> float:
    return abs(float(tree.nodes[0]) - leaves_of(tree).astype(np.float64).sum())


def test_ours_stays_exact_after_a_million_updates():
    tree = updated(ours)
    fresh = binary_tree.set(
        binary_tree.init(CAPACITY), jnp.arange(CAPACITY), jnp.asarray(leaves_of(tree))
    )
    np.testing.assert_array_equal(np.asarray(tree.nodes), np.asarray(fresh.nodes))
    # the root is a float32 sum of ~500: its rounding alone, not an accumulated drift
    assert drift(tree) < 1e-3


def test_flashbax_drifts_where_ours_does_not():
    fbx_tree = pytest.importorskip("flashbax.buffers.sum_tree")
    theirs = updated(fbx_tree)
    assert drift(theirs) > 100 * max(drift(updated(ours)), 1e-5)
