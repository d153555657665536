"""functional_rb.flashbax's buffers against flashbax 0.1.3 itself, on the same inputs: the same
states after any sequence of adds and priority updates, the same sampling rules (checked
statistically), and what flashbax allows under jit, vmap, pmap and donation."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import functional_rb as frb
import functional_rb.flashbax as ours
from functional_rb.flashbax.buffers import prioritised_trajectory_buffer as optb
from functional_rb.flashbax.buffers import sum_tree as our_tree
from functional_rb.flashbax.buffers import trajectory_buffer as otb

fbx = pytest.importorskip("flashbax")
from flashbax.buffers import prioritised_trajectory_buffer as fptb  # noqa: E402
from flashbax.buffers import sum_tree as fbx_tree  # noqa: E402
from flashbax.buffers import trajectory_buffer as ftb  # noqa: E402

ITEM = {"obs": jnp.zeros((2,), jnp.float32), "act": jnp.int32(0)}


def batch(rows: int, steps: int, start: int):
    t = start + np.arange(rows * steps, dtype=np.float32).reshape(rows, steps)
    return {"obs": jnp.asarray(np.stack([t, -t], axis=-1)), "act": jnp.asarray(t, jnp.int32)}


def fb(f, *args, **kwargs):
    """Call flashbax (whose code broadcasts across ranks, which this suite's conftest makes
    an error for ours)."""
    with jax.numpy_rank_promotion("allow"):
        return f(*args, **kwargs)


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ the same states
@settings(max_examples=8)
@given(
    rows=st.integers(1, 3),
    length=st.integers(4, 12),
    adds=st.lists(st.integers(1, 12), min_size=1, max_size=6),
)
def test_trajectory_states_equal_flashbax(rows, length, adds):
    mine, theirs = otb.init(ITEM, rows, length), fb(ftb.init, ITEM, rows, length)
    start = 0
    for steps in adds:
        steps = min(steps, length)
        b = batch(rows, steps, start)
        start += rows * steps
        mine, theirs = otb.add(mine, b), fb(ftb.add, theirs, b)
        jax.tree_util.tree_map(same, mine.experience, theirs.experience)
        same(mine.current_index, theirs.current_index)
        same(mine.is_full, theirs.is_full)


@settings(max_examples=6)
@given(
    rows=st.integers(1, 3),
    per_row=st.integers(2, 6),
    period=st.integers(1, 3),
    seq=st.integers(1, 5),
    adds=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_prioritised_states_equal_flashbax(rows, per_row, period, seq, adds, seed):
    """The item values (which sequences are drawable, at which value) and the counters follow
    flashbax's bookkeeping exactly, also after set_priorities."""
    length = per_row * period
    seq = min(seq, length)
    mine = optb.prioritised_init(ITEM, rows, length, period)
    theirs = fb(fptb.prioritised_init, ITEM, rows, length, period)
    rng = np.random.default_rng(seed)
    start = 0
    n_items = rows * per_row
    for steps in adds:
        steps = min(steps, length)
        b = batch(rows, steps, start)
        start += rows * steps
        mine = optb.prioritised_add(mine, b, seq, period)
        theirs = fb(fptb.prioritised_add, theirs, b, seq, period, "cpu")
        # whole priorities, exponent 1: flashbax rounds the value it gives new items down to
        # an integer (test_new_items_get_the_exact_largest_value), which these leave alone
        idx = jnp.asarray(rng.integers(0, n_items, size=3), jnp.int32)
        p = jnp.asarray(rng.integers(1, 6, size=3), jnp.float32)
        mine = optb.set_priorities(mine, idx, p, 1.0)
        theirs = fb(fptb.set_priorities, theirs, idx, p, 1.0, "cpu")
        everything = jnp.arange(n_items)
        np.testing.assert_allclose(
            our_tree.get_batch(mine.sum_tree_state, everything),
            fb(fbx_tree.get_batch, theirs.sum_tree_state, everything),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            mine.sum_tree_state.max_recorded_priority,
            theirs.sum_tree_state.max_recorded_priority,
            rtol=1e-6,
        )
        same(mine.running_index, theirs.running_index)
        jax.tree_util.tree_map(same, mine.experience, theirs.experience)


def test_new_items_get_the_exact_largest_value():
    """flashbax fills new items' values with jnp.full_like over their integer indices, which
    rounds the largest recorded value down (2.33 -> 2); ours gives them the value itself."""
    mine = optb.prioritised_init(ITEM, 1, 4, 1)
    theirs = fb(fptb.prioritised_init, ITEM, 1, 4, 1)
    mine = optb.prioritised_add(mine, batch(1, 1, 0), 1, 1)
    theirs = fb(fptb.prioritised_add, theirs, batch(1, 1, 0), 1, 1, "cpu")
    mine = optb.set_priorities(mine, jnp.array([0]), jnp.array([2.33]), 1.0)
    theirs = fb(fptb.set_priorities, theirs, jnp.array([0]), jnp.array([2.33]), 1.0, "cpu")
    mine = optb.prioritised_add(mine, batch(1, 1, 1), 1, 1)
    theirs = fb(fptb.prioritised_add, theirs, batch(1, 1, 1), 1, 1, "cpu")
    assert float(our_tree.get(mine.sum_tree_state, 1)) == pytest.approx(2.33)
    assert float(fb(fbx_tree.get, theirs.sum_tree_state, 1)) == 2.0


@pytest.mark.parametrize(
    "add_length,rows,seq,period,length",
    [(13, 1, 13, 2, 16), (3, 1, 4, 2, 12), (3, 1, 5, 2, 8), (4, 2, 3, 1, 13), (9, 2, 4, 3, 39)],
)
def test_new_item_indices_equal_flashbax(add_length, rows, seq, period, length):
    length -= length % period
    for before in range(0, 5 * add_length, add_length):
        mine = optb._calculate_new_item_indices(before, add_length, period, length, seq, rows)
        theirs = fb(fptb._calculate_new_item_indices, before, add_length, period, length, seq, rows)
        for a, b in zip(mine, theirs):
            assert sorted(np.asarray(a).tolist()) == sorted(np.asarray(b).tolist())


@pytest.mark.parametrize(
    "builder,kwargs",
    [
        ("make_flat_buffer", dict(add_sequences=True, add_batch_size=2)),
        ("make_flat_buffer", dict()),
        ("make_item_buffer", dict(add_sequences=True, add_batches=True)),
        ("make_prioritised_flat_buffer", dict(add_batch_size=2)),
        ("make_prioritised_item_buffer", dict(add_batches=True)),
    ],
)
def test_builders_store_what_flashbax_stores(builder, kwargs):
    mine = getattr(ours, builder)(max_length=16, min_length=2, sample_batch_size=4, **kwargs)
    theirs = getattr(fbx, builder)(max_length=16, min_length=2, sample_batch_size=4, **kwargs)
    s1, s2 = mine.init(ITEM), fb(theirs.init, ITEM)
    add_batches = kwargs.get("add_batch_size") or kwargs.get("add_batches")
    lead = ((2,) if add_batches else ()) + ((3,) if kwargs.get("add_sequences") else ())
    for i in range(5):
        b = jax.tree_util.tree_map(
            lambda x, i=i: jnp.broadcast_to(jnp.asarray(i + 1, x.dtype), lead + x.shape), ITEM
        )
        s1, s2 = mine.add(s1, b), fb(theirs.add, s2, b)
    jax.tree_util.tree_map(same, s1.experience, s2.experience)
    same(s1.current_index, s2.current_index)
    assert bool(mine.can_sample(s1)) == bool(theirs.can_sample(s2))
    out = mine.sample(s1, jax.random.PRNGKey(0))
    ref = fb(theirs.sample, s2, jax.random.PRNGKey(0))
    assert type(out).__name__ == type(ref).__name__
    assert [x.shape for x in jax.tree_util.tree_leaves(out)] == [
        x.shape for x in jax.tree_util.tree_leaves(ref)
    ]


# ------------------------------------------------------------------ the same sampling rules
def test_uniform_starts_follow_flashbax_rule():
    """Rows uniform, starts uniform over the period grid counted from the oldest step, never
    across the write head (chi-square against the rule, after the ring wrapped)."""
    rows, length, seq, period = 2, 12, 3, 2
    state = otb.init({"t": jnp.int32(0)}, rows, length)
    for k in range(3):  # 15 steps per row: wrapped, head at 3
        t = jnp.arange(5 * k, 5 * k + 5, dtype=jnp.int32)
        state = otb.add(state, {"t": jnp.stack([t, t + 1000])})
    n = 6000
    s = jax.jit(otb.sample, static_argnums=(2, 3, 4))(state, jax.random.PRNGKey(1), n, seq, period)
    t = np.asarray(s.experience["t"])
    assert (np.diff(t, axis=1) == 1).all(), "a sequence crossed the write head"
    first = t[:, 0] % 1000
    oldest = 15 - length
    expected = [oldest + k * period for k in range((length - seq) // period + 1)]
    assert set(first.tolist()) == set(expected)
    counts = np.array([np.sum((t[:, 0] >= 1000) == r) for r in (0, 1)])
    assert stats.chisquare(counts).pvalue > 1e-3
    counts = np.array([np.sum(first == e) for e in expected])
    assert stats.chisquare(counts).pvalue > 1e-3


def test_prioritised_draws_follow_values():
    buffer = ours.make_prioritised_trajectory_buffer(
        add_batch_size=1,
        sample_batch_size=4000,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=8,
        priority_exponent=1.0,
    )
    state = buffer.add(
        buffer.init({"t": jnp.int32(0)}), {"t": jnp.arange(8, dtype=jnp.int32)[None]}
    )
    p = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    state = buffer.set_priorities(state, jnp.arange(7), p)
    s = jax.jit(buffer.sample)(state, jax.random.PRNGKey(3))
    counts = np.bincount(np.asarray(s.indices), minlength=8)
    assert counts[7] == 0, "the item crossing the write head was drawn"
    expected = np.asarray(p, np.float64) / float(np.sum(np.asarray(p, np.float64)))
    assert stats.chisquare(counts[:7], counts[:7].sum() * expected).pvalue > 1e-3
    np.testing.assert_allclose(s.probabilities, p[s.indices] / p.sum(), rtol=1e-6)
    same(s.experience["t"][:, 0], s.indices)


def test_set_priorities_sets_what_flashbax_sets():
    """flashbax's set_priorities revives an item that is not drawable; ours does too by
    default (code written for flashbax may rely on it) and leaves it alone when asked."""
    kw = dict(
        add_batch_size=1,
        sample_batch_size=2,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=4,
    )
    for flag, expected in ((False, 9.0), (True, 0.0)):
        buffer = ours.make_prioritised_trajectory_buffer(
            **kw, priority_exponent=1.0, drawable_only=flag
        )
        state = buffer.add(buffer.init({"t": jnp.int32(0)}), {"t": jnp.zeros((1, 3), jnp.int32)})
        state = buffer.set_priorities(state, jnp.array([2]), jnp.array([9.0]))
        assert float(our_tree.get(state.sum_tree_state, 2)) == expected


# ------------------------------------------------------------------ opt-ins
@pytest.mark.parametrize("prioritised", [False, True])
def test_end_key_sequences_never_cross_an_episode_end(prioritised):
    make = ours.make_prioritised_trajectory_buffer if prioritised else ours.make_trajectory_buffer
    buffer = make(
        add_batch_size=2,
        sample_batch_size=3000,
        sample_sequence_length=3,
        period=1,
        min_length_time_axis=3,
        max_length_time_axis=10,
        end_key="done",
    )
    state = buffer.init({"t": jnp.int32(0), "done": jnp.bool_(False)})
    for k in range(3):
        t = jnp.arange(4 * k, 4 * k + 4, dtype=jnp.int32)
        done = (t % 5) == 4  # episodes end at 4, 9, ...
        state = buffer.add(state, {"t": jnp.stack([t, t]), "done": jnp.stack([done, ~done])})
    s = jax.jit(buffer.sample)(state, jax.random.PRNGKey(0))
    d = np.asarray(s.experience["done"])
    assert not d[:, :-1].any(), "a sequence crossed an episode end"
    assert (np.diff(np.asarray(s.experience["t"]), axis=1) == 1).all()
    if not prioritised:  # every drawable sequence equally likely
        keys = [tuple(r) for r in np.asarray(s.experience["t"]) * 2 + d]
        _, counts = np.unique(np.asarray(keys), axis=0, return_counts=True)
        assert stats.chisquare(counts).pvalue > 1e-3


def test_flat_buffer_end_key_skips_pairs_across_episodes():
    buffer = ours.make_flat_buffer(
        max_length=64, min_length=2, sample_batch_size=64, end_key="done"
    )
    state = buffer.init({"t": jnp.int32(0), "done": jnp.bool_(False)})
    for t in range(10):
        state = buffer.add(state, {"t": jnp.int32(t), "done": jnp.bool_(t % 3 == 2)})
    s = buffer.sample(state, jax.random.PRNGKey(0))
    assert not np.asarray(s.experience.first["done"]).any()


def test_checkpoint_round_trip_in_a_fresh_process(tmp_path):
    buffer = ours.make_prioritised_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=8,
    )
    state = buffer.add(buffer.init(ITEM), batch(2, 5, 0))
    frb.checkpoint.save(tmp_path / "ckpt", state)
    code = textwrap.dedent(f"""
        import numpy as np, functional_rb as frb
        s = frb.checkpoint.load({str(tmp_path / "ckpt")!r})
        print(type(s).__name__, int(s.running_index), float(np.asarray(s.experience['obs']).sum()))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    name, running, total = out.stdout.split()
    assert name == "PrioritisedTrajectoryBufferState" and running == "5"
    assert float(total) == float(np.asarray(state.experience["obs"]).sum())


# ------------------------------------------------------------------ jit, vmap, pmap, donation
def test_donated_jit_vmap_and_scan():
    buffer = ours.make_prioritised_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=3,
        period=2,
        min_length_time_axis=3,
        max_length_time_axis=8,
    )
    buffer = buffer.replace(
        add=jax.jit(buffer.add, donate_argnums=0),
        sample=jax.jit(buffer.sample),
        set_priorities=jax.jit(buffer.set_priorities, donate_argnums=0),
    )
    state = buffer.add(buffer.init(ITEM), batch(2, 6, 0))
    s = buffer.sample(state, jax.random.PRNGKey(0))
    state = buffer.set_priorities(state, s.indices, jnp.ones(4))
    # Stoix: broadcast one state to a population, then vmap
    pop = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (3,) + x.shape), state)
    pop = jax.vmap(buffer.add)(
        pop, jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (3,) + x.shape), batch(2, 2, 100))
    )
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    out = jax.vmap(buffer.sample)(pop, keys)
    assert out.experience["obs"].shape == (3, 4, 3, 2)

    def step(carry, i):
        carry = buffer.add(carry, batch(2, 1, 0))
        return carry, buffer.sample(carry, jax.random.fold_in(jax.random.PRNGKey(0), i)).indices

    final, idx = jax.lax.scan(step, state, jnp.arange(5))
    assert idx.shape == (5, 4) and int(final.running_index) == 11


def test_pmap_as_flashbax_tests_do():
    n = jax.local_device_count()
    buffer = ours.make_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=8,
    )
    items = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), ITEM)
    state = jax.pmap(buffer.init)(items)
    state = jax.pmap(buffer.add)(
        state, jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), batch(2, 4, 0))
    )
    out = jax.pmap(buffer.sample)(state, jax.random.split(jax.random.PRNGKey(0), n))
    assert out.experience["obs"].shape == (n, 4, 2, 2)


# ------------------------------------------------------------------ errors
def test_bad_batches_name_the_leaf():
    state = otb.init(ITEM, 2, 8)
    bad = batch(2, 3, 0)
    bad["obs"] = jnp.zeros((2, 3, 5))
    with pytest.raises(AssertionError, match=r"\['obs'\].*\(2, 3, 5\)"):
        otb.add(state, bad)
    with pytest.raises(ValueError, match="max_length_time_axis"):
        otb.add(state, batch(2, 9, 0))
    with pytest.raises(ValueError, match="num_envs=2"):
        otb.add(state, batch(3, 2, 0))


def test_flat_and_item_errors_name_the_shapes_the_user_passed():
    """The flat and item buffers add axes to what they are given; their errors speak of the
    shapes as the user wrote them, and a torch tensor is refused in init and add alike."""
    flat = ours.make_flat_buffer(max_length=32, min_length=2, sample_batch_size=4, add_batch_size=4)
    state = flat.init({"obs": jnp.zeros(4)})
    with pytest.raises(
        AssertionError,
        match=r"add: leaf \['obs'\] has shape \(4, 5\), expected \[add_batch_size, \*item "
        r"shape\] = \[4, 4\]",
    ):
        flat.add(state, {"obs": jnp.zeros((4, 5))})
    items = ours.make_item_buffer(
        max_length=32, min_length=2, sample_batch_size=4, add_batches=True, add_sequences=True
    )
    with pytest.raises(ValueError, match=r"shape \(7, 5\), expected \[batch, T, \*item shape\]"):
        items.add(items.init({"obs": jnp.zeros(4)}), {"obs": jnp.zeros((7, 5))})
    torch = pytest.importorskip("torch")
    for call in (
        lambda: flat.init({"obs": torch.zeros(4)}),
        lambda: flat.add(state, {"obs": torch.zeros((4, 4))}),
    ):
        with pytest.raises(TypeError, match=r"leaf \['obs'\] is a torch.Tensor.*x.numpy\(\)"):
            call()


@pytest.mark.parametrize(
    "builder", ["make_prioritised_flat_buffer", "make_prioritised_trajectory_buffer"]
)
def test_drop_stale_updates_skips_overwritten_sequences(builder):
    """With drop_stale_updates=True an update made from a sample whose sequences were
    overwritten since the draw (a newer sequence now starts in the same slot) is dropped and
    counted; the same update on a fresh sample applies."""
    if builder == "make_prioritised_flat_buffer":
        buffer = ours.make_prioritised_flat_buffer(
            max_length=8,
            min_length=2,
            sample_batch_size=4,
            add_sequences=True,
            priority_exponent=1.0,
            drop_stale_updates=True,
        )

        def add(s, t):
            return buffer.add(s, {"t": jnp.arange(t, t + 8, dtype=jnp.int32)})
    else:
        buffer = ours.make_prioritised_trajectory_buffer(
            add_batch_size=1,
            sample_batch_size=4,
            sample_sequence_length=2,
            period=1,
            min_length_time_axis=2,
            max_length_time_axis=8,
            priority_exponent=1.0,
            drop_stale_updates=True,
        )

        def add(s, t):
            return buffer.add(s, {"t": jnp.arange(t, t + 8, dtype=jnp.int32)[None]})

    state = add(buffer.init({"t": jnp.int32(0)}), 0)
    old = buffer.sample(state, jax.random.PRNGKey(0))
    state = add(state, 100)  # every slot rewritten
    before = our_tree.get_batch(state.sum_tree_state, old.indices)
    state = buffer.set_priorities(state, old, jnp.full(4, 50.0))
    same(our_tree.get_batch(state.sum_tree_state, old.indices), before)
    assert int(state.generations.dropped) == 4
    fresh = buffer.sample(state, jax.random.PRNGKey(1))
    state = buffer.set_priorities(state, fresh, jnp.full(4, 50.0))
    assert (np.asarray(our_tree.get_batch(state.sum_tree_state, fresh.indices)) == 50.0).all()
    with pytest.raises(ValueError, match="one or the other"):
        buffer.set_priorities(state, fresh, jnp.ones(4), generations=fresh.generations)
