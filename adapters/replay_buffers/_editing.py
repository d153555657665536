"""Reading and writing a buffer's stored items in place, in storage order (TorchRL's
``read_all_in_order``, ``write_all``, ``set_``, ``set_at_``, ``update_``, ``rb[i, j] =
value``), conditional updates (``update_if_present``) and TorchRL's in-process service API:
mixins of :class:`~functional_rb.adapters.ReplayBuffer`, through its public surface
(``storage``, ``lock``, ``__getitem__`` / ``__setitem__``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from tensordict import is_tensor_collection

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.replay_buffers.conditional import update_if_present
from functional_rb.adapters.samplers.base import unravel

__all__ = ["DirectService", "InPlace", "set_multi"]


class InPlace:
    """In-place edits of the stored items."""

    def read_all_in_order(self, end: int | None = None):
        """The stored items in storage order (``rb[:end]``)."""
        return self[:] if end is None else self[:end]

    def write_all(self, data, end: int | None = None) -> None:
        """Write ``data`` back in storage order (``rb[:end] = data``)."""
        if end is None:
            if len(self) == self.storage.max_size:
                self[:] = data
                return
            end = data.shape[0] if is_tensor_collection(data) else len(data)
        self[:end] = data

    def _edit_all(self, edit):
        with self.lock:
            edit(self.storage[:])
            self.storage.touched()
        return self

    def set_at_(self, key, value, index):
        """Set entry ``key`` of the items at ``index`` in place."""
        return self._edit_all(lambda td: td.set_at_(key, value, D.as_long_index(index)))

    def set_(self, key, value):
        """Set entry ``key`` of every stored item in place."""
        return self._edit_all(lambda td: td.set_(key, value))

    def update_(self, input_dict_or_td, clone: bool = False, *, keys_to_update=None):
        """Update the stored items in place from a dict or TensorDict."""
        return self._edit_all(
            lambda td: td.update_(input_dict_or_td, clone=clone, keys_to_update=keys_to_update)
        )

    # ------------------------------------------------------------------ generations
    def update_if_present(
        self,
        *,
        index,
        generation,
        patch,
        version_key=None,
        version=None,
        require_newer: bool = False,
    ):
        """Patch the records at ``index`` whose slot still holds the ``generation`` they were
        sampled with (TorchRL's generation API; needs ``RoundRobinWriter(
        track_generations=True)``). Returns a :class:`ConditionalUpdateResult`."""
        self.synchronize()
        return update_if_present(
            self,
            index=index,
            generation=generation,
            patch=patch,
            version_key=version_key,
            version=version,
            require_newer=require_newer,
        )

    def submit_update_if_present(self, **kwargs):
        """:meth:`update_if_present` on a background thread, in submission order; samples
        drawn after this call see it. Returns a ``concurrent.futures.Future``."""
        if self._updater is None:
            self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frb-update")
        fut = self._updater.submit(update_if_present, self, **kwargs)
        self._pending.append(fut)
        return fut

    def wait_updates(self) -> None:
        """Wait for the updates :meth:`submit_update_if_present` queued."""
        while self._pending:
            self._pending.pop(0).result()


def set_multi(storage, dim_extend: int, index: tuple, value, name: str) -> None:
    """``rb[i, j] = value`` over the stored items seen as ``rb[:]`` (TorchRL's view), the
    value broadcast to the selection; the caller holds the buffer's lock."""
    shape = storage.shape
    if shape is None:
        raise RuntimeError(f"{name}[{index!r}] = ...: the storage is empty.")
    grid = torch.arange(shape.numel()).reshape(shape)
    flat = D.transpose(grid, dim_extend)[index]
    if is_tensor_collection(value) and tuple(value.batch_size) != tuple(flat.shape):
        value = value.expand(flat.shape)
    elif not is_tensor_collection(value) and tuple(value.shape[: flat.ndim]) != tuple(flat.shape):
        raise ValueError(
            f"{name}[{index!r}] = value: the selection has "
            f"shape {tuple(flat.shape)}, the value {tuple(value.shape)}; give a "
            "value whose leading dims match it (or a TensorDict to broadcast)."
        )
    value = (
        value.reshape(-1)
        if is_tensor_collection(value)
        else value.reshape(-1, *value.shape[flat.ndim :])
    )
    storage[unravel(flat.reshape(-1), shape)] = value


class DirectService:
    """TorchRL's service API for the in-process ("direct") backend: the buffer is its own
    client."""

    service_backend = "direct"
    is_alive = property(lambda self: not getattr(self, "_shut", False))

    def client(self):
        return self

    def start(self):
        return self

    def shutdown(self, timeout=None) -> None:
        self._shut = True
