"""Prioritized experience replay (Schaul et al., 2016) over a jittable sum tree.

Item ``i`` is drawn with probability ``P(i) = v_i / sum_j v_j`` where ``v_i = (p_i + eps) ** alpha``
(clamped, see :mod:`functional_rb.samplers.priorities`) and ``p_i`` is its priority; importance weights are
``w_i = (N * P(i)) ** -beta / max_j (N * P(j)) ** -beta`` over the ``N`` stored items, which
simplifies to ``(min_j v_j / v_i) ** beta`` (``min`` over stored items with ``v_j > 0``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from functional_rb._internal.names import stable
from functional_rb.protocol import Context, Drawn, Layout, Sampler
from functional_rb.samplers import sum_tree
from functional_rb.samplers.priorities import Prioritization


@stable("PrioritizedState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrioritizedState:
    tree: sum_tree.SumTreeState  # leaves [capacity]: stored value of each flat position
    max_priority: jax.Array  # float32 []: largest raw priority seen (starts at
    #                              max_priority_init); new items get its value


@dataclasses.dataclass(frozen=True)
class PrioritizedSampler(Sampler):
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

    Semantics (the priority rules are :class:`functional_rb.samplers.priorities.Prioritization`'s,
    shared with :class:`~functional_rb.PrioritizedSliceSampler`):

      * An item's stored value is ``min((p + eps) ** alpha, value_max(capacity))``
        (:func:`functional_rb.samplers.priorities.value_max`: the sum tree's total stays finite).
      * ``on_add``: every written position (also a ring slot being overwritten and a slot
        chosen by ``MaxValueWriter``) gets the value of the largest priority seen so far;
        masked (not written) positions are untouched.
      * ``update(indices, priorities)``: stores the values and raises the running maximum.
        Made from a sample (``rb.update(state, sample, priorities)``), entries whose slot was
        rewritten since the draw are dropped and counted (:mod:`functional_rb.generations`);
        by bare indices they cannot be checked.
        Duplicate indices: the last occurrence wins. Indices of positions that hold no item
        (``t >= filled`` in their row) are ignored. An index outside ``[0, capacity)`` or a
        priority that is NaN, infinite or negative: eagerly a ``ValueError`` naming the first
        one; under ``jit`` that entry is ignored (the item keeps its priority).
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

    options = ("beta",)
    state_types = (PrioritizedState,)
    tracks_generations = True

    def __post_init__(self):
        Prioritization.settle(self, "PrioritizedSampler")
        if not isinstance(self.stratified, bool):
            raise TypeError(
                f"PrioritizedSampler: stratified must be a Python bool, got {self.stratified!r}."
            )

    @functools.cached_property
    def prioritization(self) -> Prioritization:
        """The priority rules (value, update policy, weights) with this sampler's numbers."""
        return Prioritization(
            "PrioritizedSampler", self.alpha, self.beta, self.eps, self.max_priority_init
        )

    # ------------------------------------------------------------------ state
    def init(self, item_spec, layout: Layout) -> PrioritizedState:
        del item_spec
        return PrioritizedState(
            tree=sum_tree.init(layout.capacity), max_priority=self.prioritization.initial_max()
        )

    def on_add(self, state: PrioritizedState, record, items, ctx: Context):
        del items
        value = self.prioritization.new_value(state.max_priority, ctx.layout.capacity)
        values = jnp.broadcast_to(value, record.positions.shape)
        if record.run_start is not None:
            # a ring writer's run of slots: the tree is updated by ranges (a few nodes per
            # level instead of one per item)
            tree = sum_tree.set_run(state.tree, record.run_start, values, record.mask)
        else:
            # -1 is ignored by sum_tree.set: masked positions keep their value.
            # A writer's unmasked positions are distinct within one call.
            tree = sum_tree.set(
                state.tree, jnp.where(record.mask, record.positions, -1), values, unique=True
            )
        return PrioritizedState(tree=tree, max_priority=state.max_priority)

    def can_sample(self, state: PrioritizedState, ctx: Context, batch_size: int):
        del batch_size
        return (ctx.size > 0) & (sum_tree.total(state.tree) > 0)

    # ------------------------------------------------------------------ update
    def update(self, state: PrioritizedState, indices, priorities, ctx: Context, *, keep=None):
        """Store the values of ``priorities`` (real ``[...]``, or a scalar) at flat
        ``indices`` (integers ``[...]``); see the class docstring for the policy. ``keep``
        (bool ``[...]``, from the buffer's generation check): entries to drop, unchecked."""
        up = self.prioritization.updates(
            indices,
            priorities,
            ctx.layout,
            ctx.filled,
            state.max_priority,
            where="PrioritizedSampler.update",
            keep=keep,
        )
        return PrioritizedState(
            tree=sum_tree.set(state.tree, up.indices, up.values), max_priority=up.max_priority
        )

    # ------------------------------------------------------------------ sample
    def sample(self, state: PrioritizedState, key, batch_size: int, ctx: Context, beta=None):  # type: ignore[override]  # only its .options
        """Draw ``batch_size`` flat positions proportionally to their stored values.

        ``beta`` (float, may be traced) overrides the configured exponent for this call.
        Returns ``Drawn(indices int32 [B], weights float32 [B], mask bool [B])``.
        """
        prio = self.prioritization
        beta = prio.beta_for(beta, where="PrioritizedSampler.sample")
        # total and min from the search's own reads: separate reads of the tree would make XLA
        # copy it when a fused step updates priorities after sampling.
        idx, v, total, vmin = sum_tree.sample_with_stats(
            state.tree, key, batch_size, stratified=self.stratified
        )
        ok = (ctx.size > 0) & (total > 0) & (v > 0)
        return Drawn(idx, prio.weights(v, vmin, beta, ok), ok), state
