"""Run a copied test suite under pytest in a subprocess and time it: the one runner behind
``flashbax_suite.py``, ``torchrl_suite.py`` and ``sb3_suite.py``, which each add their own
settings (``extra_args``) and read the JUnit XML report it writes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_pytest(
    where: Path,
    targets: Sequence[str],
    *,
    junit: Path,
    env: Mapping[str, str],
    k: str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
    require_report: bool = False,
) -> float:
    """Run ``python -m pytest`` in ``where`` on ``targets`` (paths or node ids), writing a
    JUnit XML report (xunit2, one line per failure) to ``junit``; returns the seconds it took.

    ``extra_args``: the caller's own pytest options; ``k``: a ``-k`` expression;
    ``timeout_s``: a limit on the whole run (``subprocess.TimeoutExpired`` past it);
    ``require_report``: exit with pytest's last lines when it stopped without running the tests
    (internal error, usage error, nothing collected) or wrote no report; otherwise its output
    is discarded and the caller reads whatever report there is."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit2",
        "--tb=line",
        *extra_args,
        *(["-k", k] if k else []),
        *targets,
    ]
    out = subprocess.PIPE if require_report else subprocess.DEVNULL
    start = time.perf_counter()
    p = subprocess.run(
        cmd, cwd=where, env=dict(env), timeout=timeout_s, stdout=out, stderr=subprocess.STDOUT
    )
    if require_report and (p.returncode in (3, 4, 5) or not junit.exists()):
        tail = p.stdout.decode(errors="replace").strip().splitlines()[-15:]
        raise SystemExit(f"pytest in {where} exited {p.returncode}:\n" + "\n".join(tail))
    return time.perf_counter() - start
