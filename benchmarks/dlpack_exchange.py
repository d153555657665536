"""Conversion time torch <-> JAX: DLPack (zero-copy) against copies through NumPy.

Peers, interleaved A B C D per round, medians over rounds:
  torch_to_jax (DLPack)     functional_rb.adapters.dlpack.torch_to_jax(t)
  jnp.asarray(t.numpy())    what code does without DLPack: one host copy into a JAX buffer
  numpy copy                t.numpy().copy(): the cost of touching every byte once
  jax_to_torch (DLPack)     functional_rb.adapters.dlpack.jax_to_torch(a)
  torch.from_numpy(np.asarray(a).copy())  the copy route back

Usage: python benchmarks/dlpack_exchange.py [--quick] [--mib 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from functional_rb.adapters.dlpack import jax_to_torch, torch_to_jax


def _time(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    if isinstance(out, jax.Array):
        out.block_until_ready()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="64 MiB, 5 rounds")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    mib, rounds = (64, 5) if args.quick else (args.mib, args.rounds)
    n = mib * 2**20 // 4
    t = torch.arange(n, dtype=torch.float32)
    a = jnp.arange(n, dtype=jnp.float32)
    a.block_until_ready()
    peers = {
        "torch_to_jax (DLPack)": lambda: torch_to_jax(t),
        "jnp.asarray(t.numpy())": lambda: jnp.asarray(t.numpy()),
        "numpy copy": lambda: t.numpy().copy(),
        "jax_to_torch (DLPack)": lambda: jax_to_torch(a),
        "from_numpy(asarray(a).copy())": lambda: torch.from_numpy(np.asarray(a).copy()),
    }
    assert torch_to_jax(t).unsafe_buffer_pointer() == t.data_ptr()
    assert jax_to_torch(a).data_ptr() == a.unsafe_buffer_pointer()
    times = {k: [] for k in peers}
    for fn in peers.values():  # warm-up
        fn()
    for _ in range(rounds):
        for k, fn in peers.items():
            times[k].append(_time(fn))
    base = statistics.median(times["numpy copy"])
    print(
        f"float32 tensor of {mib} MiB ({n:,} elements), {rounds} interleaved rounds, "
        f"jax {jax.__version__}, torch {torch.__version__}, device {jax.devices()[0]}"
    )
    print(f"| {'conversion':32s} | {'median':>11s} | {'vs numpy copy':>13s} |")
    print(f"|{'-' * 34}|{'-' * 13}|{'-' * 15}|")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k:32s} | {m * 1e3:8.3f} ms | {m / base:12.5f}x |")


if __name__ == "__main__":
    main()
