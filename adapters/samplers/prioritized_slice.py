"""TorchRL's ``PrioritizedSliceSampler``: slices whose start is drawn by priority."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from tensordict.utils import NestedKey

from functional_rb.adapters.samplers._trees import StartTree
from functional_rb.adapters.samplers.prioritized import PrioritizedSampler
from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["PrioritizedSliceSampler"]


class PrioritizedSliceSampler(SliceSampler, PrioritizedSampler):
    """Slices whose start is drawn by priority (TorchRL's ``PrioritizedSliceSampler``).

    Priorities are per step, by TorchRL's flat index (``t * num_envs + env``), in TorchRL's
    segment trees (:class:`PrioritizedSampler`'s). The starts are drawn, as TorchRL draws them,
    from the sum tree with 0 at the steps a slice of ``slice_len`` steps cannot start at (the
    last ``slice_len - 1`` of each trajectory, fewer with ``span``; never a trajectory's first
    step with ``strict_length=False``): TorchRL zeroes and restores those steps around every
    draw; here a zeroed copy is kept up to date as priorities and trajectories change
    (:mod:`functional_rb.adapters.samplers._trees`), with the same node values. The draw
    makes :class:`PrioritizedSampler`'s generator calls (the same seed gives TorchRL's starts:
    the buffer's ``generator``, else NumPy's global generator),
    and each slice comes back with its start's ``priority_weight`` on every step. With
    ``num_slices`` the slice length follows each ``sample``'s batch size, as in TorchRL.

    Where TorchRL's rules are wrong this sampler is right, and the draws can differ there: on a
    full ``ndim=2`` storage TorchRL shifts the excluded steps of every env by ``t0 * num_envs``
    instead of ``t0`` (so slices may cross episode ends); a slice starting after the wrap point
    of a trajectory that wraps around a full ring gets, in TorchRL, the next trajectory's end;
    at slice length 1 TorchRL excludes every step (``pad[:, -0:]``) and raises; here none is.
    A draw that fails (no start with a positive priority) leaves TorchRL's zeroed steps at 0
    for good (its restore is skipped); here the priorities are never touched by a draw.

    Args:
      max_capacity: the trees' size (None: the storage's size when first seen).
      alpha: the priority exponent (required).
      beta: the importance-weight exponent (required).
      eps: added to every priority.
      dtype: the trees' dtype, ``torch.float32`` or ``torch.float64``.
      reduction: how a priority with several elements per step is reduced.
      end_keys: several end flags, OR-ed (TorchRL's newest argument).
      span: the right span, as in :class:`SliceSampler` (a left span is turned off, with a
        warning: starts are drawn by priority).

    Example:
        >>> import numpy as np, torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, PrioritizedSliceSampler,
        ...                                     TensorDictReplayBuffer)
        >>> done = torch.zeros(20, 1, dtype=torch.bool)
        >>> done[9] = done[19] = True
        >>> rb = TensorDictReplayBuffer(
        ...     storage=LazyTensorStorage(100), batch_size=8,
        ...     sampler=PrioritizedSliceSampler(100, alpha=0.7, beta=0.5, slice_len=4))
        >>> index = rb.extend(TensorDict({"obs": torch.arange(20), ("next", "done"): done},
        ...                              [20]))
        >>> np.random.seed(0)
        >>> rb.sample()["priority_weight"].shape
        torch.Size([8])
    """

    def __init__(
        self,
        max_capacity: int | None = None,
        alpha: float | None = None,
        beta: float | None = None,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: NestedKey | None = None,
        end_keys: Sequence[NestedKey] | None = None,
        traj_key: NestedKey | None = None,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        cache_values: bool = False,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        strict_length: bool = True,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        use_gpu: bool | torch.device = False,
        max_priority_within_buffer: bool = False,
    ):
        if alpha is None or beta is None:
            raise TypeError("PrioritizedSliceSampler: alpha and beta are required.")
        SliceSampler.__init__(
            self,
            num_slices=num_slices,
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            ends=ends,
            trajectories=trajectories,
            cache_values=cache_values,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            compile=compile,
            span=span,
            use_gpu=use_gpu,
        )
        self._deferred = max_capacity is None
        PrioritizedSampler.__init__(
            self,
            1 if max_capacity is None else max_capacity,
            alpha,
            beta,
            eps,
            dtype,
            reduction,
            max_priority_within_buffer,
        )
        self._starts = StartTree()
        if self.span[0]:
            warnings.warn(
                f"Left spanning is disabled for {type(self).__name__} and will be "
                "automatically turned off: slice starts are drawn by priority.",
                stacklevel=2,
            )
            self.span = (False, self.span[1])

    def _trees_for(self, storage) -> None:
        """``max_capacity=None``: the trees take the storage's size when first seen."""
        if self._deferred and storage is not None:
            self._deferred = False
            self._max_capacity = int(storage.max_size)
            self._init()

    def _sync(self, storage) -> None:
        self._trees_for(storage)
        SliceSampler._sync(self, storage)

    # ------------------------------------------------------------------ sample
    def _excluded(self, storage, start, lengths, seq: int) -> torch.Tensor:
        """TorchRL's flat indices of the steps no slice may start at for this draw."""
        right = self.span[1]
        k = 1 if right is True else seq - 1 - int(right)
        skip = 0 if self.strict_length else 1  # a trajectory's first step stays drawable
        count = torch.minimum(torch.full_like(lengths, max(k, 0)), lengths - skip).clamp_min(0)
        traj = torch.repeat_interleave(torch.arange(lengths.numel()), count)
        first = torch.cumsum(count, 0) - count
        back = torch.arange(traj.numel()) - first[traj]  # 0 for the trajectory's last step
        t = (start[traj, 0] + lengths[traj] - 1 - back) % storage.shape[0]
        envs = storage.shape[1] if storage.ndim > 1 else 1
        return t * envs + start[traj, 1]

    def _stops(self, storage, start, stop, t0, env):
        """Steps left from each start to its trajectory's last step (the trajectory found by
        the start's row, a wrapping one included)."""
        rows = storage.shape[0]
        keys = stop[:, 1] * rows + stop[:, 0]
        j = torch.searchsorted(keys, env * rows + t0)
        first = torch.searchsorted(keys, env * rows)
        past = (j >= keys.numel()) | (stop[j.clamp_max(keys.numel() - 1), 1] != env)
        j = torch.where(past, first, j)  # after the column's last end: its wrapping trajectory
        return (stop[j, 0] - t0) % rows + 1

    def sample(self, storage, batch_size: int):
        self._sync(storage)
        start, stop, lengths = self._bounds_of(storage)
        num_slices, seq = self._shape(batch_size)
        # the blocked steps depend on the row count only through wrapping trajectories, which
        # only a full storage holds: a filling storage keeps them while it grows
        rows = int(storage.shape[0]) if storage.is_full else None
        starts = self._starts.follow(
            self._sum_tree,
            (seq, rows, tuple(storage.shape[1:])),
            self.bounds_revision,
            start,
            lengths,
            lambda s, n: self._excluded(storage, s, n, seq).numpy(),
        )
        # PrioritizedSampler's own draw (the same generator calls, weights and checks) over the
        # tree of starts; the min tree stays the whole one, as TorchRL's
        priorities, self._sum_tree = self._sum_tree, starts
        try:
            flat, weight = self._draw(len(storage), num_slices)
        finally:
            self._sum_tree = priorities
        envs = storage.shape[1] if storage.ndim > 1 else 1
        t0, env = flat // envs, flat % envs
        if self.span[1] or not self.strict_length:
            seq = torch.minimum(self._stops(storage, start, stop, t0, env), torch.tensor(seq))
        return self._slices(storage, t0, env, seq, None, weight=weight)

    # ------------------------------------------------------------------ priorities
    def update_priority(self, index, priority, *, storage=None) -> None:
        """Priorities of steps (TorchRL's indices: ``[N]`` flat, or ``(t, env)`` pairs with
        ``storage=``). Works before the sampler has seen the storage (the trees are by
        index)."""
        self._trees_for(storage)
        PrioritizedSampler.update_priority(self, index, priority, storage=storage)

    def mark_update(self, index, *, storage=None) -> None:
        self._trees_for(storage)
        PrioritizedSampler.mark_update(self, index, storage=storage)

    def add(self, index, *, storage=None) -> None:
        PrioritizedSampler.add(self, index, storage=storage)
        SliceSampler.add(self, index, storage=storage)

    def extend(self, index, *, storage=None) -> None:
        PrioritizedSampler.extend(self, index, storage=storage)
        SliceSampler.extend(self, index, storage=storage)

    def _empty(self) -> None:
        SliceSampler._empty(self)
        PrioritizedSampler._empty(self)
        self._starts.reset()

    def state_dict(self) -> dict[str, Any]:
        return PrioritizedSampler.state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        PrioritizedSampler.load_state_dict(self, state_dict)

    def dumps(self, path) -> None:
        PrioritizedSampler.dumps(self, path)

    def loads(self, path) -> None:
        PrioritizedSampler.loads(self, path)

    def __getstate__(self):
        PrioritizedSampler.__getstate__(self)  # refuses a spawn (priorities are per process)
        state = SliceSampler.__getstate__(self)
        state["_starts"] = StartTree()  # rebuilt from the priorities where it lands
        return state

    def __repr__(self):
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len="
            f"{self.slice_len}, end_key={self.end_key}, traj_key={self.traj_key}, "
            f"truncated_key={self.truncated_key}, strict_length={self.strict_length},"
            f"alpha={self._alpha}, beta={self._beta}, eps={self._eps}"
        )
