"""flashbax 0.1.3's buffers against ``functional_rb.flashbax`` (its API on our core), one run.

The same driver code runs both sides; only the module bound to ``fbx`` differs
(``import flashbax as fbx`` against ``import functional_rb.flashbax as fbx``). Six buffers,
each built by its flashbax builder with the same arguments on both sides and prefilled past
its capacity (the ring has wrapped) through the public ``add``:

  flat               ``make_flat_buffer``, ``add_batch_size=envs``: add one vectorized step
                     (``[envs]`` transitions), sample ``batch`` transition pairs.
  item               ``make_item_buffer(add_batches=True)``: add ``batch`` items, sample
                     ``batch`` (W1's step).
  trajectory         ``make_trajectory_buffer``: add ``[envs, rollout]``, sample ``seq_batch``
                     sequences of ``seq_len`` steps (``period``).
  prioritised flat   ``make_prioritised_flat_buffer``: the flat step, then ``set_priorities``
                     of the sampled pairs (priorities from the sampled rewards); random
                     priorities before timing.
  prioritised traj.  ``make_prioritised_trajectory_buffer``: the trajectory step, then
                     ``set_priorities``.
  queue              ``make_trajectory_queue``: add ``[envs, queue_seq]``, then sample
                     ``queue_seq`` steps of every row (in order, no key).

Two modes per buffer (time per step, lower is better):
  per call   a Python loop of jitted calls, as flashbax users write them:
             ``jax.jit(buffer.add, donate_argnums=0)``, ``jax.jit(buffer.sample)`` (flashbax's
             sample returns no state, so there is nothing to donate; the queue's returns
             one, donated), ``jax.jit(set_priorities, donate_argnums=0)``. Keys are split
             once beforehand; the loop blocks on its last outputs.
  in scan    ``scan_steps`` steps (add + sample (+ set_priorities)) in one jitted, donated
             ``lax.scan``; every sampled leaf (and the probabilities) is summed into the carry
             so no gather is dead code, and each step adds different data.

And one measurement of ``add`` alone (flashbax issue #62: on CPU, adding ``T > 1`` steps to
a prioritised trajectory buffer is far slower than flashbax documents, as its CPU path finds
the newly valid and invalid items with a scan over ``T``):

  prioritised_add    ``make_prioritised_trajectory_buffer(..., device="cpu")`` on both sides,
                     prefilled as above; per call: ``calls`` calls of
                     ``jax.jit(buffer.add, donate_argnums=0)`` with ``[envs, T]`` steps, for
                     each ``T`` of ``--add-lengths`` (default 1 8 64 512; each at most
                     ``capacity // envs``). One row per ``T``, in us per call (the
                     table's "step" is one ``add``).

Sides are interleaved (flashbax, ours; then ours, flashbax), ``rounds`` rounds per buffer,
the load average read before and after each round; reported: median and min-max per side,
and the ratio flashbax / ours taken round by round (median, min-max). The issue's target:
ours >= 1.5x flashbax in each row.

    python benchmarks/flashbax_compat.py --quick                  # tiny smoke run
    python benchmarks/flashbax_compat.py --out benchmarks/results/flashbax_compat.json
    python benchmarks/flashbax_compat.py --buffers flat queue --rounds 7 --capacity 100000
    python benchmarks/flashbax_compat.py --buffers prioritised_add --add-lengths 1 16 256

Default sizes: 10^6 steps of ``{obs f32[17], action i32, reward f32, done bool}`` per buffer
(the queue: ``envs * queue_steps`` = 131,072 steps), about 80 MB a state; one buffer (both
sides) is alive at a time, well under 2 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `python benchmarks/flashbax_compat.py` from the checkout
    sys.path.append(_ROOT)

from benchmarks._stats import summary  # noqa: E402

SIDES = ("flashbax", "functional_rb")
MODULES = {"flashbax": "flashbax", "functional_rb": "functional_rb.flashbax"}
ADD = "prioritised_add"  # add alone, for flashbax issue #62 (``run_add``)
BUFFERS = (
    "flat",
    "item",
    "trajectory",
    "prioritised_flat",
    "prioritised_trajectory",
    "queue",
    ADD,
)
ADD_LENGTHS = (1, 8, 64, 512)
MODES = ("per call", "in scan")
TARGET = 1.5
PRIORITY_EXPONENT = 0.6


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures (the CLI flags of the same names override these)."""

    capacity: int = 1_000_000  # steps each buffer holds (all rows together)
    envs: int = 16  # add_batch_size: rows, one per environment
    batch: int = 256  # transitions per sample (flat, item, prioritised flat)
    seq_batch: int = 128  # sequences per sample (trajectory buffers)
    seq_len: int = 16  # sample_sequence_length
    period: int = 1  # the trajectory buffers' period
    rollout: int = 8  # time steps per add (trajectory buffers)
    obs_dim: int = 17
    queue_steps: int = 8192  # the queue's max_length_time_axis
    queue_seq: int = 32  # the queue's add and sample sequence length
    calls: int = 200  # steps per round, per-call mode
    scan_steps: int = 1000  # steps per round, in-scan mode
    rounds: int = 5


QUICK = {
    "capacity": 4096,
    "envs": 4,
    "batch": 32,
    "seq_batch": 16,
    "seq_len": 8,
    "rollout": 4,
    "queue_steps": 256,
    "queue_seq": 16,
    "calls": 10,
    "scan_steps": 20,
    "rounds": 2,
}

_clock = time.perf_counter


# ----------------------------------------------------------------------------- data
def example(s: Sizes) -> dict:
    """ONE time step (no batch axes): what the builders' ``init`` takes."""
    return {
        "obs": jnp.zeros((s.obs_dim,), jnp.float32),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
    }


def steps(rng: np.random.Generator, s: Sizes, shape: tuple[int, ...]) -> dict:
    """Random time steps with leading axes ``shape`` (device arrays)."""
    return {
        "obs": jnp.asarray(rng.standard_normal(shape + (s.obs_dim,), np.float32)),
        "action": jnp.asarray(rng.integers(0, 4, shape, np.int32)),
        "reward": jnp.asarray(rng.standard_normal(shape, np.float32)),
        "done": jnp.asarray(rng.random(shape) < 0.01),
    }


def shifted(batch: dict, i: jax.Array) -> dict:
    """A different batch at each scan step (cheap), so the adds are not loop-invariant."""
    return dict(batch, obs=batch["obs"] + i.astype(jnp.float32))


def consume(acc: jax.Array, tree: Any) -> jax.Array:
    """Sum every leaf of ``tree`` into the float32 ``acc``: no sampled gather is dead code."""
    return acc + sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(tree))


def priorities(reward: jax.Array) -> jax.Array:
    """New priorities ``[B]`` from the sampled rewards (``[B]`` or ``[B, L]``), a stand-in
    for |TD error|."""
    r = jnp.abs(reward)
    return (r if r.ndim == 1 else jnp.mean(r, axis=1)) + 0.01


# ----------------------------------------------------------------------------- buffers
@dataclasses.dataclass(frozen=True)
class Spec:
    """One buffer of the benchmark, built the same way for either module ``fbx``."""

    name: str
    make: Callable[[Any, Sizes], Any]  # (fbx, sizes) -> buffer
    add_shape: Callable[[Sizes], tuple[int, ...]]  # leading axes of one add's batch
    rows_steps: Callable[[Sizes], tuple[int, int]]  # (rows, steps per row) of the state
    reward: Callable[[Any], jax.Array] | None = None  # sample -> rewards; None: not prioritised
    queue: bool = False


def _flat(fbx, s: Sizes):
    return fbx.make_flat_buffer(
        max_length=s.capacity, min_length=s.batch, sample_batch_size=s.batch, add_batch_size=s.envs
    )


def _item(fbx, s: Sizes):
    return fbx.make_item_buffer(
        max_length=s.capacity, min_length=s.batch, sample_batch_size=s.batch, add_batches=True
    )


def _trajectory(fbx, s: Sizes):
    return fbx.make_trajectory_buffer(
        add_batch_size=s.envs,
        sample_batch_size=s.seq_batch,
        sample_sequence_length=s.seq_len,
        period=s.period,
        min_length_time_axis=s.seq_len,
        max_size=s.capacity,
    )


def _prioritised_flat(fbx, s: Sizes):
    return fbx.make_prioritised_flat_buffer(
        max_length=s.capacity,
        min_length=s.batch,
        sample_batch_size=s.batch,
        add_batch_size=s.envs,
        priority_exponent=PRIORITY_EXPONENT,
    )


def _prioritised_trajectory(fbx, s: Sizes, **kwargs):
    return fbx.make_prioritised_trajectory_buffer(
        add_batch_size=s.envs,
        sample_batch_size=s.seq_batch,
        sample_sequence_length=s.seq_len,
        period=s.period,
        min_length_time_axis=s.seq_len,
        max_size=s.capacity,
        priority_exponent=PRIORITY_EXPONENT,
        **kwargs,
    )


def _queue(fbx, s: Sizes):
    return fbx.make_trajectory_queue(
        max_length_time_axis=s.queue_steps,
        add_batch_size=s.envs,
        add_sequence_length=s.queue_seq,
        sample_sequence_length=s.queue_seq,
    )


SPECS = {
    "flat": Spec("flat", _flat, lambda s: (s.envs,), lambda s: (s.envs, s.capacity // s.envs)),
    "item": Spec("item", _item, lambda s: (s.batch,), lambda s: (1, s.capacity)),
    "trajectory": Spec(
        "trajectory",
        _trajectory,
        lambda s: (s.envs, s.rollout),
        lambda s: (s.envs, s.capacity // s.envs),
    ),
    "prioritised_flat": Spec(
        "prioritised_flat",
        _prioritised_flat,
        lambda s: (s.envs,),
        lambda s: (s.envs, s.capacity // s.envs),
        reward=lambda sample: sample.experience.first["reward"],
    ),
    "prioritised_trajectory": Spec(
        "prioritised_trajectory",
        _prioritised_trajectory,
        lambda s: (s.envs, s.rollout),
        lambda s: (s.envs, (s.capacity // s.envs) // s.period * s.period),
        reward=lambda sample: sample.experience["reward"],
    ),
    "queue": Spec(
        "queue",
        _queue,
        lambda s: (s.envs, s.queue_seq),
        lambda s: (s.envs, s.queue_steps),
        queue=True,
    ),
}
# issue #62 names flashbax's CPU path: ask for it on both sides (it is also the default)
SPECS[ADD] = dataclasses.replace(
    SPECS["prioritised_trajectory"],
    name=ADD,
    make=lambda fbx, s: _prioritised_trajectory(fbx, s, device="cpu"),
)


def prefill_buffer(fbx, spec: Spec, s: Sizes):
    """A buffer with ``spec``'s state layout whose ``add`` takes ``[rows, T]`` for any T: the
    trajectory builder the flat and item builders are made of (same state type)."""
    rows, length = spec.rows_steps(s)
    if spec.queue:
        return None
    if spec.reward is not None:
        seq, period = (2, 1) if spec.name == "prioritised_flat" else (s.seq_len, s.period)
        return fbx.make_prioritised_trajectory_buffer(
            add_batch_size=rows,
            sample_batch_size=1,
            sample_sequence_length=seq,
            period=period,
            min_length_time_axis=seq,
            max_length_time_axis=length,
            priority_exponent=PRIORITY_EXPONENT,
        )
    seq = {"flat": 2, "item": 1}.get(spec.name, s.seq_len)
    return fbx.make_trajectory_buffer(
        add_batch_size=rows,
        sample_batch_size=1,
        sample_sequence_length=seq,
        period=1,
        min_length_time_axis=seq,
        max_length_time_axis=length,
    )


def filled_state(fbx, buffer, spec: Spec, s: Sizes, rng: np.random.Generator):
    """``buffer``'s state after its ring wrapped (a prioritised one then holds random
    priorities); the queue holds half its length unread."""
    rows, length = spec.rows_steps(s)
    state = buffer.init(example(s))
    if spec.queue:
        add = jax.jit(buffer.add, donate_argnums=0)
        for _ in range(max(1, (length // 2) // s.queue_seq)):
            state = add(state, steps(rng, s, (rows, s.queue_seq)))
        return state
    filler = prefill_buffer(fbx, spec, s)
    add = jax.jit(filler.add, donate_argnums=0)
    chunk = min(length, 4096)
    for _ in range(-(-(length + chunk // 2) // chunk)):  # past the end: the ring wraps
        state = add(state, steps(rng, s, (rows, chunk)))
    if spec.reward is not None:
        period = 1 if spec.name == "prioritised_flat" else s.period
        n_items = rows * (length // period)
        values = jnp.asarray(rng.exponential(1.0, n_items).astype(np.float32))
        state = jax.jit(buffer.set_priorities, donate_argnums=0)(
            state, jnp.arange(n_items, dtype=jnp.int32), values
        )
    return state


# ----------------------------------------------------------------------------- one side
class Side:
    """One module's buffer, its state and the jitted functions of both modes."""

    def __init__(self, side: str, spec: Spec, s: Sizes, seed: int):
        self.name, self.spec, self.sizes = side, spec, s
        fbx = importlib.import_module(MODULES[side])
        rng = np.random.default_rng(seed)  # the same data on both sides
        with warnings.catch_warnings():
            # both builders say that max_size sets max_length_time_axis: asked for, not news
            warnings.filterwarnings("ignore", message="Setting max_size")
            buffer = spec.make(fbx, s)
        self.state = filled_state(fbx, buffer, spec, s, rng)
        self.batch = steps(rng, s, spec.add_shape(s))
        self.keys = list(jax.random.split(jax.random.PRNGKey(seed), s.calls))
        self.buffer = buffer
        # the per-call functions, as flashbax users jit them
        self.add = jax.jit(buffer.add, donate_argnums=0)
        if spec.queue:
            self.sample = jax.jit(buffer.sample, donate_argnums=0)
        else:
            self.sample = jax.jit(buffer.sample)
        if spec.reward is not None:
            self.set_priorities = jax.jit(
                lambda st, idx, r: buffer.set_priorities(st, idx, priorities(r)), donate_argnums=0
            )
        self.scan = jax.jit(self._scan, donate_argnums=0)

    def _step(self, state, batch, key):
        """One step of the scan body: ``(state, the leaves to consume)``."""
        buffer, spec = self.buffer, self.spec
        state = buffer.add(state, batch)
        if spec.queue:
            state, sample = buffer.sample(state)
            return state, sample.experience
        sample = buffer.sample(state, key)
        if spec.reward is None:
            return state, sample.experience
        state = buffer.set_priorities(state, sample.indices, priorities(spec.reward(sample)))
        return state, (sample.experience, sample.probabilities)

    def _scan(self, state, batch, key):
        def body(carry, i):
            state, acc = carry
            state, used = self._step(state, shifted(batch, i), jax.random.fold_in(key, i))
            return (state, consume(acc, used)), None

        (state, acc), _ = jax.lax.scan(
            body, (state, jnp.float32(0)), jnp.arange(self.sizes.scan_steps, dtype=jnp.int32)
        )
        return state, acc

    def per_call(self, n: int | None = None) -> float:
        """Seconds per step of ``n`` steps of jitted calls (all ``calls`` by default)."""
        keys = self.keys[:n] if n else self.keys
        add, sample, batch, state = self.add, self.sample, self.batch, self.state
        queue, prioritised = self.spec.queue, self.spec.reward is not None
        t = _clock()
        for key in keys:
            state = add(state, batch)
            if queue:
                state, out = sample(state)
            else:
                out = sample(state, key)
                if prioritised:
                    state = self.set_priorities(state, out.indices, self.spec.reward(out))
        jax.block_until_ready((state, out))
        dt = _clock() - t
        self.state = state
        return dt / len(keys)

    def add_only(self, batch: dict, n: int | None = None) -> float:
        """Seconds per call of ``n`` jitted, donated ``add`` calls of ``batch`` (``calls``
        by default)."""
        add, state = self.add, self.state
        t = _clock()
        for _ in range(n or self.sizes.calls):
            state = add(state, batch)
        jax.block_until_ready(state)
        dt = _clock() - t
        self.state = state
        return dt / (n or self.sizes.calls)

    def in_scan(self, r: int) -> float:
        """Seconds per step of one jitted ``lax.scan`` of ``scan_steps`` steps."""
        key = jax.random.PRNGKey(1000 + r)
        t = _clock()
        self.state, acc = self.scan(self.state, self.batch, key)
        jax.block_until_ready((self.state, acc))
        return (_clock() - t) / self.sizes.scan_steps


# ----------------------------------------------------------------------------- the run
def _row(buffer: str, mode: str, unit: str, times: dict, loads: list) -> dict:
    """One table row from each side's per-round times: medians, ranges, ratios per round."""
    theirs, ours = times["flashbax"], times["functional_rb"]
    return {
        "buffer": buffer,
        "mode": mode,
        "unit": unit,
        "flashbax": summary(theirs),
        "functional_rb": summary(ours),
        "ratio": summary([a / b for a, b in zip(theirs, ours)]),
        "loads": loads,
    }


def run_buffer(spec: Spec, s: Sizes, log=print) -> list[dict]:
    """Both sides of one buffer, both modes, ``s.rounds`` interleaved rounds: one row per
    mode with each side's microseconds per step and the per-round ratios flashbax / ours."""
    t0 = _clock()
    sides = [Side(name, spec, s, seed=0) for name in SIDES]
    for side in sides:  # warm-up: compile, first touches
        side.per_call(3)
        side.in_scan(-1)
    log(f"[{spec.name}] built, prefilled and compiled in {_clock() - t0:.1f} s")
    times = {(mode, side.name): [] for mode in MODES for side in sides}
    loads = []
    for r in range(s.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # A B, then B A
        before = os.getloadavg()[0]
        for side in order:
            times[("per call", side.name)].append(side.per_call() * 1e6)
        for side in order:
            times[("in scan", side.name)].append(side.in_scan(r) * 1e6)
        loads.append((before, os.getloadavg()[0]))
        log(f"[{spec.name}] round {r + 1}/{s.rounds}: load {before:.2f} -> {loads[-1][1]:.2f}")
    return [
        _row(spec.name, mode, "us/step", {n: times[(mode, n)] for n in SIDES}, loads)
        for mode in MODES
    ]


def run_add(s: Sizes, lengths: list[int], log=print) -> list[dict]:
    """flashbax issue #62: ``add`` alone of the prioritised trajectory buffer (device "cpu"),
    ``[envs, T]`` steps per call for each ``T`` in ``lengths``, both sides interleaved in
    ``s.rounds`` rounds: one row per ``T`` with each side's microseconds per call and the
    per-round ratios flashbax / ours."""
    t0 = _clock()
    sides = [Side(name, SPECS[ADD], s, seed=0) for name in SIDES]
    rng = np.random.default_rng(1)
    batches = {T: steps(rng, s, (s.envs, T)) for T in lengths}  # the same data on both sides
    for side in sides:  # warm-up: one compilation per T
        for T in lengths:
            side.add_only(batches[T], 2)
    log(f"[{ADD}] built, prefilled and compiled in {_clock() - t0:.1f} s")
    times = {(T, side.name): [] for T in lengths for side in sides}
    loads = []
    for r in range(s.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # A B, then B A
        before = os.getloadavg()[0]
        for T in lengths:
            for side in order:
                times[(T, side.name)].append(side.add_only(batches[T]) * 1e6)
        loads.append((before, os.getloadavg()[0]))
        log(f"[{ADD}] round {r + 1}/{s.rounds}: load {before:.2f} -> {loads[-1][1]:.2f}")
    return [
        _row(ADD, f"add T={T}", "us/call", {n: times[(T, n)] for n in SIDES}, loads)
        for T in lengths
    ]


def _cell(d: dict, fmt: str) -> str:
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"


def table(rows: list[dict]) -> str:
    """The markdown table: each side's median (min-max) and the ratio flashbax / ours."""
    head = (
        "| buffer | mode | flashbax us/step | functional_rb.flashbax us/step | "
        f"flashbax / ours | >= {TARGET}x |"
    )
    out = [head, "|---|---|---:|---:|---:|---|"]
    for row in rows:
        met = "yes" if row["ratio"]["median"] >= TARGET else "**no**"
        unit = "" if row["unit"] == "us/step" else f" ({row['unit']})"
        out.append(
            f"| {row['buffer']} | {row['mode']}{unit} | {_cell(row['flashbax'], ',.1f')} | "
            f"{_cell(row['functional_rb'], ',.1f')} | {_cell(row['ratio'], '.2f')} | "
            f"{met} |"
        )
    return "\n".join(out)


def loads_text(rows: list[dict]) -> str:
    """One line per buffer: the load average before -> after each of its rounds."""
    seen, lines = set(), []
    for row in rows:
        if row["buffer"] not in seen:
            seen.add(row["buffer"])
            lines.append(
                f"- {row['buffer']}: " + ", ".join(f"{a:.2f}->{b:.2f}" for a, b in row["loads"])
            )
    return "\n".join(lines)


def versions() -> dict:
    from importlib.metadata import version

    import flashbax

    return {
        "jax": jax.__version__,
        "flashbax": version("flashbax"),
        "flashbax_path": flashbax.__file__,
        "device": str(jax.devices()[0]),
        "cpus": os.cpu_count(),
    }


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a result")
    ap.add_argument("--buffers", nargs="+", choices=BUFFERS, default=list(BUFFERS))
    ap.add_argument("--out", default=None, help="write the rows (every round) as JSON here")
    ap.add_argument(
        "--add-lengths",
        type=int,
        nargs="+",
        default=list(ADD_LENGTHS),
        help=f"{ADD}: time steps T per add ([envs, T]); default {' '.join(map(str, ADD_LENGTHS))}",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with process CPU time instead of wall time (shared machines)",
    )
    for f in dataclasses.fields(Sizes):
        ap.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {f.default:,} ({QUICK.get(f.name, f.default):,} with --quick)",
        )
    args = ap.parse_args(argv)
    sizes = dict(QUICK) if args.quick else {}
    sizes.update(
        {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(Sizes)
            if getattr(args, f.name) is not None
        }
    )
    s = Sizes(**sizes)
    if s.rounds < 1 or s.calls < 1 or s.scan_steps < 1:
        ap.error("--rounds, --calls and --scan-steps must be at least 1")
    rows_steps = SPECS[ADD].rows_steps(s)[1]
    if ADD in args.buffers and not all(1 <= T <= rows_steps for T in args.add_lengths):
        ap.error(
            f"--add-lengths must lie in [1, {rows_steps}] (the steps per row of {ADD}) "
            f"(got {args.add_lengths}); raise --capacity or drop the longer lengths"
        )
    return args, s


def main(argv=None) -> int:
    global _clock
    args, s = parse_args(argv)
    if args.cpu_time:
        _clock = time.process_time
    info = versions()
    print(
        f"flashbax {info['flashbax']} against functional_rb.flashbax; jax {info['jax']} on "
        f"{info['device']}, {info['cpus']} CPUs, {'CPU' if args.cpu_time else 'wall'} time"
        f"{', --quick (not a result)' if args.quick else ''}; {dataclasses.asdict(s)}",
        flush=True,
    )
    rows = []
    log = functools.partial(print, file=sys.stderr, flush=True)
    for name in args.buffers:
        rows += (
            run_add(s, args.add_lengths, log) if name == ADD else run_buffer(SPECS[name], s, log)
        )
    print(table(rows))
    print("\nload average (1 min) before -> after each round:")
    print(loads_text(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "sizes": dataclasses.asdict(s),
                    "quick": args.quick,
                    "clock": "cpu" if args.cpu_time else "wall",
                    **info,
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
