"""Items per second through a buffer service: N writer processes -> 1 learner.

Peers, each built once and reused; per round each runs the same job, in an order rotated
from round to round (A B C D, B C D A, ...):
  functional_rb RayReplayBuffer   functional_rb.adapters.RayReplayBuffer(LazyTensorStorage)
  torchrl RayReplayBuffer         torchrl.data.RayReplayBuffer(LazyTensorStorage)
  functional_rb RayBufferService  functional_rb.service (the JAX core buffer, NumPy arrays)
  dm-reverb Server                DeepMind Reverb's C++ gRPC server, only with
                                  ``--reverb-python PATH`` (the python of a venv holding
                                  dm-reverb 0.14.0: benchmarks/_reverb_peer.py, run there as
                                  a subprocess, in a network namespace holding only loopback)
The job, per round and peer, each phase on its own clock:
  insert  ``--writers`` writers (Ray actors; Reverb: processes) each insert ``--items``
          items (item: obs f32[--obs-dim] or ``--obs-shape 84,84`` uint8 frames, reward
          f32, writer id and sequence number i64): the Ray peers ``extend`` chunks of
          ``--chunk``, Reverb's ``trajectory_writer`` one item per step. The clock runs from
          the start signal to the last writer's return.
  sample  ``--sample-batches`` batches of ``--batch`` from the filled buffer: ``rb.sample()``
          on the Ray peers, and ``rb.samples(in_flight=--service-in-flight,
          per_call=--service-per-call)`` (batches in flight, fetched a few per remote call) on
          ``RayBufferService``; ``TrajectoryDataset`` (samples in flight) and plain
          ``client.sample`` on Reverb.
  both    the buffer emptied, the writers insert again while the driver samples as fast as
          it can (once the buffer holds a batch) until the last writer returns; with
          ``--both-rate R``, at most R items a second on every peer, so that each peer's
          writers insert beside the same sampling.
After ``insert`` and after ``both`` every stored item is read back: each must be there
exactly once. Reported per peer: medians and [min, max] over rounds of items/s. The load
average is recorded before every round (the machine is shared); ``--out`` writes it all as
JSON.

One more measurement:
  ``--restart``: the seconds from SIGKILL of a checkpointed service's actor holding
  ``--restart-items`` items (default 10^6) to its first answer holding them again.

Usage: python benchmarks/ray_service.py [--quick] [--rounds 5] [--writers 4] [--items 4096]
           [--obs-shape 84,84] [--reverb-python .venv-reverb/bin/python] [--out FILE]
       python benchmarks/ray_service.py --restart [--restart-items 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from tensordict import TensorDict

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/ray_service.py` from the checkout
    sys.path.append(str(_HERE.parent))

from benchmarks._reverb_peer import (  # noqa: E402
    exactly_once,
    finish_job_args,
    job_argv,
    job_parser,
    numpy_items,
    pace,
)
from benchmarks._stats import summary  # noqa: E402

PEERS = (
    "functional_rb RayReplayBuffer",
    "torchrl RayReplayBuffer",
    "functional_rb RayBufferService",
)
REVERB = "dm-reverb Server"


def _torch_obs(n, shape, dtype):
    if dtype == "uint8":
        return torch.randint(0, 256, (n, *shape), dtype=torch.uint8)
    return torch.randn(n, *shape)


def _torch_items(w, start, n, obs_shape, obs_dtype="float32"):
    return TensorDict(
        {
            "obs": _torch_obs(n, obs_shape, obs_dtype),
            "reward": torch.randn(n),
            "w": torch.full((n,), w),
            "seq": torch.arange(start, start + n),
        },
        batch_size=[n],
    )


def _numpy_items(w, start, n, obs_shape, obs_dtype="float32"):
    return numpy_items(np, w, start, n, obs_shape, obs_dtype)


class Writer:
    """A Ray actor extending one buffer through its client."""

    def __init__(self, client, core: bool, w: int, obs_shape, obs_dtype: str):
        self.client, self.core, self.w = client, core, w
        self.obs_shape, self.obs_dtype = obs_shape, obs_dtype

    def run(self, n: int, chunk: int) -> int:
        make = _numpy_items if self.core else _torch_items
        for start in range(0, n, chunk):
            data = make(self.w, start, chunk, self.obs_shape, self.obs_dtype)
            self.client.add(data) if self.core else self.client.extend(data)
        return n


def _build(name, capacity, batch, obs_shape, obs_dtype):
    if name == "functional_rb RayBufferService":
        import jax.numpy as jnp  # noqa: F401  (the core, for the example's dtypes)

        import functional_rb as frb
        from functional_rb.service import RayBufferService

        rb = frb.ReplayBuffer(capacity=capacity, batch_size=batch)
        example = {k: v[0] for k, v in _numpy_items(0, 0, 1, obs_shape, obs_dtype).items()}
        return RayBufferService(rb, example, remote_config={"num_cpus": 0})
    if name == "torchrl RayReplayBuffer":
        from torchrl.data import LazyTensorStorage, RayReplayBuffer
    else:
        from functional_rb.adapters import LazyTensorStorage, RayReplayBuffer
    return RayReplayBuffer(
        storage=LazyTensorStorage(capacity), batch_size=batch, remote_config={"num_cpus": 0}
    )


def _stored_pairs(rb, core: bool, n: int):
    got = rb.get(np.arange(n)) if core else rb[:n]
    return list(zip(np.asarray(got["w"]).tolist(), np.asarray(got["seq"]).tolist()))


def _empty(rb, core: bool, args) -> None:
    if core:  # a fresh state: the service's load of an empty checkpoint would cost more
        rb.load(args.empty_ckpt)
    else:
        rb.empty()


def _samples_path(args) -> str:
    return f"rb.samples(in_flight={args.service_in_flight}, per_call={args.service_per_call})"


def _round(ray, name, rb, writers, args) -> dict:
    """One round of the three phases on a Ray peer: the row ``summarize`` takes."""
    core = name.endswith("Service")
    total = args.writers * args.items
    _empty(rb, core, args)
    start = time.perf_counter()
    ray.get([w.run.remote(args.items, args.chunk) for w in writers])
    inserted = total / (time.perf_counter() - start)
    check_insert = exactly_once(_stored_pairs(rb, core, total), args.writers, args.items)

    start = time.perf_counter()
    for _ in range(args.sample_batches):
        rb.sample()
    sampled = {"rb.sample()": args.sample_batches * args.batch / (time.perf_counter() - start)}
    if core:  # the service's samples in flight (BufferClient.samples)
        path = _samples_path(args)
        batches = rb.samples(in_flight=args.service_in_flight, per_call=args.service_per_call)
        start = time.perf_counter()
        for _ in range(args.sample_batches):
            next(batches)
        sampled[path] = args.sample_batches * args.batch / (time.perf_counter() - start)
        batches.close()

    _empty(rb, core, args)
    start = time.perf_counter()
    refs = [w.run.remote(args.items, args.chunk) for w in writers]
    both_sampled, ready, batches = 0, False, None
    while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
        ready = ready or (rb.size() if core else len(rb)) >= args.batch  # (nothing leaves)
        wait = pace(start, both_sampled, args.both_rate) if ready else 0.0
        if wait > 0:
            time.sleep(min(wait, 0.002))  # (short: the writers' end is polled above)
        elif ready and core:  # the service's batches in flight, as Reverb's dataset's
            batches = batches or rb.samples(
                in_flight=args.service_in_flight, per_call=args.service_per_call
            )
            next(batches)
            both_sampled += args.batch
        elif ready:
            rb.sample()
            both_sampled += args.batch
    ray.get(refs)
    elapsed = time.perf_counter() - start
    if batches is not None:
        batches.close()
    check_both = exactly_once(_stored_pairs(rb, core, total), args.writers, args.items)
    return {
        "inserted": inserted,
        "sampled": sampled,
        "both_inserted": total / elapsed,
        "both_sampled": both_sampled / elapsed,
        "both_path": _samples_path(args) if core else "rb.sample()",
        "exactly_once": check_insert["ok"] and check_both["ok"],
        "checks": {"insert": check_insert, "both": check_both},
    }


def summarize(rows: list[dict]) -> dict:
    """One peer's rounds (``_round``'s or the Reverb peer's rows) -> medians and ranges of
    each quantity, every sample path's on its own, and whether every round stored every item
    exactly once.

    >>> row = {"inserted": 2.0, "sampled": {"p": 4.0}, "both_inserted": 1.0,
    ...        "both_sampled": 3.0, "both_path": "p", "exactly_once": True}
    >>> summarize([row, row | {"inserted": 4.0}])["inserted"]["median"]
    3.0
    """
    if not rows:
        raise ValueError("summarize: no rounds to summarize (expected one row per round)")
    paths = list(rows[0]["sampled"])
    for i, row in enumerate(rows):
        if list(row["sampled"]) != paths:
            raise ValueError(
                f"summarize: round {i} sampled through {list(row['sampled'])}, round 0 "
                f"through {paths}; every round of a peer must measure the same paths"
            )
    return {
        "inserted": summary([r["inserted"] for r in rows]),
        "sampled": {p: summary([r["sampled"][p] for r in rows]) for p in paths},
        "both_inserted": summary([r["both_inserted"] for r in rows]),
        "both_sampled": summary([r["both_sampled"] for r in rows]),
        "both_path": rows[0]["both_path"],
        "exactly_once": all(r["exactly_once"] for r in rows),
        "rounds": rows,
    }


def reverb_command(python: str, argv: list[str], isolate: bool = True) -> list[str]:
    """The command line of the Reverb peer: ``python _reverb_peer.py argv``, inside a network
    namespace of its own holding only the loopback device (``unshare --net``, as root) unless
    ``isolate`` is false: Reverb's server listens on every address of its namespace."""
    inner = [python, str(_HERE / "_reverb_peer.py"), *argv]
    if not isolate:
        return inner
    return ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner]


class ReverbPeer:
    """The driver's end of benchmarks/_reverb_peer.py: one subprocess, one round a call."""

    def __init__(self, args, log_path: str):
        if not args.reverb_any_address and (os.geteuid() != 0 or not shutil.which("unshare")):
            raise SystemExit(
                "ray_service.py: the Reverb peer runs in a network namespace of its own "
                "(`unshare --net`, which needs root) because Reverb's server listens on every "
                "address; this shell is not root or has no unshare. Run as root, or pass "
                "--reverb-any-address to let the server listen on all of this machine's "
                "addresses (its clients still dial 127.0.0.1)."
            )
        self.command = reverb_command(
            args.reverb_python, job_argv(args), isolate=not args.reverb_any_address
        )
        self.log_path = log_path
        with open(log_path, "w") as log:  # (the subprocess keeps its own copy)
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self.ready = self._read("ready")

    def _read(self, event: str) -> dict:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == event:
                return msg
        code = self.proc.wait()
        tail = pathlib.Path(self.log_path).read_text()[-3000:]
        raise RuntimeError(
            f"the Reverb peer ended (exit {code}) before its {event!r} line; command: "
            f"{' '.join(self.command)}; the end of its stderr:\n{tail}"
        )

    def round(self) -> dict:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read("round")["row"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = job_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--quick", action="store_true", help="2 writers x 256 items, 2 rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    p.add_argument("--peers", default=",".join((*PEERS, REVERB)))
    p.add_argument(
        "--reverb-python",
        default=None,
        help="python of a venv with dm-reverb: adds Reverb as a peer (benchmarks/_reverb_peer.py)",
    )
    p.add_argument(
        "--reverb-any-address",
        action="store_true",
        help="run the Reverb peer without a network namespace of its own (no root needed)",
    )
    p.add_argument(
        "--service-in-flight",
        type=int,
        default=8,
        help="batches in flight of RayBufferService's samples() (a second sample path)",
    )
    p.add_argument(
        "--service-per-call",
        type=int,
        default=4,
        help="batches each remote call of RayBufferService's samples() draws (per_call=)",
    )
    p.add_argument("--out", default=None, help="write every round as JSON here")
    p.add_argument("--restart", action="store_true", help="restart time of a killed service")
    p.add_argument("--restart-items", type=int, default=1_000_000)
    args = p.parse_args(argv)
    if args.quick:
        args.writers, args.items, args.rounds = 2, 256, 2
        args.sample_batches = min(args.sample_batches, 16)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = set(args.peers.split(",")) - {*PEERS, REVERB}
    if unknown:
        p.error(f"--peers: unknown {sorted(unknown)}; known: {', '.join((*PEERS, REVERB))}")
    args = finish_job_args(p, args)
    args.peer_names = [n for n in PEERS if n in args.peers.split(",")]
    if args.reverb_python and REVERB in args.peers.split(","):
        args.peer_names.append(REVERB)
    return args


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for name in ("ray", "torchrl", "torch", "jax", "numpy"):
        try:
            got[name] = version(name)
        except PackageNotFoundError:
            got[name] = None
    return got


def _obs_text(args) -> str:
    dtype = {"float32": "f32", "uint8": "u8"}[args.obs_dtype]
    return f"{dtype}[{','.join(map(str, args.obs_shape))}]"


def _fmt(s: dict) -> str:
    return f"{s['median']:10.0f} [{s['min']:8.0f}, {s['max']:8.0f}]"


def print_table(results: dict) -> None:
    print(
        f"\n{'peer':31s} {'inserted alone':31s} {'sampled alone (path)':52s} "
        f"{'both: inserted':31s} {'both: sampled':31s} exactly once"
    )
    for name, got in results.items():
        for i, (path, s) in enumerate(got["sampled"].items()):
            first = i == 0
            print(
                f"{name if first else '':31s} {_fmt(got['inserted']) if first else '':31s} "
                f"{_fmt(s)} ({path}){'':{max(0, 20 - len(path))}s} "
                f"{_fmt(got['both_inserted']) if first else '':31s} "
                f"{_fmt(got['both_sampled']) if first else '':31s} "
                f"{got['exactly_once'] if first else ''}"
            )


def main(argv=None):
    args = parse_args(argv)
    if args.restart:
        return restart(args)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    gcs = ray.get_runtime_context().gcs_address
    assert gcs.startswith("127.0.0.1:"), f"Ray listens on {gcs}, not on loopback"

    peers = args.peer_names
    capacity = args.writers * args.items
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    print(f"load average before: {load_before}")
    print(
        f"{args.writers} writers x {args.items} items (chunks of {args.chunk}, obs "
        f"{_obs_text(args)}), learner batch {args.batch}, {args.sample_batches} batches per "
        f"sample phase, in 'both' "
        f"{f'at most {args.both_rate:,.0f} items/s' if args.both_rate else 'as fast as it can'}, "
        f"{args.rounds} rounds, ray num_cpus={args.num_cpus}, "
        f"{os.cpu_count()} cores; peers: {', '.join(peers)}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        buffers, writers = {}, {}
        for name in peers:
            if name == REVERB:
                buffers[name] = ReverbPeer(args, os.path.join(tmp, "reverb.log"))
                print(f"Reverb peer ready: {buffers[name].ready}")
                continue
            rb = buffers[name] = _build(name, capacity, args.batch, args.obs_shape, args.obs_dtype)
            core = name.endswith("Service")
            if core:
                args.empty_ckpt = os.path.join(tmp, "empty")
                rb.add(_numpy_items(0, 0, 1, args.obs_shape, args.obs_dtype))
                rb.save(args.empty_ckpt)  # (a state holding one item; every round reloads it)
            writers[name] = [
                ray.remote(num_cpus=0)(Writer).remote(
                    rb.client(), core, w, args.obs_shape, args.obs_dtype
                )
                for w in range(args.writers)
            ]
            ray.get([w.run.remote(args.chunk, args.chunk) for w in writers[name]])  # warm-up
            rb.sample()  # (compiles the core's sample)
        rows = {name: [] for name in peers}
        loads = []
        for r in range(args.rounds):
            order = peers[r % len(peers) :] + peers[: r % len(peers)]
            loads.append({"round": r, "order": order, "load": os.getloadavg()})
            for name in order:
                if name == REVERB:
                    rows[name].append(buffers[name].round())
                else:
                    rows[name].append(_round(ray, name, buffers[name], writers[name], args))
                print(f"round {r} {name}: {json.dumps(rows[name][-1]['checks'])}", flush=True)
        reverb_ready = buffers[REVERB].ready if REVERB in buffers else None
        for rb in buffers.values():
            rb.close()
    ray.shutdown()
    results = {name: summarize(got) for name, got in rows.items()}
    print_table(results)
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    if args.out:
        doc = {
            "benchmark": "ray_service",
            "started": started,
            "ended": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/ray_service.py", *(argv or sys.argv[1:])]),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": load_after,
            "loads": loads,
            "job": {
                "writers": args.writers,
                "items": args.items,
                "chunk": args.chunk,
                "batch": args.batch,
                "obs_shape": list(args.obs_shape),
                "obs_dtype": args.obs_dtype,
                "sample_batches": args.sample_batches,
                "reverb_in_flight": args.in_flight,
                "both_rate": args.both_rate,
                "service_in_flight": args.service_in_flight,
                "service_per_call": args.service_per_call,
                "rounds": args.rounds,
                "ray_num_cpus": args.num_cpus,
            },
            "versions": _versions(),
            "reverb": reverb_ready,
            "peers": results,
        }
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


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
    load_before = os.getloadavg()[0]
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    remote = {"num_cpus": 0, "max_restarts": args.rounds}
    print(f"load average before: {os.getloadavg()}; {n} items of obs f32[{args.obs_dim}]")
    with tempfile.TemporaryDirectory() as tmp:
        core = RayBufferService(
            frb.ReplayBuffer(capacity=n, batch_size=args.batch),
            {k: v[0] for k, v in _numpy_items(0, 0, 1, (args.obs_dim,)).items()},
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
            core.add(_numpy_items(0, start, chunk, (args.obs_dim,)))
            torch_rb.extend(_torch_items(0, start, chunk, (args.obs_dim,)))
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
    _write_extra(args, "restart", {"seconds": times}, load_before, items=n)


def _write_extra(args, job: str, result: dict, load_before: float, **facts) -> None:
    """``--restart``'s figures as JSON at ``--out`` (if given)."""
    if not args.out:
        return
    out = dict(
        job=job,
        finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        load_before=load_before,
        load_after=os.getloadavg()[0],
        rounds=args.rounds,
        obs_dim=args.obs_dim,
        batch=args.batch,
        **facts,
        result=result,
    )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
