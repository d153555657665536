"""Errors name the function, the leaf path, what was expected and what was received."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb

EX = {"obs": jnp.zeros((3,), jnp.float32), "info": {"step": jnp.int32(0)}}


def items(b=2, obs_shape=(3,), obs_dtype=np.float32, step_dtype=np.int32):
    return {
        "obs": np.zeros((b,) + obs_shape, obs_dtype),
        "info": {"step": np.zeros((b,), step_dtype)},
    }


# The buffers are shared by a module's tests (their compiled calls are cached per buffer);
# each test gets a fresh state, since an eager call consumes the state it is given.
@pytest.fixture(scope="module")
def _rb():
    return frb.ReplayBuffer(capacity=4, batch_size=2)


@pytest.fixture
def rb_state(_rb):
    return _rb, _rb.init(EX)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_tree_structure_names_missing_and_unexpected_leaves(rb_state, jit):
    rb, state = rb_state
    add = jax.jit(rb.add) if jit else rb.add
    bad = {"obs": np.zeros((2, 3), np.float32), "info": {"stp": np.zeros(2, np.int32)}}
    with pytest.raises(ValueError) as e:
        add(state, bad)
    msg = str(e.value)
    assert "ReplayBuffer.add" in msg and "['info']['step']" in msg and "['info']['stp']" in msg


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_trailing_shape_names_leaf_expected_and_received(rb_state, jit):
    rb, state = rb_state
    add = jax.jit(rb.add) if jit else rb.add
    with pytest.raises(ValueError) as e:
        add(state, items(obs_shape=(4,)))
    msg = str(e.value)
    assert "['obs']" in msg and "(2, 4)" in msg and "(3,)" in msg
    with pytest.raises(ValueError, match=r"single item needs \[None\]"):
        add(state, {"obs": np.zeros((3,), np.float32), "info": {"step": np.int32(0)}})


def test_batch_axes_must_agree(rb_state):
    rb, state = rb_state
    bad = {"obs": np.zeros((2, 3), np.float32), "info": {"step": np.zeros(3, np.int32)}}
    with pytest.raises(ValueError, match="disagree on the batch shape") as e:
        rb.add(state, bad)
    assert "['obs'] has (2,)" in str(e.value) and "['info']['step'] has (3,)" in str(e.value)


def test_unsafe_cast_float_to_int_raises_and_safe_cast_is_fine(rb_state):
    rb, state = rb_state
    with pytest.raises(TypeError) as e:
        rb.add(state, items(step_dtype=np.float32))
    msg = str(e.value)
    assert "['info']['step']" in msg and "float32" in msg and "int32" in msg
    new = rb.add(state, items(obs_dtype=np.float64))  # same kind: float64 -> float32 is fine
    assert rb.get(new, jnp.arange(2))["obs"].dtype == jnp.float32
    assert int(rb.size(new)) == 2


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match=f"capacity must be a Python int >= 1, got {capacity}"):
        frb.ReplayBuffer(capacity=capacity)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_batch_size_must_be_positive_int(bad, rb_state):
    err = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(err, match="batch_size"):
        frb.ReplayBuffer(capacity=4, batch_size=bad)
    rb, state = rb_state
    state = rb.add(state, items())
    with pytest.raises(err, match="batch_size"):
        rb.sample(state, jax.random.key(0), batch_size=bad)


def test_traced_batch_size_explains_static_argnames(rb_state):
    rb, state = rb_state
    state = rb.add(state, items())
    with pytest.raises(TypeError, match="static_argnames"):
        jax.jit(rb.sample)(state, jax.random.key(0), 3)


def test_ndim_must_be_1_or_2():
    with pytest.raises(ValueError, match="ndim must be 1 or 2, got 3"):
        frb.ReplayBuffer(capacity=4, ndim=3)


def test_ndim2_items_must_be_env_by_time():
    rb = frb.ReplayBuffer(capacity=8, ndim=2)
    state = rb.init({"obs": jnp.zeros((2, 3))})
    with pytest.raises(ValueError) as e:  # ndim=1-style items [B, ...]
        rb.add(state, {"obs": np.zeros((5, 3), np.float32)})
    assert "['obs']" in str(e.value) and "[num_envs, T]" in str(e.value)
    with pytest.raises(ValueError) as e:  # wrong number of envs
        rb.add(state, {"obs": np.zeros((3, 5, 3), np.float32)})
    assert "num_envs=2" in str(e.value) and "3 envs" in str(e.value)


def test_ndim2_capacity_must_be_a_multiple_of_num_envs():
    rb = frb.ReplayBuffer(capacity=10, ndim=2)
    with pytest.raises(ValueError, match=r"capacity \(10\) must be a multiple of num_envs \(3"):
        rb.init({"obs": jnp.zeros((3, 2))})


def test_ndim2_example_leaves_need_the_env_axis():
    rb = frb.ReplayBuffer(capacity=8, ndim=2)
    with pytest.raises(ValueError, match=r"\['r'\] is a scalar"):
        rb.init({"obs": jnp.zeros((2, 3)), "r": jnp.float32(0)})


def test_without_replacement_drop_last_batch_larger_than_capacity():
    sampler = frb.SamplerWithoutReplacement(drop_last=True)
    with pytest.raises(ValueError, match="batch_size=8 exceeds capacity=4"):
        frb.ReplayBuffer(capacity=4, batch_size=8, sampler=sampler)
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, sampler=sampler)
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(4, dtype=np.int32)})
    with pytest.raises(ValueError, match="batch_size=8 exceeds capacity=4"):
        rb.sample(state, jax.random.key(0), batch_size=8)
    # without drop_last a large batch is refused eagerly and padded with mask False under jit
    rb2 = frb.ReplayBuffer(capacity=4, batch_size=8, sampler=frb.SamplerWithoutReplacement())
    st2 = rb2.add(rb2.init({"v": jnp.int32(0)}), {"v": np.arange(3, dtype=np.int32)})
    with pytest.raises(ValueError, match="only 3 items are stored"):
        rb2.sample(st2, jax.random.key(0))
    s, _ = jax.jit(rb2.sample)(st2, jax.random.key(0))
    assert int(s.mask.sum()) == 3


def test_components_must_be_components_and_hashable():
    with pytest.raises(TypeError, match="sampler=.*is not a sampler"):
        frb.ReplayBuffer(capacity=4, sampler=object())
    with pytest.raises(ValueError, match="reduction must be one of"):
        frb.MaxValueWriter("r", reduction="median")


def test_max_value_writer_missing_rank_key_raises_at_init(tmp_path):
    ex = {"obs": jnp.zeros(2), "info": {"step": jnp.int32(0)}}
    rb = frb.ReplayBuffer(capacity=4, writer=frb.MaxValueWriter(("info", "score")))
    with pytest.raises(
        KeyError,
        match=r"MaxValueWriter.init: key \('info', 'score'\) is not in "
        r"the stored items.*\['info'\]\['step'\]",
    ):
        rb.init(ex)
    with pytest.raises(KeyError, match="MaxValueWriter.init"):  # init_from_data builds via init
        rb.init_from_data(
            {"obs": np.zeros((2, 2), np.float32), "info": {"step": np.zeros(2, np.int32)}}
        )
    with pytest.raises(ValueError, match=r"rank_key=\('info',\) is a sub-tree.*\['step'\]"):
        frb.ReplayBuffer(capacity=4, writer=frb.MaxValueWriter("info")).init(ex)
    # checked before the storage creates anything on disk
    path = tmp_path / "mv"
    rb_m = frb.ReplayBuffer(
        capacity=4, writer=frb.MaxValueWriter("score"), storage=frb.MemmapStorage(str(path))
    )
    with pytest.raises(KeyError, match="MaxValueWriter.init"):
        rb_m.init(ex)
    assert not path.exists()
    # a present rank key is fine
    state = frb.ReplayBuffer(capacity=4, writer=frb.MaxValueWriter(("info", "step"))).init(ex)
    assert int(state.writer.filled) == 0


def test_not_a_state():
    rb = frb.ReplayBuffer(capacity=4)
    with pytest.raises(TypeError, match="BufferState"):
        rb.add({"obs": 1}, {"obs": np.zeros(1)})
    with pytest.raises(TypeError, match="BufferState"):
        rb.sample({"obs": 1}, jax.random.key(0))


# ----------------------------------------------------------------- a state of another buffer
TED_EX = {
    "obs": jnp.zeros((2,), jnp.float32),
    "r": jnp.float32(0),
    "next": {"obs": jnp.zeros((2,), jnp.float32), "done": jnp.zeros((1,), bool)},
}


def ted_items(b, start=0):
    v = np.arange(start, start + b, dtype=np.float32)
    return {
        "obs": np.stack([v, v], 1),
        "r": v,
        "next": {"obs": np.stack([v + 1, v + 1], 1), "done": np.zeros((b, 1), bool)},
    }


def storage_of(name, path):
    return {
        "packed": frb.DeviceStorage(),
        "unpacked": frb.DeviceStorage(pack=False),
        "ted": frb.TEDStorage(),
        "memmap": frb.MemmapStorage(str(path)),
    }[name]


ENTRY_POINTS = {
    "add": lambda rb, jit, st: (jax.jit(rb.add) if jit else rb.add)(st, ted_items(2)),
    "sample": lambda rb, jit, st: (jax.jit(rb.sample) if jit else rb.sample)(st, jax.random.key(0)),
    "update": lambda rb, jit, st: (jax.jit(rb.update) if jit else rb.update)(
        st, jnp.zeros((2,), jnp.int32), jnp.ones((2,))
    ),
    "size": lambda rb, jit, st: (jax.jit(rb.size) if jit else rb.size)(st),
    "can_sample": lambda rb, jit, st: (jax.jit(rb.can_sample) if jit else rb.can_sample)(st),
    "get": lambda rb, jit, st: (jax.jit(rb.get) if jit else rb.get)(st, jnp.arange(2)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("storage", ["packed", "unpacked", "ted", "memmap"])
def test_state_of_a_buffer_with_another_capacity_is_refused(tmp_path, storage, jit):
    small = frb.ReplayBuffer(capacity=4, batch_size=2, storage=storage_of(storage, tmp_path / "4"))
    rb = frb.ReplayBuffer(capacity=8, batch_size=2, storage=storage_of(storage, tmp_path / "8"))
    foreign = small.add(small.init(TED_EX), ted_items(3))
    for fn, call in ENTRY_POINTS.items():
        with pytest.raises(ValueError) as e:
            call(rb, jit, foreign)
        msg = str(e.value)
        assert f"ReplayBuffer.{fn}: state.storage" in msg, msg
        assert "capacity=8" in msg and ("(4," in msg or "is 4" in msg), msg
        assert f"jax.vmap(rb.{fn})" in msg
    # the buffer's own state passes every entry point
    own = rb.add(rb.init(TED_EX), ted_items(3))
    for call in ENTRY_POINTS.values():  # an eager call consumes its state: each gets a copy
        call(rb, jit, jax.tree_util.tree_map(jnp.copy, own))


@pytest.mark.parametrize("storage", ["packed", "ted"])
def test_state_with_num_envs_inconsistent_with_the_buffer_is_refused(tmp_path, storage):
    ex2 = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), TED_EX)  # num_envs = 2
    rb2 = frb.ReplayBuffer(capacity=8, batch_size=2, ndim=2, storage=storage_of(storage, None))
    state2 = rb2.init(ex2)
    rb1 = frb.ReplayBuffer(capacity=8, batch_size=2, storage=storage_of(storage, None))
    with pytest.raises(
        ValueError,
        match=r"ReplayBuffer.add: state.num_envs is 2, expected 1 "
        r"for an ndim=1 buffer",
    ):
        rb1.add(state2, ted_items(2))
    with pytest.raises(ValueError, match=r"ReplayBuffer.size: state.num_envs is 2, expected 1"):
        rb1.size(state2)
    bad = dataclasses.replace(state2, num_envs=3)  # 3 does not divide 8
    with pytest.raises(
        ValueError,
        match=r"ReplayBuffer.sample: state.num_envs is 3, expected a "
        r"positive divisor of capacity=8",
    ):
        rb2.sample(bad, jax.random.key(0))
    if storage == "ted":  # its per-row carry is laid out for 2 envs, not 4
        with pytest.raises(
            ValueError,
            match=r"ReplayBuffer.can_sample: state.storage.carry "
            r"has shape \(2, 2\), expected shape \(4, 2\)",
        ):
            rb2.can_sample(dataclasses.replace(state2, num_envs=4))


def test_state_of_a_buffer_with_another_writer_or_sampler_is_refused():
    ex = {"r": jnp.float32(0)}
    plain = frb.ReplayBuffer(capacity=8, batch_size=2)
    state = plain.add(plain.init(ex), {"r": np.ones(3, np.float32)})
    prio = frb.ReplayBuffer(capacity=8, batch_size=2, sampler=frb.PrioritizedSampler())
    with pytest.raises(
        TypeError,
        match=r"ReplayBuffer.sample: state.sampler is a "
        r"EmptySamplerState, expected PrioritizedState",
    ):
        prio.sample(state, jax.random.key(0))
    with pytest.raises(
        TypeError,
        match=r"ReplayBuffer.update: state.sampler is a "
        r"EmptySamplerState, expected PrioritizedState",
    ):
        jax.jit(prio.update)(state, jnp.zeros(2, jnp.int32), jnp.ones(2))
    mv = frb.ReplayBuffer(capacity=8, batch_size=2, writer=frb.MaxValueWriter("r"))
    with pytest.raises(
        TypeError,
        match=r"ReplayBuffer.add: state.writer is a RoundRobinState, "
        r"expected MaxValueState",
    ):
        mv.add(state, {"r": np.ones(1, np.float32)})


# ----------------------------------------------------------------- PRNG keys
@pytest.fixture(scope="module")
def _rb8():
    return frb.ReplayBuffer(capacity=8, batch_size=3)


@pytest.fixture
def filled(_rb8):
    return _rb8, _rb8.add(_rb8.init({"v": jnp.int32(0)}), {"v": np.arange(1, 6, dtype=np.int32)})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sample_refuses_what_is_not_one_key(filled, jit):
    rb, state = filled
    sample = jax.jit(rb.sample) if jit else rb.sample
    with pytest.raises(
        TypeError,
        match=r"ReplayBuffer.sample: key must be a JAX PRNG key, got "
        r".*jax.random.key\(seed\).*jax.random.PRNGKey",
    ):
        sample(state, 0)
    with pytest.raises(TypeError, match=r"got an array of dtype float32 and shape \(2,\)"):
        sample(state, np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"got an array of dtype uint32 and shape \(3,\)"):
        sample(state, np.zeros(3, np.uint32))
    with pytest.raises(
        ValueError,
        match=r"key has shape \(2,\): a batch of 2 typed keys.*"
        r"jax.vmap\(rb.sample, in_axes=\(None, 0\)\)",
    ):
        sample(state, jax.random.split(jax.random.key(0), 2))
    with pytest.raises(ValueError, match=r"key has shape \(2, 2\): a batch of 2 raw keys"):
        sample(state, jax.random.split(jax.random.PRNGKey(0), 2))


@pytest.mark.parametrize(
    "rng, name",
    [
        (np.random.default_rng(0), "numpy.random.Generator"),
        (np.random.RandomState(0), "numpy.random.RandomState"),
    ],
    ids=["Generator", "RandomState"],
)
def test_a_numpy_generator_is_named_as_the_wrong_key(filled, rng, name):
    """Called eagerly, a NumPy Generator in the key's place is named as such, with the fix (it
    used to reach jit, whose error speaks of static_argnums and never of the key)."""
    rb, state = filled
    with pytest.raises(
        TypeError,
        match=rf"ReplayBuffer.sample: key must be a JAX PRNG key, got a {name} \(.*\)\. "
        r"JAX draws from an explicit key, not from NumPy's random state: "
        r"pass jax.random.key\(0\)",
    ):
        rb.sample(state, rng, batch_size=2)


def test_a_numpy_generator_as_the_key_of_a_host_storage_buffer(tmp_path):
    """The eager path of a storage read on the host (MemmapStorage) checks the key too."""
    rb = frb.ReplayBuffer(capacity=8, batch_size=2, storage=frb.MemmapStorage(str(tmp_path)))
    state = rb.add(rb.init({"v": jnp.int32(0)}), {"v": np.arange(1, 6, dtype=np.int32)})
    with pytest.raises(
        TypeError, match=r"ReplayBuffer.sample: key must be a JAX PRNG key, got a numpy"
    ):
        rb.sample(state, np.random.default_rng(0))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sample_accepts_typed_and_raw_keys(filled, jit):
    rb, state = filled
    sample = jax.jit(rb.sample) if jit else rb.sample
    typed, _ = sample(state, jax.random.key(7))
    raw, _ = sample(state, jax.random.PRNGKey(7))  # legacy uint32[2]: same key data
    host, _ = sample(state, np.asarray(jax.random.PRNGKey(7)))
    rbg, _ = sample(state, jax.random.key(7, impl="rbg"))  # another implementation, typed
    for s in (typed, raw, host, rbg):
        assert s.indices.shape == (3,) and bool(s.mask.all())
        assert np.all(np.asarray(s.data["v"]) >= 1)
    np.testing.assert_array_equal(np.asarray(typed.indices), np.asarray(raw.indices))
    np.testing.assert_array_equal(np.asarray(typed.indices), np.asarray(host.indices))


# ----------------------------------------------------------------- sampler options
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_unknown_sampler_options_list_the_accepted_ones(filled, jit):
    rb, state = filled
    wrap = jax.jit if jit else (lambda f: f)
    with pytest.raises(
        TypeError,
        match=r"ReplayBuffer.sample: unknown option\(s\) \['beta'\] "
        r"for the sampler RandomSampler, which accepts no options",
    ):
        wrap(functools.partial(rb.sample, beta=0.5))(state, jax.random.key(0))
    prb = frb.ReplayBuffer(capacity=8, batch_size=3, sampler=frb.PrioritizedSampler())
    pstate = prb.add(prb.init({"v": jnp.int32(0)}), {"v": np.arange(1, 6, dtype=np.int32)})
    with pytest.raises(
        TypeError,
        match=r"unknown option\(s\) \['alpha', 'gamma'\] for the "
        r"sampler PrioritizedSampler, which accepts only beta=",
    ):
        wrap(functools.partial(prb.sample, gamma=1.0, alpha=0.1))(pstate, jax.random.key(0))
    s, _ = wrap(functools.partial(prb.sample, beta=0.5))(pstate, jax.random.key(0))
    assert bool(s.mask.all())


# ----------------------------------------------------------------- FIFO writers
FIFO_USERS = {
    "slice": dict(sampler=frb.SliceSampler(slice_len=2)),
    "slice_without_replacement": dict(sampler=frb.SliceSamplerWithoutReplacement(slice_len=2)),
    "prioritized_slice": dict(
        sampler=frb.PrioritizedSliceSampler(alpha=0.6, beta=0.4, slice_len=2)
    ),
    "ted": dict(storage=frb.TEDStorage()),
}


@pytest.mark.parametrize("name", list(FIFO_USERS))
def test_slice_samplers_and_ted_refuse_a_non_fifo_writer(name):
    with pytest.raises(
        ValueError,
        match=r"ReplayBuffer: (sampler|storage)=\w+ needs a FIFO "
        r"writer.*MaxValueWriter",
    ):
        frb.ReplayBuffer(
            capacity=8, batch_size=4, writer=frb.MaxValueWriter("r"), **FIFO_USERS[name]
        )
    for writer in (frb.RoundRobinWriter(), frb.ImmutableWriter()):
        frb.ReplayBuffer(capacity=8, batch_size=4, writer=writer, **FIFO_USERS[name])


def test_immutable_writer_with_init_from_data_feeds_a_slice_sampler():
    rb = frb.ReplayBuffer(
        capacity=8,
        batch_size=4,
        writer=frb.ImmutableWriter(),
        sampler=frb.SliceSampler(slice_len=2, end_key="done", truncated_key=None),
    )
    done = np.array([0, 0, 1, 0, 0, 0, 0, 1], bool)  # episodes [0, 3) and [3, 8)
    state = rb.init_from_data({"t": np.arange(8, dtype=np.int32), "done": done})
    s, _ = rb.sample(state, jax.random.key(0))
    idx = np.asarray(s.indices)
    assert bool(s.mask.all()) and np.all(idx[:, 1] == idx[:, 0] + 1)
    assert not np.any(idx[:, 0] == 2)  # a slice never crosses the episode end at step 2
    np.testing.assert_array_equal(np.asarray(s.data["t"]), idx)


# ----------------------------------------------------------------- narrowing integer casts
@pytest.fixture(scope="module")
def _rb_ints():
    return frb.ReplayBuffer(capacity=4, batch_size=2)


@pytest.fixture
def small_ints(_rb_ints):
    return _rb_ints, _rb_ints.init({"i8": jnp.int8(0), "info": {"i32": jnp.int32(0)}})


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 300], np.int64),  # wider NumPy input
        np.array([-129, 0], np.int32),
        np.array([200, 0], np.uint8),  # same width, other signedness
        jnp.array([300, 0], jnp.int32),  # a concrete JAX array wider than the target
    ],
    ids=["int64", "int32-negative", "uint8", "jax-int32"],
)
def test_out_of_range_integers_raise_eagerly(small_ints, bad):
    rb, state = small_ints
    items = {"i8": bad, "info": {"i32": np.zeros(2, np.int32)}}
    with pytest.raises(OverflowError) as e:
        rb.add(state, items)
    msg = str(e.value)
    assert "ReplayBuffer.add: leaf ['i8']" in msg and "int8" in msg and "[-128, 127]" in msg
    assert "jax.jit" in msg
    with pytest.raises(
        OverflowError,
        match=r"leaf \['info'\]\['i32'\] has values in "
        r"\[0, 2147483648\] \(dtype uint32\)",
    ):
        rb.add(
            state, {"i8": np.zeros(2, np.int8), "info": {"i32": np.array([0, 2**31], np.uint32)}}
        )


def test_in_range_narrowing_is_exact_and_jit_wraps_as_documented(small_ints):
    rb, state = small_ints
    ok = rb.add(
        state,
        {
            "i8": np.array([-128, 127], np.int64),
            "info": {"i32": np.array([0, 2**31 - 1], np.uint32)},
        },
    )
    got = rb.get(ok, jnp.arange(2))
    np.testing.assert_array_equal(np.asarray(got["i8"]), [-128, 127])
    np.testing.assert_array_equal(np.asarray(got["info"]["i32"]), [0, 2**31 - 1])
    # under jit values are not inspected: the cast wraps like a C cast, nothing else changes
    new = jax.jit(rb.add)(
        ok, {"i8": np.array([300], np.int32), "info": {"i32": np.array([5], np.int32)}}
    )
    got = rb.get(new, jnp.arange(3))
    np.testing.assert_array_equal(np.asarray(got["i8"]), [-128, 127, 44])
    np.testing.assert_array_equal(np.asarray(got["info"]["i32"]), [0, 2**31 - 1, 5])
    assert int(rb.size(new)) == 3
