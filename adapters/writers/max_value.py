"""TorchRL's ``TensorDictMaxValueWriter``: keeps the highest-ranked items; the ranks live in
the functional core (``frb.MaxValueWriter``: one jitted top-k per ``extend``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor
from tensordict.utils import NestedKey

import functional_rb as frb
from functional_rb._internal.lazy import lazy_module
from functional_rb.adapters._utils import data as D
from functional_rb.adapters.writers.base import Writer, _read_json

_core = lazy_module("functional_rb.adapters._utils.core")  # the core writer's glue (JAX)

__all__ = ["TensorDictMaxValueWriter"]


_REDUCTIONS = {
    "sum": lambda x: x.sum(-1),
    "mean": lambda x: x.mean(-1),
    "max": lambda x: x.amax(-1),
    "min": lambda x: x.amin(-1),
    "median": lambda x: x.median(-1).values,
}


class TensorDictMaxValueWriter(Writer):
    """Keeps the ``max_size`` highest-ranked items (TorchRL's ``TensorDictMaxValueWriter``).

    While free slots remain, items fill them in order; then an item replaces the lowest-ranked
    stored item when its rank is strictly greater. ``extend`` returns each item's slot, -1 for
    items not kept. The ranks live in the JAX core (``frb.MaxValueWriter``: one jitted top-k
    per ``extend``).

    Args:
      rank_key: the entry ranking an item (default ``("next", "reward")``).
      reduction: how a rank with more than one element is reduced (``"sum"``, ``"mean"``,
        ``"max"``, ``"min"`` or ``"median"``).
      **kwargs: the arguments of :class:`Writer` (``compilable``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, TensorDictMaxValueWriter,
        ...                                     TensorDictReplayBuffer)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(2),
        ...                             writer=TensorDictMaxValueWriter(rank_key="score"))
        >>> index = rb.extend(TensorDict({"score": torch.tensor([1.0, 5.0, 3.0])}, [3]))
        >>> sorted(rb[:]["score"].tolist())
        [3.0, 5.0]
    """

    def __init__(self, rank_key: NestedKey | None = None, reduction: str = "sum", **kwargs):
        super().__init__(**kwargs)
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"TensorDictMaxValueWriter: reduction must be one of "
                f"{sorted(_REDUCTIONS)}, got {reduction!r}."
            )
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
            raise RuntimeError(
                f"{type(self)} expects data to be a tensor collection (tensordict "
                f"or tensorclass). Found a {type(data)} instead."
            )
        if data.batch_dims > 1:
            raise RuntimeError(
                "Expected input tensordict to have no more than 1 dimension, got "
                f"tensordict.batch_size = {data.batch_size}"
            )
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
        positions, mask, self._state = _core.write(self._core, layout, self._state, {"rank": ranks})
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
                "storage, or reduce each trajectory to one item."
            )
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
            raise RuntimeError(
                "TensorDictMaxValueWriter.loads: the stored slots are not "
                f"0..{len(slots) - 1} (got {slots[:8]}...); the dump is damaged."
            )
        for r, i in top:
            ranks[int(i)] = r
        self._state = _core.max_value_state(cursor % layout.capacity, len(top), ranks)
        self._cursor = int(cursor)

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count)
        self._state = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "_cursor": self._cursor,
            "_write_count": self._write_count,
            "_current_top_values": self.top_values(),
            "_rank_key": self._rank_key,
        }

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
            json.dump(
                {
                    "cursor": self._cursor,
                    "write_count": self._write_count,
                    "rank_key": list(key) if isinstance(key, tuple) else key,
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                },
                f,
            )

    def loads(self, path) -> None:
        path = Path(path).absolute()
        meta = _read_json(path / "metadata.json")
        if meta.get("write_count") is not None:
            self._write_count = int(meta["write_count"])
        key = meta["rank_key"]
        self._rank_key = tuple(key) if isinstance(key, list) else key
        shape = torch.Size(meta["shape"])
        dtype = getattr(torch, str(meta["dtype"]).replace("torch.", ""))
        top = MemoryMappedTensor.from_filename(
            filename=path / "current_top_values.memmap", dtype=dtype, shape=shape
        ).tolist()
        self._set_top_values(
            [(r, int(i)) for r, i in top] if shape.numel() else [], int(meta["cursor"])
        )

    def __getstate__(self):
        import multiprocessing.context as mpc

        if mpc.get_spawning_popen() is not None:
            raise RuntimeError(
                f"Writers of type {type(self).__name__} cannot be shared between "
                "processes: the ranks that decide where items go live in this "
                "process. Use RoundRobinWriter with LazyMemmapStorage to fill a "
                "buffer from several processes."
            )
        return super().__getstate__()

    def __repr__(self):
        full = self._storage is not None and self._storage.is_full
        return (
            f"{type(self).__name__}(cursor={int(self._cursor)}, full_storage={full}, "
            f"rank_key={self._rank_key}, reduction={self._reduction})"
        )
