"""W5 scale: per-step cost (add + sample [+ update]) from 10^4 to 10^8 items (10^9 from a memmap).

For each sampler (uniform, prioritized, slices, TED) and each size, functional_rb against
TorchRL, flashbax and cpprb (``benchmarks/scale_backends.py`` has the buffers, their items and
what one step is). Every point (sampler, backend, size) runs in its own fresh process, which
builds the buffer full at that size, warms up, and times blocks of steps (median of blocks);
points run in interleaved rounds (every point once per round, the order rotated each round),
and the table gives each point's median over rounds and its min-max range, in microseconds per
step (lower is better), with the load average before and after every point. Slices also run
from a disk-backed ``MemmapStorage`` (files under ``--memmap-dir``), up to 10^9 items.

A cell that cannot run says why (a peer's broken extension, a sampler a library lacks, not
enough memory or disk for the size: checked against ``MemAvailable`` and free disk before the
point starts) instead of a number.

Usage::

    python benchmarks/w5_scale.py                       # everything, 5 rounds (hours)
    python benchmarks/w5_scale.py --quick               # 10^4 and 10^5, 2 rounds, short blocks
    python benchmarks/w5_scale.py --samplers slices --backends functional_rb torchrl \\
        --sizes 1e4 1e6 1e8 --rounds 5 --max-size 1e8
    python benchmarks/w5_scale.py --mode scan           # JAX backends, steps inside lax.scan
    python benchmarks/w5_scale.py --pages on off        # every point with and without huge pages
    python benchmarks/w5_scale.py --pages on off --peer-pages on   # the peers with them only

Writes ``--out`` (JSON, default ``benchmarks/results/w5_scale.json``) and the plot
``benchmarks/plots/bench-w5.png`` (``benchmarks/plot.py --w5 JSON`` redraws it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/w5_scale.py` from the checkout
    sys.path.append(str(_HERE.parent))  # after site-packages: an installed functional_rb wins

from benchmarks import _stats
from benchmarks import scale_backends as sb

SIZES = (10**4, 10**5, 10**6, 10**7, 10**8, 10**9)
MEMMAP_ONLY_ABOVE = 10**8  # sizes above this run from MemmapStorage only


# ------------------------------------------------------------------ one point (child process)
def _mem_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def check_room(sampler, backend, size, memmap_dir) -> str | None:
    """Why the point cannot run on this machine (None if it fits)."""
    ram, disk = sb.bytes_needed(sampler, backend, size)
    avail = _mem_available()
    if ram > 0.85 * avail:
        return f"needs ~{ram / 1e9:.1f} GB of memory, {avail / 1e9:.1f} GB available"
    if disk:
        os.makedirs(memmap_dir, exist_ok=True)
        free = shutil.disk_usage(memmap_dir).free
        if disk * 1.1 > free:
            return (
                f"needs ~{disk / 1e9:.1f} GB of disk under {memmap_dir}, {free / 1e9:.1f} GB free"
            )
    return None


def _anon_huge_kb() -> float:
    """The kernel's ``AnonHugePages`` for this process, in kB (0 where it cannot be read): what
    the huge-page advice (ours, or glibc's with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``) got."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _steal_s() -> float | None:
    """CPU time the hypervisor gave other guests, summed over this machine's CPUs, in seconds
    since boot (``steal`` in ``/proc/stat``; None where it cannot be read): a tenant's load
    that the load average does not show."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# Huge pages per point (--pages): "on" asks for them in every library's process: ours by its
# default advice (FRB_HUGEPAGES=1, nothing else), the peers through glibc's malloc tunable
# (malloc advises each mapping it makes; NumPy advises its own arrays either way). Ours runs
# as users run it, without the tunable (with it, a 10^4-item prioritized step measured the
# same: 92-106 us against 109-161, 3 alternating runs).
# "off" turns ours and NumPy's advice off (4 KiB pages unless THP is "always").
PAGES_ENV = {
    "on": {"FRB_HUGEPAGES": "1"},
    "on-peer": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "off": {"FRB_HUGEPAGES": "0", "NUMPY_MADVISE_HUGEPAGE": "0"},
}


def pages_env(backend: str, pages: str) -> dict:
    """The environment variables of a point run with huge pages ``pages`` (see PAGES_ENV)."""
    if pages == "on" and not backend.startswith("functional_rb"):
        return PAGES_ENV["on-peer"]
    return PAGES_ENV.get(pages, {})


def time_blocks(b, run, mode: str, steps: int, blocks: int, block_s: float) -> list[float]:
    """Microseconds per step of each of ``blocks`` timed blocks of ``run`` (warmed up by the
    caller): per call, at most ``steps`` calls or ``block_s`` seconds (at least 3 calls); in
    scan mode one call of ``steps`` steps. ``b.block()`` waits for the device."""
    per_step = []
    for _ in range(blocks):
        n, t = 0, time.perf_counter()
        if mode == "call":
            deadline = t + block_s
            while n < steps and (n < 3 or time.perf_counter() < deadline):
                run()
                n += 1
        else:
            run()
            n = steps
        b.block()
        per_step.append((time.perf_counter() - t) / n * 1e6)
    return per_step


def warm_up(b, run, warmup_s: float) -> int:
    """Run ``run`` 3 times (compiles, first touches), then for ``warmup_s`` seconds more; the
    number of calls. Some processes here start their steps several times slower and settle
    within ~1.3 s of running (peers and ours alike: NOTES, "Warm-up"), so the seconds count
    from after the first calls: a compile that took 2 s used up a warm-up that began with it."""
    for _ in range(3):
        run()
    b.block()
    n, t = 3, time.perf_counter()
    while time.perf_counter() - t < warmup_s:
        run()
        n += 1
    b.block()
    return n


def time_point(
    sampler,
    backend,
    size,
    mode,
    steps,
    blocks,
    block_s,
    memmap_dir,
    touch_pages=False,
    warmup_s=0.0,
) -> dict:
    """Build one buffer, warm up (:func:`warm_up`), time ``blocks`` blocks; the point's
    record. ``touch_pages``: a memmap buffer maps every page of its files first
    (``MemmapStorage.touch``)."""
    room = check_room(sampler, backend, size, memmap_dir)
    if room:
        return {"skipped": room}
    tmp = tempfile.mkdtemp(prefix="w5_", dir=memmap_dir) if "memmap" in backend else None
    try:
        t0 = time.perf_counter()
        try:
            b = sb.BACKENDS[backend](sampler, size, tmp)
            build_s = time.perf_counter() - t0
            touched_s = None
            if touch_pages and tmp:
                t1 = time.perf_counter()
                b.rb.storage.touch()
                touched_s = round(time.perf_counter() - t1, 2)
            run = b.step if mode == "call" else (lambda: b.scan_steps(steps))
            warm_calls = warm_up(b, run, warmup_s)
        except sb.Skip as e:
            return {"skipped": str(e)}
        steal0 = _steal_s()
        per_step = time_blocks(b, run, mode, steps, blocks, block_s)
        steal1 = _steal_s()
        return {
            "us_per_step": statistics.median(per_step),
            "blocks_us": per_step,
            "build_s": round(build_s, 2),
            "warmup_calls": warm_calls,
            "touched_s": touched_s,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "anon_huge_mb": round(_anon_huge_kb() / 1024, 1),
            # over the timed blocks
            "steal_s": None if steal0 is None or steal1 is None else round(steal1 - steal0, 3),
        }
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ the driver
def cells(samplers, backends, sizes, max_size, in_memory_up_to=MEMMAP_ONLY_ABOVE):
    out = []
    for s in samplers:
        for b in sb.DEFAULT_BACKENDS[s]:
            if backends and b not in backends:
                continue
            for n in sizes:
                if n > max_size:
                    continue
                if n > in_memory_up_to and not b.startswith("functional_rb-memmap"):
                    continue
                if b.startswith("functional_rb-memmap") and s != "slices":
                    continue
                out.append((s, b, n))
    return out


def run_point(cell, args) -> dict:
    s, b, n, pages = cell
    spec = json.dumps(
        {
            "sampler": s,
            "backend": b,
            "size": n,
            "mode": args.mode,
            "steps": args.steps,
            "blocks": args.blocks,
            "block_s": args.block_s,
            "memmap_dir": args.memmap_dir,
            "touch_pages": args.touch_pages,
            "warmup_s": args.warmup_s,
        }
    )
    load0 = os.getloadavg()[0]
    cpu0 = _stats.cpu_ms()
    t = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--point", spec],
            capture_output=True,
            check=False,
            text=True,
            timeout=args.point_timeout,
            env=dict(os.environ, PYTHONHASHSEED="0", **pages_env(b, pages)),
        )
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        rec = (
            json.loads(lines[-1])
            if p.returncode == 0 and lines
            else {
                "failed": f"rc={p.returncode}: "
                + (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            }
        )
    except subprocess.TimeoutExpired:
        rec = {"failed": f"timed out after {args.point_timeout} s"}
    rec.update(
        load_before=round(load0, 2),
        load_after=round(os.getloadavg()[0], 2),
        wall_s=round(time.perf_counter() - t, 1),
        # a loop's ms on each CPU before and after the point (a slow CPU: NOTES, W5)
        cpu_ms_before=cpu0,
        cpu_ms_after=_stats.cpu_ms(),
    )
    return rec


def _cpu_line(rec: dict) -> str:
    """``cpu_ms`` before -> after, each CPU's loop time."""
    before, after = rec.get("cpu_ms_before") or {}, rec.get("cpu_ms_after") or {}
    return " ".join(f"{before[c]:.1f}->{after.get(c, float('nan')):.1f}" for c in before)


def summarize(results: dict) -> list[dict]:
    rows = []
    for (s, b, n, pages), recs in results.items():
        vals = [r["us_per_step"] for r in recs if "us_per_step" in r]
        if pages:
            b = f"{b} (huge pages {pages})"
        why = next(
            (r.get("skipped") or r.get("failed") for r in recs if "us_per_step" not in r), None
        )
        row = {"sampler": s, "backend": b, "size": n, "rounds": len(vals), "values_us": vals}
        huge = [r["anon_huge_mb"] for r in recs if "anon_huge_mb" in r]
        if huge:
            row["anon_huge_mb"] = statistics.median(huge)
        if vals:
            row.update(median_us=statistics.median(vals), min_us=min(vals), max_us=max(vals))
        if why and not vals:
            row["reason"] = why
        rows.append(row)
    return rows


def _us(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def table(rows: list[dict]) -> str:
    sizes = sorted({r["size"] for r in rows})
    lines = [
        "| sampler | backend | "
        + " | ".join(f"{n:.0e}".replace("+0", "") for n in sizes)
        + " | growth (largest / 10^4) |",
        "|---|---|" + "---:|" * (len(sizes) + 1),
    ]
    notes = []
    for key in dict.fromkeys((r["sampler"], r["backend"]) for r in rows):
        by = {r["size"]: r for r in rows if (r["sampler"], r["backend"]) == key}
        cellv = []
        for n in sizes:
            r = by.get(n)
            if r is None:
                cellv.append("")
            elif "median_us" in r:
                cellv.append(f"{_us(r['median_us'])} ({_us(r['min_us'])}-{_us(r['max_us'])})")
            else:
                notes.append(f"{key[0]} / {key[1]} / {n:,}: {r.get('reason', 'no result')}")
                cellv.append("n/a")
        done = [by[n]["median_us"] for n in sizes if n in by and "median_us" in by[n]]
        small = by.get(10**4, {}).get("median_us")
        growth = f"{done[-1] / small:.2f}x" if small and len(done) > 1 else ""
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cellv) + f" | {growth} |")
    return "\n".join(lines + [""] + [f"- {x}" for x in dict.fromkeys(notes)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", help=argparse.SUPPRESS)  # child: one point, JSON spec
    ap.add_argument("--samplers", nargs="+", default=list(sb.SAMPLERS), choices=sb.SAMPLERS)
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=sorted(sb.BACKENDS),
        help="default: every backend that implements the sampler",
    )
    ap.add_argument("--sizes", nargs="+", type=lambda x: int(float(x)), default=list(SIZES))
    ap.add_argument(
        "--max-size",
        type=lambda x: int(float(x)),
        default=10**9,
        help="skip sizes above this (e.g. 1e7 on a small machine)",
    )
    ap.add_argument(
        "--mode",
        choices=("call", "scan"),
        default="call",
        help="call: jitted add/sample/update called per step (default); "
        "scan: --steps steps in one lax.scan (JAX backends only)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=500, help="steps per block (at most)")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument(
        "--block-s",
        type=float,
        default=3.0,
        help="a block stops after this many seconds (at least 3 steps)",
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=2.0,
        help="every point makes 3 calls (the compiles), then runs its step for this many "
        "seconds before timing: some processes start several times slower and settle within "
        "~1.3 s of running",
    )
    ap.add_argument("--point-timeout", type=int, default=3600)
    ap.add_argument("--memmap-dir", default=os.path.join(tempfile.gettempdir(), "frb_w5_memmap"))
    ap.add_argument(
        "--in-memory-up-to",
        type=lambda x: int(float(x)),
        default=MEMMAP_ONLY_ABOVE,
        help="sizes above this run from MemmapStorage only (default 1e8); a point "
        "that does not fit in memory is still refused",
    )
    ap.add_argument(
        "--touch-pages",
        action="store_true",
        help="memmap points map every page of their files before timing "
        "(MemmapStorage.touch: a long run's steady state, not first touches)",
    )
    ap.add_argument(
        "--pages",
        nargs="+",
        choices=("default", "on", "off"),
        default=["default"],
        help="huge pages per point: 'on' (ours advised, the peers under "
        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1), 'off' (FRB_HUGEPAGES=0, "
        "NUMPY_MADVISE_HUGEPAGE=0), "
        "'default' (the environment as it is); several: each point once per "
        "choice, interleaved",
    )
    ap.add_argument(
        "--peer-pages",
        nargs="+",
        choices=("default", "on", "off"),
        help="the --pages choices the peers run under (default: all of --pages)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: sizes 1e4 1e5, 2 rounds, 2 blocks of <=50 steps",
    )
    ap.add_argument("--out", type=pathlib.Path, default=_HERE / "results" / "w5_scale.json")
    ap.add_argument("--plot", type=pathlib.Path, default=_HERE / "plots" / "bench-w5.png")
    args = ap.parse_args(argv)
    if args.point:
        p = json.loads(args.point)
        print(
            json.dumps(
                time_point(
                    p["sampler"],
                    p["backend"],
                    p["size"],
                    p["mode"],
                    p["steps"],
                    p["blocks"],
                    p["block_s"],
                    p["memmap_dir"],
                    p.get("touch_pages", False),
                    p.get("warmup_s", 0.0),
                )
            )
        )
        return 0
    if args.quick:
        args.sizes = [n for n in args.sizes if n <= 10**5]
        args.rounds, args.steps, args.blocks, args.block_s = 2, 50, 2, 1.0
        args.warmup_s = 0.0
    todo = [
        c + ("" if p == "default" else p,)
        for c in cells(
            args.samplers, args.backends, args.sizes, args.max_size, args.in_memory_up_to
        )
        for p in args.pages
        if c[1].startswith("functional_rb") or p in (args.peer_pages or args.pages)
    ]
    if args.mode == "scan":
        todo = [c for c in todo if c[1] in ("functional_rb", "flashbax")]
    results = {c: [] for c in todo}
    loads = []
    for r in range(args.rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)]
        loads.append({"round": r, "before": os.getloadavg()})
        for c in order:
            rec = run_point(c, args)
            results[c].append(rec)
            v = rec.get("us_per_step")
            print(
                f"[round {r + 1}/{args.rounds}] {c[0]:11s} {c[1]:27s} {c[2]:>13,} {c[3]:3s} "
                + (
                    f"{v:12,.1f} us/step"
                    if v is not None
                    else str(rec.get("skipped") or rec.get("failed"))
                )
                + f"  (load {rec['load_before']}"
                + (f", steal {rec['steal_s']} s" if rec.get("steal_s") else "")
                + f", CPU ms {_cpu_line(rec)})",
                file=sys.stderr,
                flush=True,
            )
        loads[-1]["after"] = os.getloadavg()
    rows = summarize(results)
    import jax

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "mode": args.mode,
        "warmup_s": args.warmup_s,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "loadavg_per_round": loads,
        "unit": "us per step (lower is better)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "points": [{"cell": list(c), "runs": v} for c, v in results.items()],
            },
            indent=1,
        )
    )
    print(
        f"W5 ({args.mode} mode, us per step, median (min-max) of {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs; load average per round "
        + ", ".join(f"{x['before'][0]:.1f}->{x['after'][0]:.1f}" for x in loads)
        + ")\n"
    )
    print(table(rows))
    huge = [r for r in rows if r.get("anon_huge_mb")]
    if huge:
        print(
            "\nAnonHugePages (MB, median over rounds) at the end of each point:\n"
            + "\n".join(
                f"- {r['sampler']} / {r['backend']} / {r['size']:,}: {r['anon_huge_mb']:,.0f}"
                for r in huge
            )
        )
    try:
        from benchmarks.plot import plot_scale

        plot_scale(rows, args.plot, title=f"W5: per-step cost against size ({args.mode} mode)")
        print(f"\n{args.out}\n{args.plot}")
    except ImportError as e:  # matplotlib is in the bench extra
        print(f"no plot: {e}")
    return 0


def run(quick: bool = False) -> list[dict]:
    """``benchmarks/run.py w5``: steps/s rows (higher is better), one mode per (sampler, size)."""
    argv = ["--quick"] if quick else []
    with tempfile.TemporaryDirectory() as d:
        main(argv + ["--out", os.path.join(d, "w5.json"), "--plot", os.path.join(d, "w5.png")])
        rows = json.loads(pathlib.Path(d, "w5.json").read_text())["rows"]
    return [
        {
            "mode": f"{r['sampler']}, {r['size']:,} items",
            "backend": r["backend"],
            "value": 1e6 / r["median_us"],
            "unit": "steps/s",
        }
        for r in rows
        if "median_us" in r
    ]


if __name__ == "__main__":
    sys.exit(main())
