"""TorchRL's ``StorageEnsemble``: the member storages of a
:class:`~functional_rb.adapters.ReplayBufferEnsemble`, read together.

``get`` takes the ensemble index (a TensorDict of ``"buffer_ids"`` ``[nb]`` and ``"index"``
``[nb, sub, ...]``) and returns ``[(buffer_id, member data), ...]``. It does not write. Members,
indexing and ``state_dict`` follow :class:`~functional_rb.adapters._utils.ensemble.Members`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

from functional_rb.adapters._utils.ensemble import Members, check_members
from functional_rb.adapters.checkpointers.ensemble import StorageEnsembleCheckpointer
from functional_rb.adapters.storages.base import Storage

__all__ = ["StorageEnsemble"]


class StorageEnsemble(Members, Storage):
    """Member storages read together (TorchRL's ``StorageEnsemble``).

    ``len`` is the number of members; ``max_size`` the sum of theirs. Writing raises: write
    through the member buffers.

    Args:
      *storages: the member storages.
      transforms: one per member (or None): applied by :meth:`get` to what that member
        returns.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, StorageEnsemble
        >>> a, b = LazyTensorStorage(4), LazyTensorStorage(6)
        >>> a.set(torch.arange(2), torch.zeros(2, 3))
        >>> ensemble = StorageEnsemble(a, b)
        >>> len(ensemble), ensemble.max_size
        (2, 10)
    """

    _default_checkpointer = StorageEnsembleCheckpointer
    # a storage's files are its checkpointer's (StorageEnsembleCheckpointer), not the members'
    dumps = Storage.dumps
    loads = Storage.loads

    def __init__(self, *storages: Storage, transforms: Sequence[Callable | None] | None = None):
        self._members = ()  # members join after the base init, which resets the rng
        members = check_members("StorageEnsemble", storages, Storage, "storage")
        super().__init__(max_size=sum(s.max_size for s in members))
        if transforms is not None and len(transforms) != len(members):
            raise TypeError(
                f"StorageEnsemble: transforms must have the same length as the "
                f"storages ({len(members)}), got {len(transforms)}."
            )
        self._members = members
        self._transforms = None if transforms is None else list(transforms)

    @property
    def storages(self) -> tuple:
        return self._members

    @property
    def transforms(self):
        return self._transforms

    def set(self, cursor, data, *, set_cursor: bool = True):
        raise RuntimeError(
            "StorageEnsemble does not write: extend a member buffer "
            "(ensemble[i].extend(data)) or build the ReplayBufferEnsemble with "
            "routing_key= / routing_dim=."
        )

    def extend(self, value):
        return self.set(None, value)

    def add(self, value):
        return self.set(None, value)

    def get(self, item):
        """``[(buffer_id, data), ...]`` for ``item["buffer_ids"]`` ``[nb]`` and
        ``item["index"]`` ``[nb, sub, ...]`` (each member's transform applied)."""
        out = []
        for buffer_id, index in zip(item.get("buffer_ids"), item.get("index")):
            buffer_id = int(buffer_id)
            data = self._members[buffer_id].get(index)
            t = None if self._transforms is None else self._transforms[buffer_id]
            if t is not None and len(t):
                data = t(data)
            out.append((buffer_id, data))
        return out

    def contains(self, item):
        raise NotImplementedError(
            "StorageEnsemble.contains: ask a member storage (ensemble.storage[i].contains(item))."
        )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._bump()

    def _empty(self) -> None:
        for s in self._members:
            s.empty()

    def _tuple_item(self, index: tuple):
        if index[0] is Ellipsis:
            index = (slice(None), index[1:])
        result = self[index[0]]
        if len(index) == 1:
            return result
        if result is self:
            return [s[index[1:]] for s in self._members]
        if isinstance(result, StorageEnsemble):
            return result[(slice(None), *index[1:])]
        return result[index[1:]]

    def _subset(self, positions: list):
        t = self._transforms
        return StorageEnsemble(
            *(self._members[i] for i in positions),
            transforms=[None if t is None else t[i] for i in positions],
        )

    def __repr__(self):
        storages = textwrap.indent(f"storages={self._members}", " " * 4)
        transforms = textwrap.indent(f"transforms={self._transforms}", " " * 4)
        return f"StorageEnsemble(\n{storages}, \n{transforms})"
