"""ReplayBuffer as a pure function: no retracing, vmap over a population of buffers, lax.scan,
in-place adds with donate_argnums, and stable int32 index dtypes under jax_enable_x64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb.testing import assert_invariants

EX = {"obs": jnp.zeros((2,), jnp.float32), "r": jnp.float32(0)}


def batch(b, start=0.0):
    v = start + np.arange(b, dtype=np.float32)
    return {"obs": np.stack([v, -v], 1), "r": v}


@pytest.mark.parametrize(
    "sampler",
    [frb.RandomSampler(), frb.SamplerWithoutReplacement()],
    ids=["random", "without_replacement"],
)
def test_add_and_sample_do_not_retrace(sampler):
    rb = frb.ReplayBuffer(capacity=16, batch_size=4, sampler=sampler)
    traces = {"add": 0, "sample": 0}

    def add(state, items):
        traces["add"] += 1  # Python side effect: runs once per trace
        return rb.add(state, items)

    def sample(state, key):
        traces["sample"] += 1
        return rb.sample(state, key)

    add, sample = jax.jit(add, donate_argnums=0), jax.jit(sample)
    state = rb.init(EX)
    key = jax.random.key(0)
    for i in range(6):  # wraps around the ring twice
        state = add(state, batch(5, 10.0 * i))
        key, k = jax.random.split(key)
        s, state = sample(state, k)
    assert traces == {"add": 1, "sample": 1}
    assert bool(s.mask.all())


@functools.cache
def vmapped(rb, jit):
    wrap = jax.jit if jit else (lambda f: f)  # cached: one compilation per shape, not per example
    return wrap(jax.vmap(rb.add)), wrap(jax.vmap(rb.sample))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("pop,b,seed", [(1, 2, 0), (3, 5, 1)])
def test_vmap_over_a_population_of_buffers(jit, pop, b, seed):
    rb = frb.ReplayBuffer(capacity=4, batch_size=3)
    vadd, vsample = vmapped(rb, jit)
    states = jax.vmap(rb.init)(jax.tree_util.tree_map(lambda x: jnp.stack([x] * pop), EX))
    items = [batch(b, 100.0 * p) for p in range(pop)]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *items)
    states = vadd(states, stacked)
    keys = jax.random.split(jax.random.key(seed), pop)
    s, states = vsample(states, keys)
    assert s.data["obs"].shape == (pop, 3, 2)
    for p in range(pop):  # each member behaves exactly like an independent buffer
        one = rb.add(rb.init(EX), items[p])
        s1, _ = rb.sample(one, keys[p])
        np.testing.assert_array_equal(np.asarray(s.indices[p]), np.asarray(s1.indices))
        np.testing.assert_array_equal(np.asarray(s.data["obs"][p]), np.asarray(s1.data["obs"]))
        assert int(rb.size(jax.tree_util.tree_map(lambda x, p=p: x[p], states))) == min(b, 4)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_population_state_checks_pass_under_vmap_and_refuse_an_unmapped_call(jit):
    # the state checks see per-member shapes inside vmap; outside it the batch axis shows
    rb = frb.ReplayBuffer(capacity=4, batch_size=3, sampler=frb.PrioritizedSampler())
    wrap = jax.jit if jit else (lambda f: f)
    states = jax.vmap(rb.init)(jax.tree_util.tree_map(lambda x: jnp.stack([x] * 2), EX))
    items = jax.tree_util.tree_map(lambda *xs: np.stack(xs), batch(3), batch(3, 10.0))
    states = wrap(jax.vmap(rb.add))(states, items)
    np.testing.assert_array_equal(np.asarray(wrap(jax.vmap(rb.size))(states)), [3, 3])
    assert bool(wrap(jax.vmap(rb.can_sample))(states).all())
    s, states = wrap(jax.vmap(rb.sample))(states, jax.random.split(jax.random.key(0), 2))
    states = wrap(jax.vmap(rb.update))(states, s.indices, jnp.ones(s.indices.shape))
    assert wrap(jax.vmap(rb.get))(states, s.indices)["r"].shape == (2, 3)
    wrap(jax.vmap(functools.partial(assert_invariants, rb)))(states)  # each member's tree
    for fn, call in {
        "add": lambda f: f(states, items),
        "size": lambda f: f(states),
        "sample": lambda f: f(states, jax.random.key(0)),
    }.items():
        with pytest.raises(
            ValueError,
            match=rf"ReplayBuffer.{fn}: .*has shape \(2, .*"
            rf"jax.vmap\(rb.{fn}\)",
        ):
            call(wrap(getattr(rb, fn)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "make_keys",
    [
        lambda k: jax.random.split(jax.random.key(k), 3),
        lambda k: jax.random.split(jax.random.PRNGKey(k), 3),
    ],
    ids=["typed", "raw"],
)
def test_vmap_over_keys_draws_one_batch_per_key(jit, make_keys):
    rb = frb.ReplayBuffer(capacity=8, batch_size=4)
    state = rb.add(rb.init(EX), batch(6, 1.0))
    keys = make_keys(5)
    vsample = jax.vmap(rb.sample, in_axes=(None, 0))
    s, _ = (jax.jit(vsample) if jit else vsample)(state, keys)
    assert s.indices.shape == (3, 4)
    for i in range(3):  # each row is the sample of one key
        one, _ = rb.sample(state, keys[i])
        np.testing.assert_array_equal(np.asarray(s.indices[i]), np.asarray(one.indices))


def test_scan_of_add_and_sample_matches_a_python_loop():
    rb = frb.ReplayBuffer(capacity=8, batch_size=4)
    xs = {
        "obs": np.arange(30, dtype=np.float32).reshape(5, 3, 2),
        "r": np.arange(15, dtype=np.float32).reshape(5, 3),
    }
    keys = jax.random.split(jax.random.key(3), 5)

    def step(state, x):
        items, key = x
        state = rb.add(state, items)
        s, state = rb.sample(state, key)
        assert_invariants(rb, state)  # in the scan: a host callback at every step
        return state, (s.data["r"], s.indices)

    state0 = rb.init(EX)
    final, (rs, idx) = jax.jit(lambda st: jax.lax.scan(step, st, (xs, keys)))(state0)
    state = state0
    for i in range(5):
        state, (r_i, idx_i) = step(
            state, (jax.tree_util.tree_map(lambda a, i=i: a[i], xs), keys[i])
        )
        np.testing.assert_array_equal(np.asarray(rs[i]), np.asarray(r_i))
        np.testing.assert_array_equal(np.asarray(idx[i]), np.asarray(idx_i))
    for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_donated_add_writes_in_place_on_a_1m_item_buffer():
    # one array per leaf (pack=False); tests/core/storages/test_storages.py checks the packed default
    rb = frb.ReplayBuffer(capacity=1_000_000, batch_size=8, storage=frb.DeviceStorage(pack=False))
    state = rb.init({"a": jnp.float32(0), "b": jnp.zeros((2,), jnp.int8)})
    add = jax.jit(rb.add, donate_argnums=0)
    items = {"a": np.ones(8, np.float32), "b": np.ones((8, 2), np.int8)}
    state = add(state, items)  # first call: compile; from here the buffers are XLA's outputs
    leaf = state.storage.data["a"]
    ptr = leaf.unsafe_buffer_pointer()
    new = add(state, items)
    assert new.storage.data["a"].unsafe_buffer_pointer() == ptr  # reused, not copied
    assert leaf.is_deleted()  # the donated input is gone
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(leaf)
    assert int(rb.size(new)) == 16
    # a donated sample also aliases the storage (sample returns the state, like optax's update)
    s, newer = jax.jit(rb.sample, donate_argnums=0)(new, jax.random.key(0))
    assert newer.storage.data["a"].unsafe_buffer_pointer() == ptr
    assert np.all(np.asarray(s.data["a"]) == 1)


@pytest.mark.parametrize(
    "sampler,writer",
    [
        (frb.RandomSampler(), frb.RoundRobinWriter()),
        (frb.SamplerWithoutReplacement(), frb.MaxValueWriter("r")),
    ],
    ids=["random-round_robin", "without_replacement-max_value"],
)
def test_x64_keeps_int32_indices_and_the_state_structure(sampler, writer):
    rb = frb.ReplayBuffer(capacity=8, batch_size=4, sampler=sampler, writer=writer)

    def run():
        state = rb.init({"obs": jnp.zeros((2,), jnp.float32), "r": jnp.float32(0)})
        state = jax.jit(rb.add)(state, batch(5))
        s, state = jax.jit(rb.sample)(state, jax.random.key(0))
        return state, s

    state32, s32 = run()
    with jax.enable_x64(True):
        state64, s64 = run()

        def spec(t):
            return jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), t)

        assert jax.tree_util.tree_structure(state64) == jax.tree_util.tree_structure(state32)
        assert spec(state64) == spec(state32)
        assert s64.indices.dtype == jnp.int32 and s64.weights.dtype == jnp.float32
        assert rb.size(state64).dtype == jnp.int32
        assert state64.writer.cursor.dtype == jnp.int32
        assert state64.writer.filled.dtype == jnp.int32
        # float64 items are cast to the stored float32 (same kind), no retyping of the state
        state64 = rb.add(state64, {"obs": np.zeros((1, 2), np.float64), "r": np.zeros(1)})
        assert spec(state64) == spec(state32)


def test_state_is_a_pytree_with_static_num_envs():
    rb = frb.ReplayBuffer(capacity=6, ndim=2, batch_size=2)
    state = rb.init({"obs": jnp.zeros((3, 2))})
    leaves, treedef = jax.tree_util.tree_flatten(state)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.num_envs == 3 and rb.layout(again).row_capacity == 2
    assert all(isinstance(x, jax.Array) for x in leaves)
