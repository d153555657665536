"""``ReplayBuffer.sample_keeps_state``: True exactly when a sample hands back the state it was
given, so a jitted function may return the sample alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb

EXAMPLE = {"obs": jnp.zeros(3), "done": jnp.bool_(False), "policy_version": jnp.int32(0)}
N = 40


def _items():
    return {
        "obs": jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3),
        "done": jnp.arange(N) % 10 == 9,
        "policy_version": jnp.zeros(N, jnp.int32),
    }


# (id, buffer keyword arguments, whether a sample keeps the state)
CASES = [
    ("random", dict(batch_size=4), True),
    ("prioritized", dict(batch_size=4, sampler=frb.PrioritizedSampler(0.6, 0.4)), True),
    ("slice", dict(batch_size=8, sampler=frb.SliceSampler(slice_len=4, end_key="done")), True),
    (
        "prioritized_slice",
        dict(
            batch_size=8, sampler=frb.PrioritizedSliceSampler(0.6, 0.4, slice_len=4, end_key="done")
        ),
        True,
    ),
    ("episode", dict(batch_size=8, sampler=frb.EpisodeSampler(slice_len=4, end_key="done")), True),
    ("ted", dict(batch_size=4, storage=frb.TEDStorage(side_capacity=64)), True),
    ("staleness", dict(batch_size=4, sampler=frb.StalenessAwareSampler()), True),
    ("without_replacement", dict(batch_size=4, sampler=frb.SamplerWithoutReplacement()), False),
    ("once", dict(batch_size=4, sampler=frb.SampleOnceSampler()), False),
    (
        "slice_without_replacement",
        dict(batch_size=8, sampler=frb.SliceSamplerWithoutReplacement(slice_len=4, end_key="done")),
        False,
    ),
    (
        "rate_limiter",
        dict(
            batch_size=4, rate_limiter=frb.RateLimiter(1.0, min_size_to_sample=1, error_buffer=1e3)
        ),
        False,
    ),
]


def _buffer(kwargs):
    rb = frb.ReplayBuffer(capacity=64, **kwargs)
    if isinstance(rb.storage, frb.TEDStorage):
        ex = {"obs": jnp.zeros(3), "next": {"obs": jnp.zeros(3), "done": jnp.bool_(False)}}
        items = _items()
        items = {
            "obs": items["obs"],
            "next": {"obs": items["obs"] + 1, "done": items["done"]},
        }
        return rb, rb.add(rb.init(ex), items)
    return rb, rb.add(rb.init(EXAMPLE), _items())


def _equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("name,kwargs,keeps", CASES, ids=[c[0] for c in CASES])
def test_answer_matches_what_a_sample_does(name, kwargs, keeps):
    rb, state = _buffer(kwargs)
    assert rb.sample_keeps_state(state) is keeps
    before = jax.tree_util.tree_map(np.asarray, state)  # the call consumed nothing
    sample = jax.jit(rb.sample)
    changed = False
    for seed in range(4):
        _, new = sample(state, jax.random.key(seed))
        changed |= not _equal(new, before)
    # True: no sample changes a value; False here: the state really moves (not a cautious no)
    assert changed is not keeps, name


@pytest.mark.parametrize(
    "name,kwargs,keeps", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]]
)
def test_sample_alone_matches_full_sample(name, kwargs, keeps):
    del keeps
    rb, state = _buffer(kwargs)
    alone = jax.jit(lambda s, k: rb.sample(s, k)[0])  # no donation: the state stays the caller's
    full = jax.jit(rb.sample)
    for seed in range(3):
        k = jax.random.key(seed)
        a = alone(state, k)
        b, _ = full(state, k)
        assert _equal(a, b), name


def test_under_jit_and_with_a_batch_size():
    rb, state = _buffer(dict(batch_size=4, sampler=frb.SamplerWithoutReplacement()))

    @jax.jit
    def f(s):
        assert rb.sample_keeps_state(s, batch_size=2) is False  # a Python bool at trace time
        return s

    f(state)
    rb2, state2 = _buffer(dict(batch_size=4))
    assert rb2.sample_keeps_state(state2, batch_size=8) is True


def test_consumed_state_is_named():
    rb, state = _buffer(dict(batch_size=4))
    jax.jit(rb.add, donate_argnums=0)(state, _items())
    with pytest.raises(frb.errors.ConsumedStateError, match="sample_keeps_state"):
        rb.sample_keeps_state(state)


@pytest.mark.parametrize(
    "name,kwargs,keeps", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]]
)
def test_eager_sample_of_a_kept_state_consumes_nothing(name, kwargs, keeps):
    # the eager path finds the state's unchanged arrays as sample_keeps_state does, through
    # the samplers' inner jit calls: it hands them back instead of donating them
    del keeps
    rb, state = _buffer(kwargs)
    _, new = rb.sample(state, jax.random.key(0))
    old_leaves = jax.tree_util.tree_leaves(state)
    assert not any(x.is_deleted() for x in old_leaves), name
    assert all(a is b for a, b in zip(old_leaves, jax.tree_util.tree_leaves(new))), name
