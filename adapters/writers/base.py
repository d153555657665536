"""The writers' base: TorchRL's ``Writer`` protocol, where new items go.

A writer stands alone, as TorchRL's do: ``register_storage(storage)``, then ``add(item)`` /
``extend(batch)`` write into that storage and return the indices written; ``state_dict``,
``dumps`` / ``loads`` keep TorchRL's formats. :class:`TensorDictMaxValueWriter` keeps its ranks
in the functional core (``frb.MaxValueWriter``: one jitted top-k per ``extend``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["Writer"]


class Writer:
    """Base of the writers (TorchRL's ``Writer`` protocol): where ``extend`` puts new items.

    Args:
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.

    Example:
        >>> from functional_rb.adapters import RoundRobinWriter, Writer
        >>> isinstance(RoundRobinWriter(), Writer)
        True
    """

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
            raise RuntimeError(
                f"{type(self).__name__}.{what}: no storage registered; call "
                "writer.register_storage(storage) or give the writer to a buffer."
            )
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
        mesh = torch.stack(
            torch.meshgrid(*(torch.arange(d) for d in shape), indexing="ij"), -1
        ).reshape(-1, len(shape))
        if isinstance(index, int):
            return torch.cat([torch.full((mesh.shape[0], 1), index, dtype=torch.long), mesh], 1)
        index = index.reshape(-1).cpu()
        return torch.cat(
            [index.repeat_interleave(mesh.shape[0]).unsqueeze(1), mesh.repeat(index.numel(), 1)], 1
        )

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
