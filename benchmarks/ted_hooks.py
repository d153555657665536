"""TED2Flat / Flat2TED hook time: functional_rb.adapters.ted_hooks against TorchRL's hooks.

Peers, interleaved A B A B per round, medians over rounds, on the same in-memory full ring
(wrapped: shift in the middle; episodes of ~200 steps; ndim 1 and ndim 2 with 8 envs):
  TED2Flat  ours / torchrl     hook(storage) -> flat TensorDict
  Flat2TED  ours / torchrl     hook(flat) -> TED storage (ndim 1 only: TorchRL's output for a
                               full ndim=2 dump is not the storage, so it is not timed)

Usage: python benchmarks/ted_hooks.py [--quick] [--steps 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchrl
import torchrl.data as trl
from tensordict import TensorDict

from functional_rb.adapters import ted_hooks


def _storage(steps: int, envs: int, obs_dim: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    shape = [steps] if envs == 0 else [steps, envs]
    done = torch.rand(*shape, 1, generator=g) < 1 / 200
    obs = torch.randn(*shape, obs_dim, generator=g)
    nxt = torch.roll(obs, -1, 0)
    zeros = torch.zeros(*shape, 1, dtype=torch.bool)
    return TensorDict(
        {
            "observation": obs,
            "action": torch.randint(0, 6, shape, generator=g),
            "done": zeros,
            "terminated": zeros.clone(),
            "truncated": zeros.clone(),
            "next": {
                "observation": nxt,
                "reward": torch.randn(*shape, 1, generator=g),
                "done": done,
                "terminated": done.clone(),
                "truncated": zeros.clone(),
            },
        },
        batch_size=shape,
    )


def _save(hook, storage, shift):
    hook.shift, hook.is_full = shift, True
    return hook(storage)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="20k steps, 3 rounds")
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--obs-dim", type=int, default=64)
    args = p.parse_args()
    steps, rounds = (20_000, 3) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(1)
    rows = []
    for envs in (0, 8):
        storage = _storage(steps // max(envs, 1), envs, args.obs_dim)
        shift = storage.shape[0] // 3
        flat = _save(ted_hooks.TED2Flat(), storage, shift)
        peers = {
            ("TED2Flat", "ours"): lambda s=storage, n=shift: _save(ted_hooks.TED2Flat(), s, n),
            ("TED2Flat", "torchrl"): lambda s=storage, n=shift: _save(trl.TED2Flat(), s, n),
        }
        if envs == 0:
            peers[("Flat2TED", "ours")] = lambda flat=flat: ted_hooks.Flat2TED()(flat)
            peers[("Flat2TED", "torchrl")] = lambda flat=flat: trl.Flat2TED()(flat)
        times = {k: [] for k in peers}
        for fn in peers.values():  # warm-up
            fn()
        for _ in range(rounds):
            for k, fn in peers.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        for (hook, who), v in times.items():
            ref = statistics.median(times[(hook, "torchrl")])
            rows.append((hook, f"ndim={1 if envs == 0 else 2}", who, statistics.median(v), ref))
    print(
        f"{steps:,} steps (obs {args.obs_dim} float32), full ring, {rounds} interleaved "
        f"rounds, 1 torch thread, torch {torch.__version__}, torchrl {torchrl.__version__}"
    )
    print(f"| {'hook':8s} | {'storage':7s} | {'impl':7s} | {'median':>10s} | {'vs torchrl':>10s} |")
    print(f"|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 12}|{'-' * 12}|")
    for hook, nd, who, m, ref in rows:
        print(f"| {hook:8s} | {nd:7s} | {who:7s} | {m * 1e3:7.1f} ms | {m / ref:9.2f}x |")


if __name__ == "__main__":
    main()
