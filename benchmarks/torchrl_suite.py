"""TorchRL's own replay-buffer test suite, run twice: as written, and with TorchRL's classes
replaced by ``functional_rb.adapters`` as a TorchRL user would replace them (same names,
imports changed). Reports how many of the tests that pass with TorchRL also pass with the
adapters, and groups the rest by their first error line.

Not part of CI (it needs a checkout of pytorch/rl's ``test/rb``, and takes minutes)::

    python benchmarks/torchrl_suite.py --tests /path/to/rl/test/rb [--files test_samplers.py ...]
        [-k EXPR] [--out benchmarks/results/torchrl_suite.json] [--only frb]

How the classes are replaced: after the last top-level import of each test module (before any
decorator runs), every module-level name bound to an object of ``torchrl.data`` (a class, a
function, or an instance such as ``traj``) whose name ``functional_rb.adapters`` also exports
is rebound to the adapter's object (so are ``torchrl.service_backend`` and
``torchrl.transport_backend``, imported as ``from torchrl import service_backend``), and a module
``torchrl.data.replay_buffers.samplers`` (``writers``, ``storages``, ...) to the adapters' module
of that name. Names the adapters do not export stay TorchRL's, as they would in a user's code
that changed only its imports.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/torchrl_suite.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks._pytest_runner import run_pytest

_REBIND = """
# -- functional_rb: TorchRL's replay-buffer classes replaced by the adapters' --
import types as _frb_types
import functional_rb.adapters as _frb_adapters
# torchrl.data's names, and torchrl's scoped backends (service_backend, transport_backend)
_FRB_MAPPED = ("torchrl.data", "torchrl._comm.backends")
for _frb_name, _frb_obj in list(globals().items()):
    if isinstance(_frb_obj, _frb_types.ModuleType):
        _frb_mod = _frb_obj.__name__.rsplit(".", 1)[-1]
        # a submodule (torchrl.data.replay_buffers.samplers.prioritized) maps to the adapters'
        # module of the same path, else a module to the adapters' module of its last name
        _frb_path = _frb_obj.__name__.replace("torchrl.data.replay_buffers.", "", 1)
        _frb_sub = None
        if _frb_path.count(".") == 1 and _frb_obj.__name__.startswith("torchrl.data"):
            try:
                _frb_sub = __import__("functional_rb.adapters." + _frb_path,
                                      fromlist=["_"])
            except ImportError:
                pass
        if _frb_sub is not None:
            globals()[_frb_name] = _frb_sub
        elif _frb_obj.__name__.startswith("torchrl.data") and \\
                isinstance(getattr(_frb_adapters, _frb_mod, None), _frb_types.ModuleType):
            globals()[_frb_name] = getattr(_frb_adapters, _frb_mod)
    elif (isinstance(_frb_obj, type) or callable(_frb_obj) or
            type(_frb_obj).__module__.startswith("torchrl.data")) and \\
            str(getattr(_frb_obj, "__module__", "")).startswith(_FRB_MAPPED) and \\
            hasattr(_frb_adapters, _frb_name):
        globals()[_frb_name] = getattr(_frb_adapters, _frb_name)
del _frb_name, _frb_obj, _FRB_MAPPED
# -- end functional_rb --
"""


def _insert_line(source: str) -> int:
    """The line after the last top-level import that comes before any other statement
    than imports, docstrings, ``__future__`` and assignments (decorators evaluate classes)."""
    tree = ast.parse(source)
    last = 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            break
    return last


def patch_file(path: Path) -> None:
    src = path.read_text()
    line = _insert_line(src)
    if not line:
        return
    lines = src.splitlines(keepends=True)
    path.write_text("".join(lines[:line]) + _REBIND + "".join(lines[line:]))


def prepare(tests: Path, dest: Path, patched: bool) -> None:
    shutil.copytree(tests, dest)
    if patched:
        for f in dest.glob("*.py"):
            patch_file(f)


def outcomes(junit: Path) -> dict:
    """``{test id: (outcome, first message line)}`` from a JUnit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                msg = (child.get("message") or child.text or "").strip().splitlines()
                msg = msg[0][:200] if msg else ""
                break
            if child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")[:200]
        out[name] = (outcome, msg)
    return out


def _group(msg: str) -> str:
    msg = re.sub(r"0x[0-9a-f]+", "0x..", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:140]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", required=True, type=Path, help="pytorch/rl's test/rb directory")
    p.add_argument("--files", nargs="*", default=None)
    p.add_argument("-k", default=None)
    p.add_argument("--timeout", type=int, default=120, help="per test (needs pytest-timeout)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/torchrl_suite.json"))
    p.add_argument(
        "--only",
        choices=("torchrl", "frb"),
        default=None,
        help="run one side; the other is read from --out's previous run",
    )
    p.add_argument("--show", type=int, default=40, help="failure groups to print")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = dict(previous.get("outcomes", {}))
    times = dict(previous.get("seconds", {}))
    with tempfile.TemporaryDirectory(prefix="torchrl_suite_") as tmp:
        for side in ("torchrl", "frb"):
            if args.only and side != args.only:
                continue
            where = Path(tmp) / side
            prepare(args.tests, where, patched=(side == "frb"))
            junit = Path(tmp) / f"{side}.xml"
            times[side] = run_pytest(
                where,
                [str(where / f) for f in args.files] if args.files else [str(where)],
                junit=junit,
                env=env,
                k=args.k,
                extra_args=[
                    "-W",
                    "ignore",
                    *([f"--timeout={args.timeout}"] if args.timeout else []),
                ],
                require_report=True,
            )
            new = outcomes(junit) if junit.exists() else {}
            if args.files or args.k:
                merged = dict(results.get(side, {}))
                merged.update(new)
                new = merged
            results[side] = new
    ref, ours = results.get("torchrl", {}), results.get("frb", {})
    passed_ref = {t for t, (o, _) in ref.items() if o == "passed"}
    passed_both = {t for t in passed_ref if ours.get(t, ("missing",))[0] == "passed"}
    ratio = len(passed_both) / max(len(passed_ref), 1)
    groups: dict = {}
    for t in sorted(passed_ref - passed_both):
        o, msg = ours.get(t, ("missing", ""))
        groups.setdefault(_group(f"{o}: {msg}"), []).append(t)
    summary = {
        "passed_torchrl": len(passed_ref),
        "passed_both": len(passed_both),
        "ratio": round(ratio, 4),
        "seconds": times,
        "load_average": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"summary": summary, "outcomes": results, "seconds": times, "failures": groups},
            indent=1,
        )
    )
    print(json.dumps(summary))
    for g, ts in sorted(groups.items(), key=lambda kv: -len(kv[1]))[: args.show]:
        print(f"{len(ts):4d}  {g}\n      e.g. {ts[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
