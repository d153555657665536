"""Smoke test of examples/dqn_sharded.py in its --quick configuration (8 devices): the one
jitted shard_map'd training loop runs, each device's shard fills, every update draws a global
prioritized batch and sends priorities back, the replicated params stay identical."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gymnax")
pytest.importorskip("optax")

EXAMPLES = pathlib.Path(__file__).resolve().parents[4] / "examples"


@pytest.fixture(scope="module")
def dqn():
    spec = importlib.util.spec_from_file_location(
        "_example_dqn_sharded", EXAMPLES / "dqn_sharded.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_quick_run_trains_on_global_prioritized_batches(dqn, capsys):
    cfg = dqn.Config(**dqn.QUICK)
    out = dqn.train(cfg, verbose=True)
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if ln.startswith("steps ")]
    assert len(lines) == cfg.num_chunks  # one progress line per chunk (device 0's)
    ts = out["state"]
    srb = frb_buffer(dqn, cfg)
    steps = cfg.num_envs * cfg.steps_per_chunk * cfg.num_chunks
    assert int(srb.size(ts.buffer)) == min(steps, cfg.devices * cfg.capacity_per_device)
    np.testing.assert_array_equal(
        np.asarray(ts.buffer.shards.writer.filled),
        [min(steps // cfg.devices, cfg.capacity_per_device)] * cfg.devices,
    )
    first = -(-cfg.learning_starts // cfg.num_envs) - 1
    assert (
        int(ts.num_updates) == (cfg.steps_per_chunk * cfg.num_chunks - first) * cfg.updates_per_step
    )
    # priorities were sent back to the shards: they are no longer all the initial maximum
    tree = np.asarray(ts.buffer.shards.sampler.tree.values)
    assert len(np.unique(tree[tree > 0])) > 10
    # the parameters are replicated and identical on every device
    for leaf in jax.tree_util.tree_leaves(ts.params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])
    r = out["eval_returns"]
    assert r.shape == (cfg.devices * max(1, cfg.eval_episodes // cfg.devices),)
    assert np.all((r >= 1) & (r <= 500))


def frb_buffer(dqn, cfg):
    import functional_rb as frb

    return frb.ShardedReplayBuffer(dqn.make_buffer(cfg), dqn.make_mesh(cfg), axis_name=dqn.AXIS)
