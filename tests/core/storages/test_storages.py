"""DeviceStorage(pack=True) (the default) is DeviceStorage(pack=False) with another memory
layout: for every sampler, writer and ndim, the same adds and keys give the same samples, bit for
bit; adds stay in place under donation; vmap, checkpoints and the trace-time checks work
unchanged; leaves over PACK_MAX_WIDTH elements keep their own array."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _users_hlo import users_hlo
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.storages.device import gather_many

pytestmark = pytest.mark.heavy

# leaves of several dtypes and shapes, including a scalar, a bool and a rank-2 leaf
EX = {
    "obs": jnp.zeros((3, 2), jnp.float32),
    "act": jnp.zeros((), jnp.int32),
    "r": jnp.zeros((), jnp.float32),
    "small": jnp.zeros((4,), jnp.int8),
    "next": {"done": jnp.zeros((), jnp.bool_), "truncated": jnp.zeros((), jnp.bool_)},
    "rank": jnp.zeros((), jnp.float32),
}


def items(rng, lead):
    return {
        "obs": rng.standard_normal(lead + (3, 2)).astype(np.float32),
        "act": rng.integers(-9, 9, lead).astype(np.int32),
        "r": rng.standard_normal(lead).astype(np.float32),
        "small": rng.integers(-100, 100, lead + (4,)).astype(np.int8),
        "next": {"done": rng.random(lead) < 0.2, "truncated": np.zeros(lead, bool)},
        "rank": rng.standard_normal(lead).astype(np.float32),
    }


CONFIGS = {
    "random": dict(capacity=13, batch_size=5),
    "without_replacement": dict(capacity=13, batch_size=4, sampler=frb.SamplerWithoutReplacement()),
    "prioritized": dict(capacity=13, batch_size=5, sampler=frb.PrioritizedSampler(alpha=0.7)),
    "max_value": dict(capacity=13, batch_size=5, writer=frb.MaxValueWriter(rank_key="rank")),
    "slices_ndim2": dict(capacity=24, batch_size=6, ndim=2, sampler=frb.SliceSampler(slice_len=3)),
}


def ex_for(cfg):
    if cfg.get("ndim", 1) == 2:
        return jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), EX)  # 2 envs
    return EX


@functools.cache
def functions(rb, jit):
    """(add, sample), jitted once per buffer (not once per hypothesis example)."""
    if jit:
        return jax.jit(rb.add), jax.jit(rb.sample)
    return rb.add, rb.sample


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=6)
# three add sizes (one item, a few, most of the ring) cover the wrap cases with a compile each,
# where every size from 1 to 9 compiled nine add functions per configuration
@given(
    adds=st.lists(st.sampled_from([1, 3, 9]), min_size=1, max_size=3), seed=st.integers(0, 2**16)
)
def test_packed_storage_samples_exactly_what_the_per_leaf_storage_does(jit, name, adds, seed):
    cfg = CONFIGS[name]
    rbs = [frb.ReplayBuffer(storage=frb.DeviceStorage(pack=p), **cfg) for p in (False, True)]
    fns = [functions(rb, jit) for rb in rbs]
    states = [rb.init(ex_for(cfg)) for rb in rbs]
    assert isinstance(states[1].storage, frb.storages.PackedStorageState)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    for n in adds:
        lead = (2, n) if cfg.get("ndim", 1) == 2 else (n,)
        batch = items(rng, lead)
        states = [add(s, batch) for (add, _), s in zip(fns, states)]
        if not bool(rbs[0].can_sample(states[0])):
            continue
        if (
            not jit
            and name == "without_replacement"
            and int(rbs[0].size(states[0])) < rbs[0].batch_size
        ):
            continue  # eagerly a batch larger than what is stored raises (jit pads)
        key, k = jax.random.split(key)
        out = [sample(s, k) for (_, sample), s in zip(fns, states)]
        (a, states[0]), (b, states[1]) = out
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the whole content, read back by position, agrees too
    everything = jnp.arange(rbs[0].capacity, dtype=jnp.int32)
    got = [rb.storage.get(s.storage, everything, rb.context(s)) for rb, s in zip(rbs, states)]
    for x, y in zip(jax.tree_util.tree_leaves(got[0]), jax.tree_util.tree_leaves(got[1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_state_is_one_array_per_dtype_and_adds_in_place():
    rb = frb.ReplayBuffer(capacity=100_000, batch_size=8, storage=frb.DeviceStorage(pack=True))
    state = rb.init(EX)
    slabs = state.storage.slabs
    assert sorted(slabs) == ["bool", "float32", "int32", "int8"]
    assert isinstance(
        frb.ReplayBuffer(capacity=4).init(EX).storage, frb.storages.PackedStorageState
    )  # the default
    assert slabs["float32"].shape == (100_000, 3 * 2 + 1 + 1)
    assert slabs["bool"].shape == (100_000, 2) and slabs["int8"].shape == (100_000, 4)
    # the item's structure is static: a jitted call hands over the slabs and the writer's
    # counters (one array) only
    assert len(jax.tree_util.tree_leaves(state)) == len(slabs) + 1
    assert rb.storage.item_spec(state.storage) == jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), EX
    )
    add = jax.jit(rb.add, donate_argnums=0)
    batch = items(np.random.default_rng(0), (8,))
    state = add(state, batch)
    ptr = state.storage.slabs["float32"].unsafe_buffer_pointer()
    new = add(state, batch)
    assert new.storage.slabs["float32"].unsafe_buffer_pointer() == ptr  # reused, not copied
    s, newer = jax.jit(rb.sample, donate_argnums=0)(new, jax.random.key(0))
    assert newer.storage.slabs["float32"].unsafe_buffer_pointer() == ptr
    rows = np.asarray(s.indices) % 8
    np.testing.assert_array_equal(np.asarray(s.data["small"]), batch["small"][rows])


def test_packed_storage_vmaps_and_checkpoints_bit_exactly(tmp_path):
    rb = frb.ReplayBuffer(capacity=6, batch_size=4, storage=frb.DeviceStorage(pack=True))
    pop = 3
    states = jax.vmap(rb.init)(jax.tree_util.tree_map(lambda x: jnp.stack([x] * pop), EX))
    batches = [items(np.random.default_rng(p), (5,)) for p in range(pop)]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)
    states = jax.jit(jax.vmap(rb.add))(states, stacked)
    keys = jax.random.split(jax.random.key(1), pop)
    s, _ = jax.jit(jax.vmap(rb.sample))(states, keys)
    for p in range(pop):  # each member is an independent buffer
        one = rb.add(rb.init(EX), batches[p])
        s1, _ = rb.sample(one, keys[p])
        np.testing.assert_array_equal(np.asarray(s.data["obs"][p]), np.asarray(s1.data["obs"]))
        np.testing.assert_array_equal(
            np.asarray(s.data["next"]["done"][p]), np.asarray(s1.data["next"]["done"])
        )

    one = rb.add(rb.init(EX), batches[0])
    path = tmp_path / "packed.npz"
    frb.checkpoint.save(path, one)
    for like in (None, rb.init(EX)):
        back = frb.checkpoint.load(path, like=like)
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(one)
        for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(one)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        a, _ = rb.sample(back, jax.random.key(2))
        b, _ = rb.sample(one, jax.random.key(2))
        np.testing.assert_array_equal(np.asarray(a.data["obs"]), np.asarray(b.data["obs"]))


def test_packed_storage_checks_items_like_the_per_leaf_storage():
    rb = frb.ReplayBuffer(capacity=8, batch_size=2, storage=frb.DeviceStorage(pack=True))
    state = rb.init(EX)
    bad = items(np.random.default_rng(0), (3,))
    bad["small"] = bad["small"][:, :3]
    with pytest.raises(
        ValueError, match=r"\['small'\] has shape \(3, 3\), expected \[B\] \+ \(4,\)"
    ):
        rb.add(state, bad)
    bad = items(np.random.default_rng(0), (3,))
    bad["act"] = bad["act"].astype(np.float32)  # float -> int is not a safe cast
    with pytest.raises(TypeError, match="act"):
        rb.add(state, bad)


def test_large_leaves_keep_their_own_array():
    big = frb.storages.PACK_MAX_WIDTH + 1
    ex = {
        "frame": jnp.zeros((big,), jnp.uint8),
        "small": jnp.zeros((3,), jnp.uint8),
        "other": jnp.zeros((2, big), jnp.uint8),
        "r": jnp.zeros((), jnp.float32),
    }
    rb = frb.ReplayBuffer(capacity=10, batch_size=4)
    state = rb.init(ex)
    # tree order: frame (0), other (1), r (2), small (3)
    assert {k: v.shape for k, v in state.storage.slabs.items()} == {
        "leaf0_uint8": (10, big),
        "leaf1_uint8": (10, 2 * big),
        "float32": (10, 1),
        "uint8": (10, 3),
    }
    rng = np.random.default_rng(0)
    batch = {
        "frame": rng.integers(0, 255, (6, big)).astype(np.uint8),
        "small": rng.integers(0, 255, (6, 3)).astype(np.uint8),
        "other": rng.integers(0, 255, (6, 2, big)).astype(np.uint8),
        "r": rng.standard_normal(6).astype(np.float32),
    }
    state = rb.add(state, batch)
    got = rb.get(state, jnp.arange(6))
    for k in batch:
        np.testing.assert_array_equal(np.asarray(got[k]), batch[k])


@pytest.mark.parametrize("pack", [True, False])
def test_read_host_equals_get_and_leaves_donation_in_place(pack):
    # read_host gathers on the host (a view of the CPU buffer); a donated add afterwards still
    # writes the same buffer (the view is not kept)
    rb = frb.ReplayBuffer(capacity=64, storage=frb.DeviceStorage(pack=pack), ndim=2)
    item = {
        "o": np.zeros((2, 3), np.float32),
        "a": np.zeros((2,), np.int32),
        "img": np.zeros((2, 40, 40), np.uint8),
    }
    state = rb.init(item)
    rng = np.random.default_rng(0)
    steps = {
        k: rng.integers(0, 200, (2, 20, *v.shape[1:])).astype(v.dtype) for k, v in item.items()
    }
    state = rb.add(state, steps)
    idx = rng.integers(0, 64, (5, 7)).astype(np.int32)
    got = rb.storage.read_host(state.storage, idx)
    want = jax.device_get(rb.get(state, jnp.asarray(idx)))
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(x, y), got, want)
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(got))
    add = jax.jit(rb.add, donate_argnums=0)
    before = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(state.storage)]
    state = add(state, jax.tree_util.tree_map(lambda x: x[:, :1], steps))
    after = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(state.storage)]
    assert before == after


_gather_many_jit = jax.jit(lambda leaves, idx: gather_many(leaves, idx))


@settings(max_examples=40, deadline=None)
@given(
    cap=st.integers(4, 40),
    slices=st.integers(1, 5),
    length=st.sampled_from([1, 7, 8, 12]),
    kind=st.sampled_from(["runs", "wrap", "padded", "random", "longer than the capacity"]),
    seed=st.integers(0, 2**16),
)
def test_gather_many_reads_what_row_by_row_reads(cap, slices, length, kind, seed):
    """Slices read as windows (every row a run of consecutive positions) or row by row (a run
    that wraps, padding, anything else): the same rows either way, under jit and eagerly."""
    length = min(length, cap)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, cap - length + 1, slices)
    idx = starts[:, None] + np.arange(length)[None, :]
    if kind == "longer than the capacity":  # a slice of cap + 3 steps: never a window
        idx = (starts[:, None] + np.arange(cap + 3)[None, :]) % cap
    if kind == "wrap":
        idx = (idx + cap - length // 2) % cap
    elif kind == "padded":
        idx = np.minimum(idx, (starts + rng.integers(0, length, slices))[:, None])
    elif kind == "random":
        idx = rng.integers(0, cap, idx.shape)
    leaves = [
        jnp.asarray(rng.integers(0, 255, (cap, 3)), jnp.uint8),
        jnp.asarray(rng.random(cap) < 0.5),
        jnp.asarray(rng.standard_normal((cap, 2, 2)), jnp.float32),
    ]
    want = [np.asarray(x)[idx] for x in leaves]
    for fn in (gather_many, _gather_many_jit):
        got = fn(leaves, jnp.asarray(idx, jnp.int32))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype and np.array_equal(g, w)


def test_gather_many_compiles_a_window_read_for_slices():
    """The window path exists in the compiled read (a gather of [12, 3] blocks beside the
    row-by-row one), so runs are not silently read row by row."""
    if jax.default_backend() != "cpu":
        pytest.skip("the window read is the CPU's")
    leaf = jnp.zeros((100, 3), jnp.uint8)
    read = jax.jit(lambda x, i: gather_many([x], i))
    hlo = users_hlo(read, leaf, jnp.zeros((4, 12), jnp.int32))
    assert "slice_sizes={12,3}" in hlo and "slice_sizes={1,3}" in hlo
