"""functional_rb.adapters vs TorchRL on the same TensorDict workload, side by side.

Per storage kind (LazyTensorStorage, LazyMemmapStorage): ``extend`` of a batch and ``sample`` of
a batch, interleaved A B A B in one process, median over repeats, with the ratio
(TorchRL time / adapter time: > 1 means the adapter is faster). The adapter numbers include the
torch <-> JAX conversion at the boundary.

    python benchmarks/adapters_vs_torchrl.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
from tensordict import TensorDict

import functional_rb.adapters as A

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # the box is shared: avoid thread-pool oversubscription noise


def _data(n, obs):
    return TensorDict({"obs": torch.randn(n, obs), ("next", "obs"): torch.randn(n, obs),
                       "action": torch.randint(0, 4, (n,)), ("next", "reward"): torch.randn(n, 1),
                       ("next", "done"): torch.zeros(n, 1, dtype=torch.bool)}, [n])


def _time(fn, reps):
    fn()  # warm-up (compilation for the adapter)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torchrl.data as T
    cap, obs, batch = (20_000, 16, 256) if args.quick else (200_000, 64, 256)
    rounds, reps = (3, 10) if args.quick else (5, 30)
    rows = []
    tmp = tempfile.TemporaryDirectory()
    for kind in ("LazyTensorStorage", "LazyMemmapStorage"):
        libs = {}
        for name, lib in (("functional_rb", A), ("torchrl", T)):
            kw = {"scratch_dir": f"{tmp.name}/{name}_{kind}"} if kind == "LazyMemmapStorage" else {}
            rb = lib.TensorDictReplayBuffer(storage=getattr(lib, kind)(cap, **kw),
                                            batch_size=batch)
            rb.extend(_data(cap // 2, obs))
            libs[name] = rb
        chunk = _data(batch, obs)
        for op in ("extend", "sample"):
            times = {n: [] for n in libs}
            for _ in range(rounds):  # interleaved A B A B
                for n, rb in libs.items():
                    f = (lambda rb=rb: rb.extend(chunk.clone())) if op == "extend" else rb.sample
                    times[n] += _time(f, reps)
            med = {n: statistics.median(v) * 1e6 for n, v in times.items()}
            rows.append((kind, f"{op}({batch})", med["functional_rb"], med["torchrl"],
                         med["torchrl"] / med["functional_rb"]))
    print(f"capacity={cap}, obs dim={obs}, batch={batch}, medians over {rounds * reps} calls")
    print("| storage | op | functional_rb.adapters (us) | torchrl (us) | torchrl / adapters |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.2f} |")


if __name__ == "__main__":
    main()
