"""``ConsumingSampler`` (``consume_after_n_samples``): items leave the sampleable set after being
returned ``max_sample_count`` times, and writes reuse their slots first (TorchRL's design).

Each batch draws without replacement among the live items (a ``torch.randperm`` with the
buffer's generator). A consumed slot joins a free list; the buffer's next writes go to free
slots before the writer's ring cursor moves on, so a buffer fed and drained at the same pace
never overwrites items that were not sampled yet.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, EpochSampler
from functional_rb.adapters.samplers.random import RandomSampler

__all__ = ["ConsumingSampler"]


class ConsumingSampler(EpochSampler):
    """Uniform sampling that consumes items after ``max_sample_count`` draws (1-D storages).

    Each batch is drawn without replacement among the live items (``torch.randperm`` with the
    buffer's generator); a consumed slot is reused by the buffer's next writes.

    Args:
      max_sample_count: how many times an item is returned before it is consumed.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import ConsumingSampler, LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), sampler=ConsumingSampler(),
        ...                   batch_size=2)
        >>> index = rb.extend(torch.arange(4))
        >>> sorted(rb.sample().tolist() + rb.sample().tolist())  # each item once
        [0, 1, 2, 3]
    """

    reuses_slots = True

    def __init__(self, max_sample_count: int = 1):
        if isinstance(max_sample_count, bool) or not isinstance(
            max_sample_count, (int, np.integer)
        ):
            raise TypeError("max_sample_count must be a positive integer.")
        if max_sample_count < 1:
            raise ValueError("max_sample_count must be a positive integer.")
        self.max_sample_count = int(max_sample_count)
        self._empty()

    def _empty(self) -> None:
        self._sample_count = torch.zeros(0, dtype=torch.long)  # draws of each slot since written
        self._live_mask = torch.zeros(0, dtype=torch.bool)  # slot holds a sampleable item
        self._known_storage_len = 0  # slots the storage held last time
        self._free_indices: list = []  # consumed slots, oldest first
        self._ran_out = False
        self._remaining_batches = 0

    def _grow(self, n: int) -> None:
        if n > self._sample_count.numel():
            count = torch.zeros(n, dtype=torch.long)
            live = torch.zeros(n, dtype=torch.bool)
            count[: self._sample_count.numel()] = self._sample_count
            live[: self._live_mask.numel()] = self._live_mask
            self._sample_count, self._live_mask = count, live

    def _follow(self, storage) -> None:
        """Track the storage's length: new slots are live, slots past the end are not."""
        if storage is None:
            return
        if storage.ndim != 1:
            raise ValueError(
                f"{type(self).__name__} only supports 1-dimensional storages, got "
                f"storage.ndim={storage.ndim}."
            )
        n = len(storage)
        self._grow(n)
        if n > self._known_storage_len:
            self._sample_count[self._known_storage_len : n] = 0
            self._live_mask[self._known_storage_len : n] = True
        elif n < self._known_storage_len:
            self._sample_count[n : self._known_storage_len] = 0
            self._live_mask[n : self._known_storage_len] = False
        self._known_storage_len = n

    def _revive(self, index, storage=None) -> None:
        if isinstance(index, tuple):
            raise ValueError(f"{type(self).__name__} only supports flat 1-dimensional indices.")
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if index.numel() == 0:
            return
        self._grow(int(index.max()) + 1)
        self._follow(storage)
        self._sample_count[index] = 0
        self._live_mask[index] = True
        self._known_storage_len = max(self._known_storage_len, int(index.max()) + 1)
        self._ran_out = False

    def add(self, index, *, storage=None) -> None:
        self._revive(index, storage)

    def extend(self, index, *, storage=None) -> None:
        self._revive(index, storage)

    def mark_update(self, index, *, storage=None) -> None:
        self._revive(index, storage)

    def sampleable_count(self, storage, batch_size: int) -> int:
        self._follow(storage)
        return int(self._live_mask[: self._known_storage_len].sum())

    def pop_consumed(self, storage, max_count: int) -> torch.Tensor:
        """Up to ``max_count`` consumed slots for new items, oldest consumed first."""
        self._follow(storage)
        out = []
        while self._free_indices and len(out) < max_count:
            slot = self._free_indices.pop(0)
            if (
                slot < self._known_storage_len
                and not self._live_mask[slot]
                and self._sample_count[slot] >= self.max_sample_count
            ):
                out.append(slot)
        return torch.tensor(out, dtype=torch.long)

    def sample(self, storage, batch_size: int):
        self._follow(storage)
        live = torch.nonzero(self._live_mask[: self._known_storage_len]).flatten()
        if len(storage) == 0 or live.numel() == 0:
            self._ran_out, self._remaining_batches = True, 0
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        k = min(batch_size, live.numel())
        index = live[torch.randperm(live.numel(), generator=self.rng)[:k]]
        self._sample_count[index] += 1
        self._live_mask[index] = self._sample_count[index] < self.max_sample_count
        self._free_indices.extend(index[~self._live_mask[index]].tolist())
        left = int(self._live_mask[: self._known_storage_len].sum())
        self._remaining_batches = -(left // -batch_size)
        self._ran_out = left == 0
        return index, {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_sample_count": self.max_sample_count,
            "_sample_count": self._sample_count.clone(),
            "_live_mask": self._live_mask.clone(),
            "_known_storage_len": self._known_storage_len,
            "_free_indices": torch.tensor(self._free_indices, dtype=torch.long),
            "_ran_out": self._ran_out,
        }

    def load_state_dict(self, state_dict) -> None:
        self.max_sample_count = int(state_dict["max_sample_count"])
        self._sample_count = torch.as_tensor(state_dict["_sample_count"]).clone()
        self._live_mask = torch.as_tensor(state_dict["_live_mask"]).clone()
        self._known_storage_len = int(state_dict["_known_storage_len"])
        free = state_dict.get("_free_indices")
        if free is None:
            consumed = ~self._live_mask[: self._known_storage_len] & (
                self._sample_count[: self._known_storage_len] >= self.max_sample_count
            )
            free = torch.nonzero(consumed).flatten()
        self._free_indices = torch.as_tensor(free).tolist()
        self._ran_out = bool(state_dict["_ran_out"])
        self._remaining_batches = int(self._live_mask[: self._known_storage_len].sum())

    def dumps(self, path) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(path) / "consuming_sampler.pt")

    def loads(self, path) -> None:
        from pathlib import Path

        self.load_state_dict(torch.load(Path(path) / "consuming_sampler.pt"))

    def __repr__(self):
        return (
            f"{type(self).__name__}(max_sample_count={self.max_sample_count}, "
            f"sampleable={int(self._live_mask[: self._known_storage_len].sum())})"
        )


def consuming_sampler(sampler, consume_after_n_samples):
    """The sampler a buffer uses for ``consume_after_n_samples`` (TorchRL's rules)."""
    if consume_after_n_samples is None:
        return sampler
    if isinstance(sampler, ConsumingSampler):
        if sampler.max_sample_count != consume_after_n_samples:
            raise ValueError(
                "consume_after_n_samples conflicts with the provided "
                "ConsumingSampler.max_sample_count."
            )
        return sampler
    if type(sampler) is not RandomSampler:
        raise ValueError(
            "consume_after_n_samples only supports the default RandomSampler or "
            "an explicit ConsumingSampler. Prioritized, slice and "
            "without-replacement samplers are not supported."
        )
    return ConsumingSampler(max_sample_count=consume_after_n_samples)


def write_reusing_slots(sampler, writer, storage, data, single: bool = False):
    """Write ``data`` into consumed slots first, then into the ring's next slots (passing over
    those); returns the index written, as the writer returns it."""
    n = 1 if single else D.batch_len(data)
    free = sampler.pop_consumed(storage, n)
    if free.numel() == 0:
        index = writer.add(data) if single else writer.extend(data)
    else:
        if free.numel() < n:
            rest = writer.next_slots(n - free.numel(), skip=set(free.tolist()), data=data)
            free = torch.cat([free, rest])
        index = writer.write_at(int(free[0]) if single else free, data)
    sampler.extend(index, storage=storage)
    return index
