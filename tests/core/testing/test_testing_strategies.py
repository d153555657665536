"""functional_rb.testing.strategies: items, episodes, buffer configurations and operation
programs; and the ImportError that says how to install hypothesis when it is missing."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.testing import strategies as frb_st

FEW = settings(max_examples=min(5, settings().max_examples), deadline=None)


def test_without_hypothesis_the_error_says_how_to_install_it():
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"  # import hypothesis now fails
        "import functional_rb.testing as t\n"
        "t.assert_invariants, t.check_sampler, t.assert_distribution\n"  # need no hypothesis
        "for name in ('strategies', 'ReplayBufferMachine'):\n"
        "    try:\n"
        "        getattr(t, name)\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all('pip install -c constraints.txt ".[test]"' in x for x in lines)


@FEW
@given(spec=frb_st.item_specs(), data=st.data())
def test_items_follow_their_spec_and_round_trip_through_a_buffer(spec, data):
    batch = data.draw(frb_st.items(spec, batch_shape=(3,)))
    for s, x in zip(jax.tree_util.tree_leaves(spec), jax.tree_util.tree_leaves(batch)):
        assert x.shape == (3,) + tuple(s.shape) and x.dtype == s.dtype
    assert jax.tree_util.tree_structure(batch) == jax.tree_util.tree_structure(spec)
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    state = rb.add(rb.init(jax.tree_util.tree_map(lambda x: x[0], batch)), batch)
    got = rb.get(state, jnp.arange(3, dtype=jnp.int32))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(batch)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@settings(max_examples=min(20, settings().max_examples), deadline=None)
@given(data=st.data(), ndim=st.sampled_from([1, 2]))
def test_episodes_are_consistent_ted_streams(data, ndim):
    ep = data.draw(frb_st.episodes(ndim=ndim, num_envs=3))
    rows = ep if ndim == 2 else jax.tree_util.tree_map(lambda x: x[None], ep)
    lead = rows["observation"].shape[:2]
    assert lead[0] == (3 if ndim == 2 else 1)
    ex = frb_st.episode_example(2, lead[0])
    for (p, x), (_, e) in zip(
        jax.tree_util.tree_flatten_with_path(rows)[0], jax.tree_util.tree_flatten_with_path(ex)[0]
    ):
        assert x.shape == lead + e.shape[1:] and x.dtype == e.dtype, p
    done = rows["next"]["done"][..., 0]
    ids = rows["collector"]["traj_ids"]
    assert not rows["done"].any()
    assert np.array_equal(
        done, rows["next"]["terminated"][..., 0] | rows["next"]["truncated"][..., 0]
    )
    # within an episode the next observation is the following step's observation, and the
    # trajectory id changes exactly after an end
    same = ~done[:, :-1]
    assert np.array_equal(ids[:, 1:] != ids[:, :-1], done[:, :-1])
    assert np.all((rows["next"]["observation"][:, :-1] == rows["observation"][:, 1:]).all(-1)[same])
    per_env = [set(r.tolist()) for r in ids]  # ids are unique across envs too
    assert all(not a & b for i, a in enumerate(per_env) for b in per_env[i + 1 :])


def _run_program(rb, data, jit):
    ops = data.draw(frb_st.operations(rb, max_size=8))
    row = rb.capacity // (2 if rb.ndim == 2 else 1)
    for op in ops:
        if isinstance(op, frb_st.Add):
            steps = jax.tree_util.tree_leaves(op.items)[0].shape[rb.ndim - 1]
            assert steps in {1, max(row - 1, 1), row, row + 1, 2 * row + 1}
    # assert_invariants after every operation, eagerly or under jit
    state = frb_st.run_operations(rb, ops, jit=jit)
    assert int(rb.size(state)) <= rb.capacity


# each example is a new configuration, so new compilations: CI runs three, FRB_SLOW=1 forty
@settings(max_examples=min(3, settings().max_examples), deadline=None)
@given(rb=frb_st.buffers(), data=st.data(), jit=st.booleans())
def test_buffers_run_any_program_and_keep_their_invariants(rb, data, jit):
    _run_program(rb, data, jit)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(rb=frb_st.buffers(), data=st.data(), jit=st.booleans())
def test_buffers_run_any_program_and_keep_their_invariants_long(rb, data, jit):
    _run_program(rb, data, jit)
