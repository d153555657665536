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

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

CAPACITY = 1_000_000
BATCH = 256
SCAN_STEPS = 1000
REFERENCES = ("flashbax", "cpprb")

# FRB_BENCH_CLOCK=cpu measures process CPU time instead of wall time: on a shared, overloaded
# machine this shows what each step costs rather than how long it waited for a core.
_clock = time.process_time if os.environ.get("FRB_BENCH_CLOCK") == "cpu" else time.perf_counter

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


def _consume(acc, data):
    """Sum every sampled leaf into a scalar so that no gather is dead code."""
    return acc + sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(data))


def _shift(batch, i):
    """A different batch each scan step (cheap), so the adds are not loop-invariant."""
    f = i.astype(jnp.float32)
    return jax.tree_util.tree_map(lambda x: x + f, batch)


class _Jax:
    """Shared driver for JAX backends: subclasses give init/add/sample as pure functions."""

    name = "?"

    def __init__(self, prefill, batch):
        self.batch = jax.tree_util.tree_map(jnp.asarray, batch)
        self.state = self.build(prefill)
        self._add = jax.jit(self.add_fn, donate_argnums=0)
        self._sample = jax.jit(self.sample_fn, donate_argnums=0)

        def fused(state, batch, key):
            state = self.add_fn(state, batch)
            data, state = self.sample_fn(state, key)
            return data, state

        self._fused = jax.jit(fused, donate_argnums=0)

        def scan(state, batch, key):
            def body(carry, i):
                state, acc = carry
                state = self.add_fn(state, _shift(batch, i))
                data, state = self.sample_fn(state, jax.random.fold_in(key, i))
                return (state, _consume(acc, data)), None

            (state, acc), _ = jax.lax.scan(
                body, (state, jnp.float32(0)), jnp.arange(SCAN_STEPS, dtype=jnp.int32)
            )
            return state, acc

        self._scan = jax.jit(scan, donate_argnums=0)

    def jitted_sample(self):
        """``(state, key) -> (data, state)`` as a user would jit it for a per-step loop."""
        return self._sample

    def per_step(self, keys):
        add, sample, batch, state = self._add, self.jitted_sample(), self.batch, self.state
        t = _clock()
        for k in keys:
            state = add(state, batch)
            data, state = sample(state, k)
        jax.block_until_ready((state, data))
        dt = _clock() - t
        self.state = state
        return len(keys) / dt

    def fused_step(self, keys):
        fused, batch, state = self._fused, self.batch, self.state
        t = _clock()
        for k in keys:
            data, state = fused(state, batch, k)
        jax.block_until_ready((state, data))
        dt = _clock() - t
        self.state = state
        return len(keys) / dt

    def scan(self, key):
        t = _clock()
        self.state, acc = self._scan(self.state, self.batch, key)
        jax.block_until_ready((self.state, acc))
        return SCAN_STEPS / (_clock() - t)


class FunctionalRB(_Jax):
    name = "functional_rb"

    def build(self, prefill):
        import functional_rb as frb

        self.rb = frb.ReplayBuffer(capacity=CAPACITY, batch_size=BATCH)
        return self.rb.init_from_data(prefill)

    def add_fn(self, state, batch):
        return self.rb.add(state, batch)

    def sample_fn(self, state, key):
        s, state = self.rb.sample(state, key)
        return s.data, state


class FunctionalRBPerLeaf(FunctionalRB):
    """Same buffer, ``DeviceStorage(pack=False)``: one array per leaf (the default packs the
    four f32 leaves into one [1M, 25] array)."""

    name = "functional_rb (pack=False)"

    def build(self, prefill):
        import functional_rb as frb

        self.rb = frb.ReplayBuffer(
            capacity=CAPACITY, batch_size=BATCH, storage=frb.DeviceStorage(pack=False)
        )
        return self.rb.init_from_data(prefill)


class Flashbax(_Jax):
    name = "flashbax"

    def build(self, prefill):
        import flashbax as fbx

        self.buf = fbx.make_item_buffer(
            max_length=CAPACITY, min_length=1, sample_batch_size=BATCH, add_sequences=True
        )
        state = self.buf.init(jax.tree_util.tree_map(lambda x: x[0], prefill))
        add = jax.jit(self.buf.add, donate_argnums=0)
        chunk = 100_000
        for i in range(0, CAPACITY, chunk):
            state = add(state, jax.tree_util.tree_map(lambda x: x[i : i + chunk], prefill))
        return state

    def add_fn(self, state, batch):
        return self.buf.add(state, batch)

    def sample_fn(self, state, key):
        # flashbax's sample does not return a state; pass it through for the common driver.
        return self.buf.sample(state, key).experience, state

    def jitted_sample(self):
        # flashbax's own usage: a jitted sample without donation that returns only the batch.
        # Built once: a fresh jax.jit per timed block would compile inside the timing.
        if not hasattr(self, "_flashbax_sample"):
            sample = jax.jit(lambda state, key: self.buf.sample(state, key).experience)
            self._flashbax_sample = lambda state, key: (sample(state, key), state)
        return self._flashbax_sample


class BareJax(_Jax):
    """A hand-written ring buffer (dict of arrays + cursor, ``x.at[idx].set``,
    ``jax.random.randint``, ``x[idx]``), no checks: what a user would write without a library."""

    name = "bare jax (hand-written)"

    def build(self, prefill):
        return {"data": prefill, "cursor": jnp.int32(0), "size": jnp.int32(CAPACITY)}

    def add_fn(self, state, batch):
        idx = (state["cursor"] + jnp.arange(BATCH, dtype=jnp.int32)) % CAPACITY
        data = jax.tree_util.tree_map(lambda d, x: d.at[idx].set(x), state["data"], batch)
        return {
            "data": data,
            "cursor": (state["cursor"] + BATCH) % CAPACITY,
            "size": jnp.minimum(state["size"] + BATCH, CAPACITY),
        }

    def sample_fn(self, state, key):
        idx = jax.random.randint(key, (BATCH,), 0, state["size"])
        return jax.tree_util.tree_map(lambda d: d[idx], state["data"]), state


class Cpprb:
    name = "cpprb"

    def __init__(self, prefill, batch):
        import cpprb

        self.rb = cpprb.ReplayBuffer(
            CAPACITY, {"obs": {"shape": 17}, "act": {"shape": 6}, "rew": {}, "done": {}}
        )
        self.rb.add(**self._names(prefill))
        self.batch = self._names(batch)

    @staticmethod
    def _names(d):
        return {
            "obs": np.asarray(d["obs"]),
            "act": np.asarray(d["action"]),
            "rew": np.asarray(d["reward"]),
            "done": np.asarray(d["done"]),
        }

    def per_step(self, keys):
        rb, batch = self.rb, self.batch
        t = _clock()
        for _ in keys:
            rb.add(**batch)
            s = rb.sample(BATCH)
        del s
        return len(keys) / (_clock() - t)


class TorchRL:
    name = "torchrl"

    def __init__(self, prefill, batch):
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.rb = ReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=BATCH)

        def td(d):
            n = np.shape(d["reward"])[0]
            return TensorDict(
                {k: torch.as_tensor(np.asarray(v)) for k, v in d.items()}, batch_size=[n]
            )

        self.rb.extend(td(prefill))
        self.batch = td(batch)

    def per_step(self, keys):
        rb, batch = self.rb, self.batch
        keys = keys[: max(20, len(keys) // 10)]  # ~50x slower than the others: fewer steps
        t = _clock()
        for _ in keys:
            rb.extend(batch)
            s = rb.sample()
        del s
        return len(keys) / (_clock() - t)


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
            _try(FunctionalRB, prefill, batch),
            _try(FunctionalRBPerLeaf, prefill, batch),
            _try(Flashbax, prefill, batch),
            _try(BareJax, prefill, batch),
        )
        if b is not None
    ]
    host = [
        b for b in (_try(Cpprb, prefill, batch), _try(TorchRL, prefill, batch)) if b is not None
    ]
    del prefill
    keys = list(jax.random.split(jax.random.key(1), steps))
    # warm-up: compile everything and touch every code path once
    for b in jax_backends:
        b.per_step(keys[:3])
        b.fused_step(keys[:3])
        b.scan(keys[0])
    for b in host:
        b.per_step(keys[:20])
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(repeats):
        for b in jax_backends + host:  # interleaved: A B C ... A B C ...
            res.setdefault((MODE_A, b.name), []).append(b.per_step(keys))
        for b in jax_backends:
            res.setdefault((MODE_F, b.name), []).append(b.fused_step(keys))
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
