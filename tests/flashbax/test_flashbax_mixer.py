"""functional_rb.flashbax.buffers.mixer against flashbax 0.1.3's own mixer.

flashbax's mixer only calls each buffer's ``sample`` and ``can_sample``, so ours is checked
twice: over flashbax's own buffers (where both mixers must return the very same arrays), and
over ours (``functional_rb.flashbax``)."""

import inspect
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb.flashbax as ours
from functional_rb.flashbax.buffers import mixer as our_mixer

fbx = pytest.importorskip("flashbax")
fbx_mixer = pytest.importorskip("flashbax.buffers.mixer")

ADD_BATCH, SEQ, ROWS = 2, 3, 10
STEP = {"obs": jnp.zeros(2), "done": jnp.int32(0)}


def _flashbax_code():
    """flashbax's own buffers broadcast ranks implicitly: the suite's conftest makes that an
    error (jax_numpy_rank_promotion='raise'), so code that runs them allows it."""
    return jax.numpy_rank_promotion("allow")


def _trajectory_buffers(lib, prioritised=(False, False, False)):
    """Three buffers of ``lib`` (flashbax or ours) whose items say their buffer (done == k)."""
    buffers, states = [], []
    for k, prio in enumerate(prioritised):
        make = lib.make_prioritised_trajectory_buffer if prio else lib.make_trajectory_buffer
        b = make(
            add_batch_size=ADD_BATCH,
            sample_batch_size=ROWS,
            sample_sequence_length=SEQ,
            period=1,
            min_length_time_axis=SEQ,
            max_length_time_axis=16,
        )
        data = jax.tree_util.tree_map(
            lambda x, k=k: jnp.full((ADD_BATCH, 6, *x.shape), k, x.dtype), STEP
        )
        buffers.append(b)
        states.append(b.add(b.init(jax.tree_util.tree_map(jnp.zeros_like, STEP)), data))
    return buffers, states


@pytest.fixture(scope="module")
def flashbax_buffers():
    with _flashbax_code():
        return _trajectory_buffers(fbx)


@pytest.fixture
def allow_ranks():
    with _flashbax_code():
        yield


def _assert_same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------ the public names
def test_module_has_flashbaxs_names_and_signatures():
    for name in (
        "Mixer",
        "make_mixer",
        "sample_mixer_fn",
        "can_sample_mixer_fn",
        "_batch_slicer",
        "sample_types",
        "state_types",
        "SampleTypes",
        "StateTypes",
        "BufferTypes",
    ):
        assert hasattr(our_mixer, name), name
    for name in ("make_mixer", "sample_mixer_fn", "can_sample_mixer_fn", "_batch_slicer"):
        theirs = inspect.signature(getattr(fbx_mixer, name)).parameters
        mine = inspect.signature(getattr(our_mixer, name)).parameters
        assert [(p.name, p.default, p.kind) for p in mine.values()] == [
            (p.name, p.default, p.kind) for p in theirs.values()
        ], name
    assert ours.make_mixer is our_mixer.make_mixer and ours.mixer is our_mixer
    assert [t.__name__ for t in our_mixer.sample_types] == [
        t.__name__ for t in fbx_mixer.sample_types
    ]
    assert [t.__name__ for t in our_mixer.state_types] == [
        t.__name__ for t in fbx_mixer.state_types
    ]


# ------------------------------------------------------------------------------ the split
@settings(max_examples=60)
@given(
    st.integers(1, 200),
    st.lists(
        st.sampled_from([0.05, 0.1, 0.2, 0.29, 1 / 3, 0.5, 0.6, 0.71, 1, 2, 3, 7]),
        min_size=1,
        max_size=5,
    ),
)
def test_split_is_flashbaxs_including_its_float_error(batch_size, props):
    buffers = [fbx_mixer.Mixer(sample=None, can_sample=None)] * len(props)  # any one type
    theirs = fbx_mixer.make_mixer(buffers, batch_size, props)
    mine = our_mixer.make_mixer(buffers, batch_size, props)
    assert mine.sample.keywords["prop_batch_sizes"] == theirs.sample.keywords["prop_batch_sizes"]


# ------------------------------------------------------------------ over flashbax's buffers
def test_over_flashbaxs_buffers_the_batches_are_flashbaxs(flashbax_buffers, allow_ranks):
    buffers, states = flashbax_buffers
    props = [0.2, 0.2, 0.6]
    theirs = fbx.make_mixer(buffers, sample_batch_size=ROWS, proportions=props)
    mine = our_mixer.make_mixer(buffers, sample_batch_size=ROWS, proportions=props)
    for seed in (0, 1):
        key = jax.random.PRNGKey(seed)
        _assert_same(mine.sample(states, key), theirs.sample(states, key))
    _assert_same(jax.jit(mine.sample)(states, key), theirs.sample(states, key))
    assert bool(mine.can_sample(states)) and bool(jax.jit(mine.can_sample)(states))
    empty = [states[0], buffers[1].init(jax.tree_util.tree_map(jnp.zeros_like, STEP)), states[2]]
    assert bool(mine.can_sample(empty)) == bool(theirs.can_sample(empty)) is False


def test_a_buffer_whose_batch_is_smaller_than_its_share_gives_fewer_rows(
    flashbax_buffers, allow_ranks
):
    """flashbax slices each buffer's own batch: a share above its sample_batch_size is cut."""
    buffers, states = flashbax_buffers
    mine = our_mixer.make_mixer(buffers, sample_batch_size=20, proportions=[1, 1, 2])
    theirs = fbx.make_mixer(buffers, sample_batch_size=20, proportions=[1, 1, 2])
    key = jax.random.PRNGKey(3)
    sample = mine.sample(states, key)
    assert sample.experience["obs"].shape[0] == 5 + 5 + 10 == 20
    mine = our_mixer.make_mixer(buffers, sample_batch_size=40, proportions=[1, 1, 2])
    theirs = fbx.make_mixer(buffers, sample_batch_size=40, proportions=[1, 1, 2])
    sample = mine.sample(states, key)
    assert sample.experience["obs"].shape[0] == 10 + 10 + 10  # not 40
    _assert_same(sample, theirs.sample(states, key))


def test_a_zero_proportion_gives_no_rows(flashbax_buffers, allow_ranks):
    buffers, states = flashbax_buffers
    mine = our_mixer.make_mixer(buffers, sample_batch_size=ROWS, proportions=[0, 1, 1])
    done = np.asarray(mine.sample(states, jax.random.PRNGKey(0)).experience["done"][:, 0])
    assert done.tolist() == [1] * 5 + [2] * 5


# ------------------------------------------------------------------------------ over our buffers
@pytest.mark.parametrize("prioritised", [(False, False, False), (True, True, True)])
def test_over_our_buffers_each_buffer_gives_its_share(prioritised):
    buffers, states = _trajectory_buffers(ours, prioritised)
    props = [0.4, 0.1, 0.5]
    mixer = ours.make_mixer(buffers=buffers, proportions=props, sample_batch_size=ROWS)
    mixer = mixer.replace(sample=jax.jit(mixer.sample))  # a frozen record of functions
    assert bool(mixer.can_sample(states))
    sample = mixer.sample(states, jax.random.PRNGKey(0))
    assert type(sample) is type(buffers[0].sample(states[0], jax.random.PRNGKey(0)))
    done = np.asarray(sample.experience["done"])
    assert done.shape == (ROWS, SEQ)
    assert done[:, 0].tolist() == [0] * 4 + [1] + [2] * 5
    if prioritised[0]:
        # each buffer's own probabilities (not the mixture's): uniform within each buffer here
        probs = np.asarray(sample.probabilities)
        own = [
            np.asarray(b.sample(s, jax.random.PRNGKey(1)).probabilities)[0]
            for b, s in zip(buffers, states)
        ]
        np.testing.assert_allclose(probs, np.repeat(own, [4, 1, 5]), rtol=1e-6)


def test_over_our_flat_buffers():
    buffers, states = [], []
    for k in range(2):
        b = ours.make_flat_buffer(
            max_length=32,
            min_length=2,
            sample_batch_size=8,
            add_batch_size=ADD_BATCH,
            add_sequences=True,
        )
        data = jax.tree_util.tree_map(
            lambda x, k=k: jnp.full((ADD_BATCH, 5, *x.shape), k, x.dtype), STEP
        )
        buffers.append(b)
        states.append(b.add(b.init(jax.tree_util.tree_map(jnp.zeros_like, STEP)), data))
    mixer = ours.make_mixer(buffers, sample_batch_size=8, proportions=[3, 1])
    sample = mixer.sample(states, jax.random.PRNGKey(0))
    assert np.asarray(sample.experience.first["done"]).tolist() == [0] * 6 + [1] * 2
    assert np.asarray(sample.experience.second["done"]).tolist() == [0] * 6 + [1] * 2


# ------------------------------------------------------------------------------ errors
def test_make_mixer_asserts_as_flashbax_does(flashbax_buffers, allow_ranks):
    traj, traj_states = flashbax_buffers
    prio, prio_states = _trajectory_buffers(fbx, (True, False, False))
    for lib in (fbx_mixer, our_mixer):
        with pytest.raises(AssertionError):
            lib.make_mixer(traj[:2], 4, [1])
        with pytest.raises(AssertionError):
            lib.make_mixer(traj[:1], 0, [1])
        # a prioritised buffer may follow a plain one (its base class), not precede it...
        mixed = lib.make_mixer([traj[0], prio[0]], 4, [1, 1])
        with pytest.raises(AssertionError):
            lib.make_mixer([prio[0], traj[0]], 4, [1, 1])
        # ... but their samples differ in structure, so the mixer cannot sample them
        with pytest.raises(ValueError, match="structure"):
            mixed.sample([traj_states[0], prio_states[0]], jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="Number of buffers and proportions must match: 2"):
        our_mixer.make_mixer(traj[:2], 4, [1])
    with pytest.raises(ValueError, match=r"buffers\[1\] is a TrajectoryBuffer, not an inst"):
        our_mixer.make_mixer([prio[0], traj[0]], 4, [1, 1])
    with pytest.raises(ValueError, match=r"proportions\[1\]"):
        our_mixer.make_mixer(traj[:2], 4, [1, -1])


def test_samples_that_do_not_concatenate_name_the_leaf(flashbax_buffers, allow_ranks):
    buffers, states = flashbax_buffers
    longer = fbx.make_trajectory_buffer(
        add_batch_size=ADD_BATCH,
        sample_batch_size=ROWS,
        sample_sequence_length=SEQ + 1,
        period=1,
        min_length_time_axis=SEQ + 1,
        max_length_time_axis=16,
    )
    mixer = our_mixer.make_mixer([buffers[0], longer], ROWS, [1, 1])
    with pytest.raises(ValueError, match=r"\['done'\] of buffer 1's sample has shape \(5, 4\)"):
        mixer.sample([states[0], states[0]], jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="sample_mixer_fn: 1 states but 2 prop_batch_sizes"):
        mixer.sample(states[:1], jax.random.PRNGKey(0))


def test_the_mixer_needs_no_chex():
    """No extra declares chex: functional_rb.flashbax (its mixer included) imports and mixes
    without it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["chex"] = None  # import chex now raises ImportError
        import jax, jax.numpy as jnp
        import functional_rb.flashbax as fbx
        buffers = [fbx.make_flat_buffer(max_length=8, min_length=1, sample_batch_size=2)
                   for _ in range(2)]
        states = [b.init({"x": jnp.zeros(())}) for b in buffers]
        states = [b.add(s, {"x": jnp.float32(i)}) for i, (b, s) in enumerate(zip(buffers, states))]
        mixer = fbx.make_mixer(buffers, sample_batch_size=4, proportions=[1, 1])
        print(mixer.sample(states, jax.random.PRNGKey(0)).experience.first["x"].shape)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(4,)"
