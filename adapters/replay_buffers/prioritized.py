"""TorchRL's prioritized buffers: ``PrioritizedReplayBuffer`` and
``TensorDictPrioritizedReplayBuffer``, a
:class:`~functional_rb.adapters.PrioritizedSampler` built from ``alpha``, ``beta``, ``eps``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer
from functional_rb.adapters.samplers.prioritized import PrioritizedSampler
from functional_rb.adapters.samplers.random import RandomSampler
from functional_rb.adapters.storages.list import ListStorage

if TYPE_CHECKING:  # the annotations' types (type checkers, the API reference)
    from functional_rb.adapters.storages.base import Storage

__all__ = ["PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer"]


class _Priorities:
    """``sync`` of the prioritized buffers (TorchRL 0.14). ``sync=False``: a copy handed to
    another process (a worker that only writes, through a shared LazyMemmapStorage) carries a
    uniform sampler instead of the priorities; the creating process keeps the prioritized
    sampler, and gives the workers' items the default priority when it next samples.
    ``sync=True``: the prioritized sampler refuses to be sent to another process."""

    @property
    def prioritized_sampler(self):
        return self.sampler

    def update_priority(self, index, priority) -> None:
        if os.getpid() != self.owner_pid:
            raise RuntimeError(
                f"{type(self).__name__}.update_priority: this buffer was created in process "
                f"{self.owner_pid}, whose sampler keeps the priorities; this copy (process "
                f"{os.getpid()}) only writes. Update priorities in the creating process."
            )
        super().update_priority(index, priority)

    def __getstate__(self):
        state = super().__getstate__()
        if not self._sync and self._initialized:
            state["_sampler"] = RandomSampler()
        return state


class PrioritizedReplayBuffer(_Priorities, ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer``: a
    :class:`~functional_rb.adapters.PrioritizedSampler` over the storage's capacity.
    ``sample(return_info=True)`` gives ``info["priority_weight"]``.

    Args:
      alpha: the priority exponent (0: uniform).
      beta: the importance-weight exponent.
      eps: added to every priority.
      dtype: the priorities' dtype (``torch.float`` or ``torch.float64``).
      storage: where the items live (default ``ListStorage(1000)``).
      sampler: a prioritized sampler to use instead of the one built from ``alpha``,
        ``beta``, ``eps`` and ``dtype``.
      sampler_device: the device of the sampler built here (exclusive with ``sampler``).
      sync: True keeps the priorities in step with every write. False (a buffer filled by
        worker processes through a shared :class:`~functional_rb.adapters.LazyMemmapStorage`):
        workers only extend, and the creating process gives their items the default priority
        when it next samples; both behave alike within one process.
      **kwargs: the other arguments of :class:`~functional_rb.adapters.ReplayBuffer`.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, PrioritizedReplayBuffer
        >>> rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(10),
        ...                              batch_size=4)
        >>> index = rb.extend(torch.arange(6.0))
        >>> data, info = rb.sample(return_info=True)
        >>> info["priority_weight"].shape
        torch.Size([4])
        >>> rb.update_priority(info["index"], torch.ones(4))
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        storage: Storage | None = None,
        sampler: PrioritizedSampler | None = None,
        sampler_device: torch.device | str | None = None,
        sync: bool = True,
        **kwargs,
    ):
        storage = ListStorage(1000) if storage is None else storage
        if sampler is None:
            sampler = PrioritizedSampler(
                storage.max_size, alpha, beta, eps, dtype, device=sampler_device
            )
        elif sampler_device is not None:
            raise TypeError("sampler_device cannot be passed when sampler is provided.")
        self._sync = bool(sync)
        super().__init__(storage=storage, sampler=sampler, **kwargs)


class TensorDictPrioritizedReplayBuffer(_Priorities, TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer``: samples carry ``"index"`` and
    ``"priority_weight"``; call ``update_tensordict_priority(sample)`` after computing the loss.

    Args:
      alpha: the priority exponent (0: uniform).
      beta: the importance-weight exponent.
      priority_key: the entry ``extend`` reads priorities from and
        ``update_tensordict_priority`` reads new ones from (absent: the default priority).
      eps: added to every priority.
      storage: where the items live (default ``ListStorage(1000)``).
      reduction: how a priority with several elements per item is reduced (``"max"``,
        ``"min"``, ``"sum"``, ``"mean"`` or ``"median"``).
      dtype: the priorities' dtype (``torch.float`` or ``torch.float64``).
      sampler_device: the device of the prioritized sampler.
      sync: as in :class:`PrioritizedReplayBuffer`.
      **kwargs: the other arguments of :class:`~functional_rb.adapters.ReplayBuffer`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage,
        ...                                     TensorDictPrioritizedReplayBuffer)
        >>> rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, batch_size=4,
        ...                                        storage=LazyTensorStorage(10))
        >>> index = rb.extend(TensorDict({"obs": torch.randn(6, 3)}, [6]))
        >>> sample = rb.sample()
        >>> sample["td_error"] = sample["obs"].abs().sum(-1)
        >>> rb.update_tensordict_priority(sample)
        >>> sample["priority_weight"].shape
        torch.Size([4])
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        priority_key: str = "td_error",
        eps: float = 1e-8,
        storage: Storage | None = None,
        reduction: str = "max",
        dtype: torch.dtype = torch.float,
        sampler_device: torch.device | str | None = None,
        sync: bool = True,
        **kwargs,
    ):
        storage = ListStorage(1000) if storage is None else storage
        sampler = PrioritizedSampler(
            storage.max_size, alpha, beta, eps, dtype, reduction=reduction, device=sampler_device
        )
        self._sync = bool(sync)
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, **kwargs)
