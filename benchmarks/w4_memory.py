"""W4 memory: Atari-like TED items, observation uint8[84, 84] with 4-frame stacks, capacity 100k.

Bytes stored per step (lower is better) for
  - functional_rb ``TEDStorage(frame_stack=4, min_episode_len=100)``: single frames stored once,
    stacks and next observations rebuilt at sample time; ALL state leaves (frame table with its
    side table, pending and pre-history rows, every other field, pointers, sampler/writer) /
    capacity, measured with ``jax.eval_shape(rb.init, item)`` (exact state shapes, nothing
    allocated);
  - functional_rb ``DeviceStorage`` holding the full TED items (stacked obs + stacked next obs);
  - flashbax ``make_flat_buffer``: stores each timestep (the stacked observation) once and pairs
    it with the following timestep; ``jax.eval_shape`` of its ``init`` at capacity 100k;
  - TorchRL ``LazyTensorStorage`` holding TED items (stacked obs + stacked next obs): measured
    after one ``extend`` at capacity 1,000 (tensor bytes / capacity; 100k would be 5.6 GB);
  - cpprb ``ReplayBuffer(next_of="obs", stack_compress="obs")`` is not in the table: neither
    ``tracemalloc`` nor the process RSS sees its buffers (both report < 400 B/step after
    filling 20,000 stacked steps, which cannot hold the frames), so no honest number is given;
next to the minimum, one frame (7056 B) per step.

Sampling throughput (higher is better): sample 32 items (stacked obs + stacked next obs and the
other fields) from the TED storage vs from a ``DeviceStorage`` holding the full stacks, both
jitted, ``SCAN`` samples per call inside ``lax.scan`` with every leaf summed into the carry,
interleaved A B A B, medians. Capacity 10,000 for this part (the full-stack buffer at 100k
would need 5.6 GB), filled with episodes of 50..400 steps.

Usage: ``python benchmarks/w4_memory.py [--quick]``; ``run(quick)`` returns the rows.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))  # after site-packages: an installed functional_rb wins

import functional_rb as frb  # noqa: E402

CAPACITY = 100_000
FRAME = (84, 84)
K = 4
FRAME_BYTES = int(np.prod(FRAME))
MIN_ROW = "one frame (minimum)"
PLAIN = "frb DeviceStorage (full stacks)"
REFERENCES = (MIN_ROW, PLAIN)
MODE_MEM = "bytes stored per step (lower is better)"
MODE_SAMPLE = "sample 32 (stacked obs + next), samples/s"


def _ted_item(stacked: bool):
    shape = (K,) + FRAME if stacked else FRAME
    return {
        "observation": jnp.zeros(shape, jnp.uint8),
        "action": jnp.zeros((), jnp.int32),
        "done": jnp.zeros((1,), bool),
        "terminated": jnp.zeros((1,), bool),
        "truncated": jnp.zeros((1,), bool),
        "next": {"observation": jnp.zeros(shape, jnp.uint8), "reward": jnp.zeros((1,), jnp.float32),
                 "done": jnp.zeros((1,), bool), "terminated": jnp.zeros((1,), bool),
                 "truncated": jnp.zeros((1,), bool)},
    }


def _state_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def _ted_rb(capacity, batch=32):
    return frb.ReplayBuffer(capacity=capacity, batch_size=batch,
                            storage=frb.TEDStorage(frame_stack=K, min_episode_len=100))


def memory_rows():
    rows = [dict(mode=MODE_MEM, backend=MIN_ROW, value=FRAME_BYTES, unit="B/step")]
    ted = _ted_rb(CAPACITY)
    rows.append(dict(mode=MODE_MEM, backend="frb TEDStorage (frame_stack=4)", unit="B/step",
                     value=_state_bytes(jax.eval_shape(ted.init, _ted_item(False))) / CAPACITY))
    plain = frb.ReplayBuffer(capacity=CAPACITY)
    rows.append(dict(mode=MODE_MEM, backend=PLAIN, unit="B/step",
                     value=_state_bytes(jax.eval_shape(plain.init, _ted_item(True))) / CAPACITY))
    try:
        import flashbax as fbx
        buf = fbx.make_flat_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=32,
                                   add_batch_size=1)
        ts = {"observation": jnp.zeros((K,) + FRAME, jnp.uint8), "action": jnp.int32(0),
              "reward": jnp.float32(0), "done": jnp.bool_(False)}
        st = jax.eval_shape(buf.init, ts)
        rows.append(dict(mode=MODE_MEM, backend="flashbax flat buffer", unit="B/step",
                         value=_state_bytes(st) / CAPACITY))
    except Exception as e:  # pragma: no cover - optional peer
        print(f"flashbax skipped: {e!r}", file=sys.stderr)
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage
        cap = 1000
        storage = LazyTensorStorage(cap)
        b = 8
        td = TensorDict({
            "observation": torch.zeros(b, K, *FRAME, dtype=torch.uint8),
            "action": torch.zeros(b, dtype=torch.int32),
            "done": torch.zeros(b, 1, dtype=torch.bool),
            "terminated": torch.zeros(b, 1, dtype=torch.bool),
            "truncated": torch.zeros(b, 1, dtype=torch.bool),
            "next": {"observation": torch.zeros(b, K, *FRAME, dtype=torch.uint8),
                     "reward": torch.zeros(b, 1), "done": torch.zeros(b, 1, dtype=torch.bool),
                     "terminated": torch.zeros(b, 1, dtype=torch.bool),
                     "truncated": torch.zeros(b, 1, dtype=torch.bool)}}, [b])
        storage.set(torch.arange(b), td)
        nbytes = sum(t.numel() * t.element_size()
                     for t in storage._storage.values(True, True))
        rows.append(dict(mode=MODE_MEM, backend="TorchRL LazyTensorStorage (TED)", unit="B/step",
                         value=nbytes / cap, note="capacity 1,000, scaled per step"))
    except Exception as e:  # pragma: no cover
        print(f"torchrl skipped: {e!r}", file=sys.stderr)
    return rows


def _episodes(rng, n):
    """Single frames and TED fields for n consecutive steps, episodes of 50..400 steps."""
    done = np.zeros(n, bool)
    t = 0
    while True:
        t += int(rng.integers(50, 400))
        if t >= n:
            break
        done[t - 1] = True
    obs = rng.integers(0, 255, (n,) + FRAME, dtype=np.uint8)
    nxt = np.roll(obs, -1, axis=0)
    nxt[done] = rng.integers(0, 255, (int(done.sum()),) + FRAME, dtype=np.uint8)
    nxt[-1] = rng.integers(0, 255, FRAME, dtype=np.uint8)
    z = np.zeros((n, 1), bool)
    return obs, nxt, done


def _stacks(obs, nxt, done):
    """Naive full stacks (FrameStack wrapper semantics, first frame repeated at starts)."""
    n = obs.shape[0]
    start = np.zeros(n, np.int64)
    s = 0
    for t in range(n):
        if t > 0 and done[t - 1]:
            s = t
        start[t] = s
    j = np.arange(K - 1, -1, -1)
    src = np.maximum(np.arange(n)[:, None] - j[None, :], start[:, None])
    so = obs[src]
    sn = np.concatenate([so[:, 1:], nxt[:, None]], axis=1)
    return so, sn


def _items(obs, nxt, done, rng):
    n = obs.shape[0]
    z = np.zeros((n, 1), bool)
    return {"observation": obs, "action": rng.integers(0, 6, n).astype(np.int32),
            "done": z, "terminated": z, "truncated": z,
            "next": {"observation": nxt, "reward": rng.normal(size=(n, 1)).astype(np.float32),
                     "done": done[:, None], "terminated": done[:, None], "truncated": z}}


def _sampler_fn(rb, scan):
    def many(state, key):
        def body(carry, k):
            s, _ = rb.sample(state, k)
            tot = sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(s.data))
            return carry + tot, None
        out, _ = jax.lax.scan(body, jnp.float32(0), jax.random.split(key, scan))
        return out
    return jax.jit(many)


def sample_rows(quick: bool):
    cap = 2_000 if quick else 10_000
    scan = 50 if quick else 200
    rounds = 3 if quick else 7
    rng = np.random.default_rng(0)
    obs, nxt, done = _episodes(rng, cap)
    single = _items(obs, nxt, done, rng)
    so, sn = _stacks(obs, nxt, done)
    stacked = dict(single, observation=so, next=dict(single["next"], observation=sn))
    ted = _ted_rb(cap)
    plain = frb.ReplayBuffer(capacity=cap, batch_size=32)
    st_t = ted.init(jax.tree_util.tree_map(lambda x: x[0], single))
    st_p = plain.init(jax.tree_util.tree_map(lambda x: x[0], stacked))
    chunk = 1000
    add_t, add_p = jax.jit(ted.add, donate_argnums=0), jax.jit(plain.add, donate_argnums=0)
    for a in range(0, cap, chunk):
        st_t = add_t(st_t, jax.tree_util.tree_map(lambda x: x[a:a + chunk], single))
        st_p = add_p(st_p, jax.tree_util.tree_map(lambda x: x[a:a + chunk], stacked))
    # Same key, same indices: the two samples must agree (checked once, outside timing).
    s1, _ = ted.sample(st_t, jax.random.key(1))
    s2, _ = plain.sample(st_p, jax.random.key(1))
    for x, y in zip(jax.tree_util.tree_leaves(s1.data), jax.tree_util.tree_leaves(s2.data)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "TED sample differs from plain"
    fns = {"frb TEDStorage (frame_stack=4)": (_sampler_fn(ted, scan), st_t),
           PLAIN: (_sampler_fn(plain, scan), st_p)}
    times = {k: [] for k in fns}
    key = jax.random.key(0)
    for name, (f, st) in fns.items():
        f(st, key).block_until_ready()
    for r in range(rounds):
        for name, (f, st) in fns.items():
            t0 = time.perf_counter()
            f(st, jax.random.fold_in(key, r)).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return [dict(mode=MODE_SAMPLE, backend=name, unit="samples/s",
                 value=scan / statistics.median(ts), note=f"capacity {cap:,}")
            for name, ts in times.items()]


def run(quick: bool = False):
    return memory_rows() + sample_rows(quick)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sampling buffer, fewer rounds")
    args = p.parse_args()
    from benchmarks.run import table
    print(table(run(args.quick), REFERENCES))


if __name__ == "__main__":
    main()
