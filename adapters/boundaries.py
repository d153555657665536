"""TorchRL's trajectory boundaries, in one place: which entries carry them, which stored steps
end a trajectory, and where each trajectory starts and stops in storage order.

The trajectory queries (:func:`boundary_signal`, :func:`spans`) and TorchRL's public
:func:`find_start_stop_traj` apply the rule the slice samplers use,
:func:`functional_rb.adapters.samplers.slice.find_bounds`, written once there (where TorchRL
keeps its own, beside its ``SliceSampler``), in NumPy (no JAX: the torch-only paths stay so).

The rule, TorchRL's, over the signal of a storage's rows ``[L, E]`` (rows ``0..L-1`` in storage
order, ``E`` env columns): trajectory ids, or end flags.

* With ids, a trajectory ends where the id changes from one row to the next (a full storage
  also compares its last row with its first); with end flags, at a row whose flag is True.
* A storage that is not full ends a trajectory at its last stored row; a full one (a ring) at
  the row written last (the cursor), and at its last row in env columns that have no end.
* A trajectory starts after the previous end of its column; a column's first trajectory after
  the column's last end, through the ring's end when full.
* Trajectories come in TorchRL's order: by column (``end.transpose(0, -1).nonzero()``), then
  by the row of their last step.

The entries, TorchRL's: ``DEFAULT_DONE_KEYS`` (:mod:`functional_rb.adapters.ted_hooks`) under
``"next"`` (or at the root) are the end flags; the queries look for the ids in :data:`ID_KEYS` (the slice samplers in
``SLICE_TRAJ_KEYS``, beside them).
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np
import torch

from functional_rb.adapters.samplers.slice import find_bounds
from functional_rb.adapters.ted_hooks import DEFAULT_DONE_KEYS

__all__ = [
    "DEFAULT_DONE_KEYS",
    "END_KEY_GROUPS",
    "ID_KEYS",
    "boundary_signal",
    "find_start_stop_traj",
    "spans",
]

ID_KEYS = (("collector", "traj_ids"), "traj_ids", "episode")
"""Where the trajectory queries look for per-step trajectory ids, in order."""

END_KEY_GROUPS = (tuple(("next", k) for k in DEFAULT_DONE_KEYS), DEFAULT_DONE_KEYS)
"""The end flags the queries OR when there are no ids: under ``"next"``, else at the root."""


# ------------------------------------------------------------------------------ TorchRL's API
def find_start_stop_traj(
    *,
    trajectory: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
    at_capacity: bool,
    cursor: int | torch.Tensor | range | None = None,
    device: torch.device | None = None,
) -> tuple:
    """Where the trajectories of a storage's rows start and stop (TorchRL's function).

    Args:
        trajectory: trajectory ids ``[T, *B]`` in storage order; a trajectory ends where the
            id changes from one row to the next. Exclusive with ``end``.
        end: end flags ``[T, *B]`` (True, or nonzero, at the last step of a trajectory).
            Exclusive with ``trajectory``. Not modified.
        at_capacity: whether the storage is full, hence a ring: the steps after the last end
            of a column continue at row 0. Otherwise the last row ends a trajectory.
        cursor: the row written last (a tensor or range of rows: its last one). Used when
            ``at_capacity``: that row ends a trajectory.
        device: accepted for TorchRL's signature: the boundaries are found on the host (the
            rule above, in NumPy); the results come back on the input's device.

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
    del device  # the host computes; see the docstring
    if (trajectory is None) == (end is None):
        raise TypeError(
            "Exactly one of `trajectory` and `end` must be provided, got "
            f"trajectory={_describe(trajectory)} and end={_describe(end)}."
        )
    signal = trajectory if trajectory is not None else end
    if signal.ndim == 0:
        raise RuntimeError(
            "Expected the end-of-trajectory signal to be at least "
            "1-dimensional. find_start_stop_traj got a scalar; pass [T, *B]."
        )
    if signal.shape[0] == 0:
        raise RuntimeError("Cannot recover trajectory boundaries from an empty (T=0) input.")
    steps, inner = signal.shape[0], tuple(signal.shape[1:])
    # TorchRL orders columns as nonzero() over end.transpose(0, -1): the last batch dim first,
    # then the others in order
    order = (0, signal.ndim - 1, *range(1, signal.ndim - 1)) if inner else (0,)
    sig = signal.detach().to("cpu").permute(order).reshape(steps, -1).numpy()
    if trajectory is None:
        sig = sig != 0
    row = _cursor_row(cursor) if at_capacity and cursor is not None else None
    start_t, col, stop_t, lengths = find_bounds(
        sig, by_id=trajectory is not None, at_capacity=at_capacity, cursor=row
    )
    if inner:
        permuted = tuple(inner[i - 1] for i in order[1:])
        coords = np.unravel_index(col, permuted)  # (B_last, B_1, ..., B_{n-1})
        coords = (*coords[1:], coords[0])
    else:
        coords = ()
    start = torch.from_numpy(np.stack([start_t, *coords], -1).astype(np.int64))
    stop = torch.from_numpy(np.stack([stop_t, *coords], -1).astype(np.int64))
    origin = signal.device
    return start.to(origin), stop.to(origin), torch.from_numpy(lengths).to(origin)


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
        raise RuntimeError(  # noqa: TRY004 - TorchRL's exception, which its users catch
            "cursor should be an integer or a 1d tensor or a range. "
            f"find_start_stop_traj got {type(cursor).__name__}."
        )
    return int(cursor)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return repr(x)


# ------------------------------------------------------------------------------ the queries
def _steps_of(value, source, key, where: str, *, ids: bool) -> np.ndarray:
    """``value`` (an entry of ``source``, batch ``[T, *B]``) as numpy ``[T, E]`` per step:
    the id (one number per step), or the OR of the flag's elements."""
    lead = tuple(source.batch_size)
    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    steps, envs = lead[0], int(np.prod(lead[1:], dtype=np.int64))
    if arr.shape[: len(lead)] != lead or (ids and arr.size != steps * envs):
        what = "one trajectory id per step" if ids else "end flags per step"
        raise ValueError(
            f"{where}: {key!r} must hold {what}: expected shape {lead} (or "
            f"{lead + (1,)}), got {tuple(arr.shape)}. Pass trajectory_key= "
            "naming per-step trajectory ids."
        )
    if ids:
        return arr.reshape(steps, envs)
    return arr.reshape(steps, envs, -1).astype(bool).any(-1)


def boundary_signal(source, trajectory_key, where: str) -> tuple[bool, np.ndarray]:
    """``(by_id, signal [T, E])`` of a TensorDict ``[T, *B]``: the trajectory ids of every step
    (``trajectory_key``, else the first of :data:`ID_KEYS` present), or, without ids, the OR of
    the end flags (:data:`END_KEY_GROUPS`), with a ``UserWarning``: two episodes with no True
    flag between them cannot be told apart."""
    for key in ID_KEYS if trajectory_key is None else (trajectory_key,):
        ids = source.get(key, None)
        if ids is not None:
            return True, _steps_of(ids, source, key, where, ids=True)
    if trajectory_key is not None:
        stored = sorted(map(str, source.keys(include_nested=True, leaves_only=True)))
        raise KeyError(
            f"{where}: trajectory_key {trajectory_key!r} not found in data, whose "
            f"entries are {stored}. Name the entry holding per-step trajectory "
            "ids, or pass trajectory_key=None to find ids or end flags."
        )
    for group in END_KEY_GROUPS:
        found = [(k, source.get(k)) for k in group if source.get(k, None) is not None]
        if found:
            warnings.warn(
                "No trajectory id entry was found; splitting on the end-of-episode flags "
                f"{tuple(k for k, _ in found)}. A trajectory whose last step has no True end "
                "flag is merged with the next one. Store trajectory ids (e.g. ('collector', "
                "'traj_ids')) or pass trajectory_key= for reliable splitting.",
                UserWarning,
                stacklevel=4,
            )
            flags = [_steps_of(v, source, k, where, ids=False) for k, v in found]
            return False, np.logical_or.reduce(flags)
    raise KeyError(
        f"{where}: Cannot split data into trajectories: no trajectory id entry "
        f"(looked up {ID_KEYS}) and no end-of-episode entry (looked up "
        f"{END_KEY_GROUPS}). Pass trajectory_key= naming per-step trajectory ids."
    )


def spans(source, trajectory_key, oldest: int, where: str) -> list[tuple]:
    """``(batch coords, first row, length)`` per trajectory of ``source`` (``[T, *B]``, in
    storage order, ``oldest`` its oldest row), by column (row-major over the batch dims), then
    oldest first. The steps are taken in time order from ``oldest`` (the ring unrolled), so the
    rule applies as to a storage that is not full: the newest step ends a trajectory, the
    oldest starts one."""
    by_id, signal = boundary_signal(source, trajectory_key, where)
    steps = signal.shape[0]
    start_t, env, _, length = find_bounds(
        np.roll(signal, -oldest, axis=0), by_id=by_id, at_capacity=False
    )
    inner = tuple(source.batch_size[1:])
    coords = np.unravel_index(env, inner) if inner else ()
    return [
        (tuple(int(c[i]) for c in coords), int((oldest + start_t[i]) % steps), int(length[i]))
        for i in range(env.size)
    ]
