"""The samplers' base: TorchRL's ``Sampler`` protocol, which items come out.

A sampler stands alone, as TorchRL's do: ``sample(storage, batch_size) -> (index, info)``,
``extend(index)``, ``update_priority(index, priority, storage=)``, ``mark_update(index)``,
``state_dict``, ``dumps`` / ``loads``. ``index`` is what ``storage.get`` takes: an int64
tensor ``[B]``, or a tuple of one tensor per storage dim (``ndim=2``: ``(t, env)``).

- Every sampler here asks the generator exactly what TorchRL's asks (the same calls, shapes,
  dtypes and order), so the same ``torch.manual_seed`` / ``generator`` gives the same indices
  and leaves the generator in the same state. The prioritized ones, like TorchRL's, draw from
  NumPy's global generator when no ``generator`` is set.
- :class:`PrioritizedSampler` keeps its priorities in a NumPy port of TorchRL's segment trees
  (the same float sums, so the same indices).
- The slice samplers (:mod:`functional_rb.adapters.samplers.slice`) rebuild TorchRL's list of
  stored trajectories from a host copy of the boundary signal.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from functional_rb.adapters import errors

__all__ = [
    "EpochSampler",
    "Sampler",
    "EMPTY_STORAGE_ERROR",
    "empty_storage_error",
    "unravel",
    "ravel",
]


EMPTY_STORAGE_ERROR = "Cannot sample from an empty storage."


def empty_storage_error(name: str, storage, sampler, consume_after_n_samples) -> RuntimeError:
    """TorchRL's empty-storage error, saying which buffer (``name``) and storage and what to
    do."""
    held = len(storage)
    what = f"its {type(storage).__name__}"
    if held and sampler.reuses_slots:
        why = (
            f"each of the {held} items {what} holds was consumed (sampled "
            f"consume_after_n_samples={consume_after_n_samples} times)."
        )
    else:
        why = f"{what} holds no items."
    return errors.torchrl_error(
        RuntimeError,
        EMPTY_STORAGE_ERROR,
        f"{name}.sample: the buffer is empty: {why} Call extend() or add() before "
        "sampling, or check len(buffer) > 0 (or buffer.can_sample(batch_size)) first.",
    )


# a with-replacement sampler -> its without-replacement variant, filled in by the modules that
# define the variants (random.py, slice_without_replacement.py)
WITHOUT_REPLACEMENT: dict[type, type] = {}


class _ReplacementDispatch(type):
    """``replacement=False`` builds the without-replacement variant (TorchRL's ``_SamplerMeta``
    rule): ``RandomSampler(replacement=False)`` is a :class:`SamplerWithoutReplacement`.

    A class hook rather than a ``__new__``: ``__new__`` would hand ``replacement`` on to every
    sampler's ``__init__``, and run the variant's ``__init__`` twice when it is a subclass
    (``SliceSamplerWithoutReplacement`` is a ``SliceSampler``)."""

    def __call__(cls, *args, **kwargs):
        if "replacement" in kwargs and not kwargs.pop("replacement"):
            variant = WITHOUT_REPLACEMENT.get(cls)
            if variant is not None:
                return variant(*args, **kwargs)
            if cls not in WITHOUT_REPLACEMENT.values():
                raise TypeError(
                    f"{cls.__name__} has no without-replacement variant; cannot be "
                    "instantiated with replacement=False. Use RandomSampler or SliceSampler "
                    "with replacement=False, or their *WithoutReplacement classes."
                )
        return super().__call__(*args, **kwargs)


def unravel(index: torch.Tensor, shape) -> tuple:
    """Flat element indices to a tuple of per-dim indices over ``shape``."""
    out = []
    for d in reversed(shape[1:]):
        out.append(index % d)
        index = torch.div(index, d, rounding_mode="floor")
    out.append(index)
    return tuple(reversed(out))


def ravel(index: torch.Tensor, shape) -> torch.Tensor:
    """``[..., ndim]`` per-dim indices to flat element indices over ``shape``."""
    flat = index[..., 0]
    for d in range(1, index.shape[-1]):
        flat = flat * int(shape[d]) + index[..., d]
    return flat


class Sampler(metaclass=_ReplacementDispatch):
    """Base of the samplers (TorchRL's ``Sampler`` protocol)."""

    _remaining_batches = int(torch.iinfo(torch.int64).max)
    rng: torch.Generator | None = None
    prioritized = False  # whether update_priority changes what is drawn
    reuses_slots = False  # a ConsumingSampler: consumed slots are written first

    def sample(self, storage, batch_size: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def sampleable_count(self, storage, batch_size: int) -> int:
        del batch_size
        return len(storage)

    def can_sample(self, storage, batch_size: int) -> bool:
        return self.sampleable_count(storage, batch_size) > 0

    def add(self, index, *, storage=None) -> None:
        del index, storage

    def extend(self, index, *, storage=None) -> None:
        del index, storage

    def update_priority(self, index, priority, *, storage=None):
        warnings.warn(
            f"Calling update_priority() on a sampler {type(self).__name__} that is not "
            "prioritized. Make sure this is the intended behavior.",
            stacklevel=2,
        )

    def mark_update(self, index, *, storage=None) -> None:
        del index, storage

    @property
    def default_priority(self) -> float:
        return 1.0

    @property
    def ran_out(self) -> bool:
        return False

    @ran_out.setter
    def ran_out(self, value) -> None:
        del value

    def bind(self, batch_size) -> None:
        """The buffer's default batch size (None: given per sample), told when it is built."""
        del batch_size

    @property
    def remaining_batches(self) -> int:
        """Batches left in the current epoch (unbounded for samplers with replacement)."""
        return self._remaining_batches

    def empty(self) -> None:
        """Forget every item (TorchRL's ``_empty``)."""
        self._empty()

    def _empty(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict) -> None:
        del state_dict

    def dumps(self, path) -> None:
        del path

    def loads(self, path) -> None:
        del path

    def __getstate__(self):
        state = self.__dict__.copy()
        state["rng"] = None
        return state

    def __repr__(self):
        return f"{type(self).__name__}()"


class EpochSampler(Sampler):
    """A sampler that runs out (TorchRL's ``ran_out``): the flag is set when an epoch or the
    items that may still be drawn are exhausted, and a buffer iterating over it stops there."""

    _ran_out = False

    @property
    def ran_out(self) -> bool:
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value) -> None:
        self._ran_out = bool(value)


def _write_state(path, state_dict) -> None:
    path = Path(path)
    path.mkdir(exist_ok=True)
    TensorDict(state_dict).memmap(path)


def _read_state(path) -> dict:
    return TensorDict.load_memmap(path).to_dict()
