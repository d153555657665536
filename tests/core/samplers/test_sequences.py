"""SequenceSampler and PrioritizedSequenceSampler: the protocol (functional_rb.testing), the
drawable set against a Python reference of flashbax's rule, the distributions (chi-square),
priorities and generations, episode ends, and the same results eagerly and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import functional_rb as frb
from functional_rb.samplers.sequences import item_ranges
from functional_rb.testing import check_sampler


def reference_drawable(steps: int, row_capacity: int, length: int, period: int):
    """Logical starts of the drawable items of a row after ``steps`` steps (flashbax's
    prioritised rule, written out)."""
    first = -(-max(steps - row_capacity, 0) // period) * period
    return [s for s in range(first, steps, period) if s + length <= steps]


def ring_rb(sampler, rows=2, row_capacity=12, batch=None):
    batch = batch or 4 * sampler.sequence_length
    return frb.ReplayBuffer(capacity=rows * row_capacity, ndim=2, batch_size=batch, sampler=sampler)


def example(rows=2):
    return {"t": jnp.zeros((rows,), jnp.int32), "done": jnp.zeros((rows,), bool)}


def steps(rows, start, n, done_every=None):
    t = np.arange(start, start + n, dtype=np.int32)
    done = (t % done_every == done_every - 1) if done_every else np.zeros(n, bool)
    return {
        "t": jnp.asarray(np.stack([t + 1000 * r for r in range(rows)])),
        "done": jnp.asarray(np.stack([done] * rows)),
    }


@pytest.mark.parametrize(
    "sampler",
    [
        frb.SequenceSampler(sequence_length=2, period=1),
        frb.PrioritizedSequenceSampler(sequence_length=2, period=2, alpha=0.7, beta=0.5),
        frb.SequenceSampler(sequence_length=2, end_key="done"),
    ],
)
def test_protocol(sampler):
    check_sampler(
        sampler, {"t": jnp.int32(0), "done": jnp.bool_(False)}, batch_size=4, ndims=(1, 2)
    )


@settings(max_examples=20)
@given(
    steps_=st.integers(0, 40),
    cap=st.integers(2, 12),
    length=st.integers(1, 6),
    period=st.integers(1, 4),
    added=st.integers(1, 12),
)
def test_item_ranges_follow_the_rule(steps_, cap, length, period, added):
    cap -= cap % period
    if cap == 0 or length > cap:
        return
    (new_lo, new_hi), (gone_lo, gone_hi) = [
        tuple(int(v) for v in r) for r in item_ranges(jnp.int32(steps_), added, period, cap, length)
    ]
    before = set(reference_drawable(steps_, cap, length, period))
    after = set(reference_drawable(steps_ + added, cap, length, period))
    assert set(range(new_lo, new_hi, period)) == after - before
    assert set(range(gone_lo, gone_hi, period)) == before - after


@settings(max_examples=10)
@given(
    adds=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    period=st.integers(1, 3),
    length=st.integers(1, 4),
    jit=st.booleans(),
)
def test_prioritized_values_mark_exactly_the_drawable_items(adds, period, length, jit):
    cap = 12 - 12 % period
    sampler = frb.PrioritizedSequenceSampler(
        sequence_length=length, period=period, alpha=1.0, beta=0.0
    )
    rb = frb.ReplayBuffer(capacity=2 * cap, ndim=2, batch_size=4 * length, sampler=sampler)
    state, total = rb.init(example()), 0
    add = jax.jit(rb.add) if jit else rb.add
    for n in adds:
        state = add(state, steps(2, total, n))
        total += n
    values = np.asarray(frb.sum_tree.get(state.sampler.tree, jnp.arange(2 * (cap // period))))
    drawable = {s % cap // period for s in reference_drawable(total, cap, length, period)}
    for item, v in enumerate(values):
        assert (v > 0) == (item % (cap // period) in drawable), (item, v, drawable)


def test_uniform_distribution_and_windows():
    sampler = frb.SequenceSampler(sequence_length=3, period=2)
    rb = ring_rb(sampler, batch=3 * 3000)
    state = rb.init(example())
    for k in range(3):
        state = rb.add(state, steps(2, 5 * k, 5))
    s, state = jax.jit(rb.sample)(state, jax.random.key(4))
    t = np.asarray(s.data["t"])
    assert (np.diff(t, axis=1) == 1).all() and s.mask.all()
    starts = t[:, 0] % 1000
    expected = reference_drawable(15, 12, 3, 1)[::2]  # period 2 from the oldest step (3)
    assert sorted(set(starts.tolist())) == expected
    assert stats.chisquare([np.sum(starts == e) for e in expected]).pvalue > 1e-3
    assert stats.chisquare([np.sum(t[:, 0] < 1000), np.sum(t[:, 0] >= 1000)]).pvalue > 1e-3


def test_prioritized_distribution_weights_and_generations():
    sampler = frb.PrioritizedSequenceSampler(sequence_length=2, period=1, alpha=1.0, beta=1.0)
    rb = frb.ReplayBuffer(capacity=8, ndim=2, batch_size=2 * 4000, sampler=sampler)
    state = rb.add(rb.init(example(1)), steps(1, 0, 8))
    s, state = rb.sample(state, jax.random.key(0))
    p = jnp.arange(1.0, 8.0)
    state = rb.update(state, jnp.arange(7), p)
    s, state = rb.sample(state, jax.random.key(1))
    first = np.asarray(s.data["t"][:, 0])
    counts = np.bincount(first, minlength=8)
    assert counts[7] == 0
    exp = np.asarray(p, np.float64) / float(np.sum(np.asarray(p, np.float64)))
    assert stats.chisquare(counts[:7], counts[:7].sum() * exp).pvalue > 1e-3
    np.testing.assert_allclose(s.weights[:, 0], 1.0 / np.asarray(p)[first], rtol=1e-5)
    # an update made from this sample after its slots were rewritten is dropped
    state = rb.add(state, steps(1, 8, 8))
    before = int(rb.dropped_updates(state))
    state = rb.update(state, s, jnp.ones(s.indices.shape))
    assert int(rb.dropped_updates(state)) - before == s.indices.size  # one per entry


def test_end_key_never_crosses_and_is_uniform():
    sampler = frb.SequenceSampler(sequence_length=3, end_key="done")
    rb = ring_rb(sampler, row_capacity=16, batch=3 * 3000)
    state = rb.init(example())
    state = rb.add(state, steps(2, 0, 14, done_every=5))
    s, _ = rb.sample(state, jax.random.key(0))
    d, t = np.asarray(s.data["done"]), np.asarray(s.data["t"])
    assert not d[:, :-1].any()
    windows = {tuple(r) for r in t}
    valid = {
        (r * 1000 + a, r * 1000 + a + 1, r * 1000 + a + 2)
        for r in range(2)
        for a in range(12)
        if not any((a + i) % 5 == 4 for i in range(2))
    }
    assert windows == valid
    _, counts = np.unique(t, axis=0, return_counts=True)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="multiple of sequence_length"):
        frb.ReplayBuffer(
            capacity=8, ndim=2, batch_size=5, sampler=frb.SequenceSampler(sequence_length=2)
        )
    rb = frb.ReplayBuffer(
        capacity=4, ndim=2, batch_size=6, sampler=frb.SequenceSampler(sequence_length=3)
    )
    with pytest.raises(ValueError, match="exceeds the steps a row"):
        rb.init(example())
    with pytest.raises(ValueError, match="period"):
        frb.SequenceSampler(sequence_length=2, period=0)


def test_row_not_a_multiple_of_period_never_returns_a_broken_sequence():
    """flashbax allows it (its builders trim, its init does not): after the ring wraps, the
    ring's period grid drifts from the logical one; a drawn sequence that is not stored whole
    comes back masked, never as data across the write head."""
    sampler = frb.PrioritizedSequenceSampler(sequence_length=3, period=2, alpha=1.0, beta=0.0)
    rb = frb.ReplayBuffer(capacity=2 * 9, ndim=2, batch_size=3 * 500, sampler=sampler)
    state, total = rb.init(example()), 0
    for n in (5, 4, 6, 3):
        state = rb.add(state, steps(2, total, n))
        total += n
        if bool(rb.can_sample(state)):
            s, state = rb.sample(state, jax.random.key(total))
            t = np.asarray(s.data["t"])[np.asarray(s.mask[:, 0])]
            assert len(t) and (np.diff(t, axis=1) == 1).all()
