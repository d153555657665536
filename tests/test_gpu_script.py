"""benchmarks/gpu.py, the script a lent GPU runs, cannot rot: ``--tiny`` runs every section
on the CPU here, and its JSON must hold every row of the plan (a value, or why not) and its
markdown every table."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# about a minute of compiling on a loaded 2-core machine: scheduled first (tests/conftest.py)
pytestmark = pytest.mark.heavy


def _sections_module():
    # by path: the checkout's benchmarks/ is not an installed package
    spec = importlib.util.spec_from_file_location(
        "frb_gpu_sections", ROOT / "benchmarks" / "gpu_sections.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), p.stdout


def test_every_planned_row_is_reported_once(tiny_run):
    result, _, _ = tiny_run
    g = _sections_module()
    want = [g.row_key(r) for r in g.plan(g.TINY, g.SECTIONS, g.W5_SAMPLERS)]
    got = [g.row_key(r) for r in result["rows"]]
    assert sorted(got, key=repr) == sorted(want, key=repr)
    workloads = {r["workload"] for r in result["rows"]}
    assert workloads == {
        "W1 uniform",
        "W2 prioritized",
        "W3 slices",
        "frames",
        "W5 uniform",
        "W5 prioritized",
        "W5 slices",
        "W5 ted",
    }
    for wl in ("W1 uniform", "W2 prioritized", "frames"):  # per call and in lax.scan
        modes = {r["mode"] for r in result["rows"] if r["workload"] == wl}
        assert any(m.startswith("per call") for m in modes), wl
        assert any(m.startswith("lax.scan") for m in modes), wl
    w3 = {r["mode"] for r in result["rows"] if r["workload"] == "W3 slices"}
    assert any("jit per batch" in m for m in w3) and any("lax.scan" in m for m in w3)
    assert {r["mode"] for r in result["rows"] if r["workload"].startswith("W5")} == {"call", "scan"}


def test_ours_and_the_peers_are_timed_or_say_why_not(tiny_run):
    result, _, _ = tiny_run
    has = {name: importlib.util.find_spec(name) is not None for name in ("flashbax", "torchrl")}
    for r in result["rows"]:
        label = (r["workload"], r["mode"], r["backend"], r.get("size"))
        timed = (
            r["backend"]
            in ("functional_rb", "jax dispatch floor (no-op calls)", "bare jax (hand-written)")
            or (r["backend"] == "flashbax" and has["flashbax"])
            # TorchRL's prioritized buffer needs a C++ extension that may not load
            or (r["backend"] == "torchrl" and has["torchrl"] and "prioritized" not in r["workload"])
        )
        if timed:
            assert "value" in r, (label, r.get("skipped"))
            assert math.isfinite(r["value"]) and r["value"] > 0, label
        elif "value" not in r:
            assert r["skipped"], label
        if r["backend"] == "flashbax" and not has["flashbax"]:
            assert "not installed" in r["skipped"], label
    w5 = [r for r in result["rows"] if r["workload"].startswith("W5") and "value" in r]
    assert all(r["unit"] == "us/step" and r["min"] <= r["value"] <= r["max"] for r in w5)
    assert all("anon_huge_pages_kib" in r for r in w5)


def test_meta_and_markdown(tiny_run):
    result, md, stdout = tiny_run
    meta = result["meta"]
    assert meta["tiny"] is True and meta["device"]["platform"] == "cpu"
    assert meta["device"]["hugepages"]["thp"] in ("always", "madvise", "never", "unavailable")
    assert meta["elapsed_s"] < meta["budget_s"]
    assert meta["cfg"]["torch_device"] == "cpu"  # --tiny runs TorchRL's code on the CPU
    assert len(meta["jobs"]) == 4 + 3  # the sections, and W5 for each backend
    for heading in (
        "### W1 uniform",
        "### W2 prioritized",
        "### W3 slices",
        "### frames",
        "### W5",
    ):
        assert heading in md and heading in stdout
    assert "| W5" not in md and "| uniform | functional_rb (scan) |" in md
    assert "us per step (goal: < 100 us on an H100/H200)" in md


def test_a_build_that_cannot_end_in_time_stops_and_says_why(monkeypatch):
    # W5 on a GPU: flashbax's prioritised prefill of 10^8 items would run for hours past the
    # series' share of the budget, and a build cannot be interrupted once it is past its chunks
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import scale_backends as sb

    monkeypatch.setattr(sb, "CHUNK", 500)
    late = type("Late", (sb.FunctionalRB,), {"build_deadline": time.time() - 1.0})
    with pytest.raises(sb.Skip, match=r"build stopped after 1 of 3 chunks .* s left"):
        late("uniform", 1500, None)
    on_time = type("OnTime", (sb.FunctionalRB,), {"build_deadline": time.time() + 600.0})
    b = on_time("uniform", 1500, None)
    assert int(b.rb.size(b.state)) == 1500  # built whole


def test_scan_kernels_counts_the_scan_body_only(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import jax
    import jax.numpy as jnp

    from benchmarks.scan_kernels import body_counts

    def scan(x, with_cond):
        def body(c, i):
            c = jnp.sin(c) * 2.0 + i
            if with_cond:  # a conditional on a value computed in the loop stays in it
                c = jax.lax.cond(c[0] > 0, lambda v: v + 1.0, lambda v: jnp.cos(v), c)
            return c, None

        return jax.lax.scan(body, x, jnp.arange(8.0))[0]

    x = jnp.ones(1000)
    plain = body_counts(jax.jit(lambda x: scan(x, False)).lower(x).compile().as_text())
    cond = body_counts(jax.jit(lambda x: scan(x, True)).lower(x).compile().as_text())
    assert plain["conditional"] == 0 and cond["conditional"] == 1
    assert plain["fusion"] >= 1 and plain["lines"] > 0
    with pytest.raises(ValueError, match="no while loop in ENTRY"):
        body_counts(jax.jit(jnp.sin).lower(x).compile().as_text())
