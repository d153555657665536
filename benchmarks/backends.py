"""The buffers the benchmarks time, written once per library.

For each library, how its buffer is built for a kind of workload (``uniform``,
``prioritized``, ``slices``, ``ted``): which class, with which arguments, and how it is filled.
The workloads (``w1_uniform.py``, ``w2_prioritized.py``, ``w3_slices.py``,
``scale_backends.py`` for W5, ``gpu_sections.py`` for ``gpu.py``) keep their own items and
the steps they time, and build their buffers here:

* functional_rb: :func:`frb_buffer`; :class:`FunctionalRB`, the W1 / W2 driver over it.
* flashbax: :func:`flashbax_buffer`, :func:`flashbax_fill`, :func:`flashbax_sample_undonated`
  (the jitted sample flashbax's users write); :class:`Flashbax`, the W1 / W2 driver.
* cpprb: :func:`cpprb_buffer`; :class:`Cpprb`, the W1 / W2 loop.
* TorchRL: :func:`torchrl_buffer`, :func:`tensordict` (NumPy items as a ``TensorDict``).
* :class:`JaxDriver`: W1's and W2's timing of a JAX buffer: (a) one jitted, donated call per
  ``add`` / ``sample`` [/ ``update``] from a Python loop, (a') one fused jitted step per call,
  (b) ``scan_steps`` steps in one ``lax.scan``.

JAX is imported inside the functions: ``gpu.py``'s children pick their device before JAX is
imported, and ``scale_backends.py`` imports this module first.
"""

from __future__ import annotations

import os
import time

import numpy as np

BATCH = 256  # items per add and per sample (W1, W2, W5)
NUM_SLICES, SLICE_LEN = 32, 64  # a slice sample: 32 slices of 64 steps (W3, W5)
ALPHA, BETA = 0.6, 0.4  # prioritized replay's exponents (W2, W5)
SCAN_STEPS = 1000  # steps in one lax.scan, mode (b)
FILL_CHUNK = 100_000  # items per add when a peer's buffer is filled


class Skip(Exception):
    """This cell cannot run (a missing library, a broken extension, not supported): the
    message says why; the driver reports it instead of a number."""


def clock_fn():
    """The clock the timings read: wall time, or process CPU time with
    ``FRB_BENCH_CLOCK=cpu`` (on a shared, overloaded machine this shows what a step costs
    rather than how long it waited for a core)."""
    return time.process_time if os.environ.get("FRB_BENCH_CLOCK") == "cpu" else time.perf_counter


def consume(acc, data):
    """Sum every sampled leaf into a scalar so that no gather is dead code."""
    import jax
    import jax.numpy as jnp

    return acc + sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(data))


def shift(batch, i):
    """A different batch each scan step (cheap), so the adds are not loop-invariant."""
    import jax
    import jax.numpy as jnp

    f = i.astype(jnp.float32)
    return jax.tree_util.tree_map(lambda x: x + f, batch)


def priorities(reward):
    """New priorities from the sampled data (stand-in for |TD error|)."""
    import jax.numpy as jnp

    return jnp.abs(reward) + 0.01


def _rows(tree, a, b, time_axis=False):
    """Rows ``a:b`` of every leaf (NumPy); with ``time_axis`` as one row of a ``[1, T]``
    trajectory, on the device."""
    import jax
    import jax.numpy as jnp

    if time_axis:
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x[None, a:b]), tree)
    return jax.tree_util.tree_map(lambda x: x[a:b], tree)


# ------------------------------------------------------------------ functional_rb
def frb_buffer(kind: str, capacity: int, storage=None):
    """functional_rb's ``ReplayBuffer`` for ``kind``: ``RandomSampler`` (uniform, ted),
    ``PrioritizedSampler(ALPHA, BETA)``, or ``SliceSampler(SLICE_LEN)`` (batches of
    ``NUM_SLICES * SLICE_LEN`` steps); ``storage``: the default ``DeviceStorage()`` if None."""
    import functional_rb as frb

    if kind == "prioritized":
        sampler, batch = frb.PrioritizedSampler(alpha=ALPHA, beta=BETA), BATCH
    elif kind == "slices":
        sampler, batch = frb.SliceSampler(slice_len=SLICE_LEN), NUM_SLICES * SLICE_LEN
    else:
        sampler, batch = frb.RandomSampler(), BATCH
    storage = frb.DeviceStorage() if storage is None else storage
    return frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=batch, storage=storage)


# ------------------------------------------------------------------ flashbax
def flashbax_buffer(kind: str, capacity: int):
    """flashbax's buffer for ``kind``: the item buffer (uniform), the prioritised flat buffer
    (its sample draws transition pairs), the trajectory buffer (slices: one row, sequences of
    ``SLICE_LEN`` that ignore episode ends) or the flat buffer (ted: transition pairs)."""
    import flashbax as fbx

    if kind == "uniform":
        return fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=BATCH, add_sequences=True
        )
    if kind == "prioritized":
        return fbx.make_prioritised_flat_buffer(
            max_length=capacity,
            min_length=2,
            sample_batch_size=BATCH,
            add_sequences=True,
            priority_exponent=ALPHA,
        )
    if kind == "slices":
        return fbx.make_trajectory_buffer(
            add_batch_size=1,
            sample_batch_size=NUM_SLICES,
            sample_sequence_length=SLICE_LEN,
            period=1,
            min_length_time_axis=SLICE_LEN,
            max_size=capacity,
        )
    return fbx.make_flat_buffer(
        max_length=capacity, min_length=2, sample_batch_size=BATCH, add_sequences=True
    )


def flashbax_fill(buf, data, n: int, time_axis: bool = False):
    """``buf.init`` from ``data``'s first item, then the first ``n`` items of ``data`` added
    ``FILL_CHUNK`` at a time by a jitted, donated ``add`` (``time_axis``: as one row of a
    trajectory buffer). Returns ``(state, the jitted add)``."""
    import jax
    import jax.numpy as jnp

    state = buf.init(jax.tree_util.tree_map(lambda x: jnp.asarray(x[0]), data))
    add = jax.jit(buf.add, donate_argnums=0)
    for a in range(0, n, FILL_CHUNK):
        state = add(state, _rows(data, a, a + FILL_CHUNK, time_axis))
    return state, add


def flashbax_sample_undonated(sample_fn):
    """flashbax's own usage: its sample jitted without donation (it returns no state), the
    batch only. ``sample_fn(state, key) -> (*outputs, state)``; the result has the same
    signature, the state handed back as it came, for the common drivers."""
    import jax

    sample = jax.jit(lambda state, key: sample_fn(state, key)[:-1])
    return lambda state, key: (*sample(state, key), state)


# ------------------------------------------------------------------ cpprb
def cpprb_buffer(kind: str, capacity: int, spec: dict):
    """cpprb's buffer for ``kind``: ``PrioritizedReplayBuffer(alpha=ALPHA)``, a
    ``ReplayBuffer(next_of="obs")`` (ted: each observation stored once) or a plain
    ``ReplayBuffer``; slices: :class:`Skip` (cpprb has no sub-trajectory sampler)."""
    import cpprb

    if kind == "slices":
        raise Skip("cpprb has no slice (sub-trajectory) sampler")
    if kind == "prioritized":
        return cpprb.PrioritizedReplayBuffer(capacity, spec, alpha=ALPHA, eps=1e-8)
    if kind == "ted":
        return cpprb.ReplayBuffer(capacity, spec, next_of="obs")
    return cpprb.ReplayBuffer(capacity, spec)


# ------------------------------------------------------------------ TorchRL
def torch_setup(threads: int = 1, seed: int = 0) -> None:
    """One intra-op thread (on a small shared machine torch's default pool oversubscribes the
    cores: TorchRL's slice sampling ran ~30x slower) and a fixed seed."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)


def tensordict(d: dict, n: int):
    """NumPy items ``d`` (nested dicts, leading axis ``n``) as a ``TensorDict`` sharing their
    memory; 1-D bool flags become ``[n, 1]``, as TorchRL keeps them."""
    import torch
    from tensordict import TensorDict

    def conv(v):
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        t = torch.from_numpy(np.ascontiguousarray(v))
        return t[:, None] if t.ndim == 1 and t.dtype == torch.bool else t

    return TensorDict(conv(d), [n])


def torchrl_buffer(kind: str, capacity: int, cache_values: bool = False):
    """TorchRL's buffer over a ``LazyTensorStorage(capacity)`` for ``kind``: a
    ``ReplayBuffer`` (uniform), a ``TensorDictPrioritizedReplayBuffer`` (its priorities under
    ``"td_error"``), a ``TensorDictReplayBuffer`` with a ``SliceSampler`` (episode ends at
    ``("next", "done")``; ``cache_values``: TorchRL's cache of them, valid for static data) or
    without (ted). The storage class is looked up when called (``gpu.py`` points it at the
    GPU)."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

    if kind == "prioritized":
        from torchrl.data import TensorDictPrioritizedReplayBuffer

        return TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA,
            beta=BETA,
            priority_key="td_error",
            batch_size=BATCH,
            storage=LazyTensorStorage(capacity),
        )
    if kind == "slices":
        from torchrl.data import SliceSampler

        return TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=SliceSampler(
                slice_len=SLICE_LEN, end_key=("next", "done"), cache_values=cache_values
            ),
            batch_size=NUM_SLICES * SLICE_LEN,
        )
    if kind == "ted":
        return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=BATCH)
    return ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=BATCH)


# ------------------------------------------------------------------ W1 / W2 drivers
class JaxDriver:
    """W1's and W2's timing of a JAX buffer, over a subclass's pure ``build`` / ``add_fn`` /
    ``sample_fn`` [/ ``update_fn``].

    Uniform (``prios`` None, W1): ``sample_fn(state, key) -> (data, state)``; a step is add +
    sample. Prioritized (``prios`` given, W2): ``sample_fn(state, key) -> (data, indices,
    weights, state)``, ``update_fn(state, indices, priorities) -> state``; a step is add +
    sample + update of the sampled priorities (from the sampled rewards). Timings: steps per
    second of :meth:`per_call` (mode (a)), :meth:`fused` (a') and :meth:`scan` (b).
    """

    name = "?"
    scans = True  # also measured in mode (b)
    shift = staticmethod(shift)  # each scan step's batch (gpu.py's frames keep their dtypes)

    def __init__(self, capacity, prefill, batch, prios=None, *, scan_steps=SCAN_STEPS):
        import jax
        import jax.numpy as jnp

        self.cap, self.scan_steps, self.prioritized = capacity, scan_steps, prios is not None
        self.batch = jax.tree_util.tree_map(jnp.asarray, batch)
        if self.prioritized:
            self.state = self.build(prefill, jnp.asarray(prios))
            self._update = jax.jit(
                lambda s, i, r: self.update_fn(s, i, priorities(r)), donate_argnums=0
            )
        else:
            self.state = self.build(prefill)
        self._add = jax.jit(self.add_fn, donate_argnums=0)
        self._sample = jax.jit(self.sample_fn, donate_argnums=0)
        self._fused = jax.jit(self.step_fn, donate_argnums=0)
        self._scan = jax.jit(self.scan_fn, donate_argnums=0)

    def update_fn(self, state, idx, prios):
        return state

    def jitted_sample(self):
        """``(state, key) -> (..., state)`` as a user would jit it for a per-step loop."""
        return self._sample

    def step_fn(self, state, batch, key):
        """One step as one function: ``(data, state)``, or ``(state, data, weights)``."""
        state = self.add_fn(state, batch)
        if not self.prioritized:
            data, state = self.sample_fn(state, key)
            return data, state
        data, idx, w, state = self.sample_fn(state, key)
        state = self.update_fn(state, idx, priorities(data["reward"]))
        return state, data, w

    def scan_fn(self, state, batch, key):
        """``scan_steps`` steps in one ``lax.scan``, every sampled leaf (and the weights) summed
        into the carry so that XLA cannot drop the gathers."""
        import jax
        import jax.numpy as jnp

        def body(carry, i):
            state, acc = carry
            if self.prioritized:
                state, data, w = self.step_fn(
                    state, self.shift(batch, i), jax.random.fold_in(key, i)
                )
                return (state, consume(acc, data) + jnp.sum(w)), None
            state = self.add_fn(state, self.shift(batch, i))
            data, state = self.sample_fn(state, jax.random.fold_in(key, i))
            return (state, consume(acc, data)), None

        (state, acc), _ = jax.lax.scan(
            body, (state, jnp.float32(0)), jnp.arange(self.scan_steps, dtype=jnp.int32)
        )
        return state, acc

    def per_call(self, keys):
        """Mode (a): a jitted, donated ``add``, ``sample`` [and ``update``] per step."""
        import jax

        add, sample, batch, state = self._add, self.jitted_sample(), self.batch, self.state
        clock = clock_fn()
        if self.prioritized:
            update = self._update
            t = clock()
            for k in keys:
                state = add(state, batch)
                data, idx, w, state = sample(state, k)
                state = update(state, idx, data["reward"])
            jax.block_until_ready((state, data, w))
        else:
            t = clock()
            for k in keys:
                state = add(state, batch)
                data, state = sample(state, k)
            jax.block_until_ready((state, data))
        dt = clock() - t
        self.state = state
        return len(keys) / dt

    def fused(self, keys):
        """Mode (a'): one jitted (donated) step function per step."""
        import jax

        fused, batch, state = self._fused, self.batch, self.state
        clock = clock_fn()
        if self.prioritized:
            t = clock()
            for k in keys:
                state, data, w = fused(state, batch, k)
            jax.block_until_ready((state, data, w))
        else:
            t = clock()
            for k in keys:
                data, state = fused(state, batch, k)
            jax.block_until_ready((state, data))
        dt = clock() - t
        self.state = state
        return len(keys) / dt

    def scan(self, key):
        """Mode (b): ``scan_steps`` steps in one call."""
        import jax

        clock = clock_fn()
        t = clock()
        self.state, acc = self._scan(self.state, self.batch, key)
        jax.block_until_ready((self.state, acc))
        return self.scan_steps / (clock() - t)


class FunctionalRB(JaxDriver):
    """functional_rb's buffer (:func:`frb_buffer`), prefilled by ``init_from_data``; W2's
    priorities set for every item."""

    name = "functional_rb"

    def storage(self):
        return None  # DeviceStorage(): the leaves of one dtype packed into one array

    def build(self, prefill, prios=None):
        import jax.numpy as jnp

        kind = "uniform" if prios is None else "prioritized"
        self.rb = frb_buffer(kind, self.cap, self.storage())
        state = self.rb.init_from_data(prefill)
        if prios is None:
            return state
        return self.rb.update(state, jnp.arange(self.cap, dtype=jnp.int32), prios)

    def add_fn(self, state, batch):
        return self.rb.add(state, batch)

    def sample_fn(self, state, key):
        s, state = self.rb.sample(state, key)
        if self.prioritized:
            return s.data, s.indices, s.weights, state
        return s.data, state

    def update_fn(self, state, idx, prios):
        return self.rb.update(state, idx, prios)


class Flashbax(JaxDriver):
    """flashbax's item buffer (W1) or prioritised flat buffer (W2), filled ``FILL_CHUNK`` items
    at a time. W1's per-call mode jits its sample as flashbax's users do (no donation, the batch
    only); W2's jits and donates it as every JAX backend's."""

    name = "flashbax"

    def build(self, prefill, prios=None):
        import jax
        import jax.numpy as jnp

        self.buf = flashbax_buffer("uniform" if prios is None else "prioritized", self.cap)
        state, _ = flashbax_fill(self.buf, prefill, self.cap)
        if prios is None:
            return state
        # flashbax keeps one row ([1, capacity]); its item indices are the time positions.
        return jax.jit(self.buf.set_priorities, donate_argnums=0)(
            state, jnp.arange(self.cap - 1, dtype=jnp.int32), prios[:-1]
        )

    def add_fn(self, state, batch):
        return self.buf.add(state, batch)

    def sample_fn(self, state, key):
        import jax.numpy as jnp

        s = self.buf.sample(state, key)
        if not self.prioritized:
            # flashbax's sample does not return a state; pass it through for the driver.
            return s.experience, state
        # Importance weights as a flashbax user computes them (it returns probabilities only).
        w = (jnp.float32(self.cap) * s.probabilities) ** -BETA
        w = w / jnp.max(w)
        return s.experience.first, s.indices, w, state

    def update_fn(self, state, idx, prios):
        return self.buf.set_priorities(state, idx, prios)

    def jitted_sample(self):
        if self.prioritized:
            return super().jitted_sample()
        # Built once: a fresh jax.jit per timed block would compile inside the timing.
        if not hasattr(self, "_flashbax_sample"):
            self._flashbax_sample = flashbax_sample_undonated(self.sample_fn)
        return self._flashbax_sample


class Cpprb:
    """cpprb's ``ReplayBuffer`` (W1) or ``PrioritizedReplayBuffer`` (W2) of W1's items, filled
    ``FILL_CHUNK`` items at a time; a step is its ``add`` + ``sample`` [+
    ``update_priorities``], three library calls either way (nothing to fuse: :meth:`fused`
    repeats :meth:`per_call`)."""

    name = "cpprb"
    SPEC = {"obs": {"shape": 17}, "action": {"shape": 6}, "reward": {}, "done": {}}

    def __init__(self, capacity, prefill, batch, prios=None):
        self.prioritized = prios is not None
        self.rb = cpprb_buffer(
            "prioritized" if self.prioritized else "uniform", capacity, self.SPEC
        )
        for a in range(0, capacity, FILL_CHUNK):
            rows = {k: np.asarray(v[a : a + FILL_CHUNK]) for k, v in prefill.items()}
            if self.prioritized:
                rows["priorities"] = prios[a : a + FILL_CHUNK]
            self.rb.add(**rows)
        self.batch = {k: np.asarray(v) for k, v in batch.items()}

    def per_call(self, keys):
        rb, batch = self.rb, self.batch
        clock = clock_fn()
        if self.prioritized:
            t = clock()
            for _ in keys:
                rb.add(**batch)
                s = rb.sample(BATCH, beta=BETA)
                rb.update_priorities(s["indexes"], np.abs(s["reward"][:, 0]) + 0.01)
            return len(keys) / (clock() - t)
        t = clock()
        for _ in keys:
            rb.add(**batch)
            s = rb.sample(BATCH)
        del s
        return len(keys) / (clock() - t)

    fused = per_call  # three library calls per step either way: nothing to fuse
