"""TorchRL's ``RandomSampler`` and ``SamplerWithoutReplacement``: uniform draws with torch,
exactly as TorchRL's (the same generator and seed give the same indices)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from functional_rb.adapters.samplers.base import (
    EMPTY_STORAGE_ERROR,
    WITHOUT_REPLACEMENT,
    EpochSampler,
    Sampler,
    unravel,
)

__all__ = ["RandomSampler", "SamplerWithoutReplacement"]


class RandomSampler(Sampler):
    """Uniform sampling with replacement (TorchRL's ``RandomSampler``): ``torch.randint`` over
    the stored elements with the buffer's generator (torch's global one by default).

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, RandomSampler, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), sampler=RandomSampler(),
        ...                   batch_size=4, generator=torch.Generator().manual_seed(0))
        >>> index = rb.extend(torch.arange(10))
        >>> rb.sample().shape
        torch.Size([4])
    """

    def sample(self, storage, batch_size: int):
        if len(storage) == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        return storage.random_index(batch_size, generator=self.rng), {}


class SamplerWithoutReplacement(EpochSampler):
    """Each stored element once per epoch (TorchRL's ``SamplerWithoutReplacement``).

    An epoch is a ``torch.randperm`` of the stored elements (``shuffle=False``: in order);
    a batch takes the next ``batch_size`` of it. When the epoch runs out a new one is drawn
    (``ran_out`` becomes True, which ends the buffer's iteration); with ``drop_last`` an epoch's
    last, incomplete batch is skipped. A change of the storage's length starts a new epoch.

    Args:
      drop_last: skip an epoch's last, incomplete batch.
      shuffle: draw each epoch in a random order (False: in storage order).

    Example:
        >>> import torch
        >>> from functional_rb.adapters import (LazyTensorStorage, ReplayBuffer,
        ...                                     SamplerWithoutReplacement)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3,
        ...                   sampler=SamplerWithoutReplacement(shuffle=False))
        >>> index = rb.extend(torch.arange(6))
        >>> [batch.tolist() for batch in rb]
        [[0, 1, 2], [3, 4, 5]]
    """

    def __init__(self, drop_last: bool = False, shuffle: bool = True):
        self._sample_list = None
        self.len_storage = 0
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self._ran_out = False

    def _new_epoch(self, n: int, batch_size: int, device=None) -> None:
        if self.shuffle:
            self._sample_list = torch.randperm(n, device=device, generator=self.rng)
        else:
            self._sample_list = torch.arange(n, device=device)
        self._set_remaining(batch_size)

    def _set_remaining(self, batch_size: int) -> None:
        n = self._sample_list.numel()
        self._remaining_batches = n // batch_size if self.drop_last else -(n // -batch_size)

    def _next(self, n: int, batch_size: int) -> torch.Tensor:
        index = self._sample_list[:batch_size]
        self._sample_list = self._sample_list[batch_size:]
        self._set_remaining(batch_size)
        left = self._sample_list.shape[0]
        if left == 0 or (self.drop_last and left < batch_size):
            self._ran_out = True
            self._new_epoch(n, batch_size, index.device)
        else:
            self._ran_out = False
        return index

    def _take(self, n: int, batch_size: int, device) -> torch.Tensor:
        """The next ``batch_size`` of the epoch over ``n`` items (a new epoch when ``n``
        changed), with TorchRL's ``drop_last`` refusal."""
        if self.len_storage != n or self._sample_list is None:
            self._new_epoch(n, batch_size, device)
        if n < batch_size and self.drop_last:
            raise ValueError(
                f"The batch size ({batch_size}) is greater than the storage capacity ({n}). "
                "This makes it impossible to return a sample without repeating indices. "
                "Consider changing the sampler class or turn the 'drop_last' argument to False."
            )
        self.len_storage = n
        return self._next(n, batch_size)

    def storage_len(self, storage) -> int:
        return len(storage)

    def can_sample(self, storage, batch_size: int) -> bool:
        n = self.storage_len(storage)
        return n >= batch_size if self.drop_last else n > 0

    def sample(self, storage, batch_size: int):
        n = self.storage_len(storage)
        if n == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        index = self._take(n, batch_size, getattr(storage, "device", None))
        holes = storage.holes()
        if holes is not None:  # rows a dead writer may have torn are skipped
            index = index[~holes[index // (n // storage.len_along_dim0)]]
        if storage.ndim > 1:
            index = unravel(index, storage.shape)
        return index, {}

    def _empty(self) -> None:
        self._sample_list = None
        self.len_storage = 0
        self._ran_out = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "len_storage": self.len_storage,
            "_sample_list": self._sample_list,
            "drop_last": self.drop_last,
            "_ran_out": self._ran_out,
        }

    def load_state_dict(self, state_dict) -> None:
        self.len_storage = int(state_dict["len_storage"])
        lst = state_dict["_sample_list"]
        self._sample_list = lst.clone() if isinstance(lst, torch.Tensor) else lst
        self.drop_last = bool(state_dict["drop_last"])
        self._ran_out = bool(state_dict["_ran_out"])

    def dumps(self, path) -> None:
        path = Path(path)
        path.mkdir(exist_ok=True)
        sd = self.state_dict()
        sd["_sample_list"] = (
            torch.zeros(0, dtype=torch.long) if sd["_sample_list"] is None else sd["_sample_list"]
        )
        TensorDict(sd, []).memmap(path, copy_existing=True)

    def loads(self, path) -> None:
        sd = TensorDict.load_memmap(path).to_dict()
        self.load_state_dict(sd)

    def __repr__(self):
        perc = (
            len(self._sample_list) / self.len_storage * 100
            if self._sample_list is not None and self.len_storage
            else 0.0
        )
        return f"{type(self).__name__}({perc: 4.4f}% sampled)"


WITHOUT_REPLACEMENT[RandomSampler] = SamplerWithoutReplacement
