"""W3: slice sampling (sub-trajectories) on 1,000,000 stored steps.

Episodes have lengths uniform in 50..500; a batch is 32 slices x 64 steps. Side by side, in one
process, interleaved A B A B, medians over rounds:

* functional_rb ``SliceSampler`` (jitted ``rb.sample`` called from Python, and 100 batches in
  one ``lax.scan``),
* TorchRL ``SliceSampler`` without and with ``cache_values`` (``TensorDictReplayBuffer`` over a
  ``LazyTensorStorage``),
* flashbax ``make_trajectory_buffer`` (it ignores episode ends: its sequences may cross them).

Two workloads: *sample only* (static buffer) and *add + sample* (each iteration adds a chunk
of 500 steps, then samples one batch). TorchRL runs with ``torch.set_num_threads(1)`` (faster
than the default on a small shared machine). TorchRL's ``cache_values`` is only valid for static
data; under add + sample its cache is dropped by every extend.

Usage: ``python benchmarks/w3_slices.py [--quick] [--items realistic]``; ``run(quick, items)``
returns the rows.
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
    # `python benchmarks/w3_slices.py` from the checkout; after site-packages: an installed
    # functional_rb wins
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import backends  # noqa: E402
from benchmarks.backends import NUM_SLICES, SLICE_LEN  # noqa: E402

N_STEPS = 1_000_000
CHUNK = 500
OBS_DIM = 8


def make_stream(n, seed, items="small"):
    """n steps of consecutive episodes (lengths uniform in 50..500). ``items``: "small" (5
    leaves: obs f32[8], action, reward, episode id, next done) or "realistic" (7 leaves, a
    continuous-control transition: obs f32[17], action f32[6], reward, episode id, next obs
    f32[17], next done, next terminated)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(50, 501, size=n // 50 + 2)
    ends = np.cumsum(lens)
    done = np.zeros(n, bool)
    done[ends[ends <= n] - 1] = True
    ep = np.searchsorted(ends, np.arange(n), side="right").astype(np.int32)
    reward = rng.standard_normal(n).astype(np.float32)
    if items == "realistic":
        obs = rng.standard_normal((n + 1, 17)).astype(np.float32)
        return {
            "obs": obs[:n],
            "action": rng.standard_normal((n, 6)).astype(np.float32),
            "reward": reward,
            "ep": ep,
            "next": {"obs": obs[1:], "done": done, "terminated": done.copy()},
        }
    obs = rng.standard_normal((n, OBS_DIM)).astype(np.float32)
    action = rng.integers(0, 4, n).astype(np.int32)
    return {"obs": obs, "action": action, "reward": reward, "ep": ep, "next": {"done": done}}


def take(d, a, b):
    return jax.tree_util.tree_map(lambda x: x[a:b], d)


# ------------------------------------------------------------------------ contenders
class Ours:
    name = "functional_rb SliceSampler (jit per batch)"

    def __init__(self, data, extra):
        self.rb = rb = backends.frb_buffer("slices", N_STEPS)
        self.state = jax.jit(rb.init_from_data)(data)
        # donated: otherwise every call copies the returned state (the whole storage)
        self.sample = jax.jit(rb.sample, donate_argnums=0)
        self.add = jax.jit(rb.add, donate_argnums=0)
        self.chunks = [
            jax.device_put(take(extra, i * CHUNK, (i + 1) * CHUNK))
            for i in range(len(extra["ep"]) // CHUNK)
        ]
        self.i = 0
        self.key = jax.random.key(0)
        s, self.state = self.sample(self.state, self.key)
        self.state = self.add(self.state, self.chunks[0])
        jax.block_until_ready(self.state)

    def sample_only(self, n):
        keys = jax.random.split(jax.random.fold_in(self.key, self.i), n)
        self.i += 1
        t = time.perf_counter()
        for k in keys:
            s, self.state = self.sample(self.state, k)
        jax.block_until_ready(s)
        return time.perf_counter() - t

    def add_sample(self, n):
        keys = jax.random.split(jax.random.fold_in(self.key, self.i), n)
        self.i += 1
        t = time.perf_counter()
        for j, k in enumerate(keys):
            self.state = self.add(self.state, self.chunks[(self.i * n + j) % len(self.chunks)])
            s, self.state = self.sample(self.state, k)
        jax.block_until_ready(s)
        return time.perf_counter() - t


class OursScan(Ours):
    name = "functional_rb SliceSampler (lax.scan, 100/call)"
    BLOCK = 100

    def __init__(self, data, extra):
        super().__init__(data, extra)
        rb = self.rb
        stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *self.chunks[: self.BLOCK])
        self.stacked = stacked

        def consume(s):
            return sum(
                jnp.sum(x.astype(jnp.float32))
                for x in jax.tree_util.tree_leaves((s.data, s.indices, s.weights, s.mask))
            )

        def scan_sample(state, key):
            def body(c, k):
                st, acc = c
                s, st = rb.sample(st, k)
                return (st, acc + consume(s)), None

            (state, acc), _ = jax.lax.scan(
                body, (state, jnp.float32(0)), jax.random.split(key, self.BLOCK)
            )
            return state, acc

        def scan_add_sample(state, key, chunks):
            def body(c, x):
                st, acc = c
                k, chunk = x
                st = rb.add(st, chunk)
                s, st = rb.sample(st, k)
                return (st, acc + consume(s)), None

            (state, acc), _ = jax.lax.scan(
                body, (state, jnp.float32(0)), (jax.random.split(key, self.BLOCK), chunks)
            )
            return state, acc

        self.scan_sample = jax.jit(scan_sample, donate_argnums=0)
        self.scan_add_sample = jax.jit(scan_add_sample, donate_argnums=0)
        self.state, acc = self.scan_sample(self.state, self.key)
        self.state, acc = self.scan_add_sample(self.state, self.key, stacked)
        jax.block_until_ready(acc)

    def sample_only(self, n):
        reps = max(n // self.BLOCK, 1)
        t = time.perf_counter()
        for r in range(reps):
            self.state, acc = self.scan_sample(self.state, jax.random.fold_in(self.key, r))
        jax.block_until_ready(acc)
        return (time.perf_counter() - t) * n / (reps * self.BLOCK)

    def add_sample(self, n):
        reps = max(n // self.BLOCK, 1)
        t = time.perf_counter()
        for r in range(reps):
            self.state, acc = self.scan_add_sample(
                self.state, jax.random.fold_in(self.key, r), self.stacked
            )
        jax.block_until_ready(acc)
        return (time.perf_counter() - t) * n / (reps * self.BLOCK)


class TorchRL:
    def __init__(self, data, extra, cache):
        backends.torch_setup(threads=1, seed=0)  # torch's default threads: ~30x slower here
        self.name = f"TorchRL SliceSampler (cache_values={cache})"

        def td(d):
            return backends.tensordict(d, len(d["ep"]))

        self.rb = backends.torchrl_buffer("slices", N_STEPS, cache_values=cache)
        self.rb.extend(td(data))
        self.chunks = [
            td(take(extra, i * CHUNK, (i + 1) * CHUNK)) for i in range(len(extra["ep"]) // CHUNK)
        ]
        self.i = 0
        self.rb.sample()

    def sample_only(self, n):
        t = time.perf_counter()
        for _ in range(n):
            self.rb.sample()
        return time.perf_counter() - t

    def add_sample(self, n):
        t = time.perf_counter()
        for _ in range(n):
            self.rb.extend(self.chunks[self.i % len(self.chunks)])
            self.i += 1
            self.rb.sample()
        return time.perf_counter() - t


class Flashbax:
    name = "flashbax trajectory buffer (ignores episode ends)"

    def __init__(self, data, extra):
        self.buf = buf = backends.flashbax_buffer("slices", N_STEPS)
        # one row of N_STEPS steps, added 100,000 at a time; the same jitted add adds the chunks
        self.state, self.add = backends.flashbax_fill(buf, data, N_STEPS, time_axis=True)
        self.sample = jax.jit(buf.sample)
        self.chunks = [
            jax.device_put(
                jax.tree_util.tree_map(lambda x: x[None], take(extra, i * CHUNK, (i + 1) * CHUNK))
            )
            for i in range(len(extra["ep"]) // CHUNK)
        ]
        self.i = 0
        self.key = jax.random.key(0)
        jax.block_until_ready(self.sample(self.state, self.key))

    def sample_only(self, n):
        keys = jax.random.split(jax.random.fold_in(self.key, self.i), n)
        self.i += 1
        t = time.perf_counter()
        for k in keys:
            s = self.sample(self.state, k)
        jax.block_until_ready(s)
        return time.perf_counter() - t

    def add_sample(self, n):
        keys = jax.random.split(jax.random.fold_in(self.key, self.i), n)
        self.i += 1
        t = time.perf_counter()
        for j, k in enumerate(keys):
            self.state = self.add(self.state, self.chunks[(self.i * n + j) % len(self.chunks)])
            s = self.sample(self.state, k)
        jax.block_until_ready(s)
        return time.perf_counter() - t


# ------------------------------------------------------------------------ driver
def run(quick: bool = False, items: str = "small"):
    rounds = 3 if quick else 5
    n_fast, n_slow = (100, 10) if quick else (300, 30)
    data = make_stream(N_STEPS, seed=0, items=items)
    extra = make_stream(CHUNK * 200, seed=1, items=items)
    extra["ep"] = extra["ep"] + 10_000_000
    contenders = [
        Ours(data, extra),
        OursScan(data, extra),
        TorchRL(data, extra, False),
        TorchRL(data, extra, True),
        Flashbax(data, extra),
    ]
    rates = {(c.name, w): [] for c in contenders for w in ("sample", "add")}
    for _ in range(rounds):
        for c in contenders:  # interleaved: every contender once per round
            n = n_slow if c.name.startswith("TorchRL") else n_fast
            rates[(c.name, "sample")].append(n / c.sample_only(n))
            rates[(c.name, "add")].append(n / c.add_sample(n))
    rows = []
    for c in contenders:
        rows.append(
            (
                c.name,
                statistics.median(rates[(c.name, "sample")]),
                statistics.median(rates[(c.name, "add")]),
            )
        )
    return rows


def table(rows):
    ref = {r[0]: r for r in rows}
    base = ref["TorchRL SliceSampler (cache_values=False)"]
    cached = ref["TorchRL SliceSampler (cache_values=True)"]
    lines = [
        "| sampler | sample only (batches/s) | add 500 + sample (batches/s) | "
        "vs TorchRL (sample / add+sample) | vs TorchRL cache_values (sample) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, s, a in rows:
        lines.append(
            f"| {name} | {s:,.0f} | {a:,.0f} | {s / base[1]:.1f}x / {a / base[2]:.1f}x"
            f" | {s / cached[1]:.1f}x |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and batches")
    p.add_argument(
        "--items",
        choices=("small", "realistic"),
        default="small",
        help="small: 5 leaves (obs f32[8], ...); realistic: 7 leaves of a "
        "continuous-control transition (obs f32[17], action f32[6], ...)",
    )
    p.add_argument("--out", default=None, help="write the rows and the run's load as JSON here")
    args = p.parse_args()
    print(
        f"W3: {N_STEPS:,} steps, episodes 50..500, {NUM_SLICES} slices x {SLICE_LEN} steps, "
        f"{args.items} items; jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    before = os.getloadavg()
    rows = run(args.quick, args.items)
    print(table(rows))
    if args.out:
        report = {
            "items": args.items,
            "quick": args.quick,
            "jax": jax.__version__,
            "cpus": os.cpu_count(),
            "loadavg_before": before,
            "loadavg_after": os.getloadavg(),
            "unit": "batches per second, median of rounds",
            "rows": [
                {"sampler": name, "sample_only": a, "add_and_sample": b} for name, a, b in rows
            ],
        }
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
