"""Slice samplers: slices stay inside one stored episode, are contiguous, are padded exactly
where the trajectory is short, never contain overwritten steps, and are drawn with TorchRL's
distribution."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.samplers import (
    PrioritizedSliceSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
)
from functional_rb.testing import assert_frequencies, assert_invariants


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
        assert mask[i, :n].all() and not mask[i, n:].any()  # padding only at the end
        o, e = obs[i, :n], eps[i, :n]
        assert all(int(x) in kept for x in o)  # nothing overwritten
        assert np.all(np.diff(o) == 1)  # contiguous in time
        assert np.all(e == e[0]) and all(kept[int(x)] == e[0] for x in o)  # one episode
        expect = slice_len if strict else min(slice_len, counts[int(e[0])])
        assert n == expect  # padded iff short
        if strict:
            assert counts[int(e[0])] >= slice_len
        assert trunc[i, n - 1] and not trunc[i, : n - 1].any() and not trunc[i, n:].any()
        if n < slice_len:
            assert np.all(idx[i, n:] == idx[i, n - 1])  # padding: valid index
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
        _FNS[key] = (
            (jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.can_sample))
            if jit
            else (rb.add, rb.sample, rb.can_sample)
        )
    return _FNS[key]


def padded_stream(lengths, step):
    """Episodes whose total length is a multiple of ``step`` (the running one is extended), so
    every add has the same shape."""
    lengths = list(lengths)
    lengths[-1] += -sum(lengths) % step
    return episodes(lengths)


lengths_st = st.lists(st.integers(1, 9), min_size=1, max_size=12)
# maybe_jit only picks jax.jit or not: nothing to reset between examples
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10)


# (slice_len, strict_length, traj_key mode, steps per add): few configs, because each one is
# a compilation; 7 steps per add into capacity 16 (or 11) crosses the wrap point inside adds,
# 23 overwrites more than the whole ring in one add.
CONFIGS = [(4, True, False, 7), (3, False, True, 23)]
CAPACITIES = [16, 11]


@fixture_ok
@given(
    lengths=lengths_st,
    config=st.sampled_from(CONFIGS),
    capacity=st.sampled_from(CAPACITIES),
    seed=st.integers(0, 2**16),
)
def test_slices_stay_in_one_stored_episode(maybe_jit, lengths, config, capacity, seed):
    slice_len, strict, use_traj, step = config
    sampler = SliceSampler(
        slice_len=slice_len, strict_length=strict, traj_key="ep" if use_traj else None
    )
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
        assert_invariants(rb, state)  # the trajectory records match the stored end flags / ids
        kept, counts = stored_view(obs, ep, b, capacity)
        possible = max(counts.values()) >= slice_len or not strict
        assert bool(can_sample(state)) == possible
        key, k = jax.random.split(key)
        if possible:
            s, state = sample(state, k)
            check_slices(s, kept, counts, slice_len, strict)


# One config per sampler (num_slices mode: the prioritized one fixes slice_len = 18 // 6 = 3
# from the buffer's batch_size).
NDIM2_SAMPLERS = {
    "slice": SliceSampler(num_slices=6),
    "without_replacement": SliceSamplerWithoutReplacement(num_slices=6),
    "prioritized": PrioritizedSliceSampler(0.7, 0.5, num_slices=6),
}


@fixture_ok
@given(
    lengths=st.lists(lengths_st, min_size=2, max_size=2),
    kind=st.sampled_from(sorted(NDIM2_SAMPLERS)),
    seed=st.integers(0, 2**16),
)
def test_slices_ndim2_run_along_time_within_a_row(maybe_jit, lengths, kind, seed):
    step, strict = 5, True  # (padding is covered by the 1-D tests)
    row_cap, slice_len = 8, 3
    rb = frb.ReplayBuffer(
        capacity=2 * row_cap, sampler=NDIM2_SAMPLERS[kind], batch_size=6 * slice_len, ndim=2
    )
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
        data = {
            "obs": np.stack([r[0][a:b] for r in rows]),
            "ep": np.stack([r[1][a:b] for r in rows]),
            "next": {"done": np.stack([r[2][a:b] for r in rows])},
            "env": np.repeat(np.arange(2, dtype=np.int32)[:, None], b - a, axis=1),
        }
        state = add(state, data)
        assert_invariants(rb, state)  # records per row, prioritized starts and tree
        # obs is the step number within a row: make it row-unique for the reference
        views = [stored_view(r[0], r[1], b, row_cap) for r in rows]
        possible = not strict or max(max(v[1].values()) for v in views) >= slice_len
        assert bool(can_sample(state)) == possible
        if not possible:
            continue
        key, k = jax.random.split(key)
        s, state = sample(state, k)
        drawn = np.asarray(s.mask).any(axis=1)  # without replacement: an epoch's end pads
        assert drawn.any()
        env = np.asarray(s.data["env"])[:, 0]
        if kind == "without_replacement":  # one slice per trajectory in an epoch
            eps = np.asarray(s.data["ep"])[drawn, 0]
            assert len(set(eps.tolist())) == len(eps)
        for r in range(2):
            sel = drawn & (env == r)
            if not sel.any():
                continue
            sub = frb.Sample(
                jax.tree_util.tree_map(lambda v, sel=sel: np.asarray(v)[sel], s.data),
                np.asarray(s.indices)[sel],
                np.asarray(s.weights)[sel],
                np.asarray(s.mask)[sel],
            )
            check_slices(
                sub,
                views[r][0],
                views[r][1],
                slice_len,
                strict,
                env=r,
                row_cap=row_cap,
                unit_weights=kind != "prioritized",
            )


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
        batch_size=slice_len * 200,
    )
    for a in range(0, len(obs), step):
        b = min(a + step, len(obs))
        rb.extend(
            TensorDict(
                {
                    "obs": torch.tensor(obs[a:b]),
                    "ep": torch.tensor(ep[a:b]),
                    "next": {"done": torch.tensor(done[a:b])[:, None]},
                },
                [b - a],
            )
        )
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
    sampler = SliceSampler(
        slice_len=slice_len, strict_length=strict, traj_key="ep" if traj else None
    )
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
    table = np.array([[np.sum(theirs == v) for v in support], [np.sum(ours == v) for v in support]])
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, (p, table)


def test_distribution_matches_torchrl_ndim2():
    """[num_envs, time] storage, each row wrapping: the same (trajectory, start) pairs, with
    the same frequencies, as TorchRL's SliceSampler over LazyTensorStorage(ndim=2)
    (strict_length=False: short trajectories padded here, shortened there)."""
    torch = pytest.importorskip("torch")
    from scipy.stats import chi2_contingency
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data import SliceSampler as TSliceSampler

    # ep ids are row-unique and obs counts steps within a row: (ep, obs) names (row, start)
    rows = [episodes([7, 3, 12, 5, 9, 2]), episodes([4, 8, 6, 11, 2, 9], start_id=100)]
    row_cap, step, slice_len = 20, 6, 4
    chunks = [
        {
            "obs": np.stack([r[0][a : a + step] for r in rows]),
            "ep": np.stack([r[1][a : a + step] for r in rows]),
            "next": {"done": np.stack([r[2][a : a + step] for r in rows])},
        }
        for a in range(0, 36, step)
    ]  # 36 steps per row into 20 slots
    torch.manual_seed(0)
    trb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(2 * row_cap, ndim=2),
        batch_size=slice_len * 200,
        sampler=TSliceSampler(slice_len=slice_len, strict_length=False),
    )
    for c in chunks:
        trb.extend(
            TensorDict(
                {
                    "obs": torch.tensor(c["obs"]),
                    "ep": torch.tensor(c["ep"]),
                    "next": {"done": torch.tensor(c["next"]["done"])[..., None]},
                },
                [2, step],
            )
        )
    theirs = []
    for _ in range(30):
        t = trb.sample()
        tr = t["next", "truncated"].reshape(-1).numpy()
        first = np.concatenate([[True], tr[:-1]])
        theirs += zip(
            t["ep"].reshape(-1).numpy()[first].tolist(),
            t["obs"].reshape(-1).numpy()[first].tolist(),
        )
    rb = frb.ReplayBuffer(
        capacity=2 * row_cap,
        batch_size=slice_len * 3000,
        ndim=2,
        sampler=SliceSampler(slice_len=slice_len, strict_length=False),
    )
    state = rb.init(item(2))
    for c in chunks:
        state = rb.add(state, c)
    ours = []
    for i in range(2):
        s, state = rb.sample(state, jax.random.key(i))
        ours += zip(
            np.asarray(s.data["ep"])[:, 0].tolist(), np.asarray(s.data["obs"])[:, 0].tolist()
        )
    support = sorted(set(theirs) | set(ours))
    assert set(theirs) == set(ours)
    table = np.array([[theirs.count(v) for v in support], [ours.count(v) for v in support]])
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


@pytest.mark.parametrize(
    "sampler",
    [
        SliceSampler(slice_len=7),
        SliceSamplerWithoutReplacement(slice_len=7),
        PrioritizedSliceSampler(0.7, 0.5, num_slices=2),
    ],
    ids=["slice", "wor", "prioritized"],
)
def test_nothing_eligible_raises_eagerly_and_masks_under_jit(sampler):
    rb, state = _filled_buffer(sampler, lengths=(5, 3, 6), batch_size=14)
    assert not bool(rb.can_sample(state))
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(0))
    s, new_state = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not np.asarray(s.mask).any() and not np.asarray(s.weights).any()
    assert np.all(np.isfinite(np.asarray(s.weights)))
    assert np.all((np.asarray(s.indices) >= 0) & (np.asarray(s.indices) < 32))
    assert bool(rb.can_sample(new_state)) is False


def test_errors():
    with pytest.raises(ValueError, match="exactly one of num_slices and slice_len"):
        SliceSampler()
    with pytest.raises(ValueError, match="exactly one of num_slices and slice_len"):
        SliceSampler(num_slices=2, slice_len=3)
    with pytest.raises(ValueError, match="not divisible by slice_len=4"):
        frb.ReplayBuffer(capacity=32, sampler=SliceSampler(slice_len=4), batch_size=10)
    with pytest.raises(ValueError, match="not divisible by num_slices=3"):
        frb.ReplayBuffer(
            capacity=32, sampler=SliceSamplerWithoutReplacement(num_slices=3), batch_size=10
        )
    rb, state = _filled_buffer(SliceSampler(slice_len=2))
    with pytest.raises(ValueError, match="not divisible by slice_len=2"):
        rb.sample(state, jax.random.key(0), batch_size=5)
    rb = frb.ReplayBuffer(capacity=32, sampler=SliceSampler(slice_len=2), batch_size=4)
    with pytest.raises(ValueError, match=r"end_key=\('next', 'done'\).*\['obs'\]"):
        rb.init({"obs": jnp.zeros(3)})
    rb = frb.ReplayBuffer(
        capacity=32, sampler=SliceSampler(slice_len=2, traj_key="episode"), batch_size=4
    )
    with pytest.raises(
        ValueError,
        match=r"traj_key=\('episode',\) is not in the stored items, "
        r"whose leaves are \[\['ep'\], \['next'\]\['done'\]",
    ):
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
@given(lengths=lengths_st, config=st.sampled_from(CONFIGS), capacity=st.sampled_from(CAPACITIES))
def test_prioritized_valid_starts_track_the_stream(maybe_jit, lengths, config, capacity):
    _, strict, use_traj, step = config
    slice_len = 3
    # the second config gives num_slices: slice_len = batch_size // 2, fixed at init
    length = dict(num_slices=2) if use_traj else dict(slice_len=slice_len)
    sampler = PrioritizedSliceSampler(
        0.7, 0.5, strict_length=strict, traj_key="ep" if use_traj else None, **length
    )
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=2 * slice_len)
    add, sample, can_sample = buffer_fns(rb, maybe_jit)
    obs, ep, done = padded_stream(lengths, step)
    state = rb.init(item())
    assert state.sampler.slice_len == slice_len
    for a in range(0, len(obs), step):
        state = add(state, chunk(obs, ep, done, a, a + step))
        assert_invariants(rb, state)  # starts valid for the stored data, tree = their priorities
        ref = reference_valid_starts(obs, ep, a + step, capacity, slice_len, strict)
        valid = np.asarray(state.sampler.valid)
        leaves = np.asarray(state.sampler.tree.leaves)
        for pos, v in ref.items():
            assert valid[pos] == v and (leaves[pos] > 0) == v
        assert bool(can_sample(state)) == any(ref.values())
        if any(ref.values()):
            kept, counts = stored_view(obs, ep, a + step, capacity)
            s, state = sample(state, jax.random.key(a))
            check_slices(s, kept, counts, slice_len, strict=False, unit_weights=False)
            assert all(ref[int(i)] for i in np.asarray(s.indices)[:, 0])


def test_prioritized_distribution_and_weights():
    capacity, slice_len, alpha, beta = 32, 3, 0.7, 0.4
    sampler = PrioritizedSliceSampler(alpha, beta, slice_len=slice_len)
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=slice_len * 4000)
    obs, ep, done = episodes([5, 2, 9, 4, 7, 3, 6])  # 36 steps: the first 4 are overwritten
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
        np.testing.assert_allclose(
            np.asarray(s.weights)[:, 0], (w[valid].min() / w[first]) ** beta, rtol=1e-5
        )
        assert np.all(np.asarray(s.weights) == np.asarray(s.weights)[:, :1])
    # invalid starts at probability 0; the chi-square test at 1e-3 plus per-position binomial
    # tests (alpha=2e-3, Bonferroni)
    assert_frequencies(counts.astype(np.int64), expected, alpha=2e-3)
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


def _prioritized_stream(sampler, batch_size, capacity=20):
    """A buffer after a stream that wraps, with a priority update between its adds (so later
    steps get the max priority): ``(rb, state, obs, ep)``."""
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=batch_size)
    obs, ep, done = episodes([5, 2, 9, 4, 7, 3, 6])  # 36 steps
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, 18))
    prio = (np.arange(capacity, dtype=np.float32) * 7) % 11 + 1
    state = rb.update(state, jnp.arange(capacity, dtype=jnp.int32), jnp.asarray(prio))
    state = rb.add(state, chunk(obs, ep, done, 18, len(obs)))
    return rb, state, obs, ep


def _assert_same_prioritized_state(a, b):
    assert a.slice_len == b.slice_len
    for name in ("valid", "prio", "max_priority"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    np.testing.assert_array_equal(np.asarray(a.tree.leaves), np.asarray(b.tree.leaves))
    np.testing.assert_allclose(
        float(frb.sum_tree.total(a.tree)), float(frb.sum_tree.total(b.tree)), rtol=1e-6
    )


def test_prioritized_num_slices_refuses_another_slice_len():
    rb, state, _, _ = _prioritized_stream(PrioritizedSliceSampler(0.7, 0.5, num_slices=4), 12)
    key = jax.random.key(3)
    s, state = rb.sample(state, key)
    assert s.indices.shape == (4, 3) and np.asarray(s.mask).all()
    # at trace time, naming the numbers and the fixes
    msg = (
        r"num_slices=4\): batch_size=16 means slices of 4 steps, .*slice_len=3, i\.e\. "
        r"batch_size=12 .*Sample with batch_size=12; .*with_slice_len"
    )
    with pytest.raises(ValueError, match=msg):
        rb.sample(state, key, batch_size=16)
    with pytest.raises(ValueError, match=msg):
        jax.jit(rb.sample, static_argnames="batch_size")(state, key, batch_size=16)
    with pytest.raises(ValueError, match="not divisible by num_slices=4"):
        rb.sample(state, key, batch_size=10)


def test_prioritized_with_slice_len_equals_a_state_built_for_it():
    rb, state, obs, ep = _prioritized_stream(PrioritizedSliceSampler(0.7, 0.5, num_slices=4), 12)
    _, direct, _, _ = _prioritized_stream(PrioritizedSliceSampler(0.7, 0.5, num_slices=4), 16)
    assert direct.sampler.slice_len == 4
    conv = rb.sampler.with_slice_len(state.sampler, rb.context(state), 4)
    _assert_same_prioritized_state(conv, direct.sampler)
    jitted = jax.jit(lambda st: rb.sampler.with_slice_len(st.sampler, rb.context(st), 4))(state)
    _assert_same_prioritized_state(jitted, direct.sampler)
    # a state of its own: the eager calls below consume theirs (`state` is read again)
    state4 = dataclasses.replace(jax.tree_util.tree_map(jnp.copy, state), sampler=conv)
    kept, counts = stored_view(obs, ep, len(obs), 20)
    ref = reference_valid_starts(obs, ep, len(obs), 20, 4, True)
    for i in range(3):
        s, state4 = rb.sample(state4, jax.random.key(i), batch_size=16)
        check_slices(s, kept, counts, 4, strict=True, unit_weights=False)
        assert all(ref[int(i)] for i in np.asarray(s.indices)[:, 0])
    # later adds keep the converted slice length's starts up to date
    more = episodes([3, 5, 10], start_id=50)  # 18 steps, like the adds that built `direct`
    state4 = rb.add(state4, {"obs": more[0] + 36, "ep": more[1], "next": {"done": more[2]}})
    obs2, ep2 = np.concatenate([obs, more[0] + 36]), np.concatenate([ep, more[1]])
    ref = reference_valid_starts(obs2, ep2, len(obs2), 20, 4, True)
    valid = np.asarray(state4.sampler.valid)
    assert all(valid[pos] == v for pos, v in ref.items())
    with pytest.raises(ValueError, match=r"slice length is the sampler's \(3\), got 4"):
        PrioritizedSliceSampler(0.7, 0.5, slice_len=3).with_slice_len(
            state.sampler, rb.context(state), 4
        )
    with pytest.raises(ValueError, match="slice_len=21 exceeds"):
        rb.sampler.with_slice_len(state.sampler, rb.context(state), 21)


def test_prioritized_num_slices_errors():
    sampler = PrioritizedSliceSampler(0.7, 0.5, num_slices=4)
    with pytest.raises(ValueError, match="not divisible by num_slices=4"):
        frb.ReplayBuffer(capacity=16, sampler=sampler, batch_size=10)
    rb = frb.ReplayBuffer(capacity=16, sampler=sampler, batch_size=8)
    state = rb.init(item())
    with pytest.raises(ValueError, match=r"num_slices=4\)\.init: .*no batch_size"):
        sampler.init(rb.storage.item_spec(state.storage), rb.layout(state))
    with pytest.raises(ValueError, match="slice_len=9 exceeds"):
        frb.ReplayBuffer(
            capacity=8, sampler=PrioritizedSliceSampler(0.7, 0.5, num_slices=1), batch_size=9
        ).init(item())


@pytest.mark.filterwarnings("ignore:Got conflicting batch_sizes")  # TorchRL's warning, kept
def test_adapter_prioritized_slice_sampler_num_slices():
    """TorchRL's signature: PrioritizedSliceSampler(max_capacity, alpha, beta, num_slices=n)
    draws slices of batch_size // n steps for every batch_size given to sample (TorchRL's own
    sampler needs a C++ sum tree that may be missing, so the reference is analytic)."""
    pytest.importorskip("torch")
    import torch
    from tensordict import TensorDict

    A = pytest.importorskip("functional_rb.adapters")
    obs, ep, done = episodes([5, 2, 9, 4, 7, 3, 6])  # 36 steps into 20 slots: wraps
    td = TensorDict(
        {
            "obs": torch.tensor(obs),
            "ep": torch.tensor(ep),
            ("next", "done"): torch.tensor(done)[:, None],
        },
        [len(obs)],
    )
    n, alpha, beta = 400, 1.0, 0.5
    rbs = [
        A.TensorDictReplayBuffer(
            storage=A.LazyTensorStorage(20),
            batch_size=bs,
            sampler=A.PrioritizedSliceSampler(20, alpha, beta, num_slices=n),
        )
        for bs in (2 * n, None)
    ]
    kept, counts = stored_view(obs, ep, len(obs), 20)
    prio = (np.arange(20, dtype=np.float64) * 7) % 11 + 1
    for rb in rbs:
        rb.extend(td)
        rb.update_priority(torch.arange(20), torch.tensor(prio))
        for slice_len in (3, 2, 3):  # the buffer's own slice length (2) and another one (3)
            s, info = rb.sample(n * slice_len, return_info=True)
            o = s["obs"].reshape(n, slice_len).numpy()
            e = s["ep"].reshape(n, slice_len).numpy()
            assert np.all(np.diff(o, axis=1) == 1) and np.all(e == e[:, :1])
            assert all(
                counts[int(x)] >= slice_len and kept[int(y)] == x for x, y in zip(e[:, 0], o[:, 0])
            )
            tr = s["next", "truncated"].reshape(n, slice_len).numpy()
            assert tr[:, -1].all() and not tr[:, :-1].any()
            ref = reference_valid_starts(obs, ep, len(obs), 20, slice_len, True)
            valid = np.array([ref[p] for p in range(20)])
            start = info["index"][0].reshape(n, slice_len)[:, 0].numpy()
            assert valid[start].all()
            w = prio**alpha
            np.testing.assert_allclose(  # TorchRL's: (min_j P(j) / P(i)) ** beta, j stored
                info["priority_weight"].reshape(n, slice_len)[:, 0].numpy(),
                (w.min() / w[start]) ** beta,
                rtol=1e-5,
            )
            p = np.where(valid, w, 0.0)
            assert_frequencies(np.bincount(start, minlength=20), p / p.sum(), alpha=2e-3)
    # the converted starts follow priority updates (the cached conversion is dropped)
    rb = rbs[0]
    rb.update_priority(torch.tensor([int(np.flatnonzero(valid)[0])]), torch.tensor([1e9]))
    s, info = rb.sample(n * 3, return_info=True)
    start = info["index"][0].reshape(n, 3)[:, 0].numpy()
    assert np.mean(start == np.flatnonzero(valid)[0]) > 0.99


def test_vmap_over_states():
    rb, state = _filled_buffer(SliceSampler(slice_len=4), lengths=(5, 3, 6))
    _, other = _filled_buffer(SliceSampler(slice_len=4), lengths=(2, 9, 3))
    states = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), state, other)
    s, _ = jax.jit(jax.vmap(rb.sample))(states, jax.random.split(jax.random.key(0), 2))
    obs, eps = np.asarray(s.data["obs"]), np.asarray(s.data["ep"])
    assert obs.shape == (2, 2, 4) and np.asarray(s.mask).all()
    assert np.all(np.diff(obs, axis=-1) == 1) and np.all(eps == eps[..., :1])
    assert set(eps[0, :, 0]) <= {0, 2} and set(eps[1, :, 0]) <= {1}


# ---------------------------------------------------------------------------- span
def _span_counts(sampler, lengths, draws, fn=lambda f: f, num_slices=64):
    """(first, length) pair counts of the slices drawn from episodes of ``lengths``."""
    cap = sum(lengths)
    rb = frb.ReplayBuffer(capacity=cap, sampler=sampler, batch_size=sampler.slice_len * num_slices)
    obs, ep, done = episodes(lengths)
    state = rb.add(rb.init(item()), chunk(obs, ep, done, 0, cap))
    sample = fn(rb.sample)
    pairs = {}
    for i in range(draws):
        s, state = sample(state, jax.random.key(i))
        m = np.asarray(s.mask)
        o, e = np.asarray(s.data["obs"]), np.asarray(s.data["ep"])
        n = m.sum(1)
        assert (n >= 1).all() and all(m[r, : n[r]].all() for r in range(len(n)))
        for r in range(len(n)):
            assert (e[r, : n[r]] == e[r, 0]).all() and (np.diff(o[r, : n[r]]) == 1).all()
            pairs[(int(o[r, 0]), int(n[r]))] = pairs.get((int(o[r, 0]), int(n[r])), 0) + 1
    return pairs


@pytest.mark.parametrize("span", [(2, 2), (True, 0), (0, 3), True])
def test_span_starts_uniform_over_the_widened_range(span, maybe_jit):
    # one episode of 10 steps, slices of 5: the start r is uniform in [-left, 10 - 5 + right]
    # and the slice keeps the steps of [r, r + 5) inside the episode (TorchRL's documented rule)
    seq, L = 5, 10
    sampler = SliceSampler(slice_len=seq, span=span)
    left, right = (seq - 1 if v is True else v for v in sampler.span)
    rs = np.arange(-left, L - seq + right + 1)
    expected = {}
    for r in rs:
        lo, hi = max(r, 0), min(r + seq, L)
        expected[(lo, hi - lo)] = expected.get((lo, hi - lo), 0) + 1 / len(rs)
    pairs = _span_counts(sampler, [L], draws=8, fn=maybe_jit)
    keys = sorted(set(expected) | set(pairs))
    assert_frequencies(
        np.array([pairs.get(k, 0) for k in keys]),
        np.array([expected.get(k, 0.0) for k in keys]),
        alpha=1e-3,
    )
    assert min(n for _, n in pairs) >= seq - max(left, right)


def test_span_is_checked_against_the_slice_length():
    with pytest.raises(ValueError, match="strictly lower than the slice length"):
        _span_counts(SliceSampler(slice_len=3, span=3), [6], draws=1)
    with pytest.raises(TypeError, match="span must be a bool, a non-negative int"):
        SliceSampler(slice_len=3, span=-1)
    with pytest.raises(ValueError, match="right span is supported"):
        PrioritizedSliceSampler(1.0, 1.0, slice_len=3, span=(1, 0))


def test_span_without_replacement_and_prioritized_right_span():
    # without replacement: one slice of each of the 3 episodes per epoch, some shorter
    pairs = _span_counts(
        SliceSamplerWithoutReplacement(slice_len=4, span=(0, 2)), [6, 6, 6], draws=40, num_slices=3
    )
    assert sum(pairs.values()) == 120 and {n for _, n in pairs} == {2, 3, 4}
    for o, n in pairs:
        assert n == min(4, 6 - o % 6)
    # prioritized, right span 2 of slice_len 4: every step with >= 2 steps left starts a slice
    sampler = PrioritizedSliceSampler(1.0, 0.0, slice_len=4, span=(0, 2))
    pairs = _span_counts(sampler, [6, 5], draws=20)
    firsts = {o for o, _ in pairs}
    assert firsts == {0, 1, 2, 3, 4, 6, 7, 8, 9}  # each episode's last step is never a start
    assert all(n == min(4, (6 if o < 6 else 11) - o) for o, n in pairs)


@settings(max_examples=40, deadline=None)
@given(
    starts=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    lo=st.integers(0, 200),
    age=st.integers(0, 900),
)
def test_record_search_unrolled_equals_rolled(starts, lo, age):
    """The binary search over record starts finds the same record unrolled (how it runs off
    the CPU) as rolled (on the CPU), and it is the last record at least ``age`` steps old."""
    from functional_rb.samplers.trajectories import last_started

    cap = 32
    begun = np.cumsum(starts).astype(np.int32)  # record j began at step begun[j]
    m = min(len(begun), cap)
    begun = begun[-m:]
    rec = np.zeros((1, cap), np.int32)
    rec[0, (lo + np.arange(m)) % cap] = begun
    total = int(begun[-1]) + 1
    args = (jnp.asarray(rec), jnp.int32(total), jnp.int32(0), jnp.int32(lo), jnp.int32(m))
    rolled = int(jax.jit(lambda a: last_started(*args, a, unroll=False))(jnp.int32(age)))
    unrolled = int(jax.jit(lambda a: last_started(*args, a, unroll=True))(jnp.int32(age)))
    old = np.nonzero(total - begun >= age)[0]
    assert rolled == unrolled == lo + (old[-1] if old.size else 0)
