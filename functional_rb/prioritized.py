"""Prioritized experience replay (Schaul et al., 2016) over a jittable sum tree.

Item ``i`` is drawn with probability ``P(i) = v_i / sum_j v_j`` where ``v_i = (p_i + eps) ** alpha``
and ``p_i`` is its priority; importance weights are
``w_i = (N * P(i)) ** -beta / max_j (N * P(j)) ** -beta`` over the ``N`` stored items, which
simplifies to ``(min_j v_j / v_i) ** beta`` (``min`` over stored items with ``v_j > 0``).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb import sum_tree
from functional_rb._errors import concrete_or_none
from functional_rb.layout import Context, Layout
from functional_rb.samplers import Drawn, SamplerBase


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrioritizedState:
    tree: sum_tree.SumTreeState  # leaves [capacity]: (p + eps) ** alpha per flat position
    max_priority: jax.Array      # float32 []: largest raw priority seen (starts at
    #                              max_priority_init); new items get (max_priority + eps) ** alpha


def _check_number(name: str, value, *, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"PrioritizedSampler: {name} must be a Python number, got {value!r} "
                        f"({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        rel = ">" if strict else ">="
        raise ValueError(f"PrioritizedSampler: {name} must be finite and {rel} {minimum}, "
                         f"got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class PrioritizedSampler(SamplerBase):
    """Proportional prioritized sampling with replacement (TorchRL's ``PrioritizedSampler``).

    Args:
      alpha: priority exponent (0: uniform, 1: fully proportional).
      beta: importance-weight exponent; ``rb.sample(state, key, beta=b)`` overrides it for one
        call, e.g. to anneal it towards 1. ``b`` may be a traced float under ``jax.jit``
        (pass it as a keyword argument; it is not static, so annealing does not retrace).
      eps: added to every priority before the exponent, so zero priorities stay drawable.
      max_priority_init: the priority given to new items before any ``update`` (new items
        get the largest priority seen so far, this value included).
      stratified: draw one item from each of ``batch_size`` equal slices of the priority mass
        (lower-variance batches) instead of independently.

    Semantics:
      * ``on_add``: every written position (also a ring slot being overwritten and a slot
        chosen by ``MaxValueWriter``) gets ``(max_priority + eps) ** alpha``; masked (not
        written) positions are untouched.
      * ``update(indices, priorities)``: stores ``(priority + eps) ** alpha`` and raises the
        running maximum. Duplicate indices: the last occurrence wins. Indices of positions that
        hold no item (``t >= filled`` in their row) are ignored.
      * Bad priorities (negative, NaN, inf): with concrete values a ``ValueError`` naming the
        first bad one; under ``jit`` such an item's stored value becomes 0, so it is never drawn
        until it gets a valid priority, and the tree's total stays finite.
      * ``sample`` draws only stored items with a positive value. If every stored value is 0
        (or nothing is stored), ``can_sample`` is False: eagerly the buffer raises, under
        ``jit`` the sample has ``mask`` False and ``weights`` 0.
      * Works with ``ndim=2`` storages: the tree is over flat positions and only written
        positions ever hold a positive value.

    State: :class:`PrioritizedState`.
    """

    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-8
    max_priority_init: float = 1.0
    stratified: bool = False

    def __post_init__(self):
        for name, minimum, strict in (("alpha", 0.0, False), ("beta", 0.0, False),
                                      ("eps", 0.0, False), ("max_priority_init", 0.0, True)):
            object.__setattr__(self, name, _check_number(
                name, getattr(self, name), minimum=minimum, strict=strict))
        if not isinstance(self.stratified, bool):
            raise TypeError("PrioritizedSampler: stratified must be a Python bool, got "
                            f"{self.stratified!r}.")
        if (self.max_priority_init + self.eps) ** self.alpha == math.inf:
            raise ValueError("PrioritizedSampler: (max_priority_init + eps) ** alpha overflows; "
                             "use a smaller max_priority_init or alpha.")

    # ------------------------------------------------------------------ state
    def init(self, item_spec, layout: Layout) -> PrioritizedState:
        del item_spec
        return PrioritizedState(tree=sum_tree.init(layout.capacity),
                                max_priority=jnp.float32(self.max_priority_init))

    def _value(self, p: jax.Array) -> jax.Array:
        return (p + jnp.float32(self.eps)) ** jnp.float32(self.alpha)

    def on_add(self, state: PrioritizedState, positions, mask, items, ctx: Context):
        del items
        positions = jnp.asarray(positions, jnp.int32).reshape(-1)
        mask = jnp.asarray(mask, bool).reshape(-1)
        value = self._value(state.max_priority)
        values = jnp.broadcast_to(value, positions.shape)
        if ctx.run_start is not None:
            # a ring writer's run of slots: the tree is updated by ranges (a few nodes per
            # level instead of one per item)
            tree = sum_tree.set_run(state.tree, ctx.run_start, values, mask)
        else:
            # -1 is ignored by sum_tree.set: masked positions keep their value.
            # A writer's unmasked positions are distinct within one call.
            tree = sum_tree.set(state.tree, jnp.where(mask, positions, -1), values, unique=True)
        return PrioritizedState(tree=tree, max_priority=state.max_priority)

    def can_sample(self, state: PrioritizedState, ctx: Context, batch_size: int):
        del batch_size
        return (ctx.size > 0) & (sum_tree.total(state.tree) > 0)

    # ------------------------------------------------------------------ update
    def update(self, state: PrioritizedState, indices, priorities, ctx: Context):
        """Store ``(priorities + eps) ** alpha`` at flat ``indices`` (int32 ``[...]``,
        priorities float ``[...]`` of the same shape)."""
        indices = jnp.asarray(indices, jnp.int32).reshape(-1)
        priorities = jnp.asarray(priorities).reshape(-1)
        if priorities.shape != indices.shape:
            raise ValueError(f"PrioritizedSampler.update: priorities have {priorities.shape[0]} "
                             f"entries, indices {indices.shape[0]}; give one priority per index.")
        if not jnp.issubdtype(priorities.dtype, jnp.floating) and not jnp.issubdtype(
                priorities.dtype, jnp.integer):
            raise TypeError("PrioritizedSampler.update: priorities must be real numbers, got "
                            f"dtype {priorities.dtype}.")
        p = priorities.astype(jnp.float32)
        layout = ctx.layout
        self._check_concrete(indices, p, layout.capacity)
        v = self._value(jnp.maximum(p, 0.0))
        good = jnp.isfinite(p) & (p >= 0) & jnp.isfinite(v)
        in_range = (indices >= 0) & (indices < layout.capacity)
        _, t = layout.from_flat(jnp.clip(indices, 0, layout.capacity - 1))
        stored = in_range & (t < ctx.filled)
        tree = sum_tree.set(state.tree, jnp.where(stored, indices, -1),
                            jnp.where(good, v, 0.0))
        # Only valid priorities of positions actually updated raise the running maximum.
        seen = jnp.max(jnp.where(good & stored, p, 0.0), initial=0.0)
        return PrioritizedState(tree=tree, max_priority=jnp.maximum(state.max_priority, seen))

    def _check_concrete(self, indices, p, capacity: int):
        pc = concrete_or_none(p)
        if pc is not None and pc.size:
            with np.errstate(over="ignore", invalid="ignore"):
                v = (np.maximum(pc, 0).astype(np.float32) + np.float32(self.eps)) ** np.float32(
                    self.alpha)
            bad = ~np.isfinite(pc) | (pc < 0) | ~np.isfinite(v)
            if bad.any():
                i = int(np.argmax(bad))
                ic = concrete_or_none(indices)
                at = f" (storage index {int(ic[i])})" if ic is not None else ""
                why = ("overflows float32 after (p + eps) ** alpha" if np.isfinite(pc[i])
                       and pc[i] >= 0 else "is not a finite number >= 0")
                raise ValueError(
                    f"PrioritizedSampler.update: priorities[{i}]{at} = {pc[i]!r} {why} "
                    f"({int(bad.sum())} bad of {pc.size}). Priorities must be finite and >= 0, "
                    "e.g. jnp.abs(td_error); under jit a bad priority is stored as 0 (never "
                    "drawn).")
        ic = concrete_or_none(indices)
        if ic is not None and ic.size:
            out = (ic < 0) | (ic >= capacity)
            if out.any():
                i = int(np.argmax(out))
                raise ValueError(
                    f"PrioritizedSampler.update: indices[{i}] = {int(ic[i])} is outside "
                    f"[0, {capacity}). Pass the indices of a Sample (sample.indices); under jit "
                    "out-of-range indices are ignored.")

    # ------------------------------------------------------------------ sample
    def sample(self, state: PrioritizedState, key, batch_size: int, ctx: Context,
               beta=None):
        """Draw ``batch_size`` flat positions proportionally to their stored values.

        ``beta`` (float, may be traced) overrides the configured exponent for this call.
        Returns ``Drawn(indices int32 [B], weights float32 [B], mask bool [B])``.
        """
        if beta is None:
            beta = self.beta
        else:
            bc = concrete_or_none(beta)
            if bc is not None and (bc.ndim != 0 or not np.isfinite(bc) or bc < 0):
                raise ValueError(f"PrioritizedSampler.sample: beta must be a finite scalar "
                                 f">= 0, got {beta!r}.")
        tree = state.tree
        # total and min from the search's own reads: separate reads of the tree would make XLA
        # copy it when a fused step updates priorities after sampling.
        idx, v, total, vmin = sum_tree.sample_with_stats(tree, key, batch_size,
                                                         stratified=self.stratified)
        ok = (ctx.size > 0) & (total > 0) & (v > 0)
        ratio = jnp.where(ok, vmin / jnp.where(ok, v, 1.0), 0.0)
        weights = jnp.where(ok, ratio ** jnp.asarray(beta, jnp.float32), 0.0)
        return Drawn(idx, weights.astype(jnp.float32), ok), state
