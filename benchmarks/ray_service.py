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

Two more measurements:
  ``--wire``: the distributed transport's channel before and after its secure headers (the
  pickled headers of commit ``BEFORE`` against the authenticated frames), interleaved.
  ``--restart``: the seconds from SIGKILL of a checkpointed service's actor holding
  ``--restart-items`` items (default 10^6) to its first answer holding them again.

Usage: python benchmarks/ray_service.py [--quick] [--rounds 5] [--writers 4] [--items 4096]
       python benchmarks/ray_service.py --wire [--rounds 7]
       python benchmarks/ray_service.py --restart [--restart-items 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from tensordict import TensorDict

PEERS = (
    "functional_rb RayReplayBuffer",
    "torchrl RayReplayBuffer",
    "functional_rb RayBufferService",
)


def _torch_items(w, start, n, obs_dim):
    return TensorDict(
        {
            "obs": torch.randn(n, obs_dim),
            "reward": torch.randn(n),
            "w": torch.full((n,), w),
            "seq": torch.arange(start, start + n),
        },
        batch_size=[n],
    )


def _numpy_items(w, start, n, obs_dim):
    return {
        "obs": np.random.randn(n, obs_dim).astype(np.float32),
        "reward": np.random.randn(n).astype(np.float32),
        "w": np.full(n, w, np.int64),
        "seq": np.arange(start, start + n, dtype=np.int64),
    }


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
    return RayReplayBuffer(
        storage=LazyTensorStorage(capacity), batch_size=batch, remote_config={"num_cpus": 0}
    )


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
    ok = _stored_pairs(rb, core, total) == [
        (w, s) for w in range(args.writers) for s in range(args.items)
    ]
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
    p.add_argument("--wire", action="store_true", help="secure headers: before vs after")
    p.add_argument("--restart", action="store_true", help="restart time of a killed service")
    p.add_argument("--restart-items", type=int, default=1_000_000)
    args = p.parse_args()
    if args.wire or args.restart:
        return wire(args) if args.wire else restart(args)
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
    print(
        f"{args.writers} writers x {args.items} items (chunks of {args.chunk}, obs "
        f"f32[{args.obs_dim}]), learner batch {args.batch}, {args.rounds} rounds, ray "
        f"num_cpus={args.num_cpus}, {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory() as tmp:
        buffers, writers = {}, {}
        for name in peers:
            rb = buffers[name] = _build(name, capacity, args.batch, args.obs_dim)
            core = name.endswith("Service")
            if core:
                args.empty_ckpt = os.path.join(tmp, "empty")
                rb.add({k: v for k, v in _numpy_items(0, 0, 1, args.obs_dim).items()})
                rb.save(args.empty_ckpt)  # (a state holding one item; every round reloads it)
            writers[name] = [
                ray.remote(num_cpus=0)(Writer).remote(rb.client(), core, w, args.obs_dim)
                for w in range(args.writers)
            ]
            ray.get([w.run.remote(args.chunk, args.chunk) for w in writers[name]])  # warm-up
            rb.sample()  # (compiles the core's sample)
        results = {name: [] for name in peers}
        for r in range(args.rounds):
            order = peers[r % len(peers) :] + peers[: r % len(peers)]
            for name in order:
                results[name].append(_round(ray, name, buffers[name], writers[name], args))
        for rb in buffers.values():
            rb.close()
    ray.shutdown()
    print(
        f"{'peer':34s} {'inserted items/s: median [min, max]':40s} "
        f"{'sampled items/s: median [min, max]':38s} exactly once"
    )
    for name, rows in results.items():
        ins, smp = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"{name:34s} {statistics.median(ins):10.0f} [{min(ins):8.0f}, {max(ins):8.0f}]"
            f"{'':12s} {statistics.median(smp):10.0f} [{min(smp):8.0f}, {max(smp):8.0f}]"
            f"{'':10s} {all(r[2] for r in rows)}"
        )
    print(f"load average after: {os.getloadavg()}")


# ---------------------------------------------------------------------- --wire
BEFORE = "83dce3ec38f39302d9ace49781d6710de1dce395"  # the last commit with pickled headers


def _old_channel():
    """The distributed channel module of commit BEFORE (pickled headers), loaded beside
    today's: ``git show`` of its source, run as a module of its own."""
    import subprocess
    import types

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:adapters/comm/distributed.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("frb_bench_old_distributed")
    exec(compile(source, "old_distributed.py", "exec"), module.__dict__)
    return module


class _Handler:
    """A channel's handler over an adapters buffer: extend and sample."""

    def __init__(self, capacity, batch, obs_dim):
        from functional_rb.adapters import LazyTensorStorage, ReplayBuffer
        from functional_rb.adapters.comm.layout import flatten

        self.rb = ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=batch)
        self.rb.extend(_torch_items(0, 0, batch, obs_dim))
        self.layouts = {
            "extend": flatten(_torch_items(0, 0, 64, obs_dim), where="bench", strict=True)[1],
            "sample": flatten(None, where="bench", strict=True)[1],
        }

    def request_layout(self, op):
        return self.layouts[op]

    def handle(self, op, value):
        return self.rb.extend(value) if op == "extend" else self.rb.sample()


def _serve(kind, pipe, obs_dim, capacity, batch):
    """A server process: one channel server (old or new) over one buffer."""
    torch.set_num_threads(1)
    module = _old_channel() if kind == "before" else None
    if module is None:
        from functional_rb.adapters.comm import distributed as module
    server = module.ChannelServer(
        _Handler(capacity, batch, obs_dim),
        host="127.0.0.1",
        backend="gloo",
        timeout=60.0,
        name=kind,
    )
    pipe.send((server.address, server.accept()))
    pipe.recv()  # until the client is done
    server.close()


def _wire_round(client, tensors, calls):
    start = time.perf_counter()
    for _ in range(calls):
        client.call("extend", tensors, timeout=60.0)
    mid = time.perf_counter()
    for _ in range(calls):
        client.call("sample", [], timeout=60.0)
    end = time.perf_counter()
    return calls * 64 / (mid - start), calls / (end - mid)


def wire(args):
    """Round trips through the distributed channel, pickled headers (before) against the
    authenticated frames (after), each server in its own process, rounds interleaved."""
    import multiprocessing as mp

    from functional_rb.adapters.comm import distributed
    from functional_rb.adapters.comm.layout import flatten

    calls = 50 if args.quick else 500
    ctx = mp.get_context("spawn")
    tensors, _ = flatten(_torch_items(0, 0, 64, args.obs_dim), where="bench", strict=True)
    ends = {}
    print(f"load average before: {os.getloadavg()}")
    for kind, module in (("before", _old_channel()), ("after", distributed)):
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=_serve,
            args=(kind, there, args.obs_dim, (2 * args.rounds + 2) * calls * 64 + 1024, args.batch),
        )
        proc.start()
        address, grant = here.recv()
        client = module.ChannelClient(
            address,
            grant,
            host="127.0.0.1",
            backend="gloo",
            timeout=60.0,
            alive=lambda: True,
            name=kind,
        )
        _wire_round(client, tensors, 5)  # warm-up
        ends[kind] = (client, here, proc)
    rows = {kind: [] for kind in ends}
    for r in range(args.rounds):
        for kind in ("before", "after") if r % 2 == 0 else ("after", "before"):
            rows[kind].append(_wire_round(ends[kind][0], tensors, calls))
    for client, here, proc in ends.values():
        client.close()
        here.send("done")
        proc.join()
    print(
        f"channel round trips: extend of 64 items (obs f32[{args.obs_dim}]), sample of "
        f"{args.batch}; {args.rounds} rounds of {calls} calls each, interleaved"
    )
    for kind, got in rows.items():
        ins, smp = [g[0] for g in got], [g[1] * args.batch for g in got]
        print(
            f"{kind:8s} inserted items/s {statistics.median(ins):10.0f} [{min(ins):8.0f}, "
            f"{max(ins):8.0f}]   sampled items/s {statistics.median(smp):10.0f} "
            f"[{min(smp):8.0f}, {max(smp):8.0f}]"
        )
    print(f"load average after: {os.getloadavg()}")


# ---------------------------------------------------------------------- --restart
def _actor_pid(ray, actor):
    return ray.get(actor.__ray_call__.remote(lambda body: os.getpid()))


def _time_restart(ray, service, size_of, n):
    """Seconds from SIGKILL of the service's actor to its first answer holding ``n``."""
    import signal

    os.kill(_actor_pid(ray, service._service.handle), signal.SIGKILL)
    start = time.perf_counter()
    got = size_of()
    elapsed = time.perf_counter() - start
    assert got == n, f"the restarted service holds {got} items, not {n}"
    return elapsed


def restart(args):
    """A core RayBufferService and an adapters RayReplayBuffer, each holding
    ``--restart-items`` items in its newest checkpoint, killed ``--rounds`` times."""
    import tempfile

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    import functional_rb as frb
    from functional_rb.adapters import LazyTensorStorage, RayReplayBuffer
    from functional_rb.service import RayBufferService

    n, chunk = args.restart_items, min(args.restart_items, 10_000)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    remote = {"num_cpus": 0, "max_restarts": args.rounds}
    print(f"load average before: {os.getloadavg()}; {n} items of obs f32[{args.obs_dim}]")
    with tempfile.TemporaryDirectory() as tmp:
        core = RayBufferService(
            frb.ReplayBuffer(capacity=n, batch_size=args.batch),
            {k: v[0] for k, v in _numpy_items(0, 0, 1, args.obs_dim).items()},
            checkpoint_every={"items": n},
            checkpoint_path=os.path.join(tmp, "core"),
            remote_config=remote,
        )
        torch_rb = RayReplayBuffer(
            storage=LazyTensorStorage(n),
            batch_size=args.batch,
            checkpoint_every={"items": n},
            checkpoint_path=os.path.join(tmp, "adapters"),
            remote_config=remote,
        )
        for start in range(0, n, chunk):  # the last add writes the checkpoint
            core.add(_numpy_items(0, start, chunk, args.obs_dim))
            torch_rb.extend(_torch_items(0, start, chunk, args.obs_dim))
        times = {"RayBufferService": [], "RayReplayBuffer": []}
        for _ in range(args.rounds):
            times["RayBufferService"].append(_time_restart(ray, core, core.size, n))
            times["RayReplayBuffer"].append(_time_restart(ray, torch_rb, lambda: len(torch_rb), n))
        core.close()
        torch_rb.close()
    ray.shutdown()
    for name, got in times.items():
        print(
            f"{name:18s} restart to first answer: median {statistics.median(got):.2f} s "
            f"[{min(got):.2f}, {max(got):.2f}] over {len(got)} kills"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
