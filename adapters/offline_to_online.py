"""TorchRL's ``OfflineToOnlineReplayBuffer`` and ``prefill_replay_buffer``: an offline dataset
beside an online buffer, composed of the adapters' buffers and datasets.

:class:`OfflineToOnlineReplayBuffer` writes new experience to an online
:class:`~functional_rb.adapters.ReplayBuffer` only and draws every batch in a fixed split,
``round(offline_fraction * B)`` rows from the dataset and the rest from the online buffer;
:func:`prefill_replay_buffer` copies dataset samples into one buffer instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensor_collection

from functional_rb.adapters import errors
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.storages.base import Storage
from functional_rb.adapters.storages.tensor import LazyTensorStorage

__all__ = ["OfflineToOnlineReplayBuffer", "prefill_replay_buffer", "DATASET_PREFIXES"]

#: ``load_dataset`` prefixes: the class of :mod:`functional_rb.adapters.datasets` each names.
DATASET_PREFIXES = {
    "atari": "AtariDQNExperienceReplay",
    "atari_dqn": "AtariDQNExperienceReplay",
    "d4rl": "D4RLExperienceReplay",
    "gen_dgrl": "GenDGRLExperienceReplay",
    "minari": "MinariExperienceReplay",
    "openml": "OpenMLExperienceReplay",
    "openx": "OpenXExperienceReplay",
    "roboset": "RobosetExperienceReplay",
    "vd4rl": "VD4RLExperienceReplay",
}

# the sampler's info a TensorDictReplayBuffer writes into its samples: positions in that
# buffer, meaningless in a batch mixed from two buffers
_INFO_KEYS = ("index",)


def _load_dataset(dataset_id: str, where: str, **kwargs):
    """A dataset of :mod:`functional_rb.adapters.datasets` from ``"<prefix>:<name>"``."""
    prefix, sep, name = dataset_id.partition(":")
    cls_name = DATASET_PREFIXES.get(prefix.lower().strip()) if sep else None
    if cls_name is None:
        raise ValueError(
            f"{where}: offline_dataset={dataset_id!r} must be '<prefix>:<dataset>' "
            f"with a prefix among {sorted(DATASET_PREFIXES)}, e.g. "
            "'d4rl:halfcheetah-medium-v2'; or pass the dataset object itself."
        )
    datasets = importlib.import_module("functional_rb.adapters.datasets")
    return getattr(datasets, cls_name)(name, **kwargs)


def _concat(offline, online):
    """One ``[n_off + n_on]`` batch: TensorDicts by key, tensors along dim 0."""
    if not is_tensor_collection(offline):
        return torch.cat([offline, online], dim=0)
    keys = [set(map(str, b.keys(include_nested=True, leaves_only=True))) for b in (offline, online)]
    only = [k for k in _INFO_KEYS if (k in keys[0]) != (k in keys[1])]
    if only:
        offline, online = offline.exclude(*only), online.exclude(*only)
        keys = [k - set(only) for k in keys]
    if keys[0] != keys[1]:
        raise ValueError(
            "OfflineToOnlineReplayBuffer.sample: the offline and online batches have different "
            f"entries (only offline: {sorted(keys[0] - keys[1])}, only online: "
            f"{sorted(keys[1] - keys[0])}), so they cannot be concatenated. Store online "
            "experience with the dataset's keys (the same environment, TED format), or map "
            "one side with a transform."
        )
    return torch.cat([offline, online], dim=0)


class OfflineToOnlineReplayBuffer:
    """An immutable offline dataset beside a growing online buffer (TorchRL's class).

    :meth:`extend` writes to the online buffer only. :meth:`sample` draws exactly
    ``round(offline_fraction * batch_size)`` rows from the dataset and the rest from the
    online buffer, concatenated into one flat ``[batch_size]`` batch (offline rows first);
    from one buffer only while the online buffer is empty or the split gives it nothing.
    A TensorDictReplayBuffer's ``"index"`` entry is dropped from a mixed batch when only one
    side has it (it names positions in that side's buffer; TorchRL raises a KeyError).

    Args:
      offline_dataset: a buffer or dataset (anything with ``sample(n)`` and ``len``), or
        ``"<prefix>:<name>"`` for a :mod:`functional_rb.adapters.datasets` loader (prefixes
        in :data:`DATASET_PREFIXES`, e.g. ``"d4rl:halfcheetah-medium-v2"``).
      online_storage: the online buffer's storage (exactly one of ``online_storage`` and
        ``online_capacity``).
      online_capacity: the size of a :class:`~functional_rb.adapters.LazyTensorStorage` built
        for the online buffer.
      offline_fraction: in ``(0, 1)``, default 0.5; lowered by :meth:`anneal`.
      batch_size: the default for :meth:`sample`; required with a dataset id (it is the
        dataset's batch size too, unless ``dataset_kwargs`` give one).
      transform: applied to each concatenated batch.
      **dataset_kwargs: the dataset loader's arguments (dataset ids only).
    """

    def __init__(
        self,
        offline_dataset: Any,
        *,
        online_storage: Storage | None = None,
        online_capacity: int | None = None,
        offline_fraction: float = 0.5,
        batch_size: int | None = None,
        transform: Callable | None = None,
        **dataset_kwargs,
    ):
        where = "OfflineToOnlineReplayBuffer"
        if online_storage is not None and online_capacity is not None:
            raise ValueError(f"{where}: provide online_storage OR online_capacity, not both.")
        if online_storage is None and online_capacity is None:
            raise ValueError(
                f"{where}: provide one of online_storage (a storage) or "
                "online_capacity (an int: a LazyTensorStorage of that size)."
            )
        if (
            isinstance(offline_fraction, bool)
            or not isinstance(offline_fraction, (int, float))
            or not 0.0 < offline_fraction < 1.0
        ):
            raise errors.torchrl_error(
                ValueError,
                f"offline_fraction must be in (0, 1), got {offline_fraction!r}.",
                "For one buffer only, sample it directly.",
                owner=where,
            )
        if isinstance(offline_dataset, str):
            if "batch_size" not in dataset_kwargs:
                if batch_size is None:
                    raise errors.torchrl_error(
                        ValueError,
                        "batch_size must be provided when offline_dataset is a "
                        "string, so the dataset can be constructed.",
                        owner=where,
                    )
                dataset_kwargs["batch_size"] = batch_size
            offline_dataset = _load_dataset(offline_dataset, where, **dataset_kwargs)
        elif dataset_kwargs:
            raise ValueError(
                f"{where}: dataset_kwargs ({sorted(dataset_kwargs)}) are only "
                "forwarded when offline_dataset is a string. Pass them directly "
                "to your dataset constructor instead."
            )
        if online_capacity is not None:
            online_storage = LazyTensorStorage(online_capacity)
        self._offline_buffer = offline_dataset
        self._online_buffer = ReplayBuffer(storage=online_storage)
        self._offline_fraction = self._base_offline_fraction = float(offline_fraction)
        self._batch_size = batch_size
        self._transform = transform

    def extend(self, data) -> torch.Tensor:
        """Add online experience (a batch); returns its indices in the online buffer."""
        return self._online_buffer.extend(data)

    def add(self, data) -> int:
        """Add one online item; returns its index in the online buffer."""
        return self._online_buffer.add(data)

    def sample(self, batch_size: int | None = None) -> TensorDictBase:
        """A flat ``[batch_size]`` batch: ``round(offline_fraction * batch_size)`` offline
        rows, then the online ones."""
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise errors.torchrl_error(
                ValueError,
                "batch_size must be provided either in __init__ or sample().",
                owner="OfflineToOnlineReplayBuffer.sample",
            )
        n_offline = round(self._offline_fraction * batch_size)
        n_online = batch_size - n_offline
        if len(self._online_buffer) == 0 or n_offline >= batch_size:
            out = self._offline_buffer.sample(batch_size)
        elif n_offline == 0:
            out = self._online_buffer.sample(batch_size)
        else:
            out = _concat(
                self._offline_buffer.sample(n_offline), self._online_buffer.sample(n_online)
            )
        if self._transform is not None:
            out = self._transform(out)
        return out

    def anneal(self, step: int, total_steps: int) -> None:
        """Lower ``offline_fraction`` linearly from its initial value to 0 at
        ``total_steps`` (0 from then on)."""
        if total_steps <= 0:
            raise ValueError(
                f"OfflineToOnlineReplayBuffer.anneal: total_steps must be > 0, got "
                f"{total_steps!r} (the step at which offline_fraction reaches 0)."
            )
        self._offline_fraction = self._base_offline_fraction * max(0.0, 1.0 - step / total_steps)

    @property
    def offline_fraction(self) -> float:
        """The current offline fraction (after any annealing)."""
        return self._offline_fraction

    @property
    def offline_buffer(self):
        """The offline dataset (never written)."""
        return self._offline_buffer

    @property
    def online_buffer(self) -> ReplayBuffer:
        """The online replay buffer."""
        return self._online_buffer

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    def __len__(self) -> int:
        return len(self._offline_buffer) + len(self._online_buffer)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(offline={type(self._offline_buffer).__name__}, "
            f"offline_fraction={self._offline_fraction:.3f}, "
            f"online_size={len(self._online_buffer)}, batch_size={self._batch_size})"
        )


def prefill_replay_buffer(
    rb: ReplayBuffer, dataset: Any, n_samples: int | None = None, chunk_size: int = 1000
) -> ReplayBuffer:
    """Copy samples of an offline dataset into a buffer (TorchRL's function): ``n_samples``
    (default: the dataset's length) rows drawn with the dataset's own sampler,
    ``chunk_size`` at a time, each chunk passed to ``rb.extend``.

    Args:
      rb: the buffer to fill (any buffer with ``extend``).
      dataset: a buffer or dataset, or a dataset id ``"<prefix>:<name>"`` (see
        :class:`OfflineToOnlineReplayBuffer`), built with ``batch_size=chunk_size``.
      n_samples: how many rows to copy, at most the dataset's length.
      chunk_size: rows per ``sample`` / ``extend`` call (> 0).

    Returns:
      ``rb``, filled in place.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import (LazyTensorStorage, ReplayBuffer,
        ...                                     prefill_replay_buffer)
        >>> dataset = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> index = dataset.extend(torch.arange(10))
        >>> rb = prefill_replay_buffer(ReplayBuffer(storage=LazyTensorStorage(100)), dataset,
        ...                            n_samples=6, chunk_size=3)
        >>> len(rb)
        6
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"prefill_replay_buffer: chunk_size must be a positive int, got {chunk_size!r}."
        )
    if isinstance(dataset, str):
        dataset = _load_dataset(dataset, "prefill_replay_buffer", batch_size=chunk_size)
    total = len(dataset) if n_samples is None else min(int(n_samples), len(dataset))
    copied = 0
    while copied < total:
        this_chunk = min(chunk_size, total - copied)
        rb.extend(dataset.sample(this_chunk))
        copied += this_chunk
    return rb
