"""functional_rb.testing.assert_invariants: each rule passes on a state the library built and
fails, naming itself, on a state corrupted the way the rule guards against; eagerly, and under
jax.jit / jax.vmap as a host callback."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb.samplers import sum_tree
from functional_rb.testing import InvariantError, assert_invariants
from functional_rb.testing._data import StepStream
from functional_rb.testing.strategies import episode_example

EX = {"obs": jnp.zeros((2,), jnp.float32), "next": {"done": jnp.zeros((1,), bool)}}
# 13 steps into 10 slots: episodes of 3, 4, 2 and a running one of 4; the oldest 3 steps
# (the first episode) are overwritten, so the ring wraps
DONE = np.zeros(13, bool)
DONE[[2, 6, 8]] = True


_BUFFERS: dict = {}


def _rb(**kw):
    """One buffer object per configuration: the eager methods' compilations are cached per
    buffer object, so the cases that share a configuration share them."""
    return _BUFFERS.setdefault(tuple(sorted(kw.items())), frb.ReplayBuffer(**kw))


def _steps(done):
    n = len(done)
    return {
        "obs": np.stack([np.arange(n), -np.arange(n)], 1).astype(np.float32),
        "next": {"done": np.asarray(done)[:, None]},
    }


def _episodes(sampler, capacity=10, **kw):
    rb = _rb(capacity=capacity, sampler=sampler, batch_size=6, **kw)
    return rb, rb.add(rb.init(EX), _steps(DONE))


def _stream(rb, sizes, seed=0, p_end=0.25):
    ex = episode_example(rb.ndim, 2)
    stream = StepStream(ex, ndim=rb.ndim, seed=seed, p_end=p_end)
    state = rb.init(ex)
    for n in sizes:
        state = rb.add(state, stream.take(n, n))
    return state


def _counters(state, **changes):
    """``state.writer``'s counters with ``cursor`` / ``filled`` replaced."""
    w = state.writer
    new = {"cursor": w.cursor, "filled": w.filled, **changes}
    return frb.RoundRobinState.of(new["cursor"], new["filled"]).counters


def _with(state, part, **changes):
    """``state`` with fields of ``state.<part>`` (a dotted path of dataclasses) replaced."""
    names = part.split(".")
    chain = [state]
    for n in names:
        chain.append(getattr(chain[-1], n))
    new = dataclasses.replace(chain[-1], **changes)
    for obj, n in zip(reversed(chain[:-1]), reversed(names)):
        new = dataclasses.replace(obj, **{n: new})
    return new


def _set(x, i, v):
    return jnp.asarray(x).at[i].set(v)


def _with_nodes(state, **flat):
    """``state`` with its sum tree's internal nodes given in flat numbering (``sums=``,
    ``mins=``, the tree's read-back properties)."""
    t = state.sampler.tree
    fields = dict(values=t.values, sums=t.sums, mins=t.mins, capacity=t.capacity, fanout=t.fanout)
    fields.update(flat)
    return _with(state, "sampler", tree=sum_tree.SumTreeState.from_saved(**fields))


# ------------------------------------------------------------------ the corruptions
def state_from_another_buffer():
    rb = _rb(capacity=8, batch_size=2)
    other = _rb(capacity=4, batch_size=2)
    return rb, rb.init(EX), other.init(EX)


def filled_beyond_capacity():
    rb = _rb(capacity=8, batch_size=2)
    state = _stream(rb, [5])
    return rb, state, _with(state, "writer", counters=_counters(state, filled=9))


def cursor_out_of_range():
    rb = _rb(capacity=8, batch_size=2)
    state = _stream(rb, [9])
    return rb, state, _with(state, "writer", counters=_counters(state, cursor=8))


def cursor_behind_filled():
    rb = _rb(capacity=8, batch_size=2)
    state = _stream(rb, [5])
    return rb, state, _with(state, "writer", counters=_counters(state, cursor=2))


def max_value_rank_table():
    rb = _rb(capacity=8, batch_size=2, writer=frb.MaxValueWriter(("next", "reward")))
    state = _stream(rb, [5, 6])
    ranks = state.writer.ranks
    return rb, state, _with(state, "writer", ranks=_set(ranks, 0, ranks[0] + 1))


def _per(capacity, fill, **kw):
    rb = _rb(capacity=capacity, batch_size=2, sampler=frb.PrioritizedSampler(**kw))
    return rb, _stream(rb, [fill])


def tree_padding_written():
    rb, state = _per(40, 40)  # 40 leaves padded to 48
    tree = state.sampler.tree
    return rb, state, _with(state, "sampler.tree", values=_set(tree.values, 44, 1.0))


def negative_leaf():
    rb, state = _per(40, 5)
    return rb, state, _with(state, "sampler.tree", values=_set(state.sampler.tree.values, 0, -1.0))


def stale_node_sum():
    rb, state = _per(40, 40)  # two levels: 48 leaves, 16 nodes
    tree = state.sampler.tree
    return rb, state, _with_nodes(state, sums=_set(tree.sums, 0, tree.sums[0] + 1.0))


def stale_node_minimum():
    rb, state = _per(40, 40)
    tree = state.sampler.tree
    return rb, state, _with_nodes(state, mins=_set(tree.mins, 0, tree.mins[0] / 2))


def drifted_total():
    """Each node within 1e-6 of the sum of its children, but the errors add up along the
    path to the root: only the total rule sees it (what delta updates would do)."""
    rb, state = _per(300, 300, alpha=1.0)  # levels: 304 leaves, 32 + 16 nodes
    prio = np.ones(300, np.float32)
    prio[0] = 1e6
    state = rb.update(state, jnp.arange(300, dtype=jnp.int32), jnp.asarray(prio))
    tree = state.sampler.tree
    sums = np.asarray(tree.sums).copy()
    sums[0] = np.float32(sums[0] * (1 + 0.9e-6))  # level 1, node 0
    sums[32] = np.float32(sums[:16].astype(np.float64).sum() * (1 + 0.9e-6))  # level 2, node 0
    return rb, state, _with_nodes(state, sums=jnp.asarray(sums))


def priority_on_empty_slot():
    rb, state = _per(40, 5)
    tree = sum_tree.set(state.sampler.tree, jnp.array([6], jnp.int32), jnp.array([1.0]))
    return rb, state, _with(state, "sampler", tree=tree)


def priority_above_maximum():
    rb, state = _per(40, 5)
    tree = sum_tree.set(state.sampler.tree, jnp.array([0], jnp.int32), jnp.array([100.0]))
    return rb, state, _with(state, "sampler", tree=tree)


def epoch_draws_twice():
    rb = _rb(capacity=8, batch_size=2, sampler=frb.SamplerWithoutReplacement())
    _, state = rb.sample(_stream(rb, [5]), jax.random.key(0))
    perm = state.sampler.perm
    return rb, state, _with(state, "sampler", perm=_set(perm, 0, perm[1]))


def slice_total_miscounted():
    rb = _rb(capacity=10, sampler=frb.SliceSampler(slice_len=2), batch_size=6)
    state = rb.add(rb.init(EX), _steps(DONE[:5]))  # 5 steps counted by the records...
    return (
        rb,
        state,
        _with(state, "sampler", counters=state.sampler.counters.at[:, 3].set(6)),
    )  # ... made 6


def slice_head_skips_a_record():
    rb, state = _episodes(frb.SliceSampler(slice_len=2))
    return rb, state, _with(state, "sampler", counters=state.sampler.counters.at[:, 0].add(1))


def slice_record_moved():
    rb, state = _episodes(frb.SliceSampler(slice_len=2))
    st = state.sampler
    k = int(st.head[0]) + 1  # a record in the middle: its start moves one step later
    rec = st.rec_start.at[0, k % 10].add(1)
    return rb, state, _with(state, "sampler", rec_start=rec)


def prioritized_slice_validity():
    rb, state = _episodes(frb.PrioritizedSliceSampler(alpha=0.7, beta=0.5, slice_len=3))
    valid = state.sampler.valid
    i = int(np.flatnonzero(np.asarray(valid))[0])
    tree = sum_tree.set(state.sampler.tree, jnp.array([i], jnp.int32), jnp.array([0.0]))
    return rb, state, _with(state, "sampler", valid=_set(valid, i, False), tree=tree)


def _ted(frame_stack=3):
    rb = _rb(
        capacity=8, batch_size=2, storage=frb.TEDStorage(min_episode_len=1, frame_stack=frame_stack)
    )
    return rb, _stream(rb, [5, 6], p_end=0.5)


def ted_side_row_stolen():
    rb, state = _ted()  # (one configuration, frame stacks included, for the four TED rules)
    ptr, owner = np.asarray(state.storage.ptr), np.asarray(state.storage.owner)
    i = int(np.flatnonzero(ptr >= 0)[0])
    return rb, state, _with(state, "storage", owner=_set(owner, ptr[i], (i + 1) % 8))


def ted_lost():
    rb, state = _ted()
    counts = state.storage.counts  # (head, lost)
    return rb, state, _with(state, "storage", counts=counts.at[1].set(1))


def ted_carry():
    rb, state = _ted()
    carry = state.storage.carry  # (carry_dist, carry_end) per row
    return rb, state, _with(state, "storage", carry=carry.at[:, 1].set(1 - carry[:, 1]))


def ted_distance():
    rb, state = _ted()
    cursor = int(state.writer.cursor)  # the oldest stored step of a full ring; then its successor
    nxt = (cursor + 1) % 8
    rows = state.storage.rows  # column 1: the distances
    d = (int(rows[nxt, 1]) + 1) % 3
    return rb, state, _with(state, "storage", rows=rows.at[nxt, 1].set(d))


def generation_older_than_an_earlier_item():
    rb, state = _episodes(frb.PrioritizedSampler())
    state = rb.add(state, _steps(np.zeros(2, bool)))  # the newest two slots: generation 2
    newest = (int(state.writer.cursor) - 1) % 10
    return rb, state, _with(state, "generations", slots=_set(state.generations.slots, newest, 1))


CASES = {
    "state matches the buffer": state_from_another_buffer,
    "size within capacity": filled_beyond_capacity,
    "writer counters in range": cursor_out_of_range,
    "ring cursor follows filled": cursor_behind_filled,
    "max-value ranks match the stored items": max_value_rank_table,
    "sum-tree layout": tree_padding_written,
    "sum-tree leaves finite and non-negative": negative_leaf,
    "sum-tree node sums": stale_node_sum,
    "sum-tree node minima": stale_node_minimum,
    "sum-tree total": drifted_total,
    "priorities only on stored items": priority_on_empty_slot,
    "priorities at most the running maximum": priority_above_maximum,
    "without-replacement epoch": epoch_draws_twice,
    "slice counters": slice_total_miscounted,
    "slice records tile the stored steps": slice_head_skips_a_record,
    "slice records match the stored episode boundaries": slice_record_moved,
    "prioritized slice starts": prioritized_slice_validity,
    "TED side table links": ted_side_row_stolen,
    "TED next observations not lost": ted_lost,
    "TED episode carry": ted_carry,
    "TED frame-stack distances": ted_distance,
    "write generations": generation_older_than_an_earlier_item,
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_fails_on_the_corruption_it_guards_against(rule):
    rb, good, bad = CASES[rule]()
    assert_invariants(rb, good)
    with pytest.raises(InvariantError, match=f'assert_invariants: rule "{rule}" is broken') as e:
        assert_invariants(rb, bad)
    assert e.value.rule == rule and isinstance(e.value, AssertionError)


def test_every_documented_rule_has_a_corruption_test():
    from functional_rb.testing import invariants

    documented = {
        line.split("``")[1] for line in invariants.__doc__.splitlines() if line.startswith("* ``")
    }
    assert documented == set(CASES)


def test_under_jit_and_vmap_a_host_callback_checks_each_state():
    rb, good, bad = priority_on_empty_slot()

    @jax.jit
    def step(state):
        assert_invariants(rb, state)  # a debug mode inside a compiled training step
        return rb.add(state, jax.tree_util.tree_map(lambda x: x[None], episode_example()))

    step(good).writer.filled.block_until_ready()
    with pytest.raises(Exception, match='rule "priorities only on stored items" is broken'):
        step(bad).writer.filled.block_until_ready()
    states = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), good, bad)
    with pytest.raises(Exception, match='rule "priorities only on stored items" is broken'):
        jax.vmap(step)(states).writer.filled.block_until_ready()
    jax.vmap(step)(jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), good))


def test_a_population_gets_a_hint():
    rb = _rb(capacity=8, batch_size=2)
    states = jax.vmap(rb.init)(jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), EX))
    with pytest.raises(InvariantError, match=r'"state matches the buffer".*jax.vmap'):
        assert_invariants(rb, states)


def test_sum_tree_rows_split_elsewhere_break_the_layout_rule():
    """The same flat sums and minima with a row moved from ``top`` into ``nodes`` (a tree built
    for another split) fail "sum-tree layout", naming the array."""
    rb, state = _per(40, 40)
    tree = state.sampler.tree
    moved = dataclasses.replace(tree, nodes=tree.top[:, :1], top=tree.top[:, 1:])
    assert np.array_equal(np.asarray(moved.sums), np.asarray(tree.sums))
    bad = _with(state, "sampler", tree=moved)
    with pytest.raises(InvariantError, match=r"state\.sampler\.tree\.nodes has shape \[2, 1, 16\]"):
        assert_invariants(rb, bad)
