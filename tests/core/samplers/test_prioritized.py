"""Tests for functional_rb.samplers.prioritized.PrioritizedSampler through ReplayBuffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

import functional_rb as frb
from functional_rb.samplers import sum_tree
from functional_rb.testing import assert_distribution, assert_invariants

EPS = 1e-8


def _buffer(capacity, alpha=0.6, beta=0.4, batch_size=4, **kw):
    return frb.ReplayBuffer(
        capacity,
        sampler=frb.PrioritizedSampler(alpha=alpha, beta=beta, **kw),
        batch_size=batch_size,
    )


def _filled(rb, n, prios=None):
    state = rb.init({"x": jnp.zeros((), jnp.int32)})
    state = rb.add(state, {"x": jnp.arange(n, dtype=jnp.int32)})
    if prios is not None:
        state = rb.update(state, jnp.arange(n, dtype=jnp.int32), jnp.asarray(prios, jnp.float32))
    return state


def _values(p, alpha):
    return (np.asarray(p, np.float32) + np.float32(EPS)) ** np.float32(alpha)


def test_exports():
    assert "PrioritizedSampler" in frb.__all__ and "sum_tree" in frb.__all__
    assert frb.sum_tree is sum_tree


@pytest.mark.parametrize(
    "alpha,shape", [(0.0, "uniform"), (0.6, "heavy"), (1.0, "zeros"), (0.5, "steps")]
)
def test_sampling_distribution_chi_square(alpha, shape):
    rng = np.random.default_rng(7)
    n_items = 30
    prios = {
        "uniform": rng.random(n_items),
        "heavy": rng.pareto(1.5, n_items),
        "zeros": rng.random(n_items) * (rng.random(n_items) < 0.6),
        "steps": np.repeat([0.1, 1.0, 10.0], 10),
    }[shape]
    # One slot stays empty: it must never be drawn (probability 0).
    rb = _buffer(n_items + 1, alpha=alpha, batch_size=30_000)
    state = _filled(rb, n_items, prios)
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(11))
    assert sample.mask.all()
    v = np.append(_values(prios, alpha).astype(np.float64), 0.0)
    # the chi-square test at 1e-3 plus per-position binomial tests (alpha=2e-3, Bonferroni)
    assert_distribution(rb, state, v / v.sum(), n=30_000, seed=11, alpha=2e-3)


def test_weights_closed_form_and_beta_override(maybe_jit):
    prios = np.array([0.5, 2.0, 0.0, 7.0, 1.0], np.float32)
    alpha, beta = 0.7, 0.4
    rb = _buffer(8, alpha=alpha, beta=beta, batch_size=64)
    state = _filled(rb, 5, prios)
    v = _values(prios, alpha).astype(np.float64)
    prob = v / v.sum()
    n = 5
    for b in (None, 1.0, 0.0):
        kw = {} if b is None else {"beta": jnp.float32(b)}
        sample, _ = maybe_jit(rb.sample)(state, jax.random.key(0), **kw)
        bb = beta if b is None else b
        w_all = (n * prob) ** -bb
        expect = w_all[np.asarray(sample.indices)] / w_all.max()
        np.testing.assert_allclose(np.asarray(sample.weights), expect, rtol=2e-5)
    # beta is a traced value under jit: annealing does not retrace.
    f = jax.jit(rb.sample)
    f(state, jax.random.key(1), beta=jnp.float32(0.5))
    f(state, jax.random.key(1), beta=jnp.float32(0.9))
    assert f._cache_size() == 1


def test_new_items_get_max_priority_and_wrap_overwrites():
    alpha = 0.5
    rb = _buffer(4, alpha=alpha)
    state = _filled(rb, 4, [0.1, 3.0, 0.2, 0.3])
    np.testing.assert_allclose(float(state.sampler.max_priority), 3.0)
    state = rb.add(state, {"x": jnp.arange(2, dtype=jnp.int32)})  # overwrites slots 0 and 1
    np.testing.assert_allclose(
        np.asarray(state.sampler.tree.leaves), _values([3.0, 3.0, 0.2, 0.3], alpha), rtol=1e-6
    )
    fresh = _filled(_buffer(4, alpha=alpha, max_priority_init=2.0), 2)
    np.testing.assert_allclose(
        np.asarray(fresh.sampler.tree.leaves),
        _values([2.0, 2.0, 0, 0], alpha) * [1, 1, 0, 0],
        rtol=1e-6,
    )


def test_bad_priorities_eager_raise():
    rb = _buffer(4)
    state = _filled(rb, 4)
    for bad, word in ((-1.0, "-1.0"), (np.nan, "nan"), (np.inf, "inf")):
        with pytest.raises(ValueError, match=r"priorities\[2\] \(storage index 3\).*" + word):
            rb.update(state, jnp.array([0, 1, 3], jnp.int32), jnp.array([1.0, 2.0, bad]))
    with pytest.raises(ValueError, match=r"indices\[0\] = 9 is outside \[0, 4\)"):
        rb.update(state, jnp.array([9], jnp.int32), jnp.array([1.0]))


def test_bad_priorities_under_jit_are_ignored():
    # The error policy under jit: a NaN, negative or infinite priority and an out-of-range
    # index leave the state as it was; valid entries of the same call are applied.
    rb = _buffer(6, batch_size=512)
    state = _filled(rb, 6, [0.5, 0.25, 2.0, 1.0, 1.0, 1.0])
    before = np.asarray(state.sampler.tree.leaves)
    upd = jax.jit(rb.update)
    state = upd(
        state,
        jnp.array([0, 1, 2, 7, 5], jnp.int32),
        jnp.array([np.nan, -1.0, np.inf, 5.0, 0.75], jnp.float32),
    )
    leaves = np.asarray(state.sampler.tree.leaves)
    np.testing.assert_array_equal(leaves[:5], before[:5])
    np.testing.assert_allclose(leaves[5], _values([0.75], 0.6)[0], rtol=1e-6)
    assert np.isfinite(float(sum_tree.total(state.sampler.tree)))
    assert float(state.sampler.max_priority) == 2.0  # bad and out-of-range ones are ignored
    # every entry bad: the state is unchanged, bit for bit
    again = upd(state, jnp.arange(6, dtype=jnp.int32), jnp.full((6,), np.nan, jnp.float32))
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_all_zero_values_under_jit_mask_and_eagerly_raise():
    # eps=0 and priority 0: stored values 0, so nothing can be drawn.
    rb = _buffer(6, batch_size=512, eps=0.0)
    state = _filled(rb, 6, np.zeros(6))
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not sample.mask.any()
    np.testing.assert_array_equal(np.asarray(sample.weights), 0)
    assert ((np.asarray(sample.indices) >= 0) & (np.asarray(sample.indices) < 6)).all()
    assert not bool(rb.can_sample(state))
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(0))


def test_empty_buffer_under_jit_masks():
    rb = _buffer(5)
    state = rb.init({"x": jnp.zeros((), jnp.int32)})
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not sample.mask.any() and (np.asarray(sample.weights) == 0).all()
    # Updating positions that hold no item is ignored (they stay undrawable).
    state = jax.jit(rb.update)(state, jnp.array([0, 3], jnp.int32), jnp.array([1.0, 2.0]))
    assert float(sum_tree.total(state.sampler.tree)) == 0.0


def test_ndim2_only_stored_elements_are_drawn():
    num_envs, row = 3, 5
    rb = frb.ReplayBuffer(
        num_envs * row, sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.5), batch_size=200, ndim=2
    )
    state = rb.init({"x": jnp.zeros((num_envs,), jnp.int32)})
    state = rb.add(state, {"x": jnp.arange(num_envs * 2, dtype=jnp.int32).reshape(num_envs, 2)})
    sample, state = jax.jit(rb.sample)(state, jax.random.key(0))
    env, t = np.divmod(np.asarray(sample.indices), row)
    assert sample.mask.all() and (t < 2).all() and set(env) == {0, 1, 2}
    np.testing.assert_array_equal(np.asarray(sample.data["x"]), env * 2 + t)
    leaves = np.asarray(state.sampler.tree.leaves).reshape(num_envs, row)
    assert (leaves[:, 2:] == 0).all() and (leaves[:, :2] > 0).all()
    state = rb.update(state, sample.indices, jnp.ones((200,)) * 4.0)
    assert float(state.sampler.max_priority) == 4.0


def test_max_value_writer_masked_positions_untouched():
    rb = frb.ReplayBuffer(
        3,
        sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.5),
        writer=frb.MaxValueWriter("rank"),
        batch_size=8,
    )
    state = rb.init({"rank": jnp.float32(0)})
    state = rb.add(state, {"rank": jnp.array([5.0, 6.0, 7.0])})
    state = rb.update(state, jnp.arange(3, dtype=jnp.int32), jnp.array([1.0, 2.0, 0.5]))
    before = np.asarray(state.writer.ranks)
    # rank 1.0 is rejected (masked): no slot changes; rank 9.0 replaces the lowest-ranked slot,
    # which takes the running maximum priority 2.0.
    state = rb.add(state, {"rank": jnp.array([1.0, 9.0])})
    slot = int(np.argmin(before))
    assert float(state.writer.ranks[slot]) == 9.0
    expect = _values([1.0, 2.0, 0.5], 1.0)
    expect[slot] = _values(2.0, 1.0)
    np.testing.assert_allclose(np.asarray(state.sampler.tree.leaves), expect, rtol=1e-6)


_FNS = {}


def _reference_run(capacity, alpha, ops):
    """NumPy reference of a ring buffer with a prioritized sampler."""
    leaves = np.zeros(capacity, np.float32)
    maxp, cursor, filled = np.float32(1.0), 0, 0
    for op in ops:
        if op[0] == "add":
            for _ in range(op[1]):
                leaves[cursor] = _values(maxp, alpha)
                cursor = (cursor + 1) % capacity
                filled = min(filled + 1, capacity)
        else:
            _, idx, pr = op
            for i, p in zip(idx, pr):
                if 0 <= i < filled:
                    leaves[i] = _values(p, alpha)
                    maxp = max(maxp, np.float32(p))
    return leaves, maxp


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st_.lists(
        st_.one_of(
            st_.tuples(st_.just("add"), st_.sampled_from([1, 3, 8])),
            st_.tuples(
                st_.just("upd"),
                st_.lists(st_.integers(0, 5), min_size=4, max_size=4),
                st_.lists(st_.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0]), min_size=4, max_size=4),
            ),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_matches_reference_after_adds_and_updates(maybe_jit, ops):
    """Adds (with ring wrap-around) and updates (with duplicates and unstored indices) leave the
    tree equal to a brute-force reference; every sampled item has a nonzero value."""
    capacity, alpha = 6, 0.8
    rb = _buffer(capacity, alpha=alpha, batch_size=16)
    # One set of functions per mode for all examples (a fresh jax.jit per example recompiles).
    add, upd, smp = _FNS.setdefault(
        maybe_jit is jax.jit, tuple(maybe_jit(f) for f in (rb.add, rb.update, rb.sample))
    )
    state = rb.init({"x": jnp.zeros((), jnp.int32)})
    for op in ops:
        if op[0] == "add":
            state = add(state, {"x": jnp.zeros((op[1],), jnp.int32)})
        else:
            state = upd(state, jnp.asarray(op[1], jnp.int32), jnp.asarray(op[2], jnp.float32))
    leaves, maxp = _reference_run(capacity, alpha, ops)
    np.testing.assert_allclose(np.asarray(state.sampler.tree.leaves), leaves, rtol=1e-6)
    assert float(state.sampler.max_priority) == maxp
    assert_invariants(rb, state)  # the tree's nodes, total and minima; nothing on empty slots
    if int(state.writer.filled):
        sample, _ = smp(state, jax.random.key(len(ops)))
        assert sample.mask.all()
        assert (leaves[np.asarray(sample.indices)] > 0).all()


def test_ring_adds_update_the_tree_by_runs(maybe_jit):
    # A multi-level tree (1000 leaves, fan-out 16): ring adds that wrap, of sizes that do and do
    # not divide the capacity, give every written slot the new-item value, leave every other
    # slot alone and keep each node the sum/min of its children (a ring writer's run of slots
    # is applied to the tree by ranges).
    rb = _buffer(1000, alpha=0.5, batch_size=8)
    add = maybe_jit(rb.add)
    state = rb.init({"x": jnp.zeros((), jnp.float32)})
    expect = np.zeros(1000, np.float32)
    cursor = added = 0
    for step, n in enumerate((300, 7, 256, 999)):
        new_value = (np.float32(state.sampler.max_priority) + np.float32(1e-8)) ** np.float32(0.5)
        state = add(state, {"x": jnp.zeros((n,), jnp.float32)})
        expect[(cursor + np.arange(n)) % 1000] = new_value
        cursor, added = (cursor + n) % 1000, added + n
        tree = state.sampler.tree
        np.testing.assert_allclose(np.asarray(tree.leaves), expect, rtol=1e-6)
        full = sum_tree.rebuild(tree)
        np.testing.assert_array_equal(np.asarray(tree.sums), np.asarray(full.sums))
        np.testing.assert_array_equal(np.asarray(tree.mins), np.asarray(full.mins))
        # new priorities for a third of the stored items, so that later adds overwrite slots
        # of differing values
        idx = np.arange(step % 3, min(added, 1000), 3, dtype=np.int32)
        state = rb.update(state, jnp.asarray(idx), jnp.full(idx.shape, 2.0 + step, jnp.float32))
        expect = np.asarray(state.sampler.tree.leaves).copy()
        np.testing.assert_allclose(expect[idx], (2.0 + step + 1e-8) ** 0.5, rtol=1e-6)


def test_scan_add_sample_update():
    rb = _buffer(64, batch_size=8)
    state = rb.init({"x": jnp.zeros((2,), jnp.float32)})

    def step(carry, key):
        state, acc = carry
        state = rb.add(state, {"x": jnp.ones((4, 2), jnp.float32)})
        sample, state = rb.sample(state, key)
        state = rb.update(state, sample.indices, jnp.abs(sample.data["x"][:, 0]) * 2.0)
        return (state, acc + sample.data["x"].sum() + sample.weights.sum()), None

    (state, acc), _ = jax.jit(lambda s, k: jax.lax.scan(step, (s, 0.0), jax.random.split(k, 20)))(
        state, jax.random.key(0)
    )
    assert float(acc) > 0
    assert float(state.sampler.max_priority) == 2.0


def test_constructor_validation():
    with pytest.raises(ValueError, match="alpha"):
        frb.PrioritizedSampler(alpha=-1.0, beta=0.4)
    with pytest.raises(TypeError, match="beta"):
        frb.PrioritizedSampler(alpha=0.5, beta="x")
    with pytest.raises(ValueError, match="max_priority_init"):
        frb.PrioritizedSampler(alpha=0.5, beta=0.4, max_priority_init=0.0)
    hash(frb.PrioritizedSampler(alpha=0.5, beta=0.4))
