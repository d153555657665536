"""Stable-Baselines3's replay buffer against ``functional_rb.sb3``'s (its drop-in), one run.

``from functional_rb.sb3 import ReplayBuffer`` replaces
``from stable_baselines3.common.buffers import ReplayBuffer``; this script runs both, side by
side, on three workloads (``--only`` picks some):

  step     The off-policy loop's buffer cost: one ``add`` of one step (``n_envs=1``) then one
           ``sample`` per step, in us per step (lower is better), with the add and sample calls
           also timed apart (ours' add is dispatched asynchronously, so part of its work can
           land in the sample's figure; the sum is exact). Two observation kinds:
             vector  MuJoCo-like: ``Box`` float32 ``(17,)`` observations, ``Box`` float32 ``(6,)``
                     actions, batch 256, at 10^4 ... 10^7 stored steps; SB3 with its defaults,
                     ours with the same arguments.
             image   Atari-like: uint8 ``(4, 84, 84)`` observations (``VecFrameStack(4)`` of 84x84
                     frames, channels first as SB3's DQN and CleanRL hand them to the buffer;
                     ``--channels last`` for ``(84, 84, 4)``), ``Discrete(4)`` actions, batch 32;
                     SB3 with ``optimize_memory_usage=True, handle_timeout_termination=False``,
                     ours with ``frame_stack=4`` (each frame stored once), and ours with SB3's
                     arguments ("drop-in"), each at the sizes that fit this machine.
           Sides: SB3 (torch tensors on the CPU), ours with ``output="torch"`` and ours with
           ``output="jax"``: one buffer of ours serves both outputs (``output`` is the attribute
           the constructor's ``output=`` sets, read when a sample is converted), so the two
           share one copy of the data and one stream of steps.
           Each buffer is filled to its size first (the fill is timed apart, see "Filling"), then
           ``--rounds`` interleaved rounds (the order rotates: A B C, B C A, C A B, ...) of
           ``--steps`` steps per side; the 1-minute load average is read before and after each
           round. Reported: median (min-max) us per step per side, and SB3 / ours per round.
  memory   Peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, and
           ``VmHWM`` of ``/proc/self/status`` as a cross-check) of a fresh process per case,
           started from ``/bin/sh`` (a child forked from this process would inherit its peak),
           holding Atari-shaped transitions: ours with ``frame_stack=4`` filled with 10^6 steps
           (target: at most 8 GB); SB3 with ``optimize_memory_usage=True`` filled with 10^5
           (measured); SB3 at 10^6 constructed but not filled (``np.zeros`` allocates lazily):
           its arrays' ``nbytes`` are computed, as they do not fit this machine's memory; ours
           with SB3's arguments ("drop-in") filled with 10^5 (measured). Each case also reports
           the process's peak before the buffer was built (imports: torch, and JAX for ours)
           and the buffer's own array bytes (SB3: its NumPy arrays; ours: its core state).
  cleanrl  Wall time of a CleanRL-style DQN (written here after CleanRL's ``dqn.py``:
           CartPole-v1, ``gymnasium.vector.SyncVectorEnv`` with 1 env, buffer 10,000, batch 128,
           ``learning_starts`` 10,000, ``train_frequency`` 10, ``--cleanrl-steps`` steps) whose
           only difference between the two runs of a seed is the ``ReplayBuffer`` import. Each
           run is a fresh process; sides alternate which goes first per seed. Reported per seed:
           the process's wall time, the loop's, and the mean return of the last 10 episodes
           (ours draws SB3's indices from NumPy's global generator, so a seed's runs match).

Filling: SB3's buffers by writing their arrays directly (what ``add`` would leave: the same
values, ``pos`` and ``full``); ours by the core write ``add`` itself ends in
(``ReplayBuffer._grid.add``) with chunks of steps in the stored layout, skipping ``add``'s
per-step checks, except frame stacks kept on the host (``frame_stack=4``, torch samples),
filled by ``add`` (its ring of frames is written there). Every full run first checks, on the code it measures, that both fills leave
what ``add`` step by step leaves (:func:`check_fills`: the arrays as SB3 shows them and a
seeded sample; ``fills_match_add`` in the JSON; ``--quick`` checks SB3's two only). The streams
are synthetic and real frame stacks: each frame is a pooled random frame stamped with its
number, each step's observation is the previous step's next observation, and a new episode's
stack is zeros but its first frame; episodes of 500-1,500 steps; the fill ends an episode, so
the timed steps start a new one.

torch runs with ``--torch-threads`` threads (default 1; 0: torch's own default) in every
workload: on this 2-core machine shared with other jobs, torch's 2-thread copy of a sampled
batch waits for a second free core; at load ~6 that made SB3's sample of 32 images take 2.4-23
ms instead of 0.23-0.25 ms with one thread, and vary with other jobs' load.

    python benchmarks/sb3.py --quick                          # tiny smoke run (seconds)
    python benchmarks/sb3.py --wait-load 1.5 --out benchmarks/results/sb3.json
    python benchmarks/sb3.py --only step --vector-sizes 1e4 1e5 --image-sizes 1e4
    python benchmarks/sb3.py --only cleanrl --seeds 0 1 2 --cleanrl-steps 50000

Imports of torch, JAX, SB3 and ``functional_rb`` happen inside the functions that need them:
the SB3-side subprocesses (memory, cleanrl) must not pay JAX's import or memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import resource
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `python benchmarks/sb3.py` from the checkout
    sys.path.append(str(_HERE.parent))

from benchmarks._stats import summary  # noqa: E402

WORKLOADS = ("step", "memory", "cleanrl")
SB3, OURS_TORCH, OURS_JAX = "SB3", "ours (torch)", "ours (jax)"
FS_TORCH, FS_JAX = "ours frame_stack=4 (torch)", "ours frame_stack=4 (jax)"
DROPIN = "ours drop-in (torch)"
MEMORY_TARGET_BYTES = 8e9
FRAME_STACK = 4
IMAGE_SIDE = 84
VECTOR_OBS, VECTOR_ACT = 17, 6
EPISODES = (500, 1500)  # episode lengths, uniform in [lo, hi)

_clock = time.perf_counter


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures (the CLI flags of the same names override these)."""

    vector_sizes: tuple = (10**4, 10**5, 10**6, 10**7)
    image_sizes: tuple = (10**4, 10**5, 10**6)
    sb3_image_max: int = 10**5  # the largest image size SB3 runs at (10^6: 28 GB)
    dropin_image_max: int = 10**5  # the same for ours with SB3's arguments
    vector_batch: int = 256
    image_batch: int = 32
    steps: int = 1000  # timed steps per side per round, vector
    image_steps: int = 200  # the same, images
    rounds: int = 5
    memory_size: int = 10**6  # ours frame_stack=4, filled; SB3 constructed (computed)
    memory_sb3_size: int = 10**5  # SB3 and ours drop-in, filled (measured)
    seeds: tuple = (0, 1, 2)
    cleanrl_steps: int = 50_000
    cleanrl_buffer: int = 10_000
    cleanrl_batch: int = 128
    cleanrl_learning_starts: int = 10_000
    cleanrl_train_frequency: int = 10


QUICK = {
    "vector_sizes": (1000,),
    "image_sizes": (600,),
    "sb3_image_max": 600,
    "dropin_image_max": 600,
    "vector_batch": 32,
    "image_batch": 8,
    "steps": 20,
    "image_steps": 8,
    "rounds": 2,
    "memory_size": 600,
    "memory_sb3_size": 300,
    "seeds": (0,),
    "cleanrl_steps": 400,
    "cleanrl_buffer": 300,
    "cleanrl_batch": 32,
    "cleanrl_learning_starts": 200,
    "cleanrl_train_frequency": 10,
}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _load() -> float:
    return os.getloadavg()[0]


def _set_torch_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- the streams
class Chunk:
    """``n`` consecutive steps of a :class:`Stream`; observations are built on request."""

    def __init__(self, stream, gid, local, done, action, reward):
        self.stream, self.gid, self.local = stream, gid, local
        self.done, self.action, self.reward = done, action, reward

    def __len__(self) -> int:
        return len(self.gid)

    def obs(self) -> np.ndarray:
        return self.stream.stacks(self.gid, self.local)

    def next_obs(self) -> np.ndarray:
        return self.stream.stacks(self.gid + 1, self.local + 1)

    def obs_newest(self) -> np.ndarray:
        return self.stream.frames(self.gid)

    def next_newest(self) -> np.ndarray:
        return self.stream.frames(self.gid + 1)

    def steps(self) -> list[tuple]:
        """One ``add``'s arguments per step (``n_envs = 1``)."""
        obs, nxt = self.obs(), self.next_obs()
        return [
            (
                obs[i : i + 1],
                nxt[i : i + 1],
                self.action[i : i + 1],
                self.reward[i : i + 1],
                self.done[i : i + 1],
                [{}],
            )
            for i in range(len(self))
        ]


class Stream:
    """An endless episodic stream whose observations are real ``k``-frame stacks (``k = 1``:
    plain vectors). Frame ``g`` is pooled random data stamped with ``g``; a step whose
    observation's newest frame is ``g`` has next observation ``g + 1``; an episode's first
    stack is zeros but its first frame; the frame after an episode's terminal one starts the
    next. Two streams of one seed give the same steps."""

    def __init__(
        self,
        kind: str,
        seed: int,
        channels_first: bool = True,
        pool: int = 256,
        episodes: tuple[int, int] = EPISODES,
    ):
        rng = np.random.default_rng(seed)
        self.kind, self.rng, self.episodes = kind, rng, episodes
        if kind == "vector":
            self.k, self.axis = 1, 0
            self.pool = rng.standard_normal((pool, VECTOR_OBS)).astype(np.float32)
        else:
            self.k = FRAME_STACK
            frame = (1, IMAGE_SIDE, IMAGE_SIDE) if channels_first else (IMAGE_SIDE, IMAGE_SIDE, 1)
            self.axis = 0 if channels_first else 2
            self.pool = rng.integers(0, 256, (pool, *frame), dtype=np.uint8)
        self.gid, self.local = 0, 0  # the next step's observation: newest frame, its index
        self.left = self._length()

    def _length(self) -> int:
        return int(self.rng.integers(*self.episodes))

    def frames(self, ids: np.ndarray) -> np.ndarray:
        """Frames ``ids`` (``[n, *frame]``), each unique: its number stamped in."""
        out = self.pool[ids % len(self.pool)]
        flat = out.reshape(len(ids), -1)
        if out.dtype == np.uint8:
            flat[:, :8] = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
        else:
            flat[:, 0] = ids
        return out

    def stacks(self, ids: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The observations whose newest frames are ``ids`` at episode indices ``local``:
        frames ``ids - k + 1 .. ids`` along the channel axis, zeros before the episode."""
        if self.k == 1:
            return self.frames(ids)
        parts = []
        for back in range(self.k - 1, -1, -1):  # oldest first, as VecFrameStack
            f = self.frames(ids - back)
            f[local - back < 0] = 0
            parts.append(f)
        return np.concatenate(parts, axis=1 + self.axis)

    def chunk(self, n: int, end: bool = False) -> Chunk:
        """The next ``n`` steps; ``end``: the last one ends its episode (done)."""
        gid, local = np.empty(n, np.int64), np.empty(n, np.int64)
        done = np.zeros(n, np.float32)
        i = 0
        while i < n:
            m = min(self.left, n - i)
            gid[i : i + m] = self.gid + np.arange(m)
            local[i : i + m] = self.local + np.arange(m)
            self.gid, self.local, self.left, i = self.gid + m, self.local + m, self.left - m, i + m
            if self.left == 0 or (end and i == n):
                done[i - 1] = 1.0
                self.gid += 1  # past the terminal frame (the done step's next observation)
                self.local, self.left = 0, self._length()
        if self.kind == "vector":
            action = self.rng.uniform(-1, 1, (n, VECTOR_ACT)).astype(np.float32)
        else:
            action = self.rng.integers(0, 4, n)
        reward = self.rng.standard_normal(n).astype(np.float32)
        return Chunk(self, gid, local, done, action, reward)


def spaces_for(kind: str, channels_first: bool = True):
    from gymnasium import spaces

    if kind == "vector":
        return (
            spaces.Box(-np.inf, np.inf, (VECTOR_OBS,), np.float32),
            spaces.Box(-1, 1, (VECTOR_ACT,), np.float32),
        )
    c = FRAME_STACK
    shape = (c, IMAGE_SIDE, IMAGE_SIDE) if channels_first else (IMAGE_SIDE, IMAGE_SIDE, c)
    return spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(4)


# ----------------------------------------------------------------------------- buffers
def make_buffer(config: str, kind: str, size: int, channels_first: bool = True):
    """``config``: "sb3", "ours", "ours_fs" (frame_stack=4) or "dropin" (ours, SB3's arguments)."""
    obs_space, act_space = spaces_for(kind, channels_first)
    image = kind == "image"
    kwargs = dict(device="cpu")
    if image:
        kwargs["handle_timeout_termination"] = False
        if config != "ours_fs":
            kwargs["optimize_memory_usage"] = True
    if config == "sb3":
        from stable_baselines3.common.buffers import ReplayBuffer
    else:
        from functional_rb.sb3 import ReplayBuffer

        if config == "ours_fs":
            kwargs["frame_stack"] = FRAME_STACK
    with warnings.catch_warnings():
        # SB3 warns when its arrays exceed free memory (the memory case of 10^6 images)
        warnings.filterwarnings("ignore", message="This system does not have apparently enough")
        return ReplayBuffer(size, obs_space, act_space, **kwargs)


def fill_sb3(rb, stream: Stream, n: int, chunk: int) -> None:
    """Leave ``rb`` (SB3's) as ``n`` calls of ``add`` would (``n <= buffer_size``): writes
    its arrays chunk by chunk, then ``pos`` and ``full``."""
    if n > rb.buffer_size:
        raise ValueError(f"fill_sb3: n={n} exceeds buffer_size={rb.buffer_size}")
    pos, last = 0, None
    while pos < n:
        m = min(chunk, n - pos)
        c = stream.chunk(m, end=pos + m == n)
        rb.observations[pos : pos + m, 0] = c.obs()
        if not rb.optimize_memory_usage:
            rb.next_observations[pos : pos + m, 0] = c.next_obs()
        rb.actions[pos : pos + m, 0] = c.action.reshape(m, rb.action_dim)
        rb.rewards[pos : pos + m, 0] = c.reward
        rb.dones[pos : pos + m, 0] = c.done
        pos, last = pos + m, c
    if rb.optimize_memory_usage and last is not None:  # add writes next_obs one slot ahead
        rb.observations[n % rb.buffer_size, 0] = last.next_obs()[-1]
    rb.pos, rb.full = n % rb.buffer_size, n >= rb.buffer_size


def core_steps(rb, c: Chunk) -> dict:
    """``c``'s steps as ours' ``add`` hands them to its core buffer (``ReplayBuffer._step``
    does one step; here ``[n_envs = 1, T, ...]``): each stored leaf, wherever the stored item
    nests it, by its field name, in its stored dtype, its shape checked."""
    import jax

    frames = rb._frames is not None
    sources = {
        "observations": c.obs_newest() if frames else c.obs(),
        "next_observations": c.next_newest() if frames else c.next_obs(),
        "actions": c.action.reshape(len(c), rb.action_dim),
        "rewards": c.reward,
        "dones": c.done,
        "timeouts": np.zeros(len(c), np.float32),  # the streams have no truncations
    }

    paths = jax.tree_util.tree_flatten_with_path(rb._grid.dtypes)[0]
    shapes = {jax.tree_util.keystr(p): shape for (p, _), shape in zip(paths, rb._grid.leaf_shapes)}

    def leaf(path, dtype):
        where = jax.tree_util.keystr(path)
        keys = [getattr(k, "key", k) for k in path]
        name = "next_observations" if keys[-1] == "observations" and "next" in keys else keys[-1]
        x = sources.get(name)
        want = shapes[where][1:]
        if x is None or x.shape[1:] != want:
            raise ValueError(
                f"core_steps: stored leaf {where} (steps [T, *{want}]) is not one of "
                f"{sorted(sources)} of that shape; functional_rb.sb3's stored layout changed, "
                "update the fill."
            )
        return np.asarray(x, dtype)[None]

    return jax.tree_util.tree_map_with_path(leaf, rb._grid.dtypes)


def fill_ours(rb, stream: Stream, n: int, chunk: int) -> None:
    """Leave ``rb`` (ours) as ``n`` calls of ``add`` would (``n <= buffer_size``): chunks of
    steps written with the core write ``add`` ends in; ends an episode, so that ``add``'s
    frame-stack check takes the next step (a new episode's) without any history."""
    if n > rb.buffer_size:
        raise ValueError(f"fill_ours: n={n} exceeds buffer_size={rb.buffer_size}")
    pos = 0
    while pos < n:
        m = min(chunk, n - pos)
        c = stream.chunk(m, end=pos + m == n)
        if rb._ring is not None:  # frames on the host: the ring is filled by add itself
            for step in c.steps():
                rb.add(*step)
        else:
            rb.pos, rb.full = rb._grid.add(core_steps(rb, c), rb.pos, rb.full)
        pos += m
    import jax

    jax.block_until_ready(rb._grid.state)


def fill(config: str, rb, stream: Stream, n: int) -> float:
    """Fill ``rb`` with ``n`` steps of ``stream``; seconds taken."""
    chunk = 1000 if stream.kind == "image" else 10_000  # divides the sizes: one compile
    t = time.perf_counter()
    (fill_sb3 if config == "sb3" else fill_ours)(rb, stream, n, chunk)
    return time.perf_counter() - t


def array_bytes(config: str, rb) -> int:
    """The bytes of the buffer's arrays: SB3's NumPy arrays (as allocated), ours' core state."""
    if config == "sb3":
        names = ["observations", "actions", "rewards", "dones", "timeouts"]
        if not rb.optimize_memory_usage:
            names.append("next_observations")
        return int(sum(getattr(rb, k).nbytes for k in names))
    # the core state, host arrays (HostStorage) included, and the frame ring (frames on the host)
    return rb._grid.nbytes() + (0 if rb._ring is None else rb._ring.nbytes)


FILL_CHECKS = ("vector/sb3", "vector/ours", "image/sb3", "image/ours_fs", "image/dropin")
# SB3's fills only: ours' compile a few TED programs each (seconds), too long for a smoke run
QUICK_FILL_CHECKS = ("vector/sb3", "image/sb3")


def check_fills(
    channels_first: bool = True, only=FILL_CHECKS, size: int = 48, chunk: int = 16
) -> dict:
    """Each buffer's fill against ``add`` step by step on the same stream (``size`` steps in
    chunks of ``chunk``, episodes of 16-23 steps, the ring wrapped), then 4 more ``add`` calls
    on each: the arrays in SB3's layout (ours: the read-only copies its attributes return)
    and a sample of each must be equal. ``only``: the ``"kind/config"`` pairs to check (of
    :data:`FILL_CHECKS`). Returns ``{"kind/config": True}``; raises ``AssertionError`` naming
    the field otherwise."""
    out = {}
    for kind, configs in (("vector", ("sb3", "ours")), ("image", ("sb3", "ours_fs", "dropin"))):
        for config in configs:
            if f"{kind}/{config}" not in only:
                continue
            filled, added = (make_buffer(config, kind, size, channels_first) for _ in range(2))
            s_fill, s_add = (
                Stream(kind, seed=3, channels_first=channels_first, episodes=(16, 24))
                for _ in range(2)
            )
            (fill_sb3 if config == "sb3" else fill_ours)(filled, s_fill, size, chunk)
            for start in range(0, size, chunk):
                m = min(chunk, size - start)
                for step in s_add.chunk(m, end=start + m == size).steps():
                    added.add(*step)
            for rb, stream in ((filled, s_fill), (added, s_add)):
                for step in stream.chunk(4).steps():
                    rb.add(*step)
            where = f"check_fills {kind}/{config}"
            assert (filled.pos, filled.full) == (added.pos, added.full) == (4, True), where
            names = ["observations", "actions", "rewards", "dones", "timeouts"]
            if config != "sb3" or not filled.optimize_memory_usage:
                names.append("next_observations")  # ours rebuilds it in every layout
            for name in names:
                a, b = getattr(filled, name), getattr(added, name)
                np.testing.assert_array_equal(a, b, f"{where}: {name}")
            batches = []
            for rb in (filled, added):
                np.random.seed(0)
                batches.append(rb.sample(16))
            for a, b, name in zip(*batches, batches[0]._fields):
                if a is None or b is None:  # SB3's optional discounts
                    assert a is None and b is None, f"{where}: {name}"
                else:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"{where}: {name}")
            out[f"{kind}/{config}"] = True
    return out


# ----------------------------------------------------------------------------- step
@dataclasses.dataclass
class Holder:
    """One buffer, its stream and how long its fill took."""

    config: str
    rb: Any
    stream: Stream
    fill_s: float
    nbytes: int


@dataclasses.dataclass
class Side:
    name: str
    holder: Holder
    output: str | None  # ours: the output array type; SB3: None


def time_block(side: Side, steps: list[tuple], batch: int) -> tuple[float, float, float]:
    """Microseconds per step of ``add`` + ``sample`` over ``steps``: (total, add, sample)."""
    rb = side.holder.rb
    if side.output is not None:
        rb.output = side.output
    add, sample, clock = rb.add, rb.sample, _clock
    t_add = t_sample = 0.0
    out = None
    start = clock()
    for step in steps:
        t0 = clock()
        add(*step)
        t1 = clock()
        out = sample(batch)
        t_sample += clock() - t1
        t_add += t1 - t0
    if side.output == "jax":
        import jax

        jax.block_until_ready(tuple(out))
    total = clock() - start
    n = len(steps)
    return total / n * 1e6, t_add / n * 1e6, t_sample / n * 1e6


def run_step(kind: str, size: int, s: Sizes, args, log) -> dict:
    """One (observation kind, size): build and fill each buffer, warm up, time the rounds."""
    channels_first = args.channels == "first"
    configs = ["sb3", "ours"] if kind == "vector" else ["sb3", "ours_fs", "dropin"]
    skipped = {}
    if kind == "image":
        stacks = f"needs over {size * FRAME_STACK * IMAGE_SIDE**2 / 1e9:.1f} GB (one stack a step)"
        if size > s.sb3_image_max:
            skipped["sb3"] = stacks
        if size > s.dropin_image_max:
            skipped["dropin"] = stacks
    holders = {}
    for config in configs:
        if config in skipped:
            continue
        stream = Stream(kind, seed=0, channels_first=channels_first)
        rb = make_buffer(config, kind, size, channels_first)
        fill_s = fill(config, rb, stream, size)
        holders[config] = Holder(config, rb, stream, fill_s, array_bytes(config, rb))
        log(f"[step {kind} {size:,}] {config}: filled in {fill_s:.1f} s")
    sides = [Side(SB3, holders["sb3"], None)] if "sb3" in holders else []
    if kind == "vector":
        sides += [
            Side(OURS_TORCH, holders["ours"], "torch"),
            Side(OURS_JAX, holders["ours"], "jax"),
        ]
    else:
        sides += [
            Side(FS_TORCH, holders["ours_fs"], "torch"),
            Side(FS_JAX, holders["ours_fs"], "jax"),
        ]
        if "dropin" in holders:
            sides.append(Side(DROPIN, holders["dropin"], "torch"))
    batch = s.vector_batch if kind == "vector" else s.image_batch
    n_steps = s.steps if kind == "vector" else s.image_steps
    for side in sides:  # warm-up: compile, first touches
        time_block(side, side.holder.stream.chunk(3).steps(), batch)
    times = {side.name: {"total": [], "add": [], "sample": []} for side in sides}
    loads = []
    for r in range(s.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        before = _load()
        for side in order:
            steps = side.holder.stream.chunk(n_steps).steps()
            gc.collect()
            total, t_add, t_sample = time_block(side, steps, batch)
            times[side.name]["total"].append(total)
            times[side.name]["add"].append(t_add)
            times[side.name]["sample"].append(t_sample)
        loads.append((before, _load()))
        log(
            f"[step {kind} {size:,}] round {r + 1}/{s.rounds}: load {before:.2f} -> {loads[-1][1]:.2f}"
        )
    row = {
        "obs": kind,
        "size": size,
        "batch": batch,
        "steps_per_round": n_steps,
        "fill_s": {h.config: h.fill_s for h in holders.values()},
        "array_bytes": {h.config: h.nbytes for h in holders.values()},
        "skipped": skipped,
        "sides": {name: {part: summary(v) for part, v in t.items()} for name, t in times.items()},
        "ratio_sb3_over_ours": {},
        "loads": loads,
    }
    if SB3 in times:
        theirs = times[SB3]["total"]
        for name, t in times.items():
            if name != SB3:
                row["ratio_sb3_over_ours"][name] = summary(
                    [a / b for a, b in zip(theirs, t["total"])]
                )
    holders.clear()
    sides.clear()
    gc.collect()
    return row


def run_steps(s: Sizes, args, log) -> dict:
    t = time.perf_counter()
    checked = check_fills(
        args.channels == "first", QUICK_FILL_CHECKS if args.quick else FILL_CHECKS
    )
    log(f"[step] fills checked against add step by step in {time.perf_counter() - t:.1f} s")
    np.random.seed(0)  # SB3's and ours' sample draw from NumPy's global generator
    rows = []
    for kind, sizes in (("vector", s.vector_sizes), ("image", s.image_sizes)):
        for size in sizes:
            rows.append(run_step(kind, size, s, args, log))
    return {"fills_match_add": checked, "rows": rows}


# ----------------------------------------------------------------------------- memory
COMPUTE_FROM = 1000  # steps of the SB3 buffer whose arrays are scaled to a size not built
MEMORY_CASES = (
    # (case, config, which size, filled; not filled: array bytes computed, nothing measured)
    ("ours frame_stack=4, filled", "ours_fs", "memory_size", True),
    ("SB3 optimize_memory_usage, filled", "sb3", "memory_sb3_size", True),
    ("SB3 optimize_memory_usage, computed", "sb3", "memory_size", False),
    ("ours drop-in (optimize_memory_usage), filled", "dropin", "memory_sb3_size", True),
)


def memory_child(config: str, size: int, filled: bool, channels_first: bool) -> dict:
    """In a fresh process: build and fill one image buffer of ``size`` steps; its peak RSS and
    array bytes. Not ``filled`` (SB3 only): build it at ``min(size, COMPUTE_FROM)`` steps and
    scale its array bytes to ``size`` (exact: each array is ``[buffer_size, n_envs, ...]``);
    at 10^6 steps NumPy cannot even reserve them on this machine (Linux refuses a 26 GiB
    ``np.zeros`` where RAM is 23 GB), so nothing of that size is measured."""
    if config == "sb3":
        import stable_baselines3.common.buffers  # noqa: F401
    else:
        import functional_rb.sb3  # noqa: F401
    import gymnasium  # noqa: F401
    import torch  # noqa: F401

    if not filled and config != "sb3":
        raise ValueError("memory_child: only SB3's array bytes are computed (not filled)")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    built = size if filled else min(size, COMPUTE_FROM)
    rb = make_buffer(config, "image", built, channels_first)
    fill_s = 0.0
    if filled:
        fill_s = fill(config, rb, Stream("image", seed=0, channels_first=channels_first), size)
        sample = rb.sample(32)
        assert sample.observations.shape[0] == 32
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "vm_hwm_bytes": _hwm(),
        "config": config,
        "size": size,
        "built_size": built,
        "filled": filled,
        "fill_s": fill_s,
        "baseline_rss_bytes": base,
        "peak_rss_bytes": peak,
        "array_bytes": array_bytes(config, rb) * size // built,
    }


def _hwm() -> int:
    """This process's own peak RSS (``VmHWM``: the high-water mark of its address space
    since ``exec``), bytes; 0 where ``/proc`` has none."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(argv: list[str], small_parent: bool = False) -> dict:
    """Run this script with ``argv`` in a fresh process; its last stdout line, as JSON, with
    ``process_s`` and the load before and after.

    ``small_parent``: start it from ``/bin/sh`` rather than from this process. Linux carries a
    process's ``ru_maxrss`` across ``fork`` and ``exec``: a child forked from this process
    (which holds torch, JAX and the step workload's leftovers) would report at least this
    process's resident size as its peak; a child forked by a shell reports its own."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv]
    if small_parent:  # sh forks python (the "; exit" keeps it from exec-ing in place)
        cmd = ["/bin/sh", "-c", '"$0" "$@"; exit $?', *cmd]
    before, t = _load(), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out.update(process_s=seconds, loads=(before, _load()))
    return out


def _children(argvs: list[list[str]], jobs: int, small_parent: bool = False) -> list[dict]:
    """:func:`_child` of each ``argvs`` in order, ``jobs`` at a time (1: one after another,
    as measurements run; more only for smoke runs)."""
    if jobs <= 1:
        return [_child(argv, small_parent) for argv in argvs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda argv: _child(argv, small_parent), argvs))


def run_memory(s: Sizes, args, log) -> dict:
    argvs = [
        ["--memory-child", config, str(getattr(s, which)), str(int(filled))]
        + ["--channels", args.channels]
        for _, config, which, filled in MEMORY_CASES
    ]
    cases = _children(argvs, args.jobs, small_parent=True)
    for out, (case, _, _, filled) in zip(cases, MEMORY_CASES):
        out.update(case=case)
        out["measured"] = (
            "peak RSS (measured)"
            if filled
            else f"array nbytes computed ({out['built_size']:,} steps' x "
            f"{out['size'] // out['built_size']:,}); RSS not measured"
        )
        log(
            f"[memory] {case} at {out['size']:,}: peak RSS {out['peak_rss_bytes'] / 1e9:.2f} GB "
            f"(VmHWM {out['vm_hwm_bytes'] / 1e9:.2f}), arrays {out['array_bytes'] / 1e9:.2f} GB"
        )
    ours = cases[0]
    return {
        "cases": cases,
        "target_bytes": MEMORY_TARGET_BYTES,
        "ours_meets_target": ours["peak_rss_bytes"] <= MEMORY_TARGET_BYTES,
    }


# ----------------------------------------------------------------------------- cleanrl
def cleanrl_dqn(side: str, seed: int, s: Sizes, torch_threads: int) -> dict:
    """CleanRL's ``dqn.py`` (CartPole-v1; its defaults but the sizes of ``s``), written for
    gymnasium 1.x: same-step autoreset gives what gymnasium 0.29 gave CleanRL (the reset
    observation after a done, the final one in the infos). Only the import of
    ``ReplayBuffer`` depends on ``side``."""
    t_import = time.perf_counter()
    import random

    import gymnasium as gym
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.optim as optim

    if side == "sb3":
        from stable_baselines3.common.buffers import ReplayBuffer
    else:
        from functional_rb.sb3 import ReplayBuffer
    import_s = time.perf_counter() - t_import
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)

    learning_rate, gamma, tau, target_network_frequency = 2.5e-4, 0.99, 1.0, 500
    start_e, end_e, exploration_fraction = 1.0, 0.05, 0.5

    class QNetwork(nn.Module):
        def __init__(self, env):
            super().__init__()
            self.network = nn.Sequential(
                nn.Linear(np.array(env.single_observation_space.shape).prod(), 120),
                nn.ReLU(),
                nn.Linear(120, 84),
                nn.ReLU(),
                nn.Linear(84, env.single_action_space.n),
            )

        def forward(self, x):
            return self.network(x)

    def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
        slope = (end_e - start_e) / duration
        return max(slope * t + start_e, end_e)

    def make_env(env_id, seed):
        def thunk():
            env = gym.make(env_id)
            env = gym.wrappers.RecordEpisodeStatistics(env)
            env.action_space.seed(seed)
            return env

        return thunk

    start = time.perf_counter()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    device = torch.device("cpu")

    envs = gym.vector.SyncVectorEnv(
        [make_env("CartPole-v1", seed)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.single_action_space.seed(seed)
    q_network = QNetwork(envs).to(device)
    optimizer = optim.Adam(q_network.parameters(), lr=learning_rate)
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(
        s.cleanrl_buffer,
        envs.single_observation_space,
        envs.single_action_space,
        device,
        handle_timeout_termination=False,
    )
    returns, lengths = [], []
    obs, _ = envs.reset(seed=seed)
    for global_step in range(s.cleanrl_steps):
        epsilon = linear_schedule(
            start_e, end_e, exploration_fraction * s.cleanrl_steps, global_step
        )
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            q_values = q_network(torch.Tensor(obs).to(device))
            actions = torch.argmax(q_values, dim=1).cpu().numpy()

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        final = infos.get("final_info", {})
        if "episode" in final:
            for i in np.nonzero(final["_episode"])[0]:
                returns.append(float(final["episode"]["r"][i]))
                lengths.append(int(final["episode"]["l"][i]))

        real_next_obs = next_obs.copy()
        for idx, trunc in enumerate(truncations):
            if trunc:
                real_next_obs[idx] = infos["final_obs"][idx]
        rb.add(obs, real_next_obs, actions, rewards, terminations, infos)
        obs = next_obs

        if global_step > s.cleanrl_learning_starts:
            if global_step % s.cleanrl_train_frequency == 0:
                data = rb.sample(s.cleanrl_batch)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_observations).max(dim=1)
                    td_target = data.rewards.flatten() + gamma * target_max * (
                        1 - data.dones.flatten()
                    )
                old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

            if global_step % target_network_frequency == 0:
                for target_param, q_param in zip(
                    target_network.parameters(), q_network.parameters()
                ):
                    target_param.data.copy_(tau * q_param.data + (1.0 - tau) * target_param.data)
    envs.close()
    last = returns[-10:]
    return {
        "side": side,
        "seed": seed,
        "import_s": import_s,
        "loop_s": time.perf_counter() - start,
        "episodes": len(returns),
        "final_return_mean10": float(np.mean(last)) if last else float("nan"),
        "last_return": returns[-1] if returns else float("nan"),
        "returns_digest": float(np.sum(np.asarray(returns) * np.arange(1, len(returns) + 1))),
    }


def _sizes_argv(s: Sizes) -> list[str]:
    out = []
    for name in (
        "cleanrl_steps",
        "cleanrl_buffer",
        "cleanrl_batch",
        "cleanrl_learning_starts",
        "cleanrl_train_frequency",
    ):
        out += [f"--{name.replace('_', '-')}", str(getattr(s, name))]
    return out


def run_cleanrl(s: Sizes, args, log) -> dict:
    orders = [("sb3", "ours") if r % 2 == 0 else ("ours", "sb3") for r in range(len(s.seeds))]
    argvs = [
        ["--cleanrl-child", side, str(seed), "--torch-threads", str(args.torch_threads)]
        + _sizes_argv(s)
        for seed, order in zip(s.seeds, orders)
        for side in order
    ]
    runs = _children(argvs, args.jobs)
    for out in runs:
        log(
            f"[cleanrl] seed {out['seed']} {out['side']}: process {out['process_s']:.1f} s, "
            f"loop {out['loop_s']:.1f} s, final return {out['final_return_mean10']:.1f}"
        )
    loads = [(runs[2 * i]["loads"][0], runs[2 * i + 1]["loads"][1]) for i in range(len(s.seeds))]
    per_seed = []
    for seed in s.seeds:
        a, b = (
            next(x for x in runs if x["side"] == k and x["seed"] == seed) for k in ("sb3", "ours")
        )
        per_seed.append(
            {
                "seed": seed,
                "loop_ratio_ours_over_sb3": b["loop_s"] / a["loop_s"],
                "process_ratio_ours_over_sb3": b["process_s"] / a["process_s"],
                "same_returns": a["returns_digest"] == b["returns_digest"]
                and a["episodes"] == b["episodes"],
            }
        )
    return {
        "script": "CleanRL-style DQN written in benchmarks/sb3.py (cleanrl_dqn), after "
        "CleanRL's dqn.py; CleanRL itself is not in this checkout",
        "runs": runs,
        "per_seed": per_seed,
        "loads": loads,
    }


# ----------------------------------------------------------------------------- report
def _cell(d: dict, fmt: str) -> str:
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"


def step_table(result: dict) -> str:
    out = [
        "| obs | stored | side | us/step | add us | sample us | SB3 / ours | fill s |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    configs = {SB3: "sb3", OURS_TORCH: "ours", OURS_JAX: "ours", FS_TORCH: "ours_fs"}
    configs.update({FS_JAX: "ours_fs", DROPIN: "dropin"})
    for row in result["rows"]:
        for name, t in row["sides"].items():
            ratio = row["ratio_sb3_over_ours"].get(name)
            fill_s = row["fill_s"][configs[name]]
            out.append(
                f"| {row['obs']} | {row['size']:,} | {name} | {_cell(t['total'], ',.1f')} | "
                f"{t['add']['median']:,.1f} | {t['sample']['median']:,.1f} | "
                f"{_cell(ratio, '.2f') if ratio else ''} | {fill_s:.1f} |"
            )
        for config, why in row["skipped"].items():
            out.append(f"| {row['obs']} | {row['size']:,} | {config}: not run, {why} | | | | | |")
    return "\n".join(out)


def step_loads(result: dict) -> str:
    return "\n".join(
        f"- {row['obs']} {row['size']:,}: "
        + ", ".join(f"{a:.2f}->{b:.2f}" for a, b in row["loads"])
        for row in result["rows"]
    )


def memory_table(result: dict) -> str:
    out = [
        "| case | steps | peak RSS GB (ru_maxrss) | VmHWM GB | before the buffer GB | "
        "array GB | what | fill s | load |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for c in result["cases"]:
        rss = [c["peak_rss_bytes"], c["vm_hwm_bytes"], c["baseline_rss_bytes"]]
        rss = [f"{x / 1e9:.2f}" if c["filled"] else "-" for x in rss]
        out.append(
            f"| {c['case']} | {c['size']:,} | {' | '.join(rss)} | "
            f"{c['array_bytes'] / 1e9:.2f} | {c['measured']} | {c['fill_s']:.1f} | "
            f"{c['loads'][0]:.2f}->{c['loads'][1]:.2f} |"
        )
    met = "met" if result["ours_meets_target"] else "**not met**"
    out.append(f"\nours at most {result['target_bytes'] / 1e9:.0f} GB peak RSS: {met}")
    return "\n".join(out)


def cleanrl_table(result: dict) -> str:
    out = [
        "| seed | buffer | process s | loop s | import s | episodes | final return (last 10) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for run in sorted(result["runs"], key=lambda x: (x["seed"], x["side"] != "sb3")):
        out.append(
            f"| {run['seed']} | {run['side']} | {run['process_s']:.1f} | {run['loop_s']:.1f} | "
            f"{run['import_s']:.1f} | {run['episodes']} | {run['final_return_mean10']:.1f} |"
        )
    for p in result["per_seed"]:
        out.append(
            f"\nseed {p['seed']}: loop ours / SB3 {p['loop_ratio_ours_over_sb3']:.2f}, process "
            f"{p['process_ratio_ours_over_sb3']:.2f}, same returns: {p['same_returns']}"
        )
    return "\n".join(out)


def versions() -> dict:
    from importlib.metadata import version

    return {
        name: version(name) for name in ("stable-baselines3", "torch", "jax", "numpy", "gymnasium")
    } | {"cpus": os.cpu_count(), "checkout": checkout()}


def checkout() -> dict:
    """The commit measured, and the uncommitted changes to ``functional_rb/`` (their
    ``git diff`` hashed), so that a figure can be tied to the code that made it."""
    import hashlib

    def git(*cmd):
        p = subprocess.run(["git", *cmd], cwd=_HERE.parent, capture_output=True, text=True)
        return p.stdout if p.returncode == 0 else ""

    diff = git("diff", "HEAD", "--", "functional_rb")
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "functional_rb_changed": git("diff", "HEAD", "--name-only", "--", "functional_rb").split(),
        "functional_rb_untracked": git(
            "ls-files", "--others", "--exclude-standard", "--", "functional_rb"
        ).split(),
        "functional_rb_diff_sha1": hashlib.sha1(diff.encode()).hexdigest() if diff else None,
    }


# ----------------------------------------------------------------------------- the run
def _ints(text: str) -> int:
    return int(float(text))


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a result")
    ap.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--out", default=None, help="write every round as JSON here")
    ap.add_argument("--channels", choices=("first", "last"), default="first")
    ap.add_argument(
        "--torch-threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)"
    )
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="subprocesses (memory, cleanrl) at a time; more than 1 for smoke runs only",
    )
    ap.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="first wait (up to 20 min, polling every 30 s) for the 1-minute load below this",
    )
    for f in dataclasses.fields(Sizes):
        many = isinstance(f.default, tuple)
        ap.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=_ints,
            nargs="+" if many else None,
            default=None,
            help=f"default {f.default} ({QUICK.get(f.name, f.default)} with --quick)",
        )
    # one case in a fresh process (the memory and cleanrl workloads start these)
    ap.add_argument("--memory-child", nargs=3, metavar=("CONFIG", "SIZE", "FILLED"))
    ap.add_argument("--cleanrl-child", nargs=2, metavar=("SIDE", "SEED"))
    args = ap.parse_args(argv)
    sizes = dict(QUICK) if args.quick else {}
    for f in dataclasses.fields(Sizes):
        value = getattr(args, f.name)
        if value is not None:
            sizes[f.name] = tuple(value) if isinstance(f.default, tuple) else value
    s = Sizes(**sizes)
    if s.rounds < 1 or s.steps < 1 or s.image_steps < 1:
        ap.error("--rounds, --steps and --image-steps must be at least 1")
    return args, s


def wait_for_load(limit: float, log, poll: float = 30, most: float = 1200) -> dict:
    start, first = time.time(), _load()
    while _load() >= limit and time.time() - start < most:
        log(f"load {_load():.2f} >= {limit}: waiting")
        time.sleep(poll)
    return {"limit": limit, "first": first, "waited_s": time.time() - start, "at_start": _load()}


def main(argv=None) -> int:
    global _clock
    if argv is None:
        argv = sys.argv[1:]
    if "--memory-child" in argv:  # the memory case needs the arguments only
        args, _ = parse_args(argv)
        config, size, filled = args.memory_child
        print(json.dumps(memory_child(config, int(size), filled == "1", args.channels == "first")))
        return 0
    args, s = parse_args(argv)
    if args.cleanrl_child:
        side, seed = args.cleanrl_child
        print(json.dumps(cleanrl_dqn(side, int(seed), s, args.torch_threads)))
        return 0
    if args.cpu_time:
        _clock = time.process_time

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    waited = wait_for_load(args.wait_load, log) if args.wait_load else None
    if "step" in args.only:  # the other workloads' processes set their own
        _set_torch_threads(args.torch_threads)
    np.random.seed(0)  # SB3's and ours' sample draw from NumPy's global generator
    info = versions()
    start = _now()
    print(
        f"SB3's ReplayBuffer against functional_rb.sb3's, {start}; {info}, torch threads "
        f"{args.torch_threads}, {'CPU' if args.cpu_time else 'wall'} time"
        f"{', --quick (not a result)' if args.quick else ''}",
        flush=True,
    )
    results: dict = {}
    runners = {"step": run_steps, "memory": run_memory, "cleanrl": run_cleanrl}
    titles = {
        "step": "step: add 1 + sample per step, us (median (min-max) of rounds)",
        "memory": "memory: Atari-shaped transitions, one fresh process per case",
        "cleanrl": "cleanrl: CleanRL-style DQN on CartPole-v1, one fresh process per run",
    }
    tables = {"step": step_table, "memory": memory_table, "cleanrl": cleanrl_table}
    for name in WORKLOADS:
        if name in args.only:
            t = time.perf_counter()
            results[name] = runners[name](s, args, log)
            results[name]["seconds"] = time.perf_counter() - t
            print(f"\n{titles[name]}\n\n{tables[name](results[name])}", flush=True)
            if name == "step":
                print("\nload average (1 min) before -> after each round:")
                print(step_loads(results[name]))
    end = _now()
    print(f"\nstarted {start}, ended {end}; load average now {os.getloadavg()}")
    if args.out:
        doc = {
            "benchmark": "sb3",
            "started": start,
            "ended": end,
            "quick": args.quick,
            "clock": "cpu" if args.cpu_time else "wall",
            "torch_threads": args.torch_threads,
            "channels": args.channels,
            "sizes": dataclasses.asdict(s),
            "wait_load": waited,
            **info,
            **results,
        }
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
