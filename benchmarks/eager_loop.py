"""The obvious loop against the donated jitted one: ``python benchmarks/eager_loop.py``.

Capacity 1,000,000 items ``{obs f32[17], action f32[6], reward f32, done f32}`` (W1's), prefilled
with 100,000; one step = add 256 + sample 256. Modes, per step (lower is better):

  eager:        ``state = rb.add(state, x); s, state = rb.sample(state, key)``, no jax.jit in
                sight (each call is one cached compiled call that donates the state, see
                ``functional_rb._internal.eager``);
  jit donated:  ``jax.jit(rb.add, donate_argnums=0)`` and ``jax.jit(rb.sample,
                donate_argnums=0)``, the reference;
  jit, not donated (``--traps``): ``jax.jit(rb.add)`` and ``jax.jit(rb.sample)``: the returned
                state, storage included, is copied at every call;
  op by op (``--traps``): the methods run as plain eager code (how an eager call ran before
                the compiled path).

The two main modes run interleaved (A B A B ...), ``--rounds`` rounds of ``--steps`` steps;
reported: the median and the range of ms per step, and of the ratio eager / jit donated taken
round by round (the two halves of a round ran back to back, so the ratio is steadier than the
absolute figures on a shared machine). The load average is printed before and after; the
table is also written as JSON (``--out``) for ``benchmarks/plot.py``.
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

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/eager_loop.py` from the checkout
    sys.path.append(str(_HERE.parent))

import functional_rb as frb  # noqa: E402
from functional_rb._internal import eager as _eager  # noqa: E402

CAPACITY = 1_000_000
BATCH = 256
PREFILL = 100_000


def _example():
    return {
        "obs": jnp.zeros((17,), jnp.float32),
        "action": jnp.zeros((6,), jnp.float32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.float32),
    }


def _batch(rng, n):
    return {
        "obs": jnp.asarray(rng.standard_normal((n, 17), np.float32)),
        "action": jnp.asarray(rng.standard_normal((n, 6), np.float32)),
        "reward": jnp.asarray(rng.standard_normal((n,), np.float32)),
        "done": jnp.asarray((rng.random((n,)) < 0.01).astype(np.float32)),
    }


class Loop:
    """One way of calling add + sample; ``steps(n)`` returns seconds per step."""

    def __init__(self, rb, add, sample, batch, keys):
        self.rb, self.add, self.sample, self.batch, self.keys = rb, add, sample, batch, keys
        self.state = jax.jit(rb.add, donate_argnums=0)(
            rb.init(_example()), _batch(np.random.default_rng(1), PREFILL)
        )

    def steps(self, n: int) -> tuple[float, float]:
        """Seconds per step: wall time, and this process's CPU time (all its threads: what
        the steps cost, less sensitive than wall time to other jobs on a shared machine)."""
        state, batch, add, sample = self.state, self.batch, self.add, self.sample
        s = None
        t, c = time.perf_counter(), time.process_time()
        for i in range(n):
            state = add(state, batch)
            s, state = sample(state, self.keys[i % len(self.keys)])
        jax.block_until_ready((s, state))
        self.state = state
        return (time.perf_counter() - t) / n, (time.process_time() - c) / n


def _op_by_op(rb, name):
    return lambda *a: _eager.plain(rb, name, *a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--traps",
        action="store_true",
        help="also time jit without donation and op-by-op calls (slow: few steps)",
    )
    ap.add_argument("--out", type=pathlib.Path, default=_HERE / "results" / "eager_loop.json")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    rb = frb.ReplayBuffer(capacity=CAPACITY, batch_size=BATCH)
    batch = _batch(np.random.default_rng(0), BATCH)
    keys = list(jax.random.split(jax.random.key(0), 64))
    loops = {
        "eager: rb.add + rb.sample": Loop(rb, rb.add, rb.sample, batch, keys),
        "jit donated (reference)": Loop(
            rb, jax.jit(rb.add, donate_argnums=0), jax.jit(rb.sample, donate_argnums=0), batch, keys
        ),
    }
    traps = {}
    if args.traps:
        traps = {
            "jit, not donated": Loop(rb, jax.jit(rb.add), jax.jit(rb.sample), batch, keys),
            "op by op (plain eager code)": Loop(
                rb, _op_by_op(rb, "add"), _op_by_op(rb, "sample"), batch, keys
            ),
        }
    for loop in list(loops.values()) + list(traps.values()):
        loop.steps(5)  # compile and warm up
    times = {name: [] for name in list(loops) + list(traps)}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            times[name].append(loop.steps(args.steps))
        for name, loop in traps.items():
            times[name].append(loop.steps(3))
    load1 = os.getloadavg()
    eager, ref = times["eager: rb.add + rb.sample"], times["jit donated (reference)"]
    ratios = [e[0] / r[0] for e, r in zip(eager, ref)]
    cpu_ratios = [e[1] / r[1] for e, r in zip(eager, ref)]
    rows = []
    for clock, k in (("wall", 0), ("CPU", 1)):
        rows += [
            {
                "mode": f"ms per step (add 256 + sample 256), 1M items, {clock} time",
                "backend": name,
                "value": statistics.median(x[k] for x in v) * 1e3,
                "min": min(x[k] for x in v) * 1e3,
                "max": max(x[k] for x in v) * 1e3,
                "unit": "ms/step",
            }
            for name, v in times.items()
        ]
    print(
        f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after "
        f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; {os.cpu_count()} CPUs; "
        f"jax {jax.__version__} ({jax.default_backend()}); {args.rounds} rounds x "
        f"{args.steps} steps\n"
    )
    print("| mode | backend | value | unit | range (min-max) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['backend']} | {row['value']:.3f} | {row['unit']} | "
            f"{row['min']:.3f}-{row['max']:.3f} |"
        )
    for clock, r in (("wall", ratios), ("CPU", cpu_ratios)):
        print(
            f"\neager / jit donated, {clock} time, per round: median "
            f"{statistics.median(r):.2f}x, range {min(r):.2f}-{max(r):.2f}x (target: within 2x)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "rows": rows,
                "ratios": ratios,
                "cpu_ratios": cpu_ratios,
                "load_before": load0,
                "load_after": load1,
                "rounds": args.rounds,
                "steps": args.steps,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
