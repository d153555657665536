"""Every builder of functional_rb.flashbax, over a grid of arguments (good and bad), does what
flashbax 0.1.3's does: the same warnings (text, category, and the flashbax module they are
attributed to), the same printed notice, the same exception type, and states of the same
capacities."""

import io
import warnings
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb.flashbax as ours

fbx = pytest.importorskip("flashbax")

ITEM = {"obs": jnp.zeros((2,), jnp.float32)}


def outcome(make, kwargs):
    """What building (and initialising) gives: ``(error type or None, warnings as (category,
    message, module), printed text, {leaf path: shape})``."""
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as seen, redirect_stdout(out):
        warnings.simplefilter("always")
        try:
            with jax.numpy_rank_promotion("allow"):
                state = make(**kwargs).init(ITEM)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return type(e), None, out.getvalue(), None
    caught = [
        (w.category, str(w.message), w.filename.rsplit("/", 1)[-1].removesuffix(".py"))
        for w in seen
        if "flashbax" in w.filename
    ]
    shapes = {
        jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    return None, caught, out.getvalue(), shapes


def same_as_flashbax(name, kwargs):
    theirs = outcome(getattr(fbx, name), kwargs)
    mine = outcome(getattr(ours, name), kwargs)
    if mine[0] is None or theirs[0] is None:
        assert mine[0] is theirs[0], (kwargs, mine[0], theirs[0])
    else:  # the same type, or a subclass (FlashbaxArgumentError is an AssertionError too)
        assert issubclass(mine[0], theirs[0]), (kwargs, mine[0], theirs[0])
    assert mine[1:] == theirs[1:], kwargs


sizes = st.integers(1, 40)


@settings(max_examples=60, deadline=None)
@given(
    prioritised=st.booleans(),
    add_batch_size=st.integers(1, 4),
    sample_sequence_length=sizes,
    period=st.integers(1, 12),
    min_length_time_axis=sizes,
    max_length_time_axis=st.one_of(st.none(), sizes),
    max_size=st.one_of(st.none(), st.integers(1, 120)),
    device=st.sampled_from(["cpu", "gpu", "abc"]),
)
def test_trajectory_builders(prioritised, device, **kwargs):
    name = "make_trajectory_buffer"
    kwargs["sample_batch_size"] = 3
    if prioritised:
        name = "make_prioritised_trajectory_buffer"
        kwargs["device"] = device
    same_as_flashbax(name, kwargs)


@settings(max_examples=40, deadline=None)
@given(
    prioritised=st.booleans(),
    max_length=st.integers(1, 80),
    min_length=st.integers(0, 40),
    sample_batch_size=st.integers(1, 8),
    add_batch_size=st.one_of(st.none(), st.integers(1, 5)),
    add_sequences=st.booleans(),
)
def test_flat_builders(prioritised, **kwargs):
    name = "make_prioritised_flat_buffer" if prioritised else "make_flat_buffer"
    same_as_flashbax(name, kwargs)


@settings(max_examples=30, deadline=None)
@given(
    prioritised=st.booleans(),
    max_length=st.integers(1, 80),
    min_length=st.integers(0, 40),
    sample_batch_size=st.integers(1, 8),
    add_batches=st.booleans(),
    add_sequences=st.booleans(),
)
def test_item_builders(prioritised, **kwargs):
    name = "make_prioritised_item_buffer" if prioritised else "make_item_buffer"
    same_as_flashbax(name, kwargs)


@settings(max_examples=30, deadline=None)
@given(
    max_length_time_axis=sizes,
    add_batch_size=st.integers(1, 4),
    add_sequence_length=sizes,
    sample_sequence_length=sizes,
    max_size=st.one_of(st.none(), st.integers(1, 120)),
)
def test_queue_builder(**kwargs):
    same_as_flashbax("make_trajectory_queue", kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(priority_exponent=-0.1),
        dict(priority_exponent=1.5),
        dict(max_size=24, max_length_time_axis=12),
    ],
)
def test_bad_prioritised_arguments(kwargs):
    base = dict(
        add_batch_size=2,
        sample_batch_size=3,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=12,
    )
    same_as_flashbax("make_prioritised_trajectory_buffer", {**base, **kwargs})


@pytest.mark.parametrize("module", [fbx, ours], ids=["flashbax", "ours"])
def test_flashbax_module_filters_match_our_warnings(module):
    """flashbax's own test settings: every warning an error, but its period warning ignored by
    message, category and module ``flashbax``. Ours are attributed to the same module."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore",
            "Setting period greater than sample_sequence_length will result in no overlap "
            "betweentrajectories",
            UserWarning,
            "flashbax",
        )
        with jax.numpy_rank_promotion("allow"):
            module.make_trajectory_buffer(
                add_batch_size=1,
                sample_batch_size=2,
                sample_sequence_length=2,
                period=3,
                min_length_time_axis=2,
                max_length_time_axis=12,
            )
        warnings.filterwarnings("ignore", category=UserWarning, module="flashbax")
        module.make_trajectory_buffer(
            add_batch_size=1,
            sample_batch_size=2,
            sample_sequence_length=3,
            period=1,
            min_length_time_axis=2,
            max_size=12,
        )
