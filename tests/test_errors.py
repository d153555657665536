"""Errors name the function, the leaf path, what was expected and what was received."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb

EX = {"obs": jnp.zeros((3,), jnp.float32), "info": {"step": jnp.int32(0)}}


def items(b=2, obs_shape=(3,), obs_dtype=np.float32, step_dtype=np.int32):
    return {"obs": np.zeros((b,) + obs_shape, obs_dtype),
            "info": {"step": np.zeros((b,), step_dtype)}}


@pytest.fixture(scope="module")
def rb_state():
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    return rb, rb.init(EX)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_tree_structure_names_missing_and_unexpected_leaves(rb_state, jit):
    rb, state = rb_state
    add = jax.jit(rb.add) if jit else rb.add
    bad = {"obs": np.zeros((2, 3), np.float32), "info": {"stp": np.zeros(2, np.int32)}}
    with pytest.raises(ValueError) as e:
        add(state, bad)
    msg = str(e.value)
    assert "ReplayBuffer.add" in msg and "['info']['step']" in msg and "['info']['stp']" in msg


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_trailing_shape_names_leaf_expected_and_received(rb_state, jit):
    rb, state = rb_state
    add = jax.jit(rb.add) if jit else rb.add
    with pytest.raises(ValueError) as e:
        add(state, items(obs_shape=(4,)))
    msg = str(e.value)
    assert "['obs']" in msg and "(2, 4)" in msg and "(3,)" in msg
    with pytest.raises(ValueError, match=r"single item needs \[None\]"):
        add(state, {"obs": np.zeros((3,), np.float32), "info": {"step": np.int32(0)}})


def test_batch_axes_must_agree(rb_state):
    rb, state = rb_state
    bad = {"obs": np.zeros((2, 3), np.float32), "info": {"step": np.zeros(3, np.int32)}}
    with pytest.raises(ValueError, match="disagree on the batch shape") as e:
        rb.add(state, bad)
    assert "['obs'] has (2,)" in str(e.value) and "['info']['step'] has (3,)" in str(e.value)


def test_unsafe_cast_float_to_int_raises_and_safe_cast_is_fine(rb_state):
    rb, state = rb_state
    with pytest.raises(TypeError) as e:
        rb.add(state, items(step_dtype=np.float32))
    msg = str(e.value)
    assert "['info']['step']" in msg and "float32" in msg and "int32" in msg
    new = rb.add(state, items(obs_dtype=np.float64))  # same kind: float64 -> float32 is fine
    assert rb.get(new, jnp.arange(2))["obs"].dtype == jnp.float32
    assert int(rb.size(new)) == 2


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match=f"capacity must be >= 1, got {capacity}"):
        frb.ReplayBuffer(capacity=capacity)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_batch_size_must_be_positive_int(bad, rb_state):
    err = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(err, match="batch_size"):
        frb.ReplayBuffer(capacity=4, batch_size=bad)
    rb, state = rb_state
    state = rb.add(state, items())
    with pytest.raises(err, match="batch_size"):
        rb.sample(state, jax.random.key(0), batch_size=bad)


def test_traced_batch_size_explains_static_argnames(rb_state):
    rb, state = rb_state
    state = rb.add(state, items())
    with pytest.raises(TypeError, match="static_argnames"):
        jax.jit(rb.sample)(state, jax.random.key(0), 3)


def test_ndim_must_be_1_or_2():
    with pytest.raises(ValueError, match="ndim must be 1 or 2, got 3"):
        frb.ReplayBuffer(capacity=4, ndim=3)


def test_ndim2_items_must_be_env_by_time():
    rb = frb.ReplayBuffer(capacity=8, ndim=2)
    state = rb.init({"obs": jnp.zeros((2, 3))})
    with pytest.raises(ValueError) as e:  # ndim=1-style items [B, ...]
        rb.add(state, {"obs": np.zeros((5, 3), np.float32)})
    assert "['obs']" in str(e.value) and "[num_envs, T]" in str(e.value)
    with pytest.raises(ValueError) as e:  # wrong number of envs
        rb.add(state, {"obs": np.zeros((3, 5, 3), np.float32)})
    assert "num_envs=2" in str(e.value) and "3 envs" in str(e.value)


def test_ndim2_capacity_must_be_a_multiple_of_num_envs():
    rb = frb.ReplayBuffer(capacity=10, ndim=2)
    with pytest.raises(ValueError, match=r"capacity \(10\) must be a multiple of num_envs \(3"):
        rb.init({"obs": jnp.zeros((3, 2))})


def test_ndim2_example_leaves_need_the_env_axis():
    rb = frb.ReplayBuffer(capacity=8, ndim=2)
    with pytest.raises(ValueError, match=r"\['r'\] is a scalar"):
        rb.init({"obs": jnp.zeros((2, 3)), "r": jnp.float32(0)})


def test_without_replacement_drop_last_batch_larger_than_capacity():
    sampler = frb.SamplerWithoutReplacement(drop_last=True)
    with pytest.raises(ValueError, match="batch_size=8 exceeds capacity=4"):
        frb.ReplayBuffer(capacity=4, batch_size=8, sampler=sampler)
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, sampler=sampler)
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(4, dtype=np.int32)})
    with pytest.raises(ValueError, match="batch_size=8 exceeds capacity=4"):
        rb.sample(state, jax.random.key(0), batch_size=8)
    # without drop_last a large batch is fine: padding is masked
    rb2 = frb.ReplayBuffer(capacity=4, batch_size=8, sampler=frb.SamplerWithoutReplacement())
    s, _ = rb2.sample(rb2.add(rb2.init({"v": jnp.int32(0)}), {"v": np.arange(3, dtype=np.int32)}),
                      jax.random.key(0))
    assert int(s.mask.sum()) == 3


def test_components_must_be_components_and_hashable():
    with pytest.raises(TypeError, match="sampler=.*is not a sampler"):
        frb.ReplayBuffer(capacity=4, sampler=object())
    with pytest.raises(ValueError, match="reduction must be one of"):
        frb.MaxValueWriter("r", reduction="median")


def test_max_value_writer_missing_rank_key():
    rb = frb.ReplayBuffer(capacity=4, writer=frb.MaxValueWriter(("info", "score")))
    state = rb.init({"obs": jnp.zeros(2), "info": {"step": jnp.int32(0)}})
    with pytest.raises(KeyError, match=r"\('info', 'score'\).*\['info'\]\['step'\]"):
        rb.add(state, {"obs": np.zeros((1, 2), np.float32), "info": {"step": np.zeros(1, np.int32)}})


def test_not_a_state():
    rb = frb.ReplayBuffer(capacity=4)
    with pytest.raises(TypeError, match="BufferState"):
        rb.add({"obs": 1}, {"obs": np.zeros(1)})
    with pytest.raises(TypeError, match="BufferState"):
        rb.sample({"obs": 1}, jax.random.key(0))
