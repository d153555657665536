"""What a batch returned by a Ray actor costs: per object or per byte?

A bare Ray actor holds ``--rows`` rows of ``--row-bytes`` uint8 (84x84 frames by default) and
returns batches of ``--batch`` rows, copied, in four ways:

* ``one``: one batch per call, one call at a time;
* ``one, 4 in flight``: one batch per call, four calls sent ahead;
* ``four per call``: four batches per call, returned as one ``[4, batch, ...]`` array;
* ``four per call (tuple)``: four batches per call, returned as a tuple of four arrays.

Modes interleaved, the order reversed every other round; milliseconds per batch, median over
rounds and range. Why ``RayBufferService.samples(per_call=)`` exists.

Usage::

    python benchmarks/ray_objects.py --rounds 5 --out benchmarks/results/ray_objects.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/<this>.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks._stats import run_meta  # noqa: E402

MODES = ("one", "one, 4 in flight", "four per call", "four per call (tuple)")


def _measure(args) -> dict:
    import numpy as np
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Rows:
            def __init__(self, rows, row_bytes, batch):
                self.x = np.random.randint(0, 255, (rows, row_bytes), np.uint8)
                self.batch = batch

            def ping(self):
                return 0

            def one(self, i):
                return self.x[i : i + self.batch].copy()

            def four(self, i):
                b = self.batch
                return self.x[i : i + 4 * b].copy().reshape(4, b, -1)

            def four_tuple(self, i):
                return tuple(self.x[i + j : i + j + self.batch].copy() for j in range(4))

        actor = Rows.remote(args.rows, args.row_bytes, args.batch)
        ray.get(actor.ping.remote())
        pending: collections.deque = collections.deque()

        def pipelined():
            if not pending:
                pending.extend(actor.one.remote(0) for _ in range(4))
            out = ray.get(pending.popleft())
            pending.append(actor.one.remote(0))
            return out

        per_batch = {
            "one": (lambda: ray.get(actor.one.remote(0)), 1),
            "one, 4 in flight": (pipelined, 1),
            "four per call": (lambda: ray.get(actor.four.remote(0)), 4),
            "four per call (tuple)": (lambda: ray.get(actor.four_tuple.remote(0)), 4),
        }
        out: dict = {m: [] for m in MODES}
        for f, _ in per_batch.values():  # warm-up
            for _ in range(20):
                f()
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                f, batches = per_batch[m]
                calls = max(args.batches // batches, 1)
                start = time.perf_counter()
                for _ in range(calls):
                    f()
                out[m].append((time.perf_counter() - start) / (calls * batches) * 1e3)
            ray.get(list(pending))
            pending.clear()
        return out
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16_384)
    ap.add_argument("--row-bytes", type=int, default=84 * 84)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=200, help="batches per mode per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    res = _measure(args)
    load1 = os.getloadavg()
    mb = args.batch * args.row_bytes / 1e6
    print(f"ms per batch of {args.batch} x {args.row_bytes} B ({mb:.2f} MB), {args.rounds} rounds")
    print("| mode | ms per batch |\n|---|---:|")
    for m in MODES:
        v = res[m]
        print(f"| {m} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) |")
    print(f"load {load0[0]:.2f} -> {load1[0]:.2f}")
    if args.out:
        meta = run_meta(args=vars(args) | {"out": str(args.out)}, load=[load0, load1])
        args.out.write_text(json.dumps({"meta": meta, "ms_per_batch": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
