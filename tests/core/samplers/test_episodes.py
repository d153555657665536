"""EpisodeSampler (whole episodes padded to a fixed length): every sampled row is one whole,
ended episode from its first step, never steps of two episodes, with the padding after it
masked; the running episode and the overwritten tail of one are never drawn; episodes are drawn
uniformly. Properties run eagerly and under jax.jit against a Python model of the ring (adds
larger than a row included), with end flags and with trajectory ids."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.testing import assert_frequencies, assert_invariants, check_sampler

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10)


@functools.cache
def fns(rb, jit):
    if jit:
        return jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.can_sample)
    return rb.add, rb.sample, rb.can_sample


def streams(rows_lengths, total):
    """Per row, ``total`` steps of consecutive episodes of the given lengths (the last one
    extended and left running): ``(ep id, step in episode, done)`` arrays ``[E, total]``; ids
    are unique over rows."""
    ep, idx, done = [], [], []
    for r, lengths in enumerate(rows_lengths):
        lengths = list(lengths)
        lengths[-1] += max(total - sum(lengths), 0)
        e_, i_, d_ = [], [], []
        for k, n in enumerate(lengths):
            for i in range(n):
                e_.append(1000 * r + k)
                i_.append(i)
                d_.append(i == n - 1 and k < len(lengths) - 1)
        ep.append(e_[:total])
        idx.append(i_[:total])
        done.append(d_[:total])
    return np.array(ep, np.int32), np.array(idx, np.int32), np.array(done, bool)


def eligible(ep, idx, done, n, row_cap, by_id):
    """Reference: ``{episode id: length}`` of the whole, ended episodes stored after ``n``
    steps per row."""
    out = {}
    for r in range(ep.shape[0]):
        lo = max(0, n - row_cap)
        e, i, d = ep[r, lo:n].tolist(), idx[r, lo:n].tolist(), done[r, lo:n].tolist()
        for k in set(e):
            steps = [j for j in range(len(e)) if e[j] == k]
            starts = i[steps[0]] == 0
            ended = (k != e[-1]) if by_id else d[steps[-1]]
            if starts and ended:
                out[k] = len(steps)
    return out


def check_episodes(s, whole, slice_len):
    """Each row: one episode of ``whole`` from its first step, then masked padding."""
    mask = np.asarray(s.mask)
    eps, idx = np.asarray(s.data["ep"]), np.asarray(s.data["i"])
    np.testing.assert_array_equal(np.asarray(s.weights), mask.astype(np.float32))
    for row in range(mask.shape[0]):
        n = int(mask[row].sum())
        assert mask[row, :n].all(), f"row {row}: the mask {mask[row]} is not a prefix"
        k = int(eps[row, 0])
        assert k in whole, f"row {row}: episode {k} is not a whole, ended episode: {whole}"
        assert (eps[row, :n] == k).all(), f"row {row} mixes episodes: {eps[row, :n]}"
        assert idx[row, :n].tolist() == list(range(n)), f"row {row} starts mid-episode"
        assert n == min(whole[k], slice_len)
        # padding repeats the last valid step
        assert (eps[row, n:] == k).all() and (idx[row, n:] == n - 1).all()


def item(envs=None):
    x = {"ep": jnp.int32(0), "i": jnp.int32(0), "done": jnp.bool_(False)}
    if envs:
        x = jax.tree_util.tree_map(lambda a: jnp.zeros((envs,), a.dtype), x)
    return x


@pytest.mark.parametrize("by_id", [False, True], ids=["end_key", "traj_key"])
def test_protocol(by_id):
    sampler = frb.EpisodeSampler(slice_len=3, end_key="done", traj_key="ep" if by_id else None)
    check_sampler(sampler, item(), batch_size=6)


# (ndim, rows, row capacity, steps per add, slice_len, traj_key mode): 9 steps per add into
# rows of 8 overwrite more than a row in one add (an episode whose start is lost within the
# call must not count as whole)
CONFIGS = [(1, 1, 16, 5, 6, False), (1, 1, 8, 9, 4, True), (2, 2, 8, 3, 5, False)]


@fixture_ok
@given(
    lengths=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=8), min_size=2, max_size=2),
    config=st.sampled_from(CONFIGS),
    adds=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_rows_are_whole_ended_episodes_padded(maybe_jit, lengths, config, adds, seed):
    ndim, rows, row_cap, step, slice_len, by_id = config
    sampler = frb.EpisodeSampler(
        slice_len=slice_len, end_key="done", traj_key="ep" if by_id else None
    )
    rb = frb.ReplayBuffer(
        capacity=rows * row_cap, batch_size=8 * slice_len, sampler=sampler, ndim=ndim
    )
    add, sample, can_sample = fns(rb, maybe_jit is jax.jit)
    ep, idx, done = streams(lengths[:rows], adds * step)
    if by_id:  # ids only: the end flags must not matter
        done = np.zeros_like(done)
    state = rb.init(item(rows if ndim == 2 else None))
    key = jax.random.key(seed)
    for a in range(0, adds * step, step):
        b = a + step
        batch = {"ep": ep[:, a:b], "i": idx[:, a:b], "done": done[:, a:b]}
        state = add(state, batch if ndim == 2 else jax.tree_util.tree_map(lambda x: x[0], batch))
        assert_invariants(rb, state)
        whole = eligible(ep, idx, done, b, row_cap, by_id)
        assert bool(can_sample(state)) == bool(whole)
        key, k = jax.random.split(key)
        if whole:
            s, state = sample(state, k)
            check_episodes(s, whole, slice_len)
        elif maybe_jit is jax.jit:  # nothing whole: mask all False, weights 0
            s, state = sample(state, k)
            assert not np.asarray(s.mask).any() and not np.asarray(s.weights).any()
        else:
            with pytest.raises(ValueError, match="nothing can be sampled"):
                rb.sample(state, k)


def test_episodes_are_drawn_uniformly_and_long_ones_cut():
    sampler = frb.EpisodeSampler(slice_len=4, end_key="done")
    rb = frb.ReplayBuffer(capacity=64, batch_size=4000 * 4, sampler=sampler)
    lengths = [2, 6, 1, 4, 3, 5]  # the last runs on; 6 is cut to its first 4 steps
    ep, idx, done = streams([lengths], sum(lengths))
    state = rb.add(rb.init(item()), {"ep": ep[0], "i": idx[0], "done": done[0]})
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    whole = eligible(ep, idx, done, sum(lengths), 64, False)
    assert sorted(whole) == [0, 1, 2, 3, 4]
    check_episodes(s, whole, 4)
    counts = np.bincount(np.asarray(s.data["ep"])[:, 0], minlength=6)
    assert_frequencies(counts, [0.2] * 5 + [0.0])  # not weighted by length
    cut = np.asarray(s.data["ep"])[:, 0] == 1
    assert np.asarray(s.mask)[cut].all() and not np.asarray(s.data["done"])[cut][:, -1].any()


def test_a_start_lost_within_one_add_is_not_whole():
    rb = frb.ReplayBuffer(
        capacity=8, batch_size=2 * 8, sampler=frb.EpisodeSampler(slice_len=8, end_key="done")
    )
    # episode 0: steps 0-6 (done at 6); episode 1: 7-11, running. The ring keeps 4-11: the
    # tail of 0 (its start was overwritten inside this add) and the running 1: nothing whole
    ep, idx, done = streams([[7, 5]], 12)
    state = rb.add(rb.init(item()), {"ep": ep[0], "i": idx[0], "done": done[0]})
    assert not bool(rb.can_sample(state))
    state = rb.add(
        state,
        {
            "ep": jnp.array([1], jnp.int32),
            "i": jnp.array([5], jnp.int32),
            "done": jnp.array([True]),
        },
    )  # episode 1 ends: whole (7-12)
    s, state = rb.sample(state, jax.random.key(0))
    assert set(np.asarray(s.data["ep"])[np.asarray(s.mask)].tolist()) == {1}
    # a start that is the first kept step of an add counts: 0-3 then 4-11 (ended) kept whole
    ep, idx, done = streams([[4, 8, 1]], 13)
    state = rb.add(rb.init(item()), {"ep": ep[0, :12], "i": idx[0, :12], "done": done[0, :12]})
    s, state = rb.sample(state, jax.random.key(1))
    assert np.asarray(s.mask).all() and set(np.asarray(s.data["ep"]).reshape(-1).tolist()) == {1}


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="pass exactly one of num_slices and slice_len"):
        frb.EpisodeSampler(end_key="done")
    with pytest.raises(TypeError, match="strict_length"):
        frb.EpisodeSampler(slice_len=4, strict_length=True)
    rb = frb.ReplayBuffer(
        capacity=8, batch_size=8, sampler=frb.EpisodeSampler(slice_len=4, end_key="done")
    )
    with pytest.raises(ValueError, match=r"EpisodeSampler.init: end_key=\('done',\) is not in"):
        rb.init({"x": jnp.int32(0)})
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by slice_len=4"):
        rb.sample(rb.init(item()), jax.random.key(0), batch_size=6)
