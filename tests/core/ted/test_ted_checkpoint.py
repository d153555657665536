"""TED checkpoints of the older state layouts load into today's.

``fixtures/ted_layout_v1`` was written by ``fixtures/make_ted_layout.py v1`` with the code of
commit 9f7bbf2, whose ``TEDStorageState`` kept each row's pending next observation inside the
frame tables; today it is ``state.storage.pending``
(``functional_rb.checkpoint.legacy.split_ted_pending`` converts). ``fixtures/ted_layout_v2``
was written by ``make_ted_layout.py v2`` at 6e4fc1f, whose state kept the side pointers,
distances, counters, carries and small leaves in arrays of their own; today the per-step ones
share ``state.storage.rows`` (``TEDStorageState.from_saved`` converts; v1 files go through
both). The loaded state must equal the same recipe run now, leaf for leaf, and read back what
the old code read back.
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb.testing import assert_invariants

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
LAYOUTS = ("ted_layout_v1", "ted_layout_v2")
sys.path.insert(0, str(FIXTURES))
import ted_recipes as recipes  # noqa: E402


def _assert_same(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (p, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))


@functools.cache
def _recipe(name):
    return recipes.RECIPES[name]()


def _get_all(rb, name, state):
    get = rb.get if name != "vmapped" else jax.vmap(rb.get, in_axes=(0, None))
    return get(state, jnp.arange(rb.capacity, dtype=jnp.int32))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_old_layout_loads_as_todays_state(name, layout):
    old = FIXTURES / layout
    leaves = json.loads((old / name / "frb_manifest.json").read_text())["meta"]["leaves"]
    paths = " ".join(x["path"] for x in leaves)
    assert ("pending" in paths) == (layout != "ted_layout_v1")  # the fixture is that layout
    assert "ptr" in paths and "rows" not in paths
    rb, want = _recipe(name)
    old_get = np.load(old / "get.npz")
    for like in (None, want):
        got = frb.checkpoint.load(old / name, like=like)
        _assert_same(got, want)
    items = _get_all(rb, name, got)
    for path, x in jax.tree_util.tree_flatten_with_path(items)[0]:
        np.testing.assert_array_equal(np.asarray(x), old_get[name + jax.tree_util.keystr(path)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_converted_state_goes_on_like_a_new_one(layout):
    """After the load, jitted donated adds (episode ends, the ring wrapping) give what the
    same adds give the state built now, and the invariants hold."""
    rb, want = _recipe("stacked_envs")
    got = frb.checkpoint.load(FIXTURES / layout / "stacked_envs", like=want)
    want = jax.tree_util.tree_map(jnp.copy, want)  # the cached recipe is not donated
    stream = recipes._stream(np.random.default_rng(7), 2, 12)
    add = jax.jit(rb.add, donate_argnums=0)
    for a in (0, 6):
        part = jax.tree_util.tree_map(lambda x, a=a: jnp.asarray(x[:, a : a + 6]), stream)
        got, want = add(got, part), add(want, part)
    _assert_same(got, want)
    assert_invariants(rb, got)


def test_a_state_of_the_old_layout_is_refused_by_the_buffer():
    rb = frb.ReplayBuffer(capacity=4, storage=frb.TEDStorage())
    item = {"observation": jnp.zeros(2), "next": {"observation": jnp.zeros(2)}}
    state = rb.init(item)
    old = dataclasses.replace(state, storage=dataclasses.replace(state.storage, pending=None))
    with pytest.raises(ValueError, match=r"pending is None.*checkpoint\.load"):
        rb.size(old)
