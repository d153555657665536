"""functional_rb.testing.assert_distribution / assert_frequencies: passes on the right
distribution and fails on a wrong one (fixed seeds), refuses too few draws (Cochran's rule),
fails at once on a draw of probability 0, and keeps its false-alarm rate below alpha
(Bonferroni over the chi-square test and the per-position binomial tests)."""

import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb.testing import assert_distribution, assert_frequencies


def _uniform_buffer(stored=37, capacity=64, **kw):
    rb = frb.ReplayBuffer(capacity=capacity, batch_size=512, **kw)
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(stored, dtype=np.int32)})
    return rb, state


def _uniform(stored, capacity):
    p = np.zeros(capacity)
    p[:stored] = 1 / stored
    return p


def test_passes_on_the_right_distribution_and_reports_it():
    rb, state = _uniform_buffer()
    result = assert_distribution(rb, state, _uniform(37, 64), n=37 * 400, seed=1234)
    assert result.counts.sum() >= 37 * 400 and result.counts[37:].sum() == 0
    assert result.df == 36 and result.pvalue > 1e-6 / 2 and result.alpha == 1e-6


def test_fails_on_a_wrong_distribution_with_a_fixed_seed():
    # prioritized draws (priorities 1..30, alpha=1) checked against the uniform distribution
    rb = frb.ReplayBuffer(
        capacity=30, batch_size=512, sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.4)
    )
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(30, dtype=np.int32)})
    prio = np.arange(1, 31, dtype=np.float32)
    state = rb.update(state, jnp.arange(30, dtype=jnp.int32), jnp.asarray(prio))
    with pytest.raises(
        AssertionError,
        match=r'rule "chi-square goodness of fit" is broken: '
        r".*Most deviant: position",
    ):
        assert_distribution(rb, state, np.full(30, 1 / 30), n=20_000, seed=0)
    assert_distribution(rb, state, prio / prio.sum(), n=20_000, seed=0)


def test_one_wrong_position_is_caught_by_its_binomial_test():
    # 200 positions, one of them twice as likely as it should be: diluted in the chi-square
    # statistic, but its own binomial test (at alpha / (2 K)) sees it
    k, n = 200, 200_000
    p = np.full(k, 1 / k)
    q = p.copy()
    q[17] *= 2
    q /= q.sum()
    counts = np.random.default_rng(5).multinomial(n, q)
    with pytest.raises(AssertionError, match=r"Most deviant: position 17: "):
        assert_frequencies(counts, p)


def test_a_draw_of_probability_zero_fails_at_once():
    rb, state = _uniform_buffer(stored=10, capacity=16)
    wrong = _uniform(9, 16)  # position 9 holds an item, but the expectation says never
    with pytest.raises(
        AssertionError,
        match=r'"no draws where the expected probability is 0".*'
        r"positions 9 \(",
    ):
        assert_distribution(rb, state, wrong, n=2_000)


def test_too_few_draws_for_the_chi_square_approximation_raise():
    rb, state = _uniform_buffer(stored=37)
    with pytest.raises(ValueError, match=r"Cochran's rule.*Draw n >= 185"):
        assert_distribution(rb, state, _uniform(37, 64), n=100, batch_size=50)
    with pytest.raises(ValueError, match="sum to 1"):
        assert_distribution(rb, state, np.full(64, 0.5), n=100)
    with pytest.raises(ValueError, match="one per flat storage position"):
        assert_distribution(rb, state, _uniform(37, 37), n=100)


def test_improbable_positions_are_pooled_for_the_chi_square_test():
    """Positions expecting fewer than 5 draws (zero priorities under eps) are pooled, joined
    to the least expected position when the pool expects fewer than 5 itself; their binomial
    tests still run one by one."""
    p = np.array([0.4, 0.3, 0.2, 0.1 - 4e-9, 1e-9, 1e-9, 1e-9, 1e-9])
    counts = np.random.default_rng(1).multinomial(10_000, p)
    result = assert_frequencies(counts, p)
    assert result.df == 3  # 4 groups: three positions alone, the fourth with the pool
    counts[5] += 3  # 3 draws of a 1e-9 position: its own binomial test rejects it
    with pytest.raises(AssertionError, match=r'"per-position binomial test".*position 5: 3'):
        assert_frequencies(counts, p)


def test_false_alarm_rate_is_below_alpha_and_power_is_high():
    """Bonferroni: over many correct multinomial samples the rejection rate stays below alpha
    (here alpha = 0.2, so it is measurable); a 10% relative error on a quarter of the
    positions is rejected every time."""
    rng = np.random.default_rng(0)
    p = rng.random(20) + 0.2
    p /= p.sum()
    trials, alpha = 400, 0.2
    alarms = 0
    for _ in range(trials):
        try:
            assert_frequencies(rng.multinomial(5_000, p), p, alpha=alpha)
        except AssertionError:
            alarms += 1
    # binomial(400, <= 0.2): mean <= 80, sd 8; six sd above is 128
    assert alarms / trials < alpha + 6 * np.sqrt(alpha * (1 - alpha) / trials)
    q = p.copy()
    q[:5] *= 1.1
    q /= q.sum()
    for _ in range(20):
        with pytest.raises(AssertionError):
            assert_frequencies(rng.multinomial(100_000, q), p)


def test_mapping_expectations_and_slice_starts():
    # SliceSampler: a uniform trajectory among the eligible ones, then a uniform start: with
    # episodes of 4, 2 and 3 steps and slice_len=2, starts {0, 1, 2}, {4}, {6, 7}
    done = np.zeros(9, bool)
    done[[3, 5, 8]] = True
    rb = frb.ReplayBuffer(capacity=12, batch_size=8, sampler=frb.SliceSampler(slice_len=2))
    ex = {"v": jnp.int32(0), "next": {"done": jnp.zeros((), bool)}}
    state = rb.add(rb.init(ex), {"v": np.arange(9, dtype=np.int32), "next": {"done": done}})
    expected = {0: 1 / 9, 1: 1 / 9, 2: 1 / 9, 4: 1 / 3, 6: 1 / 6, 7: 1 / 6}
    assert_distribution(rb, state, expected, n=12_000, seed=3)
    with pytest.raises(AssertionError, match="no draws where the expected probability is 0"):
        assert_distribution(rb, state, {0: 0.5, 4: 0.5}, n=2_000, seed=3)
