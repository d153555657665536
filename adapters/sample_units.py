"""Sample units under TorchRL's names: what each sampled anchor expands into.

A buffer built with ``sample_unit=`` calls ``unit.expand(index, info, storage)`` after the
sampler drew the anchors and before the storage is read; the expanded index is what the batch
is made of (and what ``info["index"]`` reports). :class:`Transition` is the identity;
:class:`Sequence` expands each anchor into a window of ``burn_in + length + bootstrap``
records around it, within its episode (``episode_boundary``), and reports per-record masks.
"""

from __future__ import annotations

import abc

import torch
from tensordict import is_tensor_collection

from functional_rb.adapters import errors

__all__ = ["SampleUnit", "Transition", "Sequence"]


class SampleUnit(abc.ABC):
    """Expands sampled anchors into the records of the batch (TorchRL's protocol)."""

    @abc.abstractmethod
    def expand(self, index, info: dict, storage) -> tuple:
        """``(index, info)`` of the records the batch is built from."""


class Transition(SampleUnit):
    """Every anchor is one record (the classic behaviour)."""

    def expand(self, index, info: dict, storage) -> tuple:
        del storage
        return index, info


def _episode_distances(ends: torch.Tensor) -> tuple:
    """For time-ordered end flags ``[W, lanes]``: each step's distance back to its episode's
    first step and forward to its last step (``[W, lanes]`` each)."""
    w = ends.shape[0]
    t = torch.arange(w).unsqueeze(1).expand_as(ends)
    stop = torch.where(ends, t, torch.full_like(t, w - 1))
    stop = stop.flip(0).cummin(0).values.flip(0)
    prev_end = torch.where(ends, t, torch.full_like(t, -1)).cummax(0).values
    start = torch.cat([torch.zeros_like(prev_end[:1]), prev_end[:-1] + 1], 0)
    return t - start, stop - t


class Sequence(SampleUnit):
    """Each anchor expands into ``burn_in + length + bootstrap`` records, ``dilation`` apart:
    ``burn_in`` before the anchor, the learning region of ``length`` from it, ``bootstrap``
    after (TorchRL's ``Sequence``).

    ``episode_boundary``: ``"pad"`` repeats the last valid record at an episode end (marked
    False in ``"validity_mask"``); ``"stop"`` shifts the window back so it ends at the episode
    end (padding if the episode is too short); ``"include_reset"`` crosses episode ends but
    never the ring's write seam. ``done_key`` (default ``("next", "done")``; None: the whole
    written span is one episode) marks episode ends. Info gets, per record: ``"index"`` (the
    window's storage indices), ``"anchor_index"``, ``"sequence_id"``,
    ``"step_in_sequence"``, ``"learning_mask"`` and ``"validity_mask"``; per-anchor entries
    (e.g. ``"priority_weight"``) are repeated per record. For ``ndim > 1`` storages dim 0 is
    time and the other coordinates are kept.
    """

    def __init__(
        self,
        length: int,
        episode_boundary: str = "pad",
        done_key=("next", "done"),
        burn_in: int = 0,
        bootstrap: int = 0,
        dilation: int = 1,
    ):
        if length <= 0:
            raise ValueError(f"length must be strictly positive, got {length}.")
        if episode_boundary not in ("pad", "stop", "include_reset"):
            raise ValueError(f"Unknown episode_boundary {episode_boundary}")
        if burn_in < 0:
            raise ValueError(f"burn_in must be non-negative, got {burn_in}.")
        if bootstrap < 0:
            raise ValueError(f"bootstrap must be non-negative, got {bootstrap}.")
        if dilation < 1:
            raise ValueError(f"dilation must be strictly positive, got {dilation}.")
        self.length, self.episode_boundary = int(length), episode_boundary
        self.done_key = (
            done_key if done_key is None or isinstance(done_key, str) else tuple(done_key)
        )
        self.burn_in, self.bootstrap, self.dilation = int(burn_in), int(bootstrap), int(dilation)

    def _check(self, storage) -> None:
        if not storage.supports_conditional_update or not is_tensor_collection(
            getattr(storage, "data", None)
        ):
            raise TypeError(
                f"{type(self).__name__} requires a TensorDict-backed TensorStorage "
                "(e.g. LazyTensorStorage or LazyMemmapStorage written with "
                "TensorDict data) to recover episode boundaries and the write "
                f"cursor; got {type(storage).__name__}."
            )

    def _ring(self, storage) -> tuple:
        """``(written rows, oldest row)``: the stored rows and where time starts."""
        written = storage.len_along_dim0
        oldest = storage.next_row() % written if storage.is_full else 0
        return written, oldest

    def _distances(self, storage, written: int, oldest: int):
        """Per stored ``(row, lane)``: steps back to its episode start and forward to its end,
        in physical row order ``[written, lanes]``."""
        lanes = storage.row_numel()
        if self.done_key is None:
            ends = torch.zeros((written, lanes), dtype=torch.bool)
        else:
            done = errors.entry(
                storage.data,
                self.done_key,
                where=type(self).__name__,
                argument="done_key",
                fix="Pass done_key= naming the stored "
                "done flag, or done_key=None for no episode boundary.",
            )[:written]
            ends = done.reshape(written, lanes, -1).any(-1).cpu()
        order = (oldest + torch.arange(written)) % written
        ends = ends[order].clone()
        ends[-1] = True  # the newest step ends its (maybe still running) episode
        back, fwd = _episode_distances(ends)
        out_back, out_fwd = torch.empty_like(back), torch.empty_like(fwd)
        out_back[order], out_fwd[order] = back, fwd
        return out_back, out_fwd

    def expand(self, index, info: dict, storage) -> tuple:
        self._check(storage)
        multi = storage.ndim > 1
        anchor = torch.stack(index, -1) if isinstance(index, tuple) else index.clone()
        if multi and (anchor.ndim != 2 or anchor.shape[-1] != storage.ndim):
            raise RuntimeError(
                f"Sequence expected multidimensional anchors with shape [batch, {storage.ndim}]."
            )
        t0 = anchor[:, 0] if multi else anchor
        lane = (
            torch.stack([a for a in anchor[:, 1:].unbind(-1)], -1).reshape(anchor.shape[0], -1)
            if multi
            else torch.zeros((anchor.shape[0], 0), dtype=torch.long)
        )
        b, total = anchor.shape[0], self.burn_in + self.length + self.bootstrap
        out = {
            k: (
                v
                if torch.as_tensor(v).ndim == 0
                else torch.as_tensor(v).repeat_interleave(total, dim=0)
            )
            for k, v in info.items()
        }
        steps = torch.arange(total)
        out["sequence_id"] = torch.arange(b).repeat_interleave(total)
        out["step_in_sequence"] = steps.repeat(b)
        out["learning_mask"] = (
            (steps >= self.burn_in) & (steps < self.burn_in + self.length)
        ).repeat(b)
        out["anchor_index"] = anchor.repeat_interleave(total, dim=0)
        offset = ((steps - self.burn_in) * self.dilation).unsqueeze(0).expand(b, total)
        written, oldest = self._ring(storage)
        if self.episode_boundary == "include_reset":
            newest = (oldest - 1) % written if storage.is_full else written - 1
            back = torch.remainder(t0 - oldest, written)
            fwd = torch.remainder(newest - t0, written)
        else:
            back_all, fwd_all = self._distances(storage, written, oldest)
            flat_lane = _flat_lane(lane, storage)
            back, fwd = back_all[t0, flat_lane], fwd_all[t0, flat_lane]
            if self.episode_boundary == "stop":
                need = self.dilation * (self.length + self.bootstrap - 1) - fwd
                shift = torch.clamp(need, min=torch.zeros_like(need), max=back)
                t0, fwd, back = t0 - shift, fwd + shift, back - shift
        valid = (offset <= fwd.unsqueeze(1)) & (offset >= -back.unsqueeze(1))
        clamped = torch.maximum(torch.minimum(offset, fwd.unsqueeze(1)), -back.unsqueeze(1))
        rows = torch.remainder(t0.unsqueeze(1) + clamped, written)
        out["validity_mask"] = valid.flatten()
        if multi:
            coords = torch.cat(
                [rows.unsqueeze(-1), anchor[:, 1:].unsqueeze(1).expand(b, total, storage.ndim - 1)],
                -1,
            ).flatten(0, 1)
            return tuple(coords.unbind(-1)), out
        return rows.flatten(), out

    def __repr__(self):
        return (
            f"{type(self).__name__}(length={self.length}, episode_boundary="
            f"{self.episode_boundary!r}, burn_in={self.burn_in}, bootstrap="
            f"{self.bootstrap}, dilation={self.dilation})"
        )


def _flat_lane(lane: torch.Tensor, storage) -> torch.Tensor:
    """The flat lane number of each anchor's non-time coordinates."""
    if lane.shape[1] == 0:
        return torch.zeros(lane.shape[0], dtype=torch.long)
    inner = storage.shape[1:]
    flat = lane[:, 0]
    for d in range(1, lane.shape[1]):
        flat = flat * int(inner[d]) + lane[:, d]
    return flat
