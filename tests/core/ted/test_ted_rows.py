"""TED's per-step row (``state.storage.rows``): which leaves it holds, that they come back bit
for bit, and ``TEDStorage.rewrite`` of leaves in it and outside it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb._internal import words

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "float16", "int32", "uint32", "float32"]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from([(), (1,), (3,), (2, 2)]),
    seed=st.integers(0, 2**31 - 1),
    numpy=st.booleans(),
)
def test_words_keep_every_bit(dtype, shape, seed, numpy):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (5,) + shape + (np.dtype(dtype).itemsize,), dtype=np.uint8)
    x = raw.view(dtype).reshape((5,) + shape) if dtype != "bool" else raw[..., 0] % 2 == 1
    xp = np if numpy else jnp
    cols = words.to_words(x, 1, xp)
    assert cols.dtype == np.int32 and cols.shape == (5, words.width(shape))
    back = np.asarray(words.from_words(cols, shape, dtype, xp))
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back.view(np.uint8), np.asarray(x).view(np.uint8))


def _item(action_width=None):
    action = jnp.zeros(() if action_width is None else (action_width,), jnp.float32)
    return {
        "obs": jnp.zeros((3,), jnp.float32),
        "action": action,
        "big": jnp.zeros((40,), jnp.uint8),
        "wide": jnp.zeros((17,)),  # 17 columns: more than a line
        "next": {"obs": jnp.zeros((3,)), "reward": jnp.float32(0), "done": jnp.bool_(False)},
    }


@pytest.mark.parametrize("k", [1, 3])
def test_small_leaves_share_the_row_and_the_rest_keep_arrays(k):
    rb = frb.ReplayBuffer(capacity=32, storage=frb.TEDStorage(frame_stack=k), batch_size=4)
    state = rb.init(_item())
    ts = state.storage
    assert [key for key, _, _ in ts.packed] == [("action",), ("next", "done"), ("next", "reward")]
    assert ts.rows.shape == (32, (2 if k > 1 else 1) + 3)
    assert set(ts.data) == {"obs", "big", "wide"}  # the frame table and the large leaves
    assert ts.stacks == (k > 1) and bool(jnp.all(ts.ptr == -1))
    # leaves that would overflow a line stay out: 15 columns left after the pointer
    wide = rb.init(_item(action_width=16)).storage
    assert ("action",) not in [key for key, _, _ in wide.packed] and "action" in wide.data


def _stream(rng, n):
    obs = rng.normal(size=(n + 1, 3)).astype(np.float32)
    done = rng.random(n) < 0.2
    nxt = obs[1:].copy()
    nxt[done] = 99.0
    return {
        "obs": obs[:-1],
        "action": rng.normal(size=n).astype(np.float32),
        "big": rng.integers(0, 255, (n, 40)).astype(np.uint8),
        "wide": rng.normal(size=(n, 17)).astype(np.float32),
        "next": {"obs": nxt, "reward": rng.normal(size=n).astype(np.float32), "done": done},
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rewrite_sets_leaves_in_the_row_and_outside_it(jit):
    rb = frb.ReplayBuffer(capacity=16, storage=frb.TEDStorage(), batch_size=4)
    state = rb.add(rb.init(_item()), _stream(np.random.default_rng(0), 20))
    before = rb.get(state, jnp.arange(16))
    pos, mask = jnp.array([2, 5, 9]), jnp.array([True, False, True])
    values = {
        "action": jnp.array([7.0, 8.0, 9.0]),
        "wide": jnp.ones((3, 17)),
        "next": {"reward": jnp.array([-1.0, -2.0, -3.0])},
    }
    rewrite = jax.jit(rb.storage.rewrite) if jit else rb.storage.rewrite
    st_new = rewrite(state.storage, pos, mask, values)
    after = rb.get(dataclasses.replace(state, storage=st_new), jnp.arange(16))
    want = jax.tree_util.tree_map(np.array, before)
    for i, j in ((2, 0), (9, 2)):
        want["action"][i], want["wide"][i] = values["action"][j], 1.0
        want["next"]["reward"][i] = values["next"]["reward"][j]
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, want)


def test_rewrite_refuses_the_observations():
    rb = frb.ReplayBuffer(capacity=16, storage=frb.TEDStorage(), batch_size=4)
    state = rb.add(rb.init(_item()), _stream(np.random.default_rng(1), 5))
    with pytest.raises(KeyError, match=r"TEDStorage.rewrite: \('obs',\) is not a leaf stored"):
        rb.storage.rewrite(
            state.storage, jnp.array([0]), jnp.array([True]), {"obs": jnp.ones((1, 3))}
        )
