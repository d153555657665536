"""Write generations: a priority update computed from a sample never lands on a newer item
that a later add wrote into the same slot (functional_rb.generations)."""

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.samplers import sum_tree
from functional_rb.testing import assert_invariants

pytestmark = pytest.mark.heavy

EX = {"obs": jnp.zeros((2,), jnp.float32), "next": {"done": jnp.asarray(False)}}
CAP = 8


def _items(start, n, done_every=4):
    i = np.arange(start, start + n)
    return {
        "obs": np.stack([i, -i], 1).astype(np.float32),
        "next": {"done": (i % done_every) == done_every - 1},
    }


def _prioritized(capacity=CAP, batch_size=4):
    return frb.ReplayBuffer(
        capacity=capacity,
        batch_size=batch_size,
        sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.5, eps=0.0),
    )


def _slices(capacity=16, batch_size=12):
    return frb.ReplayBuffer(
        capacity=capacity,
        batch_size=batch_size,
        sampler=frb.PrioritizedSliceSampler(alpha=1.0, beta=0.5, eps=0.0, slice_len=2),
    )


def _values(rb, state):
    """float32 [capacity]: the stored priority value of each slot."""
    if isinstance(state.sampler, frb.PrioritizedState):
        return np.asarray(sum_tree.get(state.sampler.tree, jnp.arange(rb.capacity)))
    return np.asarray(state.sampler.prio)


def _modes():
    return {
        "eager": lambda rb: (rb.add, rb.sample, rb.update),
        "jit": lambda rb: (jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.update)),
    }


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("make", [_prioritized, _slices], ids=["items", "slices"])
def test_a_delayed_update_across_the_wraparound_never_moves_a_newer_item(mode, make):
    rb = make()
    add, sample, update = _modes()[mode](rb)
    state = add(rb.init(EX), _items(0, rb.capacity - 2))
    smp, state = sample(state, jax.random.key(3))
    idx, mask = np.asarray(smp.indices), np.asarray(smp.mask)
    # the ring wraps: the next adds rewrite the oldest slots, some of the sampled ones among them
    state = add(state, _items(100, 3))
    state = add(state, _items(200, 2))
    rewritten = np.zeros(rb.capacity, bool)
    rewritten[[(rb.capacity - 2 + k) % rb.capacity for k in range(5)]] = True
    stale = rewritten[idx] & mask
    assert stale.any() and (~stale & mask).any()  # the test exercises both kinds
    before = _values(rb, state)
    state = update(state, smp, jnp.full(idx.shape, 50.0))
    after = _values(rb, state)
    # every newer item keeps the value it got when written; the others get the update
    np.testing.assert_array_equal(after[rewritten], before[rewritten])
    fresh_slots = np.unique(idx[~stale & mask])
    np.testing.assert_allclose(after[fresh_slots], 50.0)
    assert int(rb.dropped_updates(state)) == int(stale.sum())
    assert float(state.sampler.max_priority) == 50.0
    # an update made only of stale entries changes nothing, the running maximum included
    only_stale = smp._replace(generations=jnp.where(jnp.asarray(stale), smp.generations, -1))
    again = update(state, only_stale, jnp.full(idx.shape, 1e4))  # eagerly: consumes state
    assert float(again.sampler.max_priority) == 50.0
    np.testing.assert_array_equal(_values(rb, again), after)
    assert int(rb.dropped_updates(again)) == 2 * int(stale.sum())


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_bare_indices_cannot_be_checked_and_work_as_before(mode):
    rb = _prioritized()
    add, sample, update = _modes()[mode](rb)
    state = add(rb.init(EX), _items(0, CAP))
    smp, state = sample(state, jax.random.key(0))
    data, indices, weights, mask = smp  # today's unpacking
    state = add(state, _items(100, CAP))  # every slot rewritten
    state = update(state, indices, jnp.full(indices.shape, 9.0))
    np.testing.assert_allclose(_values(rb, state)[np.unique(np.asarray(indices))], 9.0)
    assert int(rb.dropped_updates(state)) == 0


def test_explicit_generations_equal_the_sample_form():
    rb = _prioritized()
    state = rb.add(rb.init(EX), _items(0, 6))
    smp, state = rb.sample(state, jax.random.key(1))
    state = rb.add(state, _items(10, 4))
    a = jax.jit(rb.update)(jax.tree_util.tree_map(jnp.copy, state), smp, jnp.full(4, 3.0))
    b = jax.jit(lambda s, i, p, g: rb.update(s, i, p, generations=g))(
        state, smp.indices, jnp.full(4, 3.0), smp.generations
    )
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_generations_are_stamped_per_add_and_drawn_with_the_sample():
    rb = _prioritized()
    state = rb.init(EX)
    assert state.generations.slots.dtype == jnp.int32 and int(state.generations.clock) == 0
    state = rb.add(state, _items(0, 5))
    state = rb.add(state, _items(5, 5))  # slots 5, 6, 7, 0, 1
    np.testing.assert_array_equal(np.asarray(state.generations.slots), [2, 2, 1, 1, 1, 2, 2, 2])
    smp, state = rb.sample(state, jax.random.key(0), batch_size=64)
    np.testing.assert_array_equal(
        np.asarray(smp.generations), np.asarray(state.generations.slots)[np.asarray(smp.indices)]
    )
    # masked entries (nothing drawable under jit) carry -1: they are no item
    empty, _ = jax.jit(rb.sample)(rb.init(EX), jax.random.key(0))
    assert (np.asarray(empty.generations) == -1).all() and not np.asarray(empty.mask).any()
    assert_invariants(rb, state)


def test_ndim2_and_max_value_writers_stamp_the_slots_they_write():
    rb = frb.ReplayBuffer(
        capacity=8, batch_size=4, ndim=2, sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.5)
    )
    ex2 = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), EX)
    state = rb.init(ex2)
    batch = jax.tree_util.tree_map(lambda x: np.stack([x, x]), _items(0, 3))
    state = rb.add(state, batch)
    np.testing.assert_array_equal(np.asarray(state.generations.slots), [1, 1, 1, 0, 1, 1, 1, 0])
    rbm = frb.ReplayBuffer(
        capacity=4,
        batch_size=2,
        writer=frb.MaxValueWriter(rank_key="r"),
        sampler=frb.PrioritizedSampler(),
    )
    sm = rbm.init({"r": jnp.float32(0)})
    sm = rbm.add(sm, {"r": np.array([1.0, 5.0, 3.0, 4.0], np.float32)})
    lowest = int(np.argmin(np.asarray(sm.writer.ranks)))
    sm = rbm.add(sm, {"r": np.array([0.5, 2.0], np.float32)})  # replaces the 1.0 slot only
    want = np.ones(4, np.int32)
    want[lowest] = 2
    np.testing.assert_array_equal(np.asarray(sm.generations.slots), want)
    assert_invariants(rbm, sm)


def test_samplers_without_update_keep_no_generations():
    for sampler in (
        frb.RandomSampler(),
        frb.SamplerWithoutReplacement(),
        frb.SliceSampler(slice_len=2),
    ):
        rb = frb.ReplayBuffer(capacity=CAP, batch_size=4, sampler=sampler)
        state = rb.add(rb.init(EX), _items(0, CAP))
        assert state.generations is None
        smp, state = rb.sample(state, jax.random.key(0))
        assert smp.generations is None
        assert rb.update(state, smp, 1.0) is state or True  # a documented no-op
        assert int(rb.dropped_updates(state)) == 0
        with pytest.raises(ValueError, match="keeps none"):
            rb.update(state, smp.indices, 1.0, generations=jnp.zeros(smp.indices.shape, jnp.int32))


def test_argument_errors():
    rb = _prioritized()
    state = rb.add(rb.init(EX), _items(0, CAP))
    smp, state = rb.sample(state, jax.random.key(0))
    with pytest.raises(ValueError, match="a Sample carries its own generations"):
        rb.update(state, smp, 1.0, generations=smp.generations)
    with pytest.raises(ValueError, match=r"generations have shape \(3,\), expected"):
        rb.update(state, smp.indices, 1.0, generations=jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="generations must be integers"):
        rb.update(state, smp.indices, 1.0, generations=jnp.zeros(4))
    # an int64 generation beyond any stamp never matches (no int32 wrap onto a real stamp)
    g = np.asarray(smp.generations).astype(np.int64) + 2**32
    state = rb.update(state, np.asarray(smp.indices), np.ones(4), generations=g)
    assert int(rb.dropped_updates(state)) == 4


def test_priorities_of_dropped_entries_are_not_checked_but_fresh_ones_are():
    rb = _prioritized()
    state = rb.add(rb.init(EX), _items(0, CAP))
    smp, state = rb.sample(state, jax.random.key(0))
    state = rb.add(state, _items(100, CAP))  # every sampled slot rewritten
    state = rb.update(state, smp, jnp.full(4, jnp.nan))  # all dropped: nothing to raise
    assert int(rb.dropped_updates(state)) == 4
    smp, state = rb.sample(state, jax.random.key(1))
    with pytest.raises(ValueError, match="is not a finite number"):
        rb.update(state, smp, jnp.full(4, jnp.nan))


def test_sample_is_a_pytree_with_its_generations():
    rb = _prioritized()
    state = rb.add(rb.init(EX), _items(0, CAP))
    smp, state = rb.sample(state, jax.random.key(0))
    assert (
        len(smp) == 4
        and isinstance(smp, tuple)
        and smp._fields == ("data", "indices", "weights", "mask")
    )
    leaves, tree = jax.tree_util.tree_flatten(smp)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    np.testing.assert_array_equal(back.generations, smp.generations)
    through = jax.jit(lambda s: s)(smp)
    np.testing.assert_array_equal(through.generations, smp.generations)
    assert smp._replace(weights=smp.weights * 2).generations is smp.generations
    assert smp._replace(generations=None).generations is None
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(smp)).generations, smp.generations)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(smp)[0]]
    assert paths[-1] == ".generations"
    with pytest.raises(AttributeError, match="immutable"):
        smp.generations = None
    with pytest.raises(ValueError, match="unknown fields"):
        smp._replace(bogus=1)
    old_style = frb.Sample(smp.data, smp.indices, smp.weights, smp.mask)
    assert old_style.generations is None


def test_composes_with_scan_and_vmap():
    """A learner that updates with the previous step's sample (one step of delay) inside
    lax.scan: the dropped count is in the carry and matches an eager run step by step."""
    rb = _prioritized(capacity=8, batch_size=4)

    def step(carry, t):
        state, prev = carry
        state = rb.add(state, jax.tree_util.tree_map(lambda x: x[t], batches))
        state = rb.update(state, prev, jnp.full(4, 2.0) + t)
        smp, state = rb.sample(state, jax.random.fold_in(jax.random.key(0), t))
        return (state, smp), rb.dropped_updates(state)

    batches = jax.tree_util.tree_map(
        jnp.asarray,
        {
            "obs": np.arange(10 * 3 * 2, dtype=np.float32).reshape(10, 3, 2),
            "next": {"done": np.zeros((10, 3), bool)},
        },
    )
    state = rb.add(rb.init(EX), _items(0, 8))
    first, state = rb.sample(state, jax.random.key(9))
    (final, _), counts = jax.lax.scan(step, (state, first), jnp.arange(10))
    counts = np.asarray(counts)
    assert counts[-1] == int(rb.dropped_updates(final)) > 0
    assert (np.diff(counts) >= 0).all()
    # the same loop eagerly, with the compiled eager calls
    state = rb.add(rb.init(EX), _items(0, 8))
    prev, state = rb.sample(state, jax.random.key(9))
    eager = []
    for t in range(10):
        state = rb.add(state, jax.tree_util.tree_map(lambda x, t=t: x[t], batches))
        state = rb.update(state, prev, jnp.full(4, 2.0) + t)
        prev, state = rb.sample(state, jax.random.fold_in(jax.random.key(0), t))
        eager.append(int(rb.dropped_updates(state)))
    np.testing.assert_array_equal(counts, eager)
    # vmap: one counter per member
    pop = jax.vmap(rb.init)(jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), EX))
    pop = jax.vmap(rb.add)(pop, jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), _items(0, 8)))
    smp, pop = jax.vmap(rb.sample)(pop, jax.random.split(jax.random.key(0), 2))
    pop = jax.vmap(rb.add)(
        pop, jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), _items(50, 2))
    )  # slots 0 and 1
    pop = jax.jit(jax.vmap(rb.update))(pop, smp, jnp.ones((2, 4)))
    got = np.asarray(jax.vmap(rb.dropped_updates)(pop))
    want = [int(np.isin(np.asarray(smp.indices[m]), [0, 1]).sum()) for m in range(2)]
    np.testing.assert_array_equal(got, want)


def test_checkpoints_keep_generations(tmp_path):
    rb = _slices()
    state = rb.add(rb.init(EX), _items(0, 20))
    smp, state = rb.sample(state, jax.random.key(0))
    state = rb.add(state, _items(50, 3))
    state = rb.update(state, smp, jnp.ones(smp.indices.shape))
    frb.checkpoint.save(tmp_path / "c", state)
    for loaded in (
        frb.checkpoint.load(tmp_path / "c"),
        frb.checkpoint.load(tmp_path / "c", like=rb.init(EX)),
    ):
        for a, b in zip(
            jax.tree_util.tree_leaves(loaded.generations),
            jax.tree_util.tree_leaves(state.generations),
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_state_without_generations_is_refused_by_a_tracking_buffer():
    rb = _prioritized()
    state = rb.init(EX)
    import dataclasses

    with pytest.raises(ValueError, match="state.generations is None"):
        rb.add(dataclasses.replace(state, generations=None), _items(0, 2))


# ------------------------------------------------------------------ the property, both ways
@st.composite
def _programs(draw):
    """A buffer size, a first fill, and a sequence of (adds between draw and update)."""
    capacity = draw(st.integers(2, 12))
    fill = draw(st.integers(1, 2 * capacity))
    rounds = draw(
        st.lists(st.lists(st.integers(1, capacity + 2), max_size=3), min_size=1, max_size=4)
    )
    return capacity, fill, rounds, draw(st.integers(0, 2**16))


def _run_program(program, jit):
    capacity, fill, rounds, seed = program
    rb = frb.ReplayBuffer(
        capacity=capacity,
        batch_size=4,
        sampler=frb.PrioritizedSampler(alpha=1.0, beta=0.5, eps=0.0),
    )
    add, sample, update = (_modes()["jit" if jit else "eager"])(rb)
    state = add(rb.init(EX), _items(0, fill))
    written, nxt, expected = fill, 1000, 0
    for r, adds in enumerate(rounds):
        smp, state = sample(state, jax.random.key(seed + r))
        idx = np.asarray(smp.indices)
        rewritten = np.zeros(capacity, bool)
        for n in adds:  # the delay: adds between the draw and the update
            rewritten[(written + np.arange(max(n - capacity, 0), n)) % capacity] = True
            state = add(state, _items(nxt, n))
            written, nxt = written + n, nxt + n
        before = _values(rb, state)
        state = update(state, smp, jnp.full(idx.shape, 10.0 + r))
        after = _values(rb, state)
        stale = rewritten[idx]
        expected += int(stale.sum())
        np.testing.assert_array_equal(after[rewritten], before[rewritten])
        np.testing.assert_allclose(after[np.unique(idx[~stale])], 10.0 + r)
        assert int(rb.dropped_updates(state)) == expected
        assert_invariants(rb, state)
    return expected


# every example builds a buffer of another capacity (a compile per function and mode): 5 in
# CI, 25 in the long run
@settings(max_examples=25 if os.environ.get("FRB_SLOW") else 5, deadline=None, derandomize=True)
@given(_programs())
def test_property_delayed_updates_jit_and_eager_agree(program):
    assert _run_program(program, jit=True) == _run_program(program, jit=False)
