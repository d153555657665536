"""Slice samplers: contiguous sub-trajectories that never cross an episode boundary.

Three samplers, TorchRL's names and arguments: :class:`SliceSampler`,
:class:`SliceSamplerWithoutReplacement` and
:class:`~functional_rb.samplers.prioritized_slices.PrioritizedSliceSampler`. Each draws ``num_slices``
slices of ``slice_len`` consecutive time steps; ``Sample.indices``, ``weights`` and ``mask``
are ``[num_slices, slice_len]`` and ``Sample.data`` leaves are ``[num_slices, slice_len, ...]``.
What a trajectory is, and how trajectories are tracked as items are added, is
:mod:`functional_rb.samplers.trajectories`; the arguments the three share are :class:`SliceSpec`.

These samplers assume a FIFO writer (:class:`~functional_rb.RoundRobinWriter`, or
``ReplayBuffer.init_from_data``): they follow time through the ring and are meaningless with
:class:`~functional_rb.MaxValueWriter`, whose positions are not in time order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import hugepages
from functional_rb._internal.errors import config_int, describe_structure
from functional_rb._internal.jit import compiled
from functional_rb._internal.names import stable
from functional_rb._internal.random import bits32
from functional_rb._internal.span import normalize_span
from functional_rb._internal.tree import Key, get_key, has_key, normalize_key, set_key
from functional_rb.protocol import Context, Drawn, Layout, Sampler
from functional_rb.samplers import epochs, trajectories
from functional_rb.samplers.trajectories import SliceState

__all__ = (
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "SliceSpec",
    "SliceState",
    "SliceWithoutReplacementState",
)


@stable("SliceWithoutReplacementState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SliceWithoutReplacementState:
    slices: SliceState
    perm: jax.Array  # int32 [E * R]: flat record slots (e * R + k % R) in draw order
    pos: jax.Array  # int32 []: slices drawn in this epoch
    epoch_size: jax.Array  # int32 []: eligible trajectories when the epoch began
    epoch_total: jax.Array  # int32 []: `slices.total` when the epoch began (adds end it)
    epoch: jax.Array  # int32 []: epochs begun so far


def check_slice_args(name: str, num_slices, slice_len):
    if (num_slices is None) == (slice_len is None):
        raise ValueError(
            f"{name}: pass exactly one of num_slices and slice_len, got num_slices="
            f"{num_slices!r} and slice_len={slice_len!r}. E.g. {name}(slice_len=64) draws "
            "batch_size // 64 slices of 64 steps; "
            f"{name}(num_slices=32) draws 32 slices of batch_size // 32 steps."
        )
    config_int(name, "num_slices", num_slices, none_ok=True)
    config_int(name, "slice_len", slice_len, none_ok=True)


def slice_shape(name: str, num_slices, slice_len, batch_size: int):
    """``(num_slices, slice_len)`` for a batch of ``batch_size`` steps, or a ValueError."""
    if num_slices is not None:
        if batch_size % num_slices:
            raise ValueError(
                f"{name}: batch_size={batch_size} is not divisible by num_slices={num_slices}; "
                f"batch_size = num_slices * slice_len, e.g. batch_size="
                f"{max(batch_size // num_slices, 1) * num_slices}."
            )
        return int(num_slices), batch_size // num_slices
    if batch_size % slice_len:
        raise ValueError(
            f"{name}: batch_size={batch_size} is not divisible by slice_len={slice_len}; "
            f"batch_size = num_slices * slice_len, e.g. batch_size="
            f"{max(batch_size // slice_len, 1) * slice_len}."
        )
    return batch_size // slice_len, int(slice_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceSpec(Sampler):
    """The arguments every slice sampler takes (keyword-only, as in TorchRL; each is described
    in :class:`SliceSampler`'s docstring), and what follows from them: the slice shape of a
    batch, the boundary signal, the ``truncated_key`` marks.
    """

    num_slices: int | None = None
    slice_len: int | None = None
    end_key: Key = ("next", "done")
    traj_key: Key | None = None
    truncated_key: Key | None = ("next", "truncated")
    strict_length: bool = True
    span: Any = False

    requires_fifo = True  # ReplayBuffer refuses a writer that does not write in time order

    @property
    def _name(self) -> str:
        return type(self).__name__

    def __post_init__(self):
        check_slice_args(self._name, self.num_slices, self.slice_len)
        object.__setattr__(self, "end_key", normalize_key(self.end_key))
        if self.traj_key is not None:
            object.__setattr__(self, "traj_key", normalize_key(self.traj_key))
        if self.truncated_key is not None:
            object.__setattr__(self, "truncated_key", normalize_key(self.truncated_key))
        object.__setattr__(self, "span", normalize_span(self._name, self.span))

    def validate(self, *, capacity: int, batch_size: int, ndim: int):
        del capacity, ndim
        self.shape(batch_size)

    def shape(self, batch_size: int) -> tuple:
        """``(num_slices, slice_len)`` of a batch of ``batch_size`` steps (a ValueError when
        it does not divide)."""
        return slice_shape(self._name, self.num_slices, self.slice_len, batch_size)

    @property
    def _signal_key(self):
        return self.traj_key if self.traj_key is not None else self.end_key

    def _check_spec(self, item_spec, layout: Layout, slice_len=None):
        """The spec of the boundary signal leaf, after checking the items can carry slices;
        ``slice_len``: the fixed slice length, if any (default: the ``slice_len`` field)."""
        slice_len = self.slice_len if slice_len is None else slice_len
        key = self._signal_key
        what = "traj_key" if self.traj_key is not None else "end_key"
        if not has_key(item_spec, key):
            raise ValueError(
                f"{self._name}.init: {what}={key!r} is not in the stored items, whose leaves "
                f"are {describe_structure(item_spec)}. Pass the key under which episode "
                f"{'ids' if self.traj_key is not None else 'ends (done flags)'} are stored, "
                "e.g. end_key=('next', 'done') or traj_key=('collector', 'traj_ids')."
            )
        spec = get_key(item_spec, key, where=f"{self._name}.init")
        if not hasattr(spec, "shape"):
            raise ValueError(
                f"{self._name}.init: {what}={key!r} is a sub-tree "
                f"{describe_structure(spec)}, not an array leaf."
            )
        if self.traj_key is not None and int(np.prod(spec.shape)) != 1:
            raise ValueError(
                f"{self._name}.init: the trajectory ids under traj_key={key!r} must be one "
                f"number per step (shape () or (1,)), got shape {tuple(spec.shape)}."
            )
        if self.truncated_key is not None and not isinstance(item_spec, Mapping):
            raise ValueError(
                f"{self._name}.init: truncated_key={self.truncated_key!r} needs items that are "
                "(nested) dicts so the slice ends can be marked; pass truncated_key=None."
            )
        if self.strict_length and slice_len is not None and slice_len > layout.row_capacity:
            raise ValueError(
                f"{self._name}.init: slice_len={slice_len} exceeds the number of time "
                f"steps a row can hold ({layout.row_capacity}), so no slice could ever be "
                "drawn with strict_length=True. Use a shorter slice_len or a larger capacity."
            )
        return spec

    def init_records(self, item_spec, layout: Layout, slice_len=None) -> SliceState:
        """Empty trajectory records, after checking the items can carry slices."""
        spec = self._check_spec(item_spec, layout, slice_len)
        return trajectories.init(layout, spec.dtype if self.traj_key is not None else jnp.int32)

    def add_records(self, st: SliceState, items, ctx: Context) -> SliceState:
        """``st`` after the steps ``items`` (leaves ``[E * T, ...]``) were written."""
        sig = jnp.asarray(get_key(items, self._signal_key, where=f"{self._name}.on_add"))
        ne = ctx.layout.num_envs
        sig = sig.reshape((ne, sig.shape[0] // ne) + sig.shape[1:])
        return trajectories.append(st, sig, ctx, by_id=self.traj_key is not None)

    def _slices(self, st: SliceState, bits, e, k, ok, seq_len: int, ctx: Context, rec=None):
        span = trajectories.span_limits(self.span, seq_len, self._name)
        return trajectories.slice_indices(st, bits, e, k, ok, seq_len, ctx, span, rec)

    def finalize(self, data, drawn: Drawn, ctx: Context):
        """Mark the last valid step of every slice True under ``truncated_key`` (OR-ed with the
        stored flag; False on padding), and OR the same marker into the sibling ``done`` entry
        when the items have one (as TorchRL does). If the items have no ``truncated_key`` entry
        it is added, bool ``[num_slices, slice_len]`` (plus the end flag's trailing shape)."""
        del ctx
        if self.truncated_key is None:
            return data
        m = drawn.mask
        nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
        last = m & ~nxt

        def mark(leaf):
            extra = leaf.shape[2:]
            mk = jnp.broadcast_to(last.reshape(last.shape + (1,) * len(extra)), leaf.shape)
            mm = jnp.broadcast_to(m.reshape(m.shape + (1,) * len(extra)), leaf.shape)
            return ((leaf.astype(bool) & mm) | mk).astype(leaf.dtype)

        tk = self.truncated_key
        if has_key(data, tk):
            data = set_key(data, tk, mark(get_key(data, tk, where=self._name)))
        else:
            extra = ()
            if self.traj_key is None and has_key(data, self.end_key):
                extra = get_key(data, self.end_key, where=self._name).shape[2:]
            data = set_key(data, tk, mark(jnp.zeros(last.shape + tuple(extra), bool)))
        done_key = tuple(tk[:-1]) + ("done",)
        if done_key != tk and has_key(data, done_key):
            data = set_key(data, done_key, mark(get_key(data, done_key, where=self._name)))
        return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordSampler(SliceSpec):
    """A slice sampler whose state is the trajectory records alone (:class:`SliceSampler`,
    :class:`~functional_rb.EpisodeSampler`): ``init``, ``on_add``, ``can_sample`` and
    ``sample``'s checks; a subclass draws in ``_sample``. ``whole_episodes``: only ended
    episodes whose first step is stored may be drawn (:func:`trajectories.whole`)."""

    whole_episodes = False
    state_types = (SliceState,)
    # a draw that finds no eligible trajectory masks every slice (``draw_records``' ``ok``)
    draw_reports_ok = True

    def init(self, item_spec, layout: Layout) -> SliceState:
        return self.init_records(item_spec, layout)

    @compiled()
    def on_add(self, state, record, items, ctx: Context):
        del record  # a FIFO writer: the new steps follow the newest stored one
        return self.add_records(state, items, ctx)

    def can_sample(self, state, ctx: Context, batch_size: int):
        self.shape(batch_size)
        return self._can_sample(state, ctx, batch_size)

    @compiled("batch_size")
    def _can_sample(self, state, ctx: Context, batch_size: int):
        _, seq_len = self.shape(batch_size)
        return (ctx.size > 0) & trajectories.any_eligible(
            state, ctx.filled, seq_len, self.strict_length, complete=self.whole_episodes
        )

    def sample(self, state, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
        """``(Drawn, state)``; ``Drawn`` fields are ``[num_slices, slice_len]``."""
        self.shape(batch_size)  # a clear error for a batch_size that does not divide
        return self._sample(state, key, batch_size, ctx)

    def _sample(self, state, key, batch_size: int, ctx: Context):  # pragma: no cover - abstract
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceSampler(RecordSampler):
    """Slices of consecutive steps, with replacement (TorchRL's ``SliceSampler``).

    Args:
      num_slices / slice_len: exactly one; ``batch_size = num_slices * slice_len``.
      end_key: key of the per-step end flag (default ``("next", "done")``); a step with a True
        flag (any True over trailing axes) ends its trajectory.
      traj_key: key of per-step trajectory ids; when given, boundaries come from id changes
        between consecutive steps and ``end_key`` is not used.
      truncated_key: where the returned data marks each slice's last valid step (see
        :meth:`finalize`); ``None`` leaves the data untouched.
      strict_length: True: only trajectories with at least ``slice_len`` stored steps are
        drawn. False: every trajectory may be drawn; a shorter one yields a slice of its whole
        length, padded at the end (``mask`` False, weight 0, index and data repeat the last
        valid step).
      span: ``False`` (default), ``True``, an int, or a ``(left, right)`` pair of those
        (TorchRL's argument): slices may hang over the start (left) or the end (right) of
        their trajectory and come back shorter, the missing steps masked as padding. ``True``
        keeps at least one step, an int ``i`` (below the slice length) at least
        ``slice_len - i``; the start is uniform over the widened range.

    Distribution (TorchRL's, from ``SliceSampler._sample_slices``/``_get_index``): the
    ``num_slices`` slices are independent; each picks a trajectory uniformly among the
    eligible stored trajectories (not weighted by length), then a start offset uniform in
    ``[0, L - min(L, slice_len)]`` of that trajectory of ``L`` stored steps, so the slice
    ``[start, start + min(L, slice_len))`` lies inside it. Weights are 1 (0 on padding).
    TorchRL returns a shorter, ragged batch for short trajectories; here the shape is static
    and short slices are padded. When no trajectory is eligible: eagerly a ``ValueError``;
    under jit ``mask`` False everywhere.
    """

    @compiled("batch_size")
    def _sample(self, state, key, batch_size: int, ctx: Context):
        num, seq_len = self.shape(batch_size)
        bits = bits32(key, (num, trajectories.TRIES + 2))
        e, k, ok, rec = trajectories.draw_records_read(
            state, bits[:, : trajectories.TRIES + 1], seq_len, ctx.filled, self.strict_length
        )
        idx, mask = self._slices(state, bits[:, -1], e, k, ok, seq_len, ctx, rec)
        return Drawn(idx, mask.astype(jnp.float32), mask), state


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceSamplerWithoutReplacement(SliceSpec):
    """Slices without replacement (TorchRL's ``SliceSamplerWithoutReplacement``).

    Epochs, as in TorchRL: an epoch is a permutation of the eligible trajectories stored when
    it began (storage order, oldest first per row, when ``shuffle=False``); each batch takes
    the next ``num_slices`` of them and one slice from each (start uniform as in
    :class:`SliceSampler`). So within an epoch a trajectory yields at most one slice, and no
    slice start (indeed no trajectory) is drawn twice. A new epoch begins when the previous
    one is exhausted, when anything was added since it began (TorchRL resets on extend), or,
    with ``drop_last=True``, when fewer than ``num_slices`` trajectories remain. With
    ``drop_last=False`` the last batch of an epoch holds the remaining slices followed by
    fully masked slices (weight 0). Deviation: TorchRL draws short trajectories and then drops
    them (its batch shrinks); with ``strict_length=True`` this epoch only contains trajectories
    with at least ``slice_len`` stored steps.
    """

    drop_last: bool = False
    shuffle: bool = True
    state_types = (SliceWithoutReplacementState,)

    def init(self, item_spec, layout: Layout) -> SliceWithoutReplacementState:
        return SliceWithoutReplacementState(
            slices=self.init_records(item_spec, layout),
            perm=hugepages.full(
                (layout.capacity,), jnp.arange(layout.capacity, dtype=jnp.int32), jnp.int32
            ),
            pos=jnp.int32(0),
            epoch_size=jnp.int32(0),
            epoch_total=jnp.int32(0),
            epoch=jnp.int32(0),
        )

    @compiled()
    def on_add(self, state, record, items, ctx: Context):
        del record
        return dataclasses.replace(state, slices=self.add_records(state.slices, items, ctx))

    def can_sample(self, state, ctx: Context, batch_size: int):
        self.shape(batch_size)
        return self._can_sample(state, ctx, batch_size)

    @compiled("batch_size")
    def _can_sample(self, state, ctx: Context, batch_size: int):
        num, seq_len = self.shape(batch_size)
        if self.drop_last:
            _, _, elig = trajectories.all_records(
                state.slices, ctx.filled, seq_len, self.strict_length
            )
            return jnp.sum(elig, dtype=jnp.int32) >= num
        return (ctx.size > 0) & trajectories.any_eligible(
            state.slices, ctx.filled, seq_len, self.strict_length
        )

    def sample(self, state, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
        """``(Drawn, state)``; ``Drawn`` fields are ``[num_slices, slice_len]``."""
        self.shape(batch_size)
        return self._sample(state, key, batch_size, ctx)

    def _epoch_order(self, st: SliceState, key, filled, seq_len: int):
        """A new epoch's order of flat record slots (eligible first) and its size."""
        ks, _, elig = trajectories.all_records(st, filled, seq_len, self.strict_length)
        elig = elig.reshape(-1)
        if self.shuffle:
            order = epochs.shuffled(key, elig)
        else:  # oldest first per row
            ne, cap = ks.shape
            rank = (ks - st.head[:, None]).astype(jnp.float32)
            score = (jnp.arange(ne, dtype=jnp.float32)[:, None] * cap + rank).reshape(-1)
            order = epochs.ordered(score / jnp.float32(ne * cap), elig)
        return order, jnp.sum(elig, dtype=jnp.int32)

    @compiled("batch_size")
    def _sample(self, state: SliceWithoutReplacementState, key, batch_size: int, ctx: Context):
        num, seq_len = self.shape(batch_size)
        st = state.slices
        k_perm, k_off = jax.random.split(key)
        epoch = epochs.Epoch(state.perm, state.pos, state.epoch_size, state.epoch)
        flat, ok, epoch = epochs.next_batch(
            epoch,
            num,
            stale=(state.epoch_total != st.total) | (state.epoch == 0),
            drop_last=self.drop_last,
            begin=lambda: self._epoch_order(st, k_perm, ctx.filled, seq_len),
        )
        cap = st.rec_start.shape[1]
        e = flat // cap
        k = st.head[e] + jnp.remainder(flat % cap - st.head[e], cap)
        idx, mask = self._slices(st, bits32(k_off, (num,)), e, k, ok, seq_len, ctx)
        new_state = SliceWithoutReplacementState(
            slices=st,
            perm=epoch.order,
            pos=epoch.pos,
            epoch_size=epoch.size,
            epoch_total=st.total,
            epoch=epoch.count,
        )
        return Drawn(idx, mask.astype(jnp.float32), mask), new_state
