"""Eager calls (functional_rb._internal.eager): rb.add / rb.sample / rb.update outside jax.jit run as one
cached compiled call that updates the state in place and consumes it; inside a trace nothing
changes; the error policy's eager errors are kept, with the input state untouched."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import functional_rb as frb
from functional_rb._internal import eager as _eager
from functional_rb._internal.errors import ConsumedStateError

EX = {"obs": jnp.zeros(3), "r": jnp.float32(0)}


def batch(n, start=0):
    v = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([v, v, v], axis=1), "r": v}


def copy(state):
    return jax.tree_util.tree_map(jnp.copy, state)


CONFIGS = {
    "random": dict(sampler=frb.RandomSampler()),
    "without_replacement": dict(sampler=frb.SamplerWithoutReplacement()),
    "prioritized": dict(sampler=frb.PrioritizedSampler(alpha=0.6, beta=0.4)),
    "unpacked": dict(storage=frb.DeviceStorage(pack=False)),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_eager_calls_equal_jitted_calls(config):
    """add, sample and update eagerly give exactly what jax.jit of the same method gives."""
    rb = frb.ReplayBuffer(capacity=16, batch_size=4, **CONFIGS[config])
    eager = rb.init(EX)
    jitted = copy(eager)
    add, sample, update = jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.update)
    key = jax.random.key(0)
    for step in range(6):  # wraps the ring
        eager = rb.add(eager, batch(5, 5 * step))
        jitted = add(jitted, batch(5, 5 * step))
        key, k = jax.random.split(key)
        s_e, eager = rb.sample(eager, k)
        s_j, jitted = sample(jitted, k)
        jax.tree_util.tree_map(np.testing.assert_array_equal, s_e, s_j)
        prio = jnp.arange(1.0, 5.0)
        eager = rb.update(eager, s_e.indices, prio)
        jitted = update(jitted, s_j.indices, prio)
        jax.tree_util.tree_map(np.testing.assert_array_equal, eager, jitted)


def test_add_writes_in_place_and_consumes_the_state():
    rb = frb.ReplayBuffer(capacity=1000, batch_size=4)
    state = rb.add(rb.init(EX), batch(10))
    slab = jax.tree_util.tree_leaves(state.storage)[0]
    pointer = slab.unsafe_buffer_pointer()
    new = rb.add(state, batch(10, 10))
    assert slab.is_deleted()  # donated: the old state is consumed
    assert jax.tree_util.tree_leaves(new.storage)[0].unsafe_buffer_pointer() == pointer
    assert int(rb.size(new)) == 20


def test_sample_returns_the_storage_it_was_given_without_a_copy():
    """Nothing of sample's result forces a copy: the returned state holds the very arrays of
    the input state that sample does not change (a RandomSampler changes none)."""
    rb = frb.ReplayBuffer(capacity=1000, batch_size=4)
    state = rb.add(rb.init(EX), batch(10))
    s, new = rb.sample(state, jax.random.key(0))
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new)):
        assert a is b and not a.is_deleted()
    assert s.data["obs"].shape == (4, 3)


def test_sample_without_replacement_donates_only_its_epoch():
    rb = frb.ReplayBuffer(capacity=1000, batch_size=4, sampler=frb.SamplerWithoutReplacement())
    state = rb.add(rb.init(EX), batch(10))
    _, new = rb.sample(state, jax.random.key(0))
    assert state.sampler.perm.is_deleted()  # changed in place
    assert new.storage is not None
    assert jax.tree_util.tree_leaves(new.storage)[0] is jax.tree_util.tree_leaves(state.storage)[0]


@pytest.mark.parametrize("entry", ["add", "sample", "update", "size", "can_sample", "get"])
def test_reusing_a_consumed_state_says_so(entry):
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    state = rb.add(rb.init(EX), batch(3))
    rb.add(state, batch(3))  # consumes `state`
    calls = {
        "add": lambda: rb.add(state, batch(1)),
        "sample": lambda: rb.sample(state, jax.random.key(0)),
        "update": lambda: rb.update(state, jnp.arange(2), jnp.ones(2)),
        "size": lambda: rb.size(state),
        "can_sample": lambda: rb.can_sample(state),
        "get": lambda: rb.get(state, jnp.arange(2)),
    }
    with pytest.raises(ConsumedStateError) as e:
        calls[entry]()
    msg = str(e.value)
    assert f"ReplayBuffer.{entry}: this state was consumed by an earlier call" in msg
    assert "use the state that call returned" in msg and "state.storage" in msg


def test_state_donated_to_ones_own_jit_is_reported_as_consumed():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    state = rb.add(rb.init(EX), batch(3))
    jax.jit(rb.add, donate_argnums=0)(state, batch(1))
    with pytest.raises(ConsumedStateError, match="consumed by an earlier call"):
        rb.sample(state, jax.random.key(0))


def test_compiled_once_then_one_dispatch_per_call():
    """The method is traced when a call's signature is new, never again after."""
    traces = []

    @dataclasses.dataclass(frozen=True)
    class CountingSampler(frb.RandomSampler):
        def sample(self, state, key, batch_size, ctx):
            traces.append(1)
            return super().sample(state, key, batch_size, ctx)

    rb = frb.ReplayBuffer(capacity=64, batch_size=4, sampler=CountingSampler())
    state = rb.add(rb.init(EX), batch(8))
    s, state = rb.sample(state, jax.random.key(0))
    first = len(traces)
    for i in range(20):
        state = rb.add(state, batch(2))
        s, state = rb.sample(state, jax.random.key(i))
    assert len(traces) == first


def test_inside_jit_vmap_scan_and_shard_map_nothing_is_consumed():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    state = rb.add(rb.init(EX), batch(6))
    s1, _ = jax.jit(rb.sample)(state, jax.random.key(1))
    s2, _ = jax.vmap(rb.sample, in_axes=(None, 0))(state, jax.random.split(jax.random.key(1), 3))

    def body(st, i):
        st = rb.add(st, jax.tree_util.tree_map(lambda x: x + i, batch(2)))
        s, st = rb.sample(st, jax.random.fold_in(jax.random.key(0), i))
        return st, s.indices

    scanned, _ = jax.lax.scan(body, state, jnp.arange(3.0))
    mesh = jax.make_mesh((1,), ("d",))
    sharded = jax.shard_map(
        lambda st: rb.add(st, batch(2)), mesh=mesh, in_specs=P(), out_specs=P()
    )(state)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state))
    assert s1.indices.shape == (4,) and s2.indices.shape == (3, 4)
    assert int(rb.size(scanned)) == 12 and int(rb.size(sharded)) == 8


def test_jax_jit_of_the_methods_keeps_working_with_and_without_donation():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    state = rb.add(rb.init(EX), batch(6))
    s, new = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not state.storage.slabs["float32"].is_deleted()
    s2, new2 = jax.jit(rb.sample, donate_argnums=0)(new, jax.random.key(0))
    np.testing.assert_array_equal(s.indices, s2.indices)


def test_eager_errors_raise_and_leave_the_state_usable():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    state = rb.init(EX)
    with pytest.raises(ValueError, match="nothing can be sampled yet"):
        rb.sample(state, jax.random.key(0))
    state = rb.add(state, batch(2))  # still usable
    with pytest.raises(ValueError, match="has shape"):
        rb.add(state, {"obs": np.zeros((2, 4), np.float32), "r": np.zeros(2, np.float32)})
    assert int(rb.size(state)) == 2
    ints = frb.ReplayBuffer(capacity=16, batch_size=2)
    st = ints.init({"a": jnp.int8(0)})
    with pytest.raises(OverflowError, match="outside the range"):
        ints.add(st, {"a": np.array([1, 300], np.int32)})
    st = ints.add(st, {"a": np.array([1, 2], np.int32)})
    assert int(ints.size(st)) == 2


def test_prioritized_update_errors_are_eager_and_int64_indices_never_alias():
    rb = frb.ReplayBuffer(
        capacity=16, batch_size=4, sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0)
    )
    state = rb.add(rb.init(EX), batch(8))
    with pytest.raises(ValueError, match="not a finite number"):
        rb.update(state, jnp.arange(2), jnp.array([1.0, jnp.nan]))
    with pytest.raises(ValueError, match="outside"):
        rb.update(state, np.array([2**32 + 3], np.int64), np.array([5.0]))
    state = rb.update(state, jnp.arange(2), jnp.array([1.0, 2.0]))  # the state was untouched
    assert int(rb.size(state)) == 8


def test_a_carried_over_check_that_turns_bad_raises_again():
    """The sample check runs once per lineage; when the buffer stops being sampleable (here a
    sampler that refuses more than 4 stored items), the next calls check again and raise;
    the calls in between return what they return under jit (mask False, weights 0)."""

    @dataclasses.dataclass(frozen=True)
    class AtMostFour(frb.RandomSampler):
        def can_sample(self, state, ctx, batch_size):
            return (ctx.size > 0) & (ctx.size <= 4)

    rb = frb.ReplayBuffer(capacity=64, batch_size=2, sampler=AtMostFour())
    state = rb.add(rb.init(EX), batch(2))
    s, state = rb.sample(state, jax.random.key(0))
    assert bool(s.mask.all())
    state = rb.add(state, batch(10))  # now 12 stored: cannot be sampled
    with pytest.raises(ValueError, match="nothing can be sampled"):
        for i in range(4 * _eager._WAIT_AFTER):
            s, state = rb.sample(state, jax.random.key(i))
            assert not bool(s.mask.any()) and float(s.weights.sum()) == 0.0


def test_memmap_storage_compiles_the_rest_and_consumes_the_state(tmp_path):
    """A storage that writes host files (MemmapStorage) is called with concrete arrays
    between the compiled calls (functional_rb/_internal/host_calls.py); the state is
    consumed as by any eager call."""
    rb = frb.ReplayBuffer(8, storage=frb.MemmapStorage(str(tmp_path / "rb")), batch_size=2)
    state = rb.init({"id": jnp.int32(0)})
    new = rb.add(state, {"id": jnp.arange(3, dtype=jnp.int32)})
    assert any(x.is_deleted() for x in jax.tree_util.tree_leaves(state.writer))
    with pytest.raises(ConsumedStateError, match="consumed by an earlier call"):
        rb.add(state, {"id": jnp.arange(3, dtype=jnp.int32)})
    np.testing.assert_array_equal(rb.get(new, jnp.arange(3))["id"], [0, 1, 2])
    rb.storage.close()


def test_a_state_whose_leaves_share_a_buffer_is_copied_before_donation():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4, writer=frb.MaxValueWriter(rank_key="r"))
    state = rb.add(rb.init(EX), batch(3))
    shared = jnp.int32(3)  # the writer's two counters, one buffer
    state = dataclasses.replace(
        state, writer=dataclasses.replace(state.writer, cursor=shared, filled=shared)
    )
    new = rb.add(state, batch(2))
    assert int(rb.size(new)) == 5


def test_disable_jit_runs_the_methods_without_recursion():
    rb = frb.ReplayBuffer(capacity=16, batch_size=4)
    with jax.disable_jit():
        state = rb.add(rb.init(EX), batch(3))
        s, state = rb.sample(state, jax.random.key(0))
    assert int(rb.size(state)) == 3 and s.indices.shape == (4,)


def test_annealed_beta_and_batch_size_overrides():
    """Python floats are traced (an annealed beta does not recompile), Python ints static."""
    rb = frb.ReplayBuffer(
        capacity=32, batch_size=4, sampler=frb.PrioritizedSampler(alpha=0.6, beta=0.4)
    )
    state = rb.add(rb.init(EX), batch(20))
    for beta in (0.4, 0.5, 0.6):
        s, state = rb.sample(state, jax.random.key(0), beta=beta)
        s8, state = rb.sample(state, jax.random.key(0), batch_size=8, beta=beta)
        assert s.indices.shape == (4,) and s8.indices.shape == (8,)
    with pytest.raises(ValueError, match="beta must be a finite scalar"):
        rb.sample(state, jax.random.key(0), beta=-1.0)
