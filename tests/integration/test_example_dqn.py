"""Smoke test of examples/dqn_cartpole.py in its --quick configuration: the one jitted
collect/add/sample/learn loop runs, fills the buffer, counts its updates, keeps a finite loss,
keeps the best greedy checkpoint and prints its progress from inside the compiled call.

One compilation of ``run_training`` serves every test (same ``Config``, ``verbose=True``)."""

import contextlib
import importlib.util
import io
import math
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gymnax")
pytest.importorskip("optax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dqn_cartpole.py"
PROGRESS = re.compile(
    r"^steps +([\d,]+) +episodes +(\d+) +avg return +([\d.]+) +"
    r"greedy +([\d.]+) +loss +([\d.]+) +buffer +(\d+) "
)


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
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = dqn.train(cfg, verbose=True)
    return dqn, cfg, out, printed.getvalue()


def _progress_lines(text):
    return [m.groups() for m in map(PROGRESS.match, text.splitlines()) if m]


def test_quick_run_fills_buffer_and_counts_steps(quick_run):
    dqn, cfg, out, _ = quick_run
    ts = out["state"]
    rb = dqn.make_buffer(cfg)
    env_steps = cfg.num_envs * cfg.steps_per_chunk * cfg.num_chunks
    assert int(ts.step) * cfg.num_envs == env_steps
    assert int(rb.size(ts.buffer)) == min(cfg.buffer_capacity, env_steps)
    assert bool(rb.can_sample(ts.buffer))
    assert [h["env_steps"] for h in out["history"]] == [
        cfg.num_envs * cfg.steps_per_chunk * (i + 1) for i in range(cfg.num_chunks)
    ]
    assert [h["buffer_size"] for h in out["history"]] == [
        min(cfg.buffer_capacity, h["env_steps"]) for h in out["history"]
    ]
    # learning starts once learning_starts env steps were collected, then every step updates
    first = -(-cfg.learning_starts // cfg.num_envs) - 1  # first vector step that learns
    expected_updates = (cfg.steps_per_chunk * cfg.num_chunks - first) * cfg.updates_per_step
    assert int(ts.num_updates) == expected_updates
    assert sum(h["updates"] for h in out["history"]) == expected_updates
    # stored transitions are real CartPole transitions, not the zero fill
    sample, _ = rb.sample(ts.buffer, jax.random.key(0), batch_size=64)
    assert np.all(np.asarray(sample.mask))
    assert np.all(np.any(np.asarray(sample.data["obs"]) != 0, axis=1))
    assert np.all(np.asarray(sample.data["action"]) < 2)


def test_quick_run_loss_finite_and_episodes_complete(quick_run):
    _, cfg, out, _ = quick_run
    for h in out["history"]:
        assert math.isfinite(h["loss"])
        assert h["episodes"] > 0
        assert 1.0 <= h["avg_return"] <= 500.0
        assert 1.0 <= h["greedy_return"] <= 500.0
    assert out["history"][-1]["loss"] > 0.0
    for returns in (out["eval_returns"], out["last_returns"]):
        returns = np.asarray(returns)
        assert returns.shape == (cfg.eval_episodes,)
        assert np.all((returns >= 1) & (returns <= 500))
    ts = out["state"]
    for tree in (ts.params, out["best_params"]):
        assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree_util.tree_leaves(tree))


def test_quick_run_keeps_best_checkpoint(quick_run):
    dqn, cfg, out, _ = quick_run
    scores = [h["greedy_return"] for h in out["history"]]
    best = max(scores)
    assert out["best_score"] == best
    # later params win ties: the checkpoint is the last chunk with the best score
    chosen = max(i for i, s in enumerate(scores) if s == best)
    assert out["best_chunk"] == chosen
    same_as_last = [
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(out["best_params"]),
            jax.tree_util.tree_leaves(out["state"].params),
        )
    ]
    # training goes on after every chunk but the last, so only the last chunk's params are
    # the final ones
    assert all(same_as_last) == (chosen == cfg.num_chunks - 1)
    # the reported evaluation is the checkpoint's, on the seed's fresh evaluation episodes
    eval_key = jax.random.fold_in(jax.random.key(cfg.seed), 1)
    again = jax.jit(dqn.greedy_returns, static_argnums=2)(
        out["best_params"], eval_key, cfg.eval_episodes
    )
    np.testing.assert_array_equal(np.asarray(again), out["eval_returns"])
    assert out["final_return"] == pytest.approx(float(np.mean(out["eval_returns"])))


def test_progress_is_printed_from_inside_the_jitted_loop(quick_run, capsys):
    dqn, cfg, out, printed = quick_run
    # train printed one line per chunk, matching the history it returned afterwards
    lines = _progress_lines(printed)
    assert len(lines) == cfg.num_chunks
    for line, h in zip(lines, out["history"]):
        assert int(line[0].replace(",", "")) == h["env_steps"]
        assert int(line[1]) == h["episodes"]
        assert float(line[3]) == pytest.approx(h["greedy_return"], abs=0.051)
        assert int(line[5]) == h["buffer_size"]
    # one call of the compiled function, with no Python between chunks, prints the same lines
    # (a fixed seed replays the same run), in chunk order
    assert hasattr(dqn.run_training, "lower")  # a jax.jit-wrapped function
    capsys.readouterr()
    result = dqn.run_training(cfg, dqn.init_state(cfg), True)
    jax.block_until_ready(result)
    jax.effects_barrier()
    assert _progress_lines(capsys.readouterr().out) == lines
    np.testing.assert_array_equal(np.asarray(result.eval_returns), out["eval_returns"])


def test_main_quick_prints_progress_and_final_line(dqn, quick_run, capsys):
    _, cfg, _, _ = quick_run
    # same config as quick_run, so the jitted function is reused, not compiled again
    assert dqn.main(["--quick"]) == 0
    text = capsys.readouterr().out
    assert len(_progress_lines(text)) == cfg.num_chunks
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"final average return: \d+\.\d", last)
