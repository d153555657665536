"""TorchRL's ``PrioritizedSliceSampler``: slices whose start is drawn by priority."""


from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

import functional_rb as frb
from functional_rb.adapters._utils import core as _core
from functional_rb.adapters.samplers.prioritized import (read_priority_files,
                                                         write_priority_files)
from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["PrioritizedSliceSampler"]


class PrioritizedSliceSampler(SliceSampler):
    """Slices whose start is drawn by priority (TorchRL's ``PrioritizedSliceSampler``), over
    ``frb.PrioritizedSliceSampler``: ``info["priority_weight"]`` per step,
    ``update_priority(index, priority)`` on the sampled steps. With ``num_slices`` the slice
    length follows each ``sample``'s batch size, as in TorchRL."""

    prioritized = True

    def __init__(self, max_capacity: int | None = None, alpha: float | None = None,
                 beta: float | None = None, eps: float = 1e-8, dtype=torch.float,
                 reduction: str = "max", *, num_slices: int | None = None,
                 slice_len: int | None = None, end_key=None, traj_key=None, ends=None,
                 trajectories=None, cache_values: bool = False,
                 truncated_key=("next", "truncated"), init_key="is_init",
                 strict_length: bool = True, compile=False, span=False, use_gpu=False,
                 max_priority_within_buffer: bool = False):
        if alpha is None or beta is None:
            raise TypeError("PrioritizedSliceSampler: alpha and beta are required.")
        super().__init__(num_slices=num_slices, slice_len=slice_len, end_key=end_key,
                         traj_key=traj_key, ends=ends, trajectories=trajectories,
                         cache_values=cache_values, truncated_key=truncated_key,
                         init_key=init_key, strict_length=strict_length, compile=compile,
                         span=span, use_gpu=use_gpu)
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}.")
        if self.span[0]:
            warnings.warn(f"Left spanning is disabled for {type(self).__name__} and will be "
                          "automatically turned off: slice starts are drawn by priority.")
            self.span = (False, self.span[1])
        self._max_capacity = max_capacity
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.dtype, self.reduction = dtype, reduction
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self._converted = None  # (source state, slice_len, converted state)
        self._bs_hint = num_slices or slice_len  # the buffer's batch size, once bound
        self._pending = None  # (values by TorchRL index, max priority) to install at rebuild

    alpha = property(lambda self: self._alpha)
    beta = property(lambda self: self._beta)
    eps = property(lambda self: self._eps)

    def _make_core(self):
        kw = dict(alpha=self._alpha, beta=self._beta, eps=self._eps, num_slices=self.num_slices,
                  slice_len=self.slice_len, truncated_key=None,
                  strict_length=self.strict_length, span=self.span)
        kw["traj_key" if self._signal == "traj" else "end_key"] = "sig"
        self._unbound = frb.PrioritizedSliceSampler(**kw)
        return self._unbound

    def bind(self, batch_size) -> None:
        """The buffer's default batch size: the core keeps the valid slice starts of its slice
        length (others are converted per call, as TorchRL accepts any batch size)."""
        if batch_size is not None:
            self._bs_hint = int(batch_size)

    @property
    def kept_slice_len(self):
        """The slice length the kept records hold valid starts for (None before the first
        write is seen)."""
        return None if self._state is None else _core.slice_len_of(self._state)

    def _init_core_state(self, spec):
        self._core = _core.bind(self._unbound, self._bs_hint)
        return _core.init_sampler(self._core, spec, self._layout)

    def _draw(self, storage, batch_size: int):
        filled, cursor = self._ring(storage)
        state = self._state
        if self.num_slices is not None:
            state = self._for_slice_len(batch_size // self.num_slices, filled, cursor)
        idx, w, mask, new = _core.sample(self._core, self._layout, state,
                                         _core.seed_key(self.rng), batch_size,
                                         filled=filled, cursor=cursor)
        return idx, w, mask, (new if state is self._state else self._state)

    def _for_slice_len(self, slice_len: int, filled, cursor):
        if _core.slice_len_of(self._state) == slice_len:
            return self._state
        c = self._converted
        if c is None or c[0] is not self._state or c[1] != slice_len:
            c = (self._state, slice_len, _core.with_slice_len(
                self._core, self._layout, self._state, slice_len, filled=filled,
                cursor=cursor))
            self._converted = c
        return c[2]

    def _weights(self, info: dict, w: np.ndarray, keep) -> None:
        info["priority_weight"] = torch.from_numpy(
            np.array(w.reshape(-1)[keep], np.float32, copy=True))

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Priorities of steps (TorchRL's indices: ``[N]`` flat, or ``(t, env)`` pairs); the
        slice starts drawn by priority follow, as in the core."""
        if storage is not None:
            self._sync(storage)
        if self._state is None:
            raise RuntimeError("PrioritizedSliceSampler.update_priority: pass storage= (the "
                               "buffer does) so the trajectory records can be built first.")
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, dtype=torch.long).cpu()
        rows, envs = self._layout.row_capacity, self._layout.num_envs
        if index.ndim > 1 and index.shape[-1] == 2:
            t, env = index[..., 0], index[..., 1]
        else:
            t, env = index // envs, index % envs  # TorchRL's flat index: t * envs + env
        flat = torch.where(index.reshape(t.shape + (-1,))[..., 0] >= 0, env * rows + t, -1)
        flat = flat.reshape(-1)
        pr = torch.as_tensor(priority, dtype=torch.float64).reshape(-1)
        pr = pr.expand(flat.shape) if pr.numel() == 1 else pr
        keep = flat >= 0
        flat, pr = flat[keep].numpy(), pr[keep].numpy()
        if flat.size == 0:
            return
        if not np.isfinite(pr).all() or (pr < 0).any():
            raise ValueError("PrioritizedSliceSampler.update_priority: priorities must be "
                             "finite and >= 0 (e.g. td_error.abs()).")
        filled, cursor = self._ring(storage) if storage is not None else (rows, 0)
        self._state = _core.update(self._core, self._layout, self._state, flat, pr,
                                   filled=filled, cursor=cursor)
        self._converted = None

    def mark_update(self, index, *, storage=None) -> None:
        del index, storage

    # ------------------------------------------------------------------ priorities kept
    def _flat_of_pos(self) -> np.ndarray:
        """TorchRL's flat index (``t * E + env``) of each core position (``env * R + t``)."""
        lay = self._layout
        pos = np.arange(lay.capacity)
        return (pos % lay.row_capacity) * lay.num_envs + pos // lay.row_capacity

    def tree_values(self) -> np.ndarray:
        """float32 ``[max_capacity]`` by TorchRL's flat index: each stored step's
        ``(p + eps) ** alpha`` (0: no step)."""
        if self._state is None:
            return (np.zeros(self._max_capacity, np.float32) if self._pending is None
                    else self._pending[0].astype(np.float32))
        values, _ = _core.slice_values(self._state)
        out = np.zeros(max(self._max_capacity, values.size), np.float32)
        out[self._flat_of_pos()] = values
        return out[:self._max_capacity]

    def _max(self) -> float:
        if self._state is None:
            return 1.0 if self._pending is None else self._pending[1]
        return _core.slice_values(self._state)[1]

    @property
    def default_priority(self) -> float:
        return self._max()

    def _rebuild(self, storage) -> None:
        keep = None if self._state is None else (self.tree_values(), self._max())
        keep = keep if keep is not None else self._pending
        super()._rebuild(storage)
        if keep is not None:
            flat = self._flat_of_pos()  # the value of each core position, by TorchRL's index
            values = np.where(flat < keep[0].size,
                              keep[0][np.minimum(flat, keep[0].size - 1)], 0.0)
            filled, cursor = self._ring(storage)
            self._state = _core.with_slice_values(self._core, self._layout, self._state,
                                                  values, keep[1], filled=filled,
                                                  cursor=cursor)
            self._pending = None

    def _install(self, values: np.ndarray, max_priority) -> None:
        mp = 1.0 if max_priority is None else float(max_priority)
        self._pending = (np.asarray(values, np.float64), mp)
        self._state, self._revision = None, None  # rebuilt (with these) at the next sample

    def state_dict(self) -> dict[str, Any]:
        return {"_values": torch.from_numpy(self.tree_values().astype(np.float64)),
                "_max_priority": self._max(), "_alpha": self._alpha, "_beta": self._beta,
                "_eps": self._eps}

    def load_state_dict(self, state_dict) -> None:
        self._install(state_dict["_values"].double().numpy(), state_dict["_max_priority"])

    def dumps(self, path) -> None:
        write_priority_files(path, self.tree_values(), (self._max(), None), self._alpha,
                             self._beta, self._eps, self._max_capacity, 1)

    def loads(self, path) -> None:
        loaded = read_priority_files(path, self._max_capacity, self._alpha, self._eps)
        self._beta = loaded.beta
        self._install(loaded.values, loaded.max_priority[0])

    def _empty(self) -> None:
        super()._empty()
        self._pending = None

    def __getstate__(self):
        import multiprocessing.context as mpc
        if mpc.get_spawning_popen() is not None:
            raise RuntimeError(f"Samplers of type {type(self).__name__} cannot be shared between "
                               "processes: their priorities live in this process.")
        state = super().__getstate__()
        state["_converted"] = None
        return state
