"""Eager calls of a MemmapStorage buffer: the buffer's work compiled, the storage's reads and
writes NumPy code between the calls (``functional_rb/_internal/host_calls.py``). Same results
as a DeviceStorage buffer and as the jitted calls (host callbacks), no host callback on the way,
and the eager errors of any buffer."""

import jax
import jax.numpy as jnp
import pytest
from _storage_items import EXAMPLE
from _storage_items import items as _items
from _trees import assert_trees_equal

import functional_rb as frb
from functional_rb._internal.errors import ConsumedStateError
from functional_rb.storages import memmap as mm

SAMPLERS = {
    "random": lambda: frb.RandomSampler(),
    "prioritized": lambda: frb.PrioritizedSampler(alpha=0.7, beta=0.5),
    "slices": lambda: frb.SliceSampler(slice_len=2, end_key=("next", "done")),
    "without_replacement": lambda: frb.SamplerWithoutReplacement(),
}


def _run(rb, calls, steps=6):
    """Add, sample and update priorities ``steps`` times; returns the samples and the
    state."""
    state, out = rb.init(EXAMPLE), []
    for i, key in enumerate(jax.random.split(jax.random.key(3), steps)):
        state = calls["add"](state, _items(i))
        sample, state = calls["sample"](state, key)
        out.append(sample)
        state = calls["update"](state, sample.indices, jnp.abs(sample.data["next"]["reward"]) + 0.5)
    return out, state


def _eager(rb):
    return {"add": rb.add, "sample": rb.sample, "update": rb.update}


def _jitted(rb):
    return {
        "add": jax.jit(rb.add, donate_argnums=0),
        "sample": jax.jit(rb.sample, donate_argnums=0),
        "update": jax.jit(rb.update, donate_argnums=0),
    }


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_eager_calls_match_device_storage_and_the_jitted_calls(tmp_path, monkeypatch, name):
    def buffer(storage):
        return frb.ReplayBuffer(16, sampler=SAMPLERS[name](), storage=storage, batch_size=4)

    device_rb = buffer(frb.DeviceStorage())
    device_samples, device_state = _run(device_rb, _eager(device_rb))
    jit_rb = buffer(frb.MemmapStorage(tmp_path / "jit"))
    jit_samples, jit_state = _run(jit_rb, _jitted(jit_rb))

    def no_callback(*args, **kwargs):
        raise AssertionError("an eager call of a MemmapStorage buffer used a host callback")

    monkeypatch.setattr(mm, "io_callback", no_callback)
    rb = buffer(frb.MemmapStorage(tmp_path / "eager"))
    samples, state = _run(rb, _eager(rb))
    for a, b, c in zip(samples, device_samples, jit_samples):
        assert_trees_equal(a, b)
        assert_trees_equal(a, c)
    for s in (device_state, jit_state):
        assert_trees_equal(state.sampler, s.sampler)
        assert_trees_equal(state.writer, s.writer)
    assert int(state.storage.version) == int(jit_state.storage.version) == 6
    assert_trees_equal(rb.get(state, jnp.arange(16)), jit_rb.get(jit_state, jnp.arange(16)))


def test_ndim2_and_rate_limiter(tmp_path, monkeypatch):
    limiter = frb.RateLimiter(samples_per_insert=1.0, min_size_to_sample=4, error_buffer=20.0)

    def buffer(storage):
        return frb.ReplayBuffer(
            12,
            storage=storage,
            ndim=2,
            batch_size=4,
            rate_limiter=limiter,
            sampler=frb.SliceSampler(slice_len=2, end_key=("next", "done")),
        )

    def run(rb):
        example = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), EXAMPLE)
        state, out = rb.init(example), []
        for i, key in enumerate(jax.random.split(jax.random.key(5), 5)):
            items = jax.tree_util.tree_map(
                lambda x: x.reshape((2, 2) + x.shape[1:]), _items(i, n=4)
            )
            state = rb.add(state, items)
            sample, state = rb.sample(state, key)
            out.append(sample)
        return out, state

    expected, expected_state = run(buffer(frb.DeviceStorage()))
    monkeypatch.setattr(mm, "io_callback", None)  # an eager call must not reach it
    got, state = run(buffer(frb.MemmapStorage(tmp_path / "rb")))
    for a, b in zip(got, expected):
        assert_trees_equal(a, b)
    assert_trees_equal(state.limiter, expected_state.limiter)


def test_eager_errors_leave_the_files_and_the_state_as_they_were(tmp_path):
    rb = frb.ReplayBuffer(8, storage=frb.MemmapStorage(tmp_path / "rb"), batch_size=2)
    state = rb.init(EXAMPLE)
    with pytest.raises(ValueError, match=r"ReplayBuffer.sample: nothing can be sampled yet"):
        rb.sample(state, jax.random.key(0))
    state = rb.add(state, _items(0, n=3))
    bad = dict(_items(1, n=2), act=jnp.zeros(2, jnp.float32))
    with pytest.raises(TypeError, match=r"act"):
        rb.add(state, bad)
    assert int(state.storage.version) == 1 and int(rb.size(state)) == 3
    assert_trees_equal(rb.get(state, jnp.arange(3)), _items(0, n=3))

    newer = rb.add(state, _items(1, n=2))
    with pytest.raises(ConsumedStateError, match=r"consumed"):
        rb.add(state, _items(2, n=2))
    assert int(rb.size(newer)) == 5 and int(newer.storage.version) == 2
    # a copy of an older state is not consumed, but the files have moved on: refused
    older = jax.tree_util.tree_map(jnp.copy, newer)
    newest = rb.add(newer, _items(3, n=2))
    with pytest.raises(ValueError, match=r"MemmapStorage.set: .* not the newest state"):
        rb.add(older, _items(4, n=2))
    assert int(rb.size(newest)) == 7 and int(newest.storage.version) == 3
    assert_trees_equal(rb.get(newest, jnp.arange(5, 7)), _items(3, n=2))


def test_an_eager_write_is_journaled_and_rolled_back_like_any_write(tmp_path):
    path = tmp_path / "rb"
    rb = frb.ReplayBuffer(8, storage=frb.MemmapStorage(path), batch_size=2)
    state = rb.add(rb.init(EXAMPLE), _items(0, n=4))
    rb.storage.checkpoint(state)
    state = rb.add(state, _items(1, n=6))  # overwrites slots 4..7 and 0..1
    mm.close_directory(rb.storage.directory)
    restored = rb.storage.restore(rb.init(EXAMPLE))
    assert int(rb.size(restored)) == 4
    assert_trees_equal(rb.get(restored, jnp.arange(4)), _items(0, n=4))


def test_touch_reads_every_page_of_the_item_files(tmp_path):
    rb = frb.ReplayBuffer(3000, storage=frb.MemmapStorage(tmp_path / "rb"), batch_size=2)
    state = rb.add(rb.init(EXAMPLE), _items(0, n=5))
    # obs f32[3], act i32, done bool, reward f32 per item
    assert rb.storage.touch() == 3000 * (12 + 4 + 1 + 4)
    assert_trees_equal(rb.get(state, jnp.arange(5)), _items(0, n=5))
