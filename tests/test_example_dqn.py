"""Smoke test of examples/dqn_cartpole.py: the scanned collect/add/sample/learn loop runs, the
buffer fills as expected, the loss is finite and the state keeps its structure across chunks."""
import importlib.util
import math
import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gymnax")
pytest.importorskip("optax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dqn_cartpole.py"


@pytest.fixture(scope="module")
def dqn():
    spec = importlib.util.spec_from_file_location("_example_dqn_cartpole", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module's annotations through sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def quick_run(dqn):
    cfg = dqn.Config(**dqn.QUICK)
    return dqn, cfg, dqn.train(cfg, verbose=False)


def test_quick_run_fills_buffer_and_counts_steps(quick_run):
    dqn, cfg, out = quick_run
    ts = out["state"]
    rb = dqn.make_buffer(cfg)
    env_steps = cfg.num_envs * cfg.steps_per_chunk * cfg.num_chunks
    assert int(ts.step) * cfg.num_envs == env_steps
    assert int(rb.size(ts.buffer)) == min(cfg.buffer_capacity, env_steps)
    assert bool(rb.can_sample(ts.buffer))
    # learning starts once learning_starts env steps were collected, then every step updates
    first = -(-cfg.learning_starts // cfg.num_envs) - 1   # first vector step that learns
    expected_updates = (cfg.steps_per_chunk * cfg.num_chunks - first) * cfg.updates_per_step
    assert int(ts.num_updates) == expected_updates
    assert sum(h["updates"] for h in out["history"]) == expected_updates
    # stored transitions are real CartPole transitions, not the zero fill
    sample, _ = rb.sample(ts.buffer, jax.random.key(0), batch_size=64)
    assert np.all(np.asarray(sample.mask))
    assert np.all(np.any(np.asarray(sample.data["obs"]) != 0, axis=1))
    assert np.all(np.asarray(sample.data["action"]) < 2)


def test_quick_run_loss_finite_and_episodes_complete(quick_run):
    _, cfg, out = quick_run
    for h in out["history"]:
        assert math.isfinite(h["loss"])
        assert h["episodes"] > 0
        assert 1.0 <= h["avg_return"] <= 500.0
    assert out["history"][-1]["loss"] > 0.0
    returns = np.asarray(out["eval_returns"])
    assert returns.shape == (cfg.eval_episodes,)
    assert np.all((returns >= 1) & (returns <= 500))
    ts = out["state"]
    for tree in (ts.params, out["best_params"]):
        assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree_util.tree_leaves(tree))
    # the kept checkpoint is the best of the per-chunk greedy checks
    assert out["best_score"] == max(h["greedy_return"] for h in out["history"])
    last = np.asarray(out["last_returns"])
    assert last.shape == (cfg.eval_episodes,) and np.all((last >= 1) & (last <= 500))


def test_main_quick_prints_final_line(dqn, quick_run, capsys):
    # same config as quick_run, so the jitted functions are reused, not compiled again
    assert dqn.main(["--quick"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("final average return: ")
    float(last.split(": ")[1])
