"""Write generations in sharded buffers: a delayed priority update across the ring wraparound
of every shard never moves a newer item's priority; the owner of each entry drops and counts
it (global and local sampling, items and slices, eagerly and under jit, and the per-shard
axis_name= path inside one's own shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shards import mesh, unstack
from jax.sharding import PartitionSpec as P

import functional_rb as frb

N, CAP = 8, 8
EX = {"x": jnp.zeros((), jnp.float32), "next": {"done": jnp.asarray(False)}}
SAMPLERS = {
    "items": frb.PrioritizedSampler(alpha=1.0, beta=0.5, eps=0.0),
    "slices": frb.PrioritizedSliceSampler(alpha=1.0, beta=0.5, eps=0.0, slice_len=2),
}


def _items(n_per_shard, start):
    i = np.arange(N * n_per_shard) + start
    return {"x": i.astype(np.float32), "next": {"done": (i % 4) == 3}}


def _values(local, sampler_name):
    if sampler_name == "items":
        return np.asarray(frb.sum_tree.get(local.sampler.tree, jnp.arange(CAP)))
    return np.asarray(local.sampler.prio)


@functools.cache
def _buffer(name, sampling):
    rb = frb.ReplayBuffer(capacity=CAP, batch_size=8, sampler=SAMPLERS[name])
    return frb.ShardedReplayBuffer(rb, mesh(N), sampling=sampling)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("sampling", ["global", "local"])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_delayed_updates_across_the_wraparound_skip_newer_items(name, sampling, jit):
    srb = _buffer(name, sampling)
    update = jax.jit(srb.update) if jit else srb.update
    state = srb.add(srb.init(EX), _items(CAP - 2, 0))
    smp, state = srb.sample(state, jax.random.key(5))
    state = srb.add(state, _items(3, 100))  # each shard rewrites slots 6, 7, 0
    before = [_values(s, name) for s in unstack(state)]
    state = update(state, smp, jnp.full(smp.indices.shape, 40.0))
    after = [_values(s, name) for s in unstack(state)]
    idx, mask = np.asarray(smp.indices), np.asarray(smp.mask)
    gens = np.asarray(smp.generations)
    assert (gens[mask] == 1).all() and (gens[~mask] == -1).all()
    shard, pos = idx // CAP, idx % CAP
    stale = np.isin(pos, [6, 7, 0]) & mask
    assert stale.any() and (mask & ~stale).any()
    for s in range(N):
        rewritten = np.array([6, 7, 0])
        np.testing.assert_array_equal(after[s][rewritten], before[s][rewritten])
        fresh = np.unique(pos[(shard == s) & mask & ~stale])
        np.testing.assert_allclose(after[s][fresh], 40.0)
    assert int(srb.dropped_updates(state)) == int(stale.sum())
    per_shard = [int(s.generations.dropped) for s in unstack(state)]
    assert per_shard == [int((stale & (shard == s)).sum()) for s in range(N)]


def test_bare_indices_are_applied_as_before():
    srb = _buffer("items", "global")
    state = srb.add(srb.init(EX), _items(CAP, 0))
    smp, state = srb.sample(state, jax.random.key(0))
    state = srb.add(state, _items(CAP, 100))  # every slot rewritten
    state = srb.update(state, smp.indices, jnp.full(smp.indices.shape, 7.0))
    assert int(srb.dropped_updates(state)) == 0
    idx = np.asarray(smp.indices)
    for s, local in enumerate(unstack(state)):
        np.testing.assert_allclose(
            _values(local, "items")[np.unique(idx[idx // CAP == s] % CAP)], 7.0
        )


def test_per_shard_calls_in_ones_own_shard_map():
    srb = _buffer("items", "global")
    rb = srb.buffer
    state = srb.add(srb.init(EX), _items(CAP - 2, 0))

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=srb.mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P())
    )
    def step(block, key):
        local = srb.local(block)
        smp, local = rb.sample(local, key, axis_name="data")
        local = rb.add(
            local,
            jax.tree_util.tree_map(
                jnp.asarray, {"x": jnp.zeros(3), "next": {"done": jnp.zeros(3, bool)}}
            ),
        )
        local = rb.update(local, smp, jnp.full(smp.indices.shape, 3.0), axis_name="data")
        return srb.block(local), rb.dropped_updates(local, axis_name="data")

    state, dropped = step(state, jax.random.key(1))
    assert int(dropped) == int(srb.dropped_updates(state)) > 0


def test_samplers_without_priorities_keep_no_generations_in_shards():
    rb = frb.ReplayBuffer(capacity=CAP, batch_size=8)
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    state = srb.add(srb.init(EX), _items(CAP, 0))
    smp, state = srb.sample(state, jax.random.key(0))
    assert smp.generations is None and int(srb.dropped_updates(state)) == 0
    assert srb.update(state, smp, 1.0) is state  # no priorities: a no-op
