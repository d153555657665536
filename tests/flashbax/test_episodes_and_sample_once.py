"""functional_rb.flashbax's opt-ins for flashbax issues #23 and #59, against Python models of
the ring, eagerly and under jax.jit:

- ``make_trajectory_buffer(..., end_key=..., episodes=True)``: every sampled row is one whole,
  ended episode from its first step (never steps of two episodes), padding masked;
- ``make_flat_buffer(..., sample_once=True)`` / ``make_item_buffer(..., sample_once=True)``:
  no transition or item is drawn twice until its step is rewritten, a rewritten step is
  drawable again, batches are full or (under jit) all masked with nothing spent;

and without the opt-ins the state is flashbax's, leaf for leaf."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb
import functional_rb.flashbax as ours
from functional_rb.flashbax.buffers.flat_buffer import (
    MaskedTransitionSample,
    SampleOnceBufferState,
)
from functional_rb.flashbax.buffers.trajectory_buffer import (
    MaskedTrajectoryBufferSample,
    TrajectoryBufferState,
    WholeEpisodeBufferState,
)

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10)


def structure(state):
    """The field names and the leaves' shapes and dtypes."""
    names = sorted(f.name for f in dataclasses.fields(state))
    return names, [(np.shape(x), np.asarray(x).dtype) for x in jax.tree_util.tree_leaves(state)]


# ------------------------------------------------------------------ defaults unchanged
def test_without_the_opt_ins_the_state_is_flashbaxs():
    fbx = pytest.importorskip("flashbax")
    item = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
    kw = dict(
        add_batch_size=2,
        sample_batch_size=4,
        sample_sequence_length=3,
        period=1,
        min_length_time_axis=3,
        max_length_time_axis=8,
    )
    builders = [
        (
            ours.make_trajectory_buffer(**kw),
            ours.make_trajectory_buffer(**kw, episodes=False),
            fbx.make_trajectory_buffer(**kw),
        ),
        (
            ours.make_flat_buffer(32, 2, 4),
            ours.make_flat_buffer(32, 2, 4, sample_once=False),
            fbx.make_flat_buffer(32, 2, 4),
        ),
        (
            ours.make_item_buffer(16, 2, 4),
            ours.make_item_buffer(16, 2, 4, sample_once=False),
            fbx.make_item_buffer(16, 2, 4),
        ),
    ]
    for mine, explicit, theirs in builders:
        with jax.numpy_rank_promotion("allow"):
            want = structure(theirs.init(item))
        for b in (mine, explicit):
            state = b.init(item)
            assert type(state) is TrajectoryBufferState and structure(state) == want


# ------------------------------------------------------------------ episodes (#23)
def episode_steps(rows_lengths, total):
    """Per row, ``total`` steps of consecutive episodes (the last one extended and running):
    ``(ep id, step in episode, done)`` arrays ``[E, total]``, ids unique over rows."""
    out = []
    for r, lengths in enumerate(rows_lengths):
        lengths = list(lengths)
        lengths[-1] += max(total - sum(lengths), 0)
        row = [
            (100 * r + k, i, i == n - 1 and k < len(lengths) - 1)
            for k, n in enumerate(lengths)
            for i in range(n)
        ][:total]
        out.append(row)
    a = np.array(out)
    return a[..., 0].astype(np.int32), a[..., 1].astype(np.int32), a[..., 2].astype(bool)


def whole_episodes(ep, idx, done, n, row_cap):
    """Reference: ``{episode id: length}`` of the episodes stored whole and ended."""
    out = {}
    for r in range(ep.shape[0]):
        lo = max(0, n - row_cap)
        e, i, d = ep[r, lo:n], idx[r, lo:n], done[r, lo:n]
        for k in set(e.tolist()):
            at = np.flatnonzero(e == k)
            if i[at[0]] == 0 and d[at[-1]]:
                out[k] = len(at)
    return out


@functools.cache
def episode_buffer(jit):
    buffer = ours.make_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=6,
        sample_sequence_length=4,
        period=1,
        min_length_time_axis=1,
        max_length_time_axis=8,
        end_key="done",
        episodes=True,
    )
    if jit:
        buffer = buffer.replace(
            add=jax.jit(buffer.add),
            sample=jax.jit(buffer.sample),
            can_sample=jax.jit(buffer.can_sample),
        )
    return buffer


@fixture_ok
@given(
    lengths=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=8), min_size=2, max_size=2),
    steps=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_episodes_are_whole_never_mixed_and_padding_masked(maybe_jit, lengths, steps, seed):
    buffer = episode_buffer(maybe_jit is jax.jit)
    ep, idx, done = episode_steps(lengths, sum(steps))
    state = buffer.init({"ep": jnp.int32(0), "i": jnp.int32(0), "done": jnp.bool_(False)})
    assert isinstance(state, WholeEpisodeBufferState)
    key, n = jax.random.PRNGKey(seed), 0
    for t in steps:
        state = buffer.add(
            state, {"ep": ep[:, n : n + t], "i": idx[:, n : n + t], "done": done[:, n : n + t]}
        )
        n += t
        whole = whole_episodes(ep, idx, done, n, 8)
        assert bool(buffer.can_sample(state)) == bool(whole)
        key, k = jax.random.split(key)
        if not whole and maybe_jit is not jax.jit:
            with pytest.raises(ValueError, match="no whole episode is stored yet"):
                buffer.sample(state, k)
            continue
        s = buffer.sample(state, k)
        assert isinstance(s, MaskedTrajectoryBufferSample)
        mask, eps, ix = (np.asarray(x) for x in (s.mask, s.experience["ep"], s.experience["i"]))
        assert mask.shape == eps.shape == (6, 4)
        if not whole:
            assert not mask.any()
            continue
        for row in range(6):
            m = int(mask[row].sum())
            assert mask[row, :m].all(), "padding only after the episode"
            k0 = int(eps[row, 0])
            assert k0 in whole and (eps[row, :m] == k0).all(), "one whole episode per row"
            assert ix[row, :m].tolist() == list(range(m)) and m == min(whole[k0], 4)


def test_episode_errors_name_the_argument():
    kw = dict(
        add_batch_size=1,
        sample_batch_size=2,
        sample_sequence_length=4,
        period=1,
        min_length_time_axis=1,
        max_length_time_axis=8,
    )
    with pytest.raises(ValueError, match="episodes=True needs end_key.*got end_key=None"):
        ours.make_trajectory_buffer(**kw, episodes=True)
    with pytest.raises(TypeError, match="episodes must be a Python bool, got 'yes'"):
        ours.make_trajectory_buffer(**kw, end_key="done", episodes="yes")
    buffer = ours.make_trajectory_buffer(**kw, end_key="done", episodes=True)
    with pytest.raises(ValueError, match=r"episodes=True\).init: .*end_key=\('done',\)"):
        buffer.init({"obs": jnp.zeros(2)})


# ------------------------------------------------------------------ sample once (#59)
def done_of(ids):
    return ids % 5 == 0


class PairModel:
    """The flat buffer's rows: the ids stored per row (time order) and the transitions drawn."""

    def __init__(self, rows, length, end_key):
        self.rows = [[] for _ in range(rows)]
        self.length, self.end_key, self.drawn = length, end_key, set()

    def add(self, ids):  # [E, T]
        for r, row in enumerate(self.rows):
            row.extend(ids[r].tolist())
            del row[: max(0, len(row) - self.length)]

    def drawable(self):
        """``{first id: second id}`` of the transitions that may be drawn now."""
        out = {}
        for row in self.rows:
            for a, b in zip(row, row[1:]):
                if a not in self.drawn and not (self.end_key and done_of(a)):
                    out[a] = b
        return out


@functools.cache
def flat_buffer(jit, end_key):
    buffer = ours.make_flat_buffer(
        max_length=12,
        min_length=2,
        sample_batch_size=3,
        add_sequences=True,
        add_batch_size=2,
        end_key="done" if end_key else None,
        sample_once=True,
    )
    if jit:
        buffer = buffer.replace(
            add=jax.jit(buffer.add),
            sample=jax.jit(buffer.sample),
            can_sample=jax.jit(buffer.can_sample),
        )
    return buffer


@fixture_ok
@given(
    end_key=st.booleans(),
    ops=st.lists(st.one_of(st.integers(1, 6), st.just(0)), min_size=1, max_size=14),
    seed=st.integers(0, 2**16),
)
def test_flat_transitions_drawn_at_most_once_until_rewritten(maybe_jit, end_key, ops, seed):
    """``ops``: a positive number adds that many steps to both rows, 0 samples."""
    buffer = flat_buffer(maybe_jit is jax.jit, end_key)
    model = PairModel(2, 6, end_key)
    state = buffer.init({"id": jnp.int32(0), "done": jnp.bool_(False)})
    assert isinstance(state, SampleOnceBufferState) and state.used.shape == (2, 6)
    key, counter = jax.random.PRNGKey(seed), 1
    for t in ops:
        if t:
            ids = (counter + np.arange(2 * t, dtype=np.int32)).reshape(t, 2).T  # [rows, T]
            counter += 2 * t
            model.add(ids)
            state = buffer.add(state, {"id": ids, "done": done_of(ids)})
            continue
        drawable = model.drawable()
        assert bool(buffer.can_sample(state)) == (len(drawable) >= 3)
        key, k = jax.random.split(key)
        if len(drawable) < 3 and maybe_jit is not jax.jit:
            with pytest.raises(ValueError, match="sample_once=True.*sample_batch_size=3"):
                buffer.sample(state, k)
            continue
        used = np.asarray(state.used)
        s, state = buffer.sample(state, k)
        assert isinstance(s, MaskedTransitionSample)
        first = np.asarray(s.experience.first["id"]).tolist()
        second = np.asarray(s.experience.second["id"]).tolist()
        if len(drawable) < 3:  # under jit: nothing drawn, nothing spent
            assert not np.asarray(s.mask).any()
            np.testing.assert_array_equal(np.asarray(state.used), used)
            continue
        assert np.asarray(s.mask).all() and len(set(first)) == 3
        assert all(drawable.get(a) == b for a, b in zip(first, second)), (first, second)
        model.drawn |= set(first)


@fixture_ok
@given(
    ops=st.lists(st.one_of(st.integers(1, 8), st.just(0)), min_size=1, max_size=14),
    seed=st.integers(0, 2**16),
)
def test_items_drawn_at_most_once_until_rewritten(maybe_jit, ops, seed):
    buffer = ours.make_item_buffer(
        max_length=8, min_length=1, sample_batch_size=3, add_batches=True, sample_once=True
    )
    if maybe_jit is jax.jit:
        buffer = buffer.replace(add=jax.jit(buffer.add), sample=jax.jit(buffer.sample))
    state = buffer.init({"id": jnp.int32(0)})
    stored, drawn, counter = [], set(), 1
    key = jax.random.PRNGKey(seed)
    for t in ops:
        if t:
            ids = counter + np.arange(t, dtype=np.int32)
            counter += t
            stored = (stored + ids.tolist())[-8:]
            state = buffer.add(state, {"id": ids})
            continue
        left = set(stored) - drawn
        key, k = jax.random.split(key)
        if len(left) < 3 and maybe_jit is not jax.jit:
            with pytest.raises(ValueError, match="sample_once=True"):
                buffer.sample(state, k)
            continue
        s, state = buffer.sample(state, k)
        got = np.asarray(s.experience["id"]).tolist()
        assert bool(np.asarray(s.mask).all()) == (len(left) >= 3)
        if len(left) >= 3:
            assert len(set(got)) == 3 and set(got) <= left
            drawn |= set(got)


def test_a_rewritten_item_is_drawable_again():
    buffer = ours.make_item_buffer(
        max_length=4, min_length=1, sample_batch_size=4, add_batches=True, sample_once=True
    )
    state = buffer.add(buffer.init({"id": jnp.int32(0)}), {"id": jnp.arange(4)})
    s, state = buffer.sample(state, jax.random.PRNGKey(0))
    assert sorted(np.asarray(s.experience["id"]).tolist()) == [0, 1, 2, 3]
    assert not bool(buffer.can_sample(state))
    state = buffer.add(state, {"id": jnp.arange(10, 14)})  # every slot rewritten
    s, state = jax.jit(buffer.sample)(state, jax.random.PRNGKey(1))
    assert sorted(np.asarray(s.experience["id"]).tolist()) == [10, 11, 12, 13]


def test_sample_once_errors_name_the_argument():
    with pytest.raises(TypeError, match="make_flat_buffer: sample_once must be a Python bool"):
        ours.make_flat_buffer(32, 2, 4, sample_once=1)
    with pytest.raises(TypeError, match="make_item_buffer: sample_once must be a Python bool"):
        ours.make_item_buffer(16, 2, 4, sample_once="no")
    # one row of 4 steps holds 3 transitions: a batch of 4 distinct ones could never be drawn
    with pytest.raises(ValueError, match="sample_batch_size=4 exceeds the 3 transitions"):
        ours.make_flat_buffer(4, 2, 4, sample_once=True)
    buffer = ours.make_flat_buffer(16, 2, 2, end_key="done", sample_once=True)
    with pytest.raises(ValueError, match=r"end_key='done'\).init: key \('done',\) is not in"):
        buffer.init({"obs": jnp.zeros(2)})


def test_opt_in_states_round_trip_through_a_checkpoint(tmp_path):
    episodes = episode_buffer(False)
    flat = flat_buffer(False, True)
    states = {
        "episodes": episodes.add(
            episodes.init({"ep": jnp.int32(0), "i": jnp.int32(0), "done": jnp.bool_(False)}),
            {
                "ep": jnp.zeros((2, 3), jnp.int32),
                "i": jnp.zeros((2, 3), jnp.int32),
                "done": jnp.ones((2, 3), bool),
            },
        ),
        "flat": flat.add(
            flat.init({"id": jnp.int32(0), "done": jnp.bool_(False)}),
            {"id": jnp.ones((2, 4), jnp.int32), "done": jnp.zeros((2, 4), bool)},
        ),
    }
    for name, state in states.items():
        frb.checkpoint.save(tmp_path / name, state)
        loaded = frb.checkpoint.load(tmp_path / name)
        assert type(loaded) is type(state)
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, state
        )
