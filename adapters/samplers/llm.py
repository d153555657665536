"""TorchRL's ``PromptGroupSampler`` (its ``samplers/llm.py``): balanced groups of items that
share a prompt, for GRPO-style objectives; drawn with torch exactly as TorchRL's."""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Literal

import numpy as np
import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from functional_rb.adapters import errors
from functional_rb.adapters.samplers.base import (
    EMPTY_STORAGE_ERROR,
    Sampler,
    _read_state,
    _write_state,
)

__all__ = ["PromptGroupSampler"]


_STRATEGIES = ("random", "recency", "reward", "variance")


class PromptGroupSampler(Sampler):
    """Draws complete groups of items that share a key, e.g. the prompt (TorchRL's
    ``PromptGroupSampler``): each batch is ``num_groups`` groups of ``samples_per_group``
    items, the layout group-relative objectives (GRPO) need.

    Host-side Python and torch: groups are keyed by the stored ``group_key`` values, which may
    be strings (the prompt text) as well as numbers, so there is no jittable core twin. The
    group index is built from ``storage[:]`` and cached until the storage changes (a write,
    a load or an in-place edit: the storage's revision) when ``cache_groups`` is True.

    Args:
      num_groups: groups per batch (``samples_per_group`` is then ``batch_size`` divided by
        it); exactly one of ``num_groups`` and ``samples_per_group``.
      samples_per_group: items per group (``num_groups`` is then ``batch_size`` divided by it).
      group_key: the entry naming each item's group (default ``"query"``).
      strategy: ``"random"`` (groups and items uniformly), ``"recency"`` (each group's most
        recently written items), ``"reward"`` (the highest rewards), ``"variance"`` (the subset
        of maximal reward variance, ties broken by total reward).
      reward_key: the numeric reward entry for ``"reward"`` / ``"variance"``, averaged over
        trailing dims (default ``("next", "reward")``).
      cache_groups: keep the group index between samples (default True).

    Storages: one-dimensional tensor storages and ``LazyStackStorage``; a plain
    ``ListStorage`` raises ``TypeError``, ``ndim > 1`` raises ``NotImplementedError``. A group
    (or set of groups) too small for a batch is completed with replacement, with one warning.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, PromptGroupSampler,
        ...                                     TensorDictReplayBuffer)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4,
        ...                             sampler=PromptGroupSampler(samples_per_group=2))
        >>> index = rb.extend(TensorDict({"query": torch.arange(8) // 2}, [8]))
        >>> q = rb.sample()["query"].reshape(2, 2)
        >>> bool((q[:, 0] == q[:, 1]).all())  # each group shares its query
        True
    """

    def __init__(
        self,
        *,
        num_groups: int | None = None,
        samples_per_group: int | None = None,
        group_key: NestedKey = "query",
        strategy: Literal["random", "recency", "reward", "variance"] = "random",
        reward_key: NestedKey = ("next", "reward"),
        cache_groups: bool = True,
    ) -> None:
        if (num_groups is None) == (samples_per_group is None):
            raise TypeError(
                "PromptGroupSampler: exactly one of num_groups or samples_per_group "
                f"must be provided, got num_groups={num_groups} and "
                f"samples_per_group={samples_per_group}."
            )
        name = "num_groups" if num_groups is not None else "samples_per_group"
        value = num_groups if num_groups is not None else samples_per_group
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise errors.torchrl_error(
                TypeError,
                f"{name} must be a positive integer, got {value!r}.",
                owner="PromptGroupSampler",
            )
        if value <= 0:
            raise errors.torchrl_error(
                ValueError,
                f"{name} must be a positive integer, got {value!r}.",
                owner="PromptGroupSampler",
            )
        if strategy not in _STRATEGIES:
            raise ValueError(
                f"PromptGroupSampler: unknown strategy={strategy!r}. Expected one "
                "of 'random', 'recency', 'reward', 'variance'."
            )
        self.num_groups = int(num_groups) if num_groups is not None else None
        self.samples_per_group = int(samples_per_group) if samples_per_group is not None else None
        self.group_key, self.strategy = group_key, strategy
        self.reward_key, self.cache_groups = reward_key, cache_groups
        self._group_index: dict | None = None  # group value -> long [k] positions
        self._row_rewards: torch.Tensor | None = None  # float [n]: one reward per item
        self._cache_key = None  # (storage id, length, revision) the index was built from
        self._position_recency: torch.Tensor | None = None  # long [n]: write clock per slot
        self._recency_clock = 0
        self._warned_small_group = False

    def _shape(self, batch_size: int) -> tuple[int, int]:
        per = self.num_groups if self.num_groups is not None else self.samples_per_group
        name = "num_groups" if self.num_groups is not None else "samples_per_group"
        if batch_size % per:
            raise ValueError(
                f"PromptGroupSampler.sample: batch_size={batch_size} is not "
                f"divisible by {name}={per}; use a multiple of it."
            )
        return (per, batch_size // per) if self.num_groups is not None else (batch_size // per, per)

    def _randperm(self, n: int) -> torch.Tensor:
        device = self.rng.device if self.rng is not None else None
        return torch.randperm(n, generator=self.rng, device=device).cpu()

    def _randint(self, n: int, k: int) -> torch.Tensor:
        device = self.rng.device if self.rng is not None else None
        return torch.randint(n, (k,), generator=self.rng, device=device).cpu()

    # ------------------------------------------------------------------ the group index
    def _maybe_build_index(self, storage) -> None:
        key = (id(storage), len(storage), getattr(storage, "revision", None))
        if self.cache_groups and self._group_index is not None and key == self._cache_key:
            return
        data = storage[:]
        if not is_tensor_collection(data):
            raise TypeError(
                "PromptGroupSampler requires a single-dimensional storage whose slices return a "
                "tensor collection, such as LazyTensorStorage or LazyStackStorage. Plain "
                "ListStorage is not supported."
            )
        values = errors.entry(
            data, self.group_key, where="PromptGroupSampler", argument="group_key"
        )
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        keys = [tuple(v) if isinstance(v, list) else v for v in values]
        if len(keys) != len(storage):
            raise RuntimeError(
                f"PromptGroupSampler: expected group_key={self.group_key!r} to "
                f"contain one value per storage item, got {len(keys)} values "
                f"for {len(storage)} items."
            )
        groups: dict = defaultdict(list)
        for position, k in enumerate(keys):
            groups[k].append(position)
        self._group_index = {k: torch.tensor(p, dtype=torch.long) for k, p in groups.items()}
        if self.strategy in ("reward", "variance"):
            reward = errors.entry(
                data, self.reward_key, where="PromptGroupSampler", argument="reward_key"
            )
            if not isinstance(reward, torch.Tensor):
                raise TypeError(
                    f"The {self.strategy!r} strategy requires reward_key="
                    f"{self.reward_key} to hold a tensor, got {type(reward)} "
                    "(PromptGroupSampler.sample). Store a numeric reward there."
                )
            self._row_rewards = reward.reshape(reward.shape[0], -1).float().mean(-1).cpu()
        self._cache_key = key
        if self.strategy == "recency":
            self._ensure_recency(len(keys))

    def _invalidate_cache(self) -> None:
        self._group_index, self._row_rewards, self._cache_key = None, None, None

    # ------------------------------------------------------------------ selection
    def _select_groups(self, num_groups: int) -> list:
        keys = list(self._group_index)
        n = len(keys)
        if n >= num_groups:
            return [keys[i] for i in self._randperm(n)[:num_groups].tolist()]
        self._warn_small()
        selected = [keys[i] for i in self._randperm(n).tolist()]
        selected.extend(keys[i] for i in self._randint(n, num_groups - n).tolist())
        return selected

    def _select_max_variance(self, positions: torch.Tensor, k: int) -> torch.Tensor:
        """The ``k`` positions whose rewards have the largest variance: some of the lowest and
        some of the highest rewards; among equal variances, the largest total (RePO)."""
        rewards = self._row_rewards[positions].double()
        order = torch.argsort(rewards)
        values = rewards[order]
        n = values.numel()
        prefix = torch.cat([values.new_zeros(1), values.cumsum(0)])
        prefix_sq = torch.cat([values.new_zeros(1), values.square().cumsum(0)])
        num_low = torch.arange(k + 1)
        num_high = k - num_low
        totals = prefix[num_low] + prefix[n] - prefix[n - num_high]
        totals_sq = prefix_sq[num_low] + prefix_sq[n] - prefix_sq[n - num_high]
        variances = totals_sq / k - (totals / k).square()
        best = torch.where(
            torch.isclose(variances, variances.max(), rtol=1e-12, atol=1e-12),
            totals,
            totals.new_full((), -torch.inf),
        ).argmax()
        rank = torch.arange(n)
        return positions[order[(rank < best) | (rank >= n - (k - best))]]

    def _select_within(self, positions: torch.Tensor, k: int) -> torch.Tensor:
        n = positions.numel()
        if n < k:
            self._warn_small()
            selected = self._select_within(positions, n)
            return torch.cat([selected, positions[self._randint(n, k - n)]])
        if self.strategy == "recency":
            return positions[torch.argsort(self._position_recency[positions])[-k:]]
        if self.strategy == "reward":
            return positions[torch.topk(self._row_rewards[positions], k).indices]
        if self.strategy == "variance":
            return self._select_max_variance(positions, k)
        return positions[self._randperm(n)[:k]]

    def _warn_small(self) -> None:
        if not self._warned_small_group:
            warnings.warn(
                "A group (or the set of groups) was smaller than the requested sample "
                "size; completing the draw with replacement. Add more data or lower "
                "num_groups/samples_per_group to avoid this.",
                stacklevel=3,
            )
            self._warned_small_group = True

    def sample(self, storage, batch_size: int):
        if len(storage) == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        if storage.ndim > 1:
            raise NotImplementedError(
                f"PromptGroupSampler only supports single-dimensional "
                f"storages, got storage.ndim={storage.ndim}."
            )
        num_groups, per_group = self._shape(batch_size)
        self._maybe_build_index(storage)
        selected = self._select_groups(num_groups)
        index = torch.cat([self._select_within(self._group_index[k], per_group) for k in selected])
        return index, {}

    # ------------------------------------------------------------------ recency
    def _record_update(self, index) -> None:
        """Stamp the written positions with the next values of the write clock."""
        if self.strategy != "recency":
            return
        if isinstance(index, tuple):
            index = index[0]
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        if not index.numel():
            return
        self._grow_recency(int(index.max()) + 1)
        for position in index.tolist():
            self._recency_clock += 1
            self._position_recency[position] = self._recency_clock

    def _grow_recency(self, size: int) -> None:
        """Make the recency table hold ``size`` slots (new slots: -1, never written)."""
        if self._position_recency is None:
            self._position_recency = torch.full((size,), -1, dtype=torch.long)
        elif self._position_recency.numel() < size:
            pad = torch.full((size - self._position_recency.numel(),), -1, dtype=torch.long)
            self._position_recency = torch.cat([self._position_recency, pad])

    def _ensure_recency(self, length: int) -> None:
        """Slots holding items whose writes were not seen (a storage filled before this sampler
        was attached) rank as older than every seen write, in position order."""
        if self._position_recency is None:
            self._position_recency = torch.arange(length, dtype=torch.long)
            self._recency_clock = max(self._recency_clock, length)
            return
        self._grow_recency(length)
        recency = self._position_recency[:length]
        missing = (recency < 0).nonzero(as_tuple=True)[0]
        if not missing.numel():
            return
        known = recency[recency >= 0]
        if known.numel():
            stop = int(known.min())
            recency[missing] = torch.arange(stop - missing.numel(), stop, dtype=torch.long)
        else:
            recency[missing] = torch.arange(missing.numel(), dtype=torch.long)
            self._recency_clock = max(self._recency_clock, missing.numel())

    def add(self, index, *, storage=None) -> None:
        self._record_update(index)
        self._invalidate_cache()

    def extend(self, index, *, storage=None) -> None:
        self._record_update(index)
        self._invalidate_cache()

    def mark_update(self, index, *, storage=None) -> None:
        self._record_update(index)
        self._invalidate_cache()

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        self._invalidate_cache()
        self._position_recency = None
        self._recency_clock = 0
        self._warned_small_group = False

    def state_dict(self) -> dict[str, Any]:
        if self._position_recency is None:
            return {}
        return {
            "position_recency": self._position_recency.clone(),
            "recency_clock": self._recency_clock,
        }

    def load_state_dict(self, state_dict) -> None:
        recency = state_dict.get("position_recency")
        self._position_recency = recency.clone().cpu() if recency is not None else None
        self._recency_clock = int(state_dict.get("recency_clock", 0))
        self._invalidate_cache()

    def dumps(self, path) -> None:
        _write_state(path, self.state_dict())

    def loads(self, path) -> None:
        self.load_state_dict(_read_state(path))

    def __getstate__(self):
        state = super().__getstate__()
        state.update(_group_index=None, _row_rewards=None, _cache_key=None)
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_groups={self.num_groups}, samples_per_group="
            f"{self.samples_per_group}, group_key={self.group_key}, "
            f"strategy={self.strategy!r})"
        )
