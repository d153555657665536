"""How a buffer's sampler follows writes made by other processes to a shared storage.

A storage shared by processes (:class:`~functional_rb.adapters.LazyMemmapStorage`) counts the
steps every process reserved and committed (``storage.committed(since)``). Each buffer object
keeps, in a :class:`Follower`, how many of those steps its sampler has been told of; before it
samples (and after it writes) it tells the sampler about the rest, in the order the steps were
reserved, so trajectory boundaries and the priorities of new items are those one process would
have after the same writes. A copy of the buffer in another process only writes: the process
that built the buffer keeps the sampler's state.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import torch

from functional_rb.adapters.replay_buffers._buffer_io import _generator
from functional_rb.adapters.replay_buffers._prefetch import Prefetcher, prefetch_state

__all__ = ["Follower", "Processes"]


class Follower:
    """The steps of a shared storage a buffer's sampler has been told of."""

    def __init__(self):
        self.owner = os.getpid()
        self.seen = 0

    def foreign(self) -> bool:
        """Whether this copy runs in another process than the one that built the buffer."""
        return os.getpid() != self.owner

    def written(self, storage, sampler, writer, index) -> None:
        """This process wrote ``index``: tell the sampler (with a shared storage, every step
        committed so far, in reservation order)."""
        if storage.committed(self.seen) is not None:
            self.catch_up(storage, sampler, writer, own_write=True)
        elif not self.foreign():
            sampler.extend(index, storage=storage)

    def catch_up(self, storage, sampler, writer, own_write: bool = False) -> None:
        """Tell the sampler about the steps committed since it was last told (a range larger
        than the ring: its last ``rows``)."""
        got = storage.committed(self.seen)
        if got is None or self.foreign() or got[1] <= got[0]:
            return
        start, end = got
        rows = storage.max_size_along_dim0()
        start = max(start, end - rows)
        if not own_write:
            storage.touched()  # other processes changed the data this process reads
        index = writer.replicate_index((start + torch.arange(end - start)) % rows)
        sampler.mark_update(index, storage=storage)
        sampler.extend(index, storage=storage)
        for hole in storage.new_holes():  # a dead writer's rows: their priority drops to 0
            if sampler.prioritized:
                sampler.update_priority(writer.replicate_index(hole), 0.0, storage=storage)
        self.seen = end

    def rebase(self, storage) -> None:
        """The storage was replaced or emptied: its committed steps are all known."""
        got = storage.committed(0)
        self.seen = 0 if got is None else got[1]


_LIVE = weakref.WeakSet()  # the buffers of this process (each rebuilt in a forked child)


def _jax_started() -> bool:
    """Whether this process started JAX's runtime (its backends, and their threads)."""
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", True)) if bridge is not None else True


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a buffer lock one of them held (a
    prefetch or update task) would never be released there. Each buffer gets a fresh lock and
    drops the parent's thread pools (batches drawn ahead, queued updates: the parent's), and
    remembers whether the parent ran JAX (see ``ReplayBuffer._sample``)."""
    jax = _jax_started()
    for rb in list(_LIVE):
        rb._fresh_after_fork()
        rb._forked_from_jax = jax


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Processes:
    """A buffer across processes (a mixin of :class:`~functional_rb.adapters.ReplayBuffer`):
    ``share``, ``synchronize``, ``refresh``, ``mark_update`` (the storage's notice of items
    changed in place) and pickling (locks, thread pools and generators are rebuilt; the process
    that built the buffer stays its owner)."""

    def share(self, shared: bool = True):
        self.shared = bool(shared)
        if shared and self._initialized:
            self._transform.share_memory()
        return self

    @property
    def owner_pid(self) -> int:
        """The process that built this buffer (it keeps the sampler's state)."""
        return self._follower.owner

    def _foreign(self) -> bool:
        return self._follower.foreign()

    def mark_update(self, index) -> None:
        """Items at ``index`` changed (the storage tells its attached buffers)."""
        if not self._follower.foreign():
            self._sampler.mark_update(index, storage=self._storage)

    def synchronize(self, *, updates: bool = True) -> None:
        """Wait for queued conditional updates (``updates``; they take the buffer's lock, so
        never wait for them holding it), and bring the sampler up to date with the steps other
        processes wrote to a shared storage."""
        if updates:
            self.wait_updates()
        with self._lock:
            self._follower.catch_up(self._storage, self._sampler, self._writer)

    def refresh(self) -> None:
        """The components were replaced wholesale (``loads``, ``load_state_dict``): drop the
        batches drawn ahead (the callers emptied the queue first, inside ``prefetch_settled``,
        since a draw in flight needs the lock they hold now) and recount the steps a shared
        storage holds."""
        if self._prefetcher is not None:
            self._prefetcher.invalidate()
        self._follower.rebase(self._storage)

    def _register(self) -> None:
        _LIVE.add(self)

    def _fresh_after_fork(self) -> None:
        self._lock = threading.RLock()
        self._updater, self._pending = None, []
        if self._prefetcher is not None:
            self._prefetcher = Prefetcher(self._prefetcher.size)

    def __getstate__(self):
        self.wait_updates()
        # the batches drawn ahead travel (TorchRL's), with the generator state they left
        with self.prefetch_settled() as queue, self._lock:
            state = self.__dict__.copy()
            state.pop("_lock")
            state["_updater"], state["_pending"] = None, []
            state.pop("_iterator", None)  # (next()'s epoch: a generator, not picklable)
            rng = state.get("_rng")
            if rng is not None:
                state["_rng"] = (rng.get_state().clone(), str(rng.device))
            state["_prefetcher"] = (
                None if self._prefetcher is None else prefetch_state(self._prefetcher.size, queue)
            )
        return state

    def __setstate__(self, state):
        rng = state.pop("_rng", None)
        pref = state.pop("_prefetcher", None)
        if isinstance(pref, int):  # (pickled before the queue travelled)
            pref = prefetch_state(pref, ())
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._prefetcher = Prefetcher(pref["capacity"]) if pref else None
        if pref:
            self.restore_prefetch(pref, clone=False, where="__setstate__")
        self._forked_from_jax = False  # (unpickled: this process started on its own)
        self._register()
        self._rng = None
        if rng is not None:
            self.set_rng(_generator(rng))
