"""Pure-Python reference models of what a buffer must hold, and readers of a concrete state.

Everything here works on concrete (host) values; it never calls a component's private code.
The models restate the documented semantics of the core in the plainest Python:

* :class:`RingModel`: a FIFO ring: the ``j``-th item ever added to a row lives in slot
  ``j % row_capacity`` while it is among the newest ``row_capacity``;
* :class:`TopKModel`: ``MaxValueWriter``: the stored ranks are the top ``capacity`` ranks
  ever added (NaN never stored), each stored item one that was added with its rank;
* :class:`AddedModel`: any other writer: every stored item is one that was added;
* :class:`PriorityModel`: raw priorities per flat position (``PrioritizedSampler`` and
  ``PrioritizedSliceSampler`` update rules);
* :func:`trajectories`: the episode partition of a row's stored steps, from the stored end
  flags or trajectory ids (TorchRL's ``find_start_stop_traj`` on the storage as it is).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from functional_rb.samplers.prioritized import PrioritizedSampler
from functional_rb.samplers.prioritized_slices import PrioritizedSliceSampler
from functional_rb.testing._data import get_path, item_key

PyTree = Any


# ------------------------------------------------------------------ reading a state
def host(tree: PyTree) -> PyTree:
    """``tree`` with NumPy leaves (one device-to-host transfer per leaf)."""
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def counters(rb, state) -> tuple[int, int]:
    """``(cursor, filled)`` of the writer state (every writer state has both, int32)."""
    return int(state.writer.cursor), int(state.writer.filled)


def ring_positions(rb, state) -> list[np.ndarray]:
    """Per row, the flat positions of the stored steps of a FIFO ring, oldest first
    (read from the writer's ``cursor`` and ``filled``)."""
    lay = rb.layout(state)
    cursor, filled = counters(rb, state)
    ages = np.arange(filled, 0, -1)
    t = (cursor - ages) % lay.row_capacity
    return [(e * lay.row_capacity + t).astype(np.int32) for e in range(lay.num_envs)]


def prefix_positions(rb, state) -> np.ndarray:
    """Flat positions ``t < filled`` of every row: where any writer keeps its items."""
    lay = rb.layout(state)
    _, filled = counters(rb, state)
    return np.array(
        [e * lay.row_capacity + t for e in range(lay.num_envs) for t in range(filled)], np.int32
    )


@functools.lru_cache(maxsize=64)
def _jitted_get(rb):
    return jax.jit(rb.get)


def read(rb, state, positions: np.ndarray) -> PyTree:
    """The stored items at flat ``positions`` (NumPy leaves ``[len(positions), ...]``), read
    with ``rb.get`` (jitted once per buffer: these checks read often)."""
    positions = np.asarray(positions, np.int32)
    return host(_jitted_get(rb)(state, positions))


def leaf_rows(tree: PyTree) -> list[list]:
    """A batched tree ``[N, ...]`` as ``N`` lists of per-item leaves (flatten order)."""
    leaves = jax.tree_util.tree_leaves(tree)
    n = leaves[0].shape[0] if leaves else 0
    return [[x[i] for x in leaves] for i in range(n)]


# ------------------------------------------------------------------ trajectories
def step_signal(items: PyTree, end_key, traj_key) -> np.ndarray:
    """Per step the boundary signal: the trajectory id (``traj_key``) or whether any element
    of the end flag is set (``end_key``). ``items`` leaves ``[N, ...]``."""
    if traj_key is not None:
        ids = np.asarray(get_path(items, traj_key))
        return ids.reshape(ids.shape[0], -1)[:, 0]
    flags = np.asarray(get_path(items, end_key))
    return np.asarray(flags.reshape(flags.shape[0], -1).astype(bool).any(axis=1))


def trajectories(signal: np.ndarray, by_ids: bool) -> list[int]:
    """Lengths of the trajectories of a row's stored steps (in time order, oldest first).

    The oldest stored step starts a trajectory; step ``i`` starts one when step ``i - 1``
    ended its episode (end flags) or carries another id (ids); the newest step ends one."""
    n = len(signal)
    if n == 0:
        return []
    starts = [0] + [
        i for i in range(1, n) if (signal[i] != signal[i - 1] if by_ids else bool(signal[i - 1]))
    ]
    return [b - a for a, b in zip(starts, starts[1:] + [n])]


def remaining_steps(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per stored step (time order): steps left in its trajectory (itself included), and
    whether it is its trajectory's first stored step."""
    rem = np.concatenate([np.arange(n, 0, -1) for n in lengths]) if lengths else np.zeros(0)
    first = np.concatenate([np.arange(n) == 0 for n in lengths]) if lengths else np.zeros(0)
    return rem.astype(np.int64), first.astype(bool)


# ------------------------------------------------------------------ writer models
class RingModel:
    """A FIFO ring of ``num_envs`` rows of ``row_capacity`` slots (see module docstring)."""

    def __init__(self, num_envs: int, row_capacity: int):
        self.num_envs, self.row_capacity = num_envs, row_capacity
        self.added = 0  # items added per row
        self.slots: list[dict] = [dict() for _ in range(num_envs)]  # slot -> (key, leaves)

    def add(self, rows: list[list]) -> np.ndarray:
        """Add ``rows[e]`` (lists of per-item leaves, oldest first) to each row; returns the
        flat positions written (the last ``row_capacity`` items of each row)."""
        r = self.row_capacity
        written = []
        steps = len(rows[0])
        for e, items in enumerate(rows):
            for j, leaves in enumerate(items):
                if j >= steps - r:
                    slot = (self.added + j) % r
                    self.slots[e][slot] = (item_key(leaves), leaves)
                    written.append(e * r + slot)
        self.added += steps
        return np.array(written, np.int32)

    @property
    def filled(self) -> int:
        return min(self.added, self.row_capacity)

    @property
    def cursor(self) -> int:
        return self.added % self.row_capacity

    def stored(self) -> dict:
        """``{flat position: (item key, item leaves)}`` of the stored items."""
        return {
            e * self.row_capacity + s: k
            for e in range(self.num_envs)
            for s, k in self.slots[e].items()
        }

    def rows_in_order(self) -> list[np.ndarray]:
        """Per row, the flat positions of the stored items, oldest first."""
        r, f = self.row_capacity, self.filled
        first = self.added - f
        return [
            np.array([e * r + (first + j) % r for j in range(f)], np.int32)
            for e in range(self.num_envs)
        ]


class TopKModel:
    """``MaxValueWriter``'s contract: the top ``capacity`` ranks of everything added."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ranks: list[float] = []
        self.keys: dict = {}  # item key -> its rank

    def add(self, rows: list[list], ranks: np.ndarray) -> None:
        for leaves, rank in zip(rows[0], ranks):
            if not np.isnan(rank):
                self.ranks.append(float(rank))
                self.keys[item_key(leaves)] = float(rank)

    @property
    def filled(self) -> int:
        return min(len(self.ranks), self.capacity)

    def top(self) -> list[float]:
        return sorted(self.ranks)[len(self.ranks) - self.filled :]


class AddedModel:
    """Any writer: a stored item must be one of the items added."""

    def __init__(self):
        self.keys: set = set()

    def add(self, rows: list[list]) -> None:
        for items in rows:
            self.keys.update(item_key(leaves) for leaves in items)


# ------------------------------------------------------------------ priorities
F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass
class PriorityModel:
    """Raw priorities per flat position, following the documented rules of both prioritized
    samplers (``functional_rb.samplers.priorities``):

    * the stored value of ``p`` is ``min((p + eps) ** alpha, finfo(float32).max / (2 C))``;
    * new items get the value of the largest priority accepted so far (``max_priority``,
      starting at ``max_priority_init``);
    * ``update`` accepts an entry whose index is in ``[0, C)`` and holds an item and whose
      priority is finite and ``>= 0`` (anything else is ignored under jit, raises eagerly);
      duplicates resolve to the last occurrence;
    * ``slices=True`` (``PrioritizedSliceSampler``): in ``[num_slices, slice_len]`` indices a
      repeat of the previous index of its row is padding, and is skipped.
    """

    slices: bool
    alpha: float
    eps: float
    max_priority: float
    capacity: int

    def __post_init__(self):
        self.raw = np.zeros(self.capacity, np.float64)
        self.max_priority = float(np.float32(self.max_priority))

    @classmethod
    def for_sampler(cls, sampler, capacity: int) -> PriorityModel | None:
        for kind, slices in ((PrioritizedSampler, False), (PrioritizedSliceSampler, True)):
            if isinstance(sampler, kind):
                return cls(
                    slices,
                    sampler.alpha,
                    sampler.eps,
                    getattr(sampler, "max_priority_init", 1.0),
                    capacity,
                )
        return None

    def value(self, p) -> np.ndarray:
        """float32: the stored value of raw priorities ``p``."""
        with np.errstate(over="ignore", invalid="ignore"):
            v = (np.float32(p) + np.float32(self.eps)) ** np.float32(self.alpha)
        return np.minimum(v, np.float32(F32_MAX / (2.0 * self.capacity)))

    def on_add(self, positions: np.ndarray) -> None:
        self.raw[np.asarray(positions, np.int64)] = self.max_priority

    def update(
        self,
        indices: np.ndarray,
        priorities: np.ndarray,
        stored: np.ndarray,
        keep: np.ndarray | None = None,
    ) -> None:
        """Apply ``update(indices, priorities)``; ``stored``: bool ``[capacity]``; ``keep``:
        bool, the shape of ``indices``: entries an update from a sample applies (its slot
        not rewritten since the draw, an item), None: all (bare indices)."""
        indices = np.asarray(indices)
        priorities = np.broadcast_to(np.asarray(priorities, np.float64), indices.shape)
        keep = np.ones(indices.shape, bool) if keep is None else np.array(keep, bool)
        if self.slices and indices.ndim == 2:
            keep[:, 1:] &= indices[:, 1:] != indices[:, :-1]
        seen = 0.0
        for i, p, k in zip(indices.reshape(-1), priorities.reshape(-1), keep.reshape(-1)):
            i, p = int(i), float(p)
            if k and 0 <= i < self.capacity and np.isfinite(p) and p >= 0 and stored[i]:
                self.raw[i] = float(np.float32(min(p, F32_MAX)))
                seen = max(seen, self.raw[i])
        self.max_priority = max(self.max_priority, seen)

    def values(self, stored: np.ndarray) -> np.ndarray:
        """float32 ``[capacity]``: each stored position's value, 0 elsewhere."""
        return np.where(stored, self.value(self.raw), np.float32(0)).astype(np.float32)


def stored_mask(rb, state) -> np.ndarray:
    """bool ``[capacity]``: which flat positions hold an item (``t < filled``)."""
    lay = rb.layout(state)
    _, filled = counters(rb, state)
    t = np.arange(lay.capacity) % lay.row_capacity
    return t < filled
