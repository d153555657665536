"""Slice samplers: slices stay inside one stored episode, are contiguous, are padded exactly
where the trajectory is short, never contain overwritten steps, and are drawn with TorchRL's
distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import functional_rb as frb
from functional_rb.slices import (PrioritizedSliceSampler, SliceSampler,
                                  SliceSamplerWithoutReplacement)


# ---------------------------------------------------------------------------- data helpers
def episodes(lengths, start_id=0):
    """Steps of consecutive episodes: obs = absolute step, ep = episode id, done at the end.
    The last episode is still running (no done) unless ``close_last``."""
    obs, ep, done = [], [], []
    for k, n in enumerate(lengths):
        for i in range(n):
            obs.append(len(obs))
            ep.append(start_id + k)
            done.append(i == n - 1)
    return np.array(obs, np.int32), np.array(ep, np.int32), np.array(done, bool)


def item(ndim_envs=None):
    x = {"obs": jnp.int32(0), "ep": jnp.int32(0), "next": {"done": jnp.bool_(False)}}
    if ndim_envs:
        x = jax.tree_util.tree_map(lambda a: jnp.zeros((ndim_envs,), a.dtype), x)
    return x


def chunk(obs, ep, done, a, b):
    return {"obs": obs[a:b], "ep": ep[a:b], "next": {"done": done[a:b]}}


def stored_view(obs, ep, n_added, capacity):
    """Reference: what the ring holds after ``n_added`` steps: {abs step: episode id} and the
    number of stored steps of each episode."""
    lo = max(0, n_added - capacity)
    kept = {int(obs[i]): int(ep[i]) for i in range(lo, n_added)}
    counts = {}
    for e in kept.values():
        counts[e] = counts.get(e, 0) + 1
    return kept, counts


def check_slices(s, kept, counts, slice_len, strict, env=None, row_cap=None, unit_weights=True):
    obs = np.asarray(s.data["obs"])
    eps = np.asarray(s.data["ep"])
    mask = np.asarray(s.mask)
    idx = np.asarray(s.indices)
    w = np.asarray(s.weights)
    trunc = np.asarray(s.data["next"]["truncated"])
    assert mask.shape == idx.shape == obs.shape[:2] and obs.shape[1] == slice_len
    assert np.all(w[~mask] == 0) and np.all(w[mask] == 1 if unit_weights else w[mask] > 0)
    assert mask.any(axis=1).all()
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()          # padding only at the end
        o, e = obs[i, :n], eps[i, :n]
        assert all(int(x) in kept for x in o)                          # nothing overwritten
        assert np.all(np.diff(o) == 1)                                 # contiguous in time
        assert np.all(e == e[0]) and all(kept[int(x)] == e[0] for x in o)  # one episode
        expect = slice_len if strict else min(slice_len, counts[int(e[0])])
        assert n == expect                                             # padded iff short
        if strict:
            assert counts[int(e[0])] >= slice_len
        assert trunc[i, n - 1] and not trunc[i, :n - 1].any() and not trunc[i, n:].any()
        if n < slice_len:
            assert np.all(idx[i, n:] == idx[i, n - 1])                 # padding: valid index
        if env is not None:
            assert np.all(idx[i] // row_cap == np.asarray(s.data["env"])[i, 0])


# ---------------------------------------------------------------------------- properties
_FNS = {}


def buffer_fns(rb, maybe_jit):
    """``(add, sample, can_sample)``, jitted ones cached per buffer config so that hypothesis
    examples with the same config share one compilation."""
    jit = maybe_jit is jax.jit
    key = (rb, jit)
    if key not in _FNS:
        _FNS[key] = ((jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.can_sample)) if jit
                     else (rb.add, rb.sample, rb.can_sample))
    return _FNS[key]


def padded_stream(lengths, step):
    """Episodes whose total length is a multiple of ``step`` (the running one is extended), so
    every add has the same shape."""
    lengths = list(lengths)
    lengths[-1] += -sum(lengths) % step
    return episodes(lengths)

lengths_st = st.lists(st.integers(1, 9), min_size=1, max_size=12)
# maybe_jit only picks jax.jit or not: nothing to reset between examples
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture],
                      max_examples=10)


# (slice_len, strict_length, traj_key mode, steps per add): few configs, because each one is
# a compilation; 7 steps per add into capacity 16 crosses the wrap point inside adds, 23
# overwrites more than the whole ring in one add.
CONFIGS = [(4, True, False, 7), (3, False, True, 23)]


@fixture_ok
@given(lengths=lengths_st, config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**16))
def test_slices_stay_in_one_stored_episode(maybe_jit, lengths, config, seed):
    slice_len, strict, use_traj, step = config
    capacity = 16
    sampler = SliceSampler(slice_len=slice_len, strict_length=strict,
                           traj_key="ep" if use_traj else None)
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=4 * slice_len)
    add, sample, can_sample = buffer_fns(rb, maybe_jit)
    obs, ep, done = padded_stream(lengths, step)
    if use_traj:  # ids only: the end flags must not matter
        done = np.zeros_like(done)
    state = rb.init(item())
    key = jax.random.key(seed)
    for a in range(0, len(obs), step):
        b = min(a + step, len(obs))
        state = add(state, chunk(obs, ep, done, a, b))
        kept, counts = stored_view(obs, ep, b, capacity)
        possible = max(counts.values()) >= slice_len or not strict
        assert bool(can_sample(state)) == possible
        key, k = jax.random.split(key)
        if possible:
            s, state = sample(state, k)
            check_slices(s, kept, counts, slice_len, strict)


@fixture_ok
@given(lengths=st.lists(lengths_st, min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_slices_ndim2_run_along_time_within_a_row(maybe_jit, lengths, seed):
    step, strict = 5, True  # (padding is covered by the 1-D tests)
    row_cap, slice_len = 8, 3
    sampler = SliceSampler(num_slices=6, strict_length=strict)
    rb = frb.ReplayBuffer(capacity=2 * row_cap, sampler=sampler, batch_size=6 * slice_len,
                          ndim=2)
    x = item(2)
    x["env"] = jnp.zeros((2,), jnp.int32)
    state = rb.init(x)
    add, sample, can_sample = buffer_fns(rb, maybe_jit)
    rows = [padded_stream(ls, step) for ls in lengths]
    rows = [(o, e + 100 * r, d) for r, (o, e, d) in enumerate(rows)]
    t_max = min(len(r[0]) for r in rows)
    key = jax.random.key(seed)
    for a in range(0, t_max, step):
        b = min(a + step, t_max)
        data = {"obs": np.stack([r[0][a:b] for r in rows]),
                "ep": np.stack([r[1][a:b] for r in rows]),
                "next": {"done": np.stack([r[2][a:b] for r in rows])},
                "env": np.repeat(np.arange(2, dtype=np.int32)[:, None], b - a, axis=1)}
        state = add(state, data)
        # obs is the step number within a row: make it row-unique for the reference
        views = [stored_view(r[0], r[1], b, row_cap) for r in rows]
        possible = not strict or max(max(v[1].values()) for v in views) >= slice_len
        assert bool(can_sample(state)) == possible
        if not possible:
            continue
        key, k = jax.random.split(key)
        s, state = sample(state, k)
        env = np.asarray(s.data["env"])[:, 0]
        for r in range(2):
            sel = env == r
            if not sel.any():
                continue
            sub = frb.Sample(jax.tree_util.tree_map(lambda v: np.asarray(v)[sel], s.data),
                             np.asarray(s.indices)[sel], np.asarray(s.weights)[sel],
                             np.asarray(s.mask)[sel])
            check_slices(sub, views[r][0], views[r][1], slice_len, strict, env=r,
                         row_cap=row_cap)


# ---------------------------------------------------------------------------- distribution
def _torchrl_starts(lengths, capacity, step, slice_len, strict, traj, n_batches, seed):
    torch = pytest.importorskip("torch")
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data import SliceSampler as TSliceSampler

    torch.manual_seed(seed)
    obs, ep, done = episodes(lengths)
    kw = dict(traj_key="ep") if traj else dict(end_key=("next", "done"))
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(capacity),
        sampler=TSliceSampler(slice_len=slice_len, strict_length=strict, **kw),
        batch_size=slice_len * 200)
    for a in range(0, len(obs), step):
        b = min(a + step, len(obs))
        rb.extend(TensorDict({"obs": torch.tensor(obs[a:b]), "ep": torch.tensor(ep[a:b]),
                              "next": {"done": torch.tensor(done[a:b])[:, None]}}, [b - a]))
    starts = []
    for _ in range(n_batches):
        s = rb.sample()
        idx = s["index"].reshape(-1).numpy()
        tr = s["next", "truncated"].reshape(-1).numpy()
        first = np.concatenate([[True], tr[:-1]])
        starts.append(idx[first])
    return np.concatenate(starts)


@pytest.mark.parametrize("strict,traj", [(True, False), (False, False), (True, True)])
def test_distribution_matches_torchrl(strict, traj):
    from scipy.stats import chi2_contingency

    lengths, capacity, step, slice_len = [7, 3, 12, 5, 9, 2, 8, 6, 11, 4], 40, 9, 4
    theirs = _torchrl_starts(lengths, capacity, step, slice_len, strict, traj, 30, seed=0)
    sampler = SliceSampler(slice_len=slice_len, strict_length=strict,
                           traj_key="ep" if traj else None)
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=slice_len * 3000)
    obs, ep, done = episodes(lengths)
    state = rb.init(item())
    for a in range(0, len(obs), step):
        state = rb.add(state, chunk(obs, ep, done, a, min(a + step, len(obs))))
    sample = jax.jit(rb.sample)
    ours = []
    for i in range(2):
        s, state = sample(state, jax.random.key(i))
        ours.append(np.asarray(s.indices)[:, 0])
    ours = np.concatenate(ours)
    support = sorted(set(theirs) | set(ours))
    assert set(theirs) == set(ours)  # the same (trajectory, start) pairs are possible
    table = np.array([[np.sum(theirs == v) for v in support],
                      [np.sum(ours == v) for v in support]])
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, (p, table)


# ---------------------------------------------------------------------------- semantics
def _filled_buffer(sampler, lengths=(5, 3, 6), capacity=32, batch_size=8):
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=batch_size)
    obs, ep, done = episodes(list(lengths))
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, len(obs)))
    return rb, state


def test_newest_running_episode_and_overwritten_tail_are_trajectories():
    # capacity 10; episodes 6, 4, then a running one of 3: the ring holds the last 3 steps of
    # the first episode, the second one and the running one.
    rb = frb.ReplayBuffer(capacity=10, sampler=SliceSampler(slice_len=3), batch_size=300)
    obs, ep, done = episodes([6, 4, 3])
    done[-1] = False
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, len(obs)))
    s, _ = rb.sample(state, jax.random.key(0))
    firsts = set(np.asarray(s.data["obs"])[:, 0].tolist())
    assert firsts == {3, 6, 7, 10}  # surviving tail [3,4,5], [6..9] (2 starts), [10,11,12]


def test_without_replacement_epochs():
    sampler = SliceSamplerWithoutReplacement(slice_len=2)
    rb, state = _filled_buffer(sampler, lengths=(5, 3, 6, 1, 4, 2), batch_size=4)
    sample = jax.jit(rb.sample)
    seen = []
    for i in range(3):  # 5 eligible trajectories: batches of 2 slices -> 2 + 2 + 1 (+pad)
        s, state = sample(state, jax.random.key(i))
        m = np.asarray(s.mask)
        eps = np.asarray(s.data["ep"])[:, 0][m[:, 0]]
        seen.extend(eps.tolist())
        if i == 2:
            assert m[0].all() and not m[1].any()
            assert np.all(np.asarray(s.weights)[1] == 0)
    assert sorted(seen) == [0, 1, 2, 4, 5]
    s, state = sample(state, jax.random.key(9))  # new epoch
    assert np.asarray(s.mask).all()
    # an add ends the epoch
    obs, ep, done = episodes([3])
    state = rb.add(state, chunk(obs, ep + 50, done, 0, 3))
    s, state2 = sample(state, jax.random.key(10))
    assert int(state2.sampler.pos) == 2 and int(state2.sampler.epoch_size) == 6


def test_without_replacement_drop_last_and_no_shuffle():
    sampler = SliceSamplerWithoutReplacement(slice_len=2, drop_last=True, shuffle=False)
    rb, state = _filled_buffer(sampler, lengths=(5, 3, 6), batch_size=4)
    s, state = rb.sample(state, jax.random.key(0))
    assert np.asarray(s.data["ep"])[:, 0].tolist() == [0, 1]
    s, state = rb.sample(state, jax.random.key(1))  # one left < 2: new epoch
    assert np.asarray(s.data["ep"])[:, 0].tolist() == [0, 1]


def test_truncated_key_added_or_ored():
    rb, state = _filled_buffer(SliceSampler(slice_len=2, strict_length=False))
    s, _ = rb.sample(state, jax.random.key(0))
    tr = np.asarray(s.data["next"]["truncated"])
    assert tr.dtype == bool and tr.shape == (4, 2) and tr[:, -1].all()
    # the sibling done flag carries the slice ends too
    assert np.asarray(s.data["next"]["done"])[:, -1].all()
    x = item()
    x["next"]["truncated"] = jnp.zeros((1,), jnp.float32)
    rb = frb.ReplayBuffer(capacity=16, sampler=SliceSampler(slice_len=4), batch_size=8)
    obs, ep, done = episodes([8])
    data = chunk(obs, ep, done, 0, 8)
    data["next"]["truncated"] = np.eye(8, 1, k=-1, dtype=np.float32)  # stored flag on step 1
    state = rb.add(rb.init(x), data)
    s, _ = rb.sample(state, jax.random.key(3))
    tr = np.asarray(s.data["next"]["truncated"])
    assert tr.shape == (2, 4, 1) and tr.dtype == np.float32
    o = np.asarray(s.data["obs"])
    assert np.array_equal(tr[..., 0] > 0, (o == 1) | (np.arange(4) == 3)[None, :])


def test_nothing_eligible_raises_eagerly_and_masks_under_jit():
    rb, state = _filled_buffer(SliceSampler(slice_len=7), lengths=(5, 3, 6), batch_size=14)
    assert not bool(rb.can_sample(state))
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(0))
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not np.asarray(s.mask).any() and not np.asarray(s.weights).any()
    assert np.all((np.asarray(s.indices) >= 0) & (np.asarray(s.indices) < 32))


def test_errors():
    with pytest.raises(ValueError, match="exactly one of num_slices and slice_len"):
        SliceSampler()
    with pytest.raises(ValueError, match="exactly one of num_slices and slice_len"):
        SliceSampler(num_slices=2, slice_len=3)
    with pytest.raises(ValueError, match="not divisible by slice_len=4"):
        frb.ReplayBuffer(capacity=32, sampler=SliceSampler(slice_len=4), batch_size=10)
    with pytest.raises(ValueError, match="not divisible by num_slices=3"):
        frb.ReplayBuffer(capacity=32, sampler=SliceSamplerWithoutReplacement(num_slices=3),
                         batch_size=10)
    rb, state = _filled_buffer(SliceSampler(slice_len=2))
    with pytest.raises(ValueError, match="not divisible by slice_len=2"):
        rb.sample(state, jax.random.key(0), batch_size=5)
    rb = frb.ReplayBuffer(capacity=32, sampler=SliceSampler(slice_len=2), batch_size=4)
    with pytest.raises(ValueError, match=r"end_key=\('next', 'done'\).*\['obs'\]"):
        rb.init({"obs": jnp.zeros(3)})
    rb = frb.ReplayBuffer(capacity=32, sampler=SliceSampler(slice_len=2, traj_key="episode"),
                          batch_size=4)
    with pytest.raises(ValueError, match=r"traj_key=\('episode',\)"):
        rb.init(item())
    rb = frb.ReplayBuffer(capacity=8, sampler=SliceSampler(slice_len=9), batch_size=9)
    with pytest.raises(ValueError, match="slice_len=9 exceeds"):
        rb.init(item())


# ---------------------------------------------------------------------------- prioritized
def reference_valid_starts(obs, ep, n_added, capacity, slice_len, strict):
    """{ring position: True} for the steps that may start a slice (TorchRL's rule)."""
    kept, counts = stored_view(obs, ep, n_added, capacity)
    steps = sorted(kept)
    out = {}
    for i, a in enumerate(steps):
        e = kept[a]
        remaining = sum(1 for b in steps[i:] if kept[b] == e)
        first = i == 0 or kept[steps[i - 1]] != e
        out[a % capacity] = remaining >= slice_len or (not strict and first)
    return out


@fixture_ok
@given(lengths=lengths_st, config=st.sampled_from(CONFIGS[:2]))
def test_prioritized_valid_starts_track_the_stream(maybe_jit, lengths, config):
    _, strict, use_traj, step = config
    capacity, slice_len = 16, 3
    sampler = PrioritizedSliceSampler(0.7, 0.5, slice_len=slice_len, strict_length=strict,
                                      traj_key="ep" if use_traj else None)
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=2 * slice_len)
    add, sample, can_sample = buffer_fns(rb, maybe_jit)
    obs, ep, done = padded_stream(lengths, step)
    state = rb.init(item())
    for a in range(0, len(obs), step):
        state = add(state, chunk(obs, ep, done, a, a + step))
        ref = reference_valid_starts(obs, ep, a + step, capacity, slice_len, strict)
        valid = np.asarray(state.sampler.valid)
        leaves = np.asarray(state.sampler.tree.sums[0])[:capacity]
        for pos, v in ref.items():
            assert valid[pos] == v and (leaves[pos] > 0) == v
        assert bool(can_sample(state)) == any(ref.values())
        if any(ref.values()):
            kept, counts = stored_view(obs, ep, a + step, capacity)
            s, state = sample(state, jax.random.key(a))
            check_slices(s, kept, counts, slice_len, strict=False, unit_weights=False)
            assert all(ref[int(i)] for i in np.asarray(s.indices)[:, 0])


def test_prioritized_distribution_and_weights():
    from scipy.stats import chisquare

    capacity, slice_len, alpha, beta = 32, 3, 0.7, 0.4
    sampler = PrioritizedSliceSampler(alpha, beta, slice_len=slice_len)
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=slice_len * 4000)
    obs, ep, done = episodes([5, 2, 9, 4, 7, 3, 6])   # 36 steps: the first 4 are overwritten
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, len(obs)))
    prio = np.arange(1, capacity + 1, dtype=np.float32)
    state = rb.update(state, jnp.arange(capacity, dtype=jnp.int32), jnp.asarray(prio))
    ref = reference_valid_starts(obs, ep, len(obs), capacity, slice_len, True)
    valid = np.array([ref[p] for p in range(capacity)])
    w = np.where(valid, (prio + 1e-8) ** alpha, 0.0)
    expected = w / w.sum()
    counts = np.zeros(capacity)
    for i in range(3):
        s, state = rb.sample(state, jax.random.key(i))
        counts += np.bincount(np.asarray(s.indices)[:, 0], minlength=capacity)
        assert np.asarray(s.mask).all()
        # weights: (min P / P(i)) ** beta, one per slice
        first = np.asarray(s.indices)[:, 0]
        np.testing.assert_allclose(np.asarray(s.weights)[:, 0],
                                   (w[valid].min() / w[first]) ** beta, rtol=1e-5)
        assert np.all(np.asarray(s.weights) == np.asarray(s.weights)[:, :1])
    assert np.all(counts[~valid] == 0)
    f_exp = expected[valid].astype(np.float64)
    p = chisquare(counts[valid], counts.sum() * f_exp / f_exp.sum()).pvalue
    assert p > 1e-3, p
    # beta override and update through the [num_slices, slice_len] indices of a sample,
    # padding ignored: the first occurrence in a row counts
    s, _ = rb.sample(state, jax.random.key(7), beta=0.0)
    assert np.all(np.asarray(s.weights) == 1.0)


def test_prioritized_update_ignores_padding():
    sampler = PrioritizedSliceSampler(1.0, 1.0, slice_len=4, strict_length=False)
    rb = frb.ReplayBuffer(capacity=16, sampler=sampler, batch_size=8)
    obs, ep, done = episodes([2])
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, 2))
    s, state = rb.sample(state, jax.random.key(0))
    assert np.asarray(s.indices).tolist() == [[0, 1, 1, 1], [0, 1, 1, 1]]
    assert np.asarray(s.mask).tolist() == [[True, True, False, False]] * 2
    state = rb.update(state, s.indices, jnp.array([[5.0, 6.0, 0.0, 0.0], [7.0, 8.0, 0.0, 0.0]]))
    np.testing.assert_allclose(np.asarray(state.sampler.prio)[:2], [7.0, 8.0], rtol=1e-6)
    with pytest.raises(ValueError, match="pass slice_len, not num_slices"):
        PrioritizedSliceSampler(0.5, 0.5, num_slices=4)


def test_vmap_over_states():
    rb, state = _filled_buffer(SliceSampler(slice_len=4), lengths=(5, 3, 6))
    _, other = _filled_buffer(SliceSampler(slice_len=4), lengths=(2, 9, 3))
    states = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), state, other)
    s, _ = jax.jit(jax.vmap(rb.sample))(states, jax.random.split(jax.random.key(0), 2))
    obs, eps = np.asarray(s.data["obs"]), np.asarray(s.data["ep"])
    assert obs.shape == (2, 2, 4) and np.asarray(s.mask).all()
    assert np.all(np.diff(obs, axis=-1) == 1) and np.all(eps == eps[..., :1])
    assert set(eps[0, :, 0]) <= {0, 2} and set(eps[1, :, 0]) <= {1}
