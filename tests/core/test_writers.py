"""Writers: FIFO ring semantics (against a deque model), MaxValueWriter's top-k invariant,
ImmutableWriter. Each property runs eagerly and under jax.jit."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.testing import assert_invariants

# examples per property (and mode): half the profile's, to keep this file fast on 2 cores
HALF = settings(max_examples=max(4, settings().max_examples // 2))

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@functools.cache
def add_fn(rb, jit):
    # one jitted function per (buffer config, mode), so hypothesis examples share compilations
    return jax.jit(rb.add) if jit else rb.add


def stored_in_order(rb, state):
    """Row-major list of rows, each the stored `id`s oldest -> newest (reads storage directly)."""
    ctx = rb.context(state)
    filled, cursor = int(ctx.filled), int(ctx.cursor)
    lay = ctx.layout
    ts = (
        list(range(filled))
        if filled < lay.row_capacity
        else (list(range(cursor, lay.row_capacity)) + list(range(cursor)))
    )
    rows = []
    for env in range(lay.num_envs):
        pos = np.asarray(lay.to_flat(env, np.array(ts, np.int32)), np.int32)
        rows.append(np.asarray(rb.get(state, pos)["id"]).tolist() if ts else [])
    return rows


CAPS = st.sampled_from([1, 4])


@JIT
@HALF
@given(cap=CAPS, sizes=st.lists(st.sampled_from([1, 3, 9]), min_size=1, max_size=4))
def test_round_robin_is_fifo_like_a_deque(jit, cap, sizes):
    rb = frb.ReplayBuffer(capacity=cap, batch_size=1)
    state = rb.init({"id": jnp.int32(0), "x": jnp.zeros(2)})
    add = add_fn(rb, jit)
    model = collections.deque(maxlen=cap)
    counter = 0
    for b in sizes:
        ids = np.arange(counter, counter + b, dtype=np.int32)
        counter += b
        state = add(state, {"id": ids, "x": np.stack([ids, -ids], 1).astype(np.float32)})
        model.extend(ids.tolist())
        assert_invariants(rb, state)  # counters in range, the cursor follows filled until a wrap
        size = int(rb.size(state))
        assert size == len(model) <= cap
        # every item added and not yet overwritten is there, oldest first, with its payload
        (row,) = stored_in_order(rb, state)
        assert row == list(model)
        got = rb.get(state, np.arange(size, dtype=np.int32))
        x, got_ids = np.asarray(got["x"]), np.asarray(got["id"])
        np.testing.assert_array_equal(x, np.stack([got_ids, -got_ids], 1))


@JIT
@HALF
@given(
    row_cap=st.sampled_from([1, 3]),
    steps=st.lists(st.sampled_from([1, 2, 7]), min_size=1, max_size=4),
)
def test_round_robin_ndim2_each_row_is_fifo(jit, row_cap, steps):
    num_envs = 3
    rb = frb.ReplayBuffer(capacity=num_envs * row_cap, batch_size=1, ndim=2)
    state = rb.init({"id": jnp.zeros((num_envs,), jnp.int32)})
    add = add_fn(rb, jit)
    models = [collections.deque(maxlen=row_cap) for _ in range(num_envs)]
    t0 = 0
    for T in steps:
        ids = (np.arange(num_envs)[:, None] * 1000 + t0 + np.arange(T)[None, :]).astype(np.int32)
        t0 += T
        state = add(state, {"id": ids})
        for e in range(num_envs):
            models[e].extend(ids[e].tolist())
        assert_invariants(rb, state)
        assert int(rb.size(state)) == num_envs * len(models[0]) <= rb.capacity
        assert stored_in_order(rb, state) == [list(m) for m in models]


RANKS = st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0]), min_size=2, max_size=2)


@JIT
@HALF
@given(
    reduction=st.sampled_from(["sum", "mean", "max", "min"]),
    cap=st.sampled_from([1, 3]),
    batches=st.lists(
        st.one_of(*(st.lists(RANKS, min_size=n, max_size=n) for n in (2, 5))),
        min_size=1,
        max_size=4,
    ),
)
def test_max_value_writer_keeps_top_k(jit, reduction, cap, batches):
    rb = frb.ReplayBuffer(
        capacity=cap,
        batch_size=1,
        writer=frb.MaxValueWriter(("info", "score"), reduction=reduction),
    )
    state = rb.init({"id": jnp.int32(0), "info": {"score": jnp.zeros(2)}})
    add = add_fn(rb, jit)
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[reduction]
    everything = {}
    counter = 0
    for batch in batches:
        scores = np.asarray(batch, np.float32)  # a non-scalar rank leaf [B, 2]
        ids = np.arange(counter, counter + len(batch), dtype=np.int32)
        counter += len(batch)
        everything.update({int(i): float(reduce(s)) for i, s in zip(ids, scores)})
        state = add(state, {"id": ids, "info": {"score": scores}})
        assert_invariants(rb, state)  # the rank table holds the stored items' ranks
        n = int(rb.size(state))
        assert n == min(cap, len(everything))
        got = rb.get(state, np.arange(n, dtype=np.int32))
        got_ids = np.asarray(got["id"]).tolist()
        assert len(set(got_ids)) == n  # no item stored twice
        got_ranks = sorted(everything[i] for i in got_ids)
        top = sorted(everything.values())[len(everything) - n :]
        assert got_ranks == top
        # each stored payload is the one that was added with that id
        for i, sc in zip(got_ids, np.asarray(got["info"]["score"])):
            assert float(reduce(sc)) == everything[i]


def test_immutable_writer_from_data_then_add_raises():
    data = {"obs": np.arange(12, dtype=np.float32).reshape(6, 2), "r": np.arange(6, dtype=np.int32)}
    rb = frb.ReplayBuffer(capacity=8, batch_size=4, writer=frb.ImmutableWriter())
    state = rb.init_from_data(data)
    assert int(rb.size(state)) == 6
    np.testing.assert_array_equal(
        np.asarray(rb.get(state, np.arange(6, dtype=np.int32))["obs"]), data["obs"]
    )
    s, _ = rb.sample(state, jax.random.key(0))
    assert bool(s.mask.all()) and set(np.asarray(s.indices).tolist()) <= set(range(6))
    with pytest.raises(RuntimeError, match="init_from_data"):
        rb.add(state, {"obs": np.zeros((1, 2), np.float32), "r": np.zeros(1, np.int32)})
    with pytest.raises(RuntimeError, match="read-only"):
        jax.jit(rb.add)(state, {"obs": np.zeros((1, 2), np.float32), "r": np.zeros(1, np.int32)})


def test_init_from_data_keeps_last_capacity_items_in_order():
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    state = rb.init_from_data({"id": np.arange(10, dtype=np.int32)})
    assert stored_in_order(rb, state) == [[6, 7, 8, 9]]
