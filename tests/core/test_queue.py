"""The trajectory queue (functional_rb.queue): FIFO order against a Python model, its
invariants under hypothesis (eagerly and under jit), never overwriting unread data, the
errors, and jit / vmap / scan / donation / checkpoints."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb._internal.errors import ArgumentTypeError, ConsumedStateError

LENGTH, ENVS = 6, 2


def example(envs=ENVS):
    return {"obs": jnp.zeros((envs, 3), jnp.float32), "t": jnp.zeros((envs,), jnp.int32)}


def steps(start, count, envs=ENVS):
    """``count`` steps per env with distinct values: env e, step i holds 1000 * e + start + i."""
    t = (1000 * np.arange(envs)[:, None] + start + np.arange(count)[None, :]).astype(np.int32)
    return {
        "obs": jnp.asarray(np.repeat(t[..., None], 3, axis=-1), jnp.float32),
        "t": jnp.asarray(t),
    }


class Model:
    """The queue as a Python reference: one deque of step values per env."""

    def __init__(self, length):
        self.length, self.rows = length, [collections.deque() for _ in range(ENVS)]

    def fits(self, count):
        return len(self.rows[0]) + count <= self.length

    def add(self, start, count):
        for e, row in enumerate(self.rows):
            row.extend(1000 * e + start + i for i in range(count))

    def pop(self, count):
        return np.array([[row.popleft() for _ in range(count)] for row in self.rows])


QUEUES = {
    pack: frb.TrajectoryQueue(
        LENGTH, sample_sequence_length=2, storage=frb.DeviceStorage(pack=pack)
    )
    for pack in (True, False)
}
JITTED = {pack: (jax.jit(q.add), jax.jit(q.sample, static_argnums=1)) for pack, q in QUEUES.items()}

# lengths whose sums reach every offset of the ring (gcd 1), the whole ring among them; few
# distinct lengths keep the compilations few
operations = st.lists(
    st.tuples(st.sampled_from(["add", "sample"]), st.sampled_from([1, 3, 4, 6])),
    min_size=1,
    max_size=14,
)


def assert_invariants(queue, state, model, dropped):
    unread = int(queue.unread(state))
    assert unread == len(model.rows[0])
    assert bool(state.is_full) == (unread == LENGTH)
    assert 0 <= int(state.read_index) < LENGTH and 0 <= int(state.write_index) < LENGTH
    assert (int(state.write_index) - int(state.read_index)) % LENGTH == unread % LENGTH
    assert int(state.dropped_adds) == dropped
    assert state.write_index.dtype == jnp.int32 and state.read_index.dtype == jnp.int32


# the storage layout does not depend on how the call runs: leaves are checked under jit only
@pytest.mark.parametrize(
    "jit,pack",
    [(False, True), (True, True), (True, False)],
    ids=["eager-packed", "jit-packed", "jit-leaves"],
)
@settings(max_examples=15)
@given(ops=operations)
def test_fifo_order_and_invariants_against_a_python_model(ops, jit, pack):
    queue = QUEUES[pack]
    add, sample = JITTED[pack] if jit else (queue.add, queue.sample)
    state, model, dropped, written = queue.init(example()), Model(LENGTH), 0, 0
    for op, count in ops:
        if op == "add":
            items = steps(written, count)
            assert bool(queue.can_add(state, count)) == model.fits(count)
            if model.fits(count):
                state = add(state, items)
                model.add(written, count)
            elif jit:  # dropped whole and counted; nothing written
                before = jax.tree_util.tree_map(np.asarray, state.storage)
                state = add(state, items)
                dropped += 1
                jax.tree_util.tree_map(
                    np.testing.assert_array_equal,
                    before,
                    jax.tree_util.tree_map(np.asarray, state.storage),
                )
            else:
                with pytest.raises(ValueError, match="cannot take"):
                    add(state, items)
            written += count
        else:
            ok = len(model.rows[0]) >= count
            assert bool(queue.can_sample(state, count)) == ok
            if not ok and not jit:
                with pytest.raises(ValueError, match="unread"):
                    sample(state, count)
                continue
            before = int(state.read_index)
            out, state = sample(state, count)
            assert out.data["t"].shape == (ENVS, count)
            assert bool(out.mask.all()) if ok else not bool(out.mask.any())
            np.testing.assert_array_equal(out.weights, np.where(ok, 1.0, 0.0))
            times = (before + np.arange(count)) % LENGTH
            np.testing.assert_array_equal(
                out.indices, np.arange(ENVS)[:, None] * LENGTH + times[None, :]
            )
            if ok:
                want = model.pop(count)
                np.testing.assert_array_equal(out.data["t"], want)
                np.testing.assert_array_equal(out.data["obs"][..., 2], want)
            else:
                assert int(state.read_index) == before
        assert_invariants(queue, state, model, dropped)


def test_add_fills_exactly_then_never_overwrites_unread_data():
    queue = QUEUES[True]
    state = queue.add(queue.init(example()), steps(0, LENGTH))
    assert bool(state.is_full) and int(queue.unread(state)) == LENGTH
    assert not bool(queue.can_add(state, 1)) and bool(queue.can_add(state, 0))
    with pytest.raises(
        ValueError,
        match=r"cannot take 1 time steps: it holds 6 unread of "
        r"max_length_time_axis=6, so 0 are free",
    ):
        queue.add(state, steps(LENGTH, 1))
    # the eager refusal left the state whole; under jit the add is dropped and counted
    state = jax.jit(queue.add, donate_argnums=0)(state, steps(LENGTH, 1))
    assert int(state.dropped_adds) == 1 and bool(state.is_full)
    out, state = queue.sample(state, sequence_length=LENGTH)
    np.testing.assert_array_equal(out.data["t"], steps(0, LENGTH)["t"])
    assert int(queue.unread(state)) == 0 and not bool(state.is_full)


def test_empty_queue_sample_raises_eagerly_and_masks_under_jit():
    queue = QUEUES[True]
    state = queue.init(example())
    assert not bool(queue.can_sample(state))
    with pytest.raises(ValueError, match="2 time steps per env were asked for, but only 0"):
        queue.sample(state)
    out, after = jax.jit(queue.sample, donate_argnums=0)(state)
    assert not bool(out.mask.any()) and float(out.weights.sum()) == 0.0
    assert int(after.read_index) == 0 and not bool(after.is_full)


def test_wraparound_reads_in_order():
    queue = frb.TrajectoryQueue(5, sample_sequence_length=3)
    state = queue.init(example())
    state = queue.add(state, steps(0, 4))
    out, state = queue.sample(state)  # 0 1 2
    state = queue.add(state, steps(4, 3))  # wraps: time slots 4, 0, 1
    assert int(state.write_index) == 2 and not bool(state.is_full)
    out, state = queue.sample(state)  # 3 4 5, from slots 3 4 0
    np.testing.assert_array_equal(out.data["t"][0], [3, 4, 5])
    np.testing.assert_array_equal(out.indices[1], [5 + 3, 5 + 4, 5 + 0])
    state = queue.add(state, steps(7, 4))  # slots 2 3 4 0: full again
    assert bool(state.is_full) and int(queue.unread(state)) == 5
    out, state = queue.sample(state, sequence_length=5)
    np.testing.assert_array_equal(out.data["t"][1], 1000 + np.arange(6, 11))


def test_scan_matches_eager_calls():
    queue = frb.TrajectoryQueue(8, sample_sequence_length=4)

    def step(state, items):
        state = queue.add(state, items)
        out, state = queue.sample(state)
        return state, (out.data["t"], out.mask)

    chunks = [steps(4 * i, 4) for i in range(5)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *chunks)
    state, (seen, mask) = jax.jit(lambda s, x: jax.lax.scan(step, s, x))(
        queue.init(example()), stacked
    )
    assert bool(mask.all())
    np.testing.assert_array_equal(seen, np.stack([c["t"] for c in chunks]))
    assert int(queue.unread(state)) == 0 and int(state.dropped_adds) == 0


def test_scan_with_more_adds_than_reads_drops_and_counts():
    queue = frb.TrajectoryQueue(8, sample_sequence_length=2)

    def step(state, items):
        state = queue.add(state, items)
        out, state = queue.sample(state)
        return state, out.data["t"][0]

    stacked = jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs), *[steps(3 * i, 3) for i in range(8)]
    )
    state, first = jax.lax.scan(step, queue.init(example()), stacked)
    # each step adds 3 and reads 2: the queue fills, then adds are dropped (never overwrite)
    model, dropped = Model(8), 0
    for i in range(8):
        if model.fits(3):
            model.add(3 * i, 3)
        else:
            dropped += 1
        np.testing.assert_array_equal(first[i], model.pop(2)[0])
    assert int(state.dropped_adds) == dropped > 0


def test_vmap_over_a_population_of_queues():
    queue = QUEUES[False]
    population = jax.vmap(queue.init)(
        jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), example())
    )
    items = jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs), *[steps(100 * m, 3) for m in range(3)]
    )
    population = jax.jit(jax.vmap(queue.add))(population, items)
    # index-only calls take the population as is
    np.testing.assert_array_equal(queue.unread(population), [3, 3, 3])
    outs, population = jax.jit(jax.vmap(lambda s: queue.sample(s, 2)))(population)
    for m in range(3):
        np.testing.assert_array_equal(outs.data["t"][m], steps(100 * m, 2)["t"])
    assert queue.can_sample(population, 1).tolist() == [True] * 3


def test_packed_and_leaf_storages_read_the_same():
    outs = []
    for pack in (True, False):
        queue = QUEUES[pack]
        state = queue.add(queue.init(example()), steps(0, 5))
        out, _ = queue.sample(state, sequence_length=5)
        outs.append(out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, outs[0], outs[1])


def test_eager_add_consumes_its_state():
    queue = QUEUES[True]
    state = queue.init(example())
    new = queue.add(state, steps(0, 2))
    with pytest.raises(ConsumedStateError, match="TrajectoryQueue.add"):
        queue.add(state, steps(0, 2))
    out, _ = queue.sample(new)
    np.testing.assert_array_equal(out.data["t"], steps(0, 2)["t"])


def test_checkpoint_round_trip(tmp_path):
    queue = QUEUES[True]
    state = queue.add(queue.init(example()), steps(0, 5))
    _, state = queue.sample(state)
    frb.checkpoint.save(tmp_path / "q", state)
    loaded = frb.checkpoint.load(tmp_path / "q")
    assert isinstance(loaded, frb.QueueState) and loaded.num_envs == ENVS
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, state)
    out, _ = queue.sample(loaded, sequence_length=3)
    np.testing.assert_array_equal(out.data["t"], steps(2, 3)["t"])


def test_x64_keeps_int32_indices():
    queue = frb.TrajectoryQueue(4, sample_sequence_length=2)
    with jax.enable_x64(True):
        state = queue.init({"x": jnp.zeros((1,), jnp.float32)})
        state = jax.jit(queue.add)(state, {"x": jnp.ones((1, 3), jnp.float64)})
        _, state = jax.jit(queue.sample)(state)
    assert state.write_index.dtype == jnp.int32 and state.read_index.dtype == jnp.int32
    assert int(state.read_index) == 2


# ---------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_length_time_axis": 0, "sample_sequence_length": 1}, "max_length_time_axis must be"),
        (
            {"max_length_time_axis": 4, "sample_sequence_length": 5},
            r"sample_sequence_length must be a Python int in \[1, 4\], got 5",
        ),
        ({"max_length_time_axis": 4.0, "sample_sequence_length": 1}, "got 4.0"),
    ],
)
def test_bad_configuration_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        frb.TrajectoryQueue(**kwargs)


def test_a_host_storage_is_refused():
    with pytest.raises(TypeError, match="storage must be a functional_rb.DeviceStorage"):
        frb.TrajectoryQueue(4, 2, storage=frb.RoundRobinWriter())


def test_bad_examples_raise():
    queue = QUEUES[True]
    with pytest.raises(ValueError, match=r"leaf \['t'\] is a scalar"):
        queue.init({"obs": jnp.zeros((2, 3)), "t": jnp.int32(0)})
    with pytest.raises(ValueError, match="shares the leading num_envs axis"):
        queue.init({"obs": jnp.zeros((2, 3)), "t": jnp.zeros((3,))})
    with pytest.raises(ValueError, match="no array leaves"):
        queue.init({})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bad_items_name_the_leaf(jit):
    queue = QUEUES[True]
    add = jax.jit(queue.add) if jit else queue.add
    state = queue.init(example())
    bad = dict(steps(0, 2), obs=jnp.zeros((ENVS, 2, 4)))
    with pytest.raises(
        ValueError,
        match=r"leaf \['obs'\] has shape \(2, 2, 4\), expected "
        r"\[num_envs, T\] \+ \(3,\)",
    ):
        add(state, bad)
    with pytest.raises(
        ValueError,
        match=r"leaf \['obs'\] has 3 envs on axis 0, expected "
        "num_envs=2",
    ):
        add(state, steps(0, 2, envs=3))
    with pytest.raises(ValueError, match="hold 7 time steps .* more than max_length_time_axis=6"):
        add(state, steps(0, 7))
    with pytest.raises(TypeError, match=r"leaf \['t'\] has dtype float32"):
        add(state, dict(steps(0, 2), t=jnp.zeros((ENVS, 2))))


def test_bad_calls_raise():
    queue = QUEUES[True]
    state = queue.init(example())
    with pytest.raises(TypeError, match="must be the QueueState returned by queue.init"):
        queue.add({"obs": 1}, steps(0, 1))
    with pytest.raises(ValueError, match=r"sequence_length must be a Python int in \[1, 6\]"):
        queue.sample(state, sequence_length=7)
    with pytest.raises(ArgumentTypeError, match="static_argnames='num_steps'"):
        jax.jit(queue.can_add)(state, 2)
    other = frb.TrajectoryQueue(4, 2).init(example())
    with pytest.raises(ValueError, match="built by another queue configuration"):
        queue.add(other, steps(0, 1))
