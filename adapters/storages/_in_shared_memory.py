"""Sharing a :class:`~functional_rb.adapters.LazyTensorStorage` between processes, as TorchRL
does: its tensors are moved to shared memory when it is handed to another process.

When: a storage holding data is pickled by ``multiprocessing``'s ``ForkingPickler`` (the
arguments of a spawned ``Process``, a ``Queue``, a ``Pipe``: what ``torch.multiprocessing``
moves tensors to shared memory for), or the process forks while one of the buffers reading the
storage is ``share(True)``-ed (a fork copies memory, it pickles nothing, so the data is moved
just before). :func:`share` then moves each tensor's memory to shared memory in place (every
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

__all__ = ["watch", "share", "cursor_path", "before_sending", "detached_state",
           "SHARE_FIX"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's LazyTensorStorages

SHARE_FIX = (
    "Share it before the workers start: extend it once in this process, then pass the buffer "
    "to them as a Process argument or through a queue (its tensors then move to shared "
    "memory), or call rb.share(True) (or storage.share_memory_()) before forking; or use "
    "LazyMemmapStorage, or LazyTensorStorage(max_size, shared_init=True), which any process "
    "may initialize.")

_NOT_INITIALIZED = (
    "Cowardly refusing to share a storage of type {name} between processes: it has not been "
    "initialized yet (it holds no data, so its shapes are unknown). Either extend the buffer "
    "once in this process before passing it to the other processes, or build the storage with "
    "shared_init=True so that any process may initialize it.")

_DEVICE = (
    "{name}.share_memory_: its data is on {device}, which has no memory processes can share. "
    "Keep the storage on the CPU (move samples with buffer.append_transform(lambda x: "
    "x.to(device))), or use a CUDA device.")


def watch(storage) -> None:
    """Follow ``storage`` so that a fork shares it when one of its buffers is shared."""
    _LIVE.add(storage)


def cursor_path(storage) -> str:
    return os.path.join(storage._share_dir, "cursor.bin")


def _device_ok(storage) -> bool:
    device = storage.device
    return device != "auto" and torch.device(device).type in ("cpu", "cuda")


def share(storage) -> None:
    """Move ``storage``'s data to shared memory and open its shared ring (no-op if shared)."""
    if storage.shares_writes:
        return
    storage._check_home("share_memory_")
    name = type(storage).__name__
    if not storage.initialized:
        raise RuntimeError(_NOT_INITIALIZED.format(name=name))
    if not _device_ok(storage):
        raise RuntimeError(_DEVICE.format(name=name, device=storage.device))
    data = storage.data
    if isinstance(data, torch.Tensor) or D.is_tc(data):
        data.share_memory_()
    else:
        D.tree_map(lambda x: x.share_memory_(), data)
    rows, held = storage.max_size_along_dim0(), storage.len_along_dim0
    # the ring's step count, so that the next reserved slot is where this process's writer
    # goes next (a full ring: one lap plus the writer's position)
    steps = held if held < rows else rows + storage.next_row() % rows
    storage._share_dir = tempfile.mkdtemp(prefix="frb_shared_tensor_")
    storage._share_finalizer = weakref.finalize(storage, _cleanup.remove_dir,
                                                storage._share_dir, os.getpid())
    storage._open_cursor(reset=True)
    storage._reset_count(steps)
    storage._shared_base = steps  # the buffers of this process were told of these already


def before_sending(storage) -> None:
    """``storage`` is about to be pickled by ``ForkingPickler`` for another process: shared
    first when it can be; else (nothing to share yet, another device) the other process gets
    a copy that refuses writes, or, for a spawned process's arguments and a storage with no
    data yet, TorchRL's error."""
    if storage.shares_writes or storage._home_pid != os.getpid():
        return
    if storage.initialized and _device_ok(storage):
        share(storage)
    elif get_spawning_popen() is not None and not storage.initialized:
        raise RuntimeError(_NOT_INITIALIZED.format(name=type(storage).__name__))


def detached_state(storage, state: dict) -> dict:
    """``state`` of a shared storage as a copy of its own: the length, the revision and the
    writer's position as this process sees them, no cursor."""
    state["_share_finalizer"] = None
    if state.get("_cursor") is None:
        return state
    rows = storage.max_size_along_dim0()
    state.update(_cursor=None, _share_dir=None, _shared_base=0, _len=len(storage),
                 _local_revision=storage.revision)
    if storage.len_along_dim0:
        state["last_cursor"] = (storage.next_row() - 1) % rows
    return state


def _share_before_fork() -> None:
    """Before a fork: share the storages one of whose buffers is shared (their children then
    write to the same memory). An error leaves the storage unshared: the child's writes then
    raise rather than being lost."""
    for storage in list(_LIVE):
        try:
            if storage.shares_writes or storage._home_pid != os.getpid() or \
                    not storage.initialized or not _device_ok(storage):
                continue
            if torch.device(storage.device).type != "cpu":
                continue  # (CUDA does not survive a fork)
            if any(getattr(rb, "shared", False) for rb in storage.attached):
                share(storage)
        except Exception:  # (see the docstring; a fork hook cannot raise)
            continue


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_share_before_fork)
