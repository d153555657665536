"""Does a sampler draw what it should? Goodness-of-fit checks with a sound threshold.

:func:`assert_distribution` draws ``n`` items from a buffer state and compares the counts per
flat storage position with expected probabilities; :func:`assert_frequencies` does the same for
counts you already have.

The threshold. One call makes ``1 + K`` tests on the ``K`` positions of positive probability:

* Pearson's chi-square test of the whole distribution, which is powerful against deviations
  spread over many positions;
* an exact two-sided binomial test per position, powerful against one badly wrong position
  (which the chi-square test dilutes among the others).

Bonferroni's inequality bounds the probability that any of them rejects a correct sampler by
``alpha``: the chi-square test is run at level ``alpha / 2`` and each binomial test at
``alpha / (2 K)``. So a correct sampler fails one call with probability at most ``alpha``
(default ``1e-6``: with fixed seeds a test suite of a thousand such calls stays green with
probability above 0.999). The chi-square approximation needs every expected count to be at
least 5 (Cochran's rule): positions expecting fewer are pooled into one group (joined to the
least expected position when the pool itself expects fewer than 5), so the chi-square test
runs on groups that each expect at least 5, with ``groups - 1`` degrees of freedom; when
fewer than two such groups remain the call raises ``ValueError`` naming the ``n`` needed. The
binomial tests are exact and run on every position. A draw at a position of probability 0
fails at once.

Draws without replacement are not independent; their counts are more even than independent
draws' would be, so the test stays valid (conservative) for them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np


class FrequencyTest(NamedTuple):
    """The outcome of a frequency check (returned when it passes)."""

    counts: np.ndarray  # int64 [K]: draws per position
    expected: np.ndarray  # float64 [K]: expected probabilities (normalized)
    statistic: float  # Pearson's chi-square statistic over the groups of positions
    df: int  # its degrees of freedom: groups - 1
    pvalue: float  # chi-square p-value
    cell_pvalues: np.ndarray  # float64 [K]: two-sided binomial p-value per position (1 where p=0)
    alpha: float  # the family-wise false-alarm bound


def _scipy_stats():
    try:
        from scipy import stats
    except ImportError as e:  # pragma: no cover - scipy is in the test extra
        raise ImportError(
            "functional_rb.testing needs scipy for its statistical checks: "
            'pip install -c constraints.txt ".[test]" (from a clone of functional_rb)'
        ) from e
    return stats


def _probabilities(expected_probs, size: int | None, where: str) -> np.ndarray:
    if isinstance(expected_probs, Mapping):
        if size is None:
            size = max(int(k) for k in expected_probs) + 1
        p = np.zeros(size)
        for k, v in expected_probs.items():
            p[int(k)] = float(v)
    else:
        p = np.asarray(expected_probs, np.float64).reshape(-1)
        if size is not None and p.shape[0] != size:
            raise ValueError(
                f"{where}: expected_probs has {p.shape[0]} entries, expected one "
                f"per flat storage position ({size})."
            )
    if not np.all(np.isfinite(p)) or np.any(p < 0) or abs(p.sum() - 1.0) > 1e-4:
        raise ValueError(
            f"{where}: expected_probs must be finite, >= 0 and sum to 1 (within "
            f"1e-4), got sum {p.sum()!r} and minimum {p.min()!r}."
        )
    return p / p.sum()


def _cochran_cells(expected: np.ndarray) -> list:
    """Groups of positions (index arrays into ``expected``) for the chi-square test: each
    position expecting at least 5 draws alone; the others pooled into one group, which joins
    the least expected group when it expects fewer than 5 itself."""
    small = expected < 5
    cells = [np.array([i]) for i in np.flatnonzero(~small)]
    if small.any():
        pool = np.flatnonzero(small)
        if expected[pool].sum() >= 5 or not cells:
            cells.append(pool)
        else:
            j = int(np.argmin([expected[c].sum() for c in cells]))
            cells[j] = np.concatenate([cells[j], pool])
    return [c for c in cells if expected[c].sum() >= 5]


def assert_frequencies(
    counts,
    expected_probs,
    *,
    alpha: float = 1e-6,
    what: str = "draws",
    where: str = "assert_frequencies",
) -> FrequencyTest:
    """Check counts (int ``[K]``) against expected probabilities (``[K]``, or a mapping
    ``{position: probability}``). Raises ``AssertionError`` naming the rule broken and the most
    deviant positions; see the module docstring for the threshold."""
    if not 0 < alpha < 1:
        raise ValueError(f"{where}: alpha must be in (0, 1), got {alpha!r}.")
    counts = np.asarray(counts, np.int64).reshape(-1)
    p = _probabilities(expected_probs, counts.shape[0], where)
    n = int(counts.sum())
    impossible = np.flatnonzero((p == 0) & (counts > 0))
    if impossible.size:
        drawn = ", ".join(f"{int(i)} ({int(counts[i])} times)" for i in impossible[:8])
        raise AssertionError(
            f'{where}: rule "no draws where the expected probability is 0" is broken: positions '
            f"{drawn} were drawn but have expected probability 0. The sampler draws items it "
            "must never return (empty slots, zero priorities, invalid slice starts)."
        )
    support = np.flatnonzero(p > 0)
    k = support.size
    cells = _cochran_cells(n * p[support])
    if n == 0 or len(cells) < 2:
        need = math.ceil(5 / p[support].min()) if k else 0
        raise ValueError(
            f"{where}: {n} {what} leave fewer than two groups of positions that each expect "
            f"at least 5 draws (Cochran's rule for the chi-square test). Draw n >= {need}."
        )
    stats = _scipy_stats()
    obs = counts[support]
    exp_c = np.array([n * p[support][c].sum() for c in cells])
    obs_c = np.array([obs[c].sum() for c in cells])
    statistic = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    df = len(cells) - 1
    pvalue = float(stats.chi2.sf(statistic, df))
    cell = np.ones(counts.shape[0])
    lo = stats.binom.cdf(obs, n, p[support])
    hi = stats.binom.sf(obs - 1, n, p[support])
    cell[support] = np.minimum(1.0, 2 * np.minimum(lo, hi))
    result = FrequencyTest(counts, p, statistic, df, pvalue, cell, alpha)
    chi_fail, cell_fail = pvalue < alpha / 2, cell.min() < alpha / (2 * k)
    if chi_fail or cell_fail:
        worst = np.argsort(cell)[:5]
        dev = "; ".join(
            f"position {int(i)}: {int(counts[i])} drawn, {n * p[i]:.1f} expected "
            f"(binomial p = {cell[i]:.2g})"
            for i in worst
        )
        rule = "chi-square goodness of fit" if chi_fail else "per-position binomial test"
        raise AssertionError(
            f'{where}: rule "{rule}" is broken: {n} {what} do not follow expected_probs. '
            f"Chi-square = {statistic:.4g} with {df} degrees of freedom over {len(cells)} "
            f"groups of positions, p = {pvalue:.3g} "
            f"(threshold alpha/2 = {alpha / 2:.3g}); smallest per-position p = {cell.min():.3g} "
            f"(threshold alpha/(2K) = {alpha / (2 * k):.3g}, K = {k}). Bonferroni: a correct "
            f"sampler fails with probability at most alpha = {alpha:g}. Most deviant: {dev}."
        )
    return result


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _draw(rb, state, key, calls: int, batch_size):
    """Starts (the first index of a slice) and their mask of ``calls`` samples, flat."""

    def body(st, k):
        s, st = rb.sample(st, k, batch_size=batch_size)
        idx, mask = s.indices, s.mask
        if idx.ndim == 2:
            idx, mask = idx[:, 0], mask[:, 0]
        return st, (idx, mask)

    _, (idx, mask) = jax.lax.scan(body, state, jax.random.split(key, calls))
    return idx.reshape(-1), mask.reshape(-1)


def assert_distribution(
    rb,
    state,
    expected_probs,
    n: int = 20_000,
    seed: int = 0,
    *,
    alpha: float = 1e-6,
    batch_size: int | None = None,
) -> FrequencyTest:
    """Draw about ``n`` items from ``state`` and check their distribution.

    Args:
      rb, state: the buffer and one state it can sample from.
      expected_probs: the probability of each flat storage position, ``[capacity]`` (or a
        mapping ``{position: probability}``). Slice samplers: the probability that a slice
        starts at the position (their draws are counted by ``Sample.indices[:, 0]``).
      n: draws (rounded up to whole calls of ``batch_size``; masked draws are not counted).
      seed: the PRNG seed (``jax.random.key(seed)``), so a failure reproduces.
      alpha: the bound on the false-alarm probability (see the module docstring).
      batch_size: per call (default: the buffer's).

    The draws run in one jitted ``lax.scan`` that carries the state (samplers without
    replacement advance). Returns a :class:`FrequencyTest`; raises ``AssertionError``.
    """
    if not bool(rb.can_sample(state)):
        raise ValueError(
            "assert_distribution: this state cannot be sampled "
            "(rb.can_sample(state) is False); add items first."
        )
    probe = jax.eval_shape(
        lambda st: rb.sample(st, jax.random.key(0), batch_size=batch_size)[0], state
    )
    per_call = probe.indices.shape[0]
    calls = max(1, math.ceil(n / per_call))
    idx, mask = jax.device_get(_draw(rb, state, jax.random.key(seed), calls, batch_size))
    idx = np.asarray(idx)[np.asarray(mask)]
    if idx.size and (idx.min() < 0 or idx.max() >= rb.capacity):
        raise AssertionError(
            f'assert_distribution: rule "indices in range" is broken: the sampler drew index '
            f"{int(idx.min() if idx.min() < 0 else idx.max())} outside [0, {rb.capacity})."
        )
    counts = np.bincount(idx, minlength=rb.capacity)
    what = f"draws by {type(rb.sampler).__name__} (seed {seed})"
    return assert_frequencies(
        counts[: rb.capacity], expected_probs, alpha=alpha, what=what, where="assert_distribution"
    )
