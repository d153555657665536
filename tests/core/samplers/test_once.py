"""SampleOnceSampler (each item drawn at most once until its slot is rewritten): no item is
drawn twice between rewrites, a rewritten slot is drawable again, a batch is as full as the
undrawn items allow (padding masked, weights 0), draws are uniform over the undrawn items, and
the empty-buffer policy (eagerly ValueError, under jit mask False). Properties run eagerly and
under jax.jit, against a Python model of the ring."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.samplers.once import draw
from functional_rb.testing import assert_frequencies, assert_invariants, check_sampler

HALF = settings(max_examples=max(4, settings().max_examples // 2))


@functools.cache
def fns(rb, jit):
    if jit:
        return jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.can_sample)
    return rb.add, rb.sample, rb.can_sample


class Ring:
    """What a round-robin buffer of ``E`` rows of ``R`` steps holds: ``{flat slot: id}``."""

    def __init__(self, envs, row_cap):
        self.e, self.r = envs, row_cap
        self.content, self.cursor = {}, 0

    def add(self, ids):  # ids [E, T]
        for j in range(ids.shape[1]):
            for e in range(self.e):
                self.content[e * self.r + self.cursor] = int(ids[e, j])
            self.cursor = (self.cursor + 1) % self.r


def check_counter(state, undrawn):
    """The state's flags and counter agree with the model's undrawn items."""
    used = np.asarray(state.sampler.used)
    assert int(state.sampler.left) == int((~used).sum()) == len(undrawn)


@pytest.mark.parametrize("drop_last", [False, True])
def test_protocol(drop_last):
    check_sampler(frb.SampleOnceSampler(drop_last=drop_last), {"x": jnp.int32(0)}, batch_size=2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@HALF
@given(
    ndim=st.sampled_from([1, 2]),
    drop_last=st.booleans(),
    ops=st.lists(
        st.one_of(st.tuples(st.just("add"), st.integers(1, 7)), st.just(("sample", 0))),
        min_size=1,
        max_size=14,
    ),
    seed=st.integers(0, 2**16),
)
def test_no_item_twice_between_rewrites(jit, ndim, drop_last, ops, seed):
    """Over any sequence of adds and samples: every id (one per write) is drawn at most once,
    drawn ids are stored, a batch is full whenever enough undrawn items are stored (and, with
    drop_last, empty otherwise), and ids written into drawn slots become drawable again."""
    envs, row_cap, batch = (2, 5, 3) if ndim == 2 else (1, 9, 3)
    rb = frb.ReplayBuffer(
        capacity=envs * row_cap,
        batch_size=batch,
        ndim=ndim,
        sampler=frb.SampleOnceSampler(drop_last=drop_last),
    )
    ex = {"id": jnp.zeros((envs,), jnp.int32)} if ndim == 2 else {"id": jnp.int32(0)}
    add, sample, can_sample = fns(rb, jit)
    state, ring, drawn_ids, next_id = rb.init(ex), Ring(envs, row_cap), set(), 1
    key = jax.random.key(seed)
    for op, n in ops:
        if op == "add":
            ids = (next_id + np.arange(envs * n, dtype=np.int32)).reshape(envs, n)
            next_id += ids.size
            ring.add(ids)
            state = add(state, {"id": ids if ndim == 2 else ids[0]})
            assert_invariants(rb, state)
            check_counter(state, set(ring.content.values()) - drawn_ids)
            continue
        undrawn = set(ring.content.values()) - drawn_ids
        want = (
            min(batch, len(undrawn)) if not drop_last else (batch if len(undrawn) >= batch else 0)
        )
        assert bool(can_sample(state)) == (want > 0)
        key, k = jax.random.split(key)
        if want == 0 and not jit:
            with pytest.raises(ValueError, match="nothing can be sampled"):
                rb.sample(state, k)
            continue
        before = np.asarray(state.sampler.used)
        s, state = sample(state, k)
        mask = np.asarray(s.mask)
        got = np.asarray(s.data["id"])[mask].tolist()
        assert int(mask.sum()) == want and mask[:want].all()  # drawn first, then padding
        np.testing.assert_array_equal(np.asarray(s.weights), mask.astype(np.float32))
        assert len(set(got)) == len(got) and set(got) <= undrawn
        assert all(ring.content[int(i)] == v for i, v in zip(np.asarray(s.indices)[mask], got))
        if want == 0:  # under jit: nothing drawn, nothing spent
            np.testing.assert_array_equal(np.asarray(state.sampler.used), before)
        drawn_ids |= set(got)
        check_counter(state, set(ring.content.values()) - drawn_ids)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_rewritten_slot_is_drawable_again(jit):
    rb = frb.ReplayBuffer(capacity=4, batch_size=4, sampler=frb.SampleOnceSampler())
    add, sample, can_sample = fns(rb, jit)
    state = add(rb.init({"id": jnp.int32(0)}), {"id": jnp.arange(4, dtype=jnp.int32)})
    s, state = sample(state, jax.random.key(0))
    assert sorted(np.asarray(s.data["id"]).tolist()) == [0, 1, 2, 3]
    assert not bool(can_sample(state))
    state = add(state, {"id": jnp.array([10, 11], jnp.int32)})  # overwrites slots 0 and 1
    s, state = sample(state, jax.random.key(1))
    assert sorted(np.asarray(s.data["id"])[np.asarray(s.mask)].tolist()) == [10, 11]
    assert np.asarray(s.mask).tolist() == [True, True, False, False]


def _frequencies(used, count, draws=4000, capacity=None):
    """How often each slot is drawn over ``draws`` independent batches of ``count``."""
    capacity = used.shape[0] if capacity is None else capacity
    keys = jax.random.split(jax.random.key(3), draws)
    slots, ok = jax.jit(jax.vmap(lambda k: draw(k, count, capacity, lambda s: ~used[s])))(keys)
    slots, ok = np.asarray(slots), np.asarray(ok)
    assert ok.all()
    assert all(len(set(row)) == count for row in slots)  # distinct within a batch
    return np.bincount(slots.reshape(-1), minlength=capacity), slots


@pytest.mark.parametrize(
    "free_every",
    [1, 7],  # every slot free: the candidate path; 1 in 7 free: the exact top-k pass
    ids=["candidates", "exact"],
)
def test_draws_are_uniform_over_the_undrawn_items(free_every):
    used = jnp.arange(64) % free_every != 0
    counts, slots = _frequencies(used, 4)
    free = ~np.asarray(used)
    assert counts[~free].sum() == 0
    assert_frequencies(counts, free / free.sum())
    # the order inside a batch is uniform too: the first entry alone is uniform
    assert_frequencies(np.bincount(slots[:, 0], minlength=64), free / free.sum())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@settings(max_examples=10)
@given(
    capacity=st.integers(1, 40),
    count=st.integers(1, 12),
    free=st.sets(st.integers(0, 39)),
    seed=st.integers(0, 2**16),
)
def test_draw_returns_distinct_drawable_slots_then_padding(jit, capacity, count, free, seed):
    free_mask = jnp.asarray(np.isin(np.arange(capacity), sorted(free)))
    fn = functools.partial(draw, count=count, capacity=capacity, drawable=lambda s: free_mask[s])
    slots, ok = (jax.jit(fn) if jit else fn)(jax.random.key(seed))
    slots, ok = np.asarray(slots), np.asarray(ok)
    n = min(count, int(free_mask.sum()))
    assert ok.tolist() == [True] * n + [False] * (count - n)
    assert len(set(slots[ok].tolist())) == n and np.asarray(free_mask)[slots[ok]].all()
    assert (slots[~ok] == 0).all() and slots.dtype == np.int32


def test_empty_policy_and_errors():
    rb = frb.ReplayBuffer(capacity=8, batch_size=2, sampler=frb.SampleOnceSampler())
    state = rb.init({"x": jnp.int32(0)})
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(0))
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not np.asarray(s.mask).any() and not np.asarray(s.weights).any()
    assert ((np.asarray(s.indices) >= 0) & (np.asarray(s.indices) < 8)).all()
    with pytest.raises(ValueError, match="SampleOnceSampler: batch_size=9 exceeds capacity=8"):
        frb.ReplayBuffer(capacity=8, batch_size=9, sampler=frb.SampleOnceSampler(drop_last=True))
    with pytest.raises(TypeError, match="drop_last must be a Python bool, got 1"):
        frb.SampleOnceSampler(drop_last=1)


def test_works_with_every_writer_and_reads_a_dataset_once():
    rb = frb.ReplayBuffer(
        capacity=6, batch_size=4, sampler=frb.SampleOnceSampler(), writer=frb.ImmutableWriter()
    )
    state = rb.init_from_data({"x": jnp.arange(6, dtype=jnp.int32)})
    a, state = rb.sample(state, jax.random.key(0))
    b, state = rb.sample(state, jax.random.key(1))
    seen = np.asarray(a.data["x"]).tolist() + np.asarray(b.data["x"])[np.asarray(b.mask)].tolist()
    assert sorted(seen) == list(range(6)) and not bool(rb.can_sample(state))
    mv = frb.ReplayBuffer(
        capacity=3, batch_size=2, sampler=frb.SampleOnceSampler(), writer=frb.MaxValueWriter("r")
    )
    state = mv.add(mv.init({"r": jnp.float32(0)}), {"r": jnp.array([1.0, 5.0, 3.0])})
    s, state = mv.sample(state, jax.random.key(0))
    state = mv.add(state, {"r": jnp.array([9.0])})  # into the slot of the lowest-ranked, 1.0
    left = ({5.0, 3.0} - set(np.asarray(s.data["r"]).tolist())) | {9.0}
    s2, state = mv.sample(state, jax.random.key(1))
    assert set(np.asarray(s2.data["r"])[np.asarray(s2.mask)].tolist()) == left


def test_state_round_trips_through_a_checkpoint(tmp_path):
    rb = frb.ReplayBuffer(capacity=8, batch_size=3, sampler=frb.SampleOnceSampler())
    state = rb.add(rb.init({"x": jnp.int32(0)}), {"x": jnp.arange(5, dtype=jnp.int32)})
    _, state = rb.sample(state, jax.random.key(0))
    frb.checkpoint.save(tmp_path / "c", state)
    loaded = frb.checkpoint.load(tmp_path / "c")
    assert isinstance(loaded.sampler, frb.SampleOnceState)
    np.testing.assert_array_equal(np.asarray(loaded.sampler.used), np.asarray(state.sampler.used))


def test_an_eager_loop_raises_at_the_first_sample_that_finds_nothing():
    # the sampler empties itself: the eager path must check every call (Sampler.depletes),
    # not once per lineage of states as for samplers whose checks only adds can change
    rb = frb.ReplayBuffer(capacity=64, batch_size=4, sampler=frb.SampleOnceSampler())
    state = rb.add(rb.init({"x": jnp.int32(0)}), {"x": jnp.arange(40, dtype=jnp.int32)})
    for i in range(10):
        s, state = rb.sample(state, jax.random.key(i))
        assert np.asarray(s.mask).all()
    with pytest.raises(ValueError, match="nothing can be sampled"):
        rb.sample(state, jax.random.key(10))
