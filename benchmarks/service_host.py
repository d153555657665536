"""What the buffer service's own process spends on an add and a sample, without Ray.

``BufferHost`` (the object ``RayBufferService``'s actor holds) over a core buffer of 16,384
items of the Ray job's frames (``benchmarks/ray_service.py --obs-shape 84,84``: obs
``uint8[84, 84]``, a reward, a writer id and a sequence number), filled; then, per round, a
block of ``add`` calls of 64 items (a writer's chunk), a block of ``sample`` calls of 256 (the
learner's batch), and the core buffer's own ``rb.add`` on the same chunks. Microseconds per
call, wall and process CPU time (the CPU time counts XLA's threads), median and range over the
rounds.

    python benchmarks/service_host.py --rounds 5 --out service_host.json

To compare two checkouts, run it from each (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/service_host.py` from the checkout
    sys.path.append(str(_ROOT))


def _timed(fn, calls: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per call of ``fn(i)`` over ``calls`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(calls):
        fn(i)
    return (
        (time.perf_counter() - wall) / calls * 1e6,
        (time.process_time() - cpu) / calls * 1e6,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    import jax
    import numpy as np

    import functional_rb as frb
    from benchmarks._reverb_peer import numpy_items
    from functional_rb.service import BufferHost

    rb = frb.ReplayBuffer(capacity=16_384, batch_size=256)
    example = {k: v[0] for k, v in numpy_items(np, 0, 0, 1, (84, 84), "uint8").items()}
    chunks = [numpy_items(np, 0, i * 64, 64, (84, 84), "uint8") for i in range(8)]
    host = BufferHost(rb, example)
    for i in range(256):  # filled, and every call compiled
        host.add(chunks[i % 8])
    core = [rb.add(rb.init(example), chunks[0])]

    def core_add(i):
        core[0] = rb.add(core[0], chunks[i % 8])

    parts = {
        "host.add (64 items)": lambda i: host.add(chunks[i % 8]),
        "host.sample (256 items)": lambda i: host.sample(),
        "rb.add (64 items, the core buffer alone)": core_add,
    }
    for fn in parts.values():
        _timed(fn, 10)
    runs: dict = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, fn in parts.items():
            runs[name].append(_timed(fn, args.calls))
        jax.block_until_ready(core[0])
    rows = []
    for name, vals in runs.items():
        wall, cpu = [v[0] for v in vals], [v[1] for v in vals]
        rows.append(
            dict(
                part=name,
                wall_us=statistics.median(wall),
                wall_range=[min(wall), max(wall)],
                cpu_us=statistics.median(cpu),
                rounds=vals,
            )
        )
        print(
            f"{name:42s} wall {statistics.median(wall):7.1f} us ({min(wall):.1f}-{max(wall):.1f})"
            f"  CPU {statistics.median(cpu):7.1f} us"
        )
    meta = {
        "frb": frb.__file__,
        "jax": jax.__version__,
        "load_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
