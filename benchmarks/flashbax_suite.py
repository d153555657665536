"""flashbax's own test suite with its ``flashbax`` imports rewritten to
``functional_rb.flashbax``, as a flashbax user would switch, run the way flashbax runs it (its
pytest settings: every warning an error but two of its own). Reports how many cases pass with
ours, and for each that fails, whether it fails with flashbax itself too.

The tests are read from the installed flashbax wheel at run time (``flashbax/**/*_test.py``
ship inside it); nothing of flashbax is kept in this repository::

    python benchmarks/flashbax_suite.py [--sides classify|both|frb|flashbax] [--every N]
        [-n WORKERS] [--files buffers/flat_buffer_test.py ...] [-k EXPR]
        [--out benchmarks/results/flashbax_suite.json]

``--sides classify`` (the default) runs every case with ours and then only the cases ours fails
with flashbax, to tell ours' failures from flashbax's own; ``both`` runs every case on each side
(flashbax's side of the two property grids takes hours on 2 cores). ``--every N`` keeps every
Nth case of each test with more than :data:`GRID` cases (the two grids), the same cases on both
sides.

How the imports are rewritten: in each test module, ``flashbax`` in an ``import`` or
``from ... import`` statement becomes ``functional_rb.flashbax``, except the two test-fixture
modules (``flashbax.conftest``, ``flashbax.buffers.conftest``), which are flashbax's test
helpers, not its library. The copied ``conftest.py`` files give pytest the same fixtures, and
a ``pytest.ini`` holds flashbax 0.1.3's ``filterwarnings`` (:data:`PYTEST_INI`). On both sides
the root ``conftest.py`` also binds ``jax.tree_map`` (removed from JAX after flashbax 0.1.3 was
released; its mixer tests call it) to ``jax.tree_util.tree_map``.

Exit status: 0 when every case that passes with flashbax passes with ours, except the cases in
:data:`EXPECTED`; 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/flashbax_suite.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks._pytest_runner import run_pytest as _run_pytest

# a test with more cases than this is a grid: --every N keeps every Nth of its cases
GRID = 50

# cases that pass with flashbax and are expected to fail with ours, each with its reason (none:
# the compat sum tree keeps flashbax's binary layout)
EXPECTED: dict = {}

_SHIM = (
    "\n# functional_rb's runner: flashbax's tests call jax.tree_map, gone from newer JAX\n"
    "if not hasattr(jax, 'tree_map'):\n    jax.tree_map = jax.tree_util.tree_map\n"
    "\n\n# functional_rb's runner: --every N keeps every Nth case of the large grids\n"
    "def pytest_collection_modifyitems(config, items):\n"
    "    import os\n"
    "    every = int(os.environ.get('FRB_FLASHBAX_EVERY', '1'))\n"
    "    if every <= 1:\n"
    "        return\n"
    "    groups = {}\n"
    "    for item in items:\n"
    "        groups.setdefault(item.nodeid.split('[', 1)[0], []).append(item)\n"
    "    keep = {id(i) for g in groups.values() for n, i in enumerate(g)\n"
    f"            if len(g) <= {GRID} or n % every == 0}}\n"
    "    items[:] = [i for i in items if id(i) in keep]\n"
)
_FIXTURE_MODULES = ("flashbax.conftest", "flashbax.buffers.conftest")
# flashbax 0.1.3's pytest settings (its pyproject.toml, [tool.pytest.ini_options]): every
# warning is an error but two of its own, matched by message, category and module
PYTEST_INI = """[pytest]
filterwarnings =
    error
    ignore:Setting period greater than sample_sequence_length will result in no overlap betweentrajectories:UserWarning:flashbax
    ignore:jax.tree_map is deprecated:DeprecationWarning:flashbax
"""
_IMPORT = re.compile(r"^(\s*)(from|import)\s+flashbax\b([\w.]*)(\s+as\b)?", re.M)


def flashbax_root() -> Path:
    """The installed flashbax package's directory."""
    spec = importlib.util.find_spec("flashbax")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("flashbax is not installed: pip install flashbax==0.1.3")
    return Path(list(spec.submodule_search_locations)[0])


def rewrite(source: str) -> str:
    """``source`` with its flashbax imports pointing at ``functional_rb.flashbax`` (the
    fixture modules excepted).

    >>> rewrite("from flashbax.buffers import sum_tree\\nfrom flashbax.conftest import X")
    'from functional_rb.flashbax.buffers import sum_tree\\nfrom flashbax.conftest import X'
    >>> rewrite("import flashbax as fbx")
    'import functional_rb.flashbax as fbx'
    """

    def sub(m):
        if "flashbax" + m.group(3) in _FIXTURE_MODULES:
            return m.group(0)
        if m.group(2) == "import" and m.group(4):  # import flashbax[.x] as name
            return f"{m.group(1)}import functional_rb.flashbax{m.group(3)}{m.group(4)}"
        if m.group(2) == "import" and not m.group(3):
            return f"{m.group(1)}import functional_rb.flashbax as flashbax"
        return f"{m.group(1)}{m.group(2)} functional_rb.flashbax{m.group(3)}"

    return _IMPORT.sub(sub, source)


def prepare(dest: Path, ours: bool) -> list:
    """Copy flashbax's tests and conftests under ``dest`` (rewritten when ``ours``); returns
    the test files' paths relative to ``dest``."""
    root = flashbax_root()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "pytest.ini").write_text(PYTEST_INI)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not (path.name.endswith("_test.py") or path.name == "conftest.py"):
            continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text()
        if path.name == "conftest.py" and rel.parent == Path("."):
            text += _SHIM
        out.write_text(rewrite(text) if ours and path.name != "conftest.py" else text)
        if path.name.endswith("_test.py"):
            files.append(str(rel))
    return files


def run_pytest(
    where: Path, files, k, junit: Path, timeout_s: float, every: int = 1, workers: int = 0
) -> float:
    """Run pytest in ``where`` on ``files`` (paths or node ids) with flashbax's settings
    (``pytest.ini``, written by :func:`prepare`); ``every``: every Nth case of the grids;
    ``workers``: pytest-xdist processes (0: none). Returns the seconds it took."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "FRB_FLASHBAX_EVERY": str(every)}
    return _run_pytest(
        where,
        files,
        junit=junit,
        env=env,
        k=k,
        extra_args=[
            "--rootdir",
            str(where),
            *(["-n", str(workers)] if workers else ["-p", "no:xdist"]),
        ],
        timeout_s=timeout_s,
    )


def node_ids(junit: Path) -> dict:
    """``{"file.py::test[id]": "dir/file.py::test[id]"}``: each case's pytest node id."""
    ids = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        ids[Path(path).name + "::" + case.get("name")] = path + "::" + case.get("name")
    return ids


def outcomes(junit: Path) -> dict:
    """``{"file.py::test[id]": (outcome, first error line)}`` from a JUnit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = Path(case.get("classname", "").replace(".", "/")).name + ".py::" + case.get("name")
        status, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                msg = (node.get("message") or node.text or "").strip().splitlines()[:1]
                msg = msg[0][:200] if msg else ""
                break
        result[name] = (status, msg)
    return result


def base_name(case: str) -> str:
    """The test function of a case id (without its parameters)."""
    return case.split("[", 1)[0]


def compare(theirs: dict, ours: dict) -> dict:
    """The report: counts, and the cases that pass with flashbax but not with ours."""
    passing = [c for c, (s, _) in theirs.items() if s == "passed"]
    broken = {
        c: ours.get(c, ("missing", ""))[1] or ours.get(c, ("missing", ""))[0]
        for c in passing
        if ours.get(c, ("missing", ""))[0] != "passed"
    }
    unexpected = {c: m for c, m in broken.items() if base_name(c) not in EXPECTED}
    return {
        "cases": len(theirs),
        "pass_with_flashbax": len(passing),
        "pass_with_both": len(passing) - len(broken),
        "pass_with_ours_only": sum(
            1 for c, (s, _) in ours.items() if s == "passed" and theirs.get(c, ("",))[0] != "passed"
        ),
        "expected_failures": {
            c: EXPECTED[base_name(c)] for c in broken if base_name(c) in EXPECTED
        },
        "unexpected_failures": unexpected,
    }


def classify(ours: dict, theirs: dict) -> dict:
    """The report of a run of every case with ours and of ours' failures with flashbax."""
    failed = {c: m for c, (st, m) in ours.items() if st == "failed"}
    pass_theirs = {c for c in failed if theirs.get(c, ("missing",))[0] == "passed"}
    return {
        "cases": len(ours),
        "pass_with_ours": sum(st == "passed" for st, _ in ours.values()),
        "skipped_with_ours": sum(st == "skipped" for st, _ in ours.values()),
        "fail_with_both": {
            c: {"ours": m, "flashbax": theirs.get(c, ("missing", ""))[1]}
            for c, m in failed.items()
            if c not in pass_theirs
        },
        "expected_failures": {
            c: EXPECTED[base_name(c)] for c in pass_theirs if base_name(c) in EXPECTED
        },
        "unexpected_failures": {c: failed[c] for c in pass_theirs if base_name(c) not in EXPECTED},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="*", help="test files relative to flashbax's package")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument(
        "--sides",
        choices=("classify", "both", "frb", "flashbax"),
        default="classify",
        help="classify: every case with ours, then ours' failures with flashbax; both: every "
        "case on each side; frb / flashbax: one side only",
    )
    ap.add_argument("--every", type=int, default=1, help="every Nth case of the grids")
    ap.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sides = {"classify": ["frb"], "both": ["flashbax", "frb"]}.get(args.sides, [args.sides])
    results, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:

        def run(side, files, every):
            where = Path(tmp) / side
            found = prepare(where, ours=side == "frb")
            junit = Path(tmp) / f"{side}.xml"
            times[side] = run_pytest(
                where, files or found, args.k, junit, args.timeout, every, args.workers
            )
            return (outcomes(junit), node_ids(junit)) if junit.exists() else ({}, {})

        for side in sides:
            results[side], ids = run(side, args.files, args.every)
        if args.sides == "classify":
            failed = [ids[c] for c, (st, _) in results["frb"].items() if st == "failed"]
            results["flashbax"] = run("flashbax", failed, 1)[0] if failed else {}
    if args.sides == "classify":
        report = classify(results["frb"], results["flashbax"])
    elif args.sides == "both":
        report = compare(results["flashbax"], results["frb"])
    else:
        side = args.sides
        report = {
            "side": side,
            "cases": len(results[side]),
            "passed": sum(st == "passed" for st, _ in results[side].values()),
            "failed": {
                c: m
                for c, (st, m) in results[side].items()
                if st == "failed" and base_name(c) not in EXPECTED
            },
        }
    report["every"] = args.every
    report["seconds"] = {k: round(v, 1) for k, v in times.items()}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    bad = report.get("unexpected_failures", report.get("failed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
