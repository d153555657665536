"""Sharing a :class:`~functional_rb.adapters.LazyTensorStorage` between processes, as TorchRL
does: its tensors are moved to shared memory when it is handed to another process.

When: a storage holding data is pickled by ``multiprocessing``'s ``ForkingPickler`` (the
arguments of a spawned ``Process``, a ``Queue``, a ``Pipe``: what ``torch.multiprocessing``
moves tensors to shared memory for), or the process forks while one of the buffers reading the
storage is ``share(True)``-ed (a fork copies memory, it pickles nothing, so the data is moved
just before). :meth:`InSharedMemory.share_memory_` then moves each tensor's memory to shared memory in place (every
view of it follows) and opens a :class:`SharedCursor` in a temporary directory, removed with the
storage by the process that created it. From then on the storage is a
:class:`~functional_rb.adapters.storages._shared_ring.SharedRing` like a ``LazyMemmapStorage``:
writers reserve disjoint slots, the length and the mutation revision count every process's
writes.

What cannot be shared, and is then a copy that refuses writes (``Storage._check_home``): a
storage with no data yet (its shapes are unknown; sending it to a spawned process raises, as
TorchRL's "Cowardly refusing" does), a storage on a device that has no shared memory, and one
forked while no buffer reading it was shared.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from multiprocessing.context import get_spawning_popen

import torch

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.storages import _cleanup
from functional_rb.adapters.storages._hugepages import advise_tensors

__all__ = ["InSharedMemory", "SHARE_FIX"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's LazyTensorStorages

SHARE_FIX = (
    "Share it before the workers start: extend it once in this process, then pass the buffer "
    "to them as a Process argument or through a queue (its tensors then move to shared "
    "memory), or call rb.share(True) (or storage.share_memory_()) before forking; or use "
    "LazyMemmapStorage, or LazyTensorStorage(max_size, shared_init=True), which any process "
    "may initialize."
)

_NOT_INITIALIZED = (
    "Cowardly refusing to share a storage of type {name} between processes: it has not been "
    "initialized yet (it holds no data, so its shapes are unknown). Either extend the buffer "
    "once in this process before passing it to the other processes, or build the storage with "
    "shared_init=True so that any process may initialize it."
)

_DEVICE = (
    "{name}.share_memory_: its data is on {device}, which has no memory processes can share. "
    "Keep the storage on the CPU (move samples with buffer.append_transform(lambda x: "
    "x.to(device))), or use a CUDA device."
)


def _device_ok(device) -> bool:
    return device != "auto" and torch.device(device).type in ("cpu", "cuda")


class InSharedMemory:
    """Mixin of :class:`~functional_rb.adapters.LazyTensorStorage` (over
    :class:`~functional_rb.adapters.storages._shared_ring.SharedRing`): its data moved to shared
    memory and its ring coordinated across processes, when it is handed to another one."""

    def _memory_init(self) -> None:
        self._share_dir = None  # the shared cursor's directory (once shared)
        self._share_finalizer = None  # removes it when this (the owner's) storage goes away
        _LIVE.add(self)  # so that a fork shares it when one of its buffers is

    def _cursor_path(self) -> str:
        return os.path.join(self._share_dir, "cursor.bin")

    def _share_fix(self) -> str:
        return SHARE_FIX

    def share_memory_(self):
        """Move the data to shared memory and coordinate the ring across processes (what
        handing the storage to another process does); returns the storage. The storage must
        hold data (its shapes are those of the first write) on the CPU or a CUDA device."""
        if self.shares_writes:
            return self
        self._check_home("share_memory_")
        name = type(self).__name__
        if not self.initialized:
            raise RuntimeError(_NOT_INITIALIZED.format(name=name))
        if not _device_ok(self.device):
            raise RuntimeError(_DEVICE.format(name=name, device=self.device))
        data = self.data
        if isinstance(data, torch.Tensor) or D.is_tc(data):
            data.share_memory_()
        else:
            D.tree_map(lambda x: x.share_memory_(), data)
        # new memory, copied into: huge pages only where /dev/shm can give them
        advise_tensors(data, shared=True)
        rows, held = self.max_size_along_dim0(), self.len_along_dim0
        # the ring's step count, so that the next reserved slot is where this process's
        # writer goes next (a full ring: one lap plus the writer's position)
        steps = held if held < rows else rows + self.next_row() % rows
        self._share_dir = tempfile.mkdtemp(prefix="frb_shared_tensor_")
        self._share_finalizer = weakref.finalize(
            self, _cleanup.remove_dir, self._share_dir, os.getpid()
        )
        self._open_cursor(reset=True)
        self._reset_count(steps)
        self._shared_base = steps  # the buffers of this process were told of these already
        return self

    def _before_sending(self) -> None:
        """About to be pickled by ``ForkingPickler`` for another process: shared first when it
        can be; else (nothing to share yet, another device) the other process gets a copy that
        refuses writes, or, for a spawned process's arguments and a storage with no data yet,
        TorchRL's error."""
        if self.shares_writes or self._home_pid != os.getpid():
            return
        if self.initialized and _device_ok(self.device):
            self.share_memory_()
        elif get_spawning_popen() is not None and not self.initialized:
            raise RuntimeError(_NOT_INITIALIZED.format(name=type(self).__name__))

    def _detached_state(self, state: dict) -> dict:
        """``state`` of a shared storage as a copy of its own: the length, the revision and
        the writer's position as this process sees them, no cursor."""
        state["_share_finalizer"] = None
        if state.get("_cursor") is None:
            return state
        rows = self.max_size_along_dim0()
        state.update(
            _cursor=None,
            _share_dir=None,
            _shared_base=0,
            _len=len(self),
            _local_revision=self.revision,
        )
        if self.len_along_dim0:
            state["last_cursor"] = (self.next_row() - 1) % rows
        return state

    def _share_before_fork(self) -> None:
        """Shares this storage when one of its buffers is shared (a forked child then writes
        to the same memory). CUDA memory does not survive a fork."""
        if (
            self.shares_writes
            or self._home_pid != os.getpid()
            or not self.initialized
            or not _device_ok(self.device)
            or torch.device(self.device).type != "cpu"
        ):
            return
        if any(getattr(rb, "shared", False) for rb in self.attached):
            self.share_memory_()


def _share_before_fork() -> None:
    """Before a fork: share the storages one of whose buffers is shared. An error leaves the
    storage unshared: the child's writes then raise rather than being lost."""
    for storage in list(_LIVE):
        try:
            storage._share_before_fork()
        except Exception:  # (a fork hook cannot raise)
            continue


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_share_before_fork)
