"""The component protocol (functional_rb.protocol): declared
capabilities instead of probes, the write record, a component of one's own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb.samplers import epochs

P = frb.protocol


def test_protocol_namespace_and_curated_exports():
    for name in ("Context", "Drawn", "Layout", "Sampler", "Storage", "WriteRecord", "Writer"):
        assert hasattr(P, name) and name in P.__all__
        assert name not in frb.__all__  # protocol internals live under frb.protocol
    for name in ("PrioritizedState", "RoundRobinState", "SliceState", "TEDStorageState"):
        assert name in frb.__all__
    for name in frb.__all__:
        assert hasattr(frb, name), name


def test_builtin_components_declare_the_protocol():
    for sampler in (
        frb.RandomSampler(),
        frb.SamplerWithoutReplacement(),
        frb.PrioritizedSampler(),
        frb.SliceSampler(slice_len=2),
        frb.SliceSamplerWithoutReplacement(slice_len=2),
        frb.PrioritizedSliceSampler(0.6, 0.4, slice_len=2),
    ):
        assert isinstance(sampler, P.Sampler) and sampler.state_types
    for writer in (frb.RoundRobinWriter(), frb.MaxValueWriter(), frb.ImmutableWriter()):
        assert isinstance(writer, P.Writer) and writer.state_types
    for storage in (frb.DeviceStorage(), frb.DeviceStorage(pack=False), frb.TEDStorage()):
        assert isinstance(storage, P.Storage) and storage.state_types
    assert frb.PrioritizedSampler().options == ("beta",)
    assert frb.RandomSampler().options == ()
    assert frb.RoundRobinWriter().time_ordered and not frb.MaxValueWriter().time_ordered


def test_device_storage_layouts_are_two_classes():
    packed, leaf = frb.DeviceStorage(), frb.DeviceStorage(pack=False)
    assert type(packed) is frb.storages.PackedStorage and packed.pack
    assert type(leaf) is frb.storages.LeafStorage and not leaf.pack
    assert isinstance(packed, frb.DeviceStorage) and isinstance(leaf, frb.DeviceStorage)
    assert packed == frb.DeviceStorage(pack=True)
    assert hash(leaf) == hash(frb.DeviceStorage(pack=False))
    assert packed.state_types == (frb.PackedStorageState,)
    assert leaf.state_types == (frb.DeviceStorageState,)
    with pytest.raises(ValueError, match="pack must be True"):
        frb.storages.PackedStorage(pack=False)
    # a state of the other layout is refused by name
    rb_p = frb.ReplayBuffer(4, storage=packed)
    rb_l = frb.ReplayBuffer(4, storage=leaf)
    state_l = rb_l.init({"x": jnp.zeros(())})
    with pytest.raises(
        TypeError, match="state.storage is a DeviceStorageState, expected PackedStorageState"
    ):
        rb_p.add(state_l, {"x": jnp.zeros((1,))})


@pytest.mark.parametrize("ndim", [1, 2])
def test_writers_return_a_write_record(ndim):
    layout = P.Layout(
        capacity=8, num_envs=2 if ndim == 2 else 1, row_capacity=4 if ndim == 2 else 8, ndim=ndim
    )
    w = frb.RoundRobinWriter()
    st = frb.RoundRobinState.of(3, 3)
    items = {"x": jnp.zeros((2, 3) if ndim == 2 else (3,))}
    record, new = jax.jit(w.write, static_argnums=2)(st, items, layout)
    assert isinstance(record, P.WriteRecord)
    if ndim == 1:
        np.testing.assert_array_equal(np.asarray(record.positions), [3, 4, 5])
        assert int(record.run_start) == 3  # a ring run: samplers may update by ranges
    else:
        # flat, env-major: [env 0: t = 3, 0, 1; env 1: the same + row_capacity]
        np.testing.assert_array_equal(np.asarray(record.positions), [3, 0, 1, 7, 4, 5])
        assert record.run_start is None
    assert np.asarray(record.mask).all() and int(new.cursor) == (6 if ndim == 1 else 2)
    mv = frb.MaxValueWriter(rank_key="x")
    lay1 = P.Layout(capacity=4, num_envs=1, row_capacity=4, ndim=1)
    record, _ = mv.write(mv.init(lay1), {"x": jnp.array([3.0, np.nan, 1.0])}, lay1)
    assert record.run_start is None and record.positions.shape == (3,)
    np.testing.assert_array_equal(np.asarray(record.mask), [True, False, True])


def test_a_component_missing_a_member_is_refused_by_name():
    class Bare:  # duck-typed, without the protocol's declared members
        def init(self, item_spec, layout):
            return ()

        def sample(self, state, key, batch_size, ctx):
            raise AssertionError

    with pytest.raises(
        TypeError,
        match=r"lacks \[.*'on_add'.*'options'.*\].*subclass "
        r"frb\.protocol\.Sampler",
    ):
        frb.ReplayBuffer(4, sampler=Bare())


@dataclasses.dataclass(frozen=True)
class NewestFirst(P.Sampler):
    """A sampler of one's own: only init and sample written, the rest inherited."""

    def init(self, item_spec, layout):
        del item_spec, layout
        return frb.EmptySamplerState()

    def sample(self, state, key, batch_size, ctx):
        del key
        age = jnp.arange(batch_size, dtype=jnp.int32) % jnp.maximum(ctx.size, 1)
        idx = (ctx.cursor - 1 - age) % ctx.layout.capacity
        ok = jnp.broadcast_to(ctx.size > 0, (batch_size,))
        return P.Drawn(idx, ok.astype(jnp.float32), ok), state


def test_a_sampler_of_ones_own_inherits_the_declared_defaults(maybe_jit):
    rb = frb.ReplayBuffer(5, sampler=NewestFirst(), batch_size=3)
    state = rb.init({"x": jnp.zeros((), jnp.int32)})
    state = maybe_jit(rb.add)(state, {"x": jnp.arange(7, dtype=jnp.int32)})
    sample, state = maybe_jit(rb.sample)(state, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(sample.data["x"]), [6, 5, 4])
    assert maybe_jit(rb.update)(state, sample.indices, jnp.ones(3)) is not None  # no-op
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['beta'\].*accepts no options"):
        rb.sample(state, jax.random.key(0), beta=0.5)


def test_unknown_sampling_option_is_refused_by_name():
    rb = frb.ReplayBuffer(4, sampler=frb.PrioritizedSampler(), batch_size=2)
    state = rb.add(rb.init({"x": jnp.zeros(())}), {"x": jnp.zeros((4,))})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['gamma'\].*accepts only beta="):
        rb.sample(state, jax.random.key(0), gamma=0.5)


def test_num_slices_is_bound_when_the_buffer_is_built():
    sampler = frb.PrioritizedSliceSampler(0.6, 0.4, num_slices=4)
    assert sampler.bound_slice_len is None
    rb = frb.ReplayBuffer(16, sampler=sampler, batch_size=8)
    assert rb.sampler.bound_slice_len == 2 and rb.sampler.num_slices == 4
    item = {"x": jnp.zeros(()), "next": {"done": jnp.zeros((1,), bool)}}
    assert rb.init(item).sampler.slice_len == 2
    # the slice-spec arguments are keyword-only (TorchRL's signatures)
    with pytest.raises(TypeError):
        frb.SliceSampler(4)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_helper_draws_each_element_once(drop_last):
    key = jax.random.key(3)
    eligible = jnp.arange(10) < 7
    epoch = epochs.Epoch(jnp.arange(10, dtype=jnp.int32), jnp.int32(0), jnp.int32(0), jnp.int32(0))
    seen = []
    step = jax.jit(
        lambda e, stale: epochs.next_batch(
            e,
            3,
            stale=stale,
            drop_last=drop_last,
            begin=lambda: (epochs.shuffled(key, eligible), jnp.sum(eligible, dtype=jnp.int32)),
        )
    )
    for i in range(2 if drop_last else 3):
        ids, ok, epoch = step(epoch, jnp.bool_(i == 0))
        seen += list(np.asarray(ids)[np.asarray(ok)])
        assert int(epoch.count) == 1
    if drop_last:  # two full batches of the 7; the one left would make a short batch
        assert len(seen) == 6 and len(set(seen)) == 6 and set(seen) <= set(range(7))
    else:  # 3 + 3 + 1, then padding
        assert sorted(seen) == list(range(7)) and int(np.asarray(ok).sum()) == 1
    ids, ok, epoch = step(epoch, jnp.bool_(False))
    assert int(epoch.count) == 2 and np.asarray(ok).all()  # a new epoch began
