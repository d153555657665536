"""Batch post-processing (TorchRL's ``torchrl.data.postprocs``): ``MultiStep`` n-step returns
over a collected batch, and ``DensifyReward``, which spreads a sparse reward over its
trajectory.

Both take a TensorDict of batch ``[*B, T]`` (time last) with ``("next", "reward")`` and
``("next", "done")`` entries, as a collector yields it. :class:`MultiStep`'s sums and step
counts are the functional core's :func:`functional_rb.ted.n_step_returns` (the rewards and
done flags go through a core buffer of ``[env, time]`` rows); the rest of the ``"next"``
entries are gathered in torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import NestedKey, TensorDictBase, unravel_key
from tensordict.nn import TensorDictModuleBase
from torch import nn

from functional_rb._internal.lazy import lazy_module
from functional_rb.adapters import errors
from functional_rb.adapters.ted_hooks import DEFAULT_DONE_KEYS

# the n-step sums run the core's n_step_returns (JAX), imported by the first MultiStep call
_core = lazy_module("functional_rb.adapters._utils.core")

__all__ = ["MultiStep", "DensifyReward"]

# ``DensifyReward``'s discounted sums drop the terms below this weight, as TorchRL's
# ``reward2go`` does (so the two agree on trajectories longer than that horizon).
_SERIES_THRESHOLD = 1e-7


def _number(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number, got {value!r}.") from None


def _next_key(key: NestedKey) -> tuple:
    return unravel_key(("next", key))


class MultiStep(nn.Module):
    """n-step returns for a collected batch (TorchRL's ``MultiStep`` postproc).

    Each step ``t`` of a batch ``[*B, T]`` (time last) gets, with ``m`` the number of steps
    summed (at most ``n_steps``, stopping after the first ``("next", "done")`` and at the end of
    the batch):

    - ``("next", "reward")``: ``sum_{i<m} gamma**i r_{t+i}``; the one-step reward moves to
      ``("next", "original_reward")``;
    - every other ``"next"`` entry except the done keys (``done_keys``): that of step
      ``t + m - 1`` (the n-step successor);
    - ``"steps_to_next_obs"`` (int64, ``m``), ``"gamma"`` (``gamma ** m``) and
      ``"nonterminal"`` (``m > 1``, False where ``("collector", "mask")`` is False), as TorchRL
      writes them.

    The input is not modified: a shallow copy is returned. ``("next", "done")`` may have the
    batch's shape, that shape followed by 1, or the batch's shape followed by other dims (e.g.
    one flag per agent; every entry must then have those leading dims), as in TorchRL.

    Args:
        gamma (float): the discount, in ``(0, 1]``.
        n_steps (int): the most steps summed (>= 1).

    Attributes, settable as TorchRL's: ``done_key`` (the flag that ends a trajectory,
    ``"done"``), ``done_keys`` (the ``"next"`` entries left as they are, default
    :data:`~functional_rb.adapters.DEFAULT_DONE_KEYS`), ``reward_keys`` (``("reward",)``: one
    key, since the one-step reward has one place to go) and ``mask_key``
    (``("collector", "mask")``, or None).

    Rewards are summed in float32 by the core (JAX without x64) and cast back to the reward's
    dtype, so a float64 reward carries float32 rounding.
    """

    def __init__(self, gamma: float, n_steps: int):
        super().__init__()
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps <= 0:
            raise ValueError(
                f"n_steps must be a non-negative integer. MultiStep got "
                f"n_steps={n_steps!r}; pass an int >= 1 (1 keeps one-step "
                "rewards)."
            )
        if not 0 < _number(gamma, "gamma") <= 1:
            raise ValueError(
                f"got out-of-bounds gamma decay: gamma={gamma}. MultiStep needs 0 < gamma <= 1."
            )
        self.gamma = gamma
        self.n_steps = int(n_steps)
        self.register_buffer(
            "gammas",
            torch.tensor([gamma**i for i in range(self.n_steps + 1)], dtype=torch.float).reshape(
                1, 1, -1
            ),
        )
        self.done_key = "done"
        self.done_keys = DEFAULT_DONE_KEYS
        self.reward_keys = ("reward",)
        self.mask_key = ("collector", "mask")

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The batch with n-step rewards and successors (a shallow copy; see the class)."""
        if len(self.reward_keys) != 1:
            raise ValueError(
                f"MultiStep: reward_keys must hold exactly one key, got {self.reward_keys!r}: "
                "the one-step reward is kept under the single key ('next', "
                "'original_reward') (TorchRL's layout). Use one MultiStep per reward key."
            )
        td = tensordict.clone(False)
        ndim = td.ndim
        done = errors.entry(
            td,
            _next_key(self.done_key),
            where="MultiStep",
            argument="done_key",
            fix="MultiStep reads the done flag under 'next'.",
        )
        td, done = _time_last(td, done, _next_key(self.done_key))
        mask = td.get(self.mask_key, None) if self.mask_key is not None else None
        reward_key = _next_key(self.reward_keys[0])
        reward = errors.entry(
            td,
            reward_key,
            where="MultiStep",
            argument="reward_keys",
            fix="MultiStep reads the reward under 'next'.",
        )
        summed, steps = _core.n_step_sums(reward, done, self.n_steps, self.gamma)
        time_to_obs = steps - 1
        index = torch.arange(td.shape[-1], device=steps.device).expand_as(steps) + time_to_obs
        gathered = td.get("next").exclude(*self.reward_keys, *self.done_keys).gather(-1, index)
        td.set("steps_to_next_obs", steps)
        td.rename_key_(reward_key, ("next", "original_reward"))
        td.set(reward_key, summed)
        td.get("next").update(gathered)
        td.set("gamma", self.gamma**steps)
        nonterminal = time_to_obs != 0
        if mask is not None:
            nonterminal[~mask.view(steps.shape)] = False
        td.set("nonterminal", nonterminal)
        if td.ndim != ndim:  # back to the caller's layout (see _time_last)
            td = td.apply(
                lambda x: x.transpose(ndim - 1, td.ndim - 1),
                batch_size=done.transpose(ndim - 1, td.ndim - 1).shape,
            )
            td.batch_size = td.batch_size[:ndim]
        return td


def _time_last(td: TensorDictBase, done: torch.Tensor, key) -> tuple:
    """``(td, done)`` with ``done`` of the batch's shape. A done with extra trailing dims
    (other than one singleton) extends the batch to its shape, time moved last (TorchRL's
    rule); the caller moves it back."""
    if done.shape == td.shape:
        return td, done
    if done.shape[-1] == 1 and done.shape[:-1] == td.shape:
        return td, done.squeeze(-1)
    ndim = td.ndim
    try:
        td.batch_size = done.shape
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(
            "tensordict shape must be compatible with the done's shape (trailing singleton "
            f"dimension excluded). MultiStep: {key!r} has shape {tuple(done.shape)}, the batch "
            f"is {tuple(td.shape)}; every entry must have the done's leading dims."
        ) from err
    td = td.transpose(ndim - 1, td.ndim - 1)
    return td, td.get(key)


class DensifyReward(TensorDictModuleBase):
    """Spreads each trajectory's rewards over its steps: the reward of step ``t`` becomes the
    discounted reward-to-go ``sum_{k>=0} discount**k r_{t+k}`` up to the trajectory's end
    (TorchRL's ``DensifyReward``, over TorchRL's ``reward2go`` rule: a trajectory ends at a
    True ``("next", done_key)`` and at the end of the batch; terms of weight below 1e-7 are
    dropped). For a sparse reward, paid only at the last step, every step gets it.

    Keyword Args:
        reward_key (NestedKey): the reward, read under ``"next"``. Default ``"reward"``.
        done_key (NestedKey): the end flag, read under ``"next"``. Default ``"done"``.
        reward_key_out (NestedKey, optional): where the result goes, under ``"next"``
            (default: ``reward_key``, replaced).
        time_dim (int, optional): the batch dim along which time runs; default the last one,
            which is where TorchRL's ``DensifyReward`` always reads it (its ``time_dim`` is
            not used). A value outside the batch's dims raises ``ValueError``.
        discount (float): the discount, >= 0. Default 1.0. ``discount=0`` returns the
            rewards as they are (TorchRL fails there).

    The reward and the done flag must have the same shape (e.g. ``[*B, T, 1]``). The
    tensordict is updated in place and returned.
    """

    def __init__(
        self,
        *,
        reward_key: NestedKey = "reward",
        done_key: NestedKey = "done",
        reward_key_out: NestedKey | None = None,
        time_dim: int | None = None,
        discount: float = 1.0,
    ):
        super().__init__()
        if not (math.isfinite(_number(discount, "DensifyReward: discount")) and discount >= 0):
            raise ValueError(
                f"DensifyReward: discount must be a finite number >= 0, got {discount!r}."
            )
        if time_dim is not None and (isinstance(time_dim, bool) or not isinstance(time_dim, int)):
            raise TypeError(
                f"DensifyReward: time_dim must be an int (a batch dim) or None, got {time_dim!r}."
            )
        self.in_keys = [unravel_key(reward_key), unravel_key(done_key)]
        self.out_keys = [unravel_key(reward_key if reward_key_out is None else reward_key_out)]
        self.time_dim = time_dim
        self.discount = discount

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        done = tensordict.get(_next_key(self.in_keys[1]))
        reward = tensordict.get(_next_key(self.in_keys[0]))
        if reward.shape != done.shape:
            raise RuntimeError(
                "reward and done state are expected to have the same shape. Got "
                f"reward.shape={tuple(reward.shape)} and done.shape={tuple(done.shape)} "
                f"(DensifyReward, keys {self.in_keys})."
            )
        dim = self._time_axis(tensordict.ndim)
        out = _reward_to_go(reward, done, self.discount, dim)
        tensordict.set(_next_key(self.out_keys[0]), out)
        return tensordict

    def _time_axis(self, ndim: int) -> int:
        if self.time_dim is None:
            if ndim == 0:
                raise ValueError(
                    "DensifyReward: the tensordict has no batch dim to hold time; "
                    "pass a batch [*B, T]."
                )
            return ndim - 1
        if not -ndim <= self.time_dim < ndim:
            raise ValueError(
                f"DensifyReward: time_dim={self.time_dim} is not a batch dim of "
                f"a tensordict with {ndim} batch dims; leave time_dim out (time "
                "is the last batch dim, TorchRL's behaviour) or pass one in "
                f"[{-ndim}, {ndim})."
            )
        return self.time_dim % ndim


def _reward_to_go(
    reward: torch.Tensor, done: torch.Tensor, discount: float, dim: int
) -> torch.Tensor:
    """Discounted reward-to-go along ``dim`` (TorchRL's ``reward2go``): every other index is
    its own sequence, cut after each True ``done`` and at its end; terms of weight below 1e-7
    are dropped as TorchRL drops them. Computed in float64, returned in ``reward``'s dtype."""
    discount = float(discount)
    x = reward.detach().movedim(dim, -1)
    shape = x.shape
    x = x.reshape(-1, shape[-1]).to(torch.float64)
    ends = (done.detach().movedim(dim, -1).reshape(x.shape) != 0).clone()
    ends[:, -1] = True
    total = _discounted_suffix_sums(x, ends, discount)
    horizon = _horizon(discount)
    steps = x.shape[-1]
    if horizon < steps:  # subtract what lies beyond the horizon, within the same trajectory
        traj = torch.cumsum(ends, -1) - ends.long()  # trajectory number of each step
        same = traj[:, :-horizon] == traj[:, horizon:]
        tail = total[:, horizon:] * discount**horizon * same
        total = torch.cat([total[:, :-horizon] - tail, total[:, -horizon:]], -1)
    out = total.reshape(shape).movedim(-1, dim)
    return out.to(reward.dtype)


def _horizon(discount: float) -> int:
    """How many terms TorchRL's ``reward2go`` keeps: those of weight >= 1e-7 (all for a
    discount >= 1; at least the step itself)."""
    if discount >= 1.0:
        return 1 << 62
    if discount == 0.0:
        return 1
    return max(1, int(math.log(_SERIES_THRESHOLD) / math.log(discount)))


def _discounted_suffix_sums(x: torch.Tensor, ends: torch.Tensor, discount: float):
    """``S[t] = x[t] + discount * S[t+1]`` along the last dim, restarting after each end
    (``ends[:, -1]`` must be True): a parallel scan of log2(T) vector steps."""
    carry = discount * (~ends).to(x.dtype)  # how S[t+1] enters S[t]
    total = x.clone()
    steps, span = x.shape[-1], 1
    while span < steps:
        # Each position absorbs the partial sum `span` steps ahead (its sequence ends before
        # that when the carried product has reached an end, which makes it 0).
        new_total = total.clone()
        new_total[:, :-span] += carry[:, :-span] * total[:, span:]
        new_carry = carry.clone()
        new_carry[:, :-span] *= carry[:, span:]
        total, carry, span = new_total, new_carry, span * 2
    return total
