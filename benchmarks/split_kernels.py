"""Split kernels: what XLA's CPU backend splitting small kernels across threads costs a call.

XLA's CPU compiler gives a kernel several tasks on its intra-op thread pool when its cost
model calls it big enough: an I/O-bound kernel once the bytes it touches reach 512 KiB (a
gather or scatter counts its whole operand, so every one on a large buffer qualifies), a
compute-bound one once ``flops + 10 * bytes`` reaches 200,000 (an ``[N, 16] @ [16, 16]``
product). Each split kernel hands work to another thread and waits for it; on a small machine
shared with the caller's thread and other processes, that hand-over costs far more than a
gather of a few rows. Two experiments:

* ``kernels``: a jitted, donated call that does ``K`` gather-then-scatter pairs of ``M`` rows
  on a float32 ``[10^7]`` array (every kernel split), timed in this process and, with
  ``--cpus 1``, in a child pinned to one CPU (XLA then splits nothing). The difference per
  kernel is the hand-over.
* ``reads``: a jitted call reading 256 rows with fresh indices from a float32 ``[size, 7]``
  array (W5's uniform item), as a plain gather (split) and through
  ``functional_rb._internal.jit.read_whole`` (whole), interleaved rounds, in this process
  and, with ``--cpus 1``, in a child pinned to one CPU.
* ``writes``: a jitted, donated call that writes 256 consecutive rows (a ring writer's add)
  into each of three arrays of ``size`` items, float32 ``[size, 7]``, int32 ``[size]`` and
  float32 ``[size]`` (a prioritized add's storage, generation stamps and tree leaves), by
  scatter (each split), timed in this process and, with ``--cpus 1``, in a child pinned to one
  CPU.
* ``count``: for each W5 buffer (``scale_backends``), functional_rb's and flashbax's, the
  kernels each jitted call runs and how many of them are split (from the compiled HLO), and
  the op name of each split kernel (``where``: one inside ``cond/branch_...`` runs only when
  that branch is taken).

Usage: ``python benchmarks/split_kernels.py [--only reads] [--size 1e8] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

N = 10_000_000


def kernels(rounds: int = 5, calls: int = 500) -> dict:
    """us per call of ``K`` gather/scatter pairs of ``M`` rows, median and range of rounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def make(k):
        def f(x, idx):
            for j in range(k):
                v = x[(idx * (j + 3)) % N]
                x = x.at[(idx * (j + 5)) % N].set(v + 1.0, unique_indices=True)
            return x

        return jax.jit(f, donate_argnums=0)

    x = jnp.zeros(N, jnp.float32)
    out = {}
    for k in (2, 8, 16):
        for m in (16, 256):
            idx = jnp.arange(m, dtype=jnp.int32) * 7919
            g = make(k)
            split = g.lower(x, idx).compile().as_text().count("outer_dimension_partitions")
            x = g(x, idx)
            times = []
            for _ in range(rounds):
                x.block_until_ready()
                t = time.perf_counter()
                for _ in range(calls):
                    x = g(x, idx)
                x.block_until_ready()
                times.append((time.perf_counter() - t) / calls * 1e6)
            out[f"K={k} M={m}"] = {
                "split": split,
                "us": float(np.median(times)),
                "range": [min(times), max(times)],
            }
    return out


def _ops(txt: str) -> tuple[int, int, list]:
    """(kernels in the entry computation, split kernels anywhere, the split kernels' op
    names) of a compiled HLO text."""
    entry = txt[txt.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    skip = (" parameter(", " bitcast(", "get-tuple-element", " tuple(")
    ops = [ln for ln in entry.splitlines()[1:] if " = " in ln and not any(s in ln for s in skip)]
    split = [ln for ln in txt.splitlines() if "outer_dimension_partitions" in ln]
    where = [m.group(1) if (m := re.search(r'op_name="([^"]*)"', ln)) else "?" for ln in split]
    return len(ops), len(split), where


def count(size: int) -> dict:
    import jax

    from benchmarks import scale_backends as sb

    out = {}
    for kind in ("uniform", "prioritized", "slices", "ted"):
        for backend in (sb.FunctionalRB, sb.Flashbax):
            b = backend(kind, size)
            st = b.state
            calls = {
                "add": b.add_call.lower(st, b.batch),
                "sample": jax.jit(b.sample_fn).lower(st, b.keys[0]),
            }
            if kind == "prioritized":
                data, idx, _ = jax.eval_shape(b.sample_fn, st, b.keys[0])
                calls["update"] = b.update_call.lower(st, idx, data)
            out[f"{kind} {backend.name}"] = {
                name: dict(zip(("kernels", "split", "where"), _ops(low.compile().as_text())))
                for name, low in calls.items()
            }
            out[f"{kind} {backend.name}"]["state arrays"] = len(jax.tree_util.tree_leaves(st))
            del b, st
    return out


def reads(size: int, rounds: int = 7, calls: int = 1000) -> dict:
    """us per call of a read of 256 fresh rows of float32 ``[size, 7]``: a plain gather and
    ``read_whole``'s, the two alternated each round; median and range of rounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from functional_rb._internal import hugepages
    from functional_rb._internal.jit import read_whole

    x = jax.jit(lambda a: a + 1.0, donate_argnums=0)(hugepages.zeros((size, 7), jnp.float32))
    rng = np.random.default_rng(0)
    sets = [jnp.asarray(rng.integers(0, size, 256, dtype=np.int32)) for _ in range(4000)]
    fns = {
        "plain": jax.jit(lambda a, i: a[i]),
        "read_whole": jax.jit(lambda a, i: read_whole(lambda: a[i], a, i)),
    }
    times: dict = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items() if r % 2 else reversed(fns.items()):
            fn(x, sets[0]).block_until_ready()
            t = time.perf_counter()
            for c in range(calls):
                out = fn(x, sets[(c * 7 + r) % len(sets)])
            out.block_until_ready()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return {
        name: {
            "split": fn.lower(x, sets[0]).compile().as_text().count("outer_dimension_partitions"),
            "us": float(np.median(times[name])),
            "range": [min(times[name]), max(times[name])],
        }
        for name, fn in fns.items()
    }


def writes(size: int, rounds: int = 5, calls: int = 1000) -> dict:
    """us per call of three ring writes of 256 consecutive rows (at fresh positions), median
    and range of rounds, and the split kernels of the call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from functional_rb._internal import hugepages

    def ring(x, p, new):
        pos = (p + jnp.arange(new.shape[0], dtype=jnp.int32)) % x.shape[0]
        return x.at[pos].set(new, unique_indices=True)

    f = jax.jit(lambda st, p, new: tuple(ring(x, p, v) for x, v in zip(st, new)), donate_argnums=0)
    shapes = (((size, 7), jnp.float32), ((size,), jnp.int32), ((size,), jnp.float32))
    st = tuple(hugepages.zeros(s, d) for s, d in shapes)
    new = tuple(jnp.ones((256, *s[1:]), d) for s, d in shapes)
    starts = [jnp.int32(v) for v in np.random.default_rng(0).integers(0, size, 64)]
    _, split, _ = _ops(f.lower(st, starts[0], new).compile().as_text())
    for c in range(300):
        st = f(st, starts[c % 64], new)
    times = []
    for _ in range(rounds):
        jax.block_until_ready(st)
        t = time.perf_counter()
        for c in range(calls):
            st = f(st, starts[c % 64], new)
        jax.block_until_ready(st)
        times.append((time.perf_counter() - t) / calls * 1e6)
    return {"split": split, "us": float(np.median(times)), "range": [min(times), max(times)]}


def _one_cpu(*argv: str):
    """The result of this script run again, pinned to one CPU, with ``argv``."""
    child = subprocess.run(
        [sys.executable, __file__, "--cpus", "1", *argv], capture_output=True, text=True, check=True
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1e8)
    ap.add_argument("--cpus", type=int, default=0, help="(internal) pin to this many CPUs")
    ap.add_argument("--only", choices=("kernels", "reads", "writes", "count"), default=None)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.cpus]))
        exp = {"reads": reads, "writes": writes}.get(args.only or "")
        print(json.dumps(exp(int(args.size)) if exp else kernels()))
        return
    result: dict = {"load": os.getloadavg()[0]}
    if args.only in (None, "kernels"):
        one = _one_cpu()
        result["kernels"] = {"all CPUs": kernels(), "one CPU": one}
        for key, v in result["kernels"]["all CPUs"].items():
            w = one[key]
            print(f"{key:>10}: split {v['split']:2d}, {v['us']:6.1f} us; one CPU {w['us']:6.1f} us")
    if args.only in (None, "reads"):
        one = _one_cpu("--only", "reads", "--size", str(args.size))
        result["reads"] = {"all CPUs": reads(int(args.size)), "one CPU": one}
        for cpus, cells in result["reads"].items():
            for name, v in cells.items():
                lo, hi = v["range"]
                print(
                    f"read 256 rows, {cpus:>8}, {name:>10}: split {v['split']}, "
                    f"{v['us']:6.1f} us ({lo:.1f}-{hi:.1f})"
                )
    if args.only in (None, "writes"):
        one = _one_cpu("--only", "writes", "--size", str(args.size))
        result["writes"] = {"all CPUs": writes(int(args.size)), "one CPU": one}
        for cpus, v in result["writes"].items():
            lo, hi = v["range"]
            print(
                f"3 ring writes of 256 rows, {cpus:>8}: split {v['split']}, "
                f"{v['us']:6.1f} us ({lo:.1f}-{hi:.1f})"
            )
    if args.only in (None, "count"):
        result["count"] = count(int(args.size))
        for key, v in result["count"].items():
            cells = ", ".join(
                f"{k} {c['kernels']}/{c['split']}" for k, c in v.items() if isinstance(c, dict)
            )
            print(f"{key:>28}: {cells} (kernels/split); {v['state arrays']} state arrays")
    result["load_after"] = os.getloadavg()[0]
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
