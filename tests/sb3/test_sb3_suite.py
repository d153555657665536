"""Stable-Baselines3's own replay-buffer tests, read from its source distribution, with SB3's
classes replaced by ``functional_rb.sb3``'s (benchmarks/sb3_suite.py; the whole set and how it
is chosen are in that file's docstring).

CI runs a part on our side: ``test_buffers.py`` and ``test_n_step_replay.py`` whole, and of
``test_her.py`` the full buffer and two cases of truncating the last trajectory (its other
cases train agents for tens of seconds). The cases ours fails are rerun with SB3's own classes,
and a case fails this test when it passes there. In the same run a probe checks that SB3's
modules and the test modules hold our classes, while the modules that define SB3's keep theirs
for their own methods.

SB3's tests are not in its wheel: the source distribution is downloaded with pip once into
``~/.cache/functional_rb/sb3_suite/`` (or ``$FRB_SB3_SDIST``)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("functional_rb.sb3")
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sb3_suite", ROOT / "benchmarks" / "sb3_suite.py")
suite = importlib.util.module_from_spec(spec)
sys.modules["sb3_suite"] = suite
spec.loader.exec_module(suite)

PART = [
    "test_buffers.py",
    "test_n_step_replay.py",
    "test_her.py::test_full_replay_buffer",
    # handle_timeout_termination-n_steps-n_envs
    "test_her.py::test_truncate_last_trajectory[False-4-2]",
    "test_her.py::test_truncate_last_trajectory[True-5-1]",
]

# run inside pytest with ours in place (FRB_SB3_SIDE=frb): where SB3 and the tests find them
PROBE = """
import stable_baselines3
import stable_baselines3.common.buffers as buffers
import stable_baselines3.common.off_policy_algorithm as off_policy
import stable_baselines3.dqn.dqn as dqn
import stable_baselines3.her.her_replay_buffer as her
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer, RolloutBuffer

import functional_rb.sb3 as ours


def test_sb3_finds_ours():
    assert buffers.ReplayBuffer is ours.ReplayBuffer
    assert off_policy.ReplayBuffer is ours.ReplayBuffer
    assert off_policy.DictReplayBuffer is ours.DictReplayBuffer
    assert off_policy.NStepReplayBuffer is ours.NStepReplayBuffer
    assert off_policy.HerReplayBuffer is ours.HerReplayBuffer
    assert dqn.ReplayBuffer is ours.ReplayBuffer
    assert stable_baselines3.HerReplayBuffer is her.HerReplayBuffer is ours.HerReplayBuffer


def test_the_tests_find_ours():
    assert (ReplayBuffer, DictReplayBuffer) == (ours.ReplayBuffer, ours.DictReplayBuffer)
    assert RolloutBuffer.__module__ == "stable_baselines3.common.buffers"


def test_sb3_methods_keep_sb3_classes():
    # DictReplayBuffer's methods call super(ReplayBuffer, self) with the module's global
    assert vars(buffers)["ReplayBuffer"] is not ours.ReplayBuffer
    assert issubclass(ours.ReplayBuffer, vars(buffers)["ReplayBuffer"])


def test_a_default_buffer_is_ours():
    model = stable_baselines3.DQN("MlpPolicy", "CartPole-v1", buffer_size=100)
    assert type(model.replay_buffer) is ours.ReplayBuffer
"""


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """SB3's tests extracted, and :data:`PART` and the probe run once with our classes:
    ``(the tree, {case id: (outcome, error lines, seconds)})``."""
    where = tmp_path_factory.mktemp("sb3_suite")
    try:
        suite.prepare(where)
    except SystemExit as exc:  # no cached copy and no registry to download one from
        pytest.fail(f"SB3's tests are not available: {exc}")
    (where / "tests" / "test_frb_probe.py").write_text(PROBE)
    tests = [*suite.targets(PART), "tests/test_frb_probe.py"]
    results, _ = suite.run_side(where, "frb", tests, timeout_s=900)
    return where, results


def test_the_plugin_replaces_sb3_classes_by_ours(ours):
    probe = {c: r for c, r in ours[1].items() if c.startswith("test_frb_probe.py::")}
    assert len(probe) == 4, sorted(ours[1])
    failed = {c: r[1] for c, r in probe.items() if r[0] != "passed"}
    assert not failed, failed


def test_no_case_fails_with_ours_only(ours):
    where, results = ours
    part = {c: r for c, r in results.items() if not c.startswith("test_frb_probe.py::")}
    assert sum(r[0] == "passed" for r in part.values()) >= 100, part
    failed = {c for c, r in part.items() if r[0] == "failed"}
    theirs = {}
    if failed:
        theirs, _ = suite.run_side(where, "sb3", suite.targets(PART), keep=failed, timeout_s=900)
    broken = sorted(c for c in failed if theirs.get(c, ("missing",))[0] == "passed")
    assert not broken, "pass with SB3's classes, fail with ours:\n" + "\n".join(
        f"{c}\n    " + "\n    ".join(part[c][1][-3:]) for c in broken
    )
