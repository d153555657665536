"""The floor under W5's uniform step: one gather of 256 random rows from a ``[N, 7]`` float32
table (W5's 28-byte uniform items, packed as ``DeviceStorage`` packs them) and one write of 256
contiguous rows, with and without huge pages, from 10^4 to 10^8 rows.

Whatever a buffer adds, a uniform step at size N pays at least this; what a buffer's step costs
above it is the buffer's own work. Two engines: NumPy (fancy indexing, the table advised or
not: ``np._core.multiarray._set_madvise_hugepage``) and XLA on the CPU (a donated, jitted
``dynamic_update_slice`` and a jitted gather, two calls as the buffer's add and sample, the
table from ``jnp.zeros`` or from ``functional_rb._internal.hugepages.zeros``). Every (engine, size, pages) point is measured in
every round, the order rotated each round, each point in a fresh table whose pages are touched
first; the median of ``--draws`` steps per point, then the median and range over rounds, in
microseconds, with the load average and the ``AnonHugePages`` each table got.

Usage: ``python benchmarks/gather_floor.py [--sizes 1e4 1e6 1e7 1e8] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from functional_rb._internal import hugepages  # noqa: E402

WIDTH, BATCH = 7, 256


def _anon_huge_mb() -> float:
    return (hugepages.report().get("anon_huge_pages_kib") or 0) / 1024


def numpy_point(n: int, huge: bool, draws: int, rng) -> tuple[float, float]:
    """Median us per gather + write over ``draws`` steps, and the AnonHugePages (MB) held."""
    np._core.multiarray._set_madvise_hugepage(huge)
    try:
        table = np.zeros((n, WIDTH), np.float32)
    finally:
        np._core.multiarray._set_madvise_hugepage(True)
    table[:] = 1.0  # every page touched (and faulted in as huge or not)
    idx = rng.integers(0, n, (draws, BATCH))
    rows = np.ones((BATCH, WIDTH), np.float32)
    times, acc = [], 0.0
    for i in range(draws):
        t = time.perf_counter()
        acc += table[idx[i]].sum()
        start = (i * BATCH) % (n - BATCH)
        table[start : start + BATCH] = rows
        times.append(time.perf_counter() - t)
    huge_mb = _anon_huge_mb()
    del table
    return statistics.median(times) * 1e6, huge_mb


# Two calls, as the buffer makes them (add, then sample): one computation that both gathers
# from and writes into the table copies it whole (XLA writes a donated array in place only
# when no read of its old value comes after the write could start).
_xla_write = jax.jit(
    lambda table, rows, start: jax.lax.dynamic_update_slice(table, rows, (start, 0)),
    donate_argnums=0,
)
_xla_gather = jax.jit(lambda table, idx: table[idx].sum())


_touch = jax.jit(lambda t: t + 1.0, donate_argnums=0)  # in place: the same, advised buffer


def xla_point(n: int, huge: bool, draws: int, rng) -> tuple[float, float]:
    previous = hugepages.set_enabled(huge)
    try:
        table = _touch(hugepages.zeros((n, WIDTH), jnp.float32))  # every page touched
    finally:
        hugepages.set_enabled(previous)
    # every argument made before the clock starts (an eager idx[i] would time a dispatch)
    idx = [jnp.asarray(x, jnp.int32) for x in rng.integers(0, n, (draws, BATCH))]
    rows = jnp.ones((BATCH, WIDTH), jnp.float32)
    starts = [jnp.int32((i * BATCH) % (n - BATCH)) for i in range(draws)]
    table = _xla_write(table, rows, starts[0])  # compile both
    jax.block_until_ready(_xla_gather(table, idx[0]))
    times = []
    for i in range(draws):
        t = time.perf_counter()
        table = _xla_write(table, rows, starts[i])
        _xla_gather(table, idx[i]).block_until_ready()
        times.append(time.perf_counter() - t)
    huge_mb = _anon_huge_mb()
    del table
    return statistics.median(times) * 1e6, huge_mb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", nargs="+", type=lambda x: int(float(x)), default=[10**4, 10**6, 10**7, 10**8]
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--engines", nargs="+", choices=("numpy", "xla"), default=["numpy", "xla"])
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    points = [(e, n, h) for e in args.engines for n in args.sizes for h in (True, False)]
    runs = {p: [] for p in points}
    loads = []
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        order = points[r % len(points) :] + points[: r % len(points)]
        loads.append(os.getloadavg()[0])
        for e, n, h in order:
            fn = numpy_point if e == "numpy" else xla_point
            us, mb = fn(n, h, args.draws, rng)
            runs[(e, n, h)].append((us, mb))
            print(
                f"[round {r + 1}] {e:5s} {n:>13,} huge={h!s:5s} {us:8.1f} us  AnonHugePages "
                f"{mb:,.0f} MB",
                file=sys.stderr,
                flush=True,
            )
    loads.append(os.getloadavg()[0])
    print(
        f"gather 256 random rows + write 256 contiguous rows of a [N, {WIDTH}] f32 table, "
        f"us per step, median (min-max) of {args.rounds} rounds; load average "
        + " -> ".join(f"{x:.2f}" for x in loads)
        + "\n"
    )
    print("| engine | rows | huge pages | 4 KiB pages | huge / 4 KiB | AnonHugePages (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for e in args.engines:
        for n in args.sizes:
            on = [x[0] for x in runs[(e, n, True)]]
            off = [x[0] for x in runs[(e, n, False)]]
            mb = statistics.median(x[1] for x in runs[(e, n, True)])
            cell = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"  # noqa: E731
            print(
                f"| {e} | {n:.0e} | {cell(on)} | {cell(off)} | "
                f"{statistics.median(on) / statistics.median(off):.2f} | {mb:,.0f} |"
            )
            rows.append(
                {"engine": e, "rows": n, "huge_us": on, "small_us": off, "anon_huge_mb": mb}
            )
    if args.out:
        args.out.write_text(json.dumps({"loadavg": loads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
