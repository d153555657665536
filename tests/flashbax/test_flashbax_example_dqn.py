"""examples/flashbax_dqn.py, a DQN written for flashbax, run on a tiny budget with flashbax and
with ``functional_rb.flashbax`` (the program's only difference: its import line), same seed.

Both runs take the same number of environment steps and updates, end with buffer states of
the same layout and write position, and give finite returns; the functional_rb run really
goes through ``functional_rb.flashbax`` (its state is ours), also with ``--prioritised``
(``set_priorities``). Whether both sides learn equally well is for
``benchmarks/flashbax_programs.py``, not for a test of a 2,000-step run.
"""

import importlib.util
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functional_rb.flashbax.buffers import sum_tree

pytest.importorskip("gymnax")
pytest.importorskip("optax")
pytest.importorskip("flax")
pytest.importorskip("flashbax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "flashbax_dqn.py"


@pytest.fixture(scope="module")
def dqn():
    spec = importlib.util.spec_from_file_location("_example_flashbax_dqn", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # chex dataclasses resolve the module through it
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def config(dqn):
    return dict(dqn.CONFIG, **dqn.QUICK)


@pytest.fixture(scope="module")
def runs(dqn, config):
    # flashbax's own code broadcasts ranks implicitly, which tests/conftest.py makes an error;
    # the functional_rb run (the program's code and ours) stays under the strict setting
    with jax.numpy_rank_promotion("allow"):
        theirs = dqn.run(config, "flashbax", seed=0)
    return {"flashbax": theirs, "functional_rb": dqn.run(config, "functional_rb", seed=0)}


def expected_updates(config):
    """Updates the loop takes: one per step once past LEARNING_STARTS, on TRAINING_INTERVAL."""
    steps = config["TOTAL_TIMESTEPS"] // config["NUM_ENVS"]
    t = config["NUM_ENVS"] * np.arange(1, steps + 1)
    return int(np.sum((t > config["LEARNING_STARTS"]) & (t % config["TRAINING_INTERVAL"] == 0)))


def buffer_state(out):
    return out["outs"]["runner_state"][1]


def test_same_steps_and_updates_on_both_sides(runs, config):
    steps = config["TOTAL_TIMESTEPS"] // config["NUM_ENVS"] * config["NUM_ENVS"]
    for out in runs.values():
        assert out["timesteps"] == steps
        assert out["updates"] == [expected_updates(config)]
        assert out["num_seeds"] == 1 and out["seed"] == 0


def test_returns_and_losses_are_finite(runs, config):
    for side, out in runs.items():
        assert len(out["final_return"]) == 1, side
        assert 1.0 <= out["final_return"][0] <= 500.0, side
        loss = np.asarray(out["outs"]["metrics"]["loss"])
        assert np.all(np.isfinite(loss)), side
        assert np.any(loss > 0), side  # it learned something, not only the skip branch
        params = out["outs"]["runner_state"][0].params
        assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params)), side


def test_buffer_states_have_the_same_layout_and_position(runs, config):
    ours, theirs = (buffer_state(runs[s]) for s in ("functional_rb", "flashbax"))
    assert type(ours).__module__.startswith("functional_rb.flashbax")
    assert type(theirs).__module__.startswith("flashbax")
    layout = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), ours.experience)
    assert layout == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), theirs.experience)
    rows = config["BUFFER_SIZE"] // config["NUM_ENVS"]
    assert ours.experience.obs.shape == (1, config["NUM_ENVS"], rows, 4)  # [seeds, E, R, 4]
    steps = config["TOTAL_TIMESTEPS"] // config["NUM_ENVS"]
    for state in (ours, theirs):
        assert int(state.current_index[0]) == steps % rows
        assert bool(state.is_full[0]) == (steps >= rows)
    # what was stored are CartPole transitions: actions 0/1, rewards 1
    assert set(np.unique(np.asarray(ours.experience.action)).tolist()) == {0, 1}
    assert np.all(np.asarray(ours.experience.reward) == 1.0)


def test_prioritised_runs_on_functional_rb_for_two_vmapped_seeds(dqn, config):
    out = dqn.run(dict(config, PRIORITISED=True), "functional_rb", seed=0, num_seeds=2)
    assert out["updates"] == [expected_updates(config)] * 2
    assert all(1.0 <= r <= 500.0 for r in out["final_return"])
    assert np.all(np.isfinite(np.asarray(out["outs"]["metrics"]["loss"])))
    state = buffer_state(out)
    assert type(state).__module__.startswith("functional_rb.flashbax")
    # set_priorities ran in each seed's buffer: the stored priorities are |TD error|s (many
    # distinct values), and the two seeds' differ
    items = jnp.arange(config["BUFFER_SIZE"], dtype=jnp.int32)
    leaves = np.asarray(
        jax.vmap(lambda tree: sum_tree.get_batch(tree, items))(state.sum_tree_state)
    )
    assert leaves.shape == (2, config["BUFFER_SIZE"])
    for seed_leaves in leaves:
        assert np.unique(seed_leaves[seed_leaves > 0]).size > 10
    assert not np.array_equal(leaves[0], leaves[1])


def test_main_prints_the_summary(dqn, runs, monkeypatch, capsys, tmp_path):
    # main's figures come from run(); reuse the compiled run instead of compiling again
    def fake_run(config, buffer, seed, num_seeds):
        assert (buffer, seed, num_seeds) == ("functional_rb", 0, 1)
        assert config["TOTAL_TIMESTEPS"] == dqn.QUICK["TOTAL_TIMESTEPS"]
        return runs[buffer]

    monkeypatch.setattr(dqn, "run", fake_run)
    path = tmp_path / "out.json"
    assert dqn.main(["--quick", "--buffer", "functional_rb", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"compile time: [\d.]+ s, run time: [\d.]+ s", lines[1])
    assert lines[-1] == f"final average return: {runs['functional_rb']['final_return'][0]:.1f}"
    saved = json.loads(path.read_text())
    assert (
        saved["buffer"] == "functional_rb"
        and saved["timesteps"] == runs["functional_rb"]["timesteps"]
    )
