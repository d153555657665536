"""Every sampler, writer and storage sharded: global epochs without replacement (items and
slices, shuffled or in storage order), prioritized slices with their weights and update
routing, [env, time] TED storage, MaxValueWriter and ImmutableWriter per shard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shards import WOR, build, draws, mesh, unstack

import functional_rb as frb

N = 4


def _valid(out):
    return out.indices[out.mask]


def test_global_epochs_visit_every_item_once():
    cap, b = WOR.capacity, WOR.batch_size
    srb = frb.ShardedReplayBuffer(WOR, mesh(N))
    fills = [16, 3, 11, 5]
    state = build(srb, [s * cap + np.arange(f) for s, f in enumerate(fills)])
    stored = sorted(s * cap + i for s, f in enumerate(fills) for i in range(f))
    per_epoch = -(-len(stored) // (N * b))  # 3 global batches of 16: 16 + 16 + 3
    out, state = draws(srb, state, steps=2 * per_epoch)
    batches = out.indices.reshape(2 * per_epoch, N * b)
    masks = out.mask.reshape(2 * per_epoch, N * b)
    for e in range(2):
        seen = np.concatenate(
            [batches[e * per_epoch + i][masks[e * per_epoch + i]] for i in range(per_epoch)]
        )
        assert sorted(seen.tolist()) == stored  # each item exactly once
    assert masks[per_epoch - 1].sum() == len(stored) % (N * b)  # the last batch is padded
    np.testing.assert_array_equal(out.data["id"][out.mask], _valid(out))
    assert np.all(out.weights[~out.mask] == 0)
    # the shards are interleaved: each device's rows come from several shards
    owners = batches[0].reshape(N, b) // cap
    assert all(len(set(row)) > 1 for row in owners)
    # items added mid-epoch: a new global epoch begins at the next sample
    out, state = draws(srb, state, steps=1)
    state = srb.add(state, {"id": np.arange(N, dtype=np.int32) * cap + 15})
    assert np.all(np.asarray(state.shards.sampler.epoch) == 3)
    out, state = draws(srb, state, steps=1)
    assert np.all(np.asarray(state.shards.sampler.epoch) == 4)


def test_local_epochs_are_each_shards_own():
    cap, b = WOR.capacity, WOR.batch_size
    srb = frb.ShardedReplayBuffer(WOR, mesh(N), sampling="local")
    state = build(srb, [s * cap + np.arange(8) for s in range(N)])
    out, _ = draws(srb, state, steps=2)
    idx = out.indices.reshape(2, N, b)
    for d in range(N):
        assert sorted(idx[:, d].reshape(-1).tolist()) == list(range(d * cap, d * cap + 8))


def test_dataset_in_storage_order_with_immutable_writer():
    """ImmutableWriter, filled by init_from_data (shard d: block d), read without replacement
    in storage order: the global batches are the single buffer's, in order."""
    per, b = 10, 4
    rb = frb.ReplayBuffer(
        per,
        sampler=frb.SamplerWithoutReplacement(shuffle=False),
        writer=frb.ImmutableWriter(),
        batch_size=b,
    )
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    state = srb.init_from_data({"id": np.arange(N * per, dtype=np.int32)})
    with pytest.raises(RuntimeError, match="read-only"):
        srb.add(state, {"id": np.zeros(N, np.int32)})
    out, _ = draws(srb, state, steps=3)
    order = out.indices[out.mask]
    np.testing.assert_array_equal(out.data["id"][out.mask], np.arange(N * per))
    np.testing.assert_array_equal(order, np.arange(N * per) // per * per + np.arange(N * per) % per)


def _episodes(n, steps, length):
    done = (np.arange(steps) % length) == length - 1
    return {"id": np.arange(n * steps, dtype=np.int32), "next": {"done": np.tile(done, n)}}


def test_slice_epochs_visit_every_trajectory_once():
    cap, seq = 16, 2
    sampler = frb.SliceSamplerWithoutReplacement(slice_len=seq)
    rb = frb.ReplayBuffer(cap, sampler=sampler, batch_size=2 * seq)
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    data = _episodes(N, 12, 4)  # 3 trajectories of 4 steps per shard: 12 in all
    state = srb.add(srb.init(jax.tree_util.tree_map(lambda x: x[0], data)), data)
    out, _ = draws(srb, state, steps=2)  # 8 slices per global batch: 8 + 4 (+ padding)
    starts = out.data["id"][:, 0][out.mask[:, 0]]
    assert sorted(starts // 4) == list(range(12))  # one slice per trajectory
    np.testing.assert_array_equal(out.data["id"], out.indices // cap * 12 + out.indices % cap)


def test_prioritized_slices_weights_and_update_routing():
    cap, seq = 16, 3
    sampler = frb.PrioritizedSliceSampler(alpha=1.0, beta=1.0, slice_len=seq, strict_length=False)
    rb = frb.ReplayBuffer(cap, sampler=sampler, batch_size=4 * seq)
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    data = _episodes(N, 12, 4)
    state = srb.add(srb.init(jax.tree_util.tree_map(lambda x: x[0], data)), data)
    smp, state = srb.sample(state, jax.random.key(0))
    idx = np.asarray(smp.indices)
    pri = np.arange(idx.size, dtype=np.float32).reshape(idx.shape) + 1.0
    state = srb.update(state, idx, pri)
    # each shard holds, for the steps it owns, the last priority given in the global order
    # (a slice's padding repeats its last index and is ignored)
    want = {}
    for r in range(idx.shape[0]):
        for c in range(seq):
            if c == 0 or idx[r, c] != idx[r, c - 1]:
                want[int(idx[r, c])] = pri[r, c]
    for s, local in enumerate(unstack(state)):
        for g, p in want.items():
            if g // cap == s:
                assert local.sampler.prio[g % cap] == pytest.approx(p)
        assert float(local.sampler.max_priority) == pytest.approx(pri.max())
    # weights: (min_j v_j / v_i) ** beta over the valid starts of all shards
    smp, state = srb.sample(state, jax.random.key(1))
    trees = [np.asarray(local.sampler.tree.values)[:cap] for local in unstack(state)]
    vmin = min(t[t > 0].min() for t in trees)
    start = np.asarray(smp.indices)[:, 0]
    v = np.array([trees[g // cap][g % cap] for g in start])
    np.testing.assert_allclose(np.asarray(smp.weights)[:, 0], vmin / v, rtol=1e-5)


def test_ted_storage_two_dim_rows_sampled_globally():
    """TEDStorage over [env, time] rows: next observations rebuilt from the owner's rows."""
    envs, row, t = 2, 8, 5
    rb = frb.ReplayBuffer(
        envs * row, storage=frb.TEDStorage(min_episode_len=1), ndim=2, batch_size=16
    )
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    obs = np.arange(N * envs * (t + 1), dtype=np.float32).reshape(N * envs, t + 1)
    items = {
        "observation": obs[:, :-1],
        "action": np.zeros((N * envs, t), np.int32),
        "next": {
            "observation": obs[:, 1:],
            "reward": np.ones((N * envs, t), np.float32),
            "done": np.zeros((N * envs, t), bool),
        },
    }
    example = jax.tree_util.tree_map(lambda x: x[:envs, 0], items)
    state = srb.add(srb.init(example), items)
    assert int(srb.size(state)) == N * envs * t
    out, _ = draws(srb, state, steps=4)
    assert out.mask.all()
    np.testing.assert_array_equal(out.data["next"]["observation"], out.data["observation"] + 1)
    shard, pos = out.indices // (envs * row), out.indices % (envs * row)
    env, step = pos // row, pos % row
    np.testing.assert_array_equal(out.data["observation"], obs[shard * envs + env, step])


def test_max_value_writer_keeps_each_shards_best():
    cap = 4
    rb = frb.ReplayBuffer(
        cap,
        sampler=frb.PrioritizedSampler(alpha=0.6, beta=0.4),
        writer=frb.MaxValueWriter(rank_key="rank"),
        batch_size=4,
    )
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    rank = np.random.default_rng(0).permutation(N * 8).astype(np.float32)
    state = srb.add(srb.init({"rank": np.float32(0)}), {"rank": rank})
    for s, local in enumerate(unstack(state)):
        kept = np.sort(np.asarray(local.storage.slabs["float32"])[:, 0])
        np.testing.assert_array_equal(kept, np.sort(rank[s * 8 : (s + 1) * 8])[-cap:])
    smp, state = srb.sample(state, jax.random.key(0))
    state = srb.update(state, smp.indices, jnp.ones(N * 4))
    assert np.asarray(smp.mask).all()
