"""functional_rb.adapters vs TorchRL on the same TensorDict workload, side by side.

Per storage kind (LazyTensorStorage, LazyMemmapStorage): ``extend`` of a batch and ``sample`` of
a batch, and a training loop that computes between samples (the sample latency it sees, with
and without ``prefetch``). ``PrioritizedSliceSampler``: ``sample`` of slices (nothing written
between samples), and a step (``extend`` of a batch of steps, ``sample``, ``update_priority``
of the sampled steps); TorchRL's runs over the adapters' NumPy port of its segment trees
(``functional_rb.adapters.samplers._trees``, the same float semantics) since its compiled
trees do not load with this torch, so the comparison is of the two samplers' own work.
Each round runs every library once, in turn (A B A B ...); medians
and min-max ranges over the rounds, with the load average before and after.

``--baseline PATH`` also runs the same rounds with the functional_rb of another checkout (e.g.
a ``git worktree`` of an earlier commit), interleaved with this one, each round in a fresh
process, to compare before and after a change::

    python benchmarks/adapters_vs_torchrl.py [--quick] [--rounds 5] [--baseline /tmp/frb_old]
        [--only PrioritizedSliceSampler|storages]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")


def _data(n, obs):
    import torch
    from tensordict import TensorDict

    return TensorDict(
        {
            "obs": torch.randn(n, obs),
            ("next", "obs"): torch.randn(n, obs),
            "action": torch.randint(0, 4, (n,)),
            ("next", "reward"): torch.randn(n, 1),
            ("next", "done"): torch.zeros(n, 1, dtype=torch.bool),
        },
        [n],
    )


def _median_us(fn, reps):
    fn()  # warm-up (compilation)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def _loop_latency_us(rb, steps, compute_s):
    """Median time ``sample()`` takes inside a loop that computes about ``compute_s`` between
    samples (what prefetching hides). The computation is torch matmuls, which release the GIL as
    a learner's forward/backward does."""
    import torch

    a = torch.randn(256, 256)
    rb.sample()
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        rb.sample()
        lat.append(time.perf_counter() - t0)
        end = time.perf_counter() + compute_s
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
    return statistics.median(lat) * 1e6


def _episodes(n, obs, seed):
    """``n`` steps of episodes of 50..500 steps (ids and done flags agree)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 501, (n // 50 + 1,), generator=g)
    ep = torch.repeat_interleave(torch.arange(lengths.numel()) + seed * 100_000, lengths)[:n]
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[:-1, 0] = ep[1:] != ep[:-1]
    data = _data(n, obs)
    data["episode"], data["next", "done"] = ep, done
    return data


def _prioritized_slices(lib, name, cap, obs, batch, reps, out):
    """PrioritizedSliceSampler: sample alone, then extend + sample + update_priority."""
    import torch

    if name == "torchrl":  # its compiled trees do not load: the same NumPy trees as ours
        import numpy as np
        import torchrl.data.replay_buffers.samplers.prioritized as tprio

        from functional_rb.adapters.samplers import _trees as st

        for bits, dt in ((32, np.float32), (64, np.float64)):
            setattr(tprio, f"SumSegmentTreeFp{bits}", lambda n, dt=dt: st.SumSegmentTree(n, dt))
            setattr(tprio, f"MinSegmentTreeFp{bits}", lambda n, dt=dt: st.MinSegmentTree(n, dt))
    rb = lib.TensorDictReplayBuffer(
        storage=lib.LazyTensorStorage(cap),
        batch_size=batch,
        sampler=lib.PrioritizedSliceSampler(cap, 0.7, 0.5, slice_len=32, traj_key="episode"),
    )
    rb.extend(_episodes(cap // 2, obs, 0))
    s = rb.sample()
    rb.update_priority(s["index"], torch.rand(batch) + 0.1)
    out[f"PrioritizedSliceSampler/sample/{name}"] = _median_us(rb.sample, reps)
    chunks = iter([_episodes(batch, obs, i + 1) for i in range(reps + 1)])

    def step():
        rb.extend(next(chunks))
        s = rb.sample()
        rb.update_priority(s["index"], torch.rand(batch) + 0.1)

    out[f"PrioritizedSliceSampler/step/{name}"] = _median_us(step, reps)


def one_round(quick: bool, only: str | None = None) -> dict:
    """One measurement of every workload (``only``: of one family) for both libraries (this
    process's functional_rb)."""
    import torch
    import torchrl.data as T

    import functional_rb.adapters as A

    torch.set_num_threads(1)  # a shared 2-core box: no thread-pool oversubscription
    cap, obs, batch = (20_000, 16, 256) if quick else (200_000, 64, 256)
    reps = 10 if quick else 30
    out = {}
    if only in (None, "PrioritizedSliceSampler"):
        for name, lib in (("frb", A), ("torchrl", T)):
            _prioritized_slices(lib, name, cap, obs, batch, reps, out)
    if only not in (None, "storages"):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("LazyTensorStorage", "LazyMemmapStorage"):
            for name, lib in (("frb", A), ("torchrl", T)):
                kw = {"scratch_dir": f"{tmp}/{name}_{kind}"} if kind == "LazyMemmapStorage" else {}
                rb = lib.TensorDictReplayBuffer(
                    storage=getattr(lib, kind)(cap, **kw), batch_size=batch
                )
                rb.extend(_data(cap // 2, obs))
                chunk = _data(batch, obs)
                out[f"{kind}/extend/{name}"] = _median_us(
                    lambda rb=rb, chunk=chunk: rb.extend(chunk.clone()), reps
                )
                out[f"{kind}/sample/{name}"] = _median_us(rb.sample, reps)
        for name, lib in (("frb", A), ("torchrl", T)):
            for prefetch in (0, 2):
                rb = lib.TensorDictReplayBuffer(
                    storage=lib.LazyTensorStorage(cap), batch_size=batch, prefetch=prefetch or None
                )
                rb.extend(_data(cap // 2, obs))
                out[f"loop/prefetch={prefetch}/{name}"] = _loop_latency_us(
                    rb, 20 if quick else 60, 0.002
                )
    return out


def _run_round(path: str | None, quick: bool, only: str | None) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = (
        [sys.executable, __file__, "--one-round"]
        + (["--quick"] if quick else [])
        + (["--only", only] if only else [])
    )
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--baseline",
        default=None,
        help="a checkout with the functional_rb to "
        "compare with (its rounds interleave with this one's)",
    )
    ap.add_argument(
        "--only",
        default=None,
        choices=["PrioritizedSliceSampler", "storages"],
        help="one family of workloads (default: all); storages: the two storages' "
        "extend and sample, and the loop",
    )
    ap.add_argument("--out", default=None, help="write the rounds and the table as JSON here")
    ap.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_round:
        print(json.dumps(one_round(args.quick, args.only)))
        return
    trees = {"now": None}
    if args.baseline:
        trees["baseline"] = args.baseline
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = {t: [] for t in trees}
    for _ in range(args.rounds):
        for t, path in trees.items():
            runs[t].append(_run_round(path, args.quick, args.only))
    load1 = os.getloadavg()
    print(
        f"rounds={args.rounds} (each a fresh process, trees interleaved); load average "
        f"{load0[0]:.2f} before, {load1[0]:.2f} after; medians over rounds [min-max]"
    )
    keys = sorted(runs["now"][0])
    print("| workload | tree | functional_rb.adapters (us) | torchrl (us) | torchrl / adapters |")
    print("| --- | --- | --- | --- | --- |")
    table = []
    for key in sorted({k.rsplit("/", 1)[0] for k in keys}):
        for t in trees:
            ours = [r[f"{key}/frb"] for r in runs[t]]
            theirs = [r[f"{key}/torchrl"] for r in runs[t]]
            ratio = [b / a for a, b in zip(ours, theirs)]
            table.append(
                dict(
                    workload=key,
                    tree=t,
                    ours_us=statistics.median(ours),
                    torchrl_us=statistics.median(theirs),
                    torchrl_over_ours=statistics.median(ratio),
                    ratio_range=[min(ratio), max(ratio)],
                )
            )
            print(
                f"| {key} | {t} | {statistics.median(ours):.0f} [{min(ours):.0f}-"
                f"{max(ours):.0f}] | {statistics.median(theirs):.0f} | "
                f"{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}] |"
            )
    if args.out:
        result = dict(
            started=started,
            finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            load_before=load0[0],
            load_after=load1[0],
            rounds=args.rounds,
            quick=args.quick,
            only=args.only,
            trees=trees,
            runs=runs,
            table=table,
        )
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
