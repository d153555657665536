"""HostStorage: NumPy arrays in process memory. The same items and draws as DeviceStorage,
eagerly (NumPy between compiled calls, no host callback) and under jit / scan (ordered host
callbacks); stale states refused; vmap refused; pickling copies; the arrays freed with their
states; checkpoints round-trip."""

import copy
import gc
import pickle

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _storage_items import EXAMPLE
from _storage_items import items as _items
from _trees import assert_trees_equal
from hypothesis import given, settings

import functional_rb as frb
from functional_rb.storages import host
from functional_rb.testing import check_storage

SAMPLERS = {
    "random": lambda: frb.RandomSampler(),
    "prioritized": lambda: frb.PrioritizedSampler(alpha=0.7, beta=0.5),
    "slices": lambda: frb.SliceSampler(slice_len=2, end_key=("next", "done")),
}


def _run(rb, add, sample, update, steps=6):
    state, out = rb.init(EXAMPLE), []
    for i, key in enumerate(jax.random.split(jax.random.key(3), steps)):
        state = add(state, _items(i))
        drawn, state = sample(state, key)
        out.append(drawn)
        state = update(state, drawn.indices, jnp.abs(drawn.data["next"]["reward"]) + 0.5)
    return out, state


def test_conforms_to_the_storage_protocol():
    check_storage(frb.HostStorage(), vmap=False)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_eager_and_jitted_calls_match_device_storage(monkeypatch, name):
    def buffer(storage):
        return frb.ReplayBuffer(16, sampler=SAMPLERS[name](), storage=storage, batch_size=4)

    want_rb = buffer(frb.DeviceStorage())
    want, want_state = _run(want_rb, want_rb.add, want_rb.sample, want_rb.update)
    jit_rb = buffer(frb.HostStorage())
    jitted = [jax.jit(f, donate_argnums=0) for f in (jit_rb.add, jit_rb.sample, jit_rb.update)]
    got_jit, jit_state = _run(jit_rb, *jitted)

    def no_callback(*args, **kwargs):
        raise AssertionError("an eager call of a HostStorage buffer used a host callback")

    monkeypatch.setattr(host, "io_callback", no_callback)
    rb = buffer(frb.HostStorage())
    got, state = _run(rb, rb.add, rb.sample, rb.update)
    for a, b, c in zip(got, want, got_jit):
        assert_trees_equal(a, b)
        assert_trees_equal(c, b)
    for s in (state, jit_state):
        assert_trees_equal(s.sampler, want_state.sampler)
        assert_trees_equal(s.writer, want_state.writer)
        assert int(s.storage.version) == 6
    assert_trees_equal(rb.get(state, jnp.arange(16)), want_rb.get(want_state, jnp.arange(16)))


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8),
    jitted=st.booleans(),
    reads=st.lists(st.integers(0, 9), min_size=1, max_size=6),
)
def test_rows_are_what_a_numpy_ring_holds(sizes, jitted, reads):
    """Invariant: after any sequence of adds, the arrays (and get / read_host of any slots)
    hold the newest item written to each slot of a ring of 10, under jit and without."""
    rb = frb.ReplayBuffer(10, storage=frb.HostStorage(), batch_size=2)
    add = jax.jit(rb.add, donate_argnums=0) if jitted else rb.add
    get = jax.jit(rb.get) if jitted else rb.get
    state = rb.init({"x": jnp.zeros(2, jnp.int32)})
    ring, count = np.zeros((10, 2), np.int32), 0
    for size in sizes:
        xs = np.stack([np.arange(count, count + size)] * 2, axis=1).astype(np.int32)
        state = add(state, {"x": jnp.asarray(xs)})
        for row in xs:
            ring[count % 10] = row
            count += 1
    idx = np.asarray(reads, np.int32)
    np.testing.assert_array_equal(rb.storage.arrays(state.storage)[0], ring)
    np.testing.assert_array_equal(np.asarray(get(state, jnp.asarray(idx))["x"]), ring[idx])
    np.testing.assert_array_equal(rb.storage.read_host(state.storage, idx)["x"], ring[idx])
    assert int(state.storage.version) == len(sizes)


def test_writes_and_reads_inside_one_scan_keep_their_order():
    rb = frb.ReplayBuffer(4, storage=frb.HostStorage(), batch_size=1)

    def step(state, i):
        state = rb.add(state, {"x": jnp.full((1,), i, jnp.int32)})
        return state, rb.get(state, (i % 4)[None])["x"][0]

    state = rb.init({"x": jnp.int32(0)})
    state, seen = jax.jit(lambda s: jax.lax.scan(step, s, jnp.arange(10)))(state)
    # each read sees the write made just before it in the same step
    assert seen.tolist() == list(range(10))
    assert rb.storage.arrays(state.storage)[0].tolist() == [8, 9, 6, 7]


def test_a_stale_state_is_refused_and_vmap_is_refused():
    rb = frb.ReplayBuffer(8, storage=frb.HostStorage(), batch_size=2)
    state = rb.add(rb.init(EXAMPLE), _items(0, n=3))
    older = jax.tree_util.tree_map(jnp.copy, state)
    state = rb.add(state, _items(1, n=2))
    with pytest.raises(ValueError, match=r"HostStorage.set: .*2 writes.*version is 1.*newest"):
        rb.add(older, _items(2, n=1))
    assert rb.get(state, jnp.arange(5))["act"].tolist() == [0, 1, 2, 100, 101]
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    with pytest.raises(TypeError, match=r"HostStorage does not support jax.vmap"):
        jax.vmap(lambda s: rb.add(s, _items(3, n=1)))(stacked)


def test_pickling_and_deepcopy_copy_the_arrays_and_copy_shares_them():
    rb = frb.ReplayBuffer(8, storage=frb.HostStorage(), batch_size=2)
    state = rb.add(rb.init(EXAMPLE), _items(0, n=3))
    for other in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert other.storage.key != state.storage.key
        assert_trees_equal(rb.get(other, jnp.arange(8)), rb.get(state, jnp.arange(8)))
        other = rb.add(other, _items(5, n=2))  # a buffer of its own: the original is unchanged
        assert rb.get(state, jnp.arange(5))["act"].tolist() == [0, 1, 2, 0, 0]
        assert rb.get(other, jnp.arange(5))["act"].tolist() == [0, 1, 2, 500, 501]
    shallow = copy.copy(state)
    assert shallow.storage.key == state.storage.key
    assert rb.storage.arrays(shallow.storage)[0] is rb.storage.arrays(state.storage)[0]


def test_the_arrays_are_freed_with_their_last_state_even_after_jitted_calls():
    rb = frb.ReplayBuffer(8, storage=frb.HostStorage(), batch_size=2)
    state = rb.init(EXAMPLE)
    state = jax.jit(rb.add, donate_argnums=0)(state, _items(0, n=3))
    state = rb.add(state, _items(1, n=3))
    _, state = rb.sample(state, jax.random.key(0))
    key = state.storage.key
    assert key in host._ROWS
    del state
    gc.collect()
    assert key not in host._ROWS  # compiled programs and caches hold the key only
    gone = host.HostStorageState(version=jnp.int32(0), item=None, capacity=8, key=key)
    with pytest.raises(ValueError, match=r"arrays of HostStorage state .* are gone"):
        rb.storage.arrays(gone)


def test_checkpoints_round_trip_and_name_a_mismatch(tmp_path):
    def buffer(capacity=8):
        return frb.ReplayBuffer(
            capacity, storage=frb.HostStorage(), sampler=frb.PrioritizedSampler(), batch_size=2
        )

    rb = buffer()
    state = rb.add(rb.init(EXAMPLE), _items(0, n=5))
    frb.checkpoint.save(tmp_path / "ck", state)
    fresh = buffer()
    loaded = frb.checkpoint.load(tmp_path / "ck", like=fresh.init(EXAMPLE))
    assert_trees_equal(fresh.get(loaded, jnp.arange(8)), rb.get(state, jnp.arange(8)))
    assert_trees_equal(loaded.sampler, state.sampler)
    loaded = fresh.add(loaded, _items(1, n=1))  # the loaded state is current
    assert int(fresh.size(loaded)) == 6
    with pytest.raises(ValueError, match=r"capacity is 8 in the checkpoint, 16 in the template"):
        frb.checkpoint.load(tmp_path / "ck", like=buffer(16).init(EXAMPLE))
