"""Priority updates that cannot land on a newer item, for the adapters' prioritized buffers.

TorchRL's ``update_priority(index, priority)`` carries bare storage indices. Between the
``sample`` that produced them and the update (the learner's forward and backward pass, or
longer with a delayed or asynchronous learner), a ring writer may put a newer item into one of
those slots; the update would then give the newer item the older one's priority
(pytorch/rl#4041). The buffer therefore keeps, on the host, per flat sampler position:

* ``written``: the event count of the last write into the slot (this process's ``add`` /
  ``extend``, and ``empty``);
* ``drawn``: the event count of the latest ``sample`` that drew it (0: never drawn).

An entry of ``update_priority`` is **dropped** when its slot was drawn and then rewritten
(``0 < drawn < written``): the sample it came from held an item that is gone. Dropped entries
are counted (:attr:`StalePriorities.dropped`, the buffer's ``dropped_priority_updates``).
Entries of slots never drawn are applied (indices that did not come from a sample, e.g. the
priorities ``extend`` reads from ``priority_key``, which are written unchecked).

The closest sound reading for bare indices: a slot drawn again after its rewrite is applied,
since the latest draw holds the item it now stores and the indices cannot say which sample
they came from. Writes made by other processes to a shared storage are not seen here.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from functional_rb.adapters.samplers.base import ravel

__all__ = ["StalePriorities"]


class StalePriorities:
    """The host record of writes and draws of one prioritized buffer (see the module)."""

    def __init__(self):
        self.clock = 0
        self.written = np.zeros(0, np.int64)
        self.drawn = np.zeros(0, np.int64)
        self.dropped = 0
        self._checking = True

    def _flat(self, index, storage) -> np.ndarray:
        """Flat sampler positions (int64 ``[N]``) of TorchRL-style indices; -1 kept."""
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, dtype=torch.long).detach().cpu()
        if (
            storage is not None
            and storage.ndim > 1
            and index.ndim > 1
            and index.shape[-1] == storage.ndim
        ):
            index = ravel(index, tuple(storage.shape))
        flat = index.reshape(-1).numpy()
        need = int(flat.max()) + 1 if flat.size else 0
        if need > self.written.size:
            grow = need - self.written.size
            self.written = np.concatenate([self.written, np.zeros(grow, np.int64)])
            self.drawn = np.concatenate([self.drawn, np.zeros(grow, np.int64)])
        return flat

    def on_write(self, index, storage) -> None:
        flat = self._flat(index, storage)
        self.clock += 1
        self.written[flat[flat >= 0]] = self.clock

    def on_draw(self, index, storage) -> None:
        flat = self._flat(index, storage)
        self.clock += 1
        self.drawn[flat[flat >= 0]] = self.clock

    def on_empty(self) -> None:
        self.clock += 1
        self.written[:] = self.clock

    @contextlib.contextmanager
    def unchecked(self):
        """Updates within the block are applied whatever was drawn (``extend``'s own)."""
        before, self._checking = self._checking, False
        try:
            yield
        finally:
            self._checking = before

    def keep(self, index, storage) -> np.ndarray | None:
        """bool ``[N]`` (the flat order of ``index``): entries to apply; the others are
        counted as dropped. None when every entry is applied."""
        if not self._checking:
            return None
        flat = self._flat(index, storage)
        pos = np.where(flat >= 0, flat, 0)
        stale = (flat >= 0) & (self.drawn[pos] > 0) & (self.written[pos] > self.drawn[pos])
        if not stale.any():
            return None
        self.dropped += int(stale.sum())
        return ~stale

    def fresh(self, index, priority: torch.Tensor, storage):
        """``(index, priority)`` of an ``update_priority`` without the entries of rewritten
        slots (``(None, None)``: none left)."""
        keep = self.keep(index, storage)
        if keep is None:
            return index, priority
        index = torch.as_tensor(index, dtype=torch.long)
        rows = (
            index.reshape(-1, index.shape[-1])
            if (storage.ndim > 1 and index.ndim > 1 and index.shape[-1] == storage.ndim)
            else index.reshape(-1)
        )
        if priority.numel() > 1:
            priority = priority.reshape(-1)[torch.from_numpy(keep)]
        if not keep.any():
            return None, None
        return rows[torch.from_numpy(keep)], priority
