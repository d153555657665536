"""How fast each CPU of this machine runs, sampled over time: a fixed pure-Python loop timed
on each CPU in turn (``_stats.cpu_ms``), ``--samples`` times, ``--gap-s`` apart.

On an idle guest of these shared VMs the same loop takes ~8.5 ms on a CPU at one moment and
~16.5 ms at another, for seconds at a time, with no steal time counted and a load average
near 0: a benchmark point timed then runs about 2x slower whatever the library
(``benchmarks/NOTES.md``, "The warm-up after the compiles, and CPUs at half speed"). Run it
next to a benchmark's data to say how the CPUs ran.

Usage: ``python benchmarks/cpu_speed.py [--samples 40] [--gap-s 0.25] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/cpu_speed.py` from the checkout
    sys.path.append(str(_HERE.parent))

from benchmarks import _stats


def sample(samples: int, gap_s: float, n: int) -> dict:
    """``{cpu: [ms, ...]}``: the loop's time on each CPU, ``samples`` times."""
    out: dict = {}
    for _ in range(samples):
        for c, ms in _stats.cpu_ms(n).items():
            out.setdefault(c, []).append(ms)
        time.sleep(gap_s)
    return out


def slow_share(times: list[float], factor: float = 1.4) -> float:
    """The share of ``times`` above ``factor`` x their minimum (a CPU running slow).

    >>> slow_share([8.5, 8.6, 16.4, 8.4])
    0.25
    """
    fast = min(times)
    return sum(t > factor * fast for t in times) / len(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--gap-s", type=float, default=0.25)
    ap.add_argument("--loop", type=int, default=300_000, help="steps of the timed loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    per_cpu = sample(args.samples, args.gap_s, args.loop)
    res = {
        "meta": _stats.run_meta(load_before=load0, load_after=os.getloadavg(), **vars(args)),
        "ms": {str(c): v for c, v in per_cpu.items()},
        "summary": {
            str(c): {**_stats.summary(v), "slow_share": slow_share(v)} for c, v in per_cpu.items()
        },
    }
    for c, v in per_cpu.items():
        print(
            f"CPU {c}: {statistics.median(v):.1f} ms median ({min(v):.1f}-{max(v):.1f}), "
            f"slow (> 1.4x its fastest) in {slow_share(v):.0%} of {len(v)} samples"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
