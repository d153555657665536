"""TEDStorage's add against capacity: is one add's cost independent of the buffer's size?

W5 (``benchmarks/w5_scale.py``) found the compiled, donated ``add`` of a ``TEDStorage``
copying its whole observation table on every call (O(capacity)). This script times that add
alone, and reads the compiled HLO for the copies, at each size:

- a point (size) runs in its own fresh process: it builds a full buffer of W5's TED items
  (``scale_backends.make_items("ted", ...)``: ``{obs f32[4], action, next: {obs, reward,
  done}}``, episodes of 50-500 steps, ``TEDStorage(min_episode_len=50)``), compiles
  ``jax.jit(rb.add, donate_argnums=0)``, warms up, then times ``--blocks`` blocks of
  ``--adds`` adds of one prebuilt batch of ``--batch`` steps (median of blocks, us per add);
- points run in interleaved rounds (the order rotated each round); the table gives each
  size's median over rounds and its min-max range, with ``/proc/loadavg`` before and after
  every point in the JSON;
- ``big copies``: the compiled add's ``copy`` instructions of arrays with at least
  ``capacity`` rows (0 when the add writes the donated tables in place).

Usage::

    python benchmarks/ted_add_scale.py --sizes 1e4 1e5 1e6 1e7 --rounds 5
    python benchmarks/ted_add_scale.py --sizes 1e4 1e6 --frame-stack 4 --num-envs 4
    python benchmarks/ted_add_scale.py --lock /tmp/frb/test.lock   # each point under flock

Writes ``--out`` (JSON, default ``benchmarks/results/ted_add_scale.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/ted_add_scale.py` from the checkout
    sys.path.append(str(_HERE.parent))

_COPY = re.compile(r"=\s*([a-z0-9]+)\[([0-9,]*)\][^ ]*\s+copy\(")


def big_copies(hlo_text: str, rows: int) -> list:
    """The ``copy`` instructions of ``hlo_text`` whose array has at least ``rows`` rows."""
    out = []
    for line in hlo_text.splitlines():
        m = _COPY.search(line)
        if m and m.group(2) and int(m.group(2).split(",")[0]) >= rows:
            out.append(line.strip()[:160])
    return out


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ------------------------------------------------------------------ one point (child process)
def run_point(size: int, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import functional_rb as frb
    from benchmarks import scale_backends as sb

    e = args.num_envs
    storage = frb.TEDStorage(min_episode_len=50, frame_stack=args.frame_stack)
    rb = frb.ReplayBuffer(capacity=size, batch_size=256, storage=storage, ndim=1 if e == 1 else 2)
    chunk_n = min(size // e, 100_000)

    def rows(tree, t):  # [n, ...] -> [E, t, ...] for ndim=2
        f = (
            (lambda x: jnp.asarray(x[: e * t]).reshape((e, t) + x.shape[1:]))
            if e > 1
            else (lambda x: jnp.asarray(x[:t]))
        )
        return jax.tree_util.tree_map(f, tree)

    chunk = rows(sb.make_items("ted", chunk_n * e, seed=0), chunk_n)
    batch = rows(sb.make_items("ted", args.batch, seed=1), args.batch // e)
    one = jax.tree_util.tree_map(lambda x: x[:, 0] if e > 1 else x[0], chunk)
    add = jax.jit(rb.add, donate_argnums=0)
    state = rb.init(one)
    for _ in range(-(-size // (chunk_n * e))):
        state = add(state, chunk)
    hlo = add.lower(state, batch).compile().as_text()
    copies = big_copies(hlo, size)
    for _ in range(3):
        state = add(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.blocks):
        t = time.perf_counter()
        for _ in range(args.adds):
            state = add(state, batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t) / args.adds * 1e6)
    assert int(rb.size(state)) == size and int(state.storage.lost) == 0
    return {
        "size": size,
        "us_per_add": statistics.median(times),
        "blocks": times,
        "big_copies": copies,
        "jax": jax.__version__,
        "table_rows": int(np.shape(state.storage.data["obs"])[0]),
    }


# ------------------------------------------------------------------ driver
def _child(size: int, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(size),
        "--blocks",
        str(args.blocks),
        "--adds",
        str(args.adds),
        "--batch",
        str(args.batch),
        "--frame-stack",
        str(args.frame_stack),
        "--num-envs",
        str(args.num_envs),
    ]
    with open(args.lock, "a") if args.lock else contextlib.nullcontext() as lock:
        if args.lock:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        before = _loadavg()
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        after = _loadavg()
    if out.returncode:
        raise RuntimeError(f"point {size} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(load_before=before, load_after=after)
    return row


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--adds", type=int, default=20, help="adds per timed block")
    ap.add_argument("--batch", type=int, default=256, help="steps per add")
    ap.add_argument("--frame-stack", type=int, default=1)
    ap.add_argument("--num-envs", type=int, default=1)
    ap.add_argument("--lock", default=None, help="flock this file around each point")
    ap.add_argument("--out", default=str(_HERE / "results" / "ted_add_scale.json"))
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_point(args.child, args)))
        return
    sizes = [int(s) for s in args.sizes]
    rows = []
    for r in range(args.rounds):
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
        for size in order:
            row = _child(size, args)
            row["round"] = r
            rows.append(row)
            print(
                f"round {r} size {size:>10,}: {_fmt(row['us_per_add'])} us/add, "
                f"{len(row['big_copies'])} big copies, load {row['load_before']:.2f}->"
                f"{row['load_after']:.2f}",
                flush=True,
            )
    print(f"\n| capacity | us per add, median (min-max) of {args.rounds} rounds | big copies |")
    print("|---:|---:|---:|")
    for size in sizes:
        t = [x["us_per_add"] for x in rows if x["size"] == size]
        n = {len(x["big_copies"]) for x in rows if x["size"] == size}
        print(
            f"| {size:,} | {_fmt(statistics.median(t))} ({_fmt(min(t))}-{_fmt(max(t))}) "
            f"| {'/'.join(map(str, sorted(n)))} |"
        )
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows}, indent=1
        )
    )


if __name__ == "__main__":
    main()
