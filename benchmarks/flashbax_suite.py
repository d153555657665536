"""flashbax's own test suite, run twice: as written, and with its ``flashbax`` imports rewritten
to ``functional_rb.flashbax``, as a flashbax user would switch. Reports how many of the cases
that pass with flashbax also pass with ours, and lists the others with their first error line.

The tests are read from the installed flashbax wheel at run time (``flashbax/**/*_test.py``
ship inside it); nothing of flashbax is kept in this repository::

    python benchmarks/flashbax_suite.py [--files buffers/flat_buffer_test.py ...] [-k EXPR]
        [--only frb] [--out benchmarks/results/flashbax_suite.json]

How the imports are rewritten: in each test module, ``flashbax`` in an ``import`` or
``from ... import`` statement becomes ``functional_rb.flashbax``, except the two test-fixture
modules (``flashbax.conftest``, ``flashbax.buffers.conftest``), which are flashbax's test
helpers, not its library. The copied ``conftest.py`` files give pytest the same fixtures. On
both sides the root ``conftest.py`` also binds ``jax.tree_map`` (removed from JAX after
flashbax 0.1.3 was released; its mixer tests call it) to ``jax.tree_util.tree_map``.

Exit status: 0 when every case that passes with flashbax passes with ours, except the cases in
:data:`EXPECTED`, which test flashbax's private binary sum-tree node layout (the core's tree is
laid out otherwise, see ``functional_rb/flashbax/buffers/sum_tree.py``); 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# cases that pass with flashbax and are expected to fail with ours, each with its reason
EXPECTED = {
    "sum_tree_test.py::test_set_non_batched": "capacity 7: sets leaf 7, past the capacity; flashbax's binary tree has 2**3 leaves and "
    "keeps it, the core's tree ignores indices outside [0, capacity) (its masking rule)",
}

_SHIM = (
    "\n# functional_rb's runner: flashbax's tests call jax.tree_map, gone from newer JAX\n"
    "if not hasattr(jax, 'tree_map'):\n    jax.tree_map = jax.tree_util.tree_map\n"
)
_FIXTURE_MODULES = ("flashbax.conftest", "flashbax.buffers.conftest")
_IMPORT = re.compile(r"^(\s*)(from|import)\s+flashbax\b([\w.]*)", re.M)


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
    """

    def sub(m):
        if "flashbax" + m.group(3) in _FIXTURE_MODULES:
            return m.group(0)
        if m.group(2) == "import" and not m.group(3):
            return f"{m.group(1)}import functional_rb.flashbax as flashbax"
        return f"{m.group(1)}{m.group(2)} functional_rb.flashbax{m.group(3)}"

    return _IMPORT.sub(sub, source)


def prepare(dest: Path, ours: bool) -> list:
    """Copy flashbax's tests and conftests under ``dest`` (rewritten when ``ours``); returns
    the test files' paths relative to ``dest``."""
    root = flashbax_root()
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


def run_pytest(where: Path, files, k, junit: Path, timeout_s: float) -> float:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit2",
        "--tb=line",
        "-W",
        "ignore",
        "--rootdir",
        str(where),
        *files,
    ]
    if k:
        cmd += ["-k", k]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    subprocess.run(
        cmd,
        cwd=where,
        env=env,
        timeout=timeout_s,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="*", help="test files relative to flashbax's package")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument(
        "--only",
        choices=("frb", "flashbax"),
        default=None,
        help="run one side only (the report then counts that side's passes)",
    )
    ap.add_argument("--timeout", type=float, default=3000.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sides = [args.only] if args.only else ["flashbax", "frb"]
    results, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            where = Path(tmp) / side
            files = prepare(where, ours=side == "frb")
            files = args.files or files
            junit = Path(tmp) / f"{side}.xml"
            times[side] = run_pytest(where, files, args.k, junit, args.timeout)
            results[side] = outcomes(junit) if junit.exists() else {}
    if args.only:
        side = args.only
        report = {
            "side": side,
            "cases": len(results[side]),
            "passed": sum(s == "passed" for s, _ in results[side].values()),
            "failed": {
                c: m
                for c, (s, m) in results[side].items()
                if s == "failed" and base_name(c) not in EXPECTED
            },
        }
    else:
        report = compare(results["flashbax"], results["frb"])
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
