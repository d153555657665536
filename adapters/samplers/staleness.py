"""TorchRL's ``StalenessAwareSampler`` (fresher data drawn more often, data staler than a limit
never), for asynchronous post-training loops; its LLM companion, ``PromptGroupSampler``
(balanced groups of items that share a prompt, for GRPO-style objectives), is in
:mod:`functional_rb.adapters.samplers.llm`.

Both are host-side and draw with torch exactly as TorchRL's do, so the same
``torch.manual_seed`` gives the same indices. The buffer's generator (``generator=`` /
``set_rng``) is honoured: TorchRL's ``StalenessAwareSampler`` ignores it and draws from torch's
global generator, which is also what this one does when the buffer has none.
``StalenessAwareSampler`` has a jittable twin in the functional core,
:class:`functional_rb.StalenessAwareSampler`, with the same law.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from functional_rb.adapters.samplers.base import (
    EMPTY_STORAGE_ERROR,
    Sampler,
    _read_state,
    _write_state,
    unravel,
)
from functional_rb.adapters.storages.tensor import TensorStorage

__all__ = ["StalenessAwareSampler"]


def _default_staleness_weight(s: torch.Tensor) -> torch.Tensor:
    """Default freshness weighting: ``1 / (staleness + 1)``."""
    return 1.0 / (s.float() + 1.0)


def _lookup(data, key):
    """``data[key]`` for a TensorDict (nested keys as tuples) or nested dicts; None if absent."""
    if is_tensor_collection(data):
        return data.get(key, None)
    node = data
    for k in (key,) if isinstance(key, str) else tuple(key):
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    return node


class StalenessAwareSampler(Sampler):
    """Draws entries weighted by freshness and never those staler than ``max_staleness``
    (TorchRL's ``StalenessAwareSampler``), for asynchronous training (e.g. async PPO).

    Each stored entry carries the version of the policy that collected it under
    ``version_key``; :attr:`consumer_version` is the learner's version, which the training loop
    advances. ``staleness = consumer_version - policy_version``. Entries with ``staleness >
    max_staleness`` are excluded (``-1``: no limit); the others are drawn with probability
    proportional to ``staleness_weight_fn(staleness)`` (default ``1 / (staleness + 1)``),
    without replacement when at least ``batch_size`` entries remain, with replacement
    otherwise (``torch.multinomial``). ``info["staleness"]`` holds the drawn entries'
    staleness (float).

    Args:
      max_staleness: hard cutoff; ``-1`` (default): none.
      staleness_weight_fn: float staleness tensor -> float weight tensor (finite, >= 0).
      version_key: the entry holding the policy version (default ``"policy_version"``).

    Errors (as TorchRL's): an empty storage, or every entry beyond ``max_staleness``:
    ``RuntimeError``; no ``version_key`` entry: ``KeyError``. Storages with ``ndim > 1`` get
    per-dim indices (TorchRL returns flat ones there). ``can_sample`` is False when every
    entry is beyond ``max_staleness``.
    """

    def __init__(
        self,
        max_staleness: int = -1,
        staleness_weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        version_key: NestedKey = "policy_version",
    ):
        self._consumer_version = 0
        self._max_staleness = max_staleness
        self._version_key = version_key
        self._weight_fn = (
            _default_staleness_weight if staleness_weight_fn is None else staleness_weight_fn
        )

    @property
    def consumer_version(self) -> int:
        """The current training iteration / consumer version."""
        return self._consumer_version

    @consumer_version.setter
    def consumer_version(self, v: int) -> None:
        self._consumer_version = v

    def increment_consumer_version(self) -> None:
        """Advance the consumer version by 1."""
        self._consumer_version += 1

    @property
    def max_staleness(self) -> int:
        """The maximum allowed staleness; -1: no limit."""
        return self._max_staleness

    @max_staleness.setter
    def max_staleness(self, v: int) -> None:
        self._max_staleness = v

    @property
    def version_key(self):
        return self._version_key

    # ------------------------------------------------------------------ versions
    def _versions(self, storage, n: int):
        """The stored versions, flat over the element dims: ``[n]`` (None when absent)."""
        if isinstance(storage, TensorStorage) and storage.initialized:
            versions = _lookup(storage.data, self._version_key)  # the stored entry, unread
            if versions is None:
                return None
            if storage.ndim > 1:
                return versions[: storage.len_along_dim0].flatten(0, storage.ndim - 1)
            return versions[:n]
        data = storage[:n]  # list storages: the items themselves
        if isinstance(data, list):
            got = [_lookup(item, self._version_key) for item in data]
            if any(v is None for v in got):
                return None
            return torch.stack([torch.as_tensor(v).reshape(()) for v in got])
        return _lookup(data, self._version_key)

    def _staleness(self, storage, n: int) -> torch.Tensor:
        versions = self._versions(storage, n)
        if versions is None:
            raise KeyError(
                f"Could not find key {self._version_key!r} in the replay buffer storage "
                "(StalenessAwareSampler.sample). Make sure data written to the buffer contains "
                "this key (e.g., by adding the PolicyVersion transform to the environment or "
                "enabling policy-version tracking on the collector)."
            )
        return self._consumer_version - torch.as_tensor(versions).reshape(-1).float()

    def _eligible(self, staleness: torch.Tensor) -> torch.Tensor:
        if self._max_staleness >= 0:
            return (staleness <= self._max_staleness).nonzero(as_tuple=True)[0]
        return torch.arange(staleness.numel(), device=staleness.device)

    def can_sample(self, storage, batch_size: int) -> bool:
        n = len(storage)
        if n == 0:
            return False
        try:
            staleness = self._staleness(storage, n)
        except KeyError:
            return True  # sample says what is missing
        return self._eligible(staleness).numel() > 0

    # ------------------------------------------------------------------ sample
    def sample(self, storage, batch_size: int):
        n = len(storage)
        if n == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        staleness = self._staleness(storage, n)
        valid = self._eligible(staleness)
        if valid.numel() == 0:
            raise RuntimeError(
                f"All {n} entries in the buffer exceed max_staleness={self._max_staleness} "
                f"(consumer_version={self._consumer_version}; StalenessAwareSampler.sample). "
                "Increase max_staleness or update collector policy weights more frequently."
            )
        weights = self._weight_fn(staleness[valid])
        bad = ~torch.isfinite(weights) | (weights < 0)
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            raise RuntimeError(
                f"StalenessAwareSampler.sample: staleness_weight_fn gave weight "
                f"{float(weights[i])} (expected a finite number >= 0) to the entry at index "
                f"{int(valid[i])}, whose staleness is {float(staleness[valid[i]])} "
                f"(consumer_version={self._consumer_version}). An entry newer than the "
                "consumer version means it was not advanced: set sampler.consumer_version "
                "to the latest policy version."
            )
        weights = weights / weights.sum()
        index = torch.multinomial(
            weights, batch_size, replacement=batch_size > valid.numel(), generator=self.rng
        )
        index = valid[index]
        info = {"staleness": staleness[index]}
        if storage.ndim > 1:
            index = unravel(index, storage.shape)
        return index, info

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        self._consumer_version = 0

    def state_dict(self) -> dict[str, Any]:
        return OrderedDict(
            consumer_version=self._consumer_version, max_staleness=self._max_staleness
        )

    def load_state_dict(self, state_dict) -> None:
        self._consumer_version = int(state_dict["consumer_version"])
        self._max_staleness = int(state_dict["max_staleness"])

    def dumps(self, path) -> None:
        _write_state(path, self.state_dict())

    def loads(self, path) -> None:
        self.load_state_dict(_read_state(path))

    def __repr__(self):
        return (
            f"{type(self).__name__}(consumer_version={self._consumer_version}, "
            f"max_staleness={self._max_staleness})"
        )
