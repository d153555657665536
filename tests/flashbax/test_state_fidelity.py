"""The states and samples of functional_rb.flashbax are flashbax 0.1.3's PyTrees: the same key
paths in the same leaf order, the same shapes and dtypes, the same static fields, so code that
compares structures, builds a state from leaves, or restores a checkpoint written with flashbax
does not notice the switch; and a state written by flashbax goes on in ours."""

import io
import warnings
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb.flashbax as ours

fbx = pytest.importorskip("flashbax")

ITEM = {"obs": jnp.zeros((3,), jnp.float32), "act": jnp.int32(0)}

BUILDERS = {
    "make_flat_buffer": dict(max_length=20, min_length=2, sample_batch_size=4),
    "make_item_buffer": dict(max_length=20, min_length=2, sample_batch_size=4),
    "make_trajectory_buffer": dict(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=3,
        period=1,
        min_length_time_axis=3,
        max_length_time_axis=10,
    ),
    "make_prioritised_flat_buffer": dict(max_length=20, min_length=2, sample_batch_size=4),
    "make_prioritised_item_buffer": dict(max_length=20, min_length=2, sample_batch_size=4),
    "make_prioritised_trajectory_buffer": dict(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=3,
        period=2,
        min_length_time_axis=3,
        max_length_time_axis=11,
    ),
}


def fb(f, *args, **kwargs):
    """flashbax's code broadcasts across ranks, which the suite's conftest makes an error."""
    with jax.numpy_rank_promotion("allow"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with redirect_stdout(io.StringIO()):
            return f(*args, **kwargs)


def describe(tree):
    """Leaf by leaf: key path, shape, dtype; and every node's static fields."""
    leaves = [
        (jax.tree_util.keystr(p), np.shape(x), str(jnp.asarray(x).dtype))
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    return leaves


def statics(state):
    tree = getattr(state, "sum_tree_state", None)
    return None if tree is None else (tree.tree_depth, tree.capacity)


def one_add(name, item):
    if "trajectory" in name:
        return jax.tree_util.tree_map(lambda x: jnp.ones((2, 5) + x.shape, x.dtype), item)
    return jax.tree_util.tree_map(lambda x: jnp.ones_like(x), item)


def built(name):
    return fb(getattr(fbx, name), **BUILDERS[name]), ours.__dict__[name](**BUILDERS[name])


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_states_and_samples_are_flashbax_pytrees(name):
    theirs, mine = built(name)
    a, b = fb(theirs.init, ITEM), mine.init(ITEM)
    assert describe(b) == describe(a)
    assert statics(b) == statics(a)
    for _ in range(3):
        a = fb(theirs.add, a, one_add(name, ITEM))
        b = mine.add(b, one_add(name, ITEM))
    assert describe(b) == describe(a)
    key = jax.random.PRNGKey(0)
    assert describe(mine.sample(b, key)) == describe(fb(theirs.sample, a, key))
    if hasattr(theirs, "set_priorities"):
        s = mine.sample(b, key)
        b = mine.set_priorities(b, s.indices, jnp.full(s.indices.shape, 2.0))
        assert describe(b) == describe(a)


def test_the_queue_state_is_flashbax_pytree():
    kw = dict(
        max_length_time_axis=10, add_batch_size=2, add_sequence_length=2, sample_sequence_length=2
    )
    theirs, mine = fb(fbx.make_trajectory_queue, **kw), ours.make_trajectory_queue(**kw)
    assert describe(mine.init(ITEM)) == describe(fb(theirs.init, ITEM))


def test_opt_ins_add_leaves_only_when_asked():
    kw = BUILDERS["make_prioritised_trajectory_buffer"]
    plain = ours.make_prioritised_trajectory_buffer(**kw).init(ITEM)
    stale = ours.make_prioritised_trajectory_buffer(**kw, drop_stale_updates=True).init(ITEM)
    assert not hasattr(plain, "generations")
    assert isinstance(stale, type(plain)) and hasattr(stale, "generations")
    assert len(jax.tree_util.tree_leaves(stale)) > len(jax.tree_util.tree_leaves(plain))


@pytest.mark.parametrize(
    "name", ["make_prioritised_trajectory_buffer", "make_prioritised_flat_buffer"]
)
def test_a_state_written_by_flashbax_goes_on_in_ours(name):
    """flashbax's state, leaf for leaf, rebuilt in our structure: adds, draws and updates go on
    from it, and the tree is flashbax's (the same leaves and total). The priorities keep the
    largest recorded value at 1: above it, flashbax gives new items that value rounded down to
    an integer, ours the value itself (test_buffers.py::test_new_items_get_the_exact_largest_value)."""
    theirs, mine = built(name)
    a = fb(theirs.init, ITEM)
    while not fb(theirs.can_sample, a):  # flashbax draws past its capacity from an empty tree
        a = fb(theirs.add, a, one_add(name, ITEM))
    for t in range(4):
        a = fb(theirs.add, a, one_add(name, ITEM))
        s = fb(theirs.sample, a, jax.random.PRNGKey(t))
        a = fb(theirs.set_priorities, a, s.indices, jnp.array([1.0, 0.5, 0.25, 1.0]))
    b = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(mine.init(ITEM)), jax.tree_util.tree_leaves(a)
    )
    np.testing.assert_array_equal(b.sum_tree_state.nodes, a.sum_tree_state.nodes)
    b = mine.add(b, one_add(name, ITEM))
    a = fb(theirs.add, a, one_add(name, ITEM))
    s = mine.sample(b, jax.random.PRNGKey(9))
    assert bool(jnp.all(s.probabilities > 0))
    b = mine.set_priorities(b, s.indices, jnp.full(s.indices.shape, 3.0))
    a = fb(theirs.set_priorities, a, s.indices, jnp.full(s.indices.shape, 3.0))
    for x, y in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(a)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_orbax_restores_a_flashbax_checkpoint_into_our_state(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    name = "make_prioritised_trajectory_buffer"
    theirs, mine = built(name)
    a = fb(theirs.add, fb(theirs.init, ITEM), one_add(name, ITEM))
    s = fb(theirs.sample, a, jax.random.PRNGKey(0))
    a = fb(theirs.set_priorities, a, s.indices, jnp.arange(1.0, 5.0))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", a)
    with ocp.StandardCheckpointer() as ckpt:
        b = ckpt.restore(tmp_path / "ckpt", mine.init(ITEM))
    assert type(b) is type(mine.init(ITEM))
    for x, y in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(a)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mine.sample(b, jax.random.PRNGKey(1))
