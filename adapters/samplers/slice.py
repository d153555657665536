"""Slice samplers under TorchRL's names, over the functional core's trajectory records.

The core (``frb.SliceSampler`` and friends) keeps, per ``[env]`` row, the records of the stored
trajectories, updated incrementally as steps are written; a sample draws slices from them in
one jitted call. These adapters feed the core the boundary signal of each written step (the
OR of the end keys, or the trajectory ids) read from the storage, and turn the core's
``[num_slices, slice_len]`` positions into TorchRL's flat sample with its markers
(``truncated`` / ``done`` / ``terminated`` at slice ends, ``is_init`` at slice starts).

The signal: ``traj_key`` when given; ``end_key`` / ``end_keys`` when given; otherwise, as in
TorchRL, ``("collector", "traj_ids")`` or ``"episode"`` when the storage holds one, else
``("next", "done")``. A key missing from the storage falls back to the other kind.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection

import functional_rb as frb
from functional_rb.adapters import _core
from functional_rb.slices import normalize_span
from functional_rb.adapters.samplers import (EMPTY_STORAGE_ERROR, Sampler,
                                             _ReplacementDispatch, read_priority_files,
                                             write_priority_files)

_AUTO_TRAJ_KEYS = (("collector", "traj_ids"), ("episode",))


def _key(k):
    if k is None:
        return None
    return (k,) if isinstance(k, str) else tuple(k)


def _replace_last(key: tuple, name: str) -> tuple:
    return key[:-1] + (name,)


def _out_key(k: tuple):
    return k[0] if len(k) == 1 else k


class SliceSampler(Sampler, metaclass=_ReplacementDispatch):
    """Contiguous slices of stored trajectories (TorchRL's ``SliceSampler``).

    Keyword Args: TorchRL's. ``num_slices`` / ``slice_len`` (exactly one), ``end_key``,
    ``end_keys`` (OR-ed), ``traj_key``, ``truncated_key`` (the slice-end markers returned in
    ``info``), ``init_key`` (slice starts OR-ed into the stored flag), ``strict_length``
    (False: shorter trajectories come back shorter), ``pad_output`` (with
    ``strict_length=False``: short slices padded by repeating their last step, and a mask under
    ``("collector", "mask")`` when the batch has padding), ``ends`` / ``trajectories`` (static
    boundaries, with ``cache_values=True``), ``span`` (slices may hang over their trajectory's
    start and end and come back shorter; ``True`` keeps at least one step, an int ``i`` at least
    ``slice_len - i``, as TorchRL documents). ``cache_values``, ``compile`` and ``use_gpu`` are
    accepted: the records are incremental, so there is nothing to cache or compile. Not
    supported (raises): ``fragmented``.
    """

    _core_cls = frb.SliceSampler

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 end_key=None, end_keys=None, traj_key=None, step_key="step_count",
                 fragmented: bool = False, ends=None, trajectories=None,
                 cache_values: bool = False, truncated_key=("next", "truncated"),
                 init_key="is_init", strict_length: bool = True, pad_output: bool = False,
                 compile=False, span=False, use_gpu=False):
        if not ((num_slices is None) ^ (slice_len is None)):
            raise TypeError("Either num_slices or slice_len must be not None, and not both. "
                            f"Got num_slices={num_slices} and slice_len={slice_len}.")
        if end_key is not None and end_keys is not None:
            raise RuntimeError("`end_key` and `end_keys` are exclusive arguments.")
        if pad_output and strict_length:
            raise ValueError("pad_output=True is incompatible with strict_length=True: padding "
                             "only happens when short trajectories are kept.")
        span = normalize_span(type(self).__name__, span)
        if fragmented:
            raise NotImplementedError(
                f"{type(self).__name__}(fragmented=True): trajectories spread over "
                "non-adjacent storage slots are not supported; write each trajectory's steps "
                "in order (one collector per buffer row, ndim=2 storage).")
        static = ends if ends is not None else trajectories
        if static is not None:
            if traj_key is not None or end_key is not None or end_keys is not None:
                raise RuntimeError("`ends`/`trajectories` and `end_key`, `end_keys` or "
                                   "`traj_key` are exclusive arguments.")
            if ends is not None and trajectories is not None:
                raise RuntimeError("trajectories and ends are exclusive arguments.")
            if not cache_values:
                raise RuntimeError("To be used, ends/trajectories require `cache_values` to be "
                                   "set to `True`.")
        self.num_slices, self.slice_len = num_slices, slice_len
        self.end_keys = None if end_keys is None else tuple(_key(k) for k in end_keys)
        self.end_key = end_key        # as given (TorchRL keeps the spelling); _key() to use
        self.traj_key = traj_key
        self._auto = traj_key is None and end_key is None and end_keys is None and \
            static is None
        if self.end_key is None and self.end_keys is None:
            self.end_key = ("next", "done")
        self.step_key, self.fragmented = step_key, False
        self.truncated_key = truncated_key
        self.init_key = init_key
        self.strict_length, self.pad_output = bool(strict_length), bool(pad_output)
        self.cache_values, self.compile, self.use_gpu, self.span = cache_values, compile, \
            use_gpu, span
        self._static = None if static is None else (
            "traj" if trajectories is not None else "end", torch.as_tensor(static))
        self._signal = None     # "end" or "traj" once resolved
        self._core = None
        self._state = None
        self._revision = None   # the storage revision the state reflects
        self._layout = None

    # ------------------------------------------------------------------ the signal
    def _resolve(self, storage) -> None:
        if self._signal is not None:
            return
        if self._static is not None:
            self._signal = self._static[0]
        elif self.traj_key is not None:
            self._signal = "traj" if self._has(storage, self.traj_key) or \
                not self._has_end(storage) else "end"
        elif self._auto:
            found = next((k for k in _AUTO_TRAJ_KEYS if self._has(storage, k)), None)
            if found is not None:
                self.traj_key, self._signal = _out_key(found), "traj"
            else:
                self._signal = "end"
        else:
            self._signal = "end" if self._has_end(storage) or self.traj_key is None else "traj"
        self._core = self._make_core()

    def _make_core(self):
        kw = dict(num_slices=self.num_slices, slice_len=self.slice_len, truncated_key=None,
                  strict_length=self.strict_length, span=self.span)
        if self._signal == "traj":
            kw["traj_key"] = "sig"
        else:
            kw["end_key"] = "sig"
        return self._core_cls(**kw)

    @staticmethod
    def _has(storage, key) -> bool:
        data = getattr(storage, "data", None)
        if not is_tensor_collection(data):
            return False
        return _out_key(_key(key)) in data.keys(include_nested=True, leaves_only=True)

    def _has_end(self, storage) -> bool:
        keys = self.end_keys if self.end_keys is not None else (_key(self.end_key),)
        return any(self._has(storage, k) for k in keys)

    def _signal_rows(self, storage, rows: torch.Tensor) -> np.ndarray:
        """The boundary signal of dim-0 ``rows`` (in order): ``[n, *inner]`` numpy."""
        if self._static is not None:
            return self._static[1][rows].cpu().numpy()
        data = storage.data
        if not is_tensor_collection(data):
            raise RuntimeError(f"{type(self).__name__} reads the trajectory signal from "
                               "TensorDict data; this storage holds "
                               f"{type(data).__name__}.")
        if self._signal == "traj":
            return data.get(self.traj_key)[rows].cpu().numpy()
        keys = self.end_keys if self.end_keys is not None else (_key(self.end_key),)
        done = None
        for k in keys:
            v = data.get(_out_key(k), None)
            if v is None:
                continue
            v = v[rows].bool()
            done = v if done is None else done | v
        if done is None:
            raise KeyError(f"{type(self).__name__}: none of the end keys {list(keys)} is in the "
                           "storage; pass end_key=, end_keys= or traj_key= naming the stored "
                           "boundary signal.")
        return done.cpu().numpy()

    def _cut_holes(self, storage, rows: torch.Tensor, sig: np.ndarray) -> np.ndarray:
        """Rows a dead writer may have torn end their own one-step trajectory, and the row
        before them ends too, so no slice longer than one step reaches into them."""
        holes = storage.holes()
        if holes is None:
            return sig
        hole = holes[rows].numpy()
        if not hole.any():
            return sig
        sig = sig.copy()
        lead = (slice(None),) + (None,) * (sig.ndim - 1)
        if self._signal == "end":
            before = np.concatenate([hole[1:], [False]])
            return sig | (hole | before)[lead]
        ids = np.where(hole, -1 - np.arange(hole.size), 0)  # distinct ids: one step each
        return np.where(hole[lead], ids[lead], sig)

    def _items(self, sig: np.ndarray, inner: int):
        """Core items for ``sig`` ``[n, inner, ...]`` rows: env-major ``[inner * n, ...]``."""
        n = sig.shape[0]
        sig = sig.reshape((n, inner, -1))
        if self._signal == "end":
            sig = sig.any(-1)
        else:
            sig = sig[..., 0]
        sig = np.ascontiguousarray(sig.T).reshape(-1)
        return {"sig": sig if self._signal == "end" else sig.astype(np.int32)}

    # ------------------------------------------------------------------ records
    def _geometry(self, storage):
        rows = storage.max_size_along_dim0()
        inner = storage.row_numel() if hasattr(storage, "row_numel") else 1
        return rows, inner

    def _init_state(self, storage) -> None:
        rows, inner = self._geometry(storage)
        self._layout = _core.make_layout(rows * inner, inner)
        spec = {"sig": np.zeros((), bool if self._signal == "end" else np.int32)}
        self._state = self._init_core_state(spec)

    def _init_core_state(self, spec):
        return _core.init_sampler(self._core, spec, self._layout)

    def _ring(self, storage):
        """``(filled, cursor)``: stored rows and the next row the ring writes."""
        rows, _ = self._geometry(storage)
        filled = storage.len_along_dim0
        cursor = storage.next_row()
        return filled, cursor % rows

    def _add_rows(self, storage, first: int, n: int) -> None:
        rows, inner = self._geometry(storage)
        n = min(n, rows)
        t = (first + torch.arange(n)) % rows
        items = self._items(self._cut_holes(storage, t, self._signal_rows(storage, t)), inner)
        env = np.arange(inner)[:, None]
        positions = (env * rows + t.numpy()[None, :]).reshape(-1)
        filled, cursor = self._ring(storage)
        self._state = self._on_add(positions, items, filled, cursor)

    def _on_add(self, positions, items, filled, cursor):
        return _core.on_add(self._core, self._layout, self._state, positions,
                            np.ones(positions.shape, bool), items, filled=filled, cursor=cursor)

    def _rebuild(self, storage) -> None:
        """Records of the whole storage, oldest step first."""
        self._init_state(storage)
        rows, _ = self._geometry(storage)
        filled, cursor = self._ring(storage)
        if filled:
            self._add_rows(storage, cursor if filled == rows else 0, filled)
        self._revision = storage.revision

    def _sync(self, storage) -> None:
        if len(storage) == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        self._resolve(storage)
        if self._state is None or self._revision != storage.revision:
            self._rebuild(storage)

    def extend(self, index, *, storage=None) -> None:
        """Record the steps just written at ``index`` (the ring run a FIFO writer returns);
        anything else makes the next sample rebuild the records from the storage."""
        if storage is None or self._state is None or self._revision is None or \
                storage.revision != self._revision + 1:
            return
        rows_idx = torch.as_tensor(index).reshape(-1) if storage.ndim == 1 else \
            torch.as_tensor(index)[:: storage.row_numel(), 0]
        rows, _ = self._geometry(storage)
        first = int(rows_idx[0]) if rows_idx.numel() else 0
        run = (first + torch.arange(rows_idx.numel())) % rows
        if rows_idx.numel() == 0 or not torch.equal(rows_idx.cpu(), run):
            return
        n = rows_idx.numel()
        if n > rows:
            first = (first + n - rows) % rows
        self._add_rows(storage, first, n)
        self._revision = storage.revision

    add = extend

    def mark_update(self, index, *, storage=None) -> None:
        """In-place writes are seen through the storage's revision: nothing to do here."""
        del index, storage

    # ------------------------------------------------------------------ sample
    def _shape(self, batch_size: int) -> tuple:
        if self.num_slices is not None:
            if batch_size % self.num_slices:
                raise RuntimeError(f"The batch-size must be divisible by the number of slices, "
                                   f"got batch_size={batch_size} and num_slices="
                                   f"{self.num_slices}.")
            return self.num_slices, batch_size // self.num_slices
        if batch_size % self.slice_len:
            raise RuntimeError(f"The batch-size must be divisible by the slice length, got "
                               f"batch_size={batch_size} and slice_len={self.slice_len}.")
        return batch_size // self.slice_len, self.slice_len

    def _draw(self, storage, batch_size: int):
        filled, cursor = self._ring(storage)
        idx, w, mask, state = _core.sample(self._core, self._layout, self._state,
                                           _core.seed_key(self.rng), batch_size,
                                           filled=filled, cursor=cursor)
        return idx, w, mask, state

    def sampleable_count(self, storage, batch_size: int) -> int:
        if len(storage) == 0:
            return 0
        try:
            self._sync(storage)
        except (KeyError, RuntimeError):
            return 0
        self._shape(batch_size)
        filled, cursor = self._ring(storage)
        return int(_core.can_sample(self._core, self._layout, self._state, batch_size,
                                    filled=filled, cursor=cursor))

    def sample(self, storage, batch_size: int):
        self._sync(storage)
        num_slices, seq = self._shape(batch_size)
        idx, w, mask, state = self._draw(storage, batch_size)
        if not mask[:, :1].all():
            raise RuntimeError(
                f"{type(self).__name__}: no stored trajectory can give a slice of {seq} steps "
                f"({len(storage)} elements stored"
                + (", strict_length=True" if self.strict_length else "") + "). Add longer "
                "trajectories, sample shorter slices, or pass strict_length=False.")
        self._commit(state)
        rows, _ = self._geometry(storage)
        keep = slice(None) if (self.pad_output or mask.all()) else mask.reshape(-1)
        flat = idx.reshape(-1)[keep].astype(np.int64)
        t, env = torch.from_numpy(flat % rows), torch.from_numpy(flat // rows)
        index = (t,) if storage.ndim == 1 else (t, env)
        info = self._markers(storage, index, mask, keep)
        if self.pad_output and not mask.all():  # nothing padded: no mask, as TorchRL
            info[("collector", "mask")] = torch.from_numpy(mask.reshape(-1).copy())
        self._weights(info, w, keep)
        return index, info

    def slice_info(self, storage, index, mask: np.ndarray) -> dict:
        """The info :meth:`sample` gives, for slices chosen by other means (a streaming
        sampler's queued windows): ``index`` as ``sample`` returns it (``(t,)`` or ``(t, env)``
        over ``num_slices * slice_len`` steps), ``mask`` bool ``[num_slices, slice_len]`` (all
        True for whole slices)."""
        info = self._markers(storage, index, mask, slice(None))
        if self.pad_output and not mask.all():  # nothing padded: no mask, as TorchRL
            info[("collector", "mask")] = torch.from_numpy(mask.reshape(-1).copy())
        return info

    def _commit(self, state) -> None:
        self._state = state

    def _weights(self, info: dict, w: np.ndarray, keep) -> None:
        del info, w, keep

    def _markers(self, storage, index, mask: np.ndarray, keep) -> dict:
        """TorchRL's slice markers: ``truncated`` True at each slice's last valid step, ``done``
        = stored done | truncated, ``terminated`` stored (or False); ``init_key`` True at each
        slice start, OR-ed with the stored flag (only when the storage has one)."""
        nxt = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
        last = torch.from_numpy((mask & ~nxt).reshape(-1)[keep].copy())
        first = np.zeros_like(mask)
        first[:, 0] = True
        first = torch.from_numpy(first.reshape(-1)[keep].copy())
        data = storage.get(index) if is_tensor_collection(storage.data) else None
        info: dict[Any, Any] = {}
        if self.truncated_key is not None:
            tk = _key(self.truncated_key)
            truncated = last.unsqueeze(-1)
            done_key, term_key = _replace_last(tk, "done"), _replace_last(tk, "terminated")
            done = None if data is None else data.get(_out_key(done_key), None)
            done = truncated.clone() if done is None else \
                done | truncated.reshape(truncated.shape + (1,) * (done.ndim - 2))
            term = None if data is None else data.get(_out_key(term_key), None)
            info[_out_key(tk)] = truncated
            info[_out_key(done_key)] = done
            info[_out_key(term_key)] = torch.zeros_like(truncated) if term is None else term
        if self.init_key is not None and data is not None:
            stored = data.get(self.init_key, None)
            if stored is not None:
                info[self.init_key] = stored | first.reshape(
                    first.shape + (1,) * (stored.ndim - 1)).to(stored.dtype)
        return info

    def _empty(self) -> None:
        self._state = None
        self._revision = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict) -> None:
        self._empty()

    def __getstate__(self):
        state = super().__getstate__()
        state["_state"] = None
        state["_revision"] = None
        return state

    def __repr__(self):
        return (f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}"
                f", end_key={self.end_key}, traj_key={self.traj_key}, truncated_key="
                f"{self.truncated_key}, strict_length={self.strict_length})")


class SliceSamplerWithoutReplacement(SliceSampler):
    """Each stored trajectory once per epoch (TorchRL's ``SliceSamplerWithoutReplacement``),
    over ``frb.SliceSamplerWithoutReplacement``. ``drop_last`` and ``shuffle`` as in TorchRL.
    """

    _core_cls = frb.SliceSamplerWithoutReplacement

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 drop_last: bool = False, end_key=None, end_keys=None, traj_key=None,
                 ends=None, trajectories=None, truncated_key=("next", "truncated"),
                 init_key="is_init", strict_length: bool = True, shuffle: bool = True,
                 compile=False, cache_values: bool = False, pad_output: bool = False,
                 span=False, use_gpu=False):
        super().__init__(num_slices=num_slices, slice_len=slice_len, end_key=end_key,
                         end_keys=end_keys, traj_key=traj_key, ends=ends,
                         trajectories=trajectories, cache_values=cache_values,
                         truncated_key=truncated_key, init_key=init_key,
                         strict_length=strict_length, pad_output=pad_output, compile=compile,
                         span=span, use_gpu=use_gpu)
        self.drop_last, self.shuffle = bool(drop_last), bool(shuffle)
        self._ran_out = False

    def _make_core(self):
        kw = dict(num_slices=self.num_slices, slice_len=self.slice_len, truncated_key=None,
                  strict_length=self.strict_length, drop_last=self.drop_last,
                  shuffle=self.shuffle, span=self.span)
        kw["traj_key" if self._signal == "traj" else "end_key"] = "sig"
        return self._core_cls(**kw)

    def _commit(self, state) -> None:
        self._state = state
        self._ran_out = bool(_core.epoch_exhausted(state))

    @property
    def ran_out(self) -> bool:
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value) -> None:
        self._ran_out = bool(value)

    def _empty(self) -> None:
        super()._empty()
        self._ran_out = False

    def dumps(self, path) -> None:
        """TorchRL's file layout for this sampler's epoch. Epochs restart after a load (the
        trajectory records are rebuilt from the storage), so the entries say so to TorchRL
        too: ``len_storage=0`` makes it begin a new epoch."""
        from pathlib import Path

        from tensordict import TensorDict
        Path(path).mkdir(parents=True, exist_ok=True)
        TensorDict({"len_storage": torch.tensor(0), "_sample_list": torch.zeros(0, dtype=torch.long),
                    "drop_last": torch.tensor(self.drop_last),
                    "_ran_out": torch.tensor(self._ran_out)}, []).memmap(path, copy_existing=True)

    def loads(self, path) -> None:
        del path
        self._empty()


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
