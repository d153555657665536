"""frb.Mixer: one batch from several buffers in fixed proportions (functional_rb.mixer).

Compiling dominates these tests: the mixers, buffers and state shapes are shared, and the
jitted calls go through module-level ``jax.jit`` objects whose cache is keyed by the (frozen,
hashable) mixer, so each configuration compiles once per module."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import functional_rb as frb
from functional_rb.mixer import concatenate, split_batch

P_MIN = 1e-3  # chi-square threshold (fixed seeds: the verdict is reproducible)
CAP = 8
ALPHA, BETA = 0.7, 0.4
PRIO = np.array([0.5, 1.0, 2.0, 8.0, 3.0])  # the prioritized buffer's 5 items

UNI = frb.ReplayBuffer(capacity=CAP)
PER = frb.ReplayBuffer(capacity=CAP, sampler=frb.PrioritizedSampler(alpha=ALPHA, beta=BETA))
NOREP = frb.ReplayBuffer(capacity=CAP, sampler=frb.SamplerWithoutReplacement())
MIX = frb.Mixer((UNI, PER), (1, 3), 8)

SAMPLE = jax.jit(frb.Mixer.sample, static_argnums=0)  # SAMPLE(mixer, states, key, **options)
UPDATE = jax.jit(frb.Mixer.update, static_argnums=0)


def _filled(rb, k: int, n: int):
    """A state of ``rb`` holding ``n`` items ``{"x": 100 k + i}`` (so data says its buffer)."""
    return rb.add(
        rb.init({"x": jnp.float32(0)}), {"x": 100.0 * k + jnp.arange(n, dtype=jnp.float32)}
    )


@pytest.fixture(scope="module")
def _built():
    per = PER.update(_filled(PER, 1, 5), jnp.arange(5), jnp.asarray(PRIO, jnp.float32))
    return _filled(UNI, 0, 4), per


@pytest.fixture
def states(_built):
    """[uniform state (items 0..3), prioritized state (items 100..104, priorities PRIO)], fresh
    copies: eager calls consume the states they change."""
    return [jax.tree_util.tree_map(jnp.copy, s) for s in _built]


# ------------------------------------------------------------------------------ split_batch
def test_split_batch_examples_and_flashbax_rounding():
    assert split_batch(10, (1, 1, 1)) == (4, 3, 3)
    assert split_batch(10, (1, 1, 1), rounding="first") == (4, 3, 3)
    assert split_batch(7, (1, 1, 1, 1)) == (2, 2, 2, 1)
    assert split_batch(7, (1, 1, 1, 1), rounding="first") == (4, 1, 1, 1)
    # float error: flashbax computes int(0.29 / 1.0 * 100) == 28 and gives buffer 0 the rest
    assert split_batch(100, (0.29, 0.71), rounding="first") == (29, 71)
    assert split_batch(100, (0.71, 0.29), rounding="first") == (72, 28)
    assert split_batch(100, (0.71, 0.29)) == (71, 29)  # exact rationals
    assert split_batch(5, (0, 1), rounding="first") == (0, 5)


@settings(max_examples=40)
@given(st.integers(1, 300), st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6))
def test_split_batch_properties(batch_size, props):
    sizes = split_batch(batch_size, props)
    assert sum(sizes) == batch_size
    shares = [batch_size * p / sum(props) for p in props]
    assert all(abs(n - s) < 1 + 1e-9 for n, s in zip(sizes, shares))
    # flashbax's rounding (its own make_mixer is the reference in tests/flashbax)
    first = split_batch(batch_size, props, rounding="first")
    assert sum(first) == batch_size
    assert all(n >= int(s * (1 - 1e-12)) for n, s in zip(first[1:], shares[1:]))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, (1, 1)), "batch_size"),
        ((4, ()), "at least one positive"),
        ((4, (0, 0)), "at least one positive"),
        ((4, (1, -1)), r"proportions\[1\]"),
        ((4, (1, float("nan"))), r"proportions\[1\]"),
    ],
)
def test_split_batch_errors(args, match):
    with pytest.raises(ValueError, match=match):
        split_batch(*args)
    with pytest.raises(ValueError, match="rounding"):
        split_batch(4, (1, 1), rounding="nearest")


def test_concatenate_refuses_what_it_would_promote_or_broadcast():
    a = {"obs": np.zeros((2, 3), np.float32)}
    assert concatenate([a, {"obs": np.ones((1, 3), np.float32)}])["obs"].shape == (3, 3)
    with pytest.raises(ValueError, match=r"\['obs'\] of batches\[1\] has shape \(2, 4\)"):
        concatenate([a, {"obs": np.zeros((2, 4), np.float32)}])
    with pytest.raises(ValueError, match="dtype int32"):
        concatenate([a, {"obs": np.zeros((2, 3), np.int32)}])
    with pytest.raises(ValueError, match="another tree structure"):
        concatenate([a, {"obs": np.zeros((2, 3), np.float32), "r": np.zeros(2)}])


# ------------------------------------------------------------------------------ configuration
def test_mixer_is_a_frozen_hashable_config():
    m = frb.Mixer([UNI, PER], [1, 3], 8)
    assert m.buffers == (UNI, PER) and m.proportions == (1, 3)
    assert m.sizes == (2, 6) and m.rows == (2, 6) and m.offsets == (0, 2)
    assert m.source.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert m == MIX and hash(m) == hash(MIX)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.batch_size = 4
    assert dataclasses.replace(m, batch_size=4).sizes == (1, 3)
    assert frb.Mixer((UNI, UNI, UNI), (1, 1, 1), 7, rounding="first").sizes == (3, 2, 2)
    assert frb.Mixer((UNI, UNI), np.array([1.0, 3.0]), 8).proportions == (1.0, 3.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"proportions": (1, 0)}, ValueError, r"proportions\[1\] must be .*> 0.*got 0"),
        ({"proportions": (1, -2)}, ValueError, r"proportions\[1\]"),
        ({"proportions": (1,)}, ValueError, "2 buffers but 1 proportions"),
        ({"proportions": (1, "a")}, TypeError, r"proportions\[1\]"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        (
            {"proportions": (1, 99), "batch_size": 10},
            ValueError,
            r"buffers\[0\] gets 0 of the batch_size=10 rows.*at least 100",
        ),
        ({"weights": "uniform"}, ValueError, "weights must be one of"),
        ({"rounding": "up"}, ValueError, "rounding must be one of"),
        ({"buffers": ()}, ValueError, "buffers is empty"),
        ({"buffers": (UNI, "rb")}, TypeError, r"buffers\[1\] = 'rb' is not a buffer"),
        ({"buffers": UNI}, TypeError, "buffers must be a list or tuple"),
    ],
)
def test_bad_configuration_raises_naming_the_fix(kwargs, error, match):
    args = {"buffers": (UNI, UNI), "proportions": (1, 1), "batch_size": 4} | kwargs
    with pytest.raises(error, match=match):
        frb.Mixer(**args)


def test_a_share_the_sampler_cannot_draw_fails_at_construction():
    slices = frb.ReplayBuffer(capacity=32, sampler=frb.SliceSampler(slice_len=4), batch_size=8)
    with pytest.raises(ValueError, match=r"Mixer: buffers\[0\]: .*not divisible by slice_len"):
        frb.Mixer((slices, slices), (1, 1), 12)  # 6 steps each: not whole slices
    assert frb.Mixer((slices, slices), (1, 1), 16).rows == (2, 2)


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """A buffer of one's own: the sample protocol over a ReplayBuffer."""

    rb: frb.ReplayBuffer

    def sample(self, state, key, batch_size=None):
        return self.rb.sample(state, key, batch_size=batch_size)

    def can_sample(self, state):
        return self.rb.can_sample(state)


@dataclasses.dataclass(frozen=True)
class _Scaled(_Wrapped):
    def weight_scale(self, state):
        del state
        return jnp.float32(4.0)


def test_buffers_of_ones_own_need_member_weights_or_a_weight_scale(states):
    with pytest.raises(TypeError, match=r"buffers\[1\].*weights='member'.*weight_scale"):
        frb.Mixer((UNI, _Wrapped(UNI)), (1, 1), 4)
    two = [states[0], states[0]]
    m = frb.Mixer((UNI, _Wrapped(UNI)), (1, 1), 4, weights="member")
    sample, source, _ = SAMPLE(m, two, jax.random.key(0))
    np.testing.assert_array_equal(source, [0, 0, 1, 1])
    np.testing.assert_array_equal(sample.weights, 1.0)
    # weight_scale: the buffer's weights were divided by 4, the uniform ones by 1
    sample, _, _ = SAMPLE(frb.Mixer((UNI, _Scaled(UNI)), (1, 1), 4), two, jax.random.key(0))
    np.testing.assert_allclose(sample.weights, [0.25, 0.25, 1, 1])


# ------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_proportions_are_exact_and_rows_come_from_their_buffer(mode):
    rbs = (UNI, PER, NOREP)
    m = frb.Mixer(rbs, (0.2, 0.3, 0.5), 11)
    stored = (3, 5, 8)
    states = tuple(_filled(rb, k, stored[k]) for k, rb in enumerate(rbs))
    key = jax.random.key(1)
    sample, source, new = m.sample(states, key) if mode == "eager" else SAMPLE(m, states, key)
    assert isinstance(sample, frb.Sample) and isinstance(new, tuple) and len(new) == 3
    x, idx, src = (np.asarray(a) for a in (sample.data["x"], sample.indices, source))
    assert src.tolist() == m.source.tolist()
    assert np.bincount(src, minlength=3).tolist() == list(m.sizes) == [2, 3, 6]
    np.testing.assert_array_equal(x, 100.0 * src + idx)  # the data is item idx of buffer src
    assert all(idx[src == k].max() < stored[k] for k in range(3))
    assert len(set(idx[src == 2])) == 6  # the without-replacement buffer's rows are distinct
    assert sample.mask.all() and sample.indices.dtype == jnp.int32
    assert sample.weights.dtype == jnp.float32 and sample.weights.shape == (11,)
    # the prioritized buffer keeps generations; the others' rows read -1
    gens = np.asarray(sample.generations)
    assert (gens[src != 1] == -1).all() and (gens[src == 1] >= 0).all()


def test_mixture_distribution_chi_square(states):
    """A row of buffer k is item i with probability P_k(i): uniform for buffer 0, proportional
    to (p + eps) ** alpha for buffer 1; the counts over many batches follow sizes[k] * P_k(i)."""
    n_batches = 3000
    keys = jax.random.split(jax.random.key(2024), n_batches)
    sample, source, _ = jax.jit(jax.vmap(MIX.sample, in_axes=(None, 0)))(states, keys)
    src, idx = np.asarray(source).ravel(), np.asarray(sample.indices).ravel()
    v = PRIO**ALPHA
    expected = np.concatenate([MIX.sizes[0] * np.full(4, 1 / 4), MIX.sizes[1] * v / v.sum()])
    counts = np.concatenate(
        [np.bincount(idx[src == 0], minlength=4), np.bincount(idx[src == 1], minlength=5)]
    )
    assert counts.sum() == 8 * n_batches
    assert stats.chisquare(counts, expected * n_batches).pvalue > P_MIN
    # the proportions themselves are not random: each batch holds exactly sizes[k] rows
    assert (np.asarray(source) == MIX.source).all()


def _reference_weights(src, idx, beta):
    """NumPy: the mixture weight of row (buffer k, item i) is (N_k P_k(i)) ** -beta divided by
    the largest such value over every stored item of every buffer (uniform buffer: 1)."""
    v = PRIO**ALPHA
    u = (len(PRIO) * v / v.sum()) ** -beta
    top = max(u.max(), 1.0)
    return np.where(src == 0, 1.0, u[np.where(src == 1, idx, 0)]) / top


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_weights_against_numpy_for_a_prioritized_buffer(states, mode):
    key = jax.random.key(3)
    for beta in (BETA, 1.0, 0.0):
        options = {} if beta == BETA else {"beta": beta}  # beta= goes to the prioritized one
        sample, source, _ = (
            MIX.sample(states, key, **options)
            if mode == "eager"
            else SAMPLE(MIX, states, key, **options)
        )
        src, idx, w = (np.asarray(a) for a in (source, sample.indices, sample.weights))
        np.testing.assert_allclose(w, _reference_weights(src, idx, beta), rtol=1e-5)
        assert w.max() <= 1.0 + 1e-6 and (w[src == 0] < 1).all() == (beta > 0)


def test_member_weights_are_each_buffers_own(states):
    own = frb.Mixer((UNI, PER), (1, 3), 8, weights="member")
    sample, source, _ = SAMPLE(own, states, jax.random.key(3))
    src, idx, w = (np.asarray(a) for a in (source, sample.indices, sample.weights))
    assert (w[src == 0] == 1).all()
    v = PRIO**ALPHA
    np.testing.assert_allclose(w[src == 1], (v.min() / v[idx[src == 1]]) ** BETA, rtol=1e-5)
    # the same rows as the mixture's: only the scale of the uniform rows differs
    mixed, _, _ = SAMPLE(MIX, states, jax.random.key(3))
    np.testing.assert_array_equal(mixed.indices, sample.indices)


def test_slice_buffers_mix_by_slices():
    rb = frb.ReplayBuffer(capacity=32, sampler=frb.SliceSampler(slice_len=4), batch_size=8)
    prb = frb.ReplayBuffer(
        capacity=32,
        sampler=frb.PrioritizedSliceSampler(slice_len=4, alpha=1.0, beta=1.0),
        batch_size=8,
    )
    m = frb.Mixer((rb, prb), (1, 3), 16)
    assert m.sizes == (4, 12) and m.rows == (1, 3)

    def episode(k):
        done = jnp.zeros(12, bool).at[-1].set(True)
        return {"x": 100.0 * k + jnp.arange(12.0), "next": {"done": done}}

    states = [
        b.add(b.init(jax.tree_util.tree_map(lambda a: a[0], episode(k))), episode(k))
        for k, b in enumerate((rb, prb))
    ]
    sample, source, _ = SAMPLE(m, states, jax.random.key(0))
    assert sample.data["x"].shape == (4, 4) and sample.indices.shape == (4, 4)
    assert np.asarray(source).tolist() == [0, 1, 1, 1]
    assert (np.asarray(sample.data["x"][1:]) >= 100).all()
    np.testing.assert_allclose(sample.weights, 1.0)  # equal priorities: nothing to correct


# ------------------------------------------------------------------------------ errors
def test_states_are_checked(states):
    with pytest.raises(ValueError, match="got 1 states for 2 buffers"):
        MIX.sample(states[:1], jax.random.key(0))
    with pytest.raises(TypeError, match="states must be a list or tuple of 2"):
        MIX.can_sample(states[0])
    with pytest.raises(TypeError, match="Mixer.sample: key must be a JAX PRNG key"):
        SAMPLE(MIX, states, 0)
    with pytest.raises(TypeError, match=r"no buffer takes the option\(s\) \['gamma'\]"):
        MIX.sample(states, jax.random.key(0), gamma=0.5)
    with pytest.raises(TypeError, match=r"Mixer.sample: buffers\[1\]: .*BufferState"):
        MIX.sample([states[0], states[0].storage], jax.random.key(0))


def test_buffers_whose_items_differ_are_refused_naming_the_leaf(states):
    m = frb.Mixer((UNI, UNI), (1, 1), 4)
    other = jax.eval_shape(lambda: UNI.init({"x": jnp.zeros(2)}))
    with pytest.raises(ValueError, match=r"leaf \['x'\] of buffers\[1\] has shape \(2, 2\)"):
        jax.eval_shape(m.sample, [states[0], other], jax.random.key(0))
    ints = jax.eval_shape(lambda: UNI.init({"x": jnp.int32(0)}))
    with pytest.raises(ValueError, match="dtype int32"):
        jax.eval_shape(m.sample, [states[0], ints], jax.random.key(0))


def test_an_empty_buffer_raises_eagerly_and_masks_under_jit(states):
    states = [states[0], PER.init({"x": jnp.float32(0)})]
    assert not bool(MIX.can_sample(states))
    with pytest.raises(ValueError, match=r"Mixer.sample: buffers\[1\]: .*nothing can be sampled"):
        MIX.sample(states, jax.random.key(0))
    # nothing was consumed by the failed call: the same states sample under jit
    sample, _, _ = SAMPLE(MIX, states, jax.random.key(0))
    assert np.asarray(sample.mask).tolist() == [True] * 2 + [False] * 6
    assert np.asarray(sample.weights).tolist() == [1.0] * 2 + [0.0] * 6


# ------------------------------------------------------------------------------ jit, vmap, scan
def test_eager_jit_and_vmap_agree(states):
    keys = jax.random.split(jax.random.PRNGKey(7), 3)  # legacy uint32 keys work too
    jitted = SAMPLE(MIX, states, keys[0])
    eager = MIX.sample(states, keys[0])
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(a, b)
    batched = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), states)
    vs, vsrc, vstates = jax.vmap(MIX.sample)(batched, keys)
    assert vs.data["x"].shape == (3, 8) and vsrc.shape == (3, 8)
    assert jax.tree_util.tree_structure(vstates) == jax.tree_util.tree_structure(batched)
    for i in range(3):
        one = SAMPLE(MIX, states, keys[i])[0]
        np.testing.assert_array_equal(vs.indices[i], one.indices)
        np.testing.assert_allclose(vs.weights[i], one.weights, rtol=1e-6)
    ok = jax.vmap(MIX.can_sample)(batched)
    assert ok.shape == (3,) and bool(ok.all())


def test_scan_samples_and_updates_priorities(states):
    m = frb.Mixer([PER, UNI], [3, 1], 8)
    states = states[::-1]

    def step(states, key):
        sample, _, states = m.sample(states, key)
        # priority = the item's own value: after the loop every drawn item holds it
        return m.update(states, sample, sample.data["x"]), sample.indices

    out, idx = jax.jit(lambda s, k: jax.lax.scan(step, s, k))(
        states, jax.random.split(jax.random.key(0), 20)
    )
    assert isinstance(out, list) and len(out) == 2
    drawn = np.unique(np.asarray(idx)[:, :6])
    v = (drawn + 100.0 + 1e-8) ** ALPHA
    np.testing.assert_allclose(np.asarray(out[0].sampler.tree.values)[drawn], v, rtol=1e-5)
    # the uniform buffer's state is untouched by updates
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(states[1])):
        np.testing.assert_array_equal(a, b)


def test_update_routes_rows_and_drops_rewritten_slots(states):
    sample, _, states = SAMPLE(MIX, states, jax.random.key(5))
    idx = np.asarray(sample.indices)[2:]
    new = UPDATE(MIX, states, sample, jnp.arange(8.0))
    v = np.asarray(new[1].sampler.tree.values)
    last = {i: p for i, p in zip(idx, range(2, 8))}  # duplicates: the last occurrence wins
    np.testing.assert_allclose(
        [v[i] for i in last], [(p + 1e-8) ** ALPHA for p in last.values()], rtol=1e-5
    )
    # bare indices work too, and a scalar priority (eagerly here)
    new = MIX.update(new, sample.indices, 3.0)
    np.testing.assert_allclose(np.asarray(new[1].sampler.tree.values)[idx], 3.0**ALPHA, rtol=1e-5)
    # slots rewritten since the draw keep their priority when the sample itself is passed
    rewritten = jax.jit(PER.add)(new[1], {"x": jnp.arange(CAP, dtype=jnp.float32)})
    before = np.asarray(rewritten.sampler.tree.values).copy()
    dropped = int(PER.dropped_updates(rewritten))
    after = UPDATE(MIX, [new[0], rewritten], sample, jnp.full(8, 7.0))
    np.testing.assert_array_equal(np.asarray(after[1].sampler.tree.values), before)
    assert int(PER.dropped_updates(after[1])) == dropped + 6
    with pytest.raises(ValueError, match="expected the shape of indices"):
        MIX.update(new, sample, jnp.ones(3))
    with pytest.raises(ValueError, match=r"Mixer.update: buffers\[1\]: .*priorit"):
        MIX.update(new, sample, jnp.arange(8.0) - 5.0)
    # the failed eager update consumed nothing
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(new))


@settings(max_examples=6)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.integers(4, 12),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_every_batch_holds_sizes_rows_of_each_buffer(props, batch_size, jit, seed):
    batch_size = max(batch_size, len(props) * max(props))  # every buffer gets a row
    m = frb.Mixer((UNI,) * len(props), props, batch_size)
    states = [_filled(UNI, k, 4) for k in range(len(props))]
    key = jax.random.key(seed)
    sample, source, _ = SAMPLE(m, states, key) if jit else m.sample(states, key)
    x, src = np.asarray(sample.data["x"]), np.asarray(source)
    assert np.bincount(src, minlength=len(props)).tolist() == list(m.sizes)
    assert sum(m.sizes) == batch_size
    np.testing.assert_array_equal(x // 100, src)
