"""TorchRL's trajectory boundaries (``find_start_stop_traj``) over a host copy of the boundary
signal, in TorchRL's order, for the slice samplers' TorchRL-compatible draws.

TorchRL's slice samplers draw ``torch.randint(n_trajectories, ...)`` over the list of stored
trajectories in a precise order: env-major (``end.transpose(0, -1).nonzero()``), then by the
storage row of each trajectory's last step. Drawing what TorchRL draws needs that list, so it
is rebuilt here with TorchRL's rules, from the signal of the stored rows:

* trajectory ids: a trajectory ends where the id changes between consecutive rows (a full
  storage also compares the last row with the first); end flags: where the flag is True;
* a storage that is not full ends a trajectory at its last stored row; a full one at the row
  written last (the cursor), and at its last row in env columns that have no end at all;
* a trajectory starts after the previous end of its column (the first one after the
  column's last end, wrapping around a full ring).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["find_bounds", "windows"]


def find_bounds(sig: np.ndarray, *, by_id: bool, at_capacity: bool, cursor=None):
    """``(start_t, env, stop_t, lengths)``, int64 ``[N]`` each, in TorchRL's order, of the
    trajectories in ``sig`` (``[L, E]``: ids, or end flags, of stored rows ``0..L-1``)."""
    rows = sig.shape[0]
    if by_id:
        end = np.empty(sig.shape, bool)
        np.not_equal(sig[:-1], sig[1:], out=end[:-1])
        end[-1] = (sig[-1] != sig[0]) if at_capacity else True
    else:
        end = sig.astype(bool, copy=True)
        if not at_capacity:
            end[rows - 1] = True
    if at_capacity:
        if cursor is not None:
            end[int(cursor)] = True
        end[rows - 1, ~end.any(0)] = True
    env, stop_t = np.nonzero(end.T)
    n = stop_t.size
    start_t = np.empty(n, np.int64)
    start_t[1:] = stop_t[:-1] + 1
    first = np.ones(n, bool)
    first[1:] = env[1:] != env[:-1]
    last = np.ones(n, bool)
    last[:-1] = first[1:]
    start_t[first] = stop_t[last] + 1  # a column's first trajectory follows its last end
    start_t %= rows
    lengths = stop_t - start_t + 1
    lengths[lengths <= 0] += rows
    return start_t, env.astype(np.int64), stop_t.astype(np.int64), lengths


def windows(lengths: torch.Tensor, seq_length: int, strict_length: bool) -> int:
    """How many slices of ``seq_length`` steps the trajectories of ``lengths`` hold (TorchRL's
    count: with ``strict_length=False`` a shorter trajectory counts once)."""
    w = lengths - seq_length + 1
    w = w.clamp_min(0) if strict_length else torch.where(lengths > 0, w.clamp_min(1), 0)
    return int(w.sum())
