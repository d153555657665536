"""Sampling ahead: ``prefetch=N`` keeps up to N batches queued, drawn by a background thread,
so a training loop that computes between samples finds the next batch ready (TorchRL's design).

One thread draws them, in the order they were requested: a seeded buffer gives the same batches
with and without prefetching (TorchRL's N threads race for the generator, so its order varies).

The draws run the buffer's own ``_sample`` under its lock, so they are serialized with
``extend`` and priority updates: a prefetched batch reflects the buffer as it was when it was
drawn, as in TorchRL.

Two locks, always taken in one order: the queue's (:attr:`Prefetcher.lock`, TorchRL's
``_futures_lock``) before the buffer's. A draw in flight needs the buffer's lock, so whoever
waits for draws (``sample`` popping the queue, ``state_dict``, ``dumps``, pickling, ``empty``,
``load_state_dict``, ``loads``) must hold the queue's lock and not the buffer's while it waits:
:meth:`Prefetcher.settled` waits first and lets its caller take the buffer's lock after. (Waiting
under the buffer's lock hung ``load_state_dict`` for ever: the draw waited for the lock, the
loader for the draw.)

The buffer's side (``prefetch``, ``prefetch_settled``, ``restore_prefetch`` and TorchRL's
names ``_prefetch_queue`` / ``_futures_lock``) is at the end: methods of
:class:`~functional_rb.adapters.ReplayBuffer`, bound by name in its class body.

Checkpoints carry the queue (TorchRL's ``_prefetch_state``: ``{"version": 1, "capacity": N,
"queue": (batch, ...)}``), taken after the draws in flight settled and together with the
generator state those draws left: a restored buffer serves the same batches, in the same order,
as the buffer it was saved from.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from typing import Any

import torch
from tensordict import is_tensor_collection

__all__ = [
    "Prefetcher",
    "check_prefetch_state",
    "prefetch",
    "prefetch_settled",
    "prefetch_state",
    "queue",
    "queue_lock",
    "restore_prefetch",
]

_VERSION = 1  # TorchRL's prefetch-state format


def _clone(result):
    """A copy of a prefetched ``(data, info)`` sharing no storage with it (a saved queue must
    not change when the live one is consumed or edited). Tensors outside the autograd graph
    keep ``requires_grad``, as TorchRL's: a checkpoint stores values, not graphs."""
    memo: dict = {}

    def leaf(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_() if x.requires_grad else y
        if is_tensor_collection(x):
            return x.apply(leaf)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(leaf(v) for v in x)
        if isinstance(x, dict):
            return type(x)((k, leaf(v)) for k, v in x.items())
        return deepcopy(x, memo)

    return leaf(result)


def prefetch_state(capacity: int, queue, *, clone: bool = True) -> dict[str, Any]:
    """TorchRL's ``_prefetch_state`` of a queue of settled ``(data, info)`` results."""
    return {
        "version": _VERSION,
        "capacity": int(capacity),
        "queue": tuple(_clone(r) for r in queue) if clone else tuple(queue),
    }


def check_prefetch_state(state, capacity: int, where: str) -> None:
    """TorchRL's checks of a saved prefetch state against a buffer with ``prefetch=capacity``
    (its exception types and phrases), before anything is loaded."""
    if state is None:  # saved before prefetch states existed (TorchRL's legacy layout)
        return
    if not isinstance(state, dict):
        raise TypeError(
            f"{where}: The prefetch state must be a dictionary, got {type(state).__name__}."
        )
    if state.get("version") != _VERSION:
        raise RuntimeError(
            f"{where}: Unsupported prefetch state version: "
            f"{state.get('version')} (this buffer reads version {_VERSION})."
        )
    saved = state.get("capacity")
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
        raise ValueError(
            f"{where}: The saved prefetch capacity must be a non-negative integer, got {saved!r}."
        )
    if saved != capacity:
        raise RuntimeError(
            f"{where}: Cannot restore a prefetch queue with capacity {saved} "
            f"into a replay buffer with capacity {capacity}. Build the buffer "
            f"with prefetch={saved or None} to load this checkpoint."
        )
    queue = state.get("queue")
    if not isinstance(queue, (list, tuple)):
        raise TypeError(
            f"{where}: The saved prefetch queue must be a list or tuple, got "
            f"{type(queue).__name__}."
        )
    if len(queue) > saved:
        raise ValueError(
            f"{where}: The saved prefetch queue contains {len(queue)} entries but "
            f"its capacity is {saved}."
        )


class Prefetcher:
    """The queue of batches drawn ahead, and the one thread drawing them."""

    def __init__(self, size: int):
        if int(size) < 1:
            raise ValueError(f"prefetch must be a positive int, got {size!r}.")
        self.size = int(size)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frb-prefetch")
        self.queue: collections.deque = collections.deque()  # futures of (data, info)
        # re-entrant: a collate_fn or transform may itself sample another buffer's prefetcher
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.queue)

    def next(self, draw, sampler):
        """The oldest prefetched batch (or a fresh one), then top the queue up with draws.
        Called without the buffer's lock (the queued draws need it)."""
        with self.lock:
            result = self.queue.popleft().result() if self.queue else draw()
            while (
                len(self.queue) < min(sampler.remaining_batches, self.size) and not sampler.ran_out
            ):
                self.queue.append(self._pool.submit(draw))
        return result

    @contextlib.contextmanager
    def settled(self, *, clear: bool = False) -> Iterator[tuple]:
        """Hold the queue still: wait for the draws in flight and yield their results, oldest
        first; nothing is drawn until the block ends. ``clear``: drop them instead (the
        buffer is being replaced: ``empty``, ``load_state_dict``, ``loads``); draws not started
        are cancelled, a dropped draw's error belongs to no caller. Take the buffer's lock
        inside the block, never around it."""
        with self.lock:
            if clear:
                self._drop()
                yield ()
            else:
                yield tuple(f.result() for f in self.queue)

    def _drop(self) -> None:
        futures = tuple(self.queue)
        self.queue.clear()
        for fut in futures:
            if not fut.cancel():
                with contextlib.suppress(Exception):  # (see settled)
                    fut.result()

    def restore(self, results, *, clone: bool = True) -> None:
        """Queue already-drawn results (a checkpoint's), in order, after the ones queued;
        ``clone``: copies of them (the checkpoint may be restored again)."""
        with self.lock:
            for r in results:
                r = _clone(r) if clone else r
                fut = Future()
                fut.set_result(r)
                self.queue.append(fut)

    def invalidate(self) -> None:
        """Drop the queue (see :meth:`settled`)."""
        with self.lock:
            self._drop()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- the buffer's methods
# (bound by name in ReplayBuffer's class body; ``self._prefetcher`` is None without prefetch)
def prefetch(self) -> int:
    """The number of batches sampled ahead (0: no prefetching)."""
    return 0 if self._prefetcher is None else self._prefetcher.size


def prefetch_settled(self, *, clear: bool = False):
    """A context in which no batch is drawn ahead: it waits for the draws in flight and yields
    their results (``clear``: drops them and yields ``()``). Take ``self.lock`` inside it,
    never around it (see the module docstring)."""
    if self._prefetcher is None:
        return contextlib.nullcontext(())
    return self._prefetcher.settled(clear=clear)


def restore_prefetch(self, state, *, clone: bool = True, where: str = "load_state_dict") -> None:
    """Queue a checkpoint's prefetched batches (TorchRL's ``_prefetch_state``), after checking
    them against this buffer's ``prefetch`` (TorchRL's errors)."""
    check_prefetch_state(state, self.prefetch, f"{type(self).__name__}.{where}")
    if state and state["queue"]:
        self._prefetcher.restore(state["queue"], clone=clone)


# TorchRL's private names for the queue and its lock, which code written against TorchRL (its
# own tests among it) reads
def queue(self) -> collections.deque:
    return collections.deque() if self._prefetcher is None else self._prefetcher.queue


def queue_lock(self):
    return threading.RLock() if self._prefetcher is None else self._prefetcher.lock
