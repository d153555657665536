"""What TorchRL's three ensembles share: members held in order, indexed as TorchRL indexes them.

:class:`Members` is the base of :class:`~functional_rb.adapters.StorageEnsemble`,
:class:`~functional_rb.adapters.WriterEnsemble` and
:class:`~functional_rb.adapters.SamplerEnsemble`: a ``members`` tuple, the ``rng`` that sets the
generator on every member, ``len`` (the number of members), TorchRL's indexing (an int gives a
member, a slice, list, array or 1-d tensor an ensemble of those members, ``[:]`` the ensemble
itself), and ``state_dict`` / ``dumps`` / ``loads`` passed to the members under ``"0"``,
``"1"``, ... (``path/0``, ``path/1``, ...), as TorchRL does.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from functional_rb.adapters import errors

__all__ = ["Members", "check_members", "member_positions", "tuple_index"]

_INDEX_ERROR = (
    "Expected an index of type torch.Tensor, range, np.ndarray, int, slice or "
    "ellipsis, got {} instead."
)


def member_positions(index, n: int, owner: str):
    """TorchRL's rule for indexing an ensemble of ``n`` members: ``None`` for ``[:]`` (the
    ensemble itself), an int for one member, a list of positions for several."""
    if isinstance(index, slice):
        return None if index == slice(None) else list(range(n))[index]
    if isinstance(index, (list, range, np.ndarray)):
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor):
        if index.ndim > 1:
            raise RuntimeError(
                f"Cannot index a {owner} with tensor indices that have more than one dimension."
            )
        if index.is_floating_point():
            raise TypeError(
                "A floating point index was received when an integer dtype was expected."
            )
        if index.ndim == 1:
            if index.numel() == 0:
                raise IndexError(_INDEX_ERROR.format(type(index)))
            return index.tolist()
    try:
        position = operator.index(index)
    except TypeError:
        raise IndexError(_INDEX_ERROR.format(type(index))) from None
    if not -n <= position < n:
        raise IndexError(f"{owner}: member {position} is out of range ({n} members).")
    return position


def check_members(owner: str, members, base: type, kind: str) -> tuple:
    """``members`` as a tuple, each an instance of ``base`` (TypeError naming the member)."""
    members = tuple(members)
    if not members:
        raise ValueError(f"{owner}: pass at least one {kind}, e.g. {owner}(a, b).")
    for i, m in enumerate(members):
        if not isinstance(m, base):
            raise errors.not_an_adapter(
                owner,
                f"member {i}",
                kind,
                m,
                torchrl_fix="use functional_rb.adapters.{name} (same name and arguments).",
            )
    return members


def tuple_index(ensemble, index: tuple, kind: str):
    """TorchRL's tuple indexing of samplers and writers: only ``(members,)``."""
    if index[0] is Ellipsis or len(index) > 1:
        raise IndexError(
            f"Tuple of length greater than 1 are not accepted to index {kind} of "
            f"type {type(ensemble)}."
        )
    return ensemble[index[0]]


class Members:
    """Base of the ensembles: ``members`` (a tuple, in order) and what follows from it.

    A subclass sets ``self._members`` (through :func:`check_members`) and implements
    :meth:`_subset` (the ensemble of some of its members); ``_kind`` names its members in
    TorchRL's tuple-index error ("storages", "writers", "samplers").
    """

    _members: tuple = ()
    _rng_private = None
    _kind = "members"

    @property
    def members(self) -> tuple:
        return self._members

    @property
    def rng(self):
        return self._rng_private

    @rng.setter
    def rng(self, value) -> None:
        self._rng_private = value
        for m in self._members:
            m.rng = value

    def __len__(self) -> int:
        return len(self._members)

    # ------------------------------------------------------------------ indexing
    def _tuple_item(self, index: tuple):
        """``ensemble[a, b, ...]``; TorchRL's samplers and writers take only ``(members,)``."""
        return tuple_index(self, index, self._kind)

    def _subset(self, positions: list):  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, tuple):
            return self._tuple_item(index)
        pos = member_positions(index, len(self._members), type(self).__name__)
        if pos is None:
            return self
        if isinstance(pos, int):
            return self._members[pos]
        return self._subset(pos)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return OrderedDict((str(i), m.state_dict()) for i, m in enumerate(self._members))

    def load_state_dict(self, state_dict) -> None:
        for i, m in enumerate(self._members):
            m.load_state_dict(state_dict[str(i)])

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        for i, m in enumerate(self._members):
            m.dumps(path / str(i))

    def loads(self, path) -> None:
        path = Path(path).absolute()
        for i, m in enumerate(self._members):
            m.loads(path / str(i))

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("rng", None)
        state["_rng_private"] = None
        return state
