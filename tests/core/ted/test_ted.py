"""TED storage, frame stacks, n-step returns and TED <-> flat conversions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ted_data import naive_stacks, ted_stream  # noqa: E402
from _trees import assert_trees_equal  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.ted import TEDStorage, flat_to_ted, n_step_returns, ted_to_flat
from functional_rb.testing import assert_invariants

EXAMPLES = settings(max_examples=3, deadline=None)

# (ndim, num_envs, row_capacity, frame_stack, stack_pad)
CONFIGS = [
    (1, 1, 7, 1, "first"),
    (2, 2, 5, 3, "zeros"),
]
CONFIG_IDS = ["ndim1", "ndim2-stack3-zeros"]
# The equivalence test draws the row capacity: (ndim, num_envs, frame_stack, stack_pad) and the
# capacities it draws from (one below the stack size: stacks reach before the oldest stored
# step; and a few above it).
EQUIV = [
    ((1, 1, 1, "first"), (3, 7)),
    ((1, 1, 4, "first"), (3, 6)),
    ((2, 2, 3, "zeros"), (2, 5)),
]
EQUIV_IDS = ["ndim1", "ndim1-stack4-first", "ndim2-stack3-zeros"]
SAMPLER_CONFIG = (2, 2, 5, 4, "first")  # the first-frame padding, ndim=2, 4-frame stacks


def _samplers():
    """Every sampler of the core (API.md), with slice samplers that pad short trajectories."""
    return [
        frb.RandomSampler(),
        frb.SamplerWithoutReplacement(),
        frb.PrioritizedSampler(alpha=0.7, beta=0.5),
        frb.SliceSampler(slice_len=2, strict_length=False),
        frb.SliceSamplerWithoutReplacement(slice_len=2, strict_length=False),
        frb.PrioritizedSliceSampler(alpha=0.7, beta=0.5, slice_len=3, strict_length=False),
    ]


@functools.cache
def _buffers(config, sampler, min_len, jit):
    """The TED buffer and a plain buffer (fed naive full items), with their functions, built
    once per configuration so that jit compiles once across hypothesis examples."""
    ndim, e, r, k, pad = config
    ted = frb.ReplayBuffer(
        capacity=e * r,
        sampler=sampler,
        ndim=ndim,
        batch_size=6,
        storage=TEDStorage(frame_stack=k, stack_pad=pad, min_episode_len=min_len),
    )
    plain = frb.ReplayBuffer(capacity=e * r, sampler=sampler, ndim=ndim, batch_size=6)
    wrap = jax.jit if jit else (lambda f: f)
    # The plain buffer is the reference: jitted in both modes, compiled once for both.
    fns = {"ted": (ted, wrap(ted.add), wrap(ted.get), wrap(ted.sample)), "plain": _jitted(plain)}
    return fns


@functools.cache
def _jitted(rb):
    return rb, jax.jit(rb.add), jax.jit(rb.get), jax.jit(rb.sample)


def _chunks(x, ndim, a, b):
    return jax.tree_util.tree_map(lambda y: y[:, a:b] if ndim == 2 else y[0, a:b], x)


def _first(x, ndim):
    return jax.tree_util.tree_map(lambda y: y[:, 0] if ndim == 2 else y[0, 0], x)


def _fill(config, sampler, draw_chunks, seed, p_end, p_glitch, jit, min_len=1, check=None):
    ndim, e, r, k, pad = config
    fns = _buffers(config, sampler, min_len, jit)
    rng = np.random.default_rng(seed)
    sizes = [(2, r + 2)[c] for c in draw_chunks]
    data = ted_stream(rng, e, sum(sizes), p_end=p_end, p_glitch=p_glitch)
    ref = naive_stacks(data, k, pad) if k > 1 else data
    rb_t, add_t, get_t, sample_t = fns["ted"]
    rb_p, add_p, get_p, sample_p = fns["plain"]
    st_t, st_p = rb_t.init(_first(data, ndim)), rb_p.init(_first(ref, ndim))
    a = 0
    for c in sizes:
        st_t = add_t(st_t, _chunks(data, ndim, a, a + c))
        st_p = add_p(st_p, _chunks(ref, ndim, a, a + c))
        a += c
        if check is not None:
            check(fns, st_t, st_p, a)
    return fns, st_t, st_p, data, ref, a


def _stored_indices(rb, state):
    """All flat indices (one shape per buffer, so one compilation), and which are stored."""
    ctx = rb.context(state)
    lay = ctx.layout
    idx = np.arange(lay.capacity, dtype=np.int32)
    return idx, (idx % lay.row_capacity) < int(ctx.filled)


# ------------------------------------------------------------------- equivalence with a plain buffer
@pytest.mark.parametrize("config", EQUIV, ids=EQUIV_IDS)
@EXAMPLES
@given(
    data=st.data(),
    chunks=st.lists(st.integers(0, 1), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    p_end=st.sampled_from([0.0, 0.15, 0.5]),
    p_glitch=st.sampled_from([0.0, 0.1]),
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_get_matches_plain_storage(config, data, chunks, seed, p_end, p_glitch, jit):
    """For random episode boundaries, row capacities and add sizes: after every add (ring
    wraps, episode ends, adds larger than the ring), every stored index reads back the same
    full item (frame stacks included, built by a naive FrameStack reference with the
    configured padding) from the TED buffer as from a plain buffer fed the full items."""
    (ndim, e, k, pad), capacities = config
    r = data.draw(st.sampled_from(capacities), label="row_capacity")

    def check(fns, st_t, st_p, n_added):
        idx, stored = _stored_indices(fns["plain"][0], st_p)
        got = jax.tree_util.tree_map(lambda x: np.asarray(x)[stored], fns["ted"][2](st_t, idx))
        want = jax.tree_util.tree_map(lambda x: np.asarray(x)[stored], fns["plain"][2](st_p, idx))
        assert_trees_equal(got, want, f"after {n_added} steps per env")
        # no side row lost (lost == 0), side rows linked both ways, frame-stack distances
        assert_invariants(fns["ted"][0], st_t)

    _fill(
        (ndim, e, r, k, pad), frb.RandomSampler(), chunks, seed, p_end, p_glitch, jit, check=check
    )


def _fill_and_sample(rb, d):
    """Two adds of ``row_capacity + 2`` steps per env (the ring wraps), then two samples with
    keys 0 and 1, priorities updated after each (a no-op for uniform samplers)."""
    ndim, _, r, _, _ = SAMPLER_CONFIG
    c = r + 2
    state = rb.init(_first(d, ndim))
    for a in (0, c):
        state = rb.add(state, _chunks(d, ndim, a, a + c))
    samples = []
    for i in range(2):
        smp, state = rb.sample(state, jax.random.key(i))
        samples.append(smp)
        prio = jnp.arange(smp.indices.size, dtype=jnp.float32).reshape(smp.indices.shape) + 1.0
        state = rb.update(state, smp.indices, prio)
    return samples


@functools.cache
def _sample_fn(sampler, ted, jit):
    """:func:`_fill_and_sample` for the TED buffer (eager or jitted) or the plain one (the
    reference: always jitted, compiled once for both modes), built once per sampler so that
    jit compiles once across hypothesis examples."""
    ndim, e, r, k, pad = SAMPLER_CONFIG
    storage = (
        TEDStorage(frame_stack=k, stack_pad=pad, min_episode_len=1) if ted else frb.DeviceStorage()
    )
    rb = frb.ReplayBuffer(capacity=e * r, sampler=sampler, ndim=ndim, batch_size=6, storage=storage)
    fn = functools.partial(_fill_and_sample, rb)
    return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("sampler", _samplers(), ids=lambda s: type(s).__name__)
@settings(max_examples=2, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    p_end=st.sampled_from([0.2, 0.5]),
    p_glitch=st.sampled_from([0.0, 0.1]),
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_samples_match_plain_buffer(sampler, seed, p_end, p_glitch, jit):
    """Same key, same sampler, random episode boundaries (ndim=2, 4-frame stacks, ring wrap):
    the TED buffer returns the plain buffer's samples exactly (data, indices, weights, mask),
    and priority updates keep the two in step, for every sampler. (Samplers see the same end
    flags in both buffers and draw the same indices; the equivalence test above covers every
    index for random capacities.)"""
    ndim, e, r, k, pad = SAMPLER_CONFIG
    data = ted_stream(np.random.default_rng(seed), e, 2 * (r + 2), p_end=p_end, p_glitch=p_glitch)
    ref = naive_stacks(data, k, pad)
    got = _sample_fn(sampler, True, jit)(data)
    want = _sample_fn(sampler, False, True)(ref)
    for i in range(2):
        assert_trees_equal(got[i], want[i], f"sample {i}")
        assert bool(jnp.any(got[i].mask))


# ------------------------------------------------------------------- side table overflow
def test_side_table_overflow_raises_eagerly_and_counts_under_jit():
    rb = frb.ReplayBuffer(capacity=16, storage=TEDStorage(min_episode_len=8, side_capacity=2))
    data = ted_stream(np.random.default_rng(0), 1, 10, p_end=1.0)
    state = rb.init(_first(data, 1))
    with pytest.raises(ValueError, match="side table"):
        rb.add(state, _chunks(data, 1, 0, 10))
    state = jax.jit(rb.add)(state, _chunks(data, 1, 0, 10))
    assert int(state.storage.lost) > 0


_OVERFLOW_ADDS = {}


@pytest.mark.parametrize("ndim,e,k", [(1, 1, 1), (2, 3, 3)], ids=["ndim1", "ndim2-stack3"])
@settings(max_examples=5, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.sampled_from([1, 3, 7]), min_size=4, max_size=12),
)
def test_side_table_overflow_keeps_the_links(ndim, e, k, seed, sizes):
    """Side rows reused while their steps are stored (a small side table, short episodes):
    after every add, each stored step that still points at a side row is that row's owner
    (the reused rows' old steps were unlinked), so the only broken rule is the count of
    lost next observations."""
    key = (ndim, e, k)
    if key not in _OVERFLOW_ADDS:
        storage = TEDStorage(frame_stack=k, min_episode_len=6, side_capacity=3)
        rb = frb.ReplayBuffer(capacity=12 * e, ndim=ndim, storage=storage)
        _OVERFLOW_ADDS[key] = rb, jax.jit(rb.add)
    rb, add = _OVERFLOW_ADDS[key]
    data = ted_stream(np.random.default_rng(seed), e, sum(sizes), p_end=0.6, p_glitch=0.1)
    state, t = rb.init(_first(data, ndim)), 0
    for n in sizes:
        state, t = add(state, _chunks(data, ndim, t, t + n)), t + n
        if int(state.storage.lost) == 0:
            assert_invariants(rb, state)
            continue
        with pytest.raises(AssertionError) as info:
            assert_invariants(rb, state)
        assert info.value.rule == "TED next observations not lost", str(info.value)


def test_default_side_table_is_exact_when_episodes_are_long_enough():
    """min_episode_len=4 and every episode exactly 4 steps long: no side row is lost."""
    rng = np.random.default_rng(1)
    data = ted_stream(rng, 2, 40, p_end=0.0)
    done = np.zeros((2, 40, 1), bool)
    done[:, 3::4] = True
    data["next"]["done"] = done
    rb = frb.ReplayBuffer(capacity=24, ndim=2, storage=TEDStorage(min_episode_len=4))
    plain = frb.ReplayBuffer(capacity=24, ndim=2)
    st_t, st_p = rb.init(_first(data, 2)), plain.init(_first(data, 2))
    assert st_t.storage.owner.shape[0] < 24
    add_t, add_p = jax.jit(rb.add), jax.jit(plain.add)
    for a in range(0, 40, 5):
        st_t = add_t(st_t, _chunks(data, 2, a, a + 5))
        st_p = add_p(st_p, _chunks(data, 2, a, a + 5))
    idx = jnp.arange(24, dtype=jnp.int32)
    assert_trees_equal(rb.get(st_t, idx), plain.get(st_p, idx), "long episodes")
    assert_invariants(rb, st_t)  # lost == 0 among them


# ------------------------------------------------------------------- spec, memory, errors
def test_item_spec_is_the_full_ted_item_and_memory_is_one_frame_per_step():
    data = ted_stream(np.random.default_rng(0), 1, 4, frame_shape=(8, 8))
    item = _first(data, 1)
    storage = TEDStorage(frame_stack=4, min_episode_len=100)
    rb = frb.ReplayBuffer(capacity=1000, storage=storage)
    state = rb.init(item)
    spec = storage.item_spec(state.storage)
    want = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), item)
    assert spec == want
    per_step = storage.memory_bytes(state.storage) / 1000
    assert 64 <= per_step < 64 * 1.05 + 30  # one 8x8 uint8 frame + small leaves
    s, _ = rb.sample(rb.add(state, _chunks(data, 1, 0, 4)), jax.random.key(0), batch_size=3)
    assert s.data["observation"].shape == (3, 4, 8, 8)
    assert s.data["next"]["observation"].shape == (3, 4, 8, 8)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="pair"):
        TEDStorage(pairs=(("observation", ("next", "observation")),))
    with pytest.raises(ValueError, match="no \\(next, root\\) pair"):
        frb.ReplayBuffer(capacity=4, storage=TEDStorage()).init(
            {"obs": jnp.zeros(2), "next": {"reward": jnp.zeros(())}}
        )
    with pytest.raises(KeyError, match="end_keys"):
        frb.ReplayBuffer(capacity=4, storage=TEDStorage(frame_stack=2)).init(
            {"obs": jnp.zeros(2), "next": {"obs": jnp.zeros(2)}}
        )
    with pytest.raises(ValueError, match="stack_pad"):
        TEDStorage(stack_pad="edge")


# ------------------------------------------------------------------- n-step returns
def _nstep_reference(ref, n_added, rb, state, idx, n, gamma):
    """Straight loops over the added stream (numpy)."""
    ctx = rb.context(state)
    lay = ctx.layout
    filled, cursor, r = int(ctx.filled), int(ctx.cursor), lay.row_capacity
    oldest = (cursor - filled) % r
    rew = ref["next"]["reward"]
    end = ref["next"]["done"][..., 0] | ref["next"]["truncated"][..., 0]
    out = {"r": [], "m": [], "obs": [], "terminated": [], "done": [], "truncated": []}
    for p in np.asarray(idx):
        env, t = divmod(int(p), r)
        tau = n_added - filled + (t - oldest) % r
        total, m = 0.0, 0
        for i in range(n):
            if tau + i >= n_added or (i > 0 and end[env, tau + i - 1]):
                break
            total += gamma**i * float(rew[env, tau + i, 0])
            m += 1
        out["r"].append(total)
        out["m"].append(m)
        out["obs"].append(ref["next"]["observation"][env, tau + m - 1])
        for key in ("terminated", "done", "truncated"):
            out[key].append(ref["next"][key][env, tau + m - 1])
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@settings(max_examples=4, deadline=None)
@given(
    chunks=st.lists(st.integers(0, 1), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    n=st.sampled_from([1, 3]),
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_n_step_returns_match_numpy_reference(config, chunks, seed, n, jit):
    fns, st_t, _, _, ref, n_added = _fill(config, frb.RandomSampler(), chunks, seed, 0.3, 0.0, jit)
    rb = fns["ted"][0]
    idx, stored = _stored_indices(rb, st_t)
    fn = functools.partial(n_step_returns, rb, n=n)
    out = (jax.jit(fn) if jit else fn)(st_t, idx, gamma=0.9)
    out = jax.tree_util.tree_map(lambda x: np.asarray(x)[stored], out)
    idx = idx[stored]
    want = _nstep_reference(ref, n_added, rb, st_t, idx, n, 0.9)
    np.testing.assert_allclose(
        np.asarray(out["next"]["reward"])[:, 0], want["r"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(out["steps_to_next_obs"]), want["m"])
    np.testing.assert_array_equal(np.asarray(out["next"]["observation"]), want["obs"])
    for key in ("terminated", "done", "truncated"):
        np.testing.assert_array_equal(np.asarray(out["next"][key]), want[key], err_msg=key)
    np.testing.assert_allclose(np.asarray(out["gamma"]), 0.9 ** want["m"], rtol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(out["next"]["original_reward"]),
        np.asarray(rb.get(st_t, jnp.asarray(idx))["next"]["reward"]),
    )


def test_n_step_matches_torchrl_multistep_inside_a_trajectory():
    torch = pytest.importorskip("torch")
    from tensordict import TensorDict
    from torchrl.data.postprocs.postprocs import _multi_step_func

    data = ted_stream(
        np.random.default_rng(3), 1, 12, p_end=0.25, frame_shape=(3,), dtype=np.float32
    )
    rb = frb.ReplayBuffer(capacity=12)
    state = rb.add(rb.init(_first(data, 1)), _chunks(data, 1, 0, 12))
    out = n_step_returns(rb, state, jnp.arange(12, dtype=jnp.int32), n=3, gamma=0.9)
    d = _chunks(data, 1, 0, 12)
    td = TensorDict(
        {
            "observation": torch.as_tensor(d["observation"]),
            "next": {k: torch.as_tensor(v) for k, v in d["next"].items()},
        },
        [12],
    )
    # TorchRL needs n successors per step, and cuts the last n steps: compare the rest.
    want = _multi_step_func(
        td,
        done_key="done",
        done_keys=["done", "truncated", "terminated"],
        reward_keys=["reward"],
        mask_key=None,
        n_steps=3,
        gamma=0.9,
    )
    keep = 12 - 3
    np.testing.assert_allclose(
        np.asarray(out["next"]["reward"])[:keep], want["next", "reward"].numpy()[:keep], rtol=1e-5
    )
    np.testing.assert_array_equal(
        np.asarray(out["next"]["observation"])[:keep], want["next", "observation"].numpy()[:keep]
    )
    np.testing.assert_array_equal(
        np.asarray(out["steps_to_next_obs"])[:keep], want["steps_to_next_obs"].numpy()[:keep]
    )


# ------------------------------------------------------------------- TED <-> flat
def _torch_ted(d, ndim):
    import torch
    from tensordict import TensorDict

    def conv(x):
        x = torch.as_tensor(np.ascontiguousarray(x))
        return x.transpose(0, 1).contiguous() if ndim == 2 else x

    tree = jax.tree_util.tree_map(conv, d)
    shape = list(tree["observation"].shape[:ndim])
    return TensorDict(tree, shape)


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("is_full", [False, True])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shift=st.integers(1, 9))
def test_ted_to_flat_matches_torchrl_and_round_trips(tmp_path_factory, ndim, is_full, seed, shift):
    pytest.importorskip("torchrl")
    from torchrl.data import Flat2TED, TED2Flat

    rng = np.random.default_rng(seed)
    n = 9
    # A consistent ring: a stream rolled so that slot `shift % n` holds the oldest step.
    stream = ted_stream(rng, 2, n, p_end=0.3, frame_shape=(2,), dtype=np.float32)
    if is_full:
        stream = jax.tree_util.tree_map(lambda x: np.roll(x, shift, axis=1), stream)
    d = stream if ndim == 2 else jax.tree_util.tree_map(lambda x: x[0], stream)
    flat = ted_to_flat(d, shift=shift, is_full=is_full, ndim=ndim)

    hook = TED2Flat()
    hook.shift, hook.is_full = shift, is_full
    want = hook(_torch_ted(d, ndim), path=tmp_path_factory.mktemp("flat"))
    tensor_keys = sorted(want.keys(include_nested=True, leaves_only=True))
    assert sorted(k for k in flat if k not in ("shift", "is_full", "_storage_shape")) == tensor_keys
    for key in tensor_keys:
        np.testing.assert_array_equal(flat[key], want[key].numpy(), err_msg=key)
    assert flat["shift"] == shift and flat["is_full"] == is_full
    assert tuple(flat["_storage_shape"]) == tuple(want.get_non_tensor("_storage_shape"))

    back = flat_to_ted(flat)
    # TorchRL 0.14's Flat2TED raises on a full [time, env] storage whose cursor is back at slot
    # 0 (shift == n); every other case is compared with it (its [time, env] is our [env, time]).
    if ndim == 1 or not (is_full and shift % n == 0):
        want_back = Flat2TED()(want)
        keys = sorted(
            (k,) if isinstance(k, str) else k
            for k in want_back.keys(include_nested=True, leaves_only=True)
        )
        assert keys == sorted(
            tuple(p.key for p in path) for path, _ in jax.tree_util.tree_flatten_with_path(back)[0]
        )
        for key in keys:
            b = want_back[key].numpy()
            np.testing.assert_array_equal(
                np.asarray(functools.reduce(lambda t, k: t[k], key, back)),
                b if ndim == 1 else np.swapaxes(b, 0, 1),
                err_msg=str(key),
            )
    # Round trip: every written step of a consistent ring comes back (root done keys come
    # back zeroed, as in TorchRL). past_len="saved": with shift == n and not full (no TorchRL
    # state: its storage is full once n slots are written) TorchRL's reading gives the newest
    # step's next values as zeros.
    back = flat_to_ted(flat, past_len="saved")
    for key in (
        ("observation",),
        ("action",),
        ("next", "observation"),
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
    ):
        valid = slice(None) if is_full else slice(0, shift)
        a = functools.reduce(lambda t, k: t[k], key, back)
        b = functools.reduce(lambda t, k: t[k], key, d)
        if ndim == 2:
            a, b = a[:, valid], b[:, valid]
        else:
            a, b = a[valid], b[valid]
        np.testing.assert_array_equal(a, b, err_msg=str(key))


@pytest.mark.parametrize("ndim", [1, 2])
def test_flat_to_ted_saved_restores_unwritten_rows(ndim):
    """past_len="saved" gives back every slot of a non-full storage, unwritten ones included
    (the last slot's next entries are zeros unless that step ends a trajectory)."""
    rng = np.random.default_rng(3)
    n, shift = 7, 3
    stream = ted_stream(rng, 2, n, p_end=0.3, frame_shape=(2,), dtype=np.float32)
    d = stream if ndim == 2 else jax.tree_util.tree_map(lambda x: x[0], stream)
    back = flat_to_ted(ted_to_flat(d, shift=shift, is_full=False, ndim=ndim), past_len="saved")
    last = (slice(None), -1) if ndim == 2 else (-1,)
    for key in (
        ("observation",),
        ("action",),
        ("next", "reward"),
        ("next", "done"),
        ("next", "observation"),
    ):
        a = np.array(functools.reduce(lambda t, k: t[k], key, back))
        b = np.array(functools.reduce(lambda t, k: t[k], key, d))
        if key == ("next", "observation"):
            ends = np.asarray(d["next"]["done"])[last][..., 0]
            assert np.all(a[last][~ends] == 0)
            a[last], b[last] = 0, 0
        np.testing.assert_array_equal(a, b, err_msg=str(key))
    assert not np.any(back["done"])
    with pytest.raises(ValueError, match="past_len must be one of"):
        flat_to_ted(ted_to_flat(d, shift=shift, is_full=False, ndim=ndim), past_len="x")
