"""The error policy (functional_rb._internal.errors), the same in both prioritized samplers: eagerly a
ValueError naming the bad entry; under jit the documented fallback, which never writes
anything anywhere else (bad entries are ignored, huge priorities clamped)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import functional_rb as frb
from functional_rb.samplers import sum_tree
from functional_rb.samplers.priorities import value_max

CAP = 8


def _item():
    return {"x": jnp.zeros((), jnp.int32), "next": {"done": jnp.zeros((1,), bool)}}


def _items(n, start=0):
    done = np.zeros((n, 1), bool)
    done[::4] = True  # trajectories of 4 steps (slice_len 2 fits)
    return {"x": jnp.arange(start, start + n, dtype=jnp.int32), "next": {"done": jnp.asarray(done)}}


SAMPLERS = {
    "prioritized": lambda **kw: frb.PrioritizedSampler(alpha=kw.pop("alpha", 0.6), beta=0.4, **kw),
    "prioritized_slice": lambda **kw: frb.PrioritizedSliceSampler(
        kw.pop("alpha", 0.6), 0.4, slice_len=2, strict_length=False, **kw
    ),
}


def _buffer(kind, batch_size=4, **kw):
    return frb.ReplayBuffer(CAP, sampler=SAMPLERS[kind](**kw), batch_size=batch_size)


def _values(state):
    """float32 [CAP]: each position's stored value (the sampler's own per-step array)."""
    s = state.sampler
    return np.asarray(s.prio if hasattr(s, "prio") else s.tree.leaves)


def _filled(rb):
    state = rb.add(rb.init(_item()), _items(CAP))
    return rb.update(
        state, jnp.arange(CAP, dtype=jnp.int32), jnp.linspace(0.5, 2.0, CAP, dtype=jnp.float32)
    )


@pytest.fixture(params=sorted(SAMPLERS))
def kind(request):
    return request.param


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0])
def test_bad_priority_eagerly_raises_naming_the_entry(kind, bad):
    rb = _buffer(kind)
    state = _filled(rb)
    with pytest.raises(
        ValueError,
        match=r"priorities\[1\] \(storage index 5\) = "
        + f"{float(bad)!r}".replace("(", r"\(")
        + r" is not a finite number >= 0",
    ):
        rb.update(state, jnp.array([2, 5, 6], jnp.int32), jnp.array([1.0, bad, 1.0]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0])
def test_bad_priority_under_jit_is_ignored(kind, bad):
    rb = _buffer(kind)
    state = _filled(rb)
    before = _values(state)
    new = jax.jit(rb.update)(
        state, jnp.array([2, 5, 6], jnp.int32), jnp.array([3.0, bad, 0.25], jnp.float32)
    )
    after = _values(new)
    # the bad entry keeps its value, the good ones of the same call are applied
    np.testing.assert_array_equal(after[[0, 1, 3, 4, 5, 7]], before[[0, 1, 3, 4, 5, 7]])
    alpha, eps = rb.sampler.alpha, rb.sampler.eps
    np.testing.assert_allclose(after[[2, 6]], (np.float32([3.0, 0.25]) + eps) ** alpha, rtol=1e-6)
    assert float(new.sampler.max_priority) == 3.0
    assert np.isfinite(float(sum_tree.total(new.sampler.tree)))


def test_same_documented_result_in_both_samplers():
    # One NaN among valid priorities: both samplers store the same values under jit.
    got = {}
    for kind in SAMPLERS:
        rb = _buffer(kind)
        state = jax.jit(rb.update)(
            _filled(rb),
            jnp.arange(CAP, dtype=jnp.int32),
            jnp.array([1, np.nan, 2, 3, 4, 5, 6, 7], jnp.float32),
        )
        got[kind] = _values(state)
    np.testing.assert_array_equal(got["prioritized"], got["prioritized_slice"])


@pytest.mark.parametrize("index", [-1, CAP, 2**31 - 1, 2**32 + 3])
def test_out_of_range_index_eagerly_raises_in_its_own_dtype(kind, index):
    rb = _buffer(kind)
    state = _filled(rb)
    # NumPy int64 input: checked before any int32 cast (2**32 + 3 is not item 3)
    with pytest.raises(ValueError, match=rf"indices\[1\] = {index} is outside \[0, {CAP}\)"):
        rb.update(state, np.array([1, index], np.int64), np.array([1.0, 9.0]))


def test_int64_index_under_jit_never_aliases(kind):
    rb = _buffer(kind)
    with jax.enable_x64(True):
        state = _filled(rb)
        before = _values(state)
        new = jax.jit(rb.update)(
            state,
            jnp.array([2**32 + 3, 2, -(2**32) + 4], jnp.int64),
            jnp.array([9.0, 3.0, 9.0], jnp.float32),
        )
        after = _values(new)
        # only index 2 is written; items 3 and 4 (what the wrapped indices would hit) keep theirs
        np.testing.assert_array_equal(np.delete(after, 2), np.delete(before, 2))
        assert after[2] != before[2]
        assert float(new.sampler.max_priority) == 3.0


def test_without_x64_jit_itself_wraps_int64_indices_as_documented(kind):
    """The policy's stated limit: with x64 off, jax.jit casts an int64 argument to int32 at
    its boundary, silently, so 2**32 + 3 reaches the library as 3. If JAX ever stops doing
    so, this fails and the documented limit can go."""
    rb = _buffer(kind)
    state = _filled(rb)
    before = _values(state)
    new = jax.jit(rb.update)(state, np.array([2**32 + 3], np.int64), np.array([9.0]))
    after = _values(new)
    assert after[3] != before[3]
    np.testing.assert_array_equal(np.delete(after, 3), np.delete(before, 3))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_huge_priorities_are_clamped_and_sampling_stays_correct(kind, jit):
    f = jax.jit if jit else (lambda g: g)
    rb = _buffer(kind, batch_size=4000, alpha=1.0)
    state = _filled(rb)
    # 3e38 at alpha=1: the raw values would sum to inf
    state = f(rb.update)(state, jnp.arange(6, dtype=jnp.int32), jnp.full((6,), 3e38))
    state = f(rb.update)(state, jnp.array([6, 7], jnp.int32), jnp.array([1.0, 1.0]))
    vmax = np.float32(value_max(CAP))
    np.testing.assert_array_equal(_values(state)[:6], vmax)
    total = float(sum_tree.total(state.sampler.tree))
    assert np.isfinite(total) and total > 0
    sample, state = f(rb.sample)(state, jax.random.key(0))
    starts = np.asarray(sample.indices).reshape(sample.indices.shape[0], -1)[:, 0]
    assert np.asarray(sample.mask).reshape(starts.shape[0], -1)[:, 0].all()
    assert np.isfinite(np.asarray(sample.weights)).all()
    # the clamped items are drawn equally often; items 6 and 7 (value ~1e-32 of theirs) never
    counts = np.bincount(starts, minlength=CAP)
    assert counts[6:].sum() == 0
    valid = _values(state)[:6] > 0
    if kind == "prioritized_slice":  # only valid slice starts are drawn
        valid = np.asarray(state.sampler.valid)[:6]
    _, p = stats.chisquare(counts[:6][valid])
    assert p > 1e-3, (counts, p)
    # new items get the value of the largest priority seen: the clamp, still finite
    state = f(rb.add)(state, _items(2, start=100))
    np.testing.assert_array_equal(_values(state)[:2], vmax)
    assert np.isfinite(float(sum_tree.total(state.sampler.tree)))
    # and an item updated to a normal priority is drawn accordingly (here: never)
    state = f(rb.update)(state, jnp.array([0], jnp.int32), jnp.array([1.0]))
    sample, _ = f(rb.sample)(state, jax.random.key(1))
    assert 0 not in np.asarray(sample.indices).reshape(sample.indices.shape[0], -1)[:, 0]


@pytest.mark.parametrize("beta", [np.nan, -0.5, np.inf])
def test_bad_beta_eagerly_raises_and_falls_back_under_jit(kind, beta):
    rb = _buffer(kind)
    state = _filled(rb)
    with pytest.raises(ValueError, match="beta must be a finite scalar >= 0"):
        rb.sample(state, jax.random.key(0), beta=beta)
    got, _ = jax.jit(rb.sample)(state, jax.random.key(0), beta=jnp.float32(beta))
    want, _ = jax.jit(rb.sample)(state, jax.random.key(0))  # the sampler's beta
    np.testing.assert_array_equal(np.asarray(got.weights), np.asarray(want.weights))
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))


def test_get_index_out_of_range_raises_eagerly_and_clips_under_jit():
    rb = frb.ReplayBuffer(CAP, batch_size=4)
    state = rb.add(
        rb.init({"x": jnp.zeros((), jnp.int32)}), {"x": jnp.arange(CAP, dtype=jnp.int32)}
    )
    with pytest.raises(ValueError, match=rf"ReplayBuffer.get: indices\[1\] = {CAP} is outside"):
        rb.get(state, jnp.array([0, CAP], jnp.int32))
    with pytest.raises(ValueError, match=r"indices\[0\] = 4294967299 is outside"):
        rb.get(state, np.array([2**32 + 3], np.int64))
    got = jax.jit(rb.get)(state, jnp.array([-5, 3, CAP + 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got["x"]), [0, 3, CAP - 1])
