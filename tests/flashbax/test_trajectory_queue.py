"""functional_rb.flashbax.buffers.trajectory_queue against flashbax 0.1.3's own module, side by
side on the same inputs: states, samples, can_add and can_sample agree, flashbax's surprises
(an add that overwrites unread steps, a sample that reads past the write index) included."""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.flashbax.buffers import trajectory_queue as ours

fbq = pytest.importorskip("flashbax.buffers.trajectory_queue")

LENGTH, ENVS = 5, 2
STEP = {"obs": jnp.zeros((3,), jnp.float32), "action": jnp.zeros((), jnp.int32)}


def batch(start, count):
    t = (100 * np.arange(ENVS)[:, None] + start + np.arange(count)[None, :]).astype(np.int32)
    return {
        "obs": jnp.asarray(np.repeat(t[..., None], 3, -1), jnp.float32),
        "action": jnp.asarray(t),
    }


def assert_same(mine, theirs):
    """Same fields, same values (flashbax's indices are int32 too with x64 off)."""
    assert mine.keys() == list(theirs.keys())
    for name in mine:
        jax.tree_util.tree_map(np.testing.assert_array_equal, mine[name], theirs[name])


def test_init_matches():
    mine, theirs = ours.init(STEP, ENVS, LENGTH), fbq.init(STEP, ENVS, LENGTH)
    assert_same(mine, theirs)
    assert jax.tree_util.tree_map(
        lambda x: (x.shape, x.dtype), mine.experience
    ) == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), theirs.experience)
    assert mine.write_index.dtype == theirs.write_index.dtype == jnp.int32


# any add and sample, whether or not it fits: flashbax's add overwrites unread steps when asked
# to and its sample reads past the write index; ours must do the same. Lengths 0 and past the
# ring included; few distinct lengths keep the compilations few.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from([0, 2, 3, 5])),
        st.tuples(st.just("sample"), st.sampled_from([0, 2, 3, 7])),
    ),
    min_size=1,
    max_size=12,
)


def _answers(module):
    """can_add and can_sample for every length 0..LENGTH, in one compiled call."""
    return jax.jit(
        lambda s: jnp.stack(
            [module.can_add(s, k, LENGTH) for k in range(LENGTH + 1)]
            + [module.can_sample(s, k, LENGTH) for k in range(LENGTH + 1)]
        )
    )


_OURS = (jax.jit(ours.add), jax.jit(ours.sample, static_argnums=1), _answers(ours))
_THEIRS = (jax.jit(fbq.add), jax.jit(fbq.sample, static_argnums=1), _answers(fbq))


@settings(max_examples=15)
@given(ops=operations)
def test_side_by_side_with_flashbax(ops):
    mine, theirs, written = ours.init(STEP, ENVS, LENGTH), fbq.init(STEP, ENVS, LENGTH), 0
    for op, count in ops:
        np.testing.assert_array_equal(_OURS[2](mine), _THEIRS[2](theirs))
        if op == "add":
            items = batch(written, count)
            mine, theirs = _OURS[0](mine, items), _THEIRS[0](theirs, items)
            written += count
        else:
            (mine, got), (theirs, want) = _OURS[1](mine, count), _THEIRS[1](theirs, count)
            jax.tree_util.tree_map(np.testing.assert_array_equal, got.experience, want.experience)
        assert_same(mine, theirs)


def test_can_add_and_can_sample_agree_on_every_state():
    # every reachable (read, write, is_full) of a ring of LENGTH, as one batch of indices:
    # both modules' functions are elementwise over them
    rows = [(r, w, False) for r in range(LENGTH) for w in range(LENGTH)]
    rows += [(r, r, True) for r in range(LENGTH)]
    read, write, full = (jnp.asarray(c) for c in zip(*rows))
    mine = ours.TrajectoryQueueState(
        experience=None, write_index=write, read_index=read, is_full=full
    )
    theirs = fbq.TrajectoryQueueState(
        experience=None, write_index=write, read_index=read, is_full=full
    )
    for k in range(LENGTH + 1):
        np.testing.assert_array_equal(
            ours.can_add(mine, k, LENGTH), fbq.can_add(theirs, k, LENGTH), err_msg=f"k={k}"
        )
        np.testing.assert_array_equal(
            ours.can_sample(mine, k, LENGTH), fbq.can_sample(theirs, k, LENGTH), err_msg=f"s={k}"
        )


def test_make_trajectory_queue_matches_in_a_scan():
    kwargs = {
        "max_length_time_axis": 8,
        "add_batch_size": ENVS,
        "add_sequence_length": 4,
        "sample_sequence_length": 2,
    }
    results = []
    for module in (ours, fbq):
        queue = module.make_trajectory_queue(**kwargs)

        def step(state, items, queue=queue):
            ok_add = queue.can_add(state)
            state = queue.add(state, items)
            ok = queue.can_sample(state)
            state, sample = queue.sample(state)
            return state, (sample.experience["action"], ok_add, ok)

        stacked = jax.tree_util.tree_map(
            lambda *xs: jnp.stack(xs), *[batch(4 * i, 4) for i in range(5)]
        )
        results.append(
            jax.jit(lambda s, x, step=step: jax.lax.scan(step, s, x))(queue.init(STEP), stacked)
        )
    assert_same(results[0][0], results[1][0])
    jax.tree_util.tree_map(np.testing.assert_array_equal, results[0][1], results[1][1])


def test_the_queue_is_a_record_of_functions():
    queue = ours.make_trajectory_queue(
        LENGTH, ENVS, add_sequence_length=2, sample_sequence_length=2
    )
    assert queue.keys() == ["init", "add", "sample", "can_sample", "can_add"]
    queue = queue.replace(
        add=jax.jit(queue.add, donate_argnums=0), sample=jax.jit(queue.sample, donate_argnums=0)
    )
    state = queue.add(queue.init(STEP), batch(0, 2))
    state, sample = queue.sample(state)
    np.testing.assert_array_equal(sample.experience["action"], batch(0, 2)["action"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        queue.add = None


def test_states_are_pytrees_with_flashbax_paths():
    state = ours.init(STEP, ENVS, LENGTH)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    theirs = fbq.init(STEP, ENVS, LENGTH)
    assert paths == [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(theirs)[0]
    ]
    assert paths[-3:] == [".is_full", ".read_index", ".write_index"]  # sorted, as chex does
    assert ours.TrajectoryQueueState(**state).keys() == state.keys()
    assert int(state["write_index"]) == 0
    assert int(state.replace(write_index=jnp.int32(3)).write_index) == 3


def test_a_broadcast_state_vmapped_as_stoix_does():
    queue = ours.make_trajectory_queue(LENGTH, ENVS, 3, 2)
    theirs_queue = fbq.make_trajectory_queue(LENGTH, ENVS, 3, 2)
    members = 3
    outs = []
    for q in (queue, theirs_queue):
        state = jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (members,) + x.shape), q.init(STEP)
        )
        items = jax.tree_util.tree_map(
            lambda *xs: jnp.stack(xs), *[batch(10 * m, 3) for m in range(members)]
        )
        state = jax.jit(jax.vmap(q.add))(state, items)
        state, sample = jax.jit(jax.vmap(q.sample))(state)
        outs.append((state, sample, q.can_sample(state)))
    assert_same(outs[0][0], outs[1][0])
    assert_same(outs[0][1], outs[1][1])
    np.testing.assert_array_equal(outs[0][2], outs[1][2])


def test_pmap_over_local_devices():
    n = jax.local_device_count()
    queue = ours.make_trajectory_queue(LENGTH, ENVS, 2, 2)
    per_device = jax.tree_util.tree_map(lambda x: jnp.stack([x + i for i in range(n)]), STEP)
    state = jax.pmap(queue.init)(per_device)
    assert not queue.can_sample(state).any() and queue.can_add(state).all()
    items = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), batch(0, 2))
    state = jax.pmap(queue.add)(state, items)
    state, sample = jax.pmap(queue.sample)(state)
    assert sample.experience["obs"].shape == (n, ENVS, 2, 3)


def test_max_size_warns_and_sets_the_time_axis_as_flashbax():
    for module in (ours, fbq):
        with pytest.warns(UserWarning, match="max_size"):
            queue = module.make_trajectory_queue(100, ENVS, 2, 2, max_size=12)
        assert queue.init(STEP).experience["obs"].shape == (ENVS, 6, 3)
        with pytest.raises(ValueError, match="sample_sequence_length"):
            module.make_trajectory_queue(4, ENVS, 2, sample_sequence_length=5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            module.validate_trajectory_queue_args(4, ENVS, 4, None)


def test_checkpoint_round_trip(tmp_path):
    state = ours.add(ours.init(STEP, ENVS, LENGTH), batch(0, 3))
    frb.checkpoint.save(tmp_path / "q", state)
    loaded = frb.checkpoint.load(tmp_path / "q")
    assert isinstance(loaded, ours.TrajectoryQueueState)
    assert_same(loaded, state)


def test_bad_batches_raise_naming_the_leaf():
    state = ours.init(STEP, ENVS, LENGTH)
    with pytest.raises(ValueError, match=r"leaf \['obs'\] has shape \(2, 2, 4\)"):
        ours.add(state, dict(batch(0, 2), obs=jnp.zeros((ENVS, 2, 4))))
    with pytest.raises(ValueError, match="6 time steps .* more than max_length_time_axis=5"):
        ours.add(state, batch(0, 6))
    with pytest.raises(TypeError, match="must be a TrajectoryQueueState"):
        ours.add(fbq.init(STEP, ENVS, LENGTH), batch(0, 2))
    with pytest.raises(
        ValueError,
        match=r"experience\['b'\] has shape \(3, 5, 1\), expected "
        r"\[add_batch_size, max_length_time_axis, ...\] \(the prefix \(2, 5\)",
    ):
        ours.sample(
            state.replace(experience={"a": jnp.zeros((2, 5)), "b": jnp.zeros((3, 5, 1))}), 1
        )


@pytest.mark.parametrize(
    "name",
    [
        "init",
        "can_add",
        "add",
        "sample",
        "can_sample",
        "validate_trajectory_queue_args",
        "make_trajectory_queue",
    ],
)
def test_signatures_match_flashbax(name):
    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(getattr(ours, name)) == params(getattr(fbq, name))
    assert [f.name for f in dataclasses.fields(ours.TrajectoryQueue)] == [
        f.name for f in dataclasses.fields(fbq.TrajectoryQueue)
    ]
