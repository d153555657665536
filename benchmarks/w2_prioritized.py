"""prioritized replay: capacities 100k and 1M items {obs f32[17], action f32[6], reward f32, done f32}, prefilled with random priorities; one step = add 256 + sample 256 + update the 256 sampled priorities.

Modes (higher is better, steps/s):
  (a) per call: a Python loop calling a jitted ``add`` (donate_argnums), a jitted ``sample`` and
      a jitted ``update`` (donated) each step (cpprb: ``add`` + ``sample`` + ``update_priorities``).
  (a') fused per call: a Python loop calling ONE jitted (donated) function per step that does
      add + sample + update, as a JAX user writes a training step; shown for what it tells
      about where per-call time goes (cpprb's row repeats its mode (a) loop: it has nothing
      to fuse). The project's per-call targets are judged on mode (a).
  (b) scan: 1000 steps fused in one ``lax.scan`` inside one jit; every sampled leaf (and the
      importance weights) is summed into the carry so XLA cannot drop the gather, and the new
      priorities are computed from the sampled data.
  The row "jax dispatch floor (no-op calls)" runs modes (a) and (a') with no-op jitted functions
  of functional_rb's signatures and state: what the calls cost in JAX's dispatch alone.
Backends run interleaved (A B C A B C ...), several repeats; the median is reported.
``flashbax`` is ``flashbax.make_prioritised_flat_buffer`` (its sample draws transition pairs).

Standalone: ``python benchmarks/w2_prioritized.py [--quick] [--cpu-time] [--drift]``;
``--drift`` instead checks that after 10^6 random batched updates at capacity 10^6 the sum
tree's total equals the float64 sum of its leaves (relative error printed).
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

if __name__ == "__main__" and str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(
        str(pathlib.Path(__file__).resolve().parents[1])
    )  # an installed functional_rb wins

# W2's items are W1's; its buffers and their timing are backends.py's, with priorities
from benchmarks.backends import (  # noqa: E402
    ALPHA,
    BATCH,
    BETA,
    SCAN_STEPS,
    Cpprb,
    Flashbax,
    FunctionalRB,
)
from benchmarks.w1_uniform import _np_batch  # noqa: E402

CAPACITIES = (100_000, 1_000_000)
REFERENCES = ("flashbax", "cpprb")


def _mode_a(cap):
    return f"(a) per call: jit add + sample + update, cap {cap:,}"


def _mode_b(cap):
    return f"(b) {SCAN_STEPS} steps in one lax.scan, cap {cap:,}"


def _mode_f(cap):
    return f"(a') per call: one jitted step (add + sample + update), cap {cap:,}"


class DispatchFloor(FunctionalRB):
    """No-op ``add`` / ``sample`` / ``update`` with functional_rb's signatures and state (donated
    in and out, the same outputs: a batch of data, indices, weights): what three jitted calls
    per step cost in JAX's dispatch alone, a floor for any JAX buffer in mode (a)."""

    name = "jax dispatch floor (no-op calls)"
    scans = False

    def add_fn(self, state, batch):
        del batch
        return state

    def sample_fn(self, state, key):
        u = jax.random.uniform(key)  # outputs that depend on the call, as a sample's do
        data = jax.tree_util.tree_map(lambda x: jnp.zeros_like(x) + u, self.batch)
        return data, jnp.zeros((BATCH,), jnp.int32), jnp.zeros((BATCH,), jnp.float32) + u, state

    def update_fn(self, state, idx, prios):
        del idx, prios
        return state


def _torchrl_status():
    """TorchRL's PrioritizedReplayBuffer needs its compiled extension; say why it is skipped."""
    try:
        import torch
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

        rb = PrioritizedReplayBuffer(
            alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(16), batch_size=4
        )
        rb.extend(torch.zeros(8, 3))
        rb.sample()
        return None
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _try(cls, *args):
    try:
        return cls(*args)
    except ImportError as e:  # a peer that is not installed is skipped, not fatal
        print(f"[w2] skipping {cls.name}: {e}", flush=True)
        return None


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    batch = _np_batch(rng, BATCH)
    rows = []
    note = _torchrl_status()
    if note is not None:  # no row: a 0 would read as a measurement
        print(f"torchrl PrioritizedReplayBuffer: {note}", flush=True)
    reps = 3 if quick else 5
    n_calls = 30 if quick else 100
    for cap in CAPACITIES:
        prefill = _np_batch(rng, cap)
        prios = rng.exponential(1.0, cap).astype(np.float32)
        backends = [
            b
            for b in (
                _try(cls, cap, prefill, batch, prios)
                for cls in (FunctionalRB, Flashbax, Cpprb, DispatchFloor)
            )
            if b is not None
        ]
        del prefill
        keys = list(jax.random.split(jax.random.key(1), n_calls))
        scanning = [b for b in backends if getattr(b, "scans", False)]
        for b in backends:  # warm-up: compile, first touches
            b.per_call(keys[:3])
            b.fused(keys[:3])
            if b in scanning:
                b.scan(jax.random.key(2))
        res_a = {b.name: [] for b in backends}
        res_b = {b.name: [] for b in scanning}
        res_f = {b.name: [] for b in backends}
        for r in range(reps):  # interleaved A B C A B C ...
            for b in backends:
                res_a[b.name].append(b.per_call(keys))
            for b in scanning:
                res_b[b.name].append(b.scan(jax.random.key(10 + r)))
            for b in backends:
                res_f[b.name].append(b.fused(keys))
        for mode, res in ((_mode_a(cap), res_a), (_mode_f(cap), res_f), (_mode_b(cap), res_b)):
            for name, v in res.items():
                rows.append(
                    {
                        "mode": mode,
                        "backend": name,
                        "value": statistics.median(v),
                        "unit": "steps/s",
                    }
                )
        del backends
        print(f"capacity {cap:,} done", file=sys.stderr, flush=True)
    return rows


def drift_check(capacity=1_000_000, updates=1_000_000, n=64, chunk=50_000):
    """``updates`` random batched ``sum_tree.set`` calls (``n`` indices each, values spanning
    six orders of magnitude) at ``capacity``; returns the relative error of the total."""
    from functional_rb.samplers import sum_tree as st

    @jax.jit
    def run_chunk(tree, key):
        def body(tree, key):
            k1, k2, k3 = jax.random.split(key, 3)
            idx = jax.random.randint(k1, (n,), 0, capacity)
            scale = 10.0 ** jax.random.randint(k3, (n,), -3, 3).astype(jnp.float32)
            return st.set(tree, idx, jax.random.uniform(k2, (n,)) * scale), None

        return jax.lax.scan(body, tree, jax.random.split(key, chunk))[0]

    run_chunk = jax.jit(run_chunk, donate_argnums=0)
    tree = st.init(capacity)
    t = time.perf_counter()
    for i in range(updates // chunk):
        tree = run_chunk(tree, jax.random.key(i))
    leaves = np.asarray(tree.leaves).astype(np.float64)
    exact = leaves.sum()
    got = float(st.total(tree))
    pos = leaves[leaves > 0]
    print(
        f"drift check: {updates:,} batched updates of {n} at capacity {capacity:,} "
        f"({time.perf_counter() - t:.0f} s): total {got:.9g}, float64 sum of leaves "
        f"{exact:.9g}, relative error {abs(got - exact) / exact:.2e}; min exact: "
        f"{float(st.min(tree)) == pos.min()}"
    )
    return abs(got - exact) / exact


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--drift", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu_time:
        os.environ["FRB_BENCH_CLOCK"] = "cpu"
    if args.drift:
        err = drift_check()
        return 0 if err < 1e-6 else 1
    rows = run(quick=args.quick)
    print(_table(rows))
    return 0


def _table(rows):
    try:
        from benchmarks.run import table

        return table(rows, REFERENCES)
    except ImportError:  # the shared runner is not there: same format, inline
        refs = [r for r in REFERENCES if any(x["backend"] == r for x in rows)]
        out = [
            "| mode | backend | value | unit | " + " | ".join(f"x {r}" for r in refs) + " |",
            "|" + "---|" * (4 + len(refs)),
        ]
        for row in rows:
            cells = [row["mode"], row["backend"], f"{row['value']:,.0f}", row["unit"]]
            for r in refs:
                ref = [x["value"] for x in rows if x["mode"] == row["mode"] and x["backend"] == r]
                cells.append(f"{row['value'] / ref[0]:.2f}" if ref and ref[0] > 0 else "")
            out.append("| " + " | ".join(cells) + " |")
        return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
