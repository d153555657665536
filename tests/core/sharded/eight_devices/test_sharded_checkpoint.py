"""Checkpoints of sharded states: stored shard by shard (never gathered), restored onto the same
mesh shape, a clear error for another one, damage named by file."""

import json
import os

import jax
import numpy as np
import pytest
from _shards import EXAMPLE, PRIO, mesh
from _trees import assert_trees_equal

import functional_rb as frb

N, B = 4, PRIO.batch_size


def _state(srb):
    state = srb.add(srb.init(EXAMPLE), {"id": np.arange(N * 5, dtype=np.int32)})
    smp, state = srb.sample(state, jax.random.key(0))
    return srb.update(state, smp.indices, np.arange(N * B, dtype=np.float32))


def test_sharded_state_round_trips_shard_by_shard(tmp_path):
    srb = frb.ShardedReplayBuffer(PRIO, mesh(N))
    state = _state(srb)
    path = tmp_path / "ckpt"
    frb.checkpoint.save(path, state)
    manifest = frb.checkpoint.verify(path)
    assert set(manifest.files) == {"data.bin", "shards-0.bin"}
    assert manifest.meta["version"] == frb.checkpoint.VERSION
    records = manifest.meta["leaves"]
    assert all(len(r["shards"]) == N and r["mesh"] == {"data": N} for r in records)
    assert os.path.getsize(path / "data.bin") == 0  # nothing was gathered whole
    for like in (srb.init(EXAMPLE), jax.eval_shape(srb.init, EXAMPLE)):
        back = frb.checkpoint.load(path, like=like)
        assert_trees_equal(back, state)
        for x in jax.tree_util.tree_leaves(back):
            assert x.sharding.spec[0] == "data" and len(x.addressable_shards) == N
        a, _ = srb.sample(back, jax.random.key(5))
        b, _ = srb.sample(state, jax.random.key(5))
        assert_trees_equal(a, b)
    whole = frb.checkpoint.load(path)  # without a template: whole arrays
    assert isinstance(whole, frb.ShardedState) and whole.num_shards == N
    assert_trees_equal(whole, state)


def test_another_mesh_shape_is_refused_clearly(tmp_path):
    frb.checkpoint.save(tmp_path / "ckpt", _state(frb.ShardedReplayBuffer(PRIO, mesh(N))))
    other = frb.ShardedReplayBuffer(PRIO, mesh(2)).init(EXAMPLE)
    with pytest.raises(
        ValueError,
        match=r"saved in 4 shards over a mesh of shape \{'data': 4\}"
        r".*template's mesh has shape \{'data': 2\}.*same shape",
    ):
        frb.checkpoint.load(tmp_path / "ckpt", like=other)


def test_damaged_shard_file_is_named(tmp_path):
    path = tmp_path / "ckpt"
    frb.checkpoint.save(path, _state(frb.ShardedReplayBuffer(PRIO, mesh(N))))
    shard_file = path / "shards-0.bin"
    raw = bytearray(shard_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard_file.write_bytes(bytes(raw))
    like = frb.ShardedReplayBuffer(PRIO, mesh(N)).init(EXAMPLE)
    with pytest.raises(frb.checkpoint.CheckpointError, match="shards-0.bin.*checksum"):
        frb.checkpoint.load(path, like=like)
    shard_file.write_bytes(bytes(raw[:100]))
    with pytest.raises(frb.checkpoint.CheckpointError, match="shards-0.bin.*truncated"):
        frb.checkpoint.load(path, like=like)
    meta = json.loads((path / "frb_manifest.json").read_text())
    assert meta["files"]["shards-0.bin"]["size"] > 100
