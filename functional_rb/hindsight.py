"""Hindsight goal relabelling (HER, Andrychowicz et al. 2017) over a buffer's stored episodes.

For goal-conditioned RL: a sampled transition's desired goal is replaced by a goal the agent
actually achieved later in the same episode (or at its end, anywhere in it, or anywhere in the
buffer), and its reward is recomputed for that goal. Everything here is a pure, jittable array
computation; :class:`functional_rb.adapters.HERReplayBuffer` calls the first two functions.

Time order, not storage order. Each env row of the buffer is a ring: the oldest stored step
has *age* 0, the newest ``filled - 1``. Episodes are runs of consecutive ages ended by a step
whose end flag is set; the newest stored step also ends one (its successors are not stored
yet, or were overwritten), so a goal is never taken across an episode end or across the write
head, and an episode that wraps around the end of the storage arrays stays whole.

===========================  =====================================================
function                     signature
===========================  =====================================================
:func:`episode_limits`       ``(ends bool[T], filled int32[]) -> (first, last)``
:func:`goal_ages`            ``(u f32[B], age, first, last int32[B]) -> int32[B]``
:func:`relabel`              ``(key, rb, state, sample, *, reward_fn, ...) -> Sample``
===========================  =====================================================

The functions are unbatched over rows: ``jax.vmap`` them over the env rows of an ``ndim=2``
buffer, as :func:`relabel` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal import random as _random
from functional_rb._internal.checks import check_key
from functional_rb._internal.errors import config_number
from functional_rb._internal.tree import Key, get_key, has_key, normalize_key, set_key

__all__ = ["STRATEGIES", "EPISODE_STRATEGIES", "episode_limits", "goal_ages", "relabel"]

PyTree = Any

#: The goal-selection strategies of TorchRL's ``HindsightStrategy``.
STRATEGIES = ("future", "final", "episode", "random")
#: The strategies that draw the goal from the sampled step's own episode.
EPISODE_STRATEGIES = ("future", "final", "episode")

_END_KEYS = (("next", "done"), ("next", "terminated"))


def _check_strategy(strategy, allowed, where: str) -> str:
    if strategy not in allowed:
        raise ValueError(
            f"{where}: strategy must be one of {allowed}, got {strategy!r}. "
            "'future' (a later step of the same episode) is the usual choice."
        )
    return str(strategy)


def episode_limits(ends: jax.Array, filled) -> tuple[jax.Array, jax.Array]:
    """The episode of every stored step of one ring, as the ages of its first and last step.

    Args:
      ends: bool ``[T]``, in age order (``ends[0]`` is the oldest stored step): True where a
        step ends its episode (done or terminated). Entries at ages ``>= filled`` are ignored.
      filled: int32 ``[]``, the number of stored steps (``0 <= filled <= T``).

    Returns:
      ``(first, last)``, int32 ``[T]``: for a stored age ``a``, ``first[a] <= a <= last[a]``
      are the ages of the first and last stored steps of ``a``'s episode. The newest step
      (age ``filled - 1``) always ends an episode. Entries at ages ``>= filled`` are 0.
    """
    ends = jnp.asarray(ends)
    if ends.ndim != 1 or ends.dtype != jnp.bool_:
        raise ValueError(
            f"episode_limits: ends must be a bool vector [T] in age order, got "
            f"dtype {ends.dtype} and shape {ends.shape}. For an ndim=2 buffer "
            "jax.vmap over its rows; compare a float flag with != 0 first."
        )
    n = ends.shape[0]
    filled = jnp.asarray(filled, jnp.int32)
    age = jnp.arange(n, dtype=jnp.int32)
    stored = age < filled
    is_end = (ends & stored) | (age == filled - 1)
    # last[a]: the first end at or after a; first[a]: one past the last end before a
    last = jax.lax.cummin(jnp.where(is_end, age, jnp.int32(n)), reverse=True)
    end_before = jax.lax.cummax(jnp.where(is_end, age, jnp.int32(-1)))
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_before[:-1] + 1]) if n else age
    zero = jnp.int32(0)
    return jnp.where(stored, first, zero), jnp.where(stored, last, zero)


def goal_ages(
    u: jax.Array, age: jax.Array, first: jax.Array, last: jax.Array, *, strategy: str
) -> jax.Array:
    """The age of the step whose achieved goal relabels each sampled step (episode strategies).

    Args:
      u: float32 ``[B]`` uniforms in ``[0, 1)`` (unused by ``"final"``).
      age: int32 ``[B]``, the sampled steps' ages; first / last: int32 ``[B]``, their
        episodes' limits (:func:`episode_limits` at ``age``).
      strategy: ``"future"``: uniform over ``age .. last``; ``"final"``: ``last``;
        ``"episode"``: uniform over ``first .. last``.

    Returns:
      int32 ``[B]`` goal ages, always within the sampled step's episode. The arithmetic is
      TorchRL's (float32 ``floor(u * span)``), so the same uniforms give TorchRL's goals.
    """
    strategy = _check_strategy(strategy, EPISODE_STRATEGIES, "goal_ages")
    age, first, last = (jnp.asarray(x, jnp.int32) for x in (age, first, last))
    u = jnp.asarray(u, jnp.float32)
    if strategy == "final":
        return last
    if strategy == "future":
        span = jnp.maximum(last - age, 0)
        offset = jnp.floor(u * (span + 1).astype(jnp.float32)).astype(jnp.int32)
        return age + jnp.minimum(offset, span)
    length = last - first + 1
    offset = jnp.floor(u * length.astype(jnp.float32)).astype(jnp.int32)
    # u < 1 keeps offset < length in exact arithmetic; float32 rounding could reach length
    return first + jnp.clip(offset, 0, jnp.maximum(length - 1, 0))


def relabel(
    key: jax.Array,
    rb,
    state,
    sample,
    *,
    reward_fn: Callable[[PyTree], jax.Array],
    strategy: str = "future",
    her_ratio: float = 0.8,
    goal_key: Key = "desired_goal",
    achieved_goal_key: Key = "achieved_goal",
    reward_key: Key = ("next", "reward"),
    end_keys: Sequence[Key] = _END_KEYS,
):
    """HER for a sampled batch of ``rb`` (jittable, vmappable): the first
    ``int(B * her_ratio)`` rows get a hindsight goal and a recomputed reward.

    Args:
      key: a JAX PRNG key (the goals' draws).
      rb / state: the :class:`~functional_rb.ReplayBuffer` (its writer must be time ordered,
        e.g. ``RoundRobinWriter``) and its state; ``ndim=1`` or ``2`` (episodes per env row).
      sample: the :class:`~functional_rb.Sample` drawn from it, flat indices ``[B]``.
      reward_fn: ``reward_fn(data) -> reward``: ``data`` are the relabelled rows (leaves
        ``[n, ...]``, ``goal_key`` already replaced); it returns ``[n]`` or the stored
        reward's shape ``[n, ...]``. Must be jittable. Pass the same function object on
        every call (a new lambda compiles again).
      strategy: ``"future"`` (a later step of the same episode), ``"final"`` (its last
        stored step), ``"episode"`` (any of its steps) or ``"random"`` (any stored step).
      her_ratio: a Python float in ``[0, 1]``; the first ``int(B * her_ratio)`` rows are
        relabelled, the others returned as sampled.
      goal_key / achieved_goal_key / reward_key: entries of the items (nested keys as
        tuples). ``("next", *goal_key)`` is replaced too when the items have it.
      end_keys: the episode-end flags (any of them True ends an episode); keys the items
        lack are skipped, at least one must exist.

    Returns:
      The sample with ``data`` relabelled (same structure, shapes and dtypes; the reward is
      cast to the stored dtype); indices, weights and mask unchanged. Rows whose ``mask`` is
      False (nothing to sample under ``jit``) are returned unchanged.
    """
    where = "hindsight.relabel"
    strategy = _check_strategy(strategy, STRATEGIES, where)
    check_key(key, where)
    config_number(
        where,
        "her_ratio",
        her_ratio,
        minimum=0.0,
        maximum=1.0,
        fix="It is the fraction of each batch relabelled: pass e.g. 0.8.",
    )
    if not getattr(rb.writer, "time_ordered", False):
        raise ValueError(
            f"{where}: HER reads episodes as consecutive slots of the ring, but "
            f"writer={rb.writer!r} does not write in time order. Use "
            "writer=frb.RoundRobinWriter()."
        )
    idx = jnp.asarray(sample.indices)
    if idx.ndim != 1:
        raise ValueError(
            f"{where}: sample.indices must be flat [B] (transitions), got shape "
            f"{idx.shape}. Slice samples are not relabelled; sample with a "
            "transition sampler (RandomSampler, PrioritizedSampler)."
        )
    n_her = int(idx.shape[0] * her_ratio)
    if n_her == 0:
        return sample
    keys = (
        normalize_key(goal_key),
        normalize_key(achieved_goal_key),
        normalize_key(reward_key),
        tuple(normalize_key(k) for k in end_keys),
    )
    return _relabel(rb, reward_fn, strategy, n_her, keys, key, state, sample)


def _end_flags(rb, state, ctx, end_keys) -> jax.Array:
    """bool ``[num_envs, row_capacity]``: the end flags of every slot, in age order."""
    lay = ctx.layout
    r_cap = lay.row_capacity
    t = jnp.mod(ctx.cursor - ctx.filled + jnp.arange(r_cap, dtype=jnp.int32), jnp.int32(r_cap))
    env = jnp.arange(lay.num_envs, dtype=jnp.int32)[:, None]
    grid = lay.to_flat(env, t[None, :])
    items = rb.get(state, grid)  # under jit, only the end leaves are gathered
    present = [k for k in end_keys if has_key(items, k)]
    if not present:
        raise KeyError(
            f"hindsight.relabel: none of the end keys {list(end_keys)} is in the "
            "stored items, so episodes cannot be found. Store a done or terminated "
            "flag per step, or pass end_keys=[the key of yours]."
        )
    ends = jnp.zeros(grid.shape, bool)
    for k in present:
        x = jnp.asarray(get_key(items, k, where="hindsight.relabel"))
        ends = ends | jnp.any(x.reshape(grid.shape + (-1,)) != 0, axis=-1)
    return ends


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _relabel(rb, reward_fn, strategy, n_her, keys, key, state, sample):
    goal_key, achieved_key, reward_key, end_keys = keys
    ctx = rb.context(state)
    lay = ctx.layout
    r_cap = jnp.int32(lay.row_capacity)
    idx = jnp.asarray(sample.indices, jnp.int32)[:n_her]
    u = _random.uniform01(key, (n_her,))
    if strategy == "random":
        size = jnp.maximum(ctx.filled * jnp.int32(lay.num_envs), 1)
        rank = jnp.minimum(jnp.floor(u * size.astype(jnp.float32)).astype(jnp.int32), size - 1)
        goal = lay.rank_to_flat(rank, ctx.filled)
    else:
        ends = _end_flags(rb, state, ctx, end_keys)
        first, last = jax.vmap(episode_limits, in_axes=(0, None))(ends, ctx.filled)
        env, t = lay.from_flat(idx)
        oldest = ctx.cursor - ctx.filled
        age = jnp.mod(t - oldest, r_cap)
        g_age = goal_ages(u, age, first[env, age], last[env, age], strategy=strategy)
        goal = lay.to_flat(env, jnp.mod(oldest + g_age, r_cap))
    achieved = get_key(rb.get(state, goal), achieved_key, where="hindsight.relabel")
    data = sample.data
    head = jax.tree_util.tree_map(lambda x: x[:n_her], data)
    head = _set_like(head, goal_key, achieved, "goal_key")
    next_goal = ("next",) + goal_key
    if has_key(head, next_goal):
        head = _set_like(head, next_goal, achieved, "goal_key")
    head = _set_like(head, reward_key, reward_fn(head), "reward_fn's reward")
    valid = jnp.asarray(sample.mask)[:n_her]

    def merge(new, old):
        keep = valid.reshape(valid.shape + (1,) * (old.ndim - 1))
        return old.at[:n_her].set(jnp.where(keep, new, old[:n_her]))

    return sample._replace(data=jax.tree_util.tree_map(merge, head, data))


def _set_like(tree, key, value, what: str):
    """``tree`` with the leaf at ``key`` replaced by ``value``, reshaped and cast like it."""
    old = get_key(tree, key, where="hindsight.relabel")
    value = jnp.asarray(value)
    if value.size != old.size:
        raise ValueError(
            f"hindsight.relabel: {what} has shape {value.shape}, but the stored "
            f"entry {key!r} has shape {old.shape} ({old.shape[0]} relabelled "
            "rows). Return one value per row, shaped [n] or like the entry."
        )
    return set_key(tree, key, value.reshape(old.shape).astype(old.dtype))
