"""Prioritized slices: slice starts drawn by priority (TorchRL's ``PrioritizedSliceSampler``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import hugepages
from functional_rb._internal.jit import compiled
from functional_rb._internal.names import stable
from functional_rb.protocol import Context, Drawn, Layout
from functional_rb.samplers import sum_tree, trajectories
from functional_rb.samplers.priorities import Prioritization
from functional_rb.samplers.slices import SliceSpec, check_slice_args, slice_shape
from functional_rb.samplers.trajectories import SliceState


@stable("PrioritizedSliceState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrioritizedSliceState:
    slices: SliceState
    tree: sum_tree.SumTreeState  # over flat positions: the value of each valid start, else 0
    prio: jax.Array  # float32 [capacity]: stored value (p + eps) ** alpha of each step
    valid: jax.Array  # bool [capacity]: the step can start a slice of slice_len
    max_priority: jax.Array  # float32 []: largest priority seen (new steps get its value)
    # The slice length `valid` and `tree` are kept for (static: a batch_size implying another
    # one is refused at trace time). num_slices mode: the buffer's batch_size // num_slices.
    slice_len: int = dataclasses.field(metadata=dict(static=True))


def _padding_kept(indices):
    """bool, the shape of ``indices``: False on a slice's padding (``[num_slices, slice_len]``
    indices repeat the last valid one), compared in the indices' own dtype."""
    xp = jnp if isinstance(indices, jax.Array) else np
    keep = xp.ones(indices.shape, bool)
    if indices.ndim == 2 and indices.shape[1] > 1:
        keep = xp.concatenate([keep[:, :1], indices[:, 1:] != indices[:, :-1]], axis=1)
    return jnp.asarray(keep)


@dataclasses.dataclass(frozen=True)
class PrioritizedSliceSampler(SliceSpec):
    """Slices whose start is drawn by priority (TorchRL's ``PrioritizedSliceSampler``).

    Every stored step has a priority ``p`` (new steps get the largest priority seen so far,
    initially 1). A step is a *valid start* when a slice of ``slice_len`` steps starting there
    stays inside its trajectory (at least ``slice_len`` steps remain to the trajectory end),
    or, with ``strict_length=False``, when it is the first stored step of its trajectory (that
    slice is then padded, ``mask`` False on the padding): TorchRL's rule. With a right
    ``span`` (see :class:`~functional_rb.samplers.slices.SliceSpec`; a left span is refused: starts are
    drawn by priority) a start needs only ``slice_len - right`` steps left and its slice stops
    at the trajectory's end, the rest masked as padding. Each slice start is
    drawn independently with ``P(i) = (p_i + eps) ** alpha / sum_j (p_j + eps) ** alpha`` over
    the valid starts ``j``; the slice is the next ``slice_len`` steps. Weights (one per slice,
    repeated over its steps, 0 on padding) are ``w_i = (N P(i)) ** -beta / max_j (N P(j)) **
    -beta`` with ``N`` and ``j`` over the valid starts, i.e. ``(min_j P(j) / P(i)) ** beta``
    (TorchRL normalizes by the minimum over all stored steps instead; ours keeps the largest
    possible weight at 1). ``sample(..., beta=b)`` overrides ``beta``.

    ``update(indices, priorities)`` takes the ``[num_slices, slice_len]`` indices of a sample
    (or any flat positions) and sets the priority of each step; within a slice, padding
    repeats the last valid index and is ignored (the first occurrence in a row counts), and
    across the batch the last occurrence wins. As TorchRL warns, only start points are drawn
    by priority: aggregate priorities over a slice yourself if that is what you want.
    The priority rules (stored values, clamp, update policy, weights) are
    :class:`functional_rb.samplers.priorities.Prioritization`'s, shared with
    :class:`~functional_rb.PrioritizedSampler`: an index outside ``[0, capacity)`` or a
    priority that is NaN, infinite or negative raises ``ValueError`` eagerly and is ignored
    under ``jit`` (the step keeps its priority); priorities of padding are not checked.

    Slice length. Valid starts are maintained incrementally in ``add`` for one slice length
    (so ``sample`` costs ``O(num_slices * (log capacity + slice_len))``, where TorchRL rescans
    the storage on every call), which is fixed when the state is built and kept in it
    (``PrioritizedSliceState.slice_len``, static). With ``slice_len=L`` any ``batch_size`` that
    is a multiple of ``L`` works (``batch_size // L`` slices). With ``num_slices=n`` (TorchRL's
    ``slice_len = batch_size // n``), the buffer resolves it when it is built
    (:meth:`bind` with its ``batch_size``): the slice length is ``batch_size // n``;
    ``sample(..., batch_size=m)`` with ``m // n`` different from it raises ``ValueError`` at
    trace time. :meth:`with_slice_len` converts a state to another slice length in
    ``O(capacity)``, keeping the priorities (an adapter may do so for a sample with such a
    batch size).
    The sum tree is :mod:`functional_rb.samplers.sum_tree` (O(log capacity) per draw and update).
    """

    alpha: float
    beta: float
    eps: float = 1e-8
    max_priority_init: float = 1.0
    # The slice length fixed by ``bind`` (num_slices mode): batch_size // num_slices.
    bound_slice_len: int | None = dataclasses.field(default=None, init=False)

    options = ("beta",)
    state_types = (PrioritizedSliceState,)
    tracks_generations = True

    def __post_init__(self):
        super().__post_init__()
        if self.span[0]:
            raise ValueError(
                f"{self._name}(span={self.span!r}): slices start at a step drawn by its "
                "priority, so they cannot hang over their trajectory's start; use span=(False, "
                f"{self.span[1]!r}) (the right span is supported)."
            )
        Prioritization.settle(self, self._name)

    @functools.cached_property
    def prioritization(self) -> Prioritization:
        """The priority rules (value, update policy, weights) with this sampler's numbers."""
        return Prioritization(self._name, self.alpha, self.beta, self.eps, self.max_priority_init)

    def bind(self, *, batch_size: int) -> PrioritizedSliceSampler:
        """With ``num_slices=n``: this sampler with its slice length fixed to
        ``batch_size // n`` (``ReplayBuffer`` calls it with its default batch size)."""
        if self.num_slices is None:
            return self
        bound = dataclasses.replace(self)
        object.__setattr__(
            bound,
            "bound_slice_len",
            slice_shape(self._name, self.num_slices, None, int(batch_size))[1],
        )
        return bound

    def init(self, item_spec, layout: Layout) -> PrioritizedSliceState:
        """An empty state, its valid starts kept for ``slice_len`` (or, with ``num_slices``,
        the length fixed by :meth:`bind`)."""
        slice_len = self.slice_len if self.slice_len is not None else self.bound_slice_len
        if slice_len is None:
            raise ValueError(
                f"PrioritizedSliceSampler(num_slices={self.num_slices}).init: the slice length "
                "(batch_size // num_slices) is fixed when the buffer is built, but no batch_size "
                "was given (the sampler is not bound to one). Build the state with "
                "ReplayBuffer(..., batch_size=B).init(example), use "
                "sampler.bind(batch_size=B).init(...), or pass slice_len instead of num_slices."
            )
        return PrioritizedSliceState(
            slices=self.init_records(item_spec, layout, slice_len),
            tree=sum_tree.init(layout.capacity),
            prio=hugepages.zeros((layout.capacity,), jnp.float32),
            valid=hugepages.zeros((layout.capacity,), bool),
            max_priority=self.prioritization.initial_max(),
            slice_len=slice_len,
        )

    def _shape_for(self, state: PrioritizedSliceState, batch_size: int):
        """``(num_slices, slice_len)`` for ``batch_size``, or a ValueError when that slice length
        is not the one the state keeps valid starts for."""
        num, seq_len = self.shape(batch_size)
        if seq_len == state.slice_len:
            return num, seq_len
        if self.num_slices is None:
            raise ValueError(
                f"PrioritizedSliceSampler(slice_len={self.slice_len}): the sampler state keeps "
                f"valid starts for slice_len={state.slice_len}, so it was built for another "
                "sampler; use a state made by this buffer's init."
            )
        fixed = state.slice_len * self.num_slices
        raise ValueError(
            f"PrioritizedSliceSampler(num_slices={self.num_slices}): batch_size={batch_size} "
            f"means slices of {seq_len} steps, but this state keeps valid slice starts for "
            f"slice_len={state.slice_len}, i.e. batch_size={fixed} (set at init from the "
            f"buffer's batch_size). Sample with batch_size={fixed}; for {seq_len}-step slices "
            f"build the buffer with batch_size={batch_size}, or convert the state: "
            f"rb.sampler.with_slice_len(state.sampler, rb.context(state), {seq_len}) "
            f"(O(capacity)); to vary the number of slices per call use slice_len="
            f"{state.slice_len} instead of num_slices."
        )

    def with_slice_len(
        self, state: PrioritizedSliceState, ctx: Context, slice_len: int
    ) -> PrioritizedSliceState:
        """``state`` with its valid starts and sum tree recomputed for ``slice_len`` (a Python
        int); priorities, the max priority and the trajectory records are kept. O(capacity),
        jittable. With a buffer ``rb``: ``state = dataclasses.replace(state,
        sampler=rb.sampler.with_slice_len(state.sampler, rb.context(state), L))``; ``sample``
        then takes ``batch_size = num_slices * L``. Only for ``num_slices`` samplers (with
        ``slice_len`` the length is the sampler's)."""
        check_slice_args(self._name, None, slice_len)
        if self.slice_len is not None and slice_len != self.slice_len:
            raise ValueError(
                f"PrioritizedSliceSampler(slice_len={self.slice_len}).with_slice_len: the slice "
                f"length is the sampler's ({self.slice_len}), got {slice_len}; use "
                f"PrioritizedSliceSampler(..., num_slices=n) for a slice length set per state."
            )
        if self.strict_length and slice_len > ctx.layout.row_capacity:
            raise ValueError(
                f"PrioritizedSliceSampler.with_slice_len: slice_len={slice_len} exceeds the "
                f"number of time steps a row can hold ({ctx.layout.row_capacity}), so no slice "
                "could be drawn with strict_length=True."
            )
        return self._rebuild(state, ctx, int(slice_len))

    def _min_len(self, slice_len: int) -> int:
        """The fewest steps a slice may keep: a valid start has at least this many steps left
        in its trajectory (``slice_len`` less the right span)."""
        return slice_len - trajectories.span_limits(self.span, slice_len, self._name)[1]

    @compiled("slice_len")
    def _rebuild(self, state: PrioritizedSliceState, ctx: Context, slice_len: int):
        layout = ctx.layout
        age = jnp.broadcast_to(
            jnp.arange(1, layout.row_capacity + 1, dtype=jnp.int32)[None, :],
            (layout.num_envs, layout.row_capacity),
        )
        pos, valid = trajectories.starts(
            state.slices, age, ctx, self._min_len(slice_len), self.strict_length
        )
        valid_all = (
            jnp.zeros((layout.capacity,), bool)
            .at[pos.reshape(-1)]
            .set(valid.reshape(-1), mode="drop")
        )
        tree = sum_tree.set(
            state.tree,
            jnp.arange(layout.capacity, dtype=jnp.int32),
            jnp.where(valid_all, state.prio, 0.0),
            unique=True,
        )
        return dataclasses.replace(state, tree=tree, valid=valid_all, slice_len=slice_len)

    @compiled()
    def on_add(self, state: PrioritizedSliceState, record, items, ctx: Context):
        del record  # a FIFO writer: the new steps follow the newest stored one
        st = self.add_records(state.slices, items, ctx)
        layout = ctx.layout
        ne, cap = layout.num_envs, layout.row_capacity
        steps = jax.tree_util.tree_leaves(items)[0].shape[0] // ne
        if steps == 0:
            return dataclasses.replace(state, slices=st)
        kept = min(steps, cap)
        # Steps whose start validity can change: the new ones, the slice_len - 1 before them
        # (their trajectory may have grown) and the oldest stored one (it may now begin its
        # trajectory).
        w = min(kept + state.slice_len - 1, cap)
        age = jnp.concatenate([jnp.arange(1, w + 1, dtype=jnp.int32), ctx.filled[None]])[None, :]
        age = jnp.broadcast_to(age, (ne, w + 1))
        pos, valid = trajectories.starts(
            st, age, ctx, self._min_len(state.slice_len), self.strict_length
        )
        pos, valid = pos.reshape(-1), valid.reshape(-1)
        new = (age <= kept).reshape(-1)
        value = self.prioritization.new_value(state.max_priority, layout.capacity)
        prio = state.prio.at[jnp.where(new, pos, layout.capacity)].set(value, mode="drop")
        valid_all = state.valid.at[pos].set(valid, mode="drop")
        vals = jnp.where(valid, prio[jnp.minimum(pos, layout.capacity - 1)], 0.0)
        tree = sum_tree.set(state.tree, pos, vals)
        return dataclasses.replace(state, slices=st, tree=tree, prio=prio, valid=valid_all)

    def can_sample(self, state, ctx: Context, batch_size: int):
        self._shape_for(state, batch_size)
        return (ctx.size > 0) & (sum_tree.total(state.tree) > 0)

    def sample(self, state, key, batch_size: int, ctx: Context, beta=None):  # type: ignore[override]  # only its .options
        """``(Drawn, state)``; ``Drawn`` fields are ``[num_slices, slice_len]``."""
        self._shape_for(state, batch_size)
        beta = self.prioritization.beta_for(beta, where=f"{self._name}.sample")
        return self._sample(state, key, batch_size, ctx, beta)

    @compiled("batch_size")
    def _sample(self, state: PrioritizedSliceState, key, batch_size: int, ctx: Context, beta):
        num, seq_len = self._shape_for(state, batch_size)
        st = state.slices
        layout = ctx.layout
        cap = layout.row_capacity
        # total and min from the search's own reads (no copy of the tree in a fused step)
        start, v, total, vmin = sum_tree.sample_with_stats(state.tree, key, num)
        ok = (total > 0) & (ctx.size > 0) & (v > 0)
        e, t = layout.from_flat(start)
        age = jnp.remainder(ctx.cursor - 1 - t, cap) + 1
        k = trajectories.find_record(st, e, age)
        age_hi, length = trajectories.record(st, e, k, ctx.filled)
        remaining = age - (age_hi - length + 1) + 1
        eff = jnp.clip(remaining, 1, seq_len)
        j = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        tt = jnp.remainder(t[:, None] + jnp.minimum(j, (eff - 1)[:, None]), cap)
        idx = jnp.where(ok[:, None], layout.to_flat(e[:, None], tt), 0).astype(jnp.int32)
        mask = (j < eff[:, None]) & ok[:, None]
        w = self.prioritization.weights(v, vmin, beta, ok)
        weights = jnp.where(mask, w[:, None], 0.0).astype(jnp.float32)
        return Drawn(idx, weights, mask), state

    def update(self, state: PrioritizedSliceState, indices, priorities, ctx: Context, *, keep=None):
        """Set step priorities; ``indices`` ``[num_slices, slice_len]`` from a sample (padding,
        which repeats a slice's last valid index, is ignored) or flat ``[N]`` positions.
        ``keep`` (bool, the shape of ``indices``, from the buffer's generation check): steps
        to drop, unchecked."""
        if not isinstance(indices, jax.Array):
            indices = np.asarray(indices)
        kept = _padding_kept(indices)
        if keep is not None:
            kept = kept & jnp.asarray(keep)
        up = self.prioritization.updates(
            indices,
            priorities,
            ctx.layout,
            ctx.filled,
            state.max_priority,
            where=f"{self._name}.update",
            keep=kept,
        )
        return self._apply(state, up.indices, up.values, up.max_priority)

    @compiled()
    def _apply(self, state: PrioritizedSliceState, idx, values, max_priority):
        """Store ``values`` at ``idx`` (int32 ``[N]``, ``capacity`` for ignored entries; the
        last occurrence of a duplicate wins) and keep the tree in step with ``valid``."""
        n = state.prio.shape[0]
        idx = jnp.where(sum_tree.last_occurrence(idx), idx, n)
        oob = n + jnp.arange(idx.shape[0], dtype=jnp.int32)
        prio = state.prio.at[jnp.where(idx < n, idx, oob)].set(
            values, mode="drop", unique_indices=True
        )
        valid = state.valid[jnp.minimum(idx, n - 1)]
        # idx is deduplicated above (losers sent out of range): no second resolution
        tree = sum_tree.set(state.tree, idx, jnp.where(valid, values, 0.0), unique=True)
        return dataclasses.replace(state, prio=prio, tree=tree, max_priority=max_priority)
