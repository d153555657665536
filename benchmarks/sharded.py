"""Sharded buffers on 8 devices: collective bytes per step (from the compiled HLO) and step time.

    python benchmarks/sharded.py [--quick] [--devices 8] [--json benchmarks/results/sharded.json]

The script starts JAX with 8 fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_
count``) unless JAX already has them.

Item: a DQN transition ``{obs f32[64], next_obs f32[64], action i32, reward f32, done bool}``
(521 bytes). Each of the 8 shards holds 50,000 items (random data, random priorities for the
prioritized buffers). One step = each device adds 64 items to its shard, draws 256, and
(prioritized) sets the 256 drawn priorities.

1. **Bytes.** Every collective of the compiled step is read from its HLO (shapes and op kinds,
   so the figure does not depend on a noisy machine) and charged as the bytes a device sends
   to the others: all-to-all ``(n-1)/n`` of its operand, all-gather ``(n-1)/n`` of its result,
   all-reduce ``2 (n-1)/n`` (ring), collective-permute all of it. Collectives inside a
   ``while`` body (the exchange rounds of a global draw) are counted once per round; the
   mean number of rounds is measured by running the draw's plan (the same code) for 200
   keys. The **floor** is what a global draw cannot avoid: the rows drawn from other devices'
   shards, ``B (n - 1) / n`` rows of 521 bytes on average with equal shards.
2. **Step time**, in one run and interleaved (A B C D A B C D ...): global (stratified),
   global (multinomial), local, and the Stoix pattern (8 independent flashbax buffers, one per
   device, in the same ``shard_map``: ``make_item_buffer`` / ``make_prioritised_item_buffer``).
   Each round times ``STEPS`` jitted, donated steps; medians and ranges over the rounds, and
   the ratios to flashbax and of global to local. The machine's load average is printed: the
   8 fake devices share this machine's cores, and on a shared machine the times are noisy
   (the ratios, taken within one run, less so).
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count="
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}8".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import functional_rb as frb  # noqa: E402
from functional_rb.collectives import exchange as sharded_exchange  # noqa: E402

B, ADD, CAP = 256, 64, 50_000
ALPHA, BETA = 0.6, 0.4
EXAMPLE = {
    "obs": np.zeros(64, np.float32),
    "next_obs": np.zeros(64, np.float32),
    "action": np.int32(0),
    "reward": np.float32(0),
    "done": np.bool_(False),
}
ROW_BYTES = sum(np.asarray(x).nbytes for x in EXAMPLE.values())
AXIS = "data"


def _items(rng, n):
    return {
        "obs": rng.normal(size=(n, 64)).astype(np.float32),
        "next_obs": rng.normal(size=(n, 64)).astype(np.float32),
        "action": rng.integers(0, 4, n).astype(np.int32),
        "reward": rng.normal(size=n).astype(np.float32),
        "done": rng.random(n) < 0.01,
    }


# ------------------------------------------------------------------------------ HLO bytes
_DTYPE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE) + r")\[([\d,]*)\]")
_OPS = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")


def _result_bytes(type_str: str) -> int:
    total = 0
    for dt, dims in _ARRAY.findall(type_str):
        total += _DTYPE[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collective_bytes(hlo: str, n: int) -> dict:
    """``{"step": bytes, "round": bytes, "ops": [...]}``: bytes one device sends per step
    outside loops and per iteration of the while loops (the exchange rounds)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    comp, out = None, {"step": 0.0, "round": 0.0, "ops": []}
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(
            r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(_OPS) + r")(?:-start)?\(", line
        )
        if not m:
            continue
        size, op = _result_bytes(m.group(1)), m.group(2)
        share = {
            "all-to-all": (n - 1) / n,
            "all-gather": (n - 1) / n,
            "all-reduce": 2 * (n - 1) / n,
            "reduce-scatter": (n - 1),
            "collective-permute": 1.0,
        }[op]
        where = "round" if comp in bodies else "step"
        out[where] += size * share
        out["ops"].append((where, op, size))
    return out


def mean_rounds(masses, units, n, counts, cf, keys=200) -> float:
    """Mean exchange rounds of a global draw with these shard masses (the plan's own code)."""
    k = sharded_exchange.pair_capacity(units, n, cf)

    def rounds(key):
        plan = sharded_exchange.composition(key, masses, units, 0, counts)
        return jnp.maximum((jnp.max(plan.counts) + k - 1) // k, 1)

    r = jax.jit(jax.vmap(rounds))(jax.random.split(jax.random.key(1), keys))
    return float(np.mean(np.asarray(r)))


# ------------------------------------------------------------------------------ contenders
class Frb:
    def __init__(self, mesh, prioritized, sampling, counts="stratified"):
        sampler = (
            frb.PrioritizedSampler(alpha=ALPHA, beta=BETA) if prioritized else frb.RandomSampler()
        )
        self.rb = frb.ReplayBuffer(CAP, sampler=sampler, batch_size=B)
        self.srb = frb.ShardedReplayBuffer(self.rb, mesh, sampling=sampling, counts=counts)
        self.prioritized = prioritized
        self.name = f"functional_rb {sampling}" + (f" ({counts})" if sampling == "global" else "")

    def build(self, rng, n):
        state = self.srb.init(EXAMPLE)
        add = jax.jit(self.srb.add, donate_argnums=0)
        for _ in range(CAP // 5000):
            state = add(state, _items(rng, n * 5000))
        if self.prioritized:
            update = jax.jit(self.srb.update, donate_argnums=0)
            for start in range(0, CAP, 5000):
                idx = (np.arange(n)[:, None] * CAP + start + np.arange(5000)).reshape(-1)
                state = update(
                    state, idx.astype(np.int32), rng.exponential(size=idx.size).astype(np.float32)
                )
        return state

    def step(self, state, items, key):
        state = self.srb.add(state, items)
        smp, state = self.srb.sample(state, key)
        if self.prioritized:
            state = self.srb.update(state, smp.indices, jnp.abs(smp.data["reward"]) + 0.01)
        return state, jnp.sum(smp.data["obs"]) + jnp.sum(smp.weights)

    def sample_only(self, state, key):
        return self.srb.sample(state, key)


class Flashbax:
    """The Stoix pattern: one independent flashbax buffer per device, in a shard_map."""

    def __init__(self, mesh, prioritized):
        import flashbax as fbx

        self.mesh, self.prioritized = mesh, prioritized
        self.name = "flashbax x8 (Stoix)"
        if prioritized:
            self.buf = fbx.make_prioritised_item_buffer(
                max_length=CAP,
                min_length=1,
                sample_batch_size=B,
                add_batches=True,
                priority_exponent=ALPHA,
            )
        else:
            self.buf = fbx.make_item_buffer(
                max_length=CAP, min_length=1, sample_batch_size=B, add_batches=True
            )

    def _smap(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def build(self, rng, n):
        sharding = jax.sharding.NamedSharding(self.mesh, P(AXIS))
        local = jax.tree_util.tree_map(jnp.asarray, EXAMPLE)
        state = jax.jit(
            self._smap(
                lambda: jax.tree_util.tree_map(lambda x: x[None], self.buf.init(local)), (), P(AXIS)
            )
        )()
        add = jax.jit(
            self._smap(
                lambda s, it: jax.tree_util.tree_map(
                    lambda x: x[None], self.buf.add(jax.tree_util.tree_map(lambda x: x[0], s), it)
                ),
                (P(AXIS), P(AXIS)),
                P(AXIS),
            ),
            donate_argnums=0,
        )
        for _ in range(CAP // 5000):
            state = add(state, jax.device_put(_items(rng, n * 5000), sharding))
        if self.prioritized:
            setp = jax.jit(
                self._smap(
                    lambda s, i, p: jax.tree_util.tree_map(
                        lambda x: x[None],
                        self.buf.set_priorities(jax.tree_util.tree_map(lambda x: x[0], s), i, p),
                    ),
                    (P(AXIS), P(AXIS), P(AXIS)),
                    P(AXIS),
                ),
                donate_argnums=0,
            )
            idx = np.tile(np.arange(CAP, dtype=np.int32), n)
            state = setp(
                state,
                jax.device_put(idx, sharding),
                jax.device_put(rng.exponential(size=idx.size).astype(np.float32), sharding),
            )
        return state

    def step(self, state, items, key):
        buf = self.buf

        def body(s, it, key):
            s = jax.tree_util.tree_map(lambda x: x[0], s)
            s = buf.add(s, it)
            key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
            smp = buf.sample(s, key)
            data = smp.experience
            if self.prioritized:
                w = (CAP * smp.probabilities) ** -BETA  # weights as a flashbax user makes them
                w = w / jnp.max(w)
                s = buf.set_priorities(s, smp.indices, jnp.abs(data["reward"]) + 0.01)
            else:
                w = jnp.ones((B,), jnp.float32)
            out = jax.lax.psum(jnp.sum(data["obs"]) + jnp.sum(w), AXIS)
            return jax.tree_util.tree_map(lambda x: x[None], s), out

        return self._smap(body, (P(AXIS), P(AXIS), P()), (P(AXIS), P()))(state, items, key)


# ------------------------------------------------------------------------------ runs
def bytes_table(mesh, n, quick):
    rows = []
    rng = np.random.default_rng(0)
    for prioritized in (False, True):
        for sampling, counts in (
            ("global", "stratified"),
            ("global", "multinomial"),
            ("local", "stratified"),
        ):
            f = Frb(mesh, prioritized, sampling, counts)
            state = jax.eval_shape(f.srb.init, EXAMPLE)
            hlo = jax.jit(f.sample_only).lower(state, jax.random.key(0)).compile().as_text()
            got = collective_bytes(hlo, n)
            masses = (
                jnp.full((n,), 1.0)
                if not prioritized
                else jnp.asarray(rng.gamma(CAP, size=n), jnp.float32)
            )  # sums of CAP exponential priorities
            rounds = (
                mean_rounds(masses, B, n, counts, f.srb.capacity_factor)
                if sampling == "global"
                else 0.0
            )
            per_step = got["step"] + rounds * got["round"]
            floor = B * (n - 1) / n * ROW_BYTES
            rows.append(
                dict(
                    sampler="prioritized" if prioritized else "uniform",
                    mode=f.name,
                    bytes_per_step=per_step,
                    step_bytes=got["step"],
                    round_bytes=got["round"],
                    mean_rounds=rounds,
                    floor=floor,
                    ratio=per_step / floor,
                )
            )
            if prioritized and sampling == "global" and counts == "stratified":
                hlo_u = (
                    jax.jit(f.srb.update)
                    .lower(
                        state,
                        jax.ShapeDtypeStruct((n * B,), jnp.int32),
                        jax.ShapeDtypeStruct((n * B,), jnp.float32),
                    )
                    .compile()
                    .as_text()
                )
                ub = collective_bytes(hlo_u, n)
                rows.append(
                    dict(
                        sampler="prioritized",
                        mode="functional_rb update (global)",
                        bytes_per_step=ub["step"],
                        step_bytes=ub["step"],
                        round_bytes=0.0,
                        mean_rounds=0.0,
                        floor=float("nan"),
                        ratio=float("nan"),
                    )
                )
    return rows


def time_table(mesh, n, quick):
    steps, rounds = (5, 3) if quick else (20, 7)
    rows = []
    for prioritized in (False, True):
        rng = np.random.default_rng(1)
        contenders = [
            Frb(mesh, prioritized, "global"),
            Frb(mesh, prioritized, "global", "multinomial"),
            Frb(mesh, prioritized, "local"),
            Flashbax(mesh, prioritized),
        ]
        sharding = jax.sharding.NamedSharding(mesh, P(AXIS))
        items = jax.device_put(_items(rng, n * ADD), sharding)
        runs = []
        for c in contenders:
            state = c.build(rng, n)
            fn = jax.jit(c.step, donate_argnums=0)
            state, out = fn(state, items, jax.random.key(0))  # compile
            jax.block_until_ready(out)
            runs.append([c, fn, state, []])
        for r in range(rounds):
            for run in runs:
                c, fn, state, times = run
                t = time.perf_counter()
                for k in range(steps):
                    state, out = fn(state, items, jax.random.key(r * steps + k))
                jax.block_until_ready((state, out))
                times.append((time.perf_counter() - t) / steps)
                run[2] = state
        fbx_med = statistics.median(runs[-1][3])
        local_med = statistics.median(runs[2][3])
        for c, _, _, times in runs:
            med = statistics.median(times)
            rows.append(
                dict(
                    sampler="prioritized" if prioritized else "uniform",
                    mode=c.name,
                    ms_per_step=1e3 * med,
                    ms_min=1e3 * min(times),
                    ms_max=1e3 * max(times),
                    vs_flashbax=med / fbx_med,
                    vs_local=med / local_med,
                )
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-time", action="store_true")
    args = ap.parse_args(argv)
    n = args.devices
    if jax.device_count() < n:
        print(f"needs {n} devices, JAX has {jax.device_count()}", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    load0 = os.getloadavg()
    print(
        f"# sharded buffers: {n} {jax.devices()[0].platform} devices, B={B} per device, "
        f"{CAP:,} items per shard, row {ROW_BYTES} bytes; load average {load0[0]:.2f}"
    )
    brows = bytes_table(mesh, n, args.quick)
    print("\n| sampler | mode | bytes / step / device | floor | x floor | rounds |")
    print("|---|---|---|---|---|---|")
    for r in brows:
        print(
            f"| {r['sampler']} | {r['mode']} | {r['bytes_per_step']:,.0f} | "
            f"{r['floor']:,.0f} | {r['ratio']:.2f} | {r['mean_rounds']:.2f} |"
        )
    trows = [] if args.skip_time else time_table(mesh, n, args.quick)
    load1 = os.getloadavg()
    if trows:
        print("\n| sampler | mode | ms / step (median) | range | x flashbax | x local |")
        print("|---|---|---|---|---|---|")
        for r in trows:
            print(
                f"| {r['sampler']} | {r['mode']} | {r['ms_per_step']:.2f} | "
                f"{r['ms_min']:.2f}-{r['ms_max']:.2f} | {r['vs_flashbax']:.2f} | "
                f"{r['vs_local']:.2f} |"
            )
    print(f"\nload average: {load0[0]:.2f} at start, {load1[0]:.2f} at end ({os.cpu_count()} CPUs)")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "bytes": brows,
                    "time": trows,
                    "load": [load0, load1],
                    "devices": n,
                    "platform": jax.devices()[0].platform,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
