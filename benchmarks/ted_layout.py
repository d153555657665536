"""Would packing TED's small leaves beside the side-table pointer make a sample cheaper?

A ``TEDStorage`` sample of 256 transitions reads, per item, the pointer (``ptr``), three small
leaves (action f32, reward f32, done bool) and two observation rows (the step's and its
successor's, usually on the same or the next cache line). Packing the pointer and the small
leaves into one ``[C, 4]`` int32 slab would read one line for the four. This times the reads
alone, per jitted call with a fresh key each (W5's per-call mode), from ``C`` items:

* ``draw``: the 256 random indices only (the call's floor);
* ``obs``: plus the two observation rows of each item;
* ``leaves``: plus the pointer and the three small leaves as four arrays (today's layout);
* ``packed``: plus the same four values from one ``[C, 4]`` slab.

The indices are held in a buffer before the reads, as ``rb.sample`` holds them;
``--fused-draw`` lets XLA compile the draw into each read instead (what every read did before
``functional_rb._internal.jit.settled``). Variants run interleaved (the order reversed every
other round), ``--calls`` calls per round;
the table gives each variant's median over rounds and its range, in microseconds per call.

Usage::

    python benchmarks/ted_layout.py --sizes 1e6 1e8 --rounds 7 --out benchmarks/results/ted_layout.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/<this>.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks._stats import run_meta  # noqa: E402

B = 256
VARIANTS = ("draw", "obs", "leaves", "packed")


def _point(size: int, rounds: int, calls: int, settle: bool = True) -> dict:
    """Every variant at ``size`` items, in this process: ``{variant: [us per call, ...]}``.
    ``settle``: the indices held in a buffer before the reads, as ``rb.sample`` does;
    otherwise XLA compiles the draw into each read."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from functional_rb._internal.jit import settled

    rng = np.random.default_rng(0)
    obs = jnp.asarray(rng.standard_normal((size + 1, 4), np.float32))
    act = jnp.asarray(rng.standard_normal(size, np.float32))
    rew = jnp.asarray(rng.standard_normal(size, np.float32))
    done = jnp.asarray(rng.random(size) < 0.01)
    ptr = jnp.full((size,), -1, jnp.int32)
    slab = jnp.stack(
        [act.view(jnp.int32), rew.view(jnp.int32), done.astype(jnp.int32), ptr], axis=1
    )

    def rows(x, i):
        return x.at[i].get(mode="promise_in_bounds")

    def draw(key):
        i = jax.random.randint(key, (B,), 0, size)
        return settled(i, i[0] >= 0) if settle else i

    # the tables are arguments, as a buffer's state is (closed over, they would be constants)
    def two_obs(obs, i, p):
        nxt = jnp.where(p >= 0, p, i + 1)
        return rows(obs, i).sum() + rows(obs, nxt).sum()

    def v_draw(t, key):
        return draw(key).sum().astype(jnp.float32)

    def v_obs(t, key):
        i = draw(key)
        return two_obs(t["obs"], i, jnp.full_like(i, -1))

    def v_leaves(t, key):
        i = draw(key)
        small = rows(t["act"], i).sum() + rows(t["rew"], i).sum() + rows(t["done"], i).sum()
        return two_obs(t["obs"], i, rows(t["ptr"], i)) + small

    def v_packed(t, key):
        i = draw(key)
        r = rows(t["slab"], i)
        small = jax.lax.bitcast_convert_type(r[:, :2], jnp.float32).sum() + r[:, 2].sum()
        return two_obs(t["obs"], i, r[:, 3]) + small

    tables = {
        "draw": {},
        "obs": {"obs": obs},
        "leaves": {"obs": obs, "act": act, "rew": rew, "done": done, "ptr": ptr},
        "packed": {"obs": obs, "slab": slab},
    }
    fns = {
        n: jax.jit(f) for n, f in zip(VARIANTS, (v_draw, v_obs, v_leaves, v_packed), strict=True)
    }
    keys = list(jax.random.split(jax.random.key(1), rounds * calls * len(fns) + len(fns)))
    k = 0
    for n, f in fns.items():
        f(tables[n], keys[k]).block_until_ready()
        k += 1
    out: dict = {n: [] for n in fns}
    for r in range(rounds):
        for n in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            f, tab = fns[n], tables[n]
            t = time.perf_counter()
            for _ in range(calls):
                res = f(tab, keys[k])
                k += 1
            res.block_until_ready()
            out[n].append((time.perf_counter() - t) / calls * 1e6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=lambda x: int(float(x)), default=[10**6, 10**8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument(
        "--fused-draw",
        action="store_true",
        help="let XLA compile the draw into each read (the indices not held in a buffer)",
    )
    ap.add_argument("--point", type=int, help=argparse.SUPPRESS)  # a child: one size
    args = ap.parse_args(argv)
    if args.point is not None:
        print(json.dumps(_point(args.point, args.rounds, args.calls, not args.fused_draw)))
        return 0
    rows = []
    for size in args.sizes:  # each size in a fresh process: no cache or page state carried
        load0 = os.getloadavg()[0]
        cmd = [sys.executable, __file__, "--point", str(size), "--rounds", str(args.rounds)]
        cmd += ["--fused-draw"] if args.fused_draw else []
        res = subprocess.run(
            cmd + ["--calls", str(args.calls)], capture_output=True, text=True, check=True
        )
        per = json.loads(res.stdout.strip().splitlines()[-1])
        load1 = os.getloadavg()[0]
        for n in VARIANTS:
            v = per[n]
            rows.append(
                {
                    "size": size,
                    "variant": n,
                    "median_us": statistics.median(v),
                    "rounds_us": v,
                    "load": [load0, load1],
                }
            )
    print("| size | " + " | ".join(VARIANTS) + " | load |")
    print("|---:|" + "---:|" * len(VARIANTS) + "---|")
    for size in args.sizes:
        cells = []
        for n in VARIANTS:
            r = next(x for x in rows if x["size"] == size and x["variant"] == n)
            cells.append(
                f"{r['median_us']:.1f} ({min(r['rounds_us']):.1f}-{max(r['rounds_us']):.1f})"
            )
        load = next(x["load"] for x in rows if x["size"] == size)
        print(f"| {size:.0e} | " + " | ".join(cells) + f" | {load[0]:.2f}->{load[1]:.2f} |")
    if args.out:
        meta = run_meta(rounds=args.rounds, calls=args.calls, fused_draw=args.fused_draw)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
