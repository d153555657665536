"""TorchRL's ``WriterEnsemble``: the member writers of a
:class:`~functional_rb.adapters.ReplayBufferEnsemble`. It does not write itself; writes are
routed by the buffer ensemble. Members, indexing and ``state_dict`` / ``dumps`` / ``loads``
follow :class:`~functional_rb.adapters._utils.ensemble.Members`."""

from __future__ import annotations

import textwrap

import torch
from tensordict import TensorDictBase

from functional_rb.adapters._utils.ensemble import Members, check_members
from functional_rb.adapters.storages.ensemble import StorageEnsemble
from functional_rb.adapters.writers.base import Writer

__all__ = ["WriterEnsemble"]


class WriterEnsemble(Members, Writer):
    """Member writers (TorchRL's ``WriterEnsemble``). It does not write itself: a
    ``ReplayBufferEnsemble`` with ``routing_key`` / ``routing_dim`` routes writes to the member
    buffers; otherwise index the ensemble and write to a member.

    Args:
      *writers: the member writers.

    Example:
        >>> from functional_rb.adapters import RoundRobinWriter, WriterEnsemble
        >>> ensemble = WriterEnsemble(RoundRobinWriter(), RoundRobinWriter())
        >>> len(ensemble)
        2
    """

    def __init__(self, *writers: Writer):
        self._members = check_members("WriterEnsemble", writers, Writer, "writer")
        self._storage = None
        self._compilable = False
        self._rng_private = None

    @property
    def writers(self) -> tuple:
        return self._members

    @property
    def tracks_generations(self) -> bool:
        return all(w.tracks_generations for w in self._members)

    @property
    def write_count(self) -> int:
        return sum(w.write_count for w in self._members)

    _write_count = write_count  # TorchRL's name
    _kind = "writers"

    def register_storage(self, storage) -> None:
        if not isinstance(storage, StorageEnsemble):
            raise TypeError(
                f"WriterEnsemble.register_storage: expected a StorageEnsemble, got "
                f"{type(storage).__name__}."
            )
        if len(storage.storages) != len(self._members):
            raise ValueError(
                f"WriterEnsemble and StorageEnsemble must have the same number of "
                f"members, got {len(self._members)} writers and "
                f"{len(storage.storages)} storages."
            )
        self._storage = storage
        for w, s in zip(self._members, storage.storages):
            w.register_storage(s)

    def generations_of(self, index) -> torch.Tensor:
        """Generation stamps ``[nb, ...]`` of an ensemble index (``"buffer_ids"`` ``[nb]``,
        ``"index"`` ``[nb, ...]``), each row from its member's writer."""
        if not isinstance(index, TensorDictBase):
            raise TypeError(
                "WriterEnsemble.generations_of: expected the ensemble index (a "
                "TensorDict with 'buffer_ids' and 'index'), got "
                f"{type(index).__name__}."
            )
        ids, local = index.get("buffer_ids"), index.get("index")
        if ids.ndim != 1 or local.shape[0] != ids.shape[0]:
            raise ValueError(
                "WriterEnsemble expects one member id per leading local-index row, "
                f"got buffer_ids {tuple(ids.shape)} and index "
                f"{tuple(local.shape)}."
            )
        if ids.dtype == torch.bool or ids.is_floating_point():
            raise TypeError("Replay-buffer member ids must be integers.")
        if ids.numel() and ((ids < 0).any() or (ids >= len(self._members)).any()):
            raise ValueError(
                f"Replay-buffer member ids must lie in [0, "
                f"{len(self._members) - 1}], got {ids.tolist()}."
            )
        if not ids.numel():
            return torch.empty(ids.shape, dtype=torch.int64)
        out = [None] * ids.numel()
        for member in ids.unique(sorted=True).tolist():
            rows = (ids == member).nonzero().flatten()
            gens = self._members[member].generations_of(local[rows])
            for row, g in zip(rows.tolist(), gens.unbind(0)):
                out[row] = g
        if all(g.shape == out[0].shape for g in out[1:]):
            return torch.stack(out)
        return torch.nested.nested_tensor(out)

    def add(self, data):
        raise NotImplementedError(
            "WriterEnsemble does not write: extend a member buffer "
            "(ensemble[i].extend(data)) or route writes with "
            "ReplayBufferEnsemble(..., routing_key=...)."
        )

    extend = add

    def _empty(self, empty_write_count: bool = True) -> None:
        for w in self._members:
            w.empty(empty_write_count=empty_write_count)

    def _subset(self, positions: list):
        return WriterEnsemble(*(self._members[i] for i in positions))

    def __repr__(self):
        writers = textwrap.indent(f"writers={self._members}", " " * 4)
        return f"WriterEnsemble(\n{writers})"
