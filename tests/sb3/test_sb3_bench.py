"""benchmarks/sb3.py cannot rot: a tiny run of each workload (``--quick``) writes the JSON its
tables come from, and its fills leave what ``add`` step by step leaves."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("stable_baselines3")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sb3.py"


def _summary_ok(d, n):
    assert len(d["values"]) == n
    assert d["min"] <= d["median"] <= d["max"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One ``--quick`` run per workload, the three at once (each starts its own processes)."""
    tmp = tmp_path_factory.mktemp("sb3_bench")
    procs = {}
    for name in ("step", "memory", "cleanrl"):
        cmd = [sys.executable, str(SCRIPT), "--quick", "--only", name, "--out", str(tmp / name)]
        procs[name] = subprocess.Popen(
            cmd + ["--jobs", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, f"--only {name}:\n{stderr[-3000:]}"
        out[name] = (json.loads((tmp / name).read_text()), stdout)
    return out


def test_common_fields(runs):
    for name, (doc, _) in runs.items():
        assert doc["benchmark"] == "sb3" and doc["quick"] is True and doc["torch_threads"] == 1
        for key in ("started", "ended", "stable-baselines3", "jax", "torch", "sizes"):
            assert doc[key], key
        assert doc[name]["seconds"] > 0


def test_step(runs):
    doc, stdout = runs["step"]
    rounds = doc["sizes"]["rounds"]
    step = doc["step"]
    # --quick checks SB3's two fills (full runs all five, as the slow test below)
    assert step["fills_match_add"] == {"vector/sb3": True, "image/sb3": True}
    vector, image = step["rows"]
    assert (vector["obs"], image["obs"]) == ("vector", "image")
    assert list(vector["sides"]) == ["SB3", "ours (torch)", "ours (jax)"]
    assert list(image["sides"]) == [
        "SB3",
        "ours frame_stack=4 (torch)",
        "ours frame_stack=4 (jax)",
        "ours drop-in (torch)",
    ]
    for row in (vector, image):
        assert len(row["loads"]) == rounds
        assert set(row["ratio_sb3_over_ours"]) == set(row["sides"]) - {"SB3"}
        for side in row["sides"].values():
            for part in ("total", "add", "sample"):
                _summary_ok(side[part], rounds)
            assert side["total"]["median"] > 0
        for ratio in row["ratio_sb3_over_ours"].values():
            _summary_ok(ratio, rounds)
        assert all(s >= 0 for s in row["fill_s"].values())
    # ours keeps each frame once: about a quarter of SB3's observation bytes
    assert image["array_bytes"]["ours_fs"] < image["array_bytes"]["sb3"] / 2
    assert "| image | 600 | ours frame_stack=4 (torch) |" in stdout


def test_memory(runs):
    doc, stdout = runs["memory"]
    cases = doc["memory"]["cases"]
    assert [(c["config"], c["filled"]) for c in cases] == [
        ("ours_fs", True),
        ("sb3", True),
        ("sb3", False),
        ("dropin", True),
    ]
    for c in cases:
        assert 0 < c["baseline_rss_bytes"] <= c["peak_rss_bytes"]
        assert c["array_bytes"] > 0 and len(c["loads"]) == 2
    # started from a shell, a case's peak is its own, not this process's
    assert cases[2]["peak_rss_bytes"] < 2 * cases[2]["baseline_rss_bytes"]
    # the computed case scales SB3's arrays: one stack a step, as the filled one
    per_step = [c["array_bytes"] / c["size"] for c in cases[1:3]]
    assert per_step[0] == pytest.approx(per_step[1], rel=1e-3)
    assert isinstance(doc["memory"]["ours_meets_target"], bool)
    assert "ours at most 8 GB peak RSS" in stdout


def test_cleanrl(runs):
    doc, _ = runs["cleanrl"]
    result = doc["cleanrl"]
    assert sorted(r["side"] for r in result["runs"]) == ["ours", "sb3"]
    assert all(r["loop_s"] > 0 and r["episodes"] > 0 for r in result["runs"])
    # ours draws SB3's indices from NumPy's global generator: a seed learns the same either way
    assert [p["same_returns"] for p in result["per_seed"]] == [True]


@pytest.mark.slow
def test_every_fill_leaves_what_add_leaves():
    """The long version of ``fills_match_add`` (--quick checks two of the five)."""
    spec = importlib.util.spec_from_file_location("frb_sb3_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.check_fills() == dict.fromkeys(bench.FILL_CHECKS, True)


def test_cleanrl_runner_changes_only_the_buffer_import_and_reads_the_log():
    spec = importlib.util.spec_from_file_location(
        "cleanrl_dqn", ROOT / "benchmarks" / "cleanrl_dqn.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    source = "import torch\nfrom cleanrl_utils.buffers import ReplayBuffer\nrb = ReplayBuffer(10)\n"
    changed = mod.script_with_our_buffer(source)
    assert changed == source.replace(mod.THEIRS, mod.OURS)
    with pytest.raises(SystemExit, match="found 2"):
        mod.script_with_our_buffer(source + mod.THEIRS + "\n")
    log = "SPS: 10\nglobal_step=5, episodic_return=[9.]\nSPS: 12\nglobal_step=9, episodic_return=[11.]\n"
    assert mod.parse(log) == {"sps": 12, "episodes": 2, "return_last10": 10.0}
