"""TorchRL's slice markers: what a slice sampler's ``info`` says about each sampled step.

``truncated`` is True at each slice's last valid step, ``done`` is the stored done OR
truncated, ``terminated`` the stored flag (or False); ``init_key`` is True at each slice start,
OR-ed with the stored flag (only when the storage has one: a missing flag is not invented).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection

__all__ = ["as_key", "out_key", "slice_markers"]


def as_key(k):
    """A key as a tuple (None kept)."""
    if k is None:
        return None
    return (k,) if isinstance(k, str) else tuple(k)


def out_key(k: tuple):
    """A tuple key as TorchRL spells it: a plain string when it has one part."""
    return k[0] if len(k) == 1 else k


def slice_markers(storage, index, mask: np.ndarray, keep, truncated_key, init_key) -> dict:
    """The markers of slices at storage ``index`` (as a sampler returns it), ``mask`` bool
    ``[num_slices, width]`` (False: padding), ``keep`` the flat positions of ``mask`` the index
    holds (``slice(None)``: all)."""
    nxt = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
    last = torch.from_numpy((mask & ~nxt).reshape(-1)[keep].copy())
    first = np.zeros_like(mask)
    first[:, 0] = True
    first = torch.from_numpy(first.reshape(-1)[keep].copy())
    data = getattr(storage, "data", None)
    if not is_tensor_collection(data):
        data = None

    def read(key):  # only the entries the markers use: the sample's other entries are read
        value = None if data is None else data.get(key, None)  # once, by the buffer
        return None if value is None else value[index]

    info: dict[Any, Any] = {}
    if truncated_key is not None:
        tk = as_key(truncated_key)
        truncated = last.unsqueeze(-1)
        done_key, term_key = tk[:-1] + ("done",), tk[:-1] + ("terminated",)
        done = read(out_key(done_key))
        done = (
            truncated.clone()
            if done is None
            else done | truncated.reshape(truncated.shape + (1,) * (done.ndim - 2))
        )
        term = read(out_key(term_key))
        info[out_key(tk)] = truncated
        info[out_key(done_key)] = done
        info[out_key(term_key)] = torch.zeros_like(truncated) if term is None else term
    if init_key is not None:
        stored = read(init_key)
        if stored is not None:
            info[init_key] = stored | first.reshape(first.shape + (1,) * (stored.ndim - 1)).to(
                stored.dtype
            )
    return info
