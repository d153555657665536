"""Errors that once named the wrong cause (issue 36): an unbatched ``add`` after a correct
``init`` was diagnosed as a batched ``init``; a consumed state, printed or saved, gave JAX's
bare "Array has been deleted"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb


def test_an_unbatched_add_after_a_correct_init_says_to_add_a_batch_axis():
    rb = frb.ReplayBuffer(100, batch_size=4)
    state = rb.init({"obs": jnp.zeros(4)})  # one item: obs of 4 features
    with pytest.raises(ValueError) as e:
        rb.add(state, {"obs": jnp.ones(4)})  # one item, no batch axis
    msg = str(e.value)
    # the likely reading first, the other one second
    assert msg.index("x[None]") < msg.index("x[0]")
    assert "exactly the shape of ONE stored item" in msg and "most likely" not in msg
    # the same message under jit: the check runs at trace time
    with pytest.raises(ValueError, match="exactly the shape of ONE stored item"):
        jax.jit(rb.add)(rb.init({"obs": jnp.zeros(4)}), {"obs": jnp.ones(4)})


def test_a_batched_init_is_still_diagnosed_as_one():
    rb = frb.ReplayBuffer(100, batch_size=4)
    state = rb.init({"obs": jnp.zeros(4)})  # if this was a batch of 4 scalars ...
    with pytest.raises(ValueError) as e:
        rb.add(state, {"obs": jnp.ones(8)})  # ... 8 more scalars
    msg = str(e.value)
    assert "init was most likely given a batch of 4 items" in msg
    assert msg.index("x[0]") < msg.index("x[None]")
    # the fix it names works: one item to init, then the batch of 8 adds
    fixed = rb.init(jax.tree_util.tree_map(lambda x: x[0], {"obs": jnp.zeros(4)}))
    assert int(rb.size(rb.add(fixed, {"obs": jnp.ones(8)}))) == 8


def _consumed():
    rb = frb.ReplayBuffer(100, batch_size=4)
    old = rb.add(rb.init({"obs": jnp.zeros(4)}), {"obs": jnp.ones((3, 4))})
    new = rb.add(old, {"obs": jnp.ones((2, 4))})  # eager: consumes `old`
    return rb, old, new


def test_a_consumed_state_prints_as_consumed():
    _, old, new = _consumed()
    text = repr(old)
    assert text.startswith("BufferState(<consumed:") and "state.storage" in text
    assert "use the state that call returned" in text
    assert repr(new).startswith("BufferState(storage=")  # a live state prints its arrays
    assert "Array has been deleted" not in str(old)


def test_saving_a_consumed_state_raises_consumed_state_error(tmp_path):
    rb, old, new = _consumed()
    with pytest.raises(frb.errors.ConsumedStateError, match=r"checkpoint\.save: .*consumed"):
        frb.checkpoint.save(tmp_path / "ckpt", old)
    assert not (tmp_path / "ckpt").exists()  # nothing was written
    frb.checkpoint.save(tmp_path / "ckpt", new)
    assert int(rb.size(frb.checkpoint.load(tmp_path / "ckpt", like=new))) == 5


def test_reading_a_leaf_yourself_is_jax_own_error():
    # documented in docs/eager.md: the library does not see a read of one of your arrays
    _, old, _ = _consumed()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(old.writer.filled)
