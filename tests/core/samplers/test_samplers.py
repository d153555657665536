"""Samplers: drawn indices point at stored items, each item once per epoch without
replacement, uniformity (chi-square), and the empty-buffer contract. Properties run eagerly and
under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.testing import assert_distribution, assert_invariants

# examples per property (and mode): half the profile's, to keep this file fast on 2 cores
HALF = settings(max_examples=max(4, settings().max_examples // 2))

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@functools.cache
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
@HALF
@given(
    ndim=st.sampled_from([1, 2]),
    row_cap=st.sampled_from([2, 5]),
    steps=st.lists(st.sampled_from([1, 3, 6]), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
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
        np.testing.assert_array_equal(np.asarray(s.data["v"]), np.asarray(rb.get(state, idx)["v"]))
        assert np.all(np.asarray(s.data["v"]) > 0)


class RingModel:
    """What a round-robin buffer holds: ``{flat position: value}`` over ``E`` rows of ``R``."""

    def __init__(self, num_envs, row_cap):
        self.e, self.r = num_envs, row_cap
        self.content, self.cursor, self.filled = {}, 0, 0

    def add(self, values):  # values [E, T]
        for j in range(values.shape[1]):
            for e in range(self.e):
                self.content[e * self.r + self.cursor] = int(values[e, j])
            self.cursor = (self.cursor + 1) % self.r
            self.filled = min(self.filled + 1, self.r)

    @property
    def stored(self):
        return {e * self.r + t for e in range(self.e) for t in range(self.filled)}


WR_OPS = st.lists(
    st.sampled_from([("add", 1), ("add", 4), ("add", 7), ("sample",), ("sample",), ("sample",)]),
    min_size=2,
    max_size=10,
)


@JIT
@HALF
@given(
    ndim=st.sampled_from([1, 2]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    bs=st.sampled_from([2, 3]),
    first=st.sampled_from([1, 3, 5, 7]),
    ops=WR_OPS,
    seed=st.integers(0, 2**16),
)
# always covered, ndim=2 and 1: adds that change the size in the middle of an epoch (a new one
# begins), a ring wrapped by one add (4 or 7 steps into rows of 3 or 6), an add into the full
# buffer in the middle of an epoch (the epoch goes on), completed epochs, padding, drop_last
@example(
    ndim=2,
    shuffle=True,
    drop_last=False,
    bs=2,
    first=1,
    ops=[
        ("sample",),
        ("add", 1),
        ("sample",),
        ("add", 4),
        ("sample",),
        ("add", 1),
        ("sample",),
        ("sample",),
        ("sample",),
    ],
    seed=1,
)
@example(
    ndim=1,
    shuffle=False,
    drop_last=False,
    bs=2,
    first=3,
    ops=[
        ("sample",),
        ("add", 1),
        ("sample",),
        ("sample",),
        ("sample",),
        ("add", 7),
        ("sample",),
        ("sample",),
        ("sample",),
    ],
    seed=2,
)
@example(
    ndim=1,
    shuffle=True,
    drop_last=True,
    bs=3,
    first=4,
    ops=[("sample",), ("sample",), ("add", 7), ("sample",), ("add", 1), ("sample",), ("sample",)],
    seed=3,
)
def test_without_replacement_each_item_once_per_epoch(
    jit, ndim, shuffle, drop_last, bs, first, ops, seed
):
    """Against a model of the ring and of the epochs (SamplerWithoutReplacement's documented
    rule: a new epoch begins when the previous one is exhausted, when the number of stored items
    changed, or with drop_last when fewer than batch_size remain). Values are 1, 2, 3, ... so a
    never-written slot (0) cannot pass for an item."""
    num_envs, row_cap = (2, 3) if ndim == 2 else (1, 6)
    rb = frb.ReplayBuffer(
        capacity=num_envs * row_cap,
        batch_size=bs,
        ndim=ndim,
        sampler=frb.SamplerWithoutReplacement(drop_last=drop_last, shuffle=shuffle),
    )
    add, sample = fns(rb, jit)
    ex = {"v": jnp.zeros((num_envs,), jnp.int32)} if ndim == 2 else {"v": jnp.int32(0)}
    state, model = rb.init(ex), RingModel(num_envs, row_cap)
    counter, key = 1, jax.random.key(seed)
    epoch, epoch_size, pos, drawn = 0, 0, 0, []
    for op in [("add", first)] + list(ops):
        if op[0] == "add":
            v = counter + np.arange(num_envs * op[1], dtype=np.int32).reshape(num_envs, op[1])
            counter += v.size
            state = add(state, {"v": v if ndim == 2 else v[0]})
            model.add(v)
            continue
        size = len(model.stored)
        if size < (bs if drop_last else 1):
            assert not bool(rb.can_sample(state))
            continue
        key, k = jax.random.split(key)
        if not jit and size < bs:
            # eagerly a batch larger than what is stored is refused (under jit: padded), and
            # the refused call leaves the state as it was
            with pytest.raises(ValueError, match="holds each item at most once"):
                sample(state, k)
            continue
        if epoch_size != size or epoch_size - pos <= 0 or (drop_last and epoch_size - pos < bs):
            epoch, epoch_size, pos, drawn = epoch + 1, size, 0, []
        valid = bs if drop_last else min(bs, epoch_size - pos)
        s, state = sample(state, k)
        idx, m = np.asarray(s.indices), np.asarray(s.mask)
        assert int(state.sampler.epoch) == epoch
        np.testing.assert_array_equal(m, np.arange(bs) < valid)  # padding last, masked
        np.testing.assert_array_equal(np.asarray(s.weights), m.astype(np.float32))
        # every index (masked-out ones too) points at a stored item; the data is that item
        assert idx.dtype == np.int32 and set(idx.tolist()) <= model.stored
        data = np.asarray(s.data["v"])
        np.testing.assert_array_equal(data, np.asarray(rb.get(state, idx)["v"]))
        np.testing.assert_array_equal(data, [model.content[i] for i in idx.tolist()])
        assert np.all(data >= 1)
        new = idx[m].tolist()
        assert len(set(new)) == len(new) and not set(new) & set(drawn)  # once per epoch
        drawn += new
        pos += valid
        if not shuffle:
            assert drawn == sorted(drawn)  # storage order
        assert_invariants(rb, state)  # the epoch is a permutation of stored items
        done = epoch_size - pos < bs if drop_last else pos == epoch_size
        if done:  # a whole epoch: every stored position exactly once (minus drop_last's rest)
            if drop_last:
                assert len(drawn) == epoch_size // bs * bs
            else:
                assert sorted(drawn) == sorted(model.stored)


# alpha=2e-3: the chi-square test at 1e-3, plus per-position binomial tests (Bonferroni)
def test_random_sampler_is_uniform_chi_square():
    n, draws = 37, 37 * 400  # 37 of 64 slots filled: not a power of two, not full
    rb = frb.ReplayBuffer(capacity=64, batch_size=draws)
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(n, dtype=np.int32)})
    expected = np.where(np.arange(64) < n, 1 / n, 0.0)  # an empty slot is never drawn
    assert_distribution(rb, state, expected, n=draws, seed=1234, alpha=2e-3)


def test_random_sampler_ndim2_is_uniform_chi_square():
    rb = frb.ReplayBuffer(capacity=3 * 10, batch_size=3 * 7 * 400, ndim=2)
    state = rb.init({"v": jnp.zeros((3,), jnp.int32)})
    state = rb.add(state, {"v": np.ones((3, 7), np.int32)})  # 7 of 10 steps per row filled
    expected = np.where(np.arange(30) % 10 < 7, 1 / 21, 0.0)  # flat positions env * 10 + t
    assert_distribution(rb, state, expected, n=3 * 7 * 400, seed=99, alpha=2e-3)


@pytest.mark.parametrize(
    "sampler",
    [
        frb.RandomSampler(),
        frb.SamplerWithoutReplacement(),
        frb.SamplerWithoutReplacement(drop_last=True),
    ],
    ids=["random", "without_replacement", "drop_last"],
)
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
