"""functional_rb.samplers.binary_tree (flashbax's layout, exact): against a NumPy reference after
any batched sets, both ways of setting agree bit for bit, every parent is the sum of its
children, the inverse CDF, and the draws' distribution (chi-square)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_rb.samplers import binary_tree as bt
from functional_rb.testing import assert_frequencies


def check_tree(tree, ref):
    """Leaves equal ``ref`` (padding 0); each parent is exactly its children's sum."""
    nodes = np.asarray(tree.nodes)
    assert nodes.shape == (2 ** (tree.depth + 1) - 1,)
    first = 2**tree.depth - 1
    np.testing.assert_array_equal(nodes[first : first + tree.capacity], ref)
    assert not nodes[first + tree.capacity :].any()
    for level in range(tree.depth):
        parents = nodes[2**level - 1 : 2 ** (level + 1) - 1]
        children = nodes[2 ** (level + 1) - 1 : 2 ** (level + 2) - 1]
        np.testing.assert_array_equal(parents, children[0::2] + children[1::2])
    np.testing.assert_allclose(float(bt.total(tree)), ref.astype(np.float64).sum(), rtol=1e-5)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    capacity=st.sampled_from([1, 2, 7, 20, 64, 100]),
    ops=st.lists(
        st.tuples(st.sampled_from([1, 8, 150]), st.integers(0, 2**31 - 1)),
        min_size=1,
        max_size=4,
    ),
)
def test_set_matches_numpy_reference(maybe_jit, capacity, ops):
    """Duplicates (the last wins), indices out of range (ignored) and zeros; the per-index
    path (the CPU's) and the per-level path give the same nodes."""
    set_ = maybe_jit(bt.set)
    tree = bt.init(capacity)
    levels = tree.nodes
    ref = np.zeros(capacity, np.float32)
    for n, seed in ops:
        rng = np.random.default_rng(seed)
        idx = rng.integers(-3, capacity + 3, n).astype(np.int32)
        val = np.where(rng.random(n) < 0.2, 0.0, rng.random(n) * 10).astype(np.float32)
        tree = set_(tree, jnp.asarray(idx), jnp.asarray(val))
        levels = bt._set_levels(
            bt.BinaryTreeState(levels, capacity, tree.depth),
            jnp.asarray(idx),
            jnp.asarray(val),
            False,
        )
        for i, v in zip(idx, val):
            if 0 <= i < capacity:
                ref[i] = v
        check_tree(tree, ref)
        np.testing.assert_array_equal(np.asarray(levels), np.asarray(tree.nodes))


@pytest.mark.parametrize("capacity", [1, 5, 64, 1000])
def test_find_is_the_inverse_cdf_and_skips_zero_leaves(capacity):
    rng = np.random.default_rng(capacity)
    values = np.where(rng.random(capacity) < 0.3, 0.0, rng.random(capacity)).astype(np.float32)
    values[-1] = 1.0  # at least one positive leaf
    tree = bt.set(bt.init(capacity), jnp.arange(capacity), jnp.asarray(values))
    cdf = np.cumsum(values.astype(np.float64))
    targets = rng.random(500) * cdf[-1]
    found = np.asarray(bt.find(tree, jnp.asarray(targets, jnp.float32)))
    assert (values[found] > 0).all()
    want = np.searchsorted(cdf, targets, side="right")
    # float32 targets and sums: off by at most one positive leaf at a boundary
    assert np.mean(found == np.minimum(want, capacity - 1)) > 0.98
    assert int(bt.find(bt.init(capacity), jnp.array([0.5]))[0]) == 0  # empty: 0, masked by callers


def test_draws_follow_the_values():
    capacity = 37
    values = np.arange(capacity, dtype=np.float32) % 5  # zeros included
    tree = bt.set(bt.init(capacity), jnp.arange(capacity), jnp.asarray(values))
    draw = jax.jit(lambda k: bt.sample_with_stats(tree, k, 1000)[0])
    counts = np.zeros(capacity)
    for k in jax.random.split(jax.random.key(0), 40):
        np.add.at(counts, np.asarray(draw(k)), 1)
    assert counts[values == 0].sum() == 0
    assert_frequencies(counts, values / values.sum())
    idx, v, total, vmin = bt.sample_with_stats(tree, jax.random.key(1), 8, stratified=True)
    np.testing.assert_array_equal(np.asarray(v), values[np.asarray(idx)])
    assert float(total) == pytest.approx(values.sum()) and float(vmin) == 1.0


def test_a_drifted_tree_never_yields_a_zero_leaf():
    """A tree whose parents exceed their children's sums (flashbax's delta-added tree drifts
    so): targets past the real mass of a subtree are descended again, not left on a 0 leaf."""
    # leaves [1, 1, 1, 0]; the right parent says 1.5 and the root 3.5 (drifted up)
    nodes = jnp.array([3.5, 2.0, 1.5, 1.0, 1.0, 1.0, 0.0], jnp.float32)
    tree = bt.BinaryTreeState(nodes=nodes, capacity=4, depth=2)
    targets = jnp.linspace(0.0, 3.49, 200)
    found = np.asarray(bt.find(tree, targets))
    assert set(found) <= {0, 1, 2}
    assert (found[np.asarray(targets) >= 3.0] == 2).all()
    idx, v, _, _ = bt.sample_with_stats(tree, jax.random.key(0), 256)
    assert (np.asarray(v) > 0).all() and 3 not in set(np.asarray(idx))
