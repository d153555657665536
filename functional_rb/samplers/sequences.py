"""Fixed-length sequences at period-spaced starts (flashbax's trajectory sampling).

A *sequence* is ``sequence_length`` consecutive time steps of one env row of a FIFO ring
(``ndim=2``: ``[num_envs, row_capacity]``; ``ndim=1``: one row). Its *start* must lie on the
period grid, and the whole sequence must lie in the stored data without crossing the write
head (the oldest and the newest step of a row are not consecutive). ``period`` sets how much
two drawn sequences can overlap: ``period=1`` any overlap, ``period=sequence_length`` none.

:class:`SequenceSampler` draws the row and the start uniformly; its starts are period-spaced
from the oldest stored step of the row. :class:`PrioritizedSequenceSampler` keeps one priority
per *item*: item ``i`` of a row starts at time index ``(i % items_per_row) * period`` of row
``i // items_per_row`` (``items_per_row = row_capacity // period``, and ``row_capacity`` must be a
multiple of ``period``); its starts are period-spaced in the ring's own time indices. Both are
flashbax's rules (``trajectory_buffer`` and ``prioritised_trajectory_buffer``), so
``functional_rb.flashbax`` is built on them.

``end_key`` (both samplers, optional): the leaf that marks the last step of an episode. A
sequence whose steps other than its last include such a step is never drawn: sequences never
cross an episode end (flashbax leaves that to its users).

Indices are flat storage positions ``[num_sequences, sequence_length]``, as for slice samplers:
``batch_size`` counts steps and must be a multiple of ``sequence_length``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import config_int
from functional_rb._internal.names import stable
from functional_rb._internal.tree import Key, get_key, normalize_key
from functional_rb.protocol import Context, Drawn, Layout, Sampler
from functional_rb.samplers import binary_tree, sum_tree
from functional_rb.samplers.priorities import Prioritization
from functional_rb.samplers.uniform import uniform_index

__all__ = ("PrioritizedSequenceSampler", "SequenceSampler", "SequenceState", "item_ranges")


@stable("SequenceState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceState:
    """State of a sequence sampler.

    steps: int32 ``[]``: time steps written to each row since ``init`` (never wraps back: the
      ring's write head is ``steps % row_capacity``).
    tree: a :class:`~functional_rb.samplers.sum_tree.SumTreeState` over the items (or a
      :class:`~functional_rb.samplers.binary_tree.BinaryTreeState`, flashbax's layout, which
      ``functional_rb.flashbax`` passes in), or None (a uniform sampler without ``end_key``
      needs none). Values: the priority value of a
      drawable item, 0 otherwise.
    ends: bool ``[capacity]`` or None: with ``end_key``, the flag of every stored step.
    max_priority: float32 ``[]`` or None: the largest raw priority seen (prioritized only).
    """

    steps: jax.Array
    tree: sum_tree.SumTreeState | binary_tree.BinaryTreeState | None = None
    ends: jax.Array | None = None
    max_priority: jax.Array | None = None


def _trees(tree):
    """The functions of ``tree``'s layout: the wide tree or flashbax's binary one."""
    return binary_tree if isinstance(tree, binary_tree.BinaryTreeState) else sum_tree


def item_ranges(steps, added: int, period: int, row_capacity: int, length: int):
    """The logical start ranges ``(lo, hi)`` (time steps counted since ``init``, ``hi``
    excluded, multiples of ``period`` from ``lo``) of the items that become drawable and of
    those that stop being drawable when ``added`` steps are appended to rows holding
    ``steps`` steps: ``((new_lo, new_hi), (gone_lo, gone_hi))``.

    The drawable items of a row with ``n`` steps start at ``s = p0 + k * period`` with
    ``p0 = ceil(max(n - row_capacity, 0) / period) * period`` and ``s + length <= n``. An
    item still drawable whose steps were all rewritten counts as gone and new again.

    >>> (new, gone) = item_ranges(jnp.int32(0), 4, 1, 8, 2)
    >>> [int(x) for x in new], [int(x) for x in gone]
    ([0, 3], [0, 0])
    """

    def drawable(n):
        first = (jnp.maximum(n - row_capacity, 0) + period - 1) // period * period
        count = jnp.maximum((n - first - length) // period + 1, 0)
        return first, first + count * period

    lo1, hi1 = drawable(steps)
    lo2, hi2 = drawable(steps + added)
    return (jnp.maximum(lo2, hi1), hi2), (lo1, jnp.minimum(lo2, hi1))


@dataclasses.dataclass(frozen=True)
class _SequenceSpec(Sampler):
    """What both sequence samplers share: the configuration, the bookkeeping of drawable
    items, the ``end_key`` flags and the gather of whole sequences."""

    sequence_length: int = 1
    period: int = 1
    end_key: Key | None = None

    requires_fifo = True
    state_types = (SequenceState,)

    def __post_init__(self):
        name = type(self).__name__
        object.__setattr__(
            self, "sequence_length", config_int(name, "sequence_length", self.sequence_length)
        )
        object.__setattr__(self, "period", config_int(name, "period", self.period))
        if self.end_key is not None:
            object.__setattr__(self, "end_key", normalize_key(self.end_key))

    # ------------------------------------------------------------------ configuration
    def validate(self, *, capacity: int, batch_size: int, ndim: int):
        name = type(self).__name__
        if batch_size % self.sequence_length:
            raise ValueError(
                f"{name}: batch_size ({batch_size}) counts steps and must be a multiple of "
                f"sequence_length ({self.sequence_length}); e.g. batch_size="
                f"{max(batch_size // self.sequence_length, 1) * self.sequence_length}."
            )
        del capacity, ndim

    def _check_layout(self, layout: Layout):
        name = type(self).__name__
        if self.sequence_length > layout.row_capacity:
            raise ValueError(
                f"{name}: sequence_length ({self.sequence_length}) exceeds the steps a row "
                f"holds ({layout.row_capacity}); use a longer buffer or shorter sequences."
            )

    def items_per_row(self, layout: Layout) -> int:
        """Items (period-spaced starts) per row: ``row_capacity // period``."""
        return layout.row_capacity // self.period

    def _tracked(self) -> bool:
        """Whether the state keeps a tree over the items."""
        return self.end_key is not None

    def init(self, item_spec, layout: Layout) -> SequenceState:
        self._check_layout(layout)
        ends = None
        if self.end_key is not None:
            leaf = get_key(item_spec, self.end_key, where=f"{type(self).__name__}.init")
            if leaf.shape != ():
                raise ValueError(
                    f"{type(self).__name__}.init: the end_key leaf {self.end_key!r} must be one "
                    f"flag per step (shape ()), got shape {leaf.shape}."
                )
            ends = jnp.zeros((layout.capacity,), bool)
        tree = (
            sum_tree.init(layout.num_envs * self.items_per_row(layout)) if self._tracked() else None
        )
        return SequenceState(
            steps=jnp.int32(0), tree=tree, ends=ends, max_priority=self._initial_max()
        )

    def _initial_max(self):
        return None

    def _new_value(self, state: SequenceState, n_items: int):
        del state, n_items
        return jnp.float32(1.0)

    # ------------------------------------------------------------------ add
    def on_add(self, state: SequenceState, record, items, ctx: Context) -> SequenceState:
        layout = ctx.layout
        added = record.positions.shape[0] // layout.num_envs
        ends = state.ends
        if ends is not None:
            flags = jnp.asarray(
                # ends are kept when end_key is set
                get_key(items, cast(Key, self.end_key), where=f"{type(self).__name__}.on_add"),
                bool,
            ).reshape(-1)
            pos = jnp.where(record.mask, record.positions, layout.capacity)
            ends = ends.at[pos].set(flags, mode="drop")
        tree = state.tree
        if tree is not None:
            tree = self._refresh_items(state, tree, ends, added, layout)
        return dataclasses.replace(
            state, steps=state.steps + jnp.int32(added), tree=tree, ends=ends
        )

    def _refresh_items(self, state: SequenceState, tree, ends, added: int, layout: Layout):
        """Set the items that stop being drawable to 0, then those that become drawable to
        the new value (0 where they cross an episode end), as flashbax orders it."""
        per_row = self.items_per_row(layout)
        (new_lo, new_hi), (gone_lo, gone_hi) = item_ranges(
            state.steps, added, self.period, layout.row_capacity, self.sequence_length
        )
        count = min(added // self.period + 1, per_row) + 1
        k = jnp.arange(count, dtype=jnp.int32) * jnp.int32(self.period)
        env = jnp.arange(layout.num_envs, dtype=jnp.int32)[:, None]
        n_items = layout.num_envs * per_row

        def items(lo, hi):
            start = (lo + k)[None, :]
            t = start % jnp.int32(layout.row_capacity)
            idx = env * jnp.int32(per_row) + t // jnp.int32(self.period)
            return jnp.where(start < hi, idx, n_items), t

        gone, _ = items(gone_lo, gone_hi)
        new, t = items(new_lo, new_hi)
        value = jnp.broadcast_to(self._new_value(state, n_items), new.shape)
        if ends is not None:
            value = jnp.where(self._crosses_end(ends, env, t, layout), 0.0, value)
        # one set, the new items after the gone ones (the last occurrence wins): two sets in a
        # row made XLA copy the leaves between them (W2-sized trees: 4 MB per add)
        return _trees(tree).set(
            tree,
            jnp.concatenate([gone.reshape(-1), new.reshape(-1)]),
            jnp.concatenate([jnp.zeros(gone.size, jnp.float32), value.reshape(-1)]),
        )

    def _crosses_end(self, ends, env, t, layout: Layout):
        """bool, the shape of ``t``: the sequence starting at ``(env, t)`` has an episode end
        before its last step."""
        if self.sequence_length == 1:
            return jnp.zeros(jnp.broadcast_shapes(env.shape, t.shape), bool)
        offsets = jnp.arange(self.sequence_length - 1, dtype=jnp.int32)
        steps = (t[..., None] + offsets.reshape((1,) * t.ndim + (-1,))) % jnp.int32(
            layout.row_capacity
        )
        return jnp.any(ends[layout.to_flat(env[..., None], steps)], axis=-1)

    # ------------------------------------------------------------------ sample
    def can_sample(self, state: SequenceState, ctx: Context, batch_size: int):
        del batch_size
        ok = ctx.filled >= jnp.int32(self.sequence_length)
        if state.tree is not None:
            ok = ok & (_trees(state.tree).total(state.tree) > 0)
        return ok

    def _sequences(self, env, t, layout: Layout):
        """int32 ``[n, sequence_length]`` flat positions of the sequences starting at
        ``(env, t)`` (``[n]`` each), wrapping around the ring."""
        steps = (
            t[:, None] + jnp.arange(self.sequence_length, dtype=jnp.int32)[None, :]
        ) % jnp.int32(layout.row_capacity)
        return layout.to_flat(env[:, None], steps)

    def item_of(self, positions, layout: Layout):
        """int32: the item whose sequence starts at flat ``positions`` (a start off the period
        grid maps to the item of the grid point before it)."""
        env, t = layout.from_flat(positions)
        return env * jnp.int32(self.items_per_row(layout)) + t // jnp.int32(self.period)

    def start_of(self, items, layout: Layout):
        """int32: the flat position where each item's sequence starts."""
        per_row = jnp.int32(self.items_per_row(layout))
        items = jnp.asarray(items, jnp.int32)
        return layout.to_flat(items // per_row, (items % per_row) * jnp.int32(self.period))

    def item_drawable(self, state: SequenceState, items, layout: Layout):
        """bool: each item's sequence lies in the stored data, within the drawable range
        (flashbax's rule); crossing an episode end is the tree's business."""
        per_row = self.items_per_row(layout)
        t = (jnp.asarray(items, jnp.int32) % jnp.int32(per_row)) * jnp.int32(self.period)
        cap, n = jnp.int32(layout.row_capacity), state.steps
        newest = n - 1 - jnp.mod(n - 1 - t, cap)  # the last logical step at slot t
        first = (jnp.maximum(n - cap, 0) + self.period - 1) // self.period * self.period
        return (n > 0) & (newest >= first) & (newest + self.sequence_length <= n)


@dataclasses.dataclass(frozen=True)
class SequenceSampler(_SequenceSpec):
    """Uniform fixed-length sequences at period-spaced starts (flashbax's trajectory buffer).

    Args:
      sequence_length: steps per sequence.
      period: spacing of the starts: ``1`` any overlap, ``sequence_length`` none.
      end_key: optional key of a per-step done flag: sequences never cross an episode end.

    A draw picks a row uniformly, then a start uniformly among ``first + k * period``, where
    ``first`` is the row's oldest stored step, for every ``k`` whose whole sequence is stored
    (flashbax's rule). With ``end_key`` every drawable sequence that crosses no episode end is
    equally likely instead (rows are no longer drawn first), through a tree of 0/1 values over
    the items (the period grid then follows the ring's own time indices, as prioritized
    sampling does). Weights are 1.

    >>> import functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=2 * 16, ndim=2, batch_size=4 * 3,
    ...                       sampler=frb.SequenceSampler(sequence_length=3, period=1))
    >>> state = rb.init({"obs": jnp.zeros((2,))})
    >>> state = rb.add(state, {"obs": jnp.arange(2 * 8.0).reshape(2, 8)})
    >>> s, state = rb.sample(state, jax.random.key(0))
    >>> s.data["obs"].shape, bool((jnp.diff(s.data["obs"], axis=1) == 1).all())
    ((4, 3), True)
    """

    def sample(self, state: SequenceState, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
        layout = ctx.layout
        n = batch_size // self.sequence_length
        if state.tree is not None:
            idx, v, total, _ = _trees(state.tree).sample_with_stats(state.tree, key, n)
            ok = (total > 0) & (v > 0)
            starts = self.start_of(idx, layout)
            env, t = layout.from_flat(starts)
        else:
            k_row, k_start = jax.random.split(key)
            filled = ctx.filled
            head = jnp.mod(ctx.cursor - filled, jnp.int32(layout.row_capacity))
            count = jnp.where(
                filled >= self.sequence_length,
                (filled - self.sequence_length) // self.period + 1,
                0,
            )
            k = uniform_index(k_start, (n,), count, layout.row_capacity)
            t = (head + k * jnp.int32(self.period)) % jnp.int32(layout.row_capacity)
            env = uniform_index(k_row, (n,), jnp.int32(layout.num_envs), layout.num_envs)
            ok = jnp.broadcast_to(count > 0, (n,))
        indices = self._sequences(env, t, layout)
        mask = jnp.broadcast_to(ok[:, None], indices.shape)
        return Drawn(indices, mask.astype(jnp.float32), mask), state


@dataclasses.dataclass(frozen=True)
class PrioritizedSequenceSampler(_SequenceSpec):
    """Fixed-length sequences drawn by priority, one priority per period-spaced start
    (flashbax's prioritised trajectory buffer, on the core's exact sum tree).

    Args:
      sequence_length, period, end_key: as :class:`SequenceSampler`.
      alpha, beta, eps, max_priority_init: the priority rules of
        :class:`~functional_rb.PrioritizedSampler` (:mod:`functional_rb.samplers.priorities`):
        an item's value is ``(p + eps) ** alpha``, new items get the value of the largest
        priority seen so far, weights are ``(min_j P(j) / P(i)) ** beta`` over drawable items.
      stratified: one draw from each of ``n`` equal slices of the priority mass (flashbax's
        ``stratified_sample``) instead of independent draws.

    An item becomes drawable (at the new-item value) when its whole sequence is stored, and
    stops being drawable (value 0) as soon as the ring overwrites its first step; an item whose
    steps are all rewritten in one ``add`` is a new item. ``update`` takes the indices of a
    sample (``[n, sequence_length]``, or the start positions ``[n]``) and ignores entries whose
    item is not drawable any more (flashbax would bring it back); with ``end_key`` an item that
    crosses an episode end keeps value 0. A row's capacity should be a multiple of ``period``
    (flashbax's builders trim it to one): otherwise items start on the ring's own grid ``t = k *
    period``, ``k < row_capacity // period``, which drifts from the logical grid once the ring
    wraps, and a drawn item whose sequence is not stored whole comes back masked (flashbax
    would return it).

    >>> import functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=2 * 16, ndim=2, batch_size=4 * 3,
    ...     sampler=frb.PrioritizedSequenceSampler(sequence_length=3, period=2, alpha=0.6,
    ...                                            beta=0.4))
    >>> state = rb.init({"obs": jnp.zeros((2,))})
    >>> state = rb.add(state, {"obs": jnp.arange(2 * 8.0).reshape(2, 8)})
    >>> s, state = rb.sample(state, jax.random.key(0))
    >>> state = rb.update(state, s, jnp.ones(s.indices.shape))
    >>> s.indices.shape, bool((s.data["obs"][:, 0] % 2 == 0).all())
    ((4, 3), True)
    """

    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-8
    max_priority_init: float = 1.0
    stratified: bool = False

    options = ("beta",)
    tracks_generations = True

    def __post_init__(self):
        super().__post_init__()
        Prioritization.settle(self, "PrioritizedSequenceSampler")
        if not isinstance(self.stratified, bool):
            raise TypeError(
                "PrioritizedSequenceSampler: stratified must be a Python bool, got "
                f"{self.stratified!r}."
            )

    @functools.cached_property
    def prioritization(self) -> Prioritization:
        """The priority rules with this sampler's numbers."""
        return Prioritization(
            "PrioritizedSequenceSampler", self.alpha, self.beta, self.eps, self.max_priority_init
        )

    def _tracked(self) -> bool:
        return True

    def _initial_max(self):
        return self.prioritization.initial_max()

    def _new_value(self, state: SequenceState, n_items: int):
        # a prioritized state always holds max_priority
        return self.prioritization.new_value(cast(jax.Array, state.max_priority), n_items)

    def sample(self, state: SequenceState, key, batch_size: int, ctx: Context, beta=None):  # type: ignore[override]  # only its .options
        layout = ctx.layout
        beta = self.prioritization.beta_for(beta, where="PrioritizedSequenceSampler.sample")
        idx, v, total, vmin = _trees(state.tree).sample_with_stats(
            state.tree, key, batch_size // self.sequence_length, stratified=self.stratified
        )
        # an item is drawn only where its value is positive, and (when the row's capacity is not
        # a multiple of period, where the ring's grid drifts from the logical one after a wrap)
        # only if its sequence is stored whole: anything else comes back masked
        ok = (total > 0) & (v > 0) & self.item_drawable(state, idx, layout)
        env, t = layout.from_flat(self.start_of(idx, layout))
        indices = self._sequences(env, t, layout)
        weights = self.prioritization.weights(v, vmin, beta, ok)
        shape = indices.shape
        return Drawn(
            indices, jnp.broadcast_to(weights[:, None], shape), jnp.broadcast_to(ok[:, None], shape)
        ), state

    def update(self, state: SequenceState, indices, priorities, ctx: Context, *, keep=None):
        """Set the priorities of the items whose sequences start at ``indices[..., 0]``
        (``[n, sequence_length]`` from a sample) or at ``indices`` (``[n]``). ``keep`` (from
        the buffer's generation check): an entry is kept only if none of its steps was
        rewritten since the draw. Items that are not drawable now are left alone."""
        if getattr(indices, "ndim", 0) == 2:
            indices = indices[:, 0]
            if getattr(priorities, "ndim", 0) == 2:
                priorities = priorities[:, 0]
            if keep is not None:
                keep = jnp.all(jnp.asarray(keep), axis=1)
        return self.set_priorities(state, indices, priorities, ctx, keep=keep)

    def set_priorities(
        self,
        state: SequenceState,
        starts,
        priorities,
        ctx: Context,
        *,
        keep=None,
        drawable_only: bool = True,
    ) -> SequenceState:
        """Set the priorities of the items starting at flat positions ``starts`` (``[n]``).
        ``drawable_only=False`` sets them even for items not drawable now, which can bring
        back a sequence that was overwritten or crosses the write head (flashbax's
        ``set_priorities`` does; ``functional_rb.flashbax`` keeps it for compatibility).
        Entries where ``keep`` is False are dropped. Indices out of range and bad priorities
        follow :class:`~functional_rb.samplers.priorities.Prioritization`'s policy."""
        layout = ctx.layout
        where = "PrioritizedSequenceSampler.update"
        # entries whose item is not drawable now are dropped before the checks; an index out
        # of range still raises (Prioritization.updates checks it in its own dtype)
        xp = jnp if isinstance(starts, jax.Array) else np
        clipped = jnp.asarray(xp.clip(starts, 0, layout.capacity - 1)).astype(jnp.int32)
        items = self.item_of(clipped, layout)
        live = jnp.ones(items.shape, bool)
        if drawable_only:
            live = self.item_drawable(state, items, layout)
        if state.ends is not None:
            env, t = layout.from_flat(self.start_of(items, layout))
            live = live & ~self._crosses_end(state.ends, env, t, layout)
        keep = live if keep is None else jnp.asarray(keep) & live
        # drawable_only=False: any slot may be given a value, stored or not (flashbax's rule)
        filled = ctx.filled if drawable_only else jnp.int32(layout.row_capacity)
        up = self.prioritization.updates(
            starts,
            priorities,
            layout,
            filled,
            cast(jax.Array, state.max_priority),  # a prioritized state always holds it
            where=where,
            keep=keep,
        )
        n_items = layout.num_envs * self.items_per_row(layout)
        items = jnp.where(
            up.accepted, self.item_of(jnp.minimum(up.indices, layout.capacity - 1), layout), n_items
        )
        return dataclasses.replace(
            state,
            tree=_trees(state.tree).set(state.tree, items, up.values),
            max_priority=up.max_priority,
        )
