"""``uniform_index``: uniform draws in ``[0, n)`` from hashed words, one word per draw up to
2**20 items, two above (a 64-bit fraction times ``n``, computed in uint32 arithmetic)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from functional_rb._internal.random import bits32
from functional_rb.samplers import uniform_index

BIG = 2**31 - 1  # any capacity above 2**20 takes the two-word path
P_MIN = 1e-3


@pytest.mark.parametrize("n", [1, 2, 7, 2**20 + 1, 10**8, 3 * 2**29 + 5, BIG])
def test_two_word_draws_are_the_exact_64_bit_multiply_shift(n, maybe_jit):
    key = jax.random.key(3)
    got = np.asarray(maybe_jit(lambda k, n: uniform_index(k, (512,), n, BIG))(key, jnp.int32(n)))
    words = np.asarray(bits32(key, (512, 2))).astype(object)
    want = [(int(hi) * 2**32 + int(lo)) * n >> 64 for hi, lo in words]
    assert got.dtype == np.int32
    assert got.tolist() == want
    assert got.min() >= 0 and got.max() < n


def test_two_word_draws_are_uniform_over_a_large_range():
    n = 3 * 10**8 + 7  # not a power of two: a biased mapping shows in the top bins
    draws = np.asarray(
        jax.jit(lambda k: uniform_index(k, (200_000,), jnp.int32(n), BIG))(jax.random.key(0))
    )
    counts = np.bincount(draws.astype(np.int64) * 40 // n, minlength=40)
    assert stats.chisquare(counts).pvalue > P_MIN
    # the low digits too (a multiply-shift uses the high bits of the product)
    assert stats.chisquare(np.bincount(draws % 7, minlength=7)).pvalue > P_MIN


def test_one_word_path_below_the_threshold_is_unchanged():
    key, n = jax.random.key(5), 10_000
    got = np.asarray(uniform_index(key, (256,), jnp.int32(n), 2**20))
    words = np.asarray(bits32(key, (256,))).astype(object)
    assert got.tolist() == [int(w) * n >> 32 for w in words]
