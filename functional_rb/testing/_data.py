"""Deterministic item streams for any item structure (NumPy; no hypothesis needed).

:class:`StepStream` produces batches shaped like a buffer's example, step after step, with
episodes that continue across calls. Leaves it recognises get episode semantics, so every
core component sees meaningful data:

* end flags ``("next", "done")`` (episode ends), ``("next", "truncated")`` /
  ``("next", "terminated")`` (how it ended); root ``"done"`` / ``"truncated"`` /
  ``"terminated"`` are False (TED: a step is not done before it is taken);
* ``("collector", "traj_ids")``: one id per episode (an integer leaf of one element);
* TED pairs: a leaf ``("next", *k)`` with a root leaf ``k`` of the same shape and dtype
  (``k`` not a flag or reward) holds the next observation, and the following step's root
  value is that observation unless the episode ended (then a fresh reset value).

Every other leaf is random: small integers (so that values, reset observations included,
coincide now and then), bools, or floats on a half-integer grid (ties in ranks happen).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

PyTree = Any

END_KEY = ("next", "done")
TRUNCATED_KEY = ("next", "truncated")
TERMINATED_KEY = ("next", "terminated")
ROOT_FLAGS = (("done",), ("truncated",), ("terminated",))
TRAJ_KEY = ("collector", "traj_ids")
_NOT_PAIRED = ("done", "terminated", "truncated", "reward")


def key_of(path) -> tuple:
    """A ``jax.tree_util`` key path as a tuple of plain keys (dict keys, sequence indices)."""
    out = []
    for p in path:
        for attr in ("key", "idx", "name"):
            if hasattr(p, attr):
                out.append(getattr(p, attr))
                break
        else:  # pragma: no cover - a key kind jax adds later
            out.append(str(p))
    return tuple(out)


def item_leaves(example: PyTree, ndim: int):
    """``(treedef, [(key tuple, item shape, dtype)], num_envs)`` of one example item (for
    ``ndim=2`` its leaves are ``[num_envs, ...]`` and the item shape drops that axis)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(example)
    leaves, num_envs = [], 1
    for path, x in flat:
        shape = tuple(np.shape(x))
        dtype = np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)
        if ndim == 2:
            num_envs, shape = shape[0], shape[1:]
        leaves.append((key_of(path), shape, dtype))
    return treedef, leaves, num_envs


def random_values(rng: np.random.Generator, shape: tuple, dtype: np.dtype, values: int = 4):
    """Random values of ``dtype``: small integers, bools, or floats on a half-integer grid."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0, values, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.integers(-values, values, shape) * 0.5).astype(dtype)
    return (rng.integers(-2 * values, 2 * values, shape) * 0.5).astype(dtype)


class StepStream:
    """Batches of steps for ``example``'s structure; episodes continue across calls.

    Args:
      example: one item (``ndim=2``: one vectorized step, leaves ``[num_envs, ...]``).
      ndim: 1 (batches ``[B, ...]``) or 2 (``[num_envs, T, ...]``).
      seed: the stream's seed; ``take(steps, seed)`` mixes in its own seed, so a stream is a
        deterministic function of the calls made on it.
      p_end: probability that a step ends its episode; p_truncated: that an end is a
        truncation.
    """

    def __init__(
        self,
        example: PyTree,
        *,
        ndim: int = 1,
        seed: int = 0,
        p_end: float = 0.25,
        p_truncated: float = 0.3,
        values: int = 4,
    ):
        self.treedef, self.leaves, self.num_envs = item_leaves(example, ndim)
        self.ndim, self.seed, self.calls = ndim, int(seed), 0
        self.p_end, self.p_truncated, self.values = p_end, p_truncated, values
        keys = {k: (shape, dtype) for k, shape, dtype in self.leaves}
        self.pairs = [
            (k, k[1:])
            for k in keys
            if len(k) > 1
            and k[0] == "next"
            and k[1:] in keys
            and keys[k[1:]] == keys[k]
            and k[-1] not in _NOT_PAIRED
        ]
        traj = keys.get(TRAJ_KEY)
        self.has_ids = traj is not None and traj[1].kind in "iu" and int(np.prod(traj[0])) == 1
        rng = np.random.default_rng([self.seed, 2**31 - 1])
        self.current = [
            {r: random_values(rng, *keys[r], values) for _, r in self.pairs}
            for _ in range(self.num_envs)
        ]
        self.next_id = self.num_envs
        self.ids = list(range(self.num_envs))

    def take(self, steps: int, seed: int = 0) -> PyTree:
        """The next ``steps`` steps: leaves ``[steps, ...]`` (``ndim=2``:
        ``[num_envs, steps, ...]``), NumPy arrays of the example's dtypes."""
        rng = np.random.default_rng([self.seed, int(seed), self.calls])
        self.calls += 1
        cols = {
            k: np.zeros((self.num_envs, steps) + shape, dtype) for k, shape, dtype in self.leaves
        }
        pair_next = dict(self.pairs)
        for e in range(self.num_envs):
            for t in range(steps):
                end = rng.random() < self.p_end
                trunc = end and rng.random() < self.p_truncated
                for k, shape, dtype in self.leaves:
                    if k in pair_next:
                        value = random_values(rng, shape, dtype, self.values)
                    elif k == END_KEY:
                        value = end
                    elif k == TRUNCATED_KEY:
                        value = trunc
                    elif k == TERMINATED_KEY:
                        value = end and not trunc
                    elif k in ROOT_FLAGS:
                        value = False
                    elif k == TRAJ_KEY and self.has_ids:
                        value = self.ids[e]
                    elif any(k == r for _, r in self.pairs):
                        value = self.current[e][k]
                    else:
                        value = random_values(rng, shape, dtype, self.values)
                    cols[k][e, t] = value
                # a pair's root value of the next step: the next observation, or a reset
                for n, r in self.pairs:
                    shape, dtype = cols[r].shape[2:], cols[r].dtype
                    self.current[e][r] = (
                        random_values(rng, shape, dtype, self.values)
                        if end
                        else cols[n][e, t].copy()
                    )
                if end:
                    self.ids[e], self.next_id = self.next_id, self.next_id + 1
        out = [cols[k] if self.ndim == 2 else cols[k][0] for k, _, _ in self.leaves]
        return jax.tree_util.tree_unflatten(self.treedef, out)


def norm_key(key) -> tuple:
    """``"a"`` -> ``("a",)``; tuples stay (nested-mapping keys, as the core's samplers take)."""
    return (key,) if isinstance(key, str) else tuple(key)


def get_path(tree: PyTree, key):
    """``tree[k0][k1]...`` for a nested-mapping key, or None when it is absent."""
    node = tree
    for k in norm_key(key):
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    return node


def set_path(tree: Mapping, key, value) -> dict:
    """A copy of nested mappings with ``tree[k0][k1]... = value``."""
    key = norm_key(key)
    out = dict(tree)
    out[key[0]] = value if len(key) == 1 else set_path(tree.get(key[0], {}), key[1:], value)
    return out


def stack_items(items: list) -> PyTree:
    """Stack same-structured trees along a new leading axis (NumPy)."""
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *items)


def item_key(leaves) -> bytes:
    """A hashable, bitwise identity for one item given as its list of leaves."""
    return b"|".join(np.ascontiguousarray(x).tobytes() for x in leaves)
