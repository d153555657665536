"""The mistakes a first-time user makes get a short message that says what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb


def test_python_list_in_the_example_is_named_briefly():
    rb = frb.ReplayBuffer(100, batch_size=4)
    with pytest.raises(ValueError) as e:
        rb.init({"obs": [0.0] * 128, "reward": 0.0})
    msg = str(e.value)
    assert len(msg) < 500, msg
    assert "['obs'] is a Python list of numbers (an array of shape (128,))" in msg
    assert "jnp.asarray(x)" in msg and "ReplayBuffer.init" in msg


def test_python_list_in_the_items_is_named_briefly():
    rb = frb.ReplayBuffer(100, batch_size=4)
    state = rb.init({"obs": jnp.zeros(128)})
    for items in ({"obs": [[0.0] * 128] * 3}, {"obs": [0.0] * 128}):
        with pytest.raises(ValueError) as e:
            rb.add(state, items)
        msg = str(e.value)
        assert len(msg) < 500, msg
        assert "ReplayBuffer.add: ['obs'] is a Python list of numbers" in msg
        assert "jnp.asarray" in msg
    state = rb.add(state, {"obs": np.zeros((3, 128), np.float32)})  # not consumed by the errors
    assert int(rb.size(state)) == 3


def test_a_tuple_of_scalars_is_still_a_valid_item():
    rb = frb.ReplayBuffer(10, batch_size=2)
    state = rb.init((0.0, 0))  # two fields: a float and an int
    state = rb.add(state, (np.ones(3, np.float32), np.arange(3, dtype=np.int32)))
    assert int(rb.size(state)) == 3


def test_a_list_of_items_says_to_stack_them():
    rb = frb.ReplayBuffer(100, batch_size=4)
    state = rb.init({"obs": jnp.zeros(4)})
    with pytest.raises(ValueError, match=r"Python list of 3 items.*jnp\.stack"):
        rb.add(state, [{"obs": np.zeros(4, np.float32)}] * 3)


def test_structure_mismatch_lists_a_few_paths_not_all():
    rb = frb.ReplayBuffer(100, batch_size=4)
    state = rb.init({f"k{i}": jnp.zeros(()) for i in range(100)})
    with pytest.raises(ValueError) as e:
        rb.add(state, {f"j{i}": np.zeros(2, np.float32) for i in range(100)})
    msg = str(e.value)
    assert len(msg) < 1200, len(msg)
    assert "and 92 more" in msg and "... 88 more" in msg


def test_batched_example_says_to_pass_one_item():
    rb = frb.ReplayBuffer(1000, batch_size=4)
    batch = {"obs": jnp.zeros((32, 4)), "reward": jnp.zeros(32)}
    state = rb.init(batch)  # a batch where one item belongs: leaves share the leading 32
    with pytest.raises(ValueError) as e:
        rb.add(state, batch)
    msg = str(e.value)
    assert "init was most likely given a batch of 32 items" in msg
    assert "rb.init(jax.tree_util.tree_map(lambda x: x[0], batch))" in msg
    assert "[None]" in msg  # the other reading, second


def test_one_item_without_batch_axis_still_suggests_none():
    rb = frb.ReplayBuffer(1000, batch_size=4)
    state = rb.init({"obs": jnp.zeros(4), "reward": jnp.float32(0)})
    with pytest.raises(ValueError, match=r"\(a single item needs \[None\]\)"):
        rb.add(state, {"obs": jnp.zeros(4), "reward": jnp.float32(0)})


@pytest.mark.parametrize("where", ["eager", "sampler eagerly"])
def test_without_replacement_batch_larger_than_stored_raises_eagerly(where):
    rb = frb.ReplayBuffer(100, batch_size=32, sampler=frb.SamplerWithoutReplacement())
    state = rb.add(rb.init({"obs": jnp.zeros(2)}), {"obs": np.ones((10, 2), np.float32)})
    with pytest.raises(ValueError) as e:
        if where == "eager":
            rb.sample(state, jax.random.key(0))
        else:
            rb.sampler.sample(state.sampler, jax.random.key(0), 32, rb.context(state))
    msg = str(e.value)
    assert "batch_size=32 but only 10 items are stored" in msg
    assert "RandomSampler" in msg and "mask False" in msg
    s, state = rb.sample(state, jax.random.key(0), batch_size=10)  # state still usable
    assert sorted(np.asarray(s.indices).tolist()) == list(range(10))


def test_without_replacement_batch_larger_than_stored_under_jit_is_masked():
    rb = frb.ReplayBuffer(100, batch_size=32, sampler=frb.SamplerWithoutReplacement())
    state = rb.add(rb.init({"obs": jnp.zeros(2)}), {"obs": np.ones((10, 2), np.float32)})
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    mask = np.asarray(s.mask)
    np.testing.assert_array_equal(mask, np.arange(32) < 10)  # the stored items, then padding
    assert sorted(np.asarray(s.indices)[:10].tolist()) == list(range(10))
    np.testing.assert_array_equal(np.asarray(s.weights), mask.astype(np.float32))
