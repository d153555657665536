"""Writers under TorchRL's names: where new items go.

A writer stands alone, as TorchRL's do: ``register_storage(storage)``, then ``add(item)`` /
``extend(batch)`` write into that storage and return the indices written; ``state_dict``,
``dumps`` / ``loads`` keep TorchRL's formats. :class:`TensorDictMaxValueWriter` keeps its ranks
in the functional core (``frb.MaxValueWriter``: one jitted top-k per ``extend``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor, is_tensorclass

import functional_rb as frb
from functional_rb.adapters import _core
from functional_rb.adapters import _data as D

__all__ = ["Writer", "RoundRobinWriter", "TensorDictRoundRobinWriter",
           "TensorDictMaxValueWriter", "ImmutableDatasetWriter", "WriterEnsemble"]


class Writer:
    """Base of the writers (TorchRL's ``Writer`` protocol)."""

    tracks_generations = False

    def __init__(self, compilable: bool = False):
        self._storage = None
        self._compilable = compilable
        self._cursor = 0
        self._write_count = 0
        self.rng = None

    @property
    def storage(self):
        return self._storage

    def register_storage(self, storage) -> None:
        self._storage = storage

    def _need_storage(self, what: str):
        if self._storage is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: no storage registered; call "
                               "writer.register_storage(storage) or give the writer to a buffer.")
        return self._storage

    @property
    def write_count(self) -> int:
        """Items (``ndim > 1``: dim-0 steps) written so far; with a storage shared by several
        processes, by all of them."""
        shared = None if self._storage is None else self._storage.reserved
        return self._write_count if shared is None else max(shared, self._write_count)

    def generations_of(self, index) -> torch.Tensor:
        """Generation stamps of dim-0 slots (-1: this writer does not track them)."""
        index = torch.as_tensor(index)
        return torch.full(index.shape, -1, dtype=torch.int64, device=index.device)

    def replicate_index(self, index):
        """Dim-0 slots as TorchRL returns them: for ``ndim > 1`` one ``(t, *inner)`` row per
        element, ``[n * inner_numel, ndim]``."""
        st = self._storage
        if st.ndim == 1:
            return index
        shape = st.shape[1:]
        mesh = torch.stack(torch.meshgrid(*(torch.arange(d) for d in shape), indexing="ij"),
                           -1).reshape(-1, len(shape))
        if isinstance(index, int):
            return torch.cat([torch.full((mesh.shape[0], 1), index, dtype=torch.long), mesh], 1)
        index = index.reshape(-1).cpu()
        return torch.cat([index.repeat_interleave(mesh.shape[0]).unsqueeze(1),
                          mesh.repeat(index.numel(), 1)], 1)

    _replicate_index = replicate_index  # TorchRL's name

    def _notify(self, index) -> None:
        self._storage.mark_update(index)

    def state_dict(self) -> dict[str, Any]:
        return {"_cursor": self._cursor, "_write_count": self._write_count}

    def load_state_dict(self, state_dict) -> None:
        self._cursor = int(state_dict["_cursor"])
        if state_dict.get("_write_count") is not None:
            self._write_count = int(state_dict["_write_count"])
        self._after_load()

    def _after_load(self) -> None:
        if self._storage is not None:
            self._storage.align_count(self._cursor)

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(exist_ok=True)
        with open(path / "metadata.json", "w") as f:
            json.dump({"cursor": self._cursor, "write_count": self._write_count}, f)

    def loads(self, path) -> None:
        meta = _read_json(Path(path) / "metadata.json")
        self._cursor = int(meta["cursor"])
        if meta.get("write_count") is not None:
            self._write_count = int(meta["write_count"])
        self._after_load()

    def empty(self, empty_write_count: bool = True) -> None:
        """Restart at slot 0 (TorchRL's ``_empty``)."""
        self._empty(empty_write_count)

    def _empty(self, empty_write_count: bool = True) -> None:
        self._cursor = 0
        if empty_write_count:
            self._write_count = 0

    def __getstate__(self):
        state = self.__dict__.copy()
        state["rng"] = None
        return state

    def __repr__(self):
        full = self._storage is not None and self._storage.is_full
        return f"{type(self).__name__}(cursor={int(self._cursor)}, full_storage={full})"


def _read_json(file: Path) -> dict:
    try:
        return json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} does not exist: not a writer dump.") from None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{file} is damaged (not valid JSON: {e}).") from None


class RoundRobinWriter(Writer):
    """A FIFO ring along dim 0 (TorchRL's ``RoundRobinWriter``).

    ``extend`` of ``n`` items writes slots ``(cursor + arange(n)) % rows``; a batch larger than
    the ring keeps its last ``rows`` items. With a storage that coordinates several processes
    (a :class:`~functional_rb.adapters.LazyMemmapStorage`), the slots are reserved from it, so
    concurrent writers never share a slot. ``track_generations=True`` stamps each slot with the
    number of times it was written (:meth:`generations_of`).
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
    def _bump_generation(self, index: torch.Tensor) -> None:
        # generations live on the storage: a writer that does not track them still bumps them
        # when another writer of the same storage does, so that writer's handles go stale
        if not self._track_generations and self._storage.slot_generations is None:
            return
        gen = self._storage.slot_generations
        rows = self._storage.max_size_along_dim0()
        if gen is None or gen.numel() < rows:
            new = torch.full((rows,), -1, dtype=torch.int64)
            if gen is not None:
                new[:gen.numel()] = gen
            gen = new
        index = index.reshape(-1).cpu()
        gen.index_put_((index,), torch.ones_like(index), accumulate=True)
        self._storage.slot_generations = gen

    def generations_of(self, index) -> torch.Tensor:
        if not self._track_generations:
            return super().generations_of(index)
        if isinstance(index, tuple):
            index = index[0]
        index = torch.as_tensor(index, dtype=torch.long)
        if self._storage is not None and self._storage.ndim > 1 and index.ndim >= 2 and \
                index.shape[-1] == self._storage.ndim:
            index = index[..., 0]
        gen = None if self._storage is None else self._storage.slot_generations
        if gen is None or gen.numel() == 0:
            return torch.full(index.shape, -1, dtype=torch.int64)
        valid = (index >= 0) & (index < gen.numel())
        return torch.where(valid, gen[index.clamp(0, gen.numel() - 1)], -1)

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count)
        gen = None if self._storage is None else self._storage.slot_generations
        if gen is not None:
            gen[gen >= 0] += 1  # every handle held on the emptied slots goes stale

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        gen = None if self._storage is None else self._storage.slot_generations
        if self._track_generations and gen is not None:
            sd["_generation"] = gen.clone()
        return sd

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("_generation") is not None and self._storage is not None:
            self._storage.slot_generations = state_dict["_generation"].clone()

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(exist_ok=True)
        meta = {"cursor": self._cursor, "write_count": self._write_count}
        gen = None if self._storage is None else self._storage.slot_generations
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
        if meta.get("generation_shape") is not None and self._storage is not None:
            gen = MemoryMappedTensor.from_filename(
                filename=Path(path) / "generation.memmap", dtype=torch.int64,
                shape=torch.Size(meta["generation_shape"])).clone()
            self._storage.slot_generations = gen


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """TorchRL's ``TensorDictRoundRobinWriter``: also writes each item's slot under
    ``"index"`` in the data before storing it."""

    def _prepare(self, data, index) -> None:
        if is_tensorclass(data) or not D.is_tc(data):
            return
        idx = torch.as_tensor(index, dtype=torch.long, device=data.device)
        data.set("index", D.expand_leading(idx, data.shape) if idx.ndim else
                 idx.expand(data.shape))


_REDUCTIONS = {"sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1),
               "max": lambda x: x.amax(-1), "min": lambda x: x.amin(-1),
               "median": lambda x: x.median(-1).values}


class TensorDictMaxValueWriter(Writer):
    """Keeps the ``max_size`` highest-ranked items (TorchRL's ``TensorDictMaxValueWriter``).

    ``rank_key`` (default ``("next", "reward")``) ranks an item; a rank with more than one
    element is reduced with ``reduction`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or
    ``"median"``). While free slots remain, items fill them in order; then an item replaces
    the lowest-ranked stored item when its rank is strictly greater. ``extend`` returns each
    item's slot, -1 for items not kept. The ranks live in the core (``frb.MaxValueWriter``).
    """

    def __init__(self, rank_key=None, reduction: str = "sum", **kwargs):
        super().__init__(**kwargs)
        if reduction not in _REDUCTIONS:
            raise ValueError(f"TensorDictMaxValueWriter: reduction must be one of "
                             f"{sorted(_REDUCTIONS)}, got {reduction!r}.")
        self._rank_key = ("next", "reward") if rank_key is None else rank_key
        self._reduction = reduction
        self._core = frb.MaxValueWriter(rank_key="rank", reduction="sum")
        self._state = None  # core MaxValueState, built at the first write
        self._pending_top = None  # (heap, cursor) loaded before a storage was registered

    @property
    def rank_key(self):
        return self._rank_key

    @property
    def reduction(self) -> str:
        return self._reduction

    def _layout(self):
        return _core.make_layout(self._need_storage("extend").max_size)

    def _ranks(self, data) -> np.ndarray:
        if not D.is_tc(data):
            raise RuntimeError(f"{type(self)} expects data to be a tensor collection (tensordict "
                               f"or tensorclass). Found a {type(data)} instead.")
        if data.batch_dims > 1:
            raise RuntimeError("Expected input tensordict to have no more than 1 dimension, got "
                               f"tensordict.batch_size = {data.batch_size}")
        rank = data.get(self._rank_key, None)
        if rank is None:
            raise KeyError(f"Rank key {self._rank_key} not found in data.")
        rank = rank.detach().reshape(data.shape[0], -1).to(torch.float64)
        return _REDUCTIONS[self._reduction](rank).to(torch.float32).cpu().numpy()

    def _write(self, data):
        """``(positions, mask)`` numpy of the core top-k for ``data`` ``[B]``."""
        ranks = self._ranks(data)
        layout = self._layout()
        if self._state is None:
            self._state = _core.init_writer(self._core, layout)
        positions, mask, self._state = _core.write(self._core, layout, self._state,
                                                   {"rank": ranks})
        self._cursor = int(self._state.cursor)
        return np.asarray(positions), np.asarray(mask)

    def extend(self, data):
        if not D.is_tc(data):
            self._ranks(data)  # raises TorchRL's error for non-TensorDict data
        positions, mask = self._write(data)
        out = torch.full(data.shape[:1], -1, dtype=torch.long, device=data.device)
        if mask.any():
            sel = np.flatnonzero(mask)
            sel = sel[np.argsort(positions[sel], kind="stable")]  # a list storage grows in order
            slots = torch.from_numpy(positions[sel].astype(np.int64))
            sel = torch.from_numpy(sel)
            out[sel.to(out.device)] = slots.to(out.device)
            self._write_count += int(mask.sum())
            self._storage.set(slots, data[sel])
        self._notify(out)
        return out

    def add(self, data):
        if not D.is_tc(data):
            self._ranks(data)  # raises TorchRL's error for non-TensorDict data
        positions, mask = self._write(data.unsqueeze(0))
        if not mask[0]:
            return None
        index = int(positions[0])
        data.set("index", torch.tensor(index, device=data.device))
        self._write_count += 1
        self._storage.set(index, data)
        self._notify(index)
        return index

    def top_values(self) -> list:
        """``[(rank, slot)]`` of the stored items, lowest rank first (a valid min-heap, the
        order TorchRL's writer keeps)."""
        if self._state is None:
            return []
        filled = int(self._state.filled)
        ranks = np.asarray(self._state.ranks)[:filled]
        order = np.argsort(ranks, kind="stable")
        return [(float(ranks[i]), int(i)) for i in order]

    @property
    def _current_top_values(self) -> list:  # TorchRL's name for the heap
        return self.top_values() if self._pending_top is None else list(self._pending_top[0])

    def register_storage(self, storage) -> None:
        if storage.ndim > 1:
            raise ValueError(
                "TensorDictMaxValueWriter is not compatible with storages with more than one "
                "dimension: ranks compare whole items, and an [env, time] storage mixes "
                "overlapping trajectories. Flatten the data (data.reshape(-1)) into an ndim=1 "
                "storage, or reduce each trajectory to one item.")
        super().register_storage(storage)
        if self._pending_top is not None:
            self._set_top_values(*self._pending_top)

    def _set_top_values(self, top: list, cursor: int) -> None:
        if self._storage is None:  # loaded before a storage was registered: kept until then
            self._pending_top = (sorted(top), cursor)
            self._cursor = int(cursor)
            return
        self._pending_top = None
        layout = self._layout()
        ranks = np.full(layout.capacity, -np.inf, np.float32)
        slots = sorted(int(i) for _, i in top)
        if slots != list(range(len(slots))):
            raise RuntimeError("TensorDictMaxValueWriter.loads: the stored slots are not "
                               f"0..{len(slots) - 1} (got {slots[:8]}...); the dump is damaged.")
        for r, i in top:
            ranks[int(i)] = r
        self._state = _core.max_value_state(cursor % layout.capacity, len(top), ranks)
        self._cursor = int(cursor)

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count)
        self._state = None

    def state_dict(self) -> dict[str, Any]:
        return {"_cursor": self._cursor, "_write_count": self._write_count,
                "_current_top_values": self.top_values(), "_rank_key": self._rank_key}

    def load_state_dict(self, state_dict) -> None:
        self._write_count = int(state_dict.get("_write_count", 0))
        self._rank_key = state_dict.get("_rank_key", self._rank_key)
        self._set_top_values(list(state_dict["_current_top_values"]), int(state_dict["_cursor"]))

    def dumps(self, path) -> None:
        path = Path(path).absolute()
        path.mkdir(exist_ok=True)
        t = torch.as_tensor(self.top_values(), dtype=torch.float32)
        file = path / "current_top_values.memmap"
        if file.exists():
            file.unlink()
        MemoryMappedTensor.from_tensor(t, filename=file)
        key = self._rank_key
        with open(path / "metadata.json", "w") as f:
            json.dump({"cursor": self._cursor, "write_count": self._write_count,
                       "rank_key": list(key) if isinstance(key, tuple) else key,
                       "dtype": str(t.dtype), "shape": list(t.shape)}, f)

    def loads(self, path) -> None:
        path = Path(path).absolute()
        meta = _read_json(path / "metadata.json")
        if meta.get("write_count") is not None:
            self._write_count = int(meta["write_count"])
        key = meta["rank_key"]
        self._rank_key = tuple(key) if isinstance(key, list) else key
        shape = torch.Size(meta["shape"])
        dtype = getattr(torch, str(meta["dtype"]).replace("torch.", ""))
        top = MemoryMappedTensor.from_filename(filename=path / "current_top_values.memmap",
                                               dtype=dtype, shape=shape).tolist()
        self._set_top_values([(r, int(i)) for r, i in top] if shape.numel() else [],
                             int(meta["cursor"]))

    def __getstate__(self):
        import multiprocessing.context as mpc
        if mpc.get_spawning_popen() is not None:
            raise RuntimeError(f"Writers of type {type(self).__name__} cannot be shared between "
                               "processes: the ranks that decide where items go live in this "
                               "process. Use RoundRobinWriter with LazyMemmapStorage to fill a "
                               "buffer from several processes.")
        return super().__getstate__()

    def __repr__(self):
        full = self._storage is not None and self._storage.is_full
        return (f"{type(self).__name__}(cursor={int(self._cursor)}, full_storage={full}, "
                f"rank_key={self._rank_key}, reduction={self._reduction})")


class ImmutableDatasetWriter(Writer):
    """A read-only buffer (TorchRL's ``ImmutableDatasetWriter``): writes raise."""

    WRITING_ERR = ("This dataset doesn't allow writing: the buffer is read-only "
                   "(ImmutableDatasetWriter).")

    def add(self, data):
        raise RuntimeError(self.WRITING_ERR)

    def extend(self, data):
        raise RuntimeError(self.WRITING_ERR)

    def write_at(self, index, data):
        raise RuntimeError(self.WRITING_ERR)

    def _empty(self, empty_write_count: bool = True) -> None:
        raise RuntimeError(self.WRITING_ERR)

    def dumps(self, path) -> None:
        del path

    def loads(self, path) -> None:
        del path

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict) -> None:
        del state_dict


def __getattr__(name):
    # Its module imports the storages and samplers (which may import this one): bound on use.
    if name == "WriterEnsemble":
        from functional_rb.adapters._ensemble_parts import WriterEnsemble
        return WriterEnsemble
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
