"""A buffer across processes: handing it to another process (pickling: locks, thread pools and
generators are rebuilt; the process that built the buffer stays its owner), what a process
started by fork rebuilds, TorchRL's ``share`` / ``synchronize`` / ``refresh``, and the rows
another process was writing when a sample read them (:func:`without_torn_rows`), and what a
buffer's sampler knows of the steps other processes wrote to a shared storage
(:class:`Follower`).

Except those two, these are methods of
:class:`~functional_rb.adapters.ReplayBuffer`, bound by name in its class body (the module
groups them by role; the buffer owns their state).

Torn rows: a sample never holds one. A shared :class:`~functional_rb.adapters.LazyMemmapStorage`
tells, for each row it gathered, whether the row was one whole committed item
(``storage.read_checked``: the row's stamp was even and did not change across the gather). The
sampler drew only committed rows, but a writer may start to overwrite one between the draw and
the gather. Such a draw, with its whole unit (the slice it belongs to for slice samplers), is
replaced by another unit of the same batch that was read whole, with its index and info, so
every sampler's batch keeps its size, its layout and consistent weights. Only when no unit of a
batch is whole is the batch drawn again: at most ``REDRAWS`` times with short sleeps between
(``MAX_WAIT_S`` in all), then a ``RuntimeError`` says why (a ring no larger than what is in
flight). A storage of one process never reports a torn row.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

import torch

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.replay_buffers._prefetch import Prefetcher, prefetch_state
from functional_rb.adapters.replay_buffers._saving import generator_from
from functional_rb.adapters.samplers.random import RandomSampler, SamplerWithoutReplacement

__all__ = [
    "Follower",
    "MAX_WAIT_S",
    "REDRAWS",
    "without_torn_rows",
    "getstate",
    "owner_pid",
    "reduce",
    "refresh",
    "refuse_jax_after_fork",
    "register",
    "setstate",
    "share",
    "synchronize",
]


class Follower:
    """The steps of a shared storage a buffer's sampler has been told of (the buffer asks it
    only when ``storage.committed`` says the storage is shared by processes).

    A storage shared by processes counts the steps every process reserved and committed
    (``storage.committed(since)``). Before the buffer samples (and after it writes) it tells
    the sampler about the rest, in the order the steps were reserved, so trajectory boundaries
    and the priorities of new items are those one process would have after the same writes. A
    copy of the buffer in another process only writes: the process that built the buffer keeps
    the sampler's state.
    """

    def __init__(self):
        self.owner = os.getpid()
        self.seen = 0

    def foreign(self) -> bool:
        """Whether this copy runs in another process than the one that built the buffer."""
        return os.getpid() != self.owner

    def catch_up(self, got, storage, sampler, writer, own_write: bool = False) -> None:
        """Tell the sampler about the steps committed since it was last told, ``got`` (what
        ``storage.committed(self.seen)`` returned; a range larger than the ring: its last
        ``rows``)."""
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


def register(buffer) -> None:
    """Rebuild ``buffer``'s lock and thread pools in a child this process forks."""
    _LIVE.add(buffer)


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
        _fresh_after_fork(rb, forked_from_jax=jax)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_TORCH_SAMPLERS = (RandomSampler, SamplerWithoutReplacement)  # (they run no JAX)
_FORKED_JAX = (
    "{name}.sample: this buffer was inherited by a process started with fork from one that ran "
    "JAX, and its {sampler} samples with JAX, which is not fork-safe (the call could wait for "
    "ever on threads the child does not have). Start the worker with "
    "multiprocessing.get_context('spawn') or get_context('forkserver') (a worker that only "
    "extends may use fork), or sample with RandomSampler / SamplerWithoutReplacement."
)


def refuse_jax_after_fork(self) -> None:
    """In a child forked from a process that ran JAX: raise unless the sampler runs no JAX."""
    sampler = self.sampler
    if type(sampler) not in _TORCH_SAMPLERS:
        raise RuntimeError(
            _FORKED_JAX.format(name=type(self).__name__, sampler=type(sampler).__name__)
        )


def _fresh_after_fork(self, *, forked_from_jax: bool) -> None:
    self._lock = threading.RLock()
    self._updater, self._pending = None, []
    if self._prefetcher is not None:
        self._prefetcher = Prefetcher(self._prefetcher.size)
    self._forked_from_jax = forked_from_jax


def share(self, shared: bool = True):
    self.shared = bool(shared)
    if shared and self._initialized:
        self._transform.share_memory()
    return self


def owner_pid(self) -> int:
    """The process that built this buffer (it keeps the sampler's state)."""
    return self._follower.owner


def synchronize(self, *, updates: bool = True) -> None:
    """Wait for queued conditional updates (``updates``; they take the buffer's lock, so never
    wait for them holding it), and bring the sampler up to date with the steps other processes
    wrote to a shared storage."""
    if updates:
        self.wait_updates()
    with self._lock:
        self._catch_up()


def refresh(self) -> None:
    """The components were replaced wholesale (``loads``, ``load_state_dict``): drop the batches
    drawn ahead (the callers emptied the queue first, inside ``prefetch_settled``, since a draw
    in flight needs the lock they hold now) and recount the steps a shared storage holds."""
    if self._prefetcher is not None:
        self._prefetcher.invalidate()
    self._follower.rebase(self._storage)


def _unpickled(cls):
    return object.__new__(cls)


def reduce(self):
    # unpickled without the class's __new__, which would read the enclosing service contexts
    return _unpickled, (type(self),), self.__getstate__()


def getstate(self):
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


def setstate(self, state) -> None:
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
    register(self)
    self._rng = None
    if rng is not None:
        self.set_rng(generator_from(rng))


# ---------------------------------------------------------------------- torn rows
REDRAWS = 8
_SLEEPS = [min(0.001 * 2**k, 0.05) for k in range(REDRAWS)]
MAX_WAIT_S = sum(_SLEEPS)  # the longest a sample waits for writers (about 0.2 s)

_ALL_TORN = (
    "{name}.sample: every row drawn in {tries} tries was being written by another "
    "process (or was left half-written by a writer that died). Keep the storage's ring "
    "larger than the items the writers have in flight at once."
)


def _unit(sampler, n: int) -> int:
    """Positions per unit of a batch of ``n``: a slice sampler's slice length, else 1."""
    num, length = getattr(sampler, "num_slices", None), getattr(sampler, "slice_len", None)
    u = length if length else (n // num if num else 1)
    return u if u and n % u == 0 else n


def _take(x, src, n):
    if isinstance(x, tuple):
        return tuple(_take(v, src, n) for v in x)
    if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == n:
        return x[src.to(x.device)]
    return x


def without_torn_rows(drawn, draw, storage, sampler, generator, name: str):
    """``(index, info, data)`` whose rows ``storage`` read whole, from ``drawn`` (the first
    draw: ``(index, info, data, torn)``, ``torn`` not None) and, when no unit of it is whole,
    new draws (``draw()`` returns ``(index, info)``)."""
    index, info, data, torn = drawn
    for attempt, pause in enumerate(_SLEEPS):
        if attempt:
            index, info = draw()
            data, torn = storage.read_checked(index)
        if torn is None:
            return index, info, data
        n = torn.numel()
        u = _unit(sampler, n)
        bad = torn.reshape(n // u, u).any(1)
        good = (~bad).nonzero().flatten()
        if good.numel():
            src = torch.arange(n // u)
            src[bad] = good[torch.randint(good.numel(), (int(bad.sum()),), generator=generator)]
            src = (src[:, None] * u + torch.arange(u)).reshape(-1)
            info = {k: _take(v, src, n) for k, v in info.items()}
            return _take(index, src, n), info, D.index(data, src)
        time.sleep(pause)
    raise RuntimeError(_ALL_TORN.format(name=name, tries=len(_SLEEPS)))
