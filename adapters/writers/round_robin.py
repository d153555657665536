"""TorchRL's ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``: a FIFO ring along dim 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tensordict import MemoryMappedTensor, is_tensorclass

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.writers.base import Writer, _read_json

__all__ = ["RoundRobinWriter", "TensorDictRoundRobinWriter"]


def _device(storage) -> torch.device:
    """Where a storage keeps its data (generation stamps go there too, as TorchRL's)."""
    dev = getattr(storage, "device", None)
    return torch.device("cpu") if dev is None or dev == "auto" else torch.device(dev)


class RoundRobinWriter(Writer):
    """A FIFO ring along dim 0 (TorchRL's ``RoundRobinWriter``).

    ``extend`` of ``n`` items writes slots ``(cursor + arange(n)) % rows``; a batch larger than
    the ring keeps its last ``rows`` items. With a storage that coordinates several processes
    (a :class:`~functional_rb.adapters.LazyMemmapStorage`), the slots are reserved from it, so
    concurrent writers never share a slot. ``track_generations=True`` stamps each slot with the
    number of times it was written (:meth:`generations_of`).

    Args:
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      track_generations: stamp each slot with the number of times it was written.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, ReplayBuffer, RoundRobinWriter
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(4), writer=RoundRobinWriter())
        >>> rb.extend(torch.arange(6))  # the ring's slots: items 4 and 5 overwrite 0 and 1
        tensor([0, 1, 2, 3, 0, 1])
        >>> rb[:].tolist()
        [4, 5, 2, 3]
    """

    def __init__(self, compilable: bool = False, *, track_generations: bool = False):
        super().__init__(compilable)
        self._track_generations = bool(track_generations)

    @property
    def tracks_generations(self) -> bool:
        return self._track_generations

    def _slots(self, n: int, rows: int):
        """``(start, index)``: where ``n`` new steps go; ``start`` is the storage's reservation
        (None when this process owns the ring)."""
        start = self._storage.reserve(n)
        first = self._cursor if start is None else start
        index = (first + torch.arange(n)) % rows
        self._cursor = (first + n) % rows
        self._write_count += n
        return start, index

    def add(self, data):
        st = self._need_storage("add")
        rows = st.max_size_along_dim0(single_data=data)
        start, index = self._slots(1, rows)
        slot = int(index[0])
        self._prepare(data, torch.tensor(slot))
        st.set(slot, data)
        if start is not None:
            st.commit(start, 1)
        self._bump_generation(index)
        out = self.replicate_index(slot)
        self._notify(out)
        return out

    def extend(self, data):
        st = self._need_storage("extend")
        n = D.batch_len(data)
        if n == 0:
            raise RuntimeError(f"Expected at least one element in extend. Got {data=}")
        rows = st.max_size_along_dim0(batched_data=data)
        start, index = self._slots(n, rows)
        self._prepare(data, index)
        st.set(index, data)
        if start is not None:
            st.commit(start, n)
        self._bump_generation(index)
        out = self.replicate_index(index)
        self._notify(out)
        return out

    def next_slots(self, n: int, *, skip: set, data=None) -> torch.Tensor:
        """The next ``n`` ring slots from the cursor, passing over ``skip`` (slots being
        reused); the cursor moves past them."""
        rows = self._need_storage("next_slots").max_size_along_dim0(batched_data=data)
        out, cursor, scanned = [], self._cursor, 0
        while len(out) < n:
            if cursor not in skip or scanned >= rows:
                out.append(cursor)
            cursor = (cursor + 1) % rows
            scanned += 1
        self._cursor = cursor
        return torch.tensor(out, dtype=torch.long)

    def write_at(self, index, data):
        """Write at explicit dim-0 ``index`` without moving the cursor."""
        st = self._need_storage("write_at")
        single = isinstance(index, int)
        idx = torch.as_tensor(index, dtype=torch.long)
        self._write_count += 1 if single else idx.numel()
        self._prepare(data, idx)
        st.set(index if single else idx, data, set_cursor=False)
        st.grow_to(int(idx.max()) + 1 if idx.numel() else 0)
        self._bump_generation(idx.reshape(-1))
        out = self.replicate_index(int(index) if single else idx)
        self._notify(out)
        return out

    def _prepare(self, data, index) -> None:
        """A hook for writers that annotate the data before it is stored."""
        del data, index

    # ------------------------------------------------------------------ generations
    # Stamps live on the storage, so that every writer of it sees them; a writer with no storage
    # yet (built, or loaded from a dump, on its own, as TorchRL allows) keeps them until one is
    # registered.
    _pending_generation = None

    @property
    def _generation(self) -> torch.Tensor | None:
        """The stamps of the dim-0 slots, one per slot (-1: never written); TorchRL's name."""
        if self._storage is None:
            return self._pending_generation
        return self._storage.slot_generations

    @_generation.setter
    def _generation(self, value) -> None:
        value = None if value is None else torch.as_tensor(value, dtype=torch.int64)
        if self._storage is None:
            self._pending_generation = value
        else:
            self._storage.slot_generations = value

    def register_storage(self, storage) -> None:
        super().register_storage(storage)
        if self._pending_generation is not None:
            storage.slot_generations = self._pending_generation.to(_device(storage))
            self._pending_generation = None

    def _bump_generation(self, index: torch.Tensor) -> None:
        # generations live on the storage: a writer that does not track them still bumps them
        # when another writer of the same storage does, so that writer's handles go stale
        if not self._track_generations and self._storage.slot_generations is None:
            return
        gen = self._storage.slot_generations
        rows = self._storage.max_size_along_dim0()
        if gen is None or gen.numel() < rows:
            new = torch.full((rows,), -1, dtype=torch.int64, device=_device(self._storage))
            if gen is not None:
                new[: gen.numel()] = gen.to(new.device)
            gen = new
        index = index.reshape(-1).to(gen.device)
        gen.index_put_((index,), torch.ones_like(index), accumulate=True)
        self._storage.slot_generations = gen

    def generations_of(self, index) -> torch.Tensor:
        if not self._track_generations:
            return super().generations_of(index)
        if isinstance(index, tuple):
            index = index[0]
        index = torch.as_tensor(index, dtype=torch.long)
        if (
            self._storage is not None
            and self._storage.ndim > 1
            and index.ndim >= 2
            and index.shape[-1] == self._storage.ndim
        ):
            index = index[..., 0]
        gen = self._generation
        if gen is None or gen.numel() == 0:
            return torch.full(index.shape, -1, dtype=torch.int64, device=index.device)
        gen = gen.to(index.device)
        valid = (index >= 0) & (index < gen.numel())
        return torch.where(valid, gen[index.clamp(0, gen.numel() - 1)], -1)

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count)
        gen = self._generation
        if gen is not None:
            gen[gen >= 0] += 1  # every handle held on the emptied slots goes stale

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        gen = self._generation
        if self._track_generations and gen is not None:
            sd["_generation"] = gen.clone()
        return sd

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("_generation") is not None:
            self._generation = torch.as_tensor(state_dict["_generation"]).clone()

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(exist_ok=True)
        meta = {"cursor": self._cursor, "write_count": self._write_count}
        gen = self._generation
        if self._track_generations and gen is not None:
            file = path / "generation.memmap"
            if file.exists():
                file.unlink()
            MemoryMappedTensor.from_tensor(gen.cpu(), filename=file)
            meta.update(generation_shape=list(gen.shape), generation_dtype=str(gen.dtype))
        with open(path / "metadata.json", "w") as f:
            json.dump(meta, f)

    def loads(self, path) -> None:
        super().loads(path)
        meta = _read_json(Path(path) / "metadata.json")
        if meta.get("generation_shape") is not None:
            gen = MemoryMappedTensor.from_filename(
                filename=Path(path) / "generation.memmap",
                dtype=torch.int64,
                shape=torch.Size(meta["generation_shape"]),
            ).clone()
            self._generation = gen if self._storage is None else gen.to(_device(self._storage))


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """TorchRL's ``TensorDictRoundRobinWriter``: also writes each item's slot under
    ``"index"`` in the data before storing it.

    Args:
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      track_generations: as in :class:`RoundRobinWriter`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, TensorDictReplayBuffer,
        ...                                     TensorDictRoundRobinWriter)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(4),
        ...                             writer=TensorDictRoundRobinWriter())
        >>> index = rb.extend(TensorDict({"obs": torch.zeros(3)}, [3]))
        >>> rb[:]["index"].tolist()
        [0, 1, 2]
    """

    def _prepare(self, data, index) -> None:
        if is_tensorclass(data) or not D.is_tc(data):
            return
        idx = torch.as_tensor(index, dtype=torch.long, device=data.device)
        data.set("index", D.expand_leading(idx, data.shape) if idx.ndim else idx.expand(data.shape))
