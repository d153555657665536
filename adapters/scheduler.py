"""Parameter schedulers (TorchRL's ``torchrl.data.replay_buffers.scheduler``): anneal a
sampler's hyper-parameter, e.g. a prioritized sampler's ``alpha`` or ``beta``, step by step.

A scheduler reads the attribute once when it is built (its initial value) and, at each
:meth:`~ParameterScheduler.step`, sets ``sampler.<param_name>`` to the scheduled value clipped
to ``[min_value, max_value]``, as TorchRL's do. The prioritized samplers' ``alpha`` setter
re-expresses the stored ``(p + eps) ** alpha`` values with the new exponent (TorchRL's rule),
so sampling probabilities follow the annealed ``alpha`` at once.

The arithmetic is TorchRL's: a value that starts as a ``torch.Tensor`` is scheduled with torch,
anything else with numpy (the adapters' samplers keep Python floats). Differences, each
because TorchRL's behaviour is an error or a silent surprise:

- ``LinearScheduler(num_steps=0)`` and ``StepScheduler(n_steps=0)`` raise ``ValueError`` here
  (TorchRL: ``ZeroDivisionError`` at construction or at the first ``step``);
- a ``param_name`` the sampler can read but not set (a read-only property) raises
  ``AttributeError`` when the scheduler is built, not at its first ``step``;
- ``min_value > max_value`` raises ``ValueError`` (TorchRL clips to an empty range);
- :class:`SchedulerList` keeps a list (TorchRL keeps a tuple it was given, so ``append``
  fails on it) and checks that every member has a ``step`` method.

TorchRL's own schedulers accept only TorchRL's ``ReplayBuffer`` and ``Sampler`` (an
``isinstance`` check), and the adapters do not import TorchRL. To drive an adapter sampler with
TorchRL's scheduler, register the adapters' sampler base with TorchRL's abstract ``Sampler``
and pass the sampler (TorchRL's ``ReplayBuffer`` is not abstract, so the buffer itself cannot
be registered)::

    from torchrl.data.replay_buffers.samplers import Sampler as TorchRLSampler
    TorchRLSampler.register(functional_rb.adapters.Sampler)
    LinearScheduler(rb.sampler, "beta", final_value=1.0, num_steps=100)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from functional_rb.adapters import errors
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.samplers.base import Sampler

__all__ = [
    "ParameterScheduler",
    "LambdaScheduler",
    "LinearScheduler",
    "StepScheduler",
    "SchedulerList",
]


def _positive_steps(owner: str, name: str, value):
    """A step count (TorchRL accepts any positive number; 0 would divide by zero there)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not value > 0
    ):
        raise ValueError(
            f"{owner}: {name} must be a positive number of steps (calls to step()), got {value!r}."
        )
    return value


def _settable(sampler, name: str) -> bool:
    """Whether ``sampler.<name> = value`` can work: a plain attribute, or a property with a
    setter (found on the class, so that nothing is set to find out)."""
    attr = getattr(type(sampler), name, None)
    return not isinstance(attr, property) or attr.fset is not None


class ParameterScheduler(abc.ABC):
    """Adjusts the value of an attribute of a replay buffer's sampler at each :meth:`step`.

    Args:
        obj (ReplayBuffer or Sampler): the buffer whose sampler to adjust, or the sampler.
        param_name (str): the attribute to adjust, e.g. ``"beta"``.
        min_value (int or float, optional): lower bound of the scheduled value (None: none).
        max_value (int or float, optional): upper bound of the scheduled value (None: none).
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        owner = type(self).__name__
        if not isinstance(obj, (ReplayBuffer, Sampler)):
            raise errors.torchrl_error(
                TypeError,
                "ParameterScheduler only supports Sampler class. Pass either "
                f"`ReplayBuffer` or `Sampler` object. Got {type(obj)} instead.",
                "Pass a functional_rb.adapters buffer or sampler (a TorchRL buffer is "
                "scheduled by TorchRL's own schedulers).",
                owner=owner,
            )
        self.sampler = obj.sampler if isinstance(obj, ReplayBuffer) else obj
        self.param_name = param_name
        self._min_val = float("-inf") if min_value is None else min_value
        self._max_val = float("inf") if max_value is None else max_value
        if self._min_val > self._max_val:
            raise ValueError(
                f"{owner}: min_value={min_value!r} is larger than "
                f"max_value={max_value!r}; pass min_value <= max_value."
            )
        if not hasattr(self.sampler, param_name):
            raise errors.torchrl_error(
                ValueError,
                f"Provided class {type(obj).__name__} does not have an attribute {param_name}",
                f"(its sampler is a {type(self.sampler).__name__}).",
                owner=owner,
            )
        if not _settable(self.sampler, param_name):
            raise AttributeError(
                f"{owner}: {type(self.sampler).__name__}.{param_name} is "
                "read-only, so it cannot be scheduled."
            )
        initial_val = getattr(self.sampler, param_name)
        if isinstance(initial_val, torch.Tensor):
            initial_val = initial_val.clone()
            self.backend = torch
        else:
            self.backend = np
        self.initial_val = initial_val
        self._step_cnt = 0

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute except the sampler and the backend module
        (TorchRL's layout)."""
        sd = dict(self.__dict__)
        del sd["sampler"], sd["backend"]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (the sampler is not touched until the next
        :meth:`step`)."""
        self.__dict__.update(state_dict)

    def step(self) -> None:
        """Advances one step and sets the sampler's attribute to the scheduled value."""
        self._step_cnt += 1
        value = self.backend.clip(self._step(), self._min_val, self._max_val)
        setattr(self.sampler, self.param_name, value)

    @abc.abstractmethod
    def _step(self):
        """The unclipped value for step ``self._step_cnt``."""


class LambdaScheduler(ParameterScheduler):
    """Sets the attribute to its initial value times ``lambda_fn(step_count)`` (as
    :class:`torch.optim.lr_scheduler.LambdaLR`).

    Args:
        obj (ReplayBuffer or Sampler): the object whose attribute is scheduled.
        param_name (str): the attribute's name (e.g. ``"beta"``).
        min_value (int or float, optional): the lowest value set.
        max_value (int or float, optional): the highest value set.
        lambda_fn (Callable[[int], float]): the multiplicative factor of step ``step_count``
            (1 at the first :meth:`step`).
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        lambda_fn: Callable[[int], float],
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        if not callable(lambda_fn):
            raise TypeError(
                f"LambdaScheduler: lambda_fn must be callable (step count -> "
                f"factor), got {type(lambda_fn).__name__}."
            )
        super().__init__(obj, param_name, min_value, max_value)
        self.lambda_fn = lambda_fn

    def _step(self):
        return self.initial_val * self.lambda_fn(self._step_cnt)


class LinearScheduler(ParameterScheduler):
    """Moves the attribute linearly from its initial value to ``final_value`` in ``num_steps``
    steps, then holds it there.

    Args:
        obj (ReplayBuffer or Sampler): the object whose attribute is scheduled.
        param_name (str): the attribute's name (e.g. ``"beta"``).
        final_value (number): the value reached at step ``num_steps``.
        num_steps (number): how many steps the interpolation takes (> 0).

    Example: with an initial ``beta`` of 0.6, ``LinearScheduler(rb, "beta", 1.0, 4)`` sets
    0.7, 0.8, 0.9, 1.0, 1.0, ... at successive steps.
    """

    def __init__(
        self, obj: ReplayBuffer | Sampler, param_name: str, final_value: int | float, num_steps: int
    ):
        num_steps = _positive_steps("LinearScheduler", "num_steps", num_steps)
        super().__init__(obj, param_name)
        if isinstance(self.initial_val, torch.Tensor):  # the initial value's dtype and device
            final_value = torch.tensor(final_value).to(self.initial_val)
        self.final_val = final_value
        self.num_steps = num_steps
        self._delta = (self.final_val - self.initial_val) / self.num_steps

    def _step(self):
        if self._step_cnt < self.num_steps:
            return self.initial_val + self._delta * self._step_cnt
        return self.final_val


class StepScheduler(ParameterScheduler):
    """Every ``n_steps`` steps, multiplies the attribute by ``gamma`` (``mode=
    "multiplicative"``) or adds ``gamma`` to it (``mode="additive"``).

    Args:
        obj (ReplayBuffer or Sampler): the object whose attribute is scheduled.
        param_name (str): the attribute's name (e.g. ``"beta"``).
        min_value (int or float, optional): the lowest value set.
        max_value (int or float, optional): the highest value set.
        gamma (int or float): the factor or increment. Default 0.9.
        n_steps (number): the period, in steps (> 0). Default 1.
        mode (str): ``"multiplicative"`` (default) or ``"additive"``.

    Example: with an initial ``beta`` of 0.6, ``StepScheduler(rb, "beta", gamma=0.1,
    n_steps=10, mode="additive", max_value=1.0)`` gives 0.7 at step 10, 0.8 at step 20, ...,
    1.0 from step 40 on.
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        gamma: int | float = 0.9,
        n_steps: int = 1,
        mode: str = "multiplicative",
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        n_steps = _positive_steps("StepScheduler", "n_steps", n_steps)
        super().__init__(obj, param_name, min_value, max_value)
        self.gamma = gamma
        self.n_steps = n_steps
        self.mode = mode
        if mode == "additive":
            self.operator = self.backend.add
        elif mode == "multiplicative":
            self.operator = self.backend.multiply
        else:
            raise ValueError(f"Invalid mode: {mode}. Choose 'multiplicative' or 'additive'.")

    def _step(self):
        current = getattr(self.sampler, self.param_name)
        if self._step_cnt % self.n_steps == 0:
            return self.operator(current, self.gamma)
        return current


class SchedulerList:
    """Several schedulers stepped together (e.g. one for ``alpha``, one for ``beta``).

    Args:
        schedulers: a scheduler, or a list or tuple of them (anything with a ``step()``
            method, TorchRL's schedulers included).
    """

    def __init__(self, schedulers: ParameterScheduler | Sequence[ParameterScheduler]) -> None:
        if not isinstance(schedulers, (list, tuple)):
            schedulers = [schedulers]
        self.schedulers = []
        for scheduler in schedulers:
            self.append(scheduler)

    def append(self, scheduler) -> None:
        """Adds a scheduler, stepped after the others."""
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"SchedulerList: expected a scheduler (an object with a step() "
                f"method), got {type(scheduler).__name__}."
            )
        self.schedulers.append(scheduler)

    def step(self) -> None:
        """Steps every scheduler, in order."""
        for scheduler in self.schedulers:
            scheduler.step()
