"""Trajectory boundaries in storage order (TorchRL's ``find_start_stop_traj`` and
``DEFAULT_DONE_KEYS``, exported by ``torchrl.data``).

:func:`find_start_stop_traj` takes the trajectory ids or end flags of a storage's rows, time
along dim 0 (``[T, *B]``), and returns where each trajectory starts and stops, with TorchRL's
layout rules: a full storage is a ring (a trajectory may run through the last row into row 0),
the row under the write cursor ends a trajectory (what followed it was overwritten), and a
storage that is not full ends one at its last row. It works on the stored signal as it is and
returns indices; use :func:`functional_rb.adapters.query.iter_trajectories` to read the
trajectories of a buffer.
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["DEFAULT_DONE_KEYS", "find_start_stop_traj"]

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
"""The entries whose True value ends a trajectory (under ``"next"`` in TorchRL's layout):
TorchRL's ``torchrl.data.DEFAULT_DONE_KEYS``."""


def find_start_stop_traj(*, trajectory: torch.Tensor | None = None,
                         end: torch.Tensor | None = None, at_capacity: bool,
                         cursor: int | torch.Tensor | range | None = None,
                         device: torch.device | None = None) -> tuple:
    """Where the trajectories of a storage's rows start and stop (TorchRL's function).

    Keyword Args:
        trajectory (torch.Tensor, optional): trajectory ids ``[T, *B]`` in storage order; a
            trajectory ends where the id changes from one row to the next. Exclusive with
            ``end``.
        end (torch.Tensor, optional): end flags ``[T, *B]`` (True, or nonzero, at the last step
            of a trajectory). Exclusive with ``trajectory``. Not modified.
        at_capacity (bool): whether the storage is full, hence a ring: the steps after the last
            end of a column continue at row 0. Otherwise the last row ends a trajectory.
        cursor (int, torch.Tensor or range, optional): the row written last (a tensor or range
            of rows: its last one). Used when ``at_capacity``: that row ends a trajectory.
        device (torch.device, optional): where to compute; the results come back on the
            input's device.

    Returns:
        ``(start, stop, lengths)``: ``start`` and ``stop`` int64 ``[N, 1 + len(B)]`` (per
        trajectory, the row of its first / last step, then its batch coordinates), ``lengths``
        int64 ``[N]``. Trajectories are ordered by column (the last batch dim varying slowest,
        as TorchRL orders them), then by the row of their last step. One that runs through
        the ring's end has ``start > stop``.

    Example:
        >>> end = torch.zeros(10, dtype=torch.bool)
        >>> end[2] = end[7] = True
        >>> start, stop, lengths = find_start_stop_traj(end=end, at_capacity=True, cursor=4)
        >>> start.squeeze(-1), stop.squeeze(-1), lengths
        (tensor([8, 3, 5]), tensor([2, 4, 7]), tensor([5, 2, 3]))
    """
    ends = _end_flags(trajectory, end, at_capacity, cursor)
    origin = ends.device
    if device is not None:
        ends = ends.to(device)
    start, stop, lengths = _start_stop(ends)
    return start.to(origin), stop.to(origin), lengths.to(origin)


def _end_flags(trajectory, end, at_capacity: bool, cursor) -> torch.Tensor:
    """Bool ``[T, *B]``: every trajectory's last step True (the cursor's row and the
    storage's implicit ends included)."""
    if (trajectory is None) == (end is None):
        raise TypeError("Exactly one of `trajectory` and `end` must be provided, got "
                        f"trajectory={_describe(trajectory)} and end={_describe(end)}.")
    signal = trajectory if trajectory is not None else end
    if signal.ndim == 0:
        raise RuntimeError("Expected the end-of-trajectory signal to be at least "
                           f"1-dimensional. find_start_stop_traj got a scalar; pass [T, *B].")
    if signal.shape[0] == 0:
        raise RuntimeError("Cannot recover trajectory boundaries from an empty (T=0) input.")
    if trajectory is not None:
        # the last row ends one unless the ring continues into a row 0 of the same id
        last = trajectory[-1:] != trajectory[:1] if at_capacity else \
            torch.ones_like(trajectory[:1], dtype=torch.bool)
        ends = torch.cat([trajectory[:-1] != trajectory[1:], last], 0)
    else:
        ends = (end != 0) if end.dtype != torch.bool else end.clone()
        if not at_capacity:
            ends[-1] = True
    if at_capacity:
        if cursor is not None:
            row = _cursor_row(cursor)
            ends = torch.index_fill(ends, 0, torch.tensor(row, device=ends.device), True)
        # a column with no end at all is one trajectory, ended at the last row
        ends[-1] |= ~ends.any(0)
    return ends


def _cursor_row(cursor) -> int:
    if isinstance(cursor, torch.Tensor):
        cursor = cursor.reshape(-1)
        if not cursor.numel():
            raise RuntimeError("cursor must not be an empty tensor.")
        return int(cursor[-1])
    if isinstance(cursor, range):
        if not len(cursor):
            raise RuntimeError("cursor must not be an empty range.")
        return cursor[-1]
    if isinstance(cursor, bool) or not isinstance(cursor, numbers.Integral):
        raise RuntimeError("cursor should be an integer or a 1d tensor or a range. "
                           f"find_start_stop_traj got {type(cursor).__name__}.")
    return int(cursor)


def _start_stop(ends: torch.Tensor) -> tuple:
    steps = ends.shape[0]
    # nonzero over [*B reversed, T], then time moved to column 0: TorchRL's order
    stop = ends.transpose(0, -1).nonzero()
    stop[:, [0, -1]] = stop[:, [-1, 0]].clone()
    follows = (stop[:, 0] + 1) % steps  # the row after each stop
    columns = stop[:, 1:]
    same_column = (columns[1:] == columns[:-1]).all(-1)
    first = torch.cat([same_column.new_ones(1), ~same_column])   # first stop of its column
    last = torch.cat([~same_column, same_column.new_ones(1)])    # last stop of its column
    # a trajectory starts after the previous stop of its column; the column's first one after
    # the column's last stop (through the ring's end)
    start_row = torch.roll(follows, 1)
    start_row[first] = follows[last]
    start = stop.clone()
    start[:, 0] = start_row
    lengths = stop[:, 0] - start[:, 0] + 1
    lengths = torch.where(lengths <= 0, lengths + steps, lengths)
    return start, stop, lengths


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return repr(x)
