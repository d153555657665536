"""TorchRL's ``HERReplayBuffer`` and ``HindsightStrategy``: hindsight goal relabelling at sample
time, on :class:`~functional_rb.adapters.TensorDictReplayBuffer`.

The buffer samples as its parent does; then the first ``int(B * her_ratio)`` rows get the
achieved goal of another step as their desired goal and a reward recomputed by ``reward_fn``.
Which step is the core's rule (:mod:`functional_rb.hindsight`): episodes are read in time
order from the storage's end flags, the newest step ends one, and the goal's age is drawn from
torch uniforms with TorchRL's arithmetic, so a seeded run gives TorchRL's batches.

Where TorchRL differs: in a full ring, an episode that runs past the end of the storage and
continues at its start is one episode here; TorchRL cuts it at the last stored end flag, and
its steps after that flag take their goal from the episode before (``"final"``,
``"episode"``). Goals are drawn with the buffer's ``generator`` when it has one (TorchRL:
always torch's global generator).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from functional_rb._internal.lazy import lazy_module
from functional_rb.adapters import errors
from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.random import RandomSampler

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):  # noqa: D101 - enum.StrEnum's behaviour
        def __str__(self) -> str:
            return str(self.value)


__all__ = ["HindsightStrategy", "HERReplayBuffer"]

# episode limits and goal draws run the core's hindsight kernels (JAX), loaded on first use
_core = lazy_module("functional_rb.adapters._utils.core")

_NO_CACHE_KEY = (-1, None, False)
_MIN_ROWS = 256  # episode limits are compiled per power-of-two storage length, at least this


class HindsightStrategy(StrEnum):
    """Goal selection strategy of :class:`HERReplayBuffer` (TorchRL's members and values).

    Attributes:
      FUTURE: the achieved goal of a later step of the same episode (uniform).
      FINAL: that of the episode's last stored step.
      EPISODE: that of any step of the same episode (uniform).
      RANDOM: that of any stored step (uniform over the buffer).
    """

    FUTURE = "future"
    FINAL = "final"
    EPISODE = "episode"
    RANDOM = "random"


@dataclasses.dataclass(frozen=True)
class _Episodes:
    """The episodes of a 1-D storage, in age order (age 0: the oldest stored step)."""

    head: int  # storage position of age 0
    size: int  # stored steps
    first: np.ndarray  # int32 [size]: age of the first step of each age's episode
    last: np.ndarray  # int32 [size]: age of its last stored step

    def ages(self, index: torch.Tensor) -> np.ndarray:
        return (index.numpy().astype(np.int64) - self.head) % self.size

    def positions(self, ages: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((np.asarray(ages, np.int64) + self.head) % self.size)

    def end_positions(self) -> torch.Tensor:
        """Sorted storage positions of the steps that end an episode (TorchRL's cache)."""
        ages = np.nonzero(self.last == np.arange(self.size))[0]
        return torch.sort(self.positions(ages)).values


def _parse_strategy(strategy) -> HindsightStrategy:
    try:
        return HindsightStrategy(strategy)
    except ValueError:
        raise ValueError(
            f"HERReplayBuffer: strategy must be one of "
            f"{[s.value for s in HindsightStrategy]} (or a HindsightStrategy), got "
            f"{strategy!r}. 'future' is the usual choice."
        ) from None


def _terminated_key(end_key):
    return end_key[:-1] + ("terminated",) if isinstance(end_key, tuple) else "terminated"


def _next_key(key) -> tuple:
    return ("next",) + key if isinstance(key, tuple) else ("next", key)


class HERReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``HERReplayBuffer``: goal relabelling for goal-conditioned RL.

    Args:
      reward_fn: ``reward_fn(td) -> reward``: ``td`` holds the relabelled rows (``goal_key``
        already replaced); returns ``[n]`` or the stored reward's shape ``[n, 1]``.
      her_ratio: fraction of each batch relabelled, in ``[0, 1]`` (default 0.8): the first
        ``int(B * her_ratio)`` rows.
      strategy: a :class:`HindsightStrategy` or its value (default ``"future"``).
      goal_key: the desired goal entry (a nested key as a tuple); ``("next", *goal_key)`` is
        replaced too when the data has it.
      achieved_goal_key: the achieved goal entry, where relabelled goals are read.
      reward_key: where the recomputed reward goes (default ``("next", "reward")``).
      end_key: the done flag marking episode ends (default ``("next", "done")``); the
        ``"terminated"`` flag beside it counts too.
      sampler: draws the transitions (default :class:`~functional_rb.adapters.RandomSampler`).
      **kwargs: :class:`~functional_rb.adapters.TensorDictReplayBuffer`'s.

    The storage must be one-dimensional (``ndim=1``), as TorchRL's. Episodes are rebuilt
    from the storage's end flags after each write, at the next sample.
    """

    def __init__(
        self,
        reward_fn: Callable[[TensorDictBase], torch.Tensor],
        *,
        her_ratio: float = 0.8,
        strategy: HindsightStrategy | Literal["future", "final", "episode", "random"] = "future",
        goal_key: NestedKey = "desired_goal",
        achieved_goal_key: NestedKey = "achieved_goal",
        reward_key: NestedKey = ("next", "reward"),
        end_key: NestedKey = ("next", "done"),
        sampler: Sampler | None = None,
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(her_ratio, bool)
            or not isinstance(her_ratio, (int, float))
            or not 0.0 <= her_ratio <= 1.0
        ):
            raise ValueError(
                f"HERReplayBuffer: her_ratio must be in [0, 1] (the fraction of "
                f"each batch relabelled), got {her_ratio!r}. Pass e.g. "
                "her_ratio=0.8."
            )
        if not callable(reward_fn):
            raise TypeError(
                f"HERReplayBuffer: reward_fn must be callable (td -> reward), got "
                f"{type(reward_fn).__name__}."
            )
        strategy = _parse_strategy(strategy)
        super().__init__(sampler=RandomSampler() if sampler is None else sampler, **kwargs)
        self.reward_fn = reward_fn
        self.her_ratio = her_ratio
        self.strategy = strategy
        self.end_key = end_key
        self.goal_key = goal_key
        self.achieved_goal_key = achieved_goal_key
        self.reward_key = reward_key
        self._keys_validated = False
        self._episodes: _Episodes | None = None
        self._episodes_revision = None  # the storage revision they were read at
        self._episode_ends_cache: torch.Tensor | None = None
        self._last_cache_key: tuple = _NO_CACHE_KEY

    # ------------------------------------------------------------------ episodes
    def _cache_key(self, storage) -> tuple:
        """TorchRL's description of the storage a cache was built from: (length, last
        written position, full)."""
        last = (storage.next_row() - 1) % storage.max_size_along_dim0()
        return (len(storage), int(last), bool(storage.is_full))

    def _end_flags(self, storage, n: int) -> np.ndarray:
        """bool ``[n]``: done or terminated, per stored position."""
        view = storage[:]
        if isinstance(view, list):
            view = storage.default_collate(view)
        getter = getattr(view, "get", None)
        done = getter(self.end_key, None) if getter else None
        terminated = getter(_terminated_key(self.end_key), None) if getter else None
        if done is None and terminated is None:
            raise KeyError(
                f"HERReplayBuffer.sample: neither {self.end_key!r} nor "
                f"{_terminated_key(self.end_key)!r} is in the stored data, so episodes cannot "
                "be found. Store a done (or terminated) flag per step, or pass end_key= naming "
                "yours (see TorchRL's Environment API for done / terminated / truncated)."
            )
        flags = [f.reshape(n, -1).bool().any(-1) for f in (done, terminated) if f is not None]
        out = flags[0] | flags[1] if len(flags) == 2 else flags[0]
        return out.cpu().numpy()

    def _get_episodes(self) -> _Episodes | None:
        storage = self.storage
        if self._episodes is not None and self._episodes_revision == storage.revision:
            return self._episodes
        n = len(storage)
        if n == 0:
            return None
        if storage.ndim != 1:
            raise errors.torchrl_error(
                NotImplementedError,
                f"HERReplayBuffer currently only supports 1D storages (got ndim={storage.ndim}).",
                "Build the storage with ndim=1 and extend with flat transitions; JAX users can "
                "relabel ndim=2 buffers with functional_rb.hindsight.relabel.",
            )
        head = storage.next_row() % n if storage.is_full else 0
        ends = np.roll(self._end_flags(storage, n), -head)
        rows = max(_MIN_ROWS, 1 << (n - 1).bit_length())
        padded = np.zeros(rows, bool)
        padded[:n] = ends
        first, last = _core.episode_limits(padded, n)
        self._episodes = _Episodes(head, n, first, last)
        self._episodes_revision = storage.revision
        self._episode_ends_cache = self._episodes.end_positions()
        self._last_cache_key = self._cache_key(storage)
        return self._episodes

    def _goal_positions(self, index: torch.Tensor) -> torch.Tensor:
        """The storage positions whose achieved goals relabel the steps at ``index``."""
        n = index.shape[0]
        if self.strategy is HindsightStrategy.RANDOM:
            return torch.randint(len(self.storage), (n,), generator=self.generator)
        ep = self._get_episodes()
        age = ep.ages(index)
        # "final" draws nothing (as TorchRL's): the same seed gives the same next batches
        u = (
            torch.zeros(n)
            if self.strategy is HindsightStrategy.FINAL
            else torch.rand(n, generator=self.generator)
        )
        goal = _core.goal_ages(u.numpy(), age, ep.first[age], ep.last[age], self.strategy.value)
        return ep.positions(goal)

    # ------------------------------------------------------------------ sampling
    def _validate_storage_keys(self) -> None:
        if self._keys_validated or len(self.storage) == 0:
            return
        first = self.storage.get(torch.tensor([0]))
        if isinstance(first, list):
            first = self.storage.default_collate(first)
        missing = [
            f"  {role}={key!r}"
            for key, role in (
                (self.goal_key, "goal_key"),
                (self.achieved_goal_key, "achieved_goal_key"),
            )
            if first.get(key, None) is None
        ]
        if missing:
            stored = sorted(map(str, first.keys(include_nested=True, leaves_only=True)))
            raise KeyError(
                "HERReplayBuffer.sample: the following keys are not present in "
                "storage:\n" + "\n".join(missing) + f"\nThe stored entries are "
                f"{stored}. Store them in every transition before sampling, or pass "
                "the keys under which your goals are stored."
            )
        self._keys_validated = True

    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        include_info: bool | None = None,
    ):
        """A batch as :class:`TensorDictReplayBuffer` samples it, its first
        ``int(B * her_ratio)`` rows relabelled."""
        self._validate_storage_keys()
        data, info = super().sample(batch_size, return_info=True, include_info=include_info)
        self._relabel(data, info["index"])
        return (data, info) if return_info else data

    def _relabel(self, data, index) -> None:
        if isinstance(index, tuple):
            index = index[0]
        index = torch.as_tensor(index).reshape(-1).cpu()
        n_her = int(index.shape[0] * self.her_ratio)
        if n_her == 0:
            return
        if self.strategy is not HindsightStrategy.RANDOM and self._get_episodes() is None:
            return
        if data.get(self.reward_key, None) is None:
            raise KeyError(
                f"HERReplayBuffer.sample: reward_key={self.reward_key!r} is not in "
                "the sampled data, so the recomputed reward has nowhere to go. Store "
                "a reward per step, or pass reward_key= naming yours."
            )
        source = self.storage.get(self._goal_positions(index[:n_her]))
        if isinstance(source, list):
            source = self.storage.default_collate(source)
        achieved = errors.entry(
            source,
            self.achieved_goal_key,
            where="HERReplayBuffer.sample",
            argument="achieved_goal_key",
        )
        her = data[:n_her]
        with data.unlock_():
            her.set_(self.goal_key, achieved)
            if her.get(_next_key(self.goal_key), None) is not None:
                her.set_(_next_key(self.goal_key), achieved)
            her.set_(self.reward_key, self._reward_like(her, self.reward_fn(her)))

    def _reward_like(self, her, reward) -> torch.Tensor:
        stored = her.get(self.reward_key)
        reward = torch.as_tensor(reward, device=stored.device)
        if reward.numel() != stored.numel():
            raise ValueError(
                f"HERReplayBuffer.sample: reward_fn returned shape "
                f"{tuple(reward.shape)}, but {self.reward_key!r} has shape "
                f"{tuple(stored.shape)} for the {stored.shape[0]} relabelled rows. "
                "Return one reward per row, shaped (n,) or (n, 1)."
            )
        return reward.reshape(stored.shape)

    # ------------------------------------------------------------------ lifecycle
    def empty(self, empty_write_count: bool = True) -> None:
        super().empty(empty_write_count=empty_write_count)
        self._episodes = self._episode_ends_cache = None
        self._last_cache_key = _NO_CACHE_KEY

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["_her"] = {
            "goal_key": self.goal_key,
            "achieved_goal_key": self.achieved_goal_key,
            "reward_key": self.reward_key,
            "her_ratio": self.her_ratio,
            "strategy": self.strategy.value,
            "episode_ends_cache": self._episode_ends_cache,
            "last_cache_key": self._last_cache_key,
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the buffer; the saved episode cache is kept for inspection (TorchRL's
        ``_episode_ends_cache`` / ``_last_cache_key``), and episodes are read again from the
        loaded storage at the next sample."""
        state_dict = dict(state_dict)
        her = state_dict.pop("_her", None)
        super().load_state_dict(state_dict)
        self._episodes = None
        if her is not None:
            self._episode_ends_cache = her.get("episode_ends_cache")
            self._last_cache_key = tuple(her.get("last_cache_key", _NO_CACHE_KEY))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy.value!r}, "
            f"her_ratio={self.her_ratio}, goal_key={self.goal_key!r}, "
            f"achieved_goal_key={self.achieved_goal_key!r}, "
            f"reward_key={self.reward_key!r}, storage={self.storage})"
        )
