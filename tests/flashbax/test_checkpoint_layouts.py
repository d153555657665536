"""Checkpoints of functional_rb.flashbax's prioritised states written before their layout became
flashbax's (tests/fixtures/flashbax_v1, made by make_flashbax_v1.py with commit 4db8a7c: the
core's wide tree in ``sum_tree_state.tree``, a ``generations`` field on every prioritised state)
load into today's states: the same priorities, experience and largest recorded value, in
flashbax's layout, and the buffers go on from them."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
import functional_rb.flashbax as fbx
from functional_rb.flashbax.buffers import prioritised_trajectory_buffer as ptb
from functional_rb.flashbax.buffers import sum_tree

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flashbax_v1"


def buffer_of(name):
    if name == "flat":
        return fbx.make_prioritised_flat_buffer(max_length=12, min_length=2, sample_batch_size=4)
    return fbx.make_prioritised_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=3,
        period=2,
        min_length_time_axis=3,
        max_length_time_axis=10,
        drop_stale_updates=name.endswith("stale"),
    )


@pytest.mark.parametrize("name", ["flat", "trajectory", "trajectory_stale"])
def test_an_older_checkpoint_loads_in_flashbax_layout(name):
    saved = np.load(FIXTURES / "leaves.npz")
    state = frb.checkpoint.load(FIXTURES / name)
    stale = name.endswith("stale")
    assert type(state) is (
        ptb.GenerationalPrioritisedTrajectoryBufferState
        if stale
        else ptb.PrioritisedTrajectoryBufferState
    )
    tree = state.sum_tree_state
    np.testing.assert_array_equal(
        np.asarray(sum_tree.get_batch(tree, jnp.arange(tree.capacity))), saved[name + ".values"]
    )
    assert float(tree.max_recorded_priority) == float(saved[name + ".max"])
    for path, x in jax.tree_util.tree_flatten_with_path(state.experience)[0]:
        np.testing.assert_array_equal(
            np.asarray(x), saved[name + ".experience" + jax.tree_util.keystr(path)]
        )
    # flashbax's layout: a fresh state's structure, its nodes the leaves' exact sums
    buffer = buffer_of(name)
    fresh = buffer.init({"obs": jnp.zeros(2), "act": jnp.int32(0)})
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(fresh)
    nodes = np.asarray(tree.nodes)
    for level in range(tree.tree_depth):
        children = nodes[2 ** (level + 1) - 1 : 2 ** (level + 2) - 1]
        np.testing.assert_array_equal(
            nodes[2**level - 1 : 2 ** (level + 1) - 1], children[0::2] + children[1::2]
        )
    s = buffer.sample(state, jax.random.PRNGKey(0))
    assert bool(jnp.all(s.probabilities > 0))
    state = buffer.set_priorities(state, s, jnp.ones(4))
    if stale:  # the loaded generations check the sample drawn from the loaded state
        assert int(state.generations.dropped) == 0


def test_an_older_vmapped_tree_converts_member_by_member():
    """A population of states saved then (leading axis on every leaf) converts each member."""
    from functional_rb.samplers import sum_tree as wide

    values = jnp.asarray(np.random.default_rng(0).random((3, 10)), jnp.float32)
    trees = jax.vmap(lambda v: wide.set(wide.init(10), jnp.arange(10), v))(values)
    state = sum_tree.SumTreeState.from_saved(tree=trees, max_recorded_priority=jnp.ones(3))
    assert state.nodes.shape == (3, 31) and state.tree_depth == 4 and state.capacity == 10
    for member in range(3):
        one = jax.tree_util.tree_map(lambda x, member=member: x[member], state)
        np.testing.assert_array_equal(
            np.asarray(sum_tree.get_batch(one, jnp.arange(10))), np.asarray(values[member])
        )
