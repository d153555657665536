"""RateLimiter: Reverb's SampleToInsertRatio as pure functions in the buffer state.

can_insert / can_sample are checked against a plain-Python model of Reverb's rules after any
sequence of adds and samples (eagerly and under jit); counters wrap in int32 without changing
the answers; the constructor refuses windows that would block forever; a jitted loop that
honours the limiter keeps the ratio inside the window."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb


class ReverbModel:
    """Reverb's RateLimiter (rate_limiter.cc): stage 1 while size <= min_size_to_sample."""

    def __init__(self, spi, min_size, lo, hi):
        self.spi, self.min_size, self.lo, self.hi = spi, min_size, lo, hi
        self.inserts = self.samples = 0

    def can_insert(self, size, n):
        if size + n <= self.min_size:
            return True
        return (self.inserts + n) * self.spi - self.samples <= self.hi

    def can_sample(self, size, n):
        if size < self.min_size:
            return False
        return self.inserts * self.spi - self.samples - n >= self.lo


LIMITERS = [
    frb.RateLimiter(samples_per_insert=2.0, min_size_to_sample=5, error_buffer=6.0),
    frb.RateLimiter(samples_per_insert=0.5, min_size_to_sample=3, error_buffer=(-4, 9)),
    frb.RateLimiter(samples_per_insert=1 / 3, min_size_to_sample=2, error_buffer=7),
]
B, ADD = 4, 3


@functools.cache
def _fns(limiter, jitted):
    rb = frb.ReplayBuffer(8, batch_size=B, rate_limiter=limiter)  # wraps: size != inserts
    wrap = jax.jit if jitted else (lambda f: f)
    return rb, wrap(rb.add), wrap(rb.sample), wrap(rb.can_insert), wrap(rb.can_sample)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, len(LIMITERS) - 1),
    ops=st.lists(st.sampled_from(["add", "sample"]), min_size=1, max_size=25),
)
def test_answers_follow_reverb(maybe_jit, which, ops):
    limiter = LIMITERS[which]
    rb, add, sample, can_insert, can_sample = _fns(limiter, maybe_jit is jax.jit)
    model = ReverbModel(
        limiter.samples_per_insert, limiter.min_size_to_sample, limiter.min_diff, limiter.max_diff
    )
    state = rb.init({"x": jnp.float32(0)})
    size = 0
    for i, op in enumerate(ops):
        assert bool(can_insert(state, ADD)) == model.can_insert(size, ADD)
        assert bool(can_insert(state)) == model.can_insert(size, 1)
        assert bool(can_sample(state)) == model.can_sample(size, B)
        if op == "add":
            state = add(state, {"x": np.ones(ADD, np.float32)})
            model.inserts += ADD
            size = min(size + ADD, 8)
        elif size:  # the limiter advises; sample itself always draws (and counts)
            _, state = sample(state, jax.random.key(i))
            model.samples += B
        assert int(state.limiter.inserts) == model.inserts
        assert int(state.limiter.samples) == model.samples
        assert float(limiter.error(state.limiter)) == pytest.approx(
            model.inserts * model.spi - model.samples, abs=1e-4
        )


def test_counters_count_items_and_only_successful_samples():
    limiter = frb.RateLimiter(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=100)
    rb = frb.ReplayBuffer(12, ndim=2, batch_size=5, rate_limiter=limiter)
    state = rb.init({"x": jnp.zeros(2)})  # 2 envs
    smp, state = jax.jit(rb.sample)(state, jax.random.key(0))  # nothing stored: not counted
    assert not np.asarray(smp.mask).any() and int(state.limiter.samples) == 0
    state = rb.add(state, {"x": np.ones((2, 3), np.float32)})
    assert int(state.limiter.inserts) == 6  # [num_envs, T] = 6 items
    _, state = rb.sample(state, jax.random.key(1))
    assert int(state.limiter.samples) == 5


def test_error_is_exact_when_counters_wrap():
    limiter = frb.RateLimiter(samples_per_insert=0.75, min_size_to_sample=1, error_buffer=10)
    near = 2**31 - 8
    s = frb.RateLimiterState(inserts=jnp.int32(near), samples=jnp.int32(int(near * 0.75) - 3))
    for _ in range(4):  # past 2**31: the counters wrap, the error stays exact
        s = limiter.on_sample(limiter.on_insert(s, 8), 6)
        assert float(limiter.error(s)) == pytest.approx(near * 0.75 - int(near * 0.75) + 3)
    assert int(s.inserts) < 0  # wrapped


def test_a_jitted_loop_that_honours_the_limiter_keeps_the_ratio():
    limiter = frb.RateLimiter(samples_per_insert=4.0, min_size_to_sample=32, error_buffer=64)
    rb = frb.ReplayBuffer(256, batch_size=16, rate_limiter=limiter)

    def step(carry, key):
        state, actor_turn = carry
        k1, k2 = jax.random.split(key)
        # the actor adds 8 items when allowed, the learner samples when allowed
        state = jax.lax.cond(
            actor_turn & rb.can_insert(state, 8),
            lambda s: rb.add(s, {"x": jax.random.normal(k1, (8,))}),
            lambda s: s,
            state,
        )
        state = jax.lax.cond(
            ~actor_turn & rb.can_sample(state), lambda s: rb.sample(s, k2)[1], lambda s: s, state
        )
        return (state, ~actor_turn), limiter.error(state.limiter)

    state = rb.init({"x": jnp.float32(0)})
    (state, _), errors = jax.jit(
        lambda s, k: jax.lax.scan(step, (s, True), jax.random.split(k, 400))
    )(state, jax.random.key(0))
    inserts, samples = int(state.limiter.inserts), int(state.limiter.samples)
    assert samples > 1000 and samples / inserts == pytest.approx(4.0, rel=0.2)
    errors = np.asarray(errors)[50:]  # once min_size_to_sample items are in
    assert errors.min() >= limiter.min_diff - 16 and errors.max() <= limiter.max_diff + 32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(samples_per_insert=0.0, min_size_to_sample=1, error_buffer=5), "finite and > 0"),
        (dict(samples_per_insert=1.0, min_size_to_sample=0, error_buffer=5), "int >= 1"),
        (dict(samples_per_insert=4.0, min_size_to_sample=1, error_buffer=3), "narrower than 2"),
        (
            dict(samples_per_insert=1.0, min_size_to_sample=10, error_buffer=(11, 30)),
            "starts at min_diff=11",
        ),
        (dict(samples_per_insert=0.1234567, min_size_to_sample=1, error_buffer=5), "ratio p/q"),
        (dict(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=(1, 2, 3)), "a pair"),
    ],
)
def test_constructor_refuses_windows_that_block_forever(kwargs, match):
    with pytest.raises(ValueError, match=match):
        frb.RateLimiter(**kwargs)


def test_buffer_checks_its_limiter():
    small = frb.RateLimiter(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=4)
    with pytest.raises(ValueError, match="narrower than one sample batch"):
        frb.ReplayBuffer(64, batch_size=32, rate_limiter=small)
    with pytest.raises(TypeError, match="rate_limiter must be a frb.RateLimiter"):
        frb.ReplayBuffer(64, rate_limiter=4.0)
    limiter = frb.RateLimiter(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=40)
    rb = frb.ReplayBuffer(64, batch_size=8, rate_limiter=limiter)
    plain = frb.ReplayBuffer(64, batch_size=8).init({"x": jnp.float32(0)})
    with pytest.raises(TypeError, match="has a rate limiter but state.limiter is NoneType"):
        rb.can_sample(plain)
    assert bool(frb.ReplayBuffer(64, batch_size=8).can_insert(plain))  # no limiter: always
    assert hash(limiter) == hash(dataclasses.replace(limiter))


def test_limiter_counters_are_checkpointed(tmp_path):
    limiter = frb.RateLimiter(samples_per_insert=2.0, min_size_to_sample=2, error_buffer=20)
    rb = frb.ReplayBuffer(16, batch_size=4, rate_limiter=limiter)
    state = rb.add(rb.init({"x": jnp.float32(0)}), {"x": np.ones(6, np.float32)})
    _, state = rb.sample(state, jax.random.key(0))
    frb.checkpoint.save(tmp_path / "c", state)
    back = frb.checkpoint.load(tmp_path / "c", like=rb.init({"x": jnp.float32(0)}))
    assert (int(back.limiter.inserts), int(back.limiter.samples)) == (6, 4)
    assert bool(rb.can_sample(back)) == bool(rb.can_sample(state))
