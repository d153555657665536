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
  - cpprb ``ReplayBuffer(next_of="obs", stack_compress="obs")`` (obs ``uint8[84, 84, 4]``, the
    stack axis last as cpprb requires): its memory depends on the data (it caches full stacked
    obs / next obs of the steps around each episode end), so it is measured, not computed: in a
    fresh subprocess (numpy + cpprb only), resident set size (``/proc/self/statm``) before
    building the buffer and after filling all 100k steps (FrameStack-style stacks of random
    frames, episodes of 50..400 steps, ``on_episode_end`` after each), with every input array
    allocated and touched before the first reading; growth / capacity. Cross-checks, in the
    same child: the bytes of the arrays cpprb itself holds (reached with ``gc.get_referents``,
    views resolved to the arrays owning their memory, each counted once) must agree within
    5%, and stored stacks read back through cpprb must equal the frames fed. The method is
    calibrated by a plain numpy frame array of known size ``(capacity + 3) * 7056`` B, filled
    by the same loop in another fresh subprocess (linux only: skipped elsewhere);
next to the minimum, one frame (7056 B) per step.

Sampling throughput (higher is better): sample 32 items (stacked obs + stacked next obs and the
other fields) from the TED storage vs from a ``DeviceStorage`` holding the full stacks, both
jitted, ``SCAN`` samples per call inside ``lax.scan`` with every leaf summed into the carry,
interleaved A B A B, medians. Capacity 10,000 for this part (the full-stack buffer at 100k
would need 5.6 GB), filled with episodes of 50..400 steps.

Usage: ``python benchmarks/w4_memory.py [--quick] [--memory-only]``; ``run(quick)`` returns the
rows (``--memory-only``: the byte counts, no timing).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap
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
        "next": {
            "observation": jnp.zeros(shape, jnp.uint8),
            "reward": jnp.zeros((1,), jnp.float32),
            "done": jnp.zeros((1,), bool),
            "terminated": jnp.zeros((1,), bool),
            "truncated": jnp.zeros((1,), bool),
        },
    }


def _state_bytes(tree) -> int:
    return sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
    )


def _ted_rb(capacity, batch=32):
    return frb.ReplayBuffer(
        capacity=capacity,
        batch_size=batch,
        storage=frb.TEDStorage(frame_stack=K, min_episode_len=100),
    )


def memory_rows():
    rows = [dict(mode=MODE_MEM, backend=MIN_ROW, value=FRAME_BYTES, unit="B/step")]
    ted = _ted_rb(CAPACITY)
    rows.append(
        dict(
            mode=MODE_MEM,
            backend="frb TEDStorage (frame_stack=4)",
            unit="B/step",
            value=_state_bytes(jax.eval_shape(ted.init, _ted_item(False))) / CAPACITY,
        )
    )
    plain = frb.ReplayBuffer(capacity=CAPACITY)
    rows.append(
        dict(
            mode=MODE_MEM,
            backend=PLAIN,
            unit="B/step",
            value=_state_bytes(jax.eval_shape(plain.init, _ted_item(True))) / CAPACITY,
        )
    )
    try:
        import flashbax as fbx

        buf = fbx.make_flat_buffer(
            max_length=CAPACITY, min_length=1, sample_batch_size=32, add_batch_size=1
        )
        ts = {
            "observation": jnp.zeros((K,) + FRAME, jnp.uint8),
            "action": jnp.int32(0),
            "reward": jnp.float32(0),
            "done": jnp.bool_(False),
        }
        st = jax.eval_shape(buf.init, ts)
        rows.append(
            dict(
                mode=MODE_MEM,
                backend="flashbax flat buffer",
                unit="B/step",
                value=_state_bytes(st) / CAPACITY,
            )
        )
    except Exception as e:  # pragma: no cover - optional peer
        print(f"flashbax skipped: {e!r}", file=sys.stderr)
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage

        cap = 1000
        storage = LazyTensorStorage(cap)
        b = 8
        td = TensorDict(
            {
                "observation": torch.zeros(b, K, *FRAME, dtype=torch.uint8),
                "action": torch.zeros(b, dtype=torch.int32),
                "done": torch.zeros(b, 1, dtype=torch.bool),
                "terminated": torch.zeros(b, 1, dtype=torch.bool),
                "truncated": torch.zeros(b, 1, dtype=torch.bool),
                "next": {
                    "observation": torch.zeros(b, K, *FRAME, dtype=torch.uint8),
                    "reward": torch.zeros(b, 1),
                    "done": torch.zeros(b, 1, dtype=torch.bool),
                    "terminated": torch.zeros(b, 1, dtype=torch.bool),
                    "truncated": torch.zeros(b, 1, dtype=torch.bool),
                },
            },
            [b],
        )
        storage.set(torch.arange(b), td)
        nbytes = sum(t.numel() * t.element_size() for t in storage._storage.values(True, True))
        rows.append(
            dict(
                mode=MODE_MEM,
                backend="TorchRL LazyTensorStorage (TED)",
                unit="B/step",
                value=nbytes / cap,
                note="capacity 1,000, scaled per step",
            )
        )
    except Exception as e:  # pragma: no cover
        print(f"torchrl skipped: {e!r}", file=sys.stderr)
    try:
        rows.append(_cpprb_row(CAPACITY))
    except Exception as e:  # pragma: no cover - optional peer, linux-only measurement
        print(f"cpprb skipped: {e!r}", file=sys.stderr)
    return rows


def _fill_and_measure(kind: str, capacity: int, k: int, frame: tuple, seed: int) -> dict:
    """Child process body (run by :func:`_measure_in_child`; imports only numpy and cpprb).

    ``kind="cpprb"``: a cpprb buffer with ``next_of`` + ``stack_compress``; ``kind="numpy"``:
    the calibration, one ``uint8[capacity + k - 1, *frame]`` array. Both are filled by the same
    loop over ``capacity`` FrameStack-style steps. Returns the resident-set growth, the bytes
    of the arrays the buffer holds, and (cpprb) how many checked stacks differ from those fed.
    """
    import gc
    import os

    import numpy as np

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def held_bytes(root):
        # Bytes of the arrays reachable from `root` through containers and cpprb objects,
        # each view resolved to the array that owns its memory, every owner counted once.
        seen, owners, total, todo = set(), set(), 0, [root]
        while todo:
            o = todo.pop()
            if isinstance(o, np.ndarray):
                b = o
                while getattr(b, "base", None) is not None:
                    b = b.base
                if isinstance(b, np.ndarray) and id(b) not in owners:
                    owners.add(id(b))
                    total += b.nbytes
                continue
            if id(o) in seen:
                continue
            seen.add(id(o))
            if isinstance(o, (dict, list, tuple)) or type(o).__module__.startswith("cpprb"):
                todo.extend(gc.get_referents(o))
        return total

    rng = np.random.default_rng(seed)
    pool_n = 256
    pool = rng.integers(0, 255, (pool_n,) + tuple(frame), dtype=np.uint8)
    lens = rng.integers(50, 400, capacity // 50 + 2)
    # Pool ids of each step's obs stack, then of its next frame. np.full writes every page
    # now (np.zeros would map them lazily and count them as growth below).
    ids = np.full((capacity, k + 1), -1, np.int64)
    win = np.zeros(k, np.int64)
    st = np.zeros(tuple(frame) + (k,), np.uint8)
    nx = np.zeros_like(st)
    gc.collect()
    before = rss()
    if kind == "numpy":
        buf = np.empty((capacity + k - 1,) + tuple(frame), np.uint8)
    else:
        import cpprb

        buf = cpprb.ReplayBuffer(
            capacity,
            {
                "obs": {"shape": tuple(frame) + (k,), "dtype": np.uint8},
                "act": {"dtype": np.int32},
                "rew": {},
                "done": {},
            },
            next_of="obs",
            stack_compress="obs",
        )
    ep = t_ep = f = 0
    for t in range(capacity):
        if t_ep == 0:  # reset: the first frame fills the stack
            win[:] = f % pool_n
            f += 1
        nxt_id = f % pool_n
        f += 1
        ids[t, :k], ids[t, k] = win, nxt_id
        st[...] = np.moveaxis(pool[win], 0, -1)
        nx[..., :-1], nx[..., -1] = st[..., 1:], pool[nxt_id]
        done = t_ep == lens[ep] - 1
        if kind == "numpy":
            buf[t] = pool[win[-1]]
        else:
            buf.add(obs=st, act=1, rew=0.5, next_obs=nx, done=float(done))
        win[:-1], win[-1] = win[1:], nxt_id
        t_ep += 1
        if done:
            if kind != "numpy":
                buf.on_episode_end()
            ep, t_ep = ep + 1, 0
    if kind == "numpy":
        buf[capacity:] = pool[: k - 1]
    gc.collect()
    grown = rss() - before
    out = dict(
        kind=kind,
        capacity=capacity,
        rss_growth=grown,
        held=held_bytes(buf),
        episodes=ep,
        checked=0,
        mismatches=0,
    )
    if kind != "numpy":
        # Episode ends, their successors (starts) and a spread of other steps.
        ends = np.flatnonzero(np.isin(np.arange(capacity), np.cumsum(lens) - 1))
        check = np.unique(
            np.concatenate([ends, np.minimum(ends + 1, capacity - 1), np.arange(0, capacity, 97)])
        )
        bad = 0
        for a in range(0, check.size, 256):
            idx = check[a : a + 256]
            got = buf._encode_sample(idx)  # cpprb's gather behind `sample`, at given indices
            want_o = np.moveaxis(pool[ids[idx, :k]], 1, -1)
            want_n = np.moveaxis(pool[ids[idx, 1:]], 1, -1)
            bad += int(
                np.sum(
                    np.any((got["obs"] != want_o).reshape(idx.size, -1), axis=1)
                    | np.any((got["next_obs"] != want_n).reshape(idx.size, -1), axis=1)
                )
            )
        out.update(checked=int(check.size), mismatches=bad)
    return out


def _measure_in_child(kind: str, capacity: int, seed: int = 0) -> dict:
    """Run :func:`_fill_and_measure` in a fresh interpreter (no JAX, no torch loaded)."""
    if not os.path.exists("/proc/self/statm"):
        raise RuntimeError("resident-set measurement needs /proc (linux)")
    src = textwrap.dedent(inspect.getsource(_fill_and_measure))
    src += (
        f"\nimport json\nprint(json.dumps(_fill_and_measure({kind!r}, {capacity}, {K}, "
        f"{tuple(FRAME)!r}, {seed})))\n"
    )
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cpprb_row(capacity: int) -> dict:
    """cpprb's bytes per step: resident-set growth, checked against its arrays and calibrated."""
    cal = _measure_in_child("numpy", capacity)
    expected = (capacity + K - 1) * FRAME_BYTES
    cal_ratio = cal["rss_growth"] / expected
    if abs(cal_ratio - 1) > 0.02:
        raise RuntimeError(
            f"RSS calibration off: a {expected:,} B numpy array grew the "
            f"resident set by {cal['rss_growth']:,} B"
        )
    got = _measure_in_child("cpprb", capacity)
    if got["mismatches"]:
        raise RuntimeError(
            f"cpprb returned {got['mismatches']} of {got['checked']} checked "
            "stacks unlike the frames fed: wrong configuration"
        )
    if abs(got["held"] / got["rss_growth"] - 1) > 0.05:
        raise RuntimeError(
            f"cpprb: RSS growth {got['rss_growth']:,} B and its arrays "
            f"{got['held']:,} B disagree by more than 5%"
        )
    return dict(
        mode=MODE_MEM,
        backend="cpprb next_of + stack_compress",
        unit="B/step",
        value=got["rss_growth"] / capacity,
        note=(
            f"RSS growth after filling {capacity:,} steps ({got['episodes']} "
            f"episodes); its arrays: {got['held'] / capacity:,.0f} B/step; "
            f"calibration: numpy array measured {cal_ratio:.4f}x its size"
        ),
    )


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
    return {
        "observation": obs,
        "action": rng.integers(0, 6, n).astype(np.int32),
        "done": z,
        "terminated": z,
        "truncated": z,
        "next": {
            "observation": nxt,
            "reward": rng.normal(size=(n, 1)).astype(np.float32),
            "done": done[:, None],
            "terminated": done[:, None],
            "truncated": z,
        },
    }


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
        st_t = add_t(st_t, jax.tree_util.tree_map(lambda x, a=a: x[a : a + chunk], single))
        st_p = add_p(st_p, jax.tree_util.tree_map(lambda x, a=a: x[a : a + chunk], stacked))
    # Same key, same indices: the two samples must agree (checked once, outside timing).
    s1, _ = ted.sample(st_t, jax.random.key(1))
    s2, _ = plain.sample(st_p, jax.random.key(1))
    for x, y in zip(jax.tree_util.tree_leaves(s1.data), jax.tree_util.tree_leaves(s2.data)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "TED sample differs from plain"
    fns = {
        "frb TEDStorage (frame_stack=4)": (_sampler_fn(ted, scan), st_t),
        PLAIN: (_sampler_fn(plain, scan), st_p),
    }
    times = {k: [] for k in fns}
    key = jax.random.key(0)
    for f, st in fns.values():
        f(st, key).block_until_ready()
    for r in range(rounds):
        for name, (f, st) in fns.items():
            t0 = time.perf_counter()
            f(st, jax.random.fold_in(key, r)).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return [
        dict(
            mode=MODE_SAMPLE,
            backend=name,
            unit="samples/s",
            value=scan / statistics.median(ts),
            note=f"capacity {cap:,}",
        )
        for name, ts in times.items()
    ]


def run(quick: bool = False, memory_only: bool = False):
    rows = memory_rows()
    return rows if memory_only else rows + sample_rows(quick)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sampling buffer, fewer rounds")
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="bytes per step only (no timing: safe on a busy machine)",
    )
    args = p.parse_args()
    from benchmarks.run import table

    rows = run(args.quick, args.memory_only)
    print(table(rows, REFERENCES))
    for row in rows:
        if row.get("note"):
            print(f"- {row['backend']}: {row['note']}")


if __name__ == "__main__":
    main()
