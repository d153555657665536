"""Where the time of one fused jitted step goes, per call, at a small capacity (W1 and W2 items).

One process, every variant timed in interleaved rounds (median of rounds, microseconds per
call, wall time and process CPU time). Variants, each a jitted function called once per step
from a Python loop with the state donated (as ``benchmarks/w1_uniform.py``'s mode (a') and
``w2_prioritized.py``'s (a')):

* ``step``: the real fused step (W1: add 256 + sample 256; W2: + update the 256 priorities).
* ``floor, same pytrees``: a no-op with the step's arguments, donation and outputs (the state
  returned as is, a batch of the sample's shapes computed from the key): JAX's dispatch,
  argument flattening, donation and output allocation, no buffer work.
* ``floor, state in/out only`` and ``floor, + batch and key in, 1 scalar out``: the same
  floor with fewer arguments or outputs, to attribute its cost to the leaves crossing the call.
* ``floor, not donated``: the same without ``donate_argnums`` (what donation costs or saves).
* ``floor, raw key``: the same with the key passed as raw ``uint32[2]`` data (a typed key
  array is a separate dispatch path).
* ``floor, 1 leaf in / 1 out``: ``x + 1`` on a scalar, the least a jitted call costs.
* ``in scan: step / add / sample / update / rng``: the same work, 1000 steps inside one
  ``lax.scan`` (no dispatch): what the kernels cost; ``rng`` is the sampler's index draw alone.
* ``flatten args``: ``jax.tree_util.tree_flatten`` of the step's arguments in Python.

Usage: ``python benchmarks/percall_breakdown.py [--capacity 10000] [--rounds 9] [--calls 2000]``
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

import functional_rb as frb
from benchmarks.backends import consume as _consume
from benchmarks.w1_uniform import _np_batch
from functional_rb._internal import random as frb_random  # the core sampler's index draw

BATCH = 256
SCAN = 1000


def _build(kind, capacity):
    sampler = frb.PrioritizedSampler(alpha=0.6, beta=0.4) if kind == "W2" else frb.RandomSampler()
    rb = frb.ReplayBuffer(capacity=capacity, batch_size=BATCH, sampler=sampler)
    rng = np.random.default_rng(0)
    state = rb.init_from_data(jax.tree_util.tree_map(jnp.asarray, _np_batch(rng, capacity)))
    return rb, state, jax.tree_util.tree_map(jnp.asarray, _np_batch(rng, BATCH))


def _step_fns(kind, rb):
    def add(state, batch):
        return rb.add(state, batch)

    def sample(state, key):
        s, state = rb.sample(state, key)
        return s, state

    def update(state, s):
        return rb.update(state, s.indices, jnp.abs(s.data["reward"]) + 0.01)

    def step(state, batch, key):
        state = add(state, batch)
        s, state = sample(state, key)
        if kind == "W2":
            state = update(state, s)
            return (s.data, s.weights), state
        return s.data, state

    return add, sample, update, step


def variants(kind, rb, state, batch):
    """{name: call(state, key) -> state} of the per-call variants (the key: typed, or raw
    ``uint32[2]`` for ``floor, raw key``)."""
    step = _step_fns(kind, rb)[3]
    out_shape = jax.eval_shape(step, state, batch, jax.random.key(0))[0]

    def noop(state, batch, key):
        u = jax.random.uniform(key)  # outputs that depend on the call, as a sample's do
        return jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype) + u.astype(s.dtype), out_shape
        ), state

    def noop_raw(state, batch, raw):
        return noop(state, batch, jax.random.wrap_key_data(raw))

    def noop_state_only(state, batch, key):
        del batch, key
        return None, state

    def noop_no_batch_out(state, batch, key):
        return jax.random.uniform(key), state

    j = {
        "step": jax.jit(step, donate_argnums=0),
        "floor, state in/out only": jax.jit(noop_state_only, donate_argnums=0),
        "floor, + batch and key in, 1 scalar out": jax.jit(noop_no_batch_out, donate_argnums=0),
        "floor, same pytrees": jax.jit(noop, donate_argnums=0),
        "floor, not donated": jax.jit(noop),
        "floor, raw key": jax.jit(noop_raw, donate_argnums=0),
    }
    return {name: _state_of(f, batch) for name, f in j.items()}


def _state_of(f, batch):
    """``(state, key) -> state`` calling ``f(state, batch, key)``."""
    return lambda st, k: f(st, batch, k)[1]


def scan_variants(kind, rb, batch):
    add, sample, _, step = _step_fns(kind, rb)

    def scanned(body_fn):
        def run(state, key):
            def body(c, i):
                st, acc = c
                st, val = body_fn(st, jax.random.fold_in(key, i), i)
                return (st, acc + val), None

            (st, acc), _ = jax.lax.scan(
                body, (state, jnp.float32(0)), jnp.arange(SCAN, dtype=jnp.int32)
            )
            return st, acc

        return jax.jit(run, donate_argnums=0)

    def shifted(i):
        return jax.tree_util.tree_map(lambda x: x + i.astype(x.dtype), batch)

    def b_step(st, k, i):
        data, st = step(st, shifted(i), k)
        return st, _consume(0.0, data)

    def b_add(st, k, i):
        return add(st, shifted(i)), jnp.float32(0)

    def b_sample(st, k, i):
        s, st = sample(st, k)
        return st, _consume(0.0, s.data)

    def b_update(st, k, i):
        idx = jax.random.randint(k, (BATCH,), 0, rb.capacity, jnp.int32)
        return rb.update(st, idx, jnp.full((BATCH,), 1.0) + i.astype(jnp.float32)), jnp.float32(0)

    def b_rng(st, k, i):
        bits = jax.random.bits(k, (BATCH,), jnp.uint32)
        return st, jnp.sum(bits % jnp.uint32(rb.capacity)).astype(jnp.float32)

    def b_hash(st, k, i):
        bits = frb_random.bits32(k, (BATCH,))
        return st, jnp.sum(bits % jnp.uint32(rb.capacity)).astype(jnp.float32)

    out = {
        "in scan: step": b_step,
        "in scan: add": b_add,
        "in scan: sample": b_sample,
        "in scan: rng (jax.random.bits)": b_rng,
        "in scan: rng (frb hashed words)": b_hash,
    }
    if kind == "W2":
        out["in scan: update"] = b_update
    return {k: scanned(v) for k, v in out.items()}


def _time(fn, n):
    w, c = time.perf_counter(), time.process_time()
    fn(n)
    return (time.perf_counter() - w) / n * 1e6, (time.process_time() - c) / n * 1e6


def measure(kind, capacity, rounds, calls):
    rb, state, batch = _build(kind, capacity)
    keys = list(jax.random.split(jax.random.key(1), calls))
    per_call = variants(kind, rb, state, batch)
    scans = scan_variants(kind, rb, batch)
    holder = {"state": state}

    raw = [jax.random.key_data(k) for k in keys]  # made before timing: no extra dispatch

    def loop(f, raw_keys=False):
        def go(n):
            st = holder["state"]
            for k in (raw if raw_keys else keys)[:n]:
                st = f(st, k)
            jax.block_until_ready(st)
            holder["state"] = st

        return go

    def scan_loop(f):
        def go(n):
            st, acc = f(holder["state"], keys[0])
            jax.block_until_ready((st, acc))
            holder["state"] = st

        return go

    tiny = jax.jit(lambda x: x + 1)
    x0 = jnp.float32(0)

    def tiny_loop(n):
        x = x0
        for _ in range(n):
            x = tiny(x)
        jax.block_until_ready(x)

    args = (state, batch, keys[0])

    def flatten(n):
        for _ in range(n):
            jax.tree_util.tree_flatten(args)

    timed = {name: loop(f, raw_keys=name.endswith("raw key")) for name, f in per_call.items()}
    timed["floor, 1 leaf in / 1 out"] = tiny_loop
    timed["flatten args (Python)"] = flatten
    for name, f in scans.items():
        timed[name] = scan_loop(f)
    for f in timed.values():  # compile + warm
        f(5)
    res = {name: ([], []) for name in timed}
    for _ in range(rounds):
        for name, f in timed.items():
            n = SCAN if name.startswith("in scan") else calls
            w, c = _time(f, n) if not name.startswith("in scan") else _time(f, 1)
            if name.startswith("in scan"):
                w, c = w / SCAN, c / SCAN
            res[name][0].append(w)
            res[name][1].append(c)
    leaves = len(jax.tree_util.tree_leaves(args))
    return res, leaves


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--kinds", nargs="+", default=["W1", "W2"], choices=["W1", "W2"])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write every round as JSON here")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    report: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "capacity": args.capacity,
        "batch": BATCH,
        "rounds": args.rounds,
        "calls": args.calls,
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "unit": "us per call (wall and process CPU time), every round",
        "kinds": {},
    }
    print(
        f"capacity {args.capacity:,}, batch {BATCH}, {args.rounds} rounds x {args.calls} calls; "
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    for kind in args.kinds:
        res, leaves = measure(kind, args.capacity, args.rounds, args.calls)
        print(
            f"\n{kind} ({leaves} argument leaves)\n\n| variant | us per call, wall (min-max) "
            "| us per call, CPU |\n|---|---:|---:|"
        )
        for name, (w, c) in res.items():
            print(
                f"| {name} | {statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f}) | "
                f"{statistics.median(c):.1f} |"
            )
        report["kinds"][kind] = {
            "argument_leaves": leaves,
            "variants": {name: {"wall_us": w, "cpu_us": c} for name, (w, c) in res.items()},
        }
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.out is not None:
        report["loadavg_before"], report["loadavg_after"] = load_before, os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
