"""Items per second through a Ray-hosted buffer: N writer actors -> 1 learner.

Peers, each a buffer in its own Ray actor, built once and reused; per round each runs the
same job, in an order rotated from round to round (A B C, B C A, ...):
  functional_rb RayReplayBuffer   functional_rb.adapters.RayReplayBuffer(LazyTensorStorage)
  torchrl RayReplayBuffer         torchrl.data.RayReplayBuffer(LazyTensorStorage)
  functional_rb RayBufferService  functional_rb.service (the JAX core buffer, NumPy arrays)
The job: ``--writers`` Ray actors each ``extend`` ``--items`` items in chunks of ``--chunk``
(item: obs f32[--obs-dim], reward f32, writer id and sequence number i64) while the driver
samples batches of ``--batch`` as fast as it can; the clock runs from the start signal to the
last writer's return. Reported per peer: medians and [min, max] over rounds of inserted
items/s and sampled items/s, and that every item of the round was stored exactly once. The
load average is printed before and after (the machine is shared).

Usage: python benchmarks/ray_service.py [--quick] [--rounds 5] [--writers 4] [--items 4096]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from tensordict import TensorDict

PEERS = ("functional_rb RayReplayBuffer", "torchrl RayReplayBuffer",
         "functional_rb RayBufferService")


def _torch_items(w, start, n, obs_dim):
    return TensorDict({"obs": torch.randn(n, obs_dim), "reward": torch.randn(n),
                       "w": torch.full((n,), w), "seq": torch.arange(start, start + n)},
                      batch_size=[n])


def _numpy_items(w, start, n, obs_dim):
    return {"obs": np.random.randn(n, obs_dim).astype(np.float32),
            "reward": np.random.randn(n).astype(np.float32),
            "w": np.full(n, w, np.int64), "seq": np.arange(start, start + n, dtype=np.int64)}


class Writer:
    """A Ray actor extending one buffer through its client."""

    def __init__(self, client, core: bool, w: int, obs_dim: int):
        self.client, self.core, self.w, self.obs_dim = client, core, w, obs_dim

    def run(self, n: int, chunk: int) -> int:
        make = _numpy_items if self.core else _torch_items
        for start in range(0, n, chunk):
            data = make(self.w, start, chunk, self.obs_dim)
            self.client.add(data) if self.core else self.client.extend(data)
        return n


def _build(name, capacity, batch, obs_dim):
    if name == "functional_rb RayBufferService":
        import jax.numpy as jnp  # noqa: F401  (the core, for the example's dtypes)
        import functional_rb as frb
        from functional_rb.service import RayBufferService
        rb = frb.ReplayBuffer(capacity=capacity, batch_size=batch)
        example = {k: v[0] for k, v in _numpy_items(0, 0, 1, obs_dim).items()}
        return RayBufferService(rb, example, remote_config={"num_cpus": 0})
    if name == "torchrl RayReplayBuffer":
        from torchrl.data import LazyTensorStorage, RayReplayBuffer
    else:
        from functional_rb.adapters import LazyTensorStorage, RayReplayBuffer
    return RayReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=batch,
                           remote_config={"num_cpus": 0})


def _stored_pairs(rb, core: bool, n: int):
    if core:
        got = rb.get(np.arange(n))
    else:
        got = rb[:n]
    return sorted(zip(np.asarray(got["w"]).tolist(), np.asarray(got["seq"]).tolist()))


def _round(ray, name, rb, writers, args) -> tuple[float, float, bool]:
    core = name.endswith("Service")
    total = args.writers * args.items
    if core:  # a fresh state: the service's load of an empty checkpoint would cost more
        rb.load(args.empty_ckpt)
    else:
        rb.empty()
    start = time.perf_counter()
    refs = [w.run.remote(args.items, args.chunk) for w in writers]
    sampled = 0
    while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
        if (rb.size() if core else len(rb)) >= args.batch:
            rb.sample()
            sampled += args.batch
    ray.get(refs)
    elapsed = time.perf_counter() - start
    ok = _stored_pairs(rb, core, total) == [(w, s) for w in range(args.writers)
                                            for s in range(args.items)]
    return total / elapsed, sampled / elapsed, ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="2 writers x 256 items, 2 rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--items", type=int, default=4096, help="items per writer per round")
    p.add_argument("--chunk", type=int, default=64, help="items per extend")
    p.add_argument("--batch", type=int, default=256, help="learner's sample size")
    p.add_argument("--obs-dim", type=int, default=64)
    p.add_argument("--num-cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    p.add_argument("--peers", default=",".join(PEERS))
    args = p.parse_args()
    if args.quick:
        args.writers, args.items, args.rounds = 2, 256, 2
    args.items -= args.items % args.chunk
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    import tempfile
    peers = [n for n in PEERS if n in args.peers.split(",")]
    capacity = args.writers * args.items
    print(f"load average before: {os.getloadavg()}")
    print(f"{args.writers} writers x {args.items} items (chunks of {args.chunk}, obs "
          f"f32[{args.obs_dim}]), learner batch {args.batch}, {args.rounds} rounds, ray "
          f"num_cpus={args.num_cpus}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        buffers, writers = {}, {}
        for name in peers:
            rb = buffers[name] = _build(name, capacity, args.batch, args.obs_dim)
            core = name.endswith("Service")
            if core:
                args.empty_ckpt = os.path.join(tmp, "empty")
                rb.add({k: v for k, v in _numpy_items(0, 0, 1, args.obs_dim).items()})
                rb.save(args.empty_ckpt)  # (a state holding one item; every round reloads it)
            writers[name] = [ray.remote(num_cpus=0)(Writer).remote(rb.client(), core, w,
                                                                   args.obs_dim)
                             for w in range(args.writers)]
            ray.get([w.run.remote(args.chunk, args.chunk) for w in writers[name]])  # warm-up
            rb.sample()  # (compiles the core's sample)
        results = {name: [] for name in peers}
        for r in range(args.rounds):
            order = peers[r % len(peers):] + peers[:r % len(peers)]
            for name in order:
                results[name].append(_round(ray, name, buffers[name], writers[name], args))
        for rb in buffers.values():
            rb.close()
    ray.shutdown()
    print(f"{'peer':34s} {'inserted items/s: median [min, max]':40s} "
          f"{'sampled items/s: median [min, max]':38s} exactly once")
    for name, rows in results.items():
        ins, smp = [r[0] for r in rows], [r[1] for r in rows]
        print(f"{name:34s} {statistics.median(ins):10.0f} [{min(ins):8.0f}, {max(ins):8.0f}]"
              f"{'':12s} {statistics.median(smp):10.0f} [{min(smp):8.0f}, {max(smp):8.0f}]"
              f"{'':10s} {all(r[2] for r in rows)}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
