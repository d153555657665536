"""Global sampling over 2, 4 and 8 shards draws what a single buffer holding the same items
draws (chi-square, fixed seeds): uniform over stored items with unequally full shards,
prioritized proportionally to the global priorities with the single buffer's weights (global N
and minimum), slices uniform over all eligible trajectories. Local sampling: each shard's own
draws, with weights of the distribution actually used."""

import numpy as np
import pytest
from _shards import CAP, PRIO, UNIFORM, build, draws, mesh
from scipy import stats

import functional_rb as frb

P_MIN = 1e-3  # fixed seeds: the p-values are deterministic; this only guards real mismatches


def _shards(ci):
    """2, 4 and 8 shards; CI runs the counts in ``ci`` (every kind of draw and every shard
    count is covered there), the others are the long version (FRB_SLOW=1): each one is a
    compilation of its own, which dominates these tests."""
    return [n if n in ci else pytest.param(n, marks=pytest.mark.slow) for n in (2, 4, 8)]


def _chisquare(observed: dict, expected: dict, total: int):
    keys = sorted(expected)
    obs = np.array([observed.get(k, 0) for k in keys], float)
    exp = np.array([expected[k] for k in keys], float)
    exp = exp / exp.sum() * obs.sum()
    assert set(observed) <= set(expected), sorted(set(observed) - set(expected))
    assert exp.min() >= 5, "too few draws per bin for a chi-square test"
    return stats.chisquare(obs, exp).pvalue


def _fills(n):
    # unequal: a full shard that wrapped around, partly full ones, an empty one (n >= 4)
    return [CAP + 5, 3, 11, 0, 7, 16, 1, 9][:n] if n > 2 else [CAP + 5, 3]


def _ids(n):
    """Shard s holds items whose id is its global index (s * CAP + position)."""
    return [s * CAP + np.arange(fill) % CAP for s, fill in enumerate(_fills(n))]


def _stored(n):
    return [s * CAP + p for s, f in enumerate(_fills(n)) for p in range(min(f, CAP))]


@pytest.mark.parametrize("n", _shards({2, 8}))
def test_uniform_global_matches_one_buffer_with_unequal_fill(n):
    srb = frb.ShardedReplayBuffer(UNIFORM, mesh(n))
    state = build(srb, _ids(n))
    out, _ = draws(srb, state, steps=max(8, 64 // n))
    assert out.indices.shape[0] == out.mask.shape[0]
    np.testing.assert_array_equal(out.data["id"], out.indices)  # the row of the index
    assert out.mask.all() and (out.weights == 1).all()
    ids, counts = np.unique(out.indices, return_counts=True)
    stored = _stored(n)
    # a single buffer holding these items draws each with probability 1 / N
    expected = {g: 1 / len(stored) for g in stored}
    assert _chisquare(dict(zip(ids, counts)), expected, len(out.indices)) > P_MIN


def _priorities(n):
    rng = np.random.default_rng(n)
    return {g: float(rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])) for g in _stored(n)}


@pytest.mark.parametrize("n", _shards({4}))
def test_prioritized_global_matches_one_buffer(n):
    sampler = PRIO.sampler  # PrioritizedSampler(alpha=0.7, beta=0.5)
    srb = frb.ShardedReplayBuffer(PRIO, mesh(n))
    prio = _priorities(n)
    state = build(
        srb, _ids(n), [[prio.get(s * CAP + i, 1.0) for i in range(CAP)] for s in range(n)]
    )
    out, _ = draws(srb, state, steps=max(8, 64 // n))
    np.testing.assert_array_equal(out.data["id"], out.indices)
    assert out.mask.all()
    # a single buffer holding the same items with the same priorities draws item i with
    # probability v_i / sum_j v_j, v = min((p + eps) ** alpha, value_max), and weighs it
    # (N P(i)) ** -beta / max_j (N P(j)) ** -beta = (min_j v_j / v_i) ** beta
    ids = np.array(sorted(prio))
    one = frb.ReplayBuffer(n * CAP, sampler=sampler)
    values = np.asarray(
        one.sampler.prioritization.value(np.array([prio[g] for g in ids], np.float32), n * CAP),
        np.float64,
    )
    expected = dict(zip(ids.tolist(), values / values.sum()))
    got, counts = np.unique(out.indices, return_counts=True)
    assert _chisquare(dict(zip(got, counts)), expected, len(out.indices)) > P_MIN
    v = dict(zip(ids.tolist(), values))
    np.testing.assert_allclose(
        out.weights, [(values.min() / v[int(g)]) ** 0.5 for g in out.indices], rtol=1e-5
    )


def _episodes(s, fill, rng):
    """Steps of shard s: episodes of random lengths, the last one ended (so that the shards
    concatenated hold the same trajectories as one buffer)."""
    lengths, total = [], 0
    while total < fill:
        ln = int(min(rng.integers(1, 7), fill - total))  # (fill 0: no episode)
        lengths.append(ln)
        total += ln
    done = np.zeros(fill, bool)
    done[np.cumsum(lengths, dtype=int) - 1] = True
    return lengths, done


@pytest.mark.parametrize("n", _shards({8}))
def test_slices_global_matches_one_buffer(n):
    seq = 3
    sampler = frb.SliceSampler(slice_len=seq)
    rb = frb.ReplayBuffer(CAP, sampler=sampler, batch_size=8 * seq)
    srb = frb.ShardedReplayBuffer(rb, mesh(n))
    rng = np.random.default_rng(n)
    shards, expected = [], {}
    fills = [f if f <= CAP else 14 for f in _fills(n)]
    trajectories = []
    for s, fill in enumerate(fills):
        lengths, done = _episodes(s, fill, rng)
        shards.append({"id": (s * CAP + np.arange(fill)).astype(np.int32), "next": {"done": done}})
        start = 0
        for ln in lengths:
            if ln >= seq:
                trajectories.append((s * CAP + start, ln))
            start += ln
    # one buffer: a trajectory uniformly among the eligible ones, then a start uniformly
    for first, ln in trajectories:
        for off in range(ln - seq + 1):
            expected[first + off] = 1 / len(trajectories) / (ln - seq + 1)
    state = build(srb, shards)
    out, _ = draws(srb, state, steps=max(10, 200 // n))
    assert out.indices.shape[1:] == (seq,) and out.mask.all()
    np.testing.assert_array_equal(out.data["id"], out.indices)
    np.testing.assert_array_equal(np.diff(out.indices, axis=1), 1)  # consecutive steps
    starts, counts = np.unique(out.indices[:, 0], return_counts=True)
    assert _chisquare(dict(zip(starts, counts)), expected, len(out.indices)) > P_MIN


def test_multinomial_counts_match_one_buffer():
    """counts="multinomial" (independent rows): the same distribution, as one buffer."""
    n = 4
    srb = frb.ShardedReplayBuffer(UNIFORM, mesh(n), counts="multinomial", capacity_factor=1.0)
    state = build(srb, _ids(n))
    out, _ = draws(srb, state, steps=24)
    np.testing.assert_array_equal(out.data["id"], out.indices)
    assert out.mask.all()
    stored = _stored(n)
    ids, counts = np.unique(out.indices, return_counts=True)
    assert (
        _chisquare(dict(zip(ids, counts)), {g: 1 / len(stored) for g in stored}, len(out.indices))
        > P_MIN
    )


def test_local_sampling_weights_match_its_distribution():
    """sampling="local": device d draws from shard d alone, with P(i) = v_i / (n T_d); the
    weights are (min_j P(j) / P(i)) ** beta over all shards (uniform: T_d / max T)."""
    n, beta = 4, PRIO.sampler.beta
    srb = frb.ShardedReplayBuffer(PRIO, mesh(n), sampling="local")
    fills = [16, 3, 11, 5]
    rng = np.random.default_rng(7)
    p = rng.choice([0.5, 1.0, 3.0], size=(n, CAP)).astype(np.float32)
    prio = {s * CAP + i: float(p[s, i]) for s in range(n) for i in range(fills[s])}
    state = build(srb, [s * CAP + np.arange(f) for s, f in enumerate(fills)], p)
    out, _ = draws(srb, state, steps=30)
    np.testing.assert_array_equal(out.data["id"], out.indices)
    value = {
        g: float(PRIO.sampler.prioritization.value(np.float32(v), CAP)) for g, v in prio.items()
    }
    totals = {s: sum(v for g, v in value.items() if g // CAP == s) for s in range(n)}
    used = {g: v / (n * totals[g // CAP]) for g, v in value.items()}
    # every device's rows come from its own shard
    dev = np.repeat(np.arange(n), 64)[None, :].repeat(30, 0).reshape(-1)
    np.testing.assert_array_equal(out.indices // CAP, dev)
    ids, counts = np.unique(out.indices, return_counts=True)
    assert _chisquare(dict(zip(ids, counts)), used, len(out.indices)) > P_MIN
    pmin = min(used.values())
    np.testing.assert_allclose(
        out.weights, [(pmin / used[int(g)]) ** beta for g in out.indices], rtol=1e-5
    )
    # uniform local: w = T_d / max T, so sum_i w_i f(i) / (n B) estimates the union's mean
    usrb = frb.ShardedReplayBuffer(UNIFORM, mesh(n), sampling="local")
    uout, _ = draws(
        usrb, build(usrb, [s * CAP + np.arange(f) for s, f in enumerate(fills)]), steps=2
    )
    np.testing.assert_allclose(uout.weights, [fills[g // CAP] / max(fills) for g in uout.indices])
