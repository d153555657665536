"""Benchmark runner: ``python -m benchmarks.run w1 [--quick]`` (or ``python benchmarks/run.py w1``).

Workloads are the modules named in ``WORKLOADS`` (e.g. ``w1`` -> ``w1_uniform.py``), each
exposing ``run(quick: bool) -> list[dict]``. Each row is a dict with keys ``mode`` (what is measured),
``backend``, ``value`` (higher is better) and ``unit``; optional ``note``. The runner prints one
markdown table per workload with, per mode, the ratio of every backend to the reference
backends (``flashbax`` and ``cpprb`` by default; a workload may set ``REFERENCES``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/run.py` from the repository root
    sys.path.append(str(_HERE.parent))  # after site-packages: an installed functional_rb wins

DEFAULT_REFERENCES = ("flashbax", "cpprb")


# {workload name: its script}, by name: W5 has two scripts (w5_scale.py, the workload, and
# w5_breakdown.py, its parts), so a glob of w5_*.py would pick one by file order
WORKLOADS = {
    "w1": "w1_uniform",
    "w2": "w2_prioritized",
    "w3": "w3_slices",
    "w4": "w4_memory",
    "w5": "w5_scale",
}


def available() -> dict[str, str]:
    """{workload name: module name} of every workload in ``WORKLOADS``."""
    return {name: f"benchmarks.{stem}" for name, stem in WORKLOADS.items()}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def table(rows: list[dict], references=DEFAULT_REFERENCES) -> str:
    """A markdown table of ``rows`` with ratios to each reference backend within a mode."""
    refs = [r for r in references if any(row["backend"] == r for row in rows)]
    head = ["mode", "backend", "value", "unit"] + [f"x {r}" for r in refs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["mode"], row["backend"], _fmt(row["value"]), row.get("unit", "")]
        for r in refs:
            ref = [x["value"] for x in rows if x["mode"] == row["mode"] and x["backend"] == r]
            cells.append(f"{row['value'] / ref[0]:.2f}" if ref and ref[0] > 0 else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    names = available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", help=f"one or more of {sorted(names)} (or 'all')")
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (smoke run)")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with process CPU time instead of wall time (shared machines)",
    )
    ap.add_argument(
        "--out",
        type=pathlib.Path,
        help="also write the rows as JSON, with the date, load and versions "
        "(e.g. benchmarks/results/w1.json)",
    )
    args = ap.parse_args(argv)
    if args.cpu_time:
        os.environ["FRB_BENCH_CLOCK"] = "cpu"
    wanted = sorted(names) if args.workloads == ["all"] else args.workloads
    for w in wanted:
        if w not in names:
            ap.error(f"unknown workload {w!r}; available: {sorted(names)}")
    clock = "process CPU time" if args.cpu_time else "wall time"
    record = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/run.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "clock": clock,
        "quick": args.quick,
        "loadavg_before": os.getloadavg(),
        "workloads": {},
    }
    for w in wanted:
        mod = importlib.import_module(names[w])
        rows = mod.run(quick=args.quick)
        print(f"\n### {w}: {(mod.__doc__ or '').strip().splitlines()[0]}")
        print(f"({os.cpu_count()} CPUs visible, {clock}{', --quick' if args.quick else ''})\n")
        if rows and not isinstance(rows[0], dict):  # W3: one row per sampler, its own table
            print(mod.table(rows))
        else:
            print(table(rows, getattr(mod, "REFERENCES", DEFAULT_REFERENCES)))
        sys.stdout.flush()
        record["workloads"][w] = rows
    if args.out:
        record["loadavg_after"] = os.getloadavg()
        record["versions"] = _versions()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\n{args.out}")
    return 0


def _versions() -> dict:
    """The versions of JAX and of the peers that are imported."""
    out = {}
    for name in ("jax", "flashbax", "cpprb", "torch", "torchrl"):
        if name in sys.modules:
            try:
                out[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                out[name] = getattr(sys.modules[name], "__version__", "?")
    return out


if __name__ == "__main__":
    sys.exit(main())
