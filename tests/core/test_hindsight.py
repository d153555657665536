"""functional_rb.hindsight: episode limits against a NumPy reference, goal ages with TorchRL's
arithmetic, and relabelled samples that keep HER's invariants (the goal comes from the sampled
step's episode, later for "future", its last stored step for "final"; the unrelabelled rows
are untouched; the reward is reward_fn's) on buffers that wrap, eagerly and under jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb import hindsight as H
from functional_rb.testing import assert_frequencies


# ---------------------------------------------------------------------------- references
def limits_reference(ends, filled):
    """Per age: (first, last) of its episode, by walking the steps."""
    n = len(ends)
    first, last = np.zeros(n, np.int32), np.zeros(n, np.int32)
    start = 0
    for a in range(filled):
        if ends[a] or a == filled - 1:
            first[start : a + 1], last[start : a + 1] = start, a
            start = a + 1
    return first, last


def goal_reference(u, age, first, last, strategy):
    """TorchRL's float32 formulas (her.py, _sample_goal_indices)."""
    u = np.asarray(u, np.float32)
    if strategy == "final":
        return last
    if strategy == "future":
        span = np.maximum(last - age, 0)
        off = np.minimum((u * (span.astype(np.float32) + np.float32(1))).astype(np.int64), span)
        return age + off
    length = (last - first + 1).astype(np.float32)
    return first + (u * length).astype(np.int64)


# maybe_jit only picks jax.jit or not: nothing to reset between examples
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
# a fixed number of steps (one compilation per capacity); 20 steps wrap capacities 8 and 13
ends_st = st.lists(st.booleans(), min_size=20, max_size=20)


@fixture_ok
@given(ends=st.lists(st.booleans(), min_size=24, max_size=24), filled=st.integers(0, 24))
def test_episode_limits_match_reference(maybe_jit, ends, filled):
    first, last = maybe_jit(H.episode_limits)(jnp.asarray(ends), jnp.int32(filled))
    want_first, want_last = limits_reference(ends, filled)
    np.testing.assert_array_equal(np.asarray(first), want_first)
    np.testing.assert_array_equal(np.asarray(last), want_last)
    assert first.dtype == jnp.int32 and last.dtype == jnp.int32


@fixture_ok
@given(
    ends=st.lists(st.booleans(), min_size=1, max_size=40),
    strategy=st.sampled_from(H.EPISODE_STRATEGIES),
    seed=st.integers(0, 2**31 - 1),
)
def test_goal_ages_in_episode_and_equal_torchrl_arithmetic(maybe_jit, ends, strategy, seed):
    rng = np.random.default_rng(seed)
    filled = len(ends)
    first, last = limits_reference(ends, filled)
    age = rng.integers(0, filled, 16).astype(np.int32)
    u = rng.random(16, dtype=np.float32)
    u[:2] = [0.0, np.nextafter(np.float32(1), np.float32(0))]  # the extremes of [0, 1)
    fn = maybe_jit(lambda *a: H.goal_ages(*a, strategy=strategy))
    goal = np.asarray(fn(u, age, first[age], last[age]))
    assert ((first[age] <= goal) & (goal <= last[age])).all()
    if strategy == "future":
        assert (goal >= age).all()
    if strategy == "final":
        np.testing.assert_array_equal(goal, last[age])
    np.testing.assert_array_equal(goal, goal_reference(u, age, first[age], last[age], strategy))


# ---------------------------------------------------------------------------- buffers
def example(num_envs=None):
    x = {
        "step": jnp.int32(0),
        "ep": jnp.int32(0),
        "desired_goal": jnp.zeros(2, jnp.float32),
        "achieved_goal": jnp.zeros(2, jnp.float32),
        "next": {
            "desired_goal": jnp.zeros(2, jnp.float32),
            "reward": jnp.zeros(1, jnp.float32),
            "done": jnp.zeros(1, bool),
        },
    }
    if num_envs:
        x = jax.tree_util.tree_map(lambda a: jnp.zeros((num_envs,) + a.shape, a.dtype), x)
    return x


def steps(done, start=0):
    """Steps ``start, start + 1, ...`` ending an episode where ``done``; step ``s`` achieves
    goal ``(s, -s)``."""
    done = np.asarray(done, bool)
    s = start + np.arange(len(done), dtype=np.int32)
    ep = np.concatenate([[0], np.cumsum(done)[:-1]]).astype(np.int32)
    g = np.stack([s, -s], -1).astype(np.float32)
    return {
        "step": s,
        "ep": ep,
        "desired_goal": np.full_like(g, 0.5),
        "achieved_goal": g,
        "next": {
            "desired_goal": np.full_like(g, 0.5),
            "reward": np.full((len(s), 1), -9.0, np.float32),
            "done": done[:, None],
        },
    }


def lengths(*ns):
    """End flags of consecutive episodes of lengths ``ns`` (the last one still running)."""
    out = []
    for k, n in enumerate(ns):
        out += [False] * (n - 1) + [k < len(ns) - 1]
    return out


def reward_fn(d):
    return (d["achieved_goal"][..., 0] == d["desired_goal"][..., 0]).astype(jnp.float32) + d[
        "desired_goal"
    ][..., 0]


def stored_steps(rb, state):
    """{step: [env, ep, newest stored step of that episode]} of the stored items."""
    ctx = rb.context(state)
    filled, cursor = int(ctx.filled), int(ctx.cursor)
    r_cap, n_env = ctx.layout.row_capacity, ctx.layout.num_envs
    items = rb.get(state, jnp.arange(rb.capacity, dtype=jnp.int32))  # one shape: one compile
    step, ep = np.asarray(items["step"]), np.asarray(items["ep"])
    out, newest = {}, {}
    for env in range(n_env):
        for a in range(filled):
            pos = env * r_cap + (cursor - filled + a) % r_cap
            out[int(step[pos])] = [env, int(ep[pos]), None]
            newest[env, int(ep[pos])] = int(step[pos])  # ages ascend: the last one wins
    for v in out.values():
        v[2] = newest[v[0], v[1]]
    return out


@functools.cache
def buffer(capacity, batch_size, ndim=1):
    """One buffer object per configuration: eager calls are compiled once per buffer."""
    return frb.ReplayBuffer(capacity=capacity, batch_size=batch_size, ndim=ndim)


_RELABEL = {}


def relabel_fn(rb, strategy, her_ratio, jit):
    """One function per configuration, so each is traced and compiled once."""
    key = (rb, strategy, her_ratio, jit)
    if key not in _RELABEL:
        fn = functools.partial(
            H.relabel, rb=rb, reward_fn=reward_fn, strategy=strategy, her_ratio=her_ratio
        )
        _RELABEL[key] = jax.jit(fn) if jit else fn
    return _RELABEL[key]


def check_relabelled(rb, state, sample, out, strategy, n_her):
    before = jax.tree_util.tree_map(np.asarray, sample.data)
    after = jax.tree_util.tree_map(np.asarray, out.data)
    for leaf_a, leaf_b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(leaf_a[n_her:], leaf_b[n_her:])  # untouched rows
        assert leaf_a.dtype == leaf_b.dtype and leaf_a.shape == leaf_b.shape
    stored = stored_steps(rb, state)
    goal = after["desired_goal"][:n_her]
    g_step = goal[:, 0].astype(np.int64)
    np.testing.assert_array_equal(goal[:, 1], -goal[:, 0])  # an achieved goal, whole
    np.testing.assert_array_equal(after["next"]["desired_goal"][:n_her], goal)
    hit = (before["achieved_goal"][:n_her, 0] == goal[:, 0]).astype(np.float32)
    np.testing.assert_array_equal(after["next"]["reward"][:n_her, 0], hit + goal[:, 0])
    for s, g in zip(before["step"][:n_her].tolist(), g_step.tolist()):
        assert g in stored, f"goal step {g} is not stored"
        env, ep, newest = stored[s]
        if strategy == "random":
            continue
        assert stored[g][:2] == [env, ep], f"step {s} (ep {ep}) got a goal from {stored[g]}"
        if strategy == "future":
            assert g >= s
        if strategy == "final":
            assert g == newest


@fixture_ok
@given(
    ends=ends_st,
    capacity=st.sampled_from([8, 24]),
    strategy=st.sampled_from(H.STRATEGIES),
    seed=st.integers(0, 2**20),
)
def test_relabel_keeps_goals_in_episode(maybe_jit, ends, capacity, strategy, seed):
    her_ratio = 0.5  # (1.0 in the ndim=2 test) one compilation per capacity and strategy
    rb = buffer(capacity, 8)
    state = rb.add(rb.init(example()), steps(ends))  # wraps capacity 8
    sample, state = rb.sample(state, jax.random.key(seed))
    fn = relabel_fn(rb, strategy, her_ratio, maybe_jit is jax.jit)
    out = fn(jax.random.key(seed + 1), state=state, sample=sample)
    check_relabelled(rb, state, sample, out, strategy, int(8 * her_ratio))


@fixture_ok
@given(
    ends=ends_st,
    other=ends_st,
    row=st.sampled_from([7]),
    strategy=st.sampled_from(H.STRATEGIES),
    seed=st.integers(0, 2**20),
)
def test_relabel_ndim2_stays_in_each_env_row(maybe_jit, ends, other, row, strategy, seed):
    n_env = 2
    rb = buffer(n_env * row, 6, 2)
    one = steps(ends)
    two = steps(other, start=len(ends))  # env 1's steps are numbered after env 0's
    items = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), one, two)
    state = rb.add(rb.init(example(n_env)), items)
    sample, state = rb.sample(state, jax.random.key(seed))
    fn = relabel_fn(rb, strategy, 1.0, maybe_jit is jax.jit)
    out = fn(jax.random.key(seed + 1), state=state, sample=sample)
    check_relabelled(rb, state, sample, out, strategy, 6)


def test_future_goals_are_uniform_over_the_rest_of_the_episode():
    """One sampled step drawn 2800 times: its future goals are uniform over its later steps."""
    rb = buffer(16, 4)
    state = rb.add(rb.init(example()), steps(lengths(3, 9, 4)))  # step 5: episode 1's third
    idx = jnp.full((2800,), 5, jnp.int32)
    sample = frb.Sample(
        data=rb.get(state, idx), indices=idx, weights=jnp.ones(2800), mask=jnp.ones(2800, bool)
    )
    out = H.relabel(jax.random.key(0), rb, state, sample, reward_fn=reward_fn, her_ratio=1.0)
    goals = np.asarray(out.data["desired_goal"][:, 0]).astype(int)
    counts = np.bincount(goals, minlength=16)
    expected = np.zeros(16)
    expected[5:12] = 1 / 7  # steps 5..11: the sampled step and the rest of episode 1
    assert_frequencies(counts, expected, alpha=1e-3)


def test_episode_wrapping_around_the_storage_stays_whole():
    """Capacity 8, 11 steps: the running episode (steps 6..10) occupies slots 6, 7, 0, 1, 2."""
    rb = buffer(8, 4)
    state = rb.add(rb.init(example()), steps(lengths(6, 5)))
    idx = jnp.asarray([6, 7, 0, 1, 2], jnp.int32)
    sample = frb.Sample(rb.get(state, idx), idx, jnp.ones(5), jnp.ones(5, bool))
    out = H.relabel(
        jax.random.key(0), rb, state, sample, reward_fn=reward_fn, strategy="final", her_ratio=1.0
    )
    np.testing.assert_array_equal(np.asarray(out.data["desired_goal"][:, 0]), [10] * 5)


def test_masked_rows_are_returned_unchanged_under_jit():
    rb = buffer(8, 4)
    state = rb.init(example())
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(0))  # empty: mask all False
    out = jax.jit(lambda k, s: H.relabel(k, rb, state, s, reward_fn=reward_fn, her_ratio=1.0))(
        jax.random.key(1), sample
    )
    for a, b in zip(jax.tree_util.tree_leaves(sample.data), jax.tree_util.tree_leaves(out.data)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_x64_keeps_dtypes():
    with jax.enable_x64(True):
        rb = frb.ReplayBuffer(capacity=8, batch_size=4)
        state = rb.add(rb.init(example()), steps(lengths(3, 4)))
        sample, state = rb.sample(state, jax.random.key(0))
        out = H.relabel(jax.random.key(1), rb, state, sample, reward_fn=reward_fn)
        for a, b in zip(
            jax.tree_util.tree_leaves(sample.data), jax.tree_util.tree_leaves(out.data)
        ):
            assert a.dtype == b.dtype


# ---------------------------------------------------------------------------- errors
@functools.cache
def _filled():
    rb = buffer(8, 4)
    state = rb.add(rb.init(example()), steps(lengths(3, 4)))
    sample, state = rb.sample(state, jax.random.key(0))
    return rb, state, sample


def test_errors_name_the_argument_and_the_fix():
    rb, state, sample = _filled()
    key = jax.random.key(1)
    with pytest.raises(ValueError, match="strategy must be one of"):
        H.relabel(key, rb, state, sample, reward_fn=reward_fn, strategy="past")
    with pytest.raises(
        ValueError, match=r"her_ratio must be a finite Python number in \[0.0, 1.0\]"
    ):
        H.relabel(key, rb, state, sample, reward_fn=reward_fn, her_ratio=1.5)
    with pytest.raises(KeyError, match="none of the end keys"):
        H.relabel(key, rb, state, sample, reward_fn=reward_fn, end_keys=[("next", "stop")])
    with pytest.raises(KeyError, match="'missing'"):
        H.relabel(key, rb, state, sample, reward_fn=reward_fn, achieved_goal_key="missing")
    with pytest.raises(ValueError, match=r"reward_fn's reward has shape \(3,\).*Return one value"):
        H.relabel(key, rb, state, sample, reward_fn=lambda d: jnp.zeros(3), her_ratio=1.0)
    with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
        H.relabel(0, rb, state, sample, reward_fn=reward_fn)
    with pytest.raises(ValueError, match="ends must be a bool vector"):
        H.episode_limits(jnp.zeros((2, 3), bool), 3)


def test_refuses_writers_out_of_time_order_and_slices():
    rb = frb.ReplayBuffer(capacity=8, batch_size=4, writer=frb.MaxValueWriter("step"))
    with pytest.raises(ValueError, match="RoundRobinWriter"):  # refused before any read
        H.relabel(jax.random.key(1), rb, None, None, reward_fn=reward_fn)
    rb, state, sample = _filled()
    sliced = sample._replace(indices=sample.indices.reshape(2, 2))
    with pytest.raises(ValueError, match="must be flat"):
        H.relabel(jax.random.key(1), rb, state, sliced, reward_fn=reward_fn)


def test_her_ratio_zero_returns_the_sample():
    rb, state, sample = _filled()
    assert (
        H.relabel(jax.random.key(1), rb, state, sample, reward_fn=reward_fn, her_ratio=0.0)
        is sample
    )
