"""uniform replay: capacity 1M items {obs f32[17], action f32[6], reward f32, done f32}, prefilled; one step = add 256 + sample 256.

Modes (higher is better, steps/s):
  (a) per step: a Python loop calling a jitted ``add`` (donate_argnums) and a jitted ``sample``
      each step (cpprb / TorchRL: their ``add``/``extend`` + ``sample``).
  (a') fused step: one jitted (donated) function doing add + sample, called once per step.
  (b) scan: 1000 steps fused in one ``lax.scan`` inside one jit; every sampled leaf is summed
      into the carry so XLA cannot drop the gather.
Backends run interleaved (A B C A B C ...), several repeats; the median is reported.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import backends
from benchmarks.backends import BATCH, SCAN_STEPS, Cpprb, Flashbax, FunctionalRB, clock_fn

CAPACITY = 1_000_000
REFERENCES = ("flashbax", "cpprb")

MODE_A = "(a) per step: jit add + jit sample"
MODE_F = "(a') per step: fused jit add+sample"
MODE_B = f"(b) {SCAN_STEPS} steps in one lax.scan"


def _example():
    return {
        "obs": jnp.zeros((17,), jnp.float32),
        "action": jnp.zeros((6,), jnp.float32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.float32),
    }


def _np_batch(rng, n):
    return {
        "obs": rng.standard_normal((n, 17), np.float32),
        "action": rng.standard_normal((n, 6), np.float32),
        "reward": rng.standard_normal((n,), np.float32),
        "done": (rng.random((n,)) < 0.01).astype(np.float32),
    }


class FunctionalRBPerLeaf(FunctionalRB):
    """Same buffer, ``DeviceStorage(pack=False)``: one array per leaf (the default packs the
    four f32 leaves into one [1M, 25] array)."""

    name = "functional_rb (pack=False)"

    def storage(self):
        import functional_rb as frb

        return frb.DeviceStorage(pack=False)


class BareJax(backends.JaxDriver):
    """A hand-written ring buffer (dict of arrays + cursor, ``x.at[idx].set``,
    ``jax.random.randint``, ``x[idx]``), no checks: what a user would write without a library."""

    name = "bare jax (hand-written)"

    def build(self, prefill):
        return {"data": prefill, "cursor": jnp.int32(0), "size": jnp.int32(self.cap)}

    def add_fn(self, state, batch):
        cap = self.cap
        idx = (state["cursor"] + jnp.arange(BATCH, dtype=jnp.int32)) % cap
        data = jax.tree_util.tree_map(lambda d, x: d.at[idx].set(x), state["data"], batch)
        return {
            "data": data,
            "cursor": (state["cursor"] + BATCH) % cap,
            "size": jnp.minimum(state["size"] + BATCH, cap),
        }

    def sample_fn(self, state, key):
        idx = jax.random.randint(key, (BATCH,), 0, state["size"])
        return jax.tree_util.tree_map(lambda d: d[idx], state["data"]), state


class TorchRL:
    """TorchRL's ``ReplayBuffer(LazyTensorStorage)``, torch's default threads; a step is its
    ``extend`` + ``sample``."""

    name = "torchrl"

    def __init__(self, capacity, prefill, batch):
        self.rb = backends.torchrl_buffer("uniform", capacity)
        self.rb.extend(backends.tensordict(prefill, len(prefill["reward"])))
        self.batch = backends.tensordict(batch, len(batch["reward"]))

    def per_call(self, keys):
        rb, batch = self.rb, self.batch
        keys = keys[: max(20, len(keys) // 10)]  # ~50x slower than the others: fewer steps
        clock = clock_fn()
        t = clock()
        for _ in keys:
            rb.extend(batch)
            s = rb.sample()
        del s
        return len(keys) / (clock() - t)


def _try(cls, *args):
    try:
        return cls(*args)
    except ImportError as e:  # a peer that is not installed is skipped, not fatal
        print(f"[w1] skipping {cls.name}: {e}")
        return None


def run(quick: bool = False) -> list[dict]:
    steps = 200 if quick else 1000
    repeats = 3 if quick else 5
    rng = np.random.default_rng(0)
    prefill = _np_batch(rng, CAPACITY)
    batch = _np_batch(rng, BATCH)
    jax_backends = [
        b
        for b in (
            _try(FunctionalRB, CAPACITY, prefill, batch),
            _try(FunctionalRBPerLeaf, CAPACITY, prefill, batch),
            _try(Flashbax, CAPACITY, prefill, batch),
            _try(BareJax, CAPACITY, prefill, batch),
        )
        if b is not None
    ]
    host = [
        b
        for b in (_try(Cpprb, CAPACITY, prefill, batch), _try(TorchRL, CAPACITY, prefill, batch))
        if b is not None
    ]
    del prefill
    keys = list(jax.random.split(jax.random.key(1), steps))
    # warm-up: compile everything and touch every code path once
    for b in jax_backends:
        b.per_call(keys[:3])
        b.fused(keys[:3])
        b.scan(keys[0])
    for b in host:
        b.per_call(keys[:20])
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(repeats):
        for b in jax_backends + host:  # interleaved: A B C ... A B C ...
            res.setdefault((MODE_A, b.name), []).append(b.per_call(keys))
        for b in jax_backends:
            res.setdefault((MODE_F, b.name), []).append(b.fused(keys))
        for b in jax_backends:
            res.setdefault((MODE_B, b.name), []).append(b.scan(keys[r]))
    rows = []
    for (mode, name), vals in res.items():
        rows.append(
            {"mode": mode, "backend": name, "value": statistics.median(vals), "unit": "steps/s"}
        )
    # cpprb has no fused form: its per-step number is the reference for the fused mode too.
    for row in list(rows):
        if row["mode"] == MODE_A and row["backend"] == "cpprb":
            rows.append(dict(row, mode=MODE_F))
    order = {MODE_A: 0, MODE_F: 1, MODE_B: 2}
    rows.sort(key=lambda r: order[r["mode"]])
    return rows
