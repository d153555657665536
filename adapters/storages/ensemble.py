"""The parts of a :class:`~functional_rb.adapters.ReplayBufferEnsemble`, under TorchRL's names.

- :class:`StorageEnsemble`: member storages (and each member's transforms); ``get`` takes the
  ensemble index (a TensorDict of ``"buffer_ids"`` ``[nb]`` and ``"index"`` ``[nb, sub, ...]``)
  and returns ``[(buffer_id, member data), ...]``. It does not write.
- ``SamplerEnsemble`` (:mod:`functional_rb.adapters._sampler_ensemble`): which members a
  batch comes from.
- :class:`WriterEnsemble`: member writers; writes are routed by the buffer ensemble.
- :class:`StorageEnsembleCheckpointer`: TorchRL's layout, ``path/<i>/`` per non-empty member,
  ``metadata.json`` listing the empty ones, ``<i>_transform.pt`` per member transform.

Each holds its members in order and passes ``state_dict`` / ``dumps`` / ``loads`` to them under
``"0"``, ``"1"``, ... (``path/0``, ``path/1``, ...), as TorchRL does. Indexing follows TorchRL:
an int gives a member, a slice, list, array or 1-d tensor gives an ensemble of those members.
"""
from __future__ import annotations

import json
import operator
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from functional_rb.adapters.checkpointers import StorageCheckpointerBase
from functional_rb.adapters.storages import Storage
from functional_rb.adapters.writers import Writer

__all__ = ["StorageEnsemble", "StorageEnsembleCheckpointer", "WriterEnsemble",
           "check_members", "member_positions", "tuple_index"]

_INDEX_ERROR = ("Expected an index of type torch.Tensor, range, np.ndarray, int, slice or "
                "ellipsis, got {} instead.")


def member_positions(index, n: int, owner: str):
    """TorchRL's rule for indexing an ensemble of ``n`` members: ``None`` for ``[:]`` (the
    ensemble itself), an int for one member, a list of positions for several."""
    if isinstance(index, slice):
        return None if index == slice(None) else list(range(n))[index]
    if isinstance(index, (list, range, np.ndarray)):
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor):
        if index.ndim > 1:
            raise RuntimeError(f"Cannot index a {owner} with tensor indices that have more than "
                               "one dimension.")
        if index.is_floating_point():
            raise TypeError("A floating point index was received when an integer dtype was "
                            "expected.")
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
            name = f"{type(m).__module__}.{type(m).__name__}"
            hint = (" This is TorchRL's class: use functional_rb.adapters."
                    f"{type(m).__name__} (same name and arguments)."
                    if type(m).__module__.startswith("torchrl") else "")
            raise TypeError(f"{owner}: member {i} must be a functional_rb.adapters {kind}, got "
                            f"{name}.{hint}")
    return members


class StorageEnsembleCheckpointer(StorageCheckpointerBase):
    """Checkpointer of a :class:`StorageEnsemble` (TorchRL's layout, see the module)."""

    def dumps(self, storage, path) -> None:
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        empty = [i for i, member in enumerate(storage.storages) if not len(member)]
        with open(path / "metadata.json", "w") as f:
            json.dump({"empty_members": empty}, f)
        for i, member in enumerate(storage.storages):
            if i not in empty:
                member.dumps(path / str(i))
        for i, transform in enumerate(storage.transforms or ()):
            if transform is not None:
                torch.save(transform.state_dict(), path / f"{i}_transform.pt")

    def loads(self, storage, path) -> None:
        path = Path(path).absolute()
        meta = path / "metadata.json"
        try:
            empty = set(json.loads(meta.read_text())["empty_members"]) if meta.exists() \
                else set()
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RuntimeError(f"StorageEnsembleCheckpointer.loads: {meta} is damaged ({e}); "
                               "expected {\"empty_members\": [...]}.") from None
        for i, member in enumerate(storage.storages):
            if i in empty:
                member.empty()
            else:
                member.loads(path / str(i))
        for i, transform in enumerate(storage.transforms or ()):
            if transform is not None:
                transform.load_state_dict(torch.load(path / f"{i}_transform.pt"))


class StorageEnsemble(Storage):
    """Member storages read together (TorchRL's ``StorageEnsemble``).

    Args: the member storages. Keyword Args: ``transforms``, one per member (or None): applied
    by :meth:`get` to what the member returns. ``len`` is the number of members; ``max_size``
    the sum of theirs. Writing raises: write through the member buffers.
    """

    _default_checkpointer = StorageEnsembleCheckpointer

    def __init__(self, *storages: Storage, transforms=None):
        self._storages = ()  # members join after the base init, which resets the rng
        members = check_members("StorageEnsemble", storages, Storage, "storage")
        super().__init__(max_size=sum(s.max_size for s in members))
        if transforms is not None and len(transforms) != len(members):
            raise TypeError(f"StorageEnsemble: transforms must have the same length as the "
                            f"storages ({len(members)}), got {len(transforms)}.")
        self._storages = members
        self._transforms = None if transforms is None else list(transforms)

    @property
    def storages(self) -> tuple:
        return self._storages

    @property
    def transforms(self):
        return self._transforms

    @property
    def rng(self):
        return self._rng_private

    @rng.setter
    def rng(self, value) -> None:
        self._rng_private = value
        for s in self._storages:
            s.rng = value

    def set(self, cursor, data, *, set_cursor: bool = True):
        raise RuntimeError("StorageEnsemble does not write: extend a member buffer "
                           "(ensemble[i].extend(data)) or build the ReplayBufferEnsemble with "
                           "routing_key= / routing_dim=.")

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
            data = self._storages[buffer_id].get(index)
            t = None if self._transforms is None else self._transforms[buffer_id]
            if t is not None and len(t):
                data = t(data)
            out.append((buffer_id, data))
        return out

    def __len__(self) -> int:
        return len(self._storages)

    def contains(self, item):
        raise NotImplementedError("StorageEnsemble.contains: ask a member storage "
                                  "(ensemble.storage[i].contains(item)).")

    def state_dict(self) -> dict[str, Any]:
        return OrderedDict((str(i), s.state_dict()) for i, s in enumerate(self._storages))

    def load_state_dict(self, state_dict) -> None:
        for i, s in enumerate(self._storages):
            s.load_state_dict(state_dict[str(i)])
        self._bump()

    def _empty(self) -> None:
        for s in self._storages:
            s.empty()

    def __getitem__(self, index):
        if isinstance(index, tuple):
            if index[0] is Ellipsis:
                index = (slice(None), index[1:])
            result = self[index[0]]
            if len(index) == 1:
                return result
            if result is self:
                return [s[index[1:]] for s in self._storages]
            if isinstance(result, StorageEnsemble):
                return result[(slice(None), *index[1:])]
            return result[index[1:]]
        pos = member_positions(index, len(self._storages), "StorageEnsemble")
        if pos is None:
            return self
        if isinstance(pos, int):
            return self._storages[pos]
        t = self._transforms
        return StorageEnsemble(*(self._storages[i] for i in pos),
                               transforms=[None if t is None else t[i] for i in pos])

    def __getstate__(self):
        state = super().__getstate__()
        state["_rng_private"] = None
        return state

    def __repr__(self):
        storages = textwrap.indent(f"storages={self._storages}", " " * 4)
        transforms = textwrap.indent(f"transforms={self._transforms}", " " * 4)
        return f"StorageEnsemble(\n{storages}, \n{transforms})"


class WriterEnsemble(Writer):
    """Member writers (TorchRL's ``WriterEnsemble``). It does not write itself: a
    ``ReplayBufferEnsemble`` with ``routing_key`` / ``routing_dim`` routes writes to the member
    buffers; otherwise index the ensemble and write to a member."""

    def __init__(self, *writers: Writer):
        self._writers = check_members("WriterEnsemble", writers, Writer, "writer")
        self._storage = None
        self._compilable = False
        self._rng_private = None

    @property
    def writers(self) -> tuple:
        return self._writers

    @property
    def rng(self):
        return self._rng_private

    @rng.setter
    def rng(self, value) -> None:
        self._rng_private = value
        for w in self._writers:
            w.rng = value

    @property
    def tracks_generations(self) -> bool:
        return all(w.tracks_generations for w in self._writers)

    @property
    def write_count(self) -> int:
        return sum(w.write_count for w in self._writers)

    _write_count = write_count  # TorchRL's name

    def register_storage(self, storage) -> None:
        if not isinstance(storage, StorageEnsemble):
            raise TypeError(f"WriterEnsemble.register_storage: expected a StorageEnsemble, got "
                            f"{type(storage).__name__}.")
        if len(storage.storages) != len(self._writers):
            raise ValueError(f"WriterEnsemble and StorageEnsemble must have the same number of "
                             f"members, got {len(self._writers)} writers and "
                             f"{len(storage.storages)} storages.")
        self._storage = storage
        for w, s in zip(self._writers, storage.storages):
            w.register_storage(s)

    def generations_of(self, index) -> torch.Tensor:
        """Generation stamps ``[nb, ...]`` of an ensemble index (``"buffer_ids"`` ``[nb]``,
        ``"index"`` ``[nb, ...]``), each row from its member's writer."""
        if not isinstance(index, TensorDictBase):
            raise TypeError("WriterEnsemble.generations_of: expected the ensemble index (a "
                            "TensorDict with 'buffer_ids' and 'index'), got "
                            f"{type(index).__name__}.")
        ids, local = index.get("buffer_ids"), index.get("index")
        if ids.ndim != 1 or local.shape[0] != ids.shape[0]:
            raise ValueError("WriterEnsemble expects one member id per leading local-index row, "
                             f"got buffer_ids {tuple(ids.shape)} and index "
                             f"{tuple(local.shape)}.")
        if ids.dtype == torch.bool or ids.is_floating_point():
            raise TypeError("Replay-buffer member ids must be integers.")
        if ids.numel() and ((ids < 0).any() or (ids >= len(self._writers)).any()):
            raise ValueError(f"Replay-buffer member ids must lie in [0, "
                             f"{len(self._writers) - 1}], got {ids.tolist()}.")
        if not ids.numel():
            return torch.empty(ids.shape, dtype=torch.int64)
        out = [None] * ids.numel()
        for member in ids.unique(sorted=True).tolist():
            rows = (ids == member).nonzero().flatten()
            gens = self._writers[member].generations_of(local[rows])
            for row, g in zip(rows.tolist(), gens.unbind(0)):
                out[row] = g
        if all(g.shape == out[0].shape for g in out[1:]):
            return torch.stack(out)
        return torch.nested.nested_tensor(out)

    def add(self, data):
        raise NotImplementedError("WriterEnsemble does not write: extend a member buffer "
                                  "(ensemble[i].extend(data)) or route writes with "
                                  "ReplayBufferEnsemble(..., routing_key=...).")

    extend = add

    def _empty(self, empty_write_count: bool = True) -> None:
        for w in self._writers:
            w.empty(empty_write_count=empty_write_count)

    def state_dict(self) -> dict[str, Any]:
        return OrderedDict((str(i), w.state_dict()) for i, w in enumerate(self._writers))

    def load_state_dict(self, state_dict) -> None:
        for i, w in enumerate(self._writers):
            w.load_state_dict(state_dict[str(i)])

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        for i, w in enumerate(self._writers):
            w.dumps(path / str(i))

    def loads(self, path) -> None:
        path = Path(path).absolute()
        for i, w in enumerate(self._writers):
            w.loads(path / str(i))

    def __getitem__(self, index):
        if isinstance(index, tuple):
            return tuple_index(self, index, "writers")
        pos = member_positions(index, len(self._writers), "WriterEnsemble")
        if pos is None:
            return self
        if isinstance(pos, int):
            return self._writers[pos]
        return WriterEnsemble(*(self._writers[i] for i in pos))

    def __len__(self) -> int:
        return len(self._writers)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_rng_private"] = None
        return state

    def __repr__(self):
        writers = textwrap.indent(f"writers={self._writers}", " " * 4)
        return f"WriterEnsemble(\n{writers})"


def tuple_index(ensemble, index: tuple, kind: str):
    """TorchRL's tuple indexing of samplers and writers: only ``(members,)``."""
    if index[0] is Ellipsis or len(index) > 1:
        raise IndexError(f"Tuple of length greater than 1 are not accepted to index {kind} of "
                         f"type {type(ensemble)}.")
    return ensemble[index[0]]
