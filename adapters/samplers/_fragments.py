"""Trajectories whose steps are interleaved in storage (TorchRL's ``fragmented=True``).

Several workers writing to one buffer interleave their trajectories' steps, so storage order
says nothing of which step follows which. With a trajectory id and a step number stored per
step, the logical order is recovered: the stored steps sorted by (trajectory, step) — a pure
function of the stored values, as TorchRL's ``_FragmentedTrajectoryIndex`` — and cut into
runs wherever the trajectory changes or a step number is missing (an overwritten or never
stored step splits its trajectory into two runs). A slice is drawn within one run.

:class:`FragmentIndex` keeps one record per storage row (``-1`` step: no live record),
rewritten only for the rows a write touched, and the runs are rebuilt from the records after a
change. The checks and their exception types are TorchRL's: ids and step numbers must be
scalar integers per step, steps >= 0, and each (trajectory, step) pair stored once.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import is_tensor_collection

__all__ = ["FragmentIndex", "check_fragmented_args", "check_fragmented_storage", "draw_in_runs"]


def check_fragmented_args(
    name: str, *, own_sample: bool, step_key, ends, trajectories, span, compile
) -> None:
    """TorchRL's refusals for ``fragmented=True`` (``name``: the sampler class being built;
    ``own_sample``: it draws with another ``sample`` than SliceSampler's)."""
    if own_sample:
        raise NotImplementedError(
            f"{name}(fragmented=True): fragmented=True currently supports SliceSampler with "
            "replacement only."
        )
    if step_key is None:
        raise ValueError("step_key must be provided when fragmented=True.")
    if ends is not None:
        raise ValueError(
            "fragmented=True requires trajectory and step identifiers; the static "
            "ends argument cannot reconstruct interleaved trajectories."
        )
    if trajectories is not None:
        raise ValueError(
            "The static trajectories argument is not supported with "
            "fragmented=True; provide traj_key and step_key."
        )
    if any(span):
        raise NotImplementedError("span is not supported with fragmented=True.")
    if compile:
        raise NotImplementedError("compile is not supported with fragmented=True.")


def check_fragmented_storage(storage, *, by_id: bool) -> None:
    """TorchRL's refusals at sampling: a storage of several dimensions, no trajectory ids."""
    if storage.ndim > 1:
        raise NotImplementedError(
            "Fragmented trajectory indexing only supports single-dimensional storages, got "
            f"storage.ndim={storage.ndim}. Use a one-dimensional storage with fragmented=True, "
            "or one row per collector (ndim=2) without it."
        )
    if not by_id:
        raise RuntimeError(
            "fragmented=True requires a trajectory identifier under traj_key; "
            "end-of-trajectory flags alone cannot reconstruct interleaved data."
        )


class FragmentIndex:
    """Per storage row, the (trajectory, step) record of its step; the runs they form."""

    def __init__(self, traj_key, step_key, rows: int):
        self.traj_key, self.step_key = traj_key, step_key
        self.traj = np.zeros(rows, np.int64)
        self.step = np.full(rows, -1, np.int64)
        self._runs = None

    # ------------------------------------------------------------------ records
    def write(self, storage, rows: torch.Tensor, holes: np.ndarray | None = None) -> None:
        """Read the records of storage ``rows`` (dim 0), in place of those they had;
        ``holes`` (bool, per row of ``rows``): torn rows, which hold no live record."""
        data = getattr(storage, "data", None)
        if not is_tensor_collection(data):
            raise TypeError(
                "Fragmented trajectory indexing requires a single-dimensional "
                "storage whose slices return a tensor collection, such as "
                f"LazyTensorStorage or LazyStackStorage; this "
                f"{type(storage).__name__} holds {type(data).__name__}."
            )
        traj = self._column(data, self.traj_key, rows)
        step = self._column(data, self.step_key, rows)
        if step.size and int(step.min()) < 0:
            raise ValueError(
                f"Step numbers must be non-negative, got {int(step.min())} under "
                f"step_key={self.step_key!r}."
            )
        if holes is not None:
            step = np.where(holes, -1, step)
        at = rows.numpy()
        self.traj[at], self.step[at] = traj, step
        self._runs = None

    def _column(self, data, key, rows: torch.Tensor) -> np.ndarray:
        value = data.get(key, None)
        if value is None:
            stored = sorted(map(str, data.keys(include_nested=True, leaves_only=True)))
            which = "traj_key" if key == self.traj_key else "step_key"
            raise KeyError(
                f"SliceSampler(fragmented=True): {which} {key!r} is not in the "
                f"storage, whose entries are {stored}. Store a trajectory id and a "
                "step number per step (e.g. ('collector', 'traj_ids') and "
                "'step_count') and name them with traj_key= and step_key=."
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"key={key!r} must contain a tensor, got {type(value).__name__}.")
        value = value[rows].reshape(rows.numel(), -1)
        if value.shape[1] != 1:
            raise RuntimeError(
                f"Expected scalar values under key={key!r}, got shape {tuple(value.shape)}."
            )
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"key={key!r} must contain integer values, got dtype={value.dtype}.")
        return value[:, 0].cpu().numpy().astype(np.int64)

    # ------------------------------------------------------------------ runs
    def runs(self, stored: int):
        """``(slots, offsets, lengths)``, long tensors: the live rows among the first
        ``stored`` sorted by (trajectory, step), and where each run starts in that order and
        how many steps it has (TorchRL's packing)."""
        if self._runs is None:
            live = np.flatnonzero(self.step[:stored] >= 0)
            traj, step = self.traj[live], self.step[live]
            order = np.lexsort((step, traj))  # stable: by trajectory, then step
            traj, step = traj[order], step[order]
            same = traj[1:] == traj[:-1]
            dup = np.flatnonzero(same & (step[1:] == step[:-1]))
            if dup.size:
                raise self._duplicate_error(int(traj[dup[0]]), int(step[dup[0]]))
            new_run = np.ones(step.size, bool)
            new_run[1:] = ~same | (step[1:] != step[:-1] + 1)
            offsets = np.flatnonzero(new_run)
            lengths = np.diff(np.append(offsets, step.size))
            self._runs = tuple(
                torch.from_numpy(np.ascontiguousarray(x, np.int64))
                for x in (live[order], offsets, lengths)
            )
        return self._runs

    def _duplicate_error(self, trajectory: int, step: int) -> RuntimeError:
        return RuntimeError(
            f"Found duplicate records for trajectory {trajectory!r} at step {step} (traj_key="
            f"{self.traj_key!r}, step_key={self.step_key!r}). Trajectory-step pairs must be "
            "unique in the live storage. This commonly happens when trajectory ids are reused, "
            "e.g. a recreated collector restarts its traj_ids at 0 while episodes from a "
            "previous run are still stored. Use a trajectory key whose ids stay unique across "
            "the buffer lifetime, or empty the buffer before reusing ids."
        )


def draw_in_runs(
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    seq: int,
    num_slices: int,
    strict_length: bool,
    rng,
):
    """TorchRL's fragmented draw: ``torch.randint`` over the runs (those of at least ``seq``
    steps with ``strict_length``), then ``torch.rand`` for each slice's start within its run.
    Returns ``(packed starts long [num_slices], steps per slice: seq, or long
    [num_slices])``; the starts index the runs' packed order."""
    if not lengths.numel():
        raise RuntimeError("No logical trajectory runs are available for sampling.")
    n: int | torch.Tensor = seq
    if strict_length:
        eligible = lengths >= seq
        if not bool(eligible.any()):
            raise RuntimeError(
                "Did not find a single fragmented trajectory run with sufficient length "
                f"(length range: {int(lengths.min())} - {int(lengths.max())} / required={seq}). "
                "Store longer trajectories, sample shorter slices, or pass strict_length=False."
            )
        offsets, lengths = offsets[eligible], lengths[eligible]
        run = torch.randint(lengths.shape[0], (num_slices,), generator=rng)
    else:
        run = torch.randint(lengths.shape[0], (num_slices,), generator=rng)
        n = lengths[run].clamp_max(seq)
    available = lengths[run] - n + 1
    rel = (torch.rand(num_slices, generator=rng) * available).floor().to(offsets.dtype)
    return offsets[run] + rel, n
