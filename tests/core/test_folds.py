"""The reductions written as folds (``functional_rb._internal.folds``): the same values as
``jnp``'s, with and without ``jit``, and no reducer computation in what they compile to; the
slice samplers' programs keep none either (each reducer's scalars are buffers that XLA:CPU's
runtime wraps at every call: NOTES, "Buffers the runtime wraps at every call")."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import functional_rb as frb
from functional_rb._internal import folds

# a few shapes (odd, even, empty, one), so that the jitted folds compile once per shape
SHAPES = st.sampled_from([(1,), (7,), (8,), (0, 3), (3, 5), (2, 1, 6), (4, 3, 9)])
REDUCERS = re.compile(r"stablehlo\.(reduce|reduce_window)\b")
JITTED = {}


def _both(f, *args, static=()):
    """``f(*args, *static)`` op by op (the function under the library's ``jax.jit``) and
    jitted (one compiled function per ``f``)."""
    eager = getattr(f, "__wrapped__", f)
    jitted = JITTED.setdefault(
        f, jax.jit(f, static_argnums=tuple(range(len(args), len(args) + len(static))))
    )
    with jax.disable_jit():
        plain = eager(*args, *static)
    return plain, jitted(*args, *static)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.bool_, SHAPES), st.data())
def test_any_all_sum_match_jnp(x, data):
    axis = data.draw(st.one_of(st.none(), st.integers(0, x.ndim - 1)))
    for ours, theirs in (
        (folds.any_, np.any(x, axis=axis)),
        (folds.all_, np.all(x, axis=axis)),
        (folds.sum_, np.sum(x, axis=axis, dtype=np.int32)),
    ):
        for got in _both(ours, x, static=(axis,)):
            np.testing.assert_array_equal(np.asarray(got), theirs)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.bool_, SHAPES), st.data())
def test_first_true_is_argmax_and_any(mask, data):
    axis = data.draw(st.integers(0, mask.ndim - 1))
    if mask.shape[axis] == 0:
        return
    for index, found in _both(folds.first_true, mask, static=(axis,)):
        np.testing.assert_array_equal(np.asarray(index), np.argmax(mask, axis=axis))
        np.testing.assert_array_equal(np.asarray(found), np.any(mask, axis=axis))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.int32, SHAPES, elements=st.integers(-1000, 1000)), st.data())
def test_cumsum_matches_numpy(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1))
    for got in _both(folds.cumsum, x, static=(axis,)):
        np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=axis))


@settings(max_examples=20, deadline=None)
@given(
    hnp.arrays(np.bool_, st.sampled_from([1, 5, 127, 128, 129, 700])),
    st.integers(0, 800),
    st.sampled_from([1, 3, 128]),
)
def test_nth_true_is_a_search_of_the_running_count(mask, r, width):
    want = min(int(np.searchsorted(np.cumsum(mask), r, side="right")), mask.shape[0] - 1)
    for got in _both(folds.nth_true, mask, jnp.int32(r), static=(width,)):
        assert int(got) == want


@settings(max_examples=20, deadline=None)
@given(hnp.arrays(np.int32, st.sampled_from([1, 4, 9]), elements=st.integers(0, 5)), st.data())
def test_bucket_of_finds_the_bucket_holding_an_item(counts, data):
    r = data.draw(st.integers(0, int(counts.sum()) + 3))
    before = np.cumsum(counts)
    i = min(int(np.searchsorted(before, r, side="right")), counts.shape[0] - 1)
    for got in _both(folds.bucket_of, counts, jnp.int32(r)):
        assert [int(v) for v in got] == [i, r - (before[i] - counts[i])]


def test_large_inputs_reduce_as_jnp_does():
    x = jnp.arange(folds.FOLD_MAX + 3) % 7 == 0
    assert int(folds.sum_(x)) == int(np.sum(np.asarray(x)))
    assert bool(folds.any_(x)) and not bool(folds.all_(x))


@pytest.mark.parametrize(
    "f",
    [folds.any_, folds.all_, folds.sum_, lambda x: folds.first_true(x)[0], folds.cumsum],
    ids=["any", "all", "sum", "first_true", "cumsum"],
)
def test_folds_compile_to_no_reducer(f):
    text = jax.jit(f).lower(jnp.zeros((4, 37), bool)).as_text()
    assert not REDUCERS.search(text), text


@pytest.mark.parametrize(
    "sampler",
    [frb.SliceSampler(slice_len=8), frb.EpisodeSampler(slice_len=8)],
    ids=lambda s: type(s).__name__,
)
def test_slice_sample_program_holds_no_reducer(sampler):
    """The draw, its exact fallback and the storage's read of a slice sample: no reduce."""
    rb = frb.ReplayBuffer(capacity=1000, sampler=sampler, batch_size=32)
    state = rb.init({"obs": jnp.zeros((2,), jnp.uint8), "next": {"done": jnp.bool_(False)}})
    done = (np.arange(200) % 20) == 19
    state = rb.add(state, {"obs": np.zeros((200, 2), np.uint8), "next": {"done": done}})
    text = jax.jit(rb.sample).lower(state, jax.random.key(0)).as_text()
    found = REDUCERS.findall(text)
    assert not found, f"{len(found)} reduce ops in the sample's program"
