"""Prioritized replay for SB3 (Schaul et al. 2016), which SB3 does not have: the core's sum tree.

``PrioritizedReplayBuffer`` / ``DictPrioritizedReplayBuffer`` take SB3's arguments plus
``alpha``, ``beta``, ``eps`` and an optional ``beta_schedule``. Items are drawn with
probability ``p_i ** alpha / sum_j p_j ** alpha`` by the core's exact
:class:`functional_rb.PrioritizedSampler`; new items get the largest priority seen so far.
Samples are :class:`PrioritizedReplayBufferSamples`: SB3's fields plus ``weights``
(importance weights ``[B, 1]``, normalized by their maximum over stored items) and
``indices`` (NumPy, what :meth:`update_priorities` takes).

SB3's algorithms do not weight their losses or report TD errors; :func:`use_priorities`
makes DQN, SAC and TD3 do both (see its docstring), without a copy of their code.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch as th

import functional_rb as frb
from functional_rb.sb3.buffers import DictReplayBuffer, ReplayBuffer

__all__ = [
    "DictPrioritizedReplayBuffer",
    "PrioritizedReplayBuffer",
    "PrioritizedReplayBufferSamples",
    "use_priorities",
]


class PrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ``ReplayBufferSamples`` fields, then ``weights`` and ``indices``."""

    observations: Any
    actions: Any
    next_observations: Any
    dones: Any
    rewards: Any
    discounts: Any = None
    weights: Any = None  # [B, 1] float32, the buffer's output array type
    indices: np.ndarray | None = None  # [B] int64: pass to update_priorities


class PrioritizedReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer`` with prioritized sampling.

    Args (keyword-only, beyond :class:`functional_rb.sb3.ReplayBuffer`'s):
      alpha: priority exponent (0: uniform).
      beta: importance-weight exponent; an attribute, set it to anneal.
      eps: added to every priority given to :meth:`update_priorities` (no item starves).
      beta_schedule: optional ``f(progress_remaining) -> beta`` (SB3's schedule convention,
        progress going from 1 to 0); :func:`use_priorities` applies it before each ``train``.

    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from functional_rb.sb3 import PrioritizedReplayBuffer
    >>> rb = PrioritizedReplayBuffer(8, spaces.Box(-1, 1, (2,)), spaces.Discrete(2),
    ...                              device="cpu", alpha=1.0, beta=1.0)
    >>> for i in range(4):
    ...     o = np.full((1, 2), i / 4, np.float32)
    ...     rb.add(o, o, np.array([0]), np.ones(1), np.zeros(1), [{}])
    >>> batch = rb.sample(16)
    >>> rb.update_priorities(np.arange(4), np.full(4, 1e-9))  # every stored item but...
    >>> rb.update_priorities(batch.indices[:1], np.ones(1))   # ...one: it is all we draw
    >>> len(set(rb.sample(16).indices.tolist()))
    1
    """

    def __init__(
        self,
        *args,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        beta_schedule: Callable[[float], float] | None = None,
        **kwargs,
    ):
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.beta_schedule = beta_schedule
        self._pending: list = []  # per-item |TD errors| reported for the last sample
        self._last_indices: np.ndarray | None = None
        super().__init__(*args, **kwargs)

    def _sampler(self):
        return frb.PrioritizedSampler(alpha=self.alpha, beta=self.beta)

    def _host_rows(self) -> bool:
        return False  # every add goes through the core: the sampler gives new steps priority

    # ignore[override] below: SB3's fields plus weights, as SBX's prioritized buffers return
    def sample(self, batch_size: int, env=None) -> PrioritizedReplayBufferSamples:  # type: ignore[override]
        self.flush_priorities()
        self._check_can_sample()
        self._grid.sync(self.pos, self.full)
        # SB3 seeds NumPy's global generator (set_random_seed): the core key comes from it
        seed = np.random.randint(0, 2**31 - 1)
        t, env_idx, weights, data = self._grid.draw(
            seed, batch_size, on_device=self._on_device(env), beta=self.beta
        )
        fields = self._transitions(self._fields(data, flat_shape=(batch_size,)), env)
        indices = self._grid.flat(t, env_idx).astype(np.int64)
        self._last_indices = indices
        sample = self._pack(
            cls=PrioritizedReplayBufferSamples,
            **fields,
            weights=weights.reshape(-1, 1).astype(np.float32),
        )
        return sample._replace(indices=indices)

    def update_priorities(self, indices, priorities) -> None:
        """Set the priorities of the sampled items ``indices`` (a sample's ``indices``) to
        ``|priorities| + eps`` (NumPy, torch or JAX arrays, one per index)."""
        if isinstance(priorities, th.Tensor):
            priorities = priorities.detach().cpu().numpy()
        p = np.abs(np.asarray(priorities, np.float64)).reshape(-1) + self.eps
        idx = np.asarray(indices).reshape(-1)
        if p.shape != idx.shape:
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}.update_priorities: {idx.size} indices "
                f"but {p.size} priorities; pass one priority per sampled index."
            )
        env, t = np.divmod(idx, self.buffer_size)
        self._grid.update(t, env, p.astype(np.float32))

    def report_td_errors(self, td_errors) -> None:
        """Record ``|TD errors|`` (``[B]`` or ``[B, 1]``) of the last sample; several reports
        for one sample (one per critic) are averaged when :meth:`flush_priorities` runs."""
        td = td_errors.detach().abs().reshape(-1).cpu().numpy()
        if self._last_indices is None or td.shape != self._last_indices.shape:
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}.report_td_errors: got {td.shape[0]} TD "
                "errors for a last sample of "
                f"{0 if self._last_indices is None else len(self._last_indices)} items."
            )
        self._pending.append(td)

    def flush_priorities(self) -> None:
        """Turn the reported TD errors of the last sample into its items' priorities."""
        if self._pending and self._last_indices is not None:
            self.update_priorities(self._last_indices, np.mean(self._pending, axis=0))
        self._pending = []


# ignore[override,misc] below: read-only arrays (DictReplayBuffer), prioritized samples
class DictPrioritizedReplayBuffer(PrioritizedReplayBuffer, DictReplayBuffer):  # type: ignore[override,misc]
    """:class:`PrioritizedReplayBuffer` for ``Dict`` observation spaces (SB3's
    ``DictReplayBuffer`` arguments plus ``alpha``, ``beta``, ``eps``, ``beta_schedule``)."""


# ---------------------------------------------------------------------------------- the glue
class _WeightedLosses:
    """Stands in for ``torch.nn.functional`` in an algorithm's module during ``train``: its
    ``mse_loss`` / ``smooth_l1_loss`` weight each item by the last sample's importance weight
    and report the TD errors to the buffer; everything else is torch's."""

    def __init__(self, functional, buffer: PrioritizedReplayBuffer, weights: dict):
        self._f, self._buffer, self._weights = functional, buffer, weights

    def __getattr__(self, name):
        return getattr(self._f, name)

    def _weighted(self, loss_fn, input, target, **kwargs):
        weights = self._weights.get("w")
        if weights is None or kwargs.get("reduction", "mean") != "mean":
            return loss_fn(input, target, **kwargs)
        kwargs.pop("reduction", None)
        per_item = loss_fn(input, target, reduction="none", **kwargs)
        self._buffer.report_td_errors(input.detach() - target.detach())
        w = weights.reshape(-1, *([1] * (per_item.ndim - 1))).to(per_item.device)
        return (per_item * w).mean()

    def mse_loss(self, input, target, **kwargs):
        return self._weighted(self._f.mse_loss, input, target, **kwargs)

    def smooth_l1_loss(self, input, target, **kwargs):
        return self._weighted(self._f.smooth_l1_loss, input, target, **kwargs)


def use_priorities(model):
    """Make an SB3 DQN, SAC or TD3 ``model`` whose buffer is a :class:`PrioritizedReplayBuffer`
    learn with it: each critic loss is weighted by the sample's importance weights and the
    sample's priorities become its ``|TD errors|`` (the mean over critics). Returns ``model``.

    It wraps ``model.train``: while it runs, the ``F`` (``torch.nn.functional``) that the
    algorithm's module calls for its critic loss is a stand-in whose ``mse_loss`` and
    ``smooth_l1_loss`` do the above; nothing else changes.

    >>> from stable_baselines3 import DQN
    >>> from functional_rb.sb3 import PrioritizedReplayBuffer, use_priorities
    >>> model = use_priorities(DQN("MlpPolicy", "CartPole-v1", learning_starts=64,
    ...                            replay_buffer_class=PrioritizedReplayBuffer,
    ...                            replay_buffer_kwargs=dict(alpha=0.6, beta=0.4)))
    >>> _ = model.learn(200)
    """
    buffer = model.replay_buffer
    if not isinstance(buffer, PrioritizedReplayBuffer):
        raise TypeError(
            "functional_rb.sb3.use_priorities: the model's replay buffer is "
            f"{type(buffer).__name__}; build the model with "
            "replay_buffer_class=functional_rb.sb3.PrioritizedReplayBuffer."
        )
    module = sys.modules[type(model).train.__module__]
    if not hasattr(module, "F"):
        raise TypeError(
            f"functional_rb.sb3.use_priorities: {type(model).__name__}'s module "
            f"{module.__name__} computes its loss without torch.nn.functional as F; "
            "use_priorities supports SB3's DQN, SAC and TD3."
        )
    train = model.train
    weights: dict = {}
    sample = buffer.sample

    def weighted_sample(*args, **kwargs):
        out = sample(*args, **kwargs)
        weights["w"] = (
            out.weights
            if isinstance(out.weights, th.Tensor)
            else th.as_tensor(np.asarray(out.weights))
        )
        return out

    def prioritized_train(*args, **kwargs):
        if buffer.beta_schedule is not None:
            buffer.beta = float(buffer.beta_schedule(model._current_progress_remaining))
        with (
            _patched(module, _WeightedLosses(module.F, buffer, weights)),
            _patched(buffer, weighted_sample, name="sample"),
        ):
            try:
                return train(*args, **kwargs)
            finally:
                buffer.flush_priorities()
                weights.clear()

    model.train = prioritized_train
    return model


@contextlib.contextmanager
def _patched(obj, value, name: str = "F"):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if name in vars(obj) and not isinstance(obj, type(sys)):
            delattr(obj, name)  # an instance attribute we set: the method shows again
        else:
            setattr(obj, name, old)
