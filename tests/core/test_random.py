"""The hashed index words (functional_rb._internal.random): deterministic per key, uniform, independent
between positions and between keys (chi-square, fixed seeds, p > 1e-4 thresholds: a correct
generator fails one of these with probability ~1e-4 each, a biased one fails reliably)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from functional_rb._internal.random import bits32, uniform01

P_MIN = 1e-4


def _words(keys, n):
    return np.asarray(jax.jit(jax.vmap(lambda k: bits32(k, (n,))))(keys))


def test_same_key_same_words_under_jit_vmap_and_eagerly():
    key = jax.random.key(7)
    eager = np.asarray(bits32(key, (5, 3)))
    assert eager.dtype == np.uint32 and eager.shape == (5, 3)
    np.testing.assert_array_equal(np.asarray(jax.jit(bits32, static_argnums=1)(key, (5, 3))), eager)
    keys = jnp.stack([jax.random.key_data(key)] * 2)
    vm = np.asarray(jax.vmap(lambda k: bits32(jax.random.wrap_key_data(k), (5, 3)))(keys))
    np.testing.assert_array_equal(vm[0], eager)
    np.testing.assert_array_equal(vm[1], eager)
    # raw uint32 key data and every PRNG implementation are accepted
    np.testing.assert_array_equal(np.asarray(bits32(jax.random.key_data(key), (5, 3))), eager)
    rbg = np.asarray(bits32(jax.random.key(7, impl="rbg"), (15,)))
    assert rbg.shape == (15,) and not np.array_equal(rbg, eager.reshape(-1))
    with pytest.raises(TypeError, match="PRNG key"):
        bits32(jnp.zeros((2,), jnp.int32), (3,))


def test_words_are_uniform_in_every_byte():
    w = _words(jax.random.split(jax.random.key(0), 2000), 256).reshape(-1)  # 512k words
    for shift in (0, 8, 16, 24):
        counts = np.bincount((w >> shift) & 0xFF, minlength=256)
        assert stats.chisquare(counts).pvalue > P_MIN, shift


def test_neighbouring_positions_and_keys_are_independent():
    # pairs (word i, word i+1) of one key, and (word i of key k, word i of fold_in(k, 1))
    keys = jax.random.split(jax.random.key(1), 4000)
    w = _words(keys, 64)
    w2 = _words(jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys), 64)
    for a, b in ((w[:, :-1], w[:, 1:]), (w, w2)):
        cells = ((a >> 28) * 16 + (b >> 28)).reshape(-1)  # top 4 bits of each: 16 x 16 cells
        counts = np.bincount(cells, minlength=256)
        assert stats.chisquare(counts).pvalue > P_MIN
    # consecutive raw keys (PRNGKey(0), PRNGKey(1), ...) too: no structure leaks through
    raw = jnp.stack([jnp.array([0, i], jnp.uint32) for i in range(3000)])
    first = np.asarray(jax.vmap(lambda k: bits32(k, (1,)))(raw))[:, 0]
    counts = np.bincount(first >> 24, minlength=256)
    assert stats.chisquare(counts).pvalue > P_MIN


def test_uniform01_is_in_range_and_uniform():
    u = np.asarray(
        jax.jit(jax.vmap(lambda k: uniform01(k, (500,))))(jax.random.split(jax.random.key(3), 400))
    ).reshape(-1)
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > P_MIN
