"""The buffers that ``benchmarks/w5_scale.py`` times: one class per (library, sampler), each
built and prefilled at a given size in its own process, each doing one step per ``step()``.

A step is ``add BATCH`` + ``sample`` (+ ``update`` the sampled priorities for
``prioritized``). Items (small on purpose, so that 10^8 of them fit in memory and 10^9 on disk):

* ``uniform`` / ``prioritized``: ``{obs f32[4], action f32, reward f32, done f32}`` (28 B);
  a sample is 256 items.
* ``slices``: ``{obs u8[8], next: {done bool}}`` (9 B), episodes of 50..500 steps; a sample is
  32 slices x 64 steps that never cross an episode end (flashbax's trajectory buffer ignores
  episode ends: its sequences may cross them).
* ``ted``: ``{obs f32[4], action f32, next: {obs f32[4], reward f32, done bool}}`` (41 B as
  TorchRL stores it); functional_rb's ``TEDStorage``, cpprb's ``next_of="obs"`` and flashbax's
  flat buffer (transition pairs) store each observation once; a sample is 256 transitions.

The JAX backends call jitted, donated ``add`` / ``sample`` / ``update`` once each per step (the
W1/W2 "(a)" mode); ``scan_steps(n)`` runs ``n`` steps inside one ``lax.scan`` instead (kernel
cost without dispatch). Prefill adds the same pre-generated chunk again and again (contents do
not change the timing; chunks end with an episode end, so episodes stay consistent).
"""

from __future__ import annotations

import time

import numpy as np

# each library's buffer for each sampler is backends.py's (shared with W1-W3)
from benchmarks import backends
from benchmarks.backends import ALPHA, BATCH, BETA, NUM_SLICES, SLICE_LEN, Skip  # noqa: F401

CHUNK = 1_000_000  # prefill chunk (items per add)
KEYS = 4096  # sampling keys per point, none used twice
SAMPLERS = ("uniform", "prioritized", "slices", "ted")

# bytes per stored item (data only), for the memory / disk check before a point runs
ITEM_BYTES = {"uniform": 28, "prioritized": 28, "slices": 9, "ted": 41}


# ------------------------------------------------------------------ data (NumPy)
def _episode_ends(rng, n):
    done = np.zeros(n, bool)
    ends = np.cumsum(rng.integers(50, 501, size=n // 50 + 2))
    done[ends[ends < n] - 1] = True
    done[-1] = True  # chunks are whole episodes: a repeated chunk stays consistent
    return done


def make_items(sampler: str, n: int, seed: int = 0) -> dict:
    """``n`` items of ``sampler``'s layout as NumPy arrays (nested dicts)."""
    rng = np.random.default_rng(seed)
    if sampler in ("uniform", "prioritized"):
        return {
            "obs": rng.standard_normal((n, 4), np.float32),
            "action": rng.standard_normal(n, np.float32),
            "reward": rng.standard_normal(n, np.float32),
            "done": (rng.random(n) < 0.01).astype(np.float32),
        }
    done = _episode_ends(rng, n)
    if sampler == "slices":
        return {"obs": rng.integers(0, 256, (n, 8), dtype=np.uint8), "next": {"done": done}}
    obs = rng.standard_normal((n + 1, 4), np.float32)
    nxt = obs[1:].copy()
    nxt[done] = rng.standard_normal((int(done.sum()), 4), np.float32)  # terminal observations
    return {
        "obs": obs[:n],
        "action": rng.standard_normal(n, np.float32),
        "next": {"obs": nxt, "reward": rng.standard_normal(n, np.float32), "done": done},
    }


def _take(tree, a, b):
    if isinstance(tree, dict):
        return {k: _take(v, a, b) for k, v in tree.items()}
    return tree[a:b]


def _chunks(size: int, n_chunk: int):
    """(start, stop) within the prefill chunk of each prefill add: whole chunks, then the
    remainder."""
    return [(0, min(n_chunk, size - i)) for i in range(0, size, n_chunk)]


def shifted(tree, i):
    """``tree``'s batch made different at scan step ``i`` (every number plus ``i``), its flags
    (bool leaves) left as they are: ``done + i`` would be True everywhere from the second step
    on, and a buffer fed one-step episodes samples another way (slices: every candidate too
    short, the exact fallback over all records)."""
    import jax

    return jax.tree_util.tree_map(lambda x: x if x.dtype == bool else x + i.astype(x.dtype), tree)


# ------------------------------------------------------------------ JAX backends
class _Jax:
    """Per-call and in-scan drivers over ``add_fn`` / ``sample_fn`` / ``update_fn``."""

    def __init__(self, sampler, size, memmap_dir=None):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.sampler, self.size, self.memmap_dir = sampler, size, memmap_dir
        n_chunk = min(size, CHUNK)
        chunk = make_items(sampler, n_chunk, seed=0)
        self.batch = jax.tree_util.tree_map(jnp.asarray, make_items(sampler, BATCH, seed=1))
        self.state = self.build(chunk, n_chunk)
        self.prioritized = sampler == "prioritized"
        self.add_call = jax.jit(self.add_fn, donate_argnums=0)
        self.sample_call = self.jitted_sample()
        self.update_call = jax.jit(self.update_fn, donate_argnums=0)
        # a fresh key for every step of a point (at most ~1,500 of them): cycling through a
        # few keys would draw the same rows again and again, and at 10^8 items those rows
        # would be read from the cache instead of memory, as no other library's are
        self.keys = list(jax.random.split(jax.random.key(1), KEYS))
        self.calls = 0  # scan_steps calls: each folds its own number into its keys
        self.i = 0

    # the state is donated to add and update; sample donates unless jitted_sample says not
    def jitted_sample(self):
        return self.jax.jit(self.sample_fn, donate_argnums=0)

    # when set (``time.time()`` seconds), prefill waits for each chunk and stops with Skip once
    # the chunks still to add would end past it (flashbax's prioritised add on a GPU: a
    # sequential scan per item, hours for 10^8 items)
    build_deadline: float | None = None

    def prefill(self, state, chunk, n_chunk):
        add = self.jax.jit(self.add_fn, donate_argnums=0)
        spans = _chunks(self.size, n_chunk)
        start = time.time()
        for i, (a, b) in enumerate(spans):
            state = add(state, self.chunk_for(chunk, a, b))
            if self.build_deadline is not None and i + 1 < len(spans):
                self.jax.block_until_ready(state)
                now = time.time()
                more = (now - start) / (i + 1) * (len(spans) - i - 1)
                if now + more > self.build_deadline:
                    raise Skip(
                        f"build stopped after {i + 1} of {len(spans)} chunks "
                        f"({now - start:.0f} s): ~{more:.0f} s more needed, "
                        f"{self.build_deadline - now:.0f} s left"
                    )
        self.jax.block_until_ready(state)
        return state

    def chunk_for(self, chunk, a, b):
        return self.jax.tree_util.tree_map(self.jnp.asarray, _take(chunk, a, b))

    def next_key(self):
        """The next step's sampling key (each used once in a point of up to ``KEYS`` steps)."""
        self.i += 1
        return self.keys[(self.i - 1) % KEYS]

    def step(self):
        k = self.next_key()
        self.state = self.add_call(self.state, self.batch)
        data, idx, self.state = self.sample_call(self.state, k)
        if self.prioritized:
            self.state = self.update_call(self.state, idx, data)
        self.last = data

    def block(self):
        self.jax.block_until_ready((self.state, self.last))

    def scan_steps(self, n):
        jax, jnp = self.jax, self.jnp
        if getattr(self, "_scan_n", None) != n:

            def body(carry, i):
                state, acc, key = carry
                b = shifted(self.batch, i)
                state = self.add_fn(state, b)
                data, idx, state = self.sample_fn(state, jax.random.fold_in(key, i))
                if self.prioritized:
                    state = self.update_fn(state, idx, data)
                acc = acc + sum(
                    jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(data)
                )
                return (state, acc, key), None

            def run(state, call):
                key = jax.random.fold_in(self.keys[0], call)
                (state, acc, _), _ = jax.lax.scan(
                    body, (state, jnp.float32(0), key), jnp.arange(n, dtype=jnp.int32)
                )
                return state, acc

            self._scan, self._scan_n = jax.jit(run, donate_argnums=0), n
        self.calls += 1
        self.state, self.last = self._scan(self.state, np.int32(self.calls))

    def update_fn(self, state, idx, data):
        return state

    def scan_hlo(self) -> str:
        """The compiled program of the last :meth:`scan_steps` length, as HLO text (what
        ``benchmarks/scan_kernels.py`` counts the kernels of)."""
        return self._scan.lower(self.state, np.int32(1)).compile().as_text()


def _reward_priorities(jnp, data):
    r = data["reward"] if "reward" in data else data["next"]["reward"]
    return jnp.abs(r) + 0.01


class FunctionalRB(_Jax):
    name = "functional_rb"

    def storage(self):
        import functional_rb as frb

        if self.sampler == "ted":
            return frb.TEDStorage(min_episode_len=50)
        return frb.DeviceStorage()

    def build(self, chunk, n_chunk):
        self.rb = backends.frb_buffer(self.sampler, self.size, self.storage())
        first = self.jax.tree_util.tree_map(lambda x: self.jnp.asarray(x[0]), chunk)
        return self.prefill(self.rb.init(first), chunk, n_chunk)

    def add_fn(self, state, batch):
        return self.rb.add(state, batch)

    def sample_fn(self, state, key):
        s, state = self.rb.sample(state, key)
        return s.data, s.indices, state

    def update_fn(self, state, idx, data):
        if self.sampler != "prioritized":
            return state
        return self.rb.update(state, idx, _reward_priorities(self.jnp, data))


class FunctionalRBMemmapJit(FunctionalRB):
    """Slices from a disk-backed ``MemmapStorage`` (files under ``memmap_dir``), with jitted,
    donated calls: the storage's reads and writes are host callbacks inside them."""

    name = "functional_rb MemmapStorage, jit"

    def storage(self):
        import functional_rb as frb

        if self.sampler != "slices":
            raise Skip("MemmapStorage is timed for slices only")
        return frb.MemmapStorage(self.memmap_dir)

    def scan_steps(self, n):
        raise Skip("MemmapStorage reads through host callbacks: per-call mode only")


class FunctionalRBMemmap(FunctionalRBMemmapJit):
    """The same, with the eager methods (``rb.add`` / ``rb.sample`` outside ``jax.jit``): the
    buffer's work compiled, the storage's reads and writes NumPy code between the calls
    (``functional_rb/_internal/host_calls.py``), as a program that does not jit them runs."""

    name = "functional_rb MemmapStorage"

    def step(self):
        k = self.next_key()
        self.state = self.rb.add(self.state, self.batch)
        s, self.state = self.rb.sample(self.state, k)
        self.last = s.data


class Flashbax(_Jax):
    name = "flashbax"

    def build(self, chunk, n_chunk):
        s = self.sampler
        self.buf = backends.flashbax_buffer(s, self.size)
        if s == "ted":
            chunk = self._ted_steps(chunk)
            self.batch = self._ted_steps(self.batch)
        if s == "slices":
            self.batch = self.jax.tree_util.tree_map(lambda x: x[None], self.batch)
        first = self.jax.tree_util.tree_map(lambda x: self.jnp.asarray(x[0]), chunk)
        return self.prefill(self.buf.init(first), chunk, n_chunk)

    @staticmethod
    def _ted_steps(t):
        return {
            "obs": t["obs"],
            "action": t["action"],
            "reward": t["next"]["reward"],
            "done": t["next"]["done"],
        }

    def chunk_for(self, chunk, a, b):
        c = super().chunk_for(chunk, a, b)
        return self.jax.tree_util.tree_map(lambda x: x[None], c) if self.sampler == "slices" else c

    def add_fn(self, state, batch):
        return self.buf.add(state, batch)

    def sample_fn(self, state, key):
        s = self.buf.sample(state, key)
        exp = s.experience
        if self.sampler == "prioritized":
            return exp.first, s.indices, state
        if self.sampler == "ted":
            exp = {"step": exp.first, "next_obs": exp.second["obs"]}
        return exp, self.jnp.zeros((), self.jnp.int32), state

    def jitted_sample(self):
        return backends.flashbax_sample_undonated(self.sample_fn)

    def update_fn(self, state, idx, data):
        if self.sampler != "prioritized":
            return state
        return self.buf.set_priorities(state, idx, _reward_priorities(self.jnp, data))


# ------------------------------------------------------------------ host backends
def _no_sum_tree(e: Exception) -> Skip:
    import torchrl

    return Skip(
        f"torchrl {torchrl.__version__} PrioritizedReplayBuffer: "
        f"{str(e).splitlines()[0][:100]} (its C++ extension does not load)"
    )


class TorchRL:
    name = "torchrl"

    def __init__(self, sampler, size, memmap_dir=None):
        import torch

        backends.torch_setup(threads=1, seed=0)  # faster than torch's default pool here (W3)
        self.torch, self.sampler = torch, sampler
        try:
            self.rb = backends.torchrl_buffer(sampler, size)
        except RuntimeError as e:
            if sampler != "prioritized":
                raise
            raise _no_sum_tree(e) from None
        n_chunk = min(size, CHUNK)
        chunk = make_items(sampler, n_chunk, seed=0)
        self.batch = backends.tensordict(make_items(sampler, BATCH, seed=1), BATCH)
        try:
            for a, b in _chunks(size, n_chunk):
                self.rb.extend(backends.tensordict(_take(chunk, a, b), b - a))
            self.step()
        except RuntimeError as e:  # torchrl 0.14.1 with torch 2.13: no compiled sum tree
            if sampler != "prioritized":
                raise
            raise _no_sum_tree(e) from None

    def step(self):
        self.rb.extend(self.batch)
        s = self.rb.sample()
        if self.sampler == "prioritized":
            s.set("td_error", s["reward"].abs() + 0.01)
            self.rb.update_tensordict_priority(s)
        self.last = s

    def block(self):
        pass

    def scan_steps(self, n):
        raise Skip("no lax.scan form")


class Cpprb:
    name = "cpprb"

    def __init__(self, sampler, size, memmap_dir=None):
        self.sampler = sampler
        spec = {"obs": {"shape": 4}, "action": {}, "reward": {}, "done": {}}
        self.rb = backends.cpprb_buffer(sampler, size, spec)
        n_chunk = min(size, CHUNK)
        chunk = self._names(make_items(sampler, n_chunk, seed=0))
        for a, b in _chunks(size, n_chunk):
            self.rb.add(**_take(chunk, a, b))
        self.batch = self._names(make_items(sampler, BATCH, seed=1))

    def _names(self, d):
        if self.sampler == "ted":
            return {
                "obs": d["obs"],
                "action": d["action"],
                "reward": d["next"]["reward"],
                "done": d["next"]["done"].astype(np.float32),
                "next_obs": d["next"]["obs"],
            }
        return d

    def step(self):
        self.rb.add(**self.batch)
        if self.sampler == "prioritized":
            s = self.rb.sample(BATCH, beta=BETA)
            self.rb.update_priorities(s["indexes"], np.abs(s["reward"][:, 0]) + 0.01)
        else:
            s = self.rb.sample(BATCH)
        self.last = s

    def block(self):
        pass

    def scan_steps(self, n):
        raise Skip("no lax.scan form")


BACKENDS = {
    "functional_rb": FunctionalRB,
    "functional_rb-memmap": FunctionalRBMemmap,
    "functional_rb-memmap-jit": FunctionalRBMemmapJit,
    "torchrl": TorchRL,
    "flashbax": Flashbax,
    "cpprb": Cpprb,
}
# which backends each sampler is timed with (a backend that cannot do it reports why)
DEFAULT_BACKENDS = {
    "uniform": ("functional_rb", "torchrl", "flashbax", "cpprb"),
    "prioritized": ("functional_rb", "torchrl", "flashbax", "cpprb"),
    "slices": (
        "functional_rb",
        "functional_rb-memmap",
        "functional_rb-memmap-jit",
        "torchrl",
        "flashbax",
        "cpprb",
    ),
    "ted": ("functional_rb", "torchrl", "flashbax", "cpprb"),
}


def bytes_needed(sampler: str, backend: str, size: int) -> tuple[float, float]:
    """(RAM, disk) bytes a cell needs, roughly: the stored data (twice the observations where
    TorchRL keeps TED's next observation), sampler bookkeeping, and the 1M-item prefill
    chunk."""
    item = ITEM_BYTES[sampler]
    if sampler == "ted" and backend != "torchrl":
        item -= 16
    extra = {"prioritized": 16, "slices": 4 if backend.startswith("functional_rb") else 0}
    per = item + extra.get(sampler, 0)
    if backend == "torchrl" and sampler == "slices":
        per += 40  # its SliceSampler scans the whole storage per sample (int64 temporaries)
    chunk = CHUNK * ITEM_BYTES[sampler] * 3
    if backend.startswith("functional_rb-memmap"):
        # on disk: the items and the journal's int64 write stamp per slot (its undo area is
        # sparse until a checkpoint is followed by overwrites)
        return 4.0 * size + chunk + 5e8, float((item + 8) * size)
    return per * size * 1.1 + chunk + 5e8, 0.0
