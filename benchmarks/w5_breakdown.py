"""Where W5's step goes: each part of our step timed alone, at 10^4 and 10^8 items.

W5 (``benchmarks/w5_scale.py``) times a whole step: jitted, donated ``add`` of 256 items,
``sample`` (and ``update`` of the drawn priorities for ``prioritized``), one call each. This
script builds the same buffers (``scale_backends.FunctionalRB``) and times their parts:

* per call, as W5 calls them: ``call.step`` (W5's step), ``call.add``, ``call.sample``,
  ``call.update``, and ``call.empty`` (a jitted, donated identity on the whole state: what a
  call costs before it computes anything);
* compute only, ``K`` of one part inside one ``lax.scan`` (the time per iteration, every output
  consumed, every call with keys of its own): ``scan.add``; ``scan.draw`` (the sampler's draw
  alone: ``rb.sampler.sample``); ``scan.draw+get`` (the draw and the storage's read of its
  indices, ``rb.storage.get``); ``scan.update`` (the priorities of 256 uniform indices);
  ``scan.step`` (W5's scan mode: the whole step). ``call.update`` writes the priorities of
  256 fresh uniform indices per call.

The per-call excess experiment (why a call costs more than the scan's compute plus an empty
call, more so at 10^8): ``call.sample.hot`` draws with one key every call (the rows of the call
before, still cached) and ``scan.draw+get.hot`` with four keys in turn, so the cold rows'
share is ``call.sample - call.sample.hot`` per call and ``scan.draw+get - scan.draw+get.hot``
in a scan; ``--hugepages on off`` runs each point with and without huge pages (the page
walks' share). ``call.draw+get`` lets XLA compile the draw into each leaf's gather (it copies
the hash and modulo into every gather loop); ``call.draw+settle+get`` holds the indices in a
buffer first, as ``rb.sample`` does (``functional_rb._internal.jit.settled``);
``call.get.given`` reads indices drawn beforehand, passed as an argument (the floor).
``--parts`` times only the parts named.

Each (sampler, size, huge pages) point runs in its own process, every point in every round, the order
rotated each round, the parts' order rotated within a point; medians of ``--blocks`` blocks per
part, then the median and range over rounds, in microseconds, with the load average.

Usage: ``python benchmarks/w5_breakdown.py [--samplers ...] [--sizes 1e4 1e8] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

from benchmarks import scale_backends as sb  # noqa: E402
from benchmarks.w5_scale import time_blocks  # noqa: E402
from functional_rb._internal.jit import settled  # noqa: E402

K = 200  # iterations of one part in a scan
POOL = 4000  # index sets drawn beforehand for call.get.given
CALL_PARTS = (
    "call.step",
    "call.empty",
    "call.add",
    "call.sample",
    "call.sample.hot",
    "call.draw+get",
    "call.draw+get.hot",
    "call.draw+settle+get",
    "call.get.given",
    "call.update",
)
SCAN_PARTS = (
    "scan.step",
    "scan.add",
    "scan.draw",
    "scan.draw+get",
    "scan.draw+get.hot",
    "scan.update",
)


def _scan_parts(b) -> dict:
    """The compute-only parts of backend ``b``: name -> a function of no argument that runs
    ``K`` iterations of the part (its state kept in ``b.state``), blocked by ``b.block()``.
    Every call draws with keys of its own: indices drawn again in a later call would find
    their rows in the cache (32 MiB of L3 here holds 200 x 256 rows many times over)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from functional_rb.samplers import uniform_index

    rb, bs = b.rb, b.rb.batch_size
    steps = jnp.arange(K, dtype=jnp.int32)
    calls = itertools.count(1)

    def consume(acc, tree):
        return acc + sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(tree))

    def draw_k(state, call, get, hot=False, n=K):
        # hot: four keys in turn (of the calls, and of the iterations), so the rows are those
        # of 3 calls or iterations ago (still cached) and the work is not loop-invariant (XLA
        # would hoist it out of the scan)
        ctx, key = rb.context(state), jax.random.fold_in(b.keys[0], call % 4 if hot else call)

        def body(acc, i):
            k = jax.random.fold_in(key, i % 4 if hot else i)
            drawn, _ = rb.sampler.sample(state.sampler, k, bs, ctx)
            out = (drawn.indices, drawn.weights)
            if get:
                out = (out, rb.storage.get(state.storage, drawn.indices, ctx))
            return consume(acc, out), None

        return jax.lax.scan(body, jnp.float32(0), jnp.arange(n, dtype=jnp.int32))[0]

    def add_k(state):
        def body(state, i):
            return rb.add(state, sb.shifted(b.batch, i)), None

        return jax.lax.scan(body, state, steps)[0]

    def update_k(state, call):
        key, n = jax.random.fold_in(b.keys[1], call), rb.context(state).size

        def body(state, i):
            idx = uniform_index(jax.random.fold_in(key, i), (bs,), n, rb.capacity)
            return rb.update(state, idx, (idx % 7).astype(jnp.float32) + 0.5), None

        return jax.lax.scan(body, state, steps)[0]

    def draw_settle_get(state, call):
        # the scan's body as rb.sample runs it: the indices held in a buffer (a lax.cond)
        # before the storage's gathers read them
        ctx, key = rb.context(state), jax.random.fold_in(b.keys[0], call)
        drawn, _ = rb.sampler.sample(state.sampler, key, bs, ctx)
        idx = settled(drawn.indices, ctx.size > 0)
        return consume(
            jnp.float32(0), ((idx, drawn.weights), rb.storage.get(state.storage, idx, ctx))
        )

    def drawn_indices(state, key):
        return rb.sampler.sample(state.sampler, key, bs, rb.context(state))[0].indices

    def get_given(state, idx):
        return consume(jnp.float32(0), rb.storage.get(state.storage, idx, rb.context(state)))

    draw = jax.jit(draw_k, static_argnums=(2, 3, 4))
    settle_call, get_call, draw_call = (
        jax.jit(draw_settle_get),
        jax.jit(get_given),
        jax.jit(drawn_indices),
    )
    # indices drawn beforehand, each set read once per pass: POOL sets of 256 rows are far
    # more than L3 holds at 10^8 items, so a set's rows are cold again when it comes round
    pool = [draw_call(b.state, jax.random.fold_in(b.keys[2], i)) for i in range(POOL)]
    given = itertools.count()
    add = jax.jit(add_k, donate_argnums=0)
    update = jax.jit(update_k, donate_argnums=0)

    def keep(fn):
        def run():
            b.last = fn(np.int32(next(calls)))

        return run

    def advance(fn):
        def run():
            b.state = fn(np.int32(next(calls)))

        return run

    parts = {
        "scan.step": lambda: b.scan_steps(K),
        "scan.add": advance(lambda c: add(b.state)),
        "scan.draw": keep(lambda c: draw(b.state, c, False)),
        "scan.draw+get": keep(lambda c: draw(b.state, c, True)),
        "scan.draw+get.hot": keep(lambda c: draw(b.state, c, True, True)),
        # the scan's body as a call of its own (one iteration): per call, the same program
        "call.draw+get": keep(lambda c: draw(b.state, c, True, False, 1)),
        "call.draw+get.hot": keep(lambda c: draw(b.state, c, True, True, 1)),
        "call.draw+settle+get": keep(lambda c: settle_call(b.state, c)),
        "call.get.given": keep(lambda c: get_call(b.state, pool[next(given) % POOL])),
    }
    if b.prioritized:
        parts["scan.update"] = advance(lambda c: update(b.state, c))
    return parts


def _call_parts(b) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    empty = jax.jit(lambda state: state, donate_argnums=0)
    # call.update's indices: fresh ones each call (the same 256 would be updated from the cache)
    rng = np.random.default_rng(2)
    n_fresh = sb.KEYS if b.prioritized else 0
    fresh = [jnp.asarray(rng.integers(0, b.size, 256), jnp.int32) for _ in range(n_fresh)]
    updates = itertools.count()

    def sample():
        b.last, _, b.state = b.sample_call(b.state, b.next_key())

    hot_key = b.next_key()

    def sample_hot():  # one key for every call: the rows of the last call, still cached
        b.last, _, b.state = b.sample_call(b.state, hot_key)

    def add():
        b.state = b.add_call(b.state, b.batch)

    def update():
        b.state = b.update_call(b.state, fresh[next(updates) % sb.KEYS], b.last)

    def run_empty():
        b.state = empty(b.state)

    parts = {
        "call.step": b.step,
        "call.empty": run_empty,
        "call.add": add,
        "call.sample": sample,
        "call.sample.hot": sample_hot,
    }
    if b.prioritized:
        sample()  # b.last: the priorities (from its rewards) every update call writes
        parts["call.update"] = update
    return parts


def time_parts(
    sampler: str, size: int, blocks: int, block_s: float, rotate: int, only=None
) -> dict:
    """Build one buffer, time every part; ``{part: median us, part + '.blocks': [...]}``."""
    t0 = time.perf_counter()
    b = sb.FunctionalRB(sampler, size)
    out = {"build_s": round(time.perf_counter() - t0, 1)}
    b.step()  # every part's block() waits on the last sample too
    parts = {**_call_parts(b), **_scan_parts(b)}
    names = [n for n in parts if only is None or n in only]
    names = names[rotate % len(names) :] + names[: rotate % len(names)]
    for name in names:
        run = parts[name]
        for _ in range(3):  # compile, first touches
            run()
        b.block()
        steps = K if name.startswith("scan.") else 500
        per = time_blocks(b, run, "call", steps, blocks, block_s)
        if name.startswith("scan."):
            per = [v / K for v in per]  # time_blocks counted one "step" per call
        out[name] = statistics.median(per)
        out[name + ".blocks"] = per
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", help=argparse.SUPPRESS)
    ap.add_argument("--samplers", nargs="+", default=list(sb.SAMPLERS), choices=sb.SAMPLERS)
    ap.add_argument("--sizes", nargs="+", type=lambda x: int(float(x)), default=[10**4, 10**8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--block-s", type=float, default=1.0)
    ap.add_argument(
        "--hugepages",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="off: the point's process runs with FRB_HUGEPAGES=0 (no huge-page advice)",
    )
    ap.add_argument(
        "--parts", nargs="+", choices=CALL_PARTS + SCAN_PARTS, help="time only these parts"
    )
    ap.add_argument("--out", type=pathlib.Path, default=_HERE / "results" / "w5_breakdown.json")
    args = ap.parse_args(argv)
    if args.point:
        p = json.loads(args.point)
        print(
            json.dumps(
                time_parts(
                    p["sampler"], p["size"], p["blocks"], p["block_s"], p["r"], p.get("parts")
                )
            )
        )
        return 0
    cells = [(s, n, hp) for s in args.samplers for n in args.sizes for hp in args.hugepages]
    runs = {c: [] for c in cells}
    loads = []
    for r in range(args.rounds):
        loads.append({"round": r, "before": os.getloadavg()})
        for s, n, hp in cells[r % len(cells) :] + cells[: r % len(cells)]:
            spec = {"sampler": s, "size": n, "blocks": args.blocks, "block_s": args.block_s}
            spec["parts"] = args.parts
            env = dict(os.environ, PYTHONHASHSEED="0", FRB_HUGEPAGES="1" if hp == "on" else "0")
            p = subprocess.run(
                [sys.executable, __file__, "--point", json.dumps({**spec, "r": r})],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode or not lines:
                sys.exit(f"{s} {n:,} hugepages {hp}: rc={p.returncode}\n{p.stderr[-2000:]}")
            runs[(s, n, hp)].append(json.loads(lines[-1]))
            print(
                f"[round {r + 1}/{args.rounds}] {s} {n:,} hugepages {hp} done",
                file=sys.stderr,
                flush=True,
            )
        loads[-1]["after"] = os.getloadavg()
    rows = []
    for (s, n, hp), recs in runs.items():
        for part in CALL_PARTS + SCAN_PARTS:
            vals = [rec[part] for rec in recs if part in rec]
            if vals:
                rows.append(
                    {
                        "sampler": s,
                        "size": n,
                        "hugepages": hp,
                        "part": part,
                        "median_us": statistics.median(vals),
                        "min_us": min(vals),
                        "max_us": max(vals),
                    }
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "cpus": os.cpu_count(),
        "loadavg_per_round": loads,
        "hugepages": args.hugepages,
        "unit": "us per call (call.*) or per scan iteration (scan.*)",
    }
    points = [{"cell": list(c), "runs": v} for c, v in runs.items()]
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "points": points}, indent=1))
    print(table(rows, [(n, hp) for n in args.sizes for hp in args.hugepages]))
    print(
        "load average per round: "
        + ", ".join(f"{x['before'][0]:.1f}->{x['after'][0]:.1f}" for x in loads)
    )
    return 0


def table(rows: list[dict], columns: list[tuple]) -> str:
    """Markdown: one line per (sampler, part), one column per (size, huge pages)."""
    by = {(r["sampler"], r["part"], (r["size"], r.get("hugepages", "on"))): r for r in rows}
    keys = list(dict.fromkeys((r["sampler"], r["part"]) for r in rows))

    def cell(r):
        if r is None:
            return "-"
        return f"{r['median_us']:,.1f} ({r['min_us']:,.1f}-{r['max_us']:,.1f})"

    both = len({hp for _, hp in columns}) > 1
    names = [f"{n:,.0e}" + (f", huge pages {hp}" if both else "") for n, hp in columns]
    lines = ["| sampler | part | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for s, part in keys:
        lines.append(
            f"| {s} | {part} | " + " | ".join(cell(by.get((s, part, c))) for c in columns) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
