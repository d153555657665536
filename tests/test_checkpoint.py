"""checkpoint.save / load: bit-exact round trips (NaN payloads, wrap-around, static num_envs)
and a loaded state behaves exactly like the original."""
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])

CONFIGS = {
    "random": dict(ndim=1),
    "without_replacement": dict(ndim=1, sampler=frb.SamplerWithoutReplacement()),
    "max_value": dict(ndim=1, writer=frb.MaxValueWriter("r")),
    "ndim2": dict(ndim=2),
}


@functools.lru_cache(maxsize=None)
def buffer(name, jit):
    rb = frb.ReplayBuffer(capacity=6, batch_size=4, **CONFIGS[name])
    if jit:
        return rb, jax.jit(rb.add), jax.jit(rb.sample)
    return rb, rb.add, rb.sample


def bits(tree):
    """Every leaf as raw bytes (NaN payloads and -0.0 compare exactly), plus dtype and shape."""
    return [(x.dtype, x.shape, np.asarray(x).tobytes()) for x in jax.tree_util.tree_leaves(tree)]


def nan_payload_floats(rng, shape):
    raw = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    raw[..., 0] = 0x7FC00000 | (raw[..., 0] & 0x003FFFFF)  # quiet NaNs with random payloads
    return raw.view(np.float32)


def items_for(name, rng, n):
    if name == "ndim2":
        return {"obs": nan_payload_floats(rng, (2, n, 3)), "r": rng.standard_normal((2, n), np.float32),
                "id": rng.integers(0, 100, (2, n)).astype(np.int32)}
    return {"obs": nan_payload_floats(rng, (n, 3)), "r": rng.standard_normal(n, np.float32),
            "id": rng.integers(0, 100, n).astype(np.int32)}


def example(name):
    lead = (2,) if name == "ndim2" else ()
    return {"obs": jnp.zeros(lead + (3,), jnp.float32), "r": jnp.zeros(lead, jnp.float32),
            "id": jnp.zeros(lead, jnp.int32)}


@JIT
@settings(max_examples=max(4, settings().max_examples // 3))
@given(name=st.sampled_from(sorted(CONFIGS)),
       adds=st.lists(st.sampled_from([1, 4, 7]), min_size=0, max_size=3),
       seed=st.integers(0, 2**16), with_template=st.booleans())
def test_round_trip_is_bit_exact_and_behaves_identically(jit, name, adds, seed, with_template):
    rb, add, sample = buffer(name, jit)
    rng = np.random.default_rng(seed)
    state = rb.init(example(name))
    key = jax.random.key(seed)
    for n in adds:  # 7 > capacity // num_envs: wraps around
        state = add(state, items_for(name, rng, n))
        if int(rb.size(state)) and name == "without_replacement":
            key, k = jax.random.split(key)
            _, state = sample(state, k)  # mid-epoch sampler state must survive too
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rb.npz")
        frb.checkpoint.save(path, state)
        loaded = frb.checkpoint.load(path, like=rb.init(example(name)) if with_template else None)
    assert type(loaded) is type(state) and loaded.num_envs == state.num_envs
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
    assert bits(loaded) == bits(state)
    if int(rb.size(state)) == 0:
        return
    # same key -> same next samples; and the same after one more add
    more = items_for(name, rng, 4)
    outs = []
    for s in (state, loaded):
        a, s = sample(s, key)
        s = add(s, more)
        b, s = sample(s, jax.random.fold_in(key, 1))
        outs.append((bits(a), bits(b), bits(s)))
    assert outs[0] == outs[1]


def test_template_mismatch_names_the_leaf(tmp_path):
    packed = frb.ReplayBuffer(capacity=4, batch_size=2)
    path = tmp_path / "packed.npz"
    frb.checkpoint.save(path, packed.init({"obs": jnp.zeros(3)}))
    with pytest.raises(ValueError, match=r"item\['obs'\] is float32\[3\].*expected float32\[2\]"):
        frb.checkpoint.load(path, like=packed.init({"obs": jnp.zeros(2)}))
    with pytest.raises(ValueError, match=r"leaves .*'obs'.* in the checkpoint, .*'x'.* in the template"):
        frb.checkpoint.load(path, like=packed.init({"x": jnp.zeros(3)}))
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, storage=frb.DeviceStorage(pack=False))
    path = tmp_path / "rb.npz"
    frb.checkpoint.save(path, rb.init({"obs": jnp.zeros(3)}))
    with pytest.raises(ValueError, match=r"\['obs'\].*float32\[4, 3\].*float32\[4, 2\]"):
        frb.checkpoint.load(path, like=rb.init({"obs": jnp.zeros(2)}))
    with pytest.raises(ValueError, match=r"only in the checkpoint: .*\['obs'\]"):
        frb.checkpoint.load(path, like=rb.init({"x": jnp.zeros(3)}))
    rb2 = frb.ReplayBuffer(capacity=4, batch_size=2, ndim=2)
    frb.checkpoint.save(path, rb2.init({"obs": jnp.zeros((2, 3))}))
    with pytest.raises(ValueError, match="num_envs"):
        frb.checkpoint.load(path, like=rb2.init({"obs": jnp.zeros((4, 3))}))


def test_checkpoint_is_not_pickle_and_rejects_foreign_classes(tmp_path):
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    path = tmp_path / "rb.npz"
    frb.checkpoint.save(path, rb.init({"obs": jnp.zeros(3)}))
    with np.load(path, allow_pickle=False) as z:  # readable with pickle disabled
        assert "manifest" in z.files
    with pytest.raises(TypeError, match="cannot store"):
        frb.checkpoint.save(tmp_path / "x.npz", {"f": object()})
    key_state = {"key": jax.random.key(7), "x": jnp.arange(3)}
    frb.checkpoint.save(tmp_path / "k.npz", key_state)
    back = frb.checkpoint.load(tmp_path / "k.npz")
    np.testing.assert_array_equal(jax.random.key_data(back["key"]),
                                  jax.random.key_data(key_state["key"]))
    assert frb.checkpoint is __import__("functional_rb.checkpoint").checkpoint


def test_packed_item_of_nested_containers_round_trips(tmp_path):
    """A packed storage keeps its item's structure in the manifest: lists, tuples, None and
    nested dicts come back as the same tree and the loaded state samples identically."""
    item = {"x": [jnp.ones(2), None, (jnp.int32(3), jnp.ones((), jnp.bool_))],
            "y": {"z": jnp.zeros((2, 2), jnp.uint8)}}
    rb = frb.ReplayBuffer(capacity=8, batch_size=4)
    rng = np.random.default_rng(0)
    batch = {"x": [rng.normal(size=(5, 2)).astype(np.float32), None,
                   (rng.integers(0, 9, 5).astype(np.int32), rng.random(5) < 0.5)],
             "y": {"z": rng.integers(0, 255, (5, 2, 2)).astype(np.uint8)}}
    state = rb.add(rb.init(item), batch)
    path = tmp_path / "nested.npz"
    frb.checkpoint.save(path, state)
    for loaded in (frb.checkpoint.load(path), frb.checkpoint.load(path, like=rb.init(item))):
        assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
        a, _ = rb.sample(loaded, jax.random.key(3))
        b, _ = rb.sample(state, jax.random.key(3))
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_item_with_a_namedtuple_is_refused_by_name(tmp_path):
    import collections
    Pair = collections.namedtuple("Pair", "a b")
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    state = rb.init({"p": Pair(jnp.zeros(2), jnp.int32(0))})
    with pytest.raises(TypeError, match=r"item\['p'\] of type Pair"):
        frb.checkpoint.save(tmp_path / "nt.npz", state)
    assert not os.path.exists(tmp_path / "nt.npz")
