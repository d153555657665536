"""A program written for flashbax (examples/flashbax_dqn.py) run with flashbax and with ours.

Each seed runs once per side, each run in a fresh process, the sides interleaved (seed 0:
flashbax then ours; seed 1: ours then flashbax; ...), the load average read before and after
each seed's pair. The two runs of a seed differ only in the program's import line
(``--buffer``). Reported per side: the final average return per seed and its mean (learning:
"learns as well"), the greedy return of the final network, and the time (compilation, the
jitted training run, the whole process); per seed, the ratio ours / flashbax of the run time
(below 1: ours is faster):

    python benchmarks/flashbax_programs.py                        # seeds 0-4, 300k steps each
    python benchmarks/flashbax_programs.py --prioritised --seeds 0 1 2
    python benchmarks/flashbax_programs.py --quick                # tiny smoke run, not a result
    python benchmarks/flashbax_programs.py --out benchmarks/results/flashbax_programs.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flashbax_dqn.py"
SIDES = ("flashbax", "functional_rb")


def run_once(side: str, seed: int, extra: list[str]) -> dict:
    """One fresh process of the example; its ``--json`` figures plus the process wall time.

    A failed run raises ``RuntimeError`` with the tail of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            str(EXAMPLE),
            "--buffer",
            side,
            "--seed",
            str(seed),
            "--json",
            str(path),
            *extra,
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        wall = time.perf_counter() - t
        if proc.returncode != 0 or not path.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            raise RuntimeError(
                f"flashbax_programs: {' '.join(cmd)} exited {proc.returncode}:\n" + "\n".join(tail)
            )
        out = json.loads(path.read_text())
    out["process_s"] = wall
    return out


def _spread(values: list[float], fmt: str = ".1f") -> str:
    return (
        f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        if values
        else "-"
    )


def report(runs: dict[str, list[dict]], loads: list[tuple[float, float]]) -> str:
    """The markdown table of both sides, the per-seed time ratios and the load averages."""
    head = (
        "| side | final average return: mean | per seed | greedy return: mean | "
        "compile s | run s | process s |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---:|"]
    for side in SIDES:
        rs = runs[side]
        finals = [r["final_return"][0] for r in rs]
        greedy = [r["greedy_return"][0] for r in rs if r["greedy_return"]]
        per_seed = ", ".join(f"{r['seed']}: {f:.1f}" for r, f in zip(rs, finals))
        greedy_mean = f"{statistics.mean(greedy):.1f}" if greedy else "-"
        lines.append(
            f"| {side} | {statistics.mean(finals):.1f} | {per_seed} | {greedy_mean} | "
            f"{_spread([r['compile_s'] for r in rs])} | "
            f"{_spread([r['run_s'] for r in rs])} | "
            f"{_spread([r['process_s'] for r in rs])} |"
        )
    pairs = list(zip(runs["flashbax"], runs["functional_rb"]))
    run_ratio = [b["run_s"] / a["run_s"] for a, b in pairs]
    proc_ratio = [b["process_s"] / a["process_s"] for a, b in pairs]
    ratios = (
        f"ours / flashbax, per seed: run time {_spread(run_ratio, '.2f')}, "
        f"whole process {_spread(proc_ratio, '.2f')} (median, min-max)"
    )
    lines += [
        "",
        ratios,
        "load average (1 min) before -> after each seed's pair: "
        + ", ".join(f"{a:.2f}->{b:.2f}" for a, b in loads),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--prioritised", action="store_true", help="the PER variant")
    ap.add_argument("--total-timesteps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny runs: a smoke run, not a result")
    ap.add_argument("--out", default=None, help="write every run's figures as JSON here")
    args = ap.parse_args(argv)
    extra = (
        (["--prioritised"] if args.prioritised else [])
        + (["--quick"] if args.quick else [])
        + (["--total-timesteps", str(args.total_timesteps)] if args.total_timesteps else [])
    )
    print(
        f"{EXAMPLE.name} {' '.join(extra)}; seeds {args.seeds}; {os.cpu_count()} CPUs"
        f"{'; --quick (not a result)' if args.quick else ''}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    loads = []
    for i, seed in enumerate(args.seeds):
        before = os.getloadavg()[0]
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:  # A B, then B A
            out = run_once(side, seed, extra)
            runs[side].append(out)
            print(
                f"seed {seed} {side}: final average return {out['final_return'][0]:.1f}, "
                f"compile {out['compile_s']:.1f} s, run {out['run_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        loads.append((before, os.getloadavg()[0]))
    print(report(runs, loads))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "loads": loads}, f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
