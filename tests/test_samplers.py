"""Samplers: drawn indices point at stored items, each item once per epoch without
replacement, uniformity (chi-square), and the empty-buffer contract. Properties run eagerly and
under jax.jit."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

import functional_rb as frb

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@functools.lru_cache(maxsize=None)
def fns(rb, jit):
    if jit:
        return jax.jit(rb.add), jax.jit(rb.sample, static_argnames="batch_size")
    return rb.add, rb.sample


def stored_positions(rb, state):
    ctx = rb.context(state)
    lay = ctx.layout
    filled = int(ctx.filled)
    return {e * lay.row_capacity + t for e in range(lay.num_envs) for t in range(filled)}


@JIT
@given(ndim=st.sampled_from([1, 2]), row_cap=st.sampled_from([2, 5]),
       steps=st.lists(st.sampled_from([1, 3, 6]), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_random_sampler_indices_point_at_stored_items(jit, ndim, row_cap, steps, seed):
    num_envs = 2 if ndim == 2 else 1
    rb = frb.ReplayBuffer(capacity=num_envs * row_cap, batch_size=16, ndim=ndim)
    ex = {"v": jnp.zeros((num_envs,), jnp.int32)} if ndim == 2 else {"v": jnp.int32(0)}
    state = rb.init(ex)
    add, sample = fns(rb, jit)
    key = jax.random.key(seed)
    counter = 1
    for T in steps:
        shape = (num_envs, T) if ndim == 2 else (T,)
        v = (counter + np.arange(np.prod(shape))).reshape(shape).astype(np.int32)
        counter += v.size
        state = add(state, {"v": v})
        key, k = jax.random.split(key)
        s, state = sample(state, k)
        idx = np.asarray(s.indices)
        assert idx.dtype == np.int32 and idx.shape == (16,)
        assert set(idx.tolist()) <= stored_positions(rb, state)
        assert bool(s.mask.all()) and np.all(np.asarray(s.weights) == 1.0)
        # the data is the item stored at that index (never a zero-filled slot)
        np.testing.assert_array_equal(np.asarray(s.data["v"]),
                                      np.asarray(rb.get(state, idx)["v"]))
        assert np.all(np.asarray(s.data["v"]) > 0)


@JIT
@given(shuffle=st.booleans(), drop_last=st.booleans(), n=st.integers(1, 7),
       bs=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2**16))
def test_without_replacement_each_item_once_per_epoch(jit, shuffle, drop_last, n, bs, seed):
    cap = 8
    rb = frb.ReplayBuffer(capacity=cap, batch_size=bs,
                          sampler=frb.SamplerWithoutReplacement(drop_last=drop_last,
                                                                shuffle=shuffle))
    add, sample = fns(rb, jit)
    state = add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(n, dtype=np.int32)})
    key = jax.random.key(seed)
    if drop_last and n < bs:
        assert not bool(rb.can_sample(state))
        return
    n_batches = n // bs if drop_last else -(-n // bs)
    for _epoch in range(2):
        seen = []
        for _ in range(n_batches):
            key, k = jax.random.split(key)
            s, state = sample(state, k)
            m = np.asarray(s.mask)
            # padding (drop_last=False, last batch) is masked with zero weight, valid index
            assert np.all(np.asarray(s.weights)[~m] == 0) and np.all(np.asarray(s.weights)[m] == 1)
            assert np.all((np.asarray(s.indices) >= 0) & (np.asarray(s.indices) < cap))
            seen += np.asarray(s.data["v"])[m].tolist()
        if drop_last:
            assert len(seen) == n_batches * bs and len(set(seen)) == len(seen)
            assert set(seen) <= set(range(n))
        else:
            assert sorted(seen) == list(range(n))  # each item exactly once
        if not shuffle:
            assert seen == sorted(seen)  # storage order


def test_random_sampler_is_uniform_chi_square():
    n, draws = 37, 37 * 400  # 37 of 64 slots filled: not a power of two, not full
    rb = frb.ReplayBuffer(capacity=64, batch_size=draws)
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(n, dtype=np.int32)})
    s, _ = jax.jit(rb.sample)(state, jax.random.key(1234))
    counts = np.bincount(np.asarray(s.indices), minlength=64)
    assert counts[n:].sum() == 0
    assert stats.chisquare(counts[:n]).pvalue > 1e-3


def test_random_sampler_ndim2_is_uniform_chi_square():
    rb = frb.ReplayBuffer(capacity=3 * 10, batch_size=3 * 7 * 400, ndim=2)
    state = rb.init({"v": jnp.zeros((3,), jnp.int32)})
    state = rb.add(state, {"v": np.ones((3, 7), np.int32)})  # 7 of 10 steps per row filled
    s, _ = jax.jit(rb.sample)(state, jax.random.key(99))
    env, t = np.asarray(s.indices) // 10, np.asarray(s.indices) % 10
    assert t.max() < 7
    counts = np.bincount(env * 7 + t, minlength=21)
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("sampler", [frb.RandomSampler(), frb.SamplerWithoutReplacement(),
                                     frb.SamplerWithoutReplacement(drop_last=True)],
                         ids=["random", "without_replacement", "drop_last"])
def test_empty_buffer_eager_raises_jit_masks(sampler):
    rb = frb.ReplayBuffer(capacity=8, batch_size=4, sampler=sampler)
    state = rb.init({"v": jnp.float32(0)})
    assert not bool(rb.can_sample(state))
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(0))
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not bool(s.mask.any())
    assert np.all(np.asarray(s.weights) == 0) and np.all(np.isfinite(np.asarray(s.weights)))
    idx = np.asarray(s.indices)
    assert idx.dtype == np.int32 and np.all((idx >= 0) & (idx < 8))


def test_update_is_a_noop_for_uniform_samplers():
    rb = frb.ReplayBuffer(capacity=8, batch_size=4)
    state = rb.add(rb.init({"v": jnp.float32(0)}), {"v": np.ones(5, np.float32)})
    new = rb.update(state, jnp.array([0, 1], jnp.int32), jnp.array([1.0, 2.0]))
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
