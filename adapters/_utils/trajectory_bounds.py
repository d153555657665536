"""Where the trajectories of stored steps start and stop, decided by the core's records.

The functional core keeps trajectory records per env row (:mod:`functional_rb.samplers.trajectories`:
the records the slice samplers draw from). Given the boundary signal of every stored step in
time order, oldest first, they give each stored trajectory: where its first stored step is and
how many steps it has. The rules are the core's (and TorchRL's ``find_start_stop_traj``):

* with trajectory ids, a trajectory ends where the id changes between consecutive steps;
  with end flags, at a step whose flag (any element) is True;
* the newest step always ends a trajectory;
* the oldest stored step starts one (its earlier steps, if any, were overwritten).

Which entry is the signal: ``trajectory_key`` when given, else the first of
``("collector", "traj_ids")``, ``"traj_ids"``, ``"episode"`` the data holds, else the OR of
the end flags ``("next", "done" | "truncated" | "terminated")`` (or the root ones), with a
``UserWarning``: two episodes with no True flag between them cannot be told apart.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from functional_rb.adapters._utils import core as _core
from functional_rb.samplers import trajectories as _records

__all__ = ["ID_KEYS", "END_KEY_GROUPS", "boundary_signal", "trajectory_bounds", "spans",
           "read_steps"]

ID_KEYS = (("collector", "traj_ids"), "traj_ids", "episode")
_DONE_KEYS = ("done", "truncated", "terminated")
END_KEY_GROUPS = (tuple(("next", k) for k in _DONE_KEYS), _DONE_KEYS)
_MIN_STEPS = 1024  # the records are compiled per power-of-two length, at least this one


def _steps_of(value, source, key, where: str, *, ids: bool) -> np.ndarray:
    """``value`` (an entry of ``source``, batch ``[T, *B]``) as numpy ``[T, E]`` per step:
    the id (one number per step), or the OR of the flag's elements."""
    lead = tuple(source.batch_size)
    arr = _core.to_numpy(value)
    steps, envs = lead[0], int(np.prod(lead[1:], dtype=np.int64))
    if arr.shape[:len(lead)] != lead or (ids and arr.size != steps * envs):
        what = "one trajectory id per step" if ids else "end flags per step"
        raise ValueError(f"{where}: {key!r} must hold {what}: expected shape {lead} (or "
                         f"{lead + (1,)}), got {tuple(arr.shape)}. Pass trajectory_key= "
                         "naming per-step trajectory ids.")
    if ids:
        return arr.reshape(steps, envs)
    return arr.reshape(steps, envs, -1).astype(bool).any(-1)


def boundary_signal(source, trajectory_key, where: str) -> tuple[bool, np.ndarray]:
    """``(by_id, signal [T, E])``: the trajectory ids, or the end flags, of every step."""
    for key in ID_KEYS if trajectory_key is None else (trajectory_key,):
        ids = source.get(key, None)
        if ids is not None:
            return True, _steps_of(ids, source, key, where, ids=True)
    if trajectory_key is not None:
        stored = sorted(map(str, source.keys(include_nested=True, leaves_only=True)))
        raise KeyError(f"{where}: trajectory_key {trajectory_key!r} not found in data, whose "
                       f"entries are {stored}. Name the entry holding per-step trajectory "
                       "ids, or pass trajectory_key=None to find ids or end flags.")
    for group in END_KEY_GROUPS:
        found = [(k, source.get(k)) for k in group if source.get(k, None) is not None]
        if found:
            warnings.warn(
                "No trajectory id entry was found; splitting on the end-of-episode flags "
                f"{tuple(k for k, _ in found)}. A trajectory whose last step has no True end "
                "flag is merged with the next one. Store trajectory ids (e.g. ('collector', "
                "'traj_ids')) or pass trajectory_key= for reliable splitting.", UserWarning,
                stacklevel=4)
            flags = [_steps_of(v, source, k, where, ids=False) for k, v in found]
            return False, np.logical_or.reduce(flags)
    raise KeyError(f"{where}: Cannot split data into trajectories: no trajectory id entry "
                   f"(looked up {ID_KEYS}) and no end-of-episode entry (looked up "
                   f"{END_KEY_GROUPS}). Pass trajectory_key= naming per-step trajectory ids.")


@functools.lru_cache(maxsize=None)
def _compiled_records(steps: int, by_id: bool):
    """The core's records of one row of ``steps`` steps: for each record slot whether it holds
    a trajectory, the index of its first stored step and its length."""
    layout = _core.make_layout(steps)

    def records(signal, filled):
        ctx = _core.context(layout, filled, 0)  # the ring was written to its end
        st = _records.append(_records.init(layout, jnp.int32), signal, ctx, by_id=by_id)
        k, length, alive = _records.all_records(st, ctx.filled, 1, False)
        age_hi, _ = _records.record(st, jnp.zeros_like(k), k, ctx.filled)
        return alive[0], (ctx.filled - age_hi)[0], length[0]
    return jax.jit(records)


def trajectory_bounds(signal: np.ndarray, *, by_id: bool):
    """Trajectories of steps in time order, found by the core's records.

    signal: ``[T, E]`` per step and env column, oldest first: trajectory ids (``by_id``: a
      trajectory ends where the id changes) or end flags (True ends the step's trajectory).
      The newest step of each column always ends one.
    Returns ``(env, first, length)``, int64 ``[N]`` each: per trajectory, its column, the index
    of its first step and its step count; by column, then by time.
    """
    steps, envs = signal.shape
    # The columns are laid end to end in one row of the core (one compile per length, whatever
    # the columns), each column's last step ending a trajectory.
    if by_id:  # ids as int32 run numbers, new ones in each column: exact for any id dtype
        change = np.ones((steps, envs), bool)
        change[1:] = signal[1:] != signal[:-1]
        row = np.cumsum(change.T.reshape(-1), dtype=np.int32)
    else:
        ends = signal.astype(bool)
        ends[-1] = True
        row = ends.T.reshape(-1)
    n = steps * envs
    size = max(_MIN_STEPS, 1 << (n - 1).bit_length())
    # older padding steps: the core clips every record to the `n` stored ones
    padded = np.concatenate([np.zeros(size - n, row.dtype), row])[None]
    alive, first, length = jax.device_get(_compiled_records(size, by_id)(padded, np.int32(n)))
    first, length = first[alive].astype(np.int64), length[alive].astype(np.int64)
    order = np.argsort(first)
    first, length = first[order], length[order]
    return first // steps, first % steps, length


def spans(source, trajectory_key, oldest: int, where: str) -> list[tuple]:
    """``(batch coords, first row, length)`` per trajectory of ``source`` (``[T, *B]``, in
    storage order, ``oldest`` its oldest row), by column then oldest first."""
    by_id, signal = boundary_signal(source, trajectory_key, where)
    steps = signal.shape[0]
    signal = np.roll(signal, -oldest, axis=0)
    env, first, length = trajectory_bounds(signal, by_id=by_id)
    inner = tuple(source.batch_size[1:])
    coords = np.unravel_index(env, inner) if inner else ()
    return [(tuple(int(c[i]) for c in coords), int((oldest + first[i]) % steps),
             int(length[i])) for i in range(env.size)]


def read_steps(source, coords: tuple, first: int, length: int):
    """The ``length`` steps of column ``coords`` from row ``first`` on, through the wrap."""
    rows = source.batch_size[0]
    if first + length <= rows:  # a view
        return source[(slice(first, first + length), *coords)]
    index = torch.arange(first, first + length, device=source.device) % rows
    return source[(index, *coords)]


