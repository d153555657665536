"""flashbax's own test suite, read from the installed wheel, against functional_rb.flashbax
(benchmarks/flashbax_suite.py; the whole suite, every case, is in benchmarks/README.md), run
as flashbax runs it: every warning an error but two of its own.

CI runs a part on our side only: the files of the flat, trajectory and prioritised buffers,
the sum tree, the mixer and utils, with every 120th case of the two grids of
broken-trajectory sampling (720 compiled cases in all; the same cases every run). The item
buffers and the queue are compared with flashbax itself, call by call, in this folder's other
tests, and the vault's file takes about six minutes on either side (a gzip chunk re-compressed
per one-step write). A case fails the test unless it also fails with flashbax itself
(:data:`FAIL_WITH_FLASHBAX`, recorded from a run of both sides) or is one of the runner's
``EXPECTED``."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("flashbax")
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "flashbax_suite", ROOT / "benchmarks" / "flashbax_suite.py"
)
suite = importlib.util.module_from_spec(spec)
sys.modules["flashbax_suite"] = suite
spec.loader.exec_module(suite)

# cases that fail with flashbax 0.1.3 itself on the JAX this project installs (full run of
# both sides, benchmarks/flashbax_suite.py)
FAIL_WITH_FLASHBAX = {
    "sum_tree_test.py::test_set_batch_scan_matches_set_batch_bincount": "its own assert that two permutations differ everywhere (JAX's permutation changed)",
}

FILES = [
    "utils_test.py",
    "buffers/flat_buffer_test.py",
    "buffers/mixer_test.py",
    "buffers/prioritised_flat_buffer_test.py",
    "buffers/sum_tree_test.py",
    "buffers/trajectory_buffer_test.py",
    "buffers/prioritised_trajectory_buffer_test.py",
]
EVERY = 120  # of the grids' cases (6 of 720, ~3 s each; the whole suite: benchmarks/README.md)


def test_rewrite_keeps_the_fixture_modules():
    src = (
        "from flashbax.buffers import sum_tree, trajectory_buffer\n"
        "from flashbax.buffers.conftest import get_fake_batch\n"
        "import flashbax\nfrom flashbax import utils\n"
    )
    out = suite.rewrite(src)
    assert "from functional_rb.flashbax.buffers import sum_tree, trajectory_buffer" in out
    assert "from flashbax.buffers.conftest import get_fake_batch" in out
    assert "import functional_rb.flashbax as flashbax" in out
    assert "from functional_rb.flashbax import utils" in out
    assert suite.rewrite("import flashbax as fbx") == "import functional_rb.flashbax as fbx"


def test_the_suite_runs_with_flashbax_warning_settings(tmp_path):
    """Every warning an error, flashbax's two exceptions kept (its pyproject.toml's)."""
    suite.prepare(tmp_path, ours=True)
    ini = (tmp_path / "pytest.ini").read_text().split()
    assert ini[ini.index("filterwarnings") + 2] == "error"
    assert sum(line.startswith("ignore:") for line in ini) >= 2


def test_flashbax_suite_passes_against_functional_rb(tmp_path):
    where = tmp_path / "frb"
    files = suite.prepare(where, ours=True)
    assert set(FILES) <= set(files), sorted(set(FILES) - set(files))
    junit = tmp_path / "frb.xml"
    suite.run_pytest(where, FILES, None, junit, timeout_s=1200, every=EVERY)
    results = suite.outcomes(junit)
    passed = [c for c, (s, _) in results.items() if s == "passed"]
    grids = [c for c in passed if "doesnt_sample_prev_broken" in c]
    assert len(passed) >= 70 and len(grids) >= 5, f"only {len(passed)} cases ran: {results}"
    failed = {
        c: m
        for c, (s, m) in results.items()
        if s == "failed"
        and suite.base_name(c) not in suite.EXPECTED
        and suite.base_name(c) not in FAIL_WITH_FLASHBAX
    }
    assert not failed, failed
