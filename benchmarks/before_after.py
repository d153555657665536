"""The same workloads from two checkouts of functional_rb, interleaved: did a change move them?

    python benchmarks/before_after.py --before /path/to/old/checkout --after . \\
        [--rounds 5] [w1_uniform w2_prioritized w3_slices]

Each round runs every workload once from each tree (before, after, before, after, ...), each
in a fresh process with that tree first on ``sys.path`` and ``quick=True``; only functional_rb's
own rows are kept. Prints the medians and ranges of each mode and the ratio after/before, with
the load average during the run (a figure taken under load is not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CODE = """
import json, benchmarks.{w} as m
rows = m.run(quick=True)
out = []
for x in rows:  # W3 returns (name, sample rate, add+sample rate) tuples
    if not isinstance(x, dict):
        x = [dict(backend=x[0], mode="sample only", value=x[1], unit="batches/s"),
             dict(backend=x[0], mode="add + sample", value=x[2], unit="batches/s")]
    out += x if isinstance(x, list) else [x]
print("JSON" + json.dumps([x for x in out if "functional_rb" in x["backend"]]))
"""


def _run(tree: str, workload: str) -> list:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    out = subprocess.run(
        [sys.executable, "-c", _CODE.format(w=workload)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("JSON")]
    if not line:
        raise RuntimeError(f"{workload} failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(line[0][4:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default=".")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("workloads", nargs="*", default=["w1_uniform", "w2_prioritized", "w3_slices"])
    args = p.parse_args(argv)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    values: dict = {}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for w in args.workloads:
            for tag, tree in trees.items():
                t = time.time()
                for row in _run(tree, w):
                    key = (w, row["backend"], row["mode"], row["unit"])
                    values.setdefault(key, {}).setdefault(tag, []).append(row["value"])
                loads.append(os.getloadavg()[0])
                print(
                    f"round {r} {w} {tag}: {time.time() - t:.0f}s, load {loads[-1]:.2f}", flush=True
                )
    print(f"\nload average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}\n")
    print(
        "| workload | backend: mode | before (median, range) | after (median, range) | "
        "after/before |\n|---|---|---|---|---|"
    )
    for (w, backend, mode, unit), d in sorted(values.items()):
        b, a = d.get("before", []), d.get("after", [])
        if a and b:
            mb, ma = statistics.median(b), statistics.median(a)
            print(
                f"| {w} | {backend}: {mode} ({unit}) | {mb:,.0f} ({min(b):,.0f}-{max(b):,.0f})"
                f" | {ma:,.0f} ({min(a):,.0f}-{max(a):,.0f}) | {ma / mb:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
