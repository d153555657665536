"""TorchRL's ``StreamingSliceSampler``: newly completed windows first, then uniform slices.

Each write is cut, in the order it arrives, into non-overlapping windows of ``slice_len`` steps
that never cross a trajectory boundary (a stored end flag, a change of trajectory id, or a
stored ``is_init``); a window still short of ``slice_len`` at the end of a write waits for the
next write of the same trajectory. Each completed window is queued once, and ``sample`` returns
the queued windows (oldest first) before it falls back to the uniform slices of
:class:`~functional_rb.adapters.SliceSampler` for the rest of the batch.

Ring slots carry a write count (a generation stamp): a queued window whose slots were
overwritten before it was sampled is dropped, so a window never mixes two writes' data.

Writes are seen through ``mark_update(index, storage=)``, the notification a buffer's writer
sends after every write (as in TorchRL). One write notified twice (a memory-mapped storage's
buffer tells its sampler again when it catches up with the shared write count) is recognised by
its unchanged storage revision and counted once.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["StreamingSliceSampler"]

_AUTO_TRAJ_KEYS = (("collector", "traj_ids"), "episode")
_STATE_FILE = "streaming_slice.pt"
_PAD_MASK = ("collector", "mask")


def _empty_long(*shape) -> torch.Tensor:
    return torch.empty(shape if shape else (0,), dtype=torch.long)


def _entry(info: dict, key, n: int) -> torch.Tensor:
    """``info[key]`` for ``n`` steps; a pad mask left out (nothing padded) is all True."""
    if key in info:
        return info[key]
    if key == _PAD_MASK:
        return torch.ones(n, dtype=torch.bool)
    raise KeyError(
        f"StreamingSliceSampler.sample: the queued windows' info and the uniform "
        f"slices' info differ in {key!r}; both come from SliceSampler.slice_info."
    )


class StreamingSliceSampler(SliceSampler):
    """Fresh fixed-length windows first, then uniform slices (TorchRL's
    ``StreamingSliceSampler``, the same keyword arguments and state).

    For one-dimensional storages written in chronological order (one stream per buffer, e.g.
    one member of a :class:`~functional_rb.adapters.ReplayBufferEnsemble` per environment).
    ``sample`` returns ``(index, info)`` as the slice sampler does: ``index`` a 1-tuple of
    int64 ``[batch_size]`` positions, queued windows first.

    Args:
      slice_len: the length of every window and slice (required).
      end_key: the boundaries, as in :class:`~functional_rb.adapters.SliceSampler`; with no
        ``end_key``, ``end_keys`` or ``traj_key``, ``("collector", "traj_ids")`` or
        ``"episode"`` is used when the written data holds it, and ``("next", "done")`` always.
      end_keys: several end flags, OR-ed.
      traj_key: the per-step trajectory id.
      strict_length: for the uniform fallback, as in
        :class:`~functional_rb.adapters.SliceSampler`.
      pad_output: for the uniform fallback, as in
        :class:`~functional_rb.adapters.SliceSampler`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, StreamingSliceSampler,
        ...                                     TensorDictReplayBuffer)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4,
        ...                             sampler=StreamingSliceSampler(slice_len=4))
        >>> done = torch.zeros(8, 1, dtype=torch.bool)
        >>> index = rb.extend(TensorDict({"obs": torch.arange(8), ("next", "done"): done}, [8]))
        >>> rb.sample()["obs"].tolist()  # the first fresh window
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        *,
        slice_len: int,
        end_key: NestedKey | None = None,
        end_keys: Sequence[NestedKey] | None = None,
        traj_key: NestedKey | None = None,
        cache_values: bool = False,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        strict_length: bool = True,
        pad_output: bool = False,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        use_gpu: bool | torch.device = False,
    ):
        if isinstance(slice_len, bool) or not isinstance(slice_len, int):
            raise TypeError(
                "StreamingSliceSampler: slice_len must be a positive integer, got "
                f"{slice_len!r} ({type(slice_len).__name__})."
            )
        if slice_len < 1:
            raise ValueError(
                f"StreamingSliceSampler: slice_len must be a positive integer, got {slice_len}."
            )
        self._stream_auto = traj_key is None and end_key is None and end_keys is None
        super().__init__(
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            cache_values=cache_values,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            pad_output=pad_output,
            compile=compile,
            span=span,
            use_gpu=use_gpu,
        )
        self._stream_traj_key = traj_key
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._queued_slices: collections.deque = collections.deque()  # (slots, stamps) [L]
        self._pending_indices = _empty_long()  # int64 [k < L]: the unfinished window
        self._pending_versions = _empty_long()  # int64 [k]: their stamps when written
        self._slot_versions = _empty_long()  # int64 [slots seen]: writes per slot
        self._last_traj = None  # trajectory id of the last step written
        self._last_was_done = False
        self._last_write = None  # (storage revision, slots) of the last write

    # ------------------------------------------------------------------ writes
    def mark_update(self, index, *, storage=None) -> None:
        """Queue the windows completed by the write of ``index`` (int64 ``[n]`` slots of a
        one-dimensional TensorDict storage, in the order they were written)."""
        super().mark_update(index, storage=storage)
        if storage is None:
            return
        slots = self._written_slots(index, storage)
        if slots is None:
            return
        stamps = self._stamp(slots, storage.max_size)
        self._drop_stale_pending()
        data = storage.get(slots)
        if not isinstance(data, TensorDictBase):
            raise TypeError(
                "StreamingSliceSampler.mark_update: the storage returned "
                f"{type(data).__name__}; it reads trajectory boundaries from "
                "TensorDict data. Use a TensorDict storage (LazyTensorStorage, "
                "LazyMemmapStorage) with TensorDict items."
            )
        done, traj, boundary = self._boundaries(data, slots.numel())
        self._queue_windows(slots, stamps, done, boundary)
        while len(self._queued_slices) > storage.max_size // self.slice_len:
            self._queued_slices.popleft()  # older windows than the ring holds were overwritten
        if traj is not None:
            self._last_traj = traj[-1].clone()
        self._last_was_done = bool(done[-1])

    def _written_slots(self, index, storage):
        """int64 ``[n]`` slots written (the last ``max_size`` of a longer write), or None when
        there is nothing new to queue."""
        if storage.ndim != 1:
            raise RuntimeError(
                f"StreamingSliceSampler requires a one-dimensional storage, got "
                f"ndim={storage.ndim}. Give each stream its own buffer (e.g. one "
                "member of a ReplayBufferEnsemble per environment)."
            )
        if storage.max_size < self.slice_len:
            raise ValueError(
                f"Storage capacity {storage.max_size} cannot hold one "
                f"slice_len={self.slice_len} window."
            )
        if isinstance(index, tuple):
            raise RuntimeError(
                "StreamingSliceSampler requires one-dimensional write indices, "
                "got a tuple of index tensors."
            )
        slots = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        if not slots.numel():
            return None
        write = (storage.revision, slots)
        last = self._last_write
        self._last_write = write
        if last is not None and last[0] == write[0] and torch.equal(last[1], slots):
            return None  # the same write notified again: the storage did not change since
        return slots[-storage.max_size :]

    def _stamp(self, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        """Advance the write count of each slot; int64 ``[n]``: the count of each occurrence."""
        need = int(slots.max()) + 1
        if self._slot_versions.numel() < need:
            size = min(capacity, max(need, 2 * self._slot_versions.numel(), 1024))
            grown = torch.zeros(size, dtype=torch.long)
            grown[: self._slot_versions.numel()] = self._slot_versions
            self._slot_versions = grown
        if slots.unique().numel() == slots.numel():
            stamps = self._slot_versions[slots] + 1
            self._slot_versions[slots] = stamps
            return stamps
        stamps = torch.empty_like(slots)
        for i, slot in enumerate(slots.tolist()):
            self._slot_versions[slot] += 1
            stamps[i] = self._slot_versions[slot]
        return stamps

    def _drop_stale_pending(self) -> None:
        pending = self._pending_indices
        if pending.numel() and not torch.equal(
            self._slot_versions[pending], self._pending_versions
        ):
            self._pending_indices, self._pending_versions = _empty_long(), _empty_long()

    def _traj_key(self, data: TensorDictBase):
        """The trajectory-id key: the one given, or (no boundary key given) the first of
        ``("collector", "traj_ids")``, ``"episode"`` the first write holds, as TorchRL."""
        if self._stream_auto:
            self._stream_auto = False
            keys = set(data.keys(include_nested=True, leaves_only=True))
            self._stream_traj_key = next((k for k in _AUTO_TRAJ_KEYS if k in keys), None)
        return self._stream_traj_key

    def _boundaries(self, data: TensorDictBase, n: int):
        """``(done, traj, boundary)``: bool ``[n]`` stored ends (OR of the end keys), int
        ``[n, k]`` trajectory ids (or None) and bool ``[n]`` "a trajectory starts here"."""
        key = self._traj_key(data)
        traj = None if key is None else data.get(key, None)
        traj = None if traj is None else traj.reshape(n, -1).cpu()
        done = torch.zeros(n, dtype=torch.bool)
        for k in self.end_keys or (self.end_key,):
            value = data.get(k, None)
            if value is not None:
                done |= value.reshape(n, -1).any(-1).cpu()
        is_init = data.get("is_init", None)
        boundary = (
            torch.zeros(n, dtype=torch.bool)
            if is_init is None
            else is_init.reshape(n, -1).any(-1).cpu()
        )
        if n > 1:
            boundary[1:] |= done[:-1]
            if traj is not None:
                boundary[1:] |= (traj[1:] != traj[:-1]).any(-1)
        if self._last_was_done:
            boundary[0] = True
        if traj is not None and self._last_traj is not None:
            boundary[0] |= bool((traj[0] != self._last_traj).any())
        return done, traj, boundary

    def _queue_windows(self, slots, stamps, done, boundary) -> None:
        """Cut the pending steps and this write at each boundary into ``slice_len`` windows;
        the unfinished tail of the last segment (unless it ends a trajectory) waits."""
        pending = 0
        if self._pending_indices.numel() and not boundary[0]:
            pending = self._pending_indices.numel()
            slots = torch.cat((self._pending_indices, slots))
            stamps = torch.cat((self._pending_versions, stamps))
            done = torch.cat((torch.zeros(pending, dtype=torch.bool), done))
        starts = torch.cat(
            (torch.zeros(1, dtype=torch.long), boundary.nonzero().flatten() + pending)
        ).unique(sorted=True)
        stops = torch.cat((starts[1:], torch.tensor([slots.numel()])))
        self._pending_indices, self._pending_versions = _empty_long(), _empty_long()
        L = self.slice_len
        for seg, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
            whole = (stop - start) // L * L
            if whole:
                self._queued_slices.extend(
                    zip(
                        slots[start : start + whole].reshape(-1, L).unbind(0),
                        stamps[start : start + whole].reshape(-1, L).unbind(0),
                    )
                )
            if seg == starts.numel() - 1 and whole < stop - start and not done[stop - 1]:
                self._pending_indices = slots[start + whole : stop].clone()
                self._pending_versions = stamps[start + whole : stop].clone()

    def end_stream(self, index=None, *, storage=None) -> None:
        """The stream was closed (TorchRL's ``ReplayBufferEnsemble.end_streams``): the
        unfinished window is dropped and the next write starts a trajectory."""
        del index, storage
        self._pending_indices, self._pending_versions = _empty_long(), _empty_long()
        self._last_traj = None
        self._last_was_done = True

    _end_stream = end_stream  # TorchRL's name

    # ------------------------------------------------------------------ sampling
    def _fresh_windows(self, num_slices: int) -> list:
        fresh = []
        while self._queued_slices and len(fresh) < num_slices:
            slots, stamps = self._queued_slices.popleft()
            if int(slots.max()) >= self._slot_versions.numel():
                continue
            if torch.equal(self._slot_versions[slots], stamps):
                fresh.append(slots)
        return fresh

    def sample(self, storage, batch_size: int):
        if batch_size % self.slice_len:
            raise RuntimeError(
                f"The batch-size must be divisible by the slice length, got "
                f"batch_size={batch_size} and slice_len={self.slice_len}."
            )
        num_slices = batch_size // self.slice_len
        fresh = self._fresh_windows(num_slices)
        if not fresh:
            return super().sample(storage, batch_size)
        index = (torch.stack(fresh).reshape(-1),)
        info = self.slice_info(storage, index, np.ones((len(fresh), self.slice_len), bool))
        if len(fresh) == num_slices:
            return index, info
        rest_index, rest_info = super().sample(storage, (num_slices - len(fresh)) * self.slice_len)
        index = tuple(torch.cat((a, b.to(a.device))) for a, b in zip(index, rest_index))
        n = (index[0].numel() - rest_index[0].numel(), rest_index[0].numel())
        return index, {
            k: torch.cat((_entry(info, k, n[0]), _entry(rest_info, k, n[1])))
            for k in info.keys() | rest_info.keys()
        }

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        super()._empty()
        self._reset_stream()

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's entries: slot write counts, queued windows ``[q, slice_len]`` with their
        stamps, the unfinished window, the last trajectory id and end flag."""
        if self._queued_slices:
            slots, stamps = (torch.stack(x) for x in zip(*self._queued_slices))
        else:
            slots, stamps = _empty_long(0, self.slice_len), _empty_long(0, self.slice_len)
        last = self._last_traj
        return {
            "slot_versions": self._slot_versions.clone(),
            "queued_indices": slots,
            "queued_versions": stamps,
            "pending_indices": self._pending_indices.clone(),
            "pending_versions": self._pending_versions.clone(),
            "last_traj": last.clone() if last is not None else torch.empty(0),
            "has_last_traj": torch.tensor(last is not None),
            "last_was_done": torch.tensor(self._last_was_done),
            "slice_len": torch.tensor(self.slice_len),
        }

    def load_state_dict(self, state_dict) -> None:
        slice_len = int(state_dict["slice_len"])
        if slice_len != self.slice_len:
            raise RuntimeError(
                f"StreamingSliceSampler.load_state_dict: cannot restore "
                f"slice_len={slice_len} into a slice_len={self.slice_len} "
                "sampler; build the sampler with the dumped slice_len."
            )
        super().load_state_dict(state_dict)
        self._slot_versions = state_dict["slot_versions"].cpu().clone()
        self._queued_slices = collections.deque(
            zip(
                state_dict["queued_indices"].cpu().clone().unbind(0),
                state_dict["queued_versions"].cpu().clone().unbind(0),
            )
        )
        self._pending_indices = state_dict["pending_indices"].cpu().clone()
        self._pending_versions = state_dict["pending_versions"].cpu().clone()
        self._last_traj = (
            state_dict["last_traj"].cpu().clone() if bool(state_dict["has_last_traj"]) else None
        )
        self._last_was_done = bool(state_dict["last_was_done"])
        self._last_write = None

    def dumps(self, path) -> None:
        """TorchRL's file: ``path/streaming_slice.pt`` (``torch.save`` of the state dict)."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path / _STATE_FILE)

    def loads(self, path) -> None:
        file = Path(path).absolute() / _STATE_FILE
        if not file.exists():
            raise FileNotFoundError(
                f"StreamingSliceSampler.loads: {file} does not exist; "
                "expected the directory a StreamingSliceSampler dumped to."
            )
        self.load_state_dict(torch.load(file))

    def __repr__(self):
        return (
            f"StreamingSliceSampler(slice_len={self.slice_len}, end_key={self.end_key}, "
            f"traj_key={self.traj_key}, queued={len(self._queued_slices)}, "
            f"strict_length={self.strict_length})"
        )
