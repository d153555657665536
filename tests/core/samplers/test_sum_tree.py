"""Tests for functional_rb.samplers.sum_tree: exactness against a NumPy reference, inverse CDF, sampling
distribution (chi-square), duplicate resolution and drift."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from functional_rb.samplers import sum_tree as st
from functional_rb.samplers.sum_tree_state import level_sizes
from functional_rb.testing import assert_frequencies
from functional_rb.testing.invariants import check_sum_tree


def _check_against(tree, ref):
    np.testing.assert_array_equal(np.asarray(tree.leaves), ref)
    assert tree.leaves.shape == (tree.capacity,)
    check_sum_tree(tree)  # layout, padding, node sums and minima, total vs float64 (1e-6)
    pos = ref[ref > 0]
    assert float(st.min(tree)) == (pos.min() if pos.size else np.inf)
    # every internal node is the fold of its children: bit-identical to a rebuild
    full = st.rebuild(tree)
    for got, want in zip((tree.sums, tree.mins), (full.sums, full.mins)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("capacity,fanout", [(1, 2), (7, 2), (32, 32), (33, 32), (100, 4)])
def test_init_is_empty(capacity, fanout):
    tree = st.init(capacity, fanout)
    _check_against(tree, np.zeros(capacity, np.float32))
    assert tree.values.shape[0] % fanout == 0 and tree.sums.shape == tree.mins.shape


def test_init_rejects_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        st.init(0)
    with pytest.raises(ValueError, match="fanout"):
        st.init(10, fanout=1)


# maybe_jit is stateless, so sharing it across examples is fine.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st_.sampled_from([(1, 2), (7, 2), (20, 3), (70, 4), (70, 32)]),
    ops=st_.lists(
        st_.tuples(st_.sampled_from([1, 8, 150]), st_.integers(0, 2**31 - 1)),
        min_size=1,
        max_size=4,
    ),
)
def test_set_matches_numpy_reference(maybe_jit, shape, ops):
    """After any sequence of batched sets (duplicates, out-of-range indices, zeros) the tree
    equals a brute-force reference: leaves exactly, total to float64, min exactly."""
    capacity, fanout = shape
    set_ = maybe_jit(st.set)
    set_unique = maybe_jit(functools.partial(st.set, unique=True))
    tree = tree_u = st.init(capacity, fanout)
    ref = np.zeros(capacity, np.float32)
    for n, seed in ops:
        rng = np.random.default_rng(seed)
        idx = rng.integers(-2, capacity + 2, n).astype(np.int32)
        vals = (rng.random(n) * (rng.random(n) < 0.7)).astype(np.float32)
        tree = set_(tree, idx, vals)
        for i, v in zip(idx, vals):  # sequential semantics: the last write wins
            if 0 <= i < capacity:
                ref[i] = v
        _check_against(tree, ref)
        # unique=True on the same batch with its losing duplicates sent out of range (what a
        # writer passes: distinct positions, any number of ignored ones) gives the same tree
        last = np.array([i not in idx[j + 1 :] for j, i in enumerate(idx)], bool)
        tree_u = set_unique(tree_u, np.where(last, idx, -1).astype(np.int32), vals)
        _check_against(tree_u, ref)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    shape=st_.sampled_from([(1, 2), (7, 2), (20, 3), (70, 4), (300, 4), (1000, 16)]),
    ops=st_.lists(
        st_.tuples(
            st_.integers(-5, 3000),
            st_.sampled_from([1, 5, 40, 256, 1100]),
            st_.integers(0, 2**31 - 1),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_set_run_matches_numpy_reference_and_set(maybe_jit, shape, ops):
    """set_run (a ring writer's slots: start, start + 1, ... modulo capacity, with a mask) gives
    the reference leaves, a consistent tree, and the very tree ``set`` gives for the same
    positions, including runs that wrap around and runs longer than the capacity."""
    capacity, fanout = shape
    set_run = maybe_jit(st.set_run)
    set_ = maybe_jit(st.set)
    tree = tree_s = st.init(capacity, fanout)
    ref = np.zeros(capacity, np.float32)
    for start, n, seed in ops:
        rng = np.random.default_rng(seed)
        mask = rng.random(n) < 0.8
        vals = (rng.random(n) * (rng.random(n) < 0.8)).astype(np.float32)
        tree = set_run(tree, np.int32(start), vals, mask)
        pos = (start + np.arange(n)) % capacity
        tree_s = set_(tree_s, np.where(mask, pos, -1).astype(np.int32), vals)
        for p, m, v in zip(pos, mask, vals):
            if m:
                ref[p] = v
        _check_against(tree, ref)
        for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(tree_s)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_set_run_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="mask has shape"):
        st.set_run(st.init(10), 0, np.zeros(4, np.float32), np.ones(3, bool))


def test_duplicates_last_occurrence_wins():
    # 10: the rebuild-from-leaves path is not taken; 600: it is (600 * fanout >= leaves).
    for n in (10, 600):
        idx = np.zeros(n, np.int32)
        idx[1::2] = 3
        vals = np.arange(1, n + 1, dtype=np.float32)
        for cap in (5, 4096):
            tree = jax.jit(st.set)(st.init(cap, 2), idx, vals)
            expect = np.zeros(cap, np.float32)
            expect[0], expect[3] = n - 1, n
            np.testing.assert_array_equal(np.asarray(tree.leaves), expect)
            _check_against(tree, expect)


def test_duplicates_mixed_with_ignored_indices_under_vmap():
    # Rows of one vmapped batch resolve their duplicates independently; ignored indices
    # (out of range, e.g. -1 from a mask) never win and never clobber a slot.
    idx = np.array([[2, -1, 2, 7, 99], [-1, -1, 5, 5, 5]], np.int32)
    vals = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.float32)
    trees = jax.vmap(lambda i, v: st.set(st.init(10, 4), i, v))(idx, vals)
    expect = np.zeros((2, 10), np.float32)
    expect[0, 2], expect[0, 7], expect[1, 5] = 3, 4, 10
    np.testing.assert_array_equal(np.asarray(trees.values[:, :10]), expect)
    np.testing.assert_array_equal(np.asarray(jax.vmap(st.total)(trees)), expect.sum(axis=1))


def test_last_occurrence_helper_both_paths():
    # 600 > the [N, N] comparison threshold, so the sort path runs as well as the quadratic one.
    for n in (10, 600):
        idx = np.random.default_rng(n).integers(0, 7, n).astype(np.int32)
        got = np.asarray(jax.jit(st.last_occurrence)(idx))
        expect = np.array([i not in idx[j + 1 :] for j, i in enumerate(idx)])
        np.testing.assert_array_equal(got, expect)


def test_find_is_the_inverse_cdf(maybe_jit):
    rng = np.random.default_rng(0)
    cap = 300
    ref = (rng.random(cap) * (rng.random(cap) < 0.5)).astype(np.float32)
    ref[-5:] = 0  # trailing zeros: the top of the range must not land on them
    tree = st.set(st.init(cap, 4), np.arange(cap, dtype=np.int32), ref)
    tot = float(st.total(tree))
    targets = np.concatenate(
        [rng.random(2000) * tot, [0.0, -1.0, tot, 2 * tot, np.nextafter(tot, 0)]]
    ).astype(np.float32)
    got = np.asarray(maybe_jit(st.find)(tree, targets))
    assert got.dtype == np.int32
    assert ((got >= 0) & (got < cap)).all()
    assert (ref[got] > 0).all(), "find returned a zero-valued leaf"
    cs = np.cumsum(ref.astype(np.float64))
    expect = np.searchsorted(cs, targets.astype(np.float64), side="right")
    inside = (targets >= 0) & (targets < tot)
    # Away from bucket boundaries (rounding) the answer is exactly the float64 inverse CDF.
    far = (
        inside
        & (np.abs(cs[np.minimum(expect, cap - 1)] - targets) > 1e-4 * tot)
        & (np.abs(np.where(expect > 0, cs[np.maximum(expect - 1, 0)], 0) - targets) > 1e-4 * tot)
    )
    assert far.sum() > 1500
    np.testing.assert_array_equal(got[far], expect[far])


def test_find_on_all_zero_tree_stays_in_range():
    tree = st.init(10, 4)
    got = np.asarray(st.find(tree, jnp.array([0.0, 1.0, -3.0])))
    np.testing.assert_array_equal(got, 0)
    assert np.asarray(st.sample(tree, jax.random.key(0), 7)).max() == 0


@pytest.mark.parametrize("stratified", [False, True])
@pytest.mark.parametrize("fanout", [2, 32])
def test_sample_distribution_chi_square(stratified, fanout):
    rng = np.random.default_rng(1)
    cap = 40
    vals = (rng.random(cap) ** 3 * (rng.random(cap) < 0.8)).astype(np.float32)
    tree = st.set(st.init(cap, fanout), np.arange(cap, dtype=np.int32), vals)
    n = 40_000
    idx = np.asarray(
        jax.jit(st.sample, static_argnums=(2, 3))(tree, jax.random.key(3), n, stratified)
    )
    counts = np.bincount(idx, minlength=cap)
    v64 = vals.astype(np.float64)
    # zero leaves at probability 0; the chi-square test at 1e-3 plus per-position binomial tests
    assert_frequencies(counts, v64 / v64.sum(), alpha=2e-3)
    nz = vals > 0
    expected = v64[nz] / v64.sum() * n
    if stratified:  # stratification: each count within one draw of its expectation per stratum
        assert np.abs(counts[nz] - expected).max() < 3


def test_total_does_not_drift():
    """Many random batched updates: the root still equals the float64 sum of the leaves.
    (benchmarks/w2_prioritized.py --drift runs this at capacity 10^6 with 10^6 updates.)"""
    cap, steps, n = 5_000, 1_000, 64

    @jax.jit
    def run(tree, key):
        def body(tree, key):
            k1, k2, k3 = jax.random.split(key, 3)
            idx = jax.random.randint(k1, (n,), 0, cap)
            big = jax.random.bernoulli(k3, 0.1, (n,))
            vals = jax.random.uniform(k2, (n,)) * jnp.where(big, 1e3, 1e-3)
            return st.set(tree, idx, vals), None

        return jax.lax.scan(body, tree, jax.random.split(key, steps))[0]

    tree = run(st.init(cap), jax.random.key(0))
    leaves = np.asarray(tree.leaves).astype(np.float64)
    check_sum_tree(tree)  # the total (and every node) against float64 sums, relative 1e-6
    assert float(st.min(tree)) == leaves[leaves > 0].min()


def test_get_and_vmap():
    trees = jax.vmap(lambda v: st.set(st.init(6, 2), jnp.arange(3, dtype=jnp.int32), v))(
        jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    )
    np.testing.assert_allclose(np.asarray(jax.vmap(st.total)(trees)), [3.0, 12.0])
    got = jax.vmap(st.get, in_axes=(0, None))(trees, jnp.array([[2, 0]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), [[[2, 0]], [[5, 3]]])


@pytest.mark.parametrize("capacity, fanout", [(3, 4), (100, 16), (10**5, 16), (10**5, 32768)])
def test_layout_keeps_the_top_block_in_top_and_sums_exact(capacity, fanout):
    """``top`` always holds the last level (even when one row of it is over ``TOP_BYTES``),
    the arrays' rows are every level's, and the total is the leaves' sum after updates."""
    tree = st.init(capacity, fanout)
    sizes = level_sizes(capacity, fanout)
    rows = sum(sizes[1:]) // fanout
    assert tree.nodes.shape[1] + tree.top.shape[1] == rows
    assert (tree.top.shape[1] > 0) == (rows > 0)
    vals = np.random.default_rng(0).random(capacity).astype(np.float32)
    tree = st.set(tree, np.arange(capacity, dtype=np.int32), vals)
    np.testing.assert_allclose(float(st.total(tree)), vals.astype(np.float64).sum(), rtol=1e-5)
    assert float(st.min(tree)) == vals[vals > 0].min()
    full = st.rebuild(tree)
    for got, want in ((tree.nodes, full.nodes), (tree.top, full.top)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
