"""Sampling ahead: ``prefetch=N`` keeps up to N batches queued, drawn by a background thread,
so a training loop that computes between samples finds the next batch ready (TorchRL's design).

One thread draws them, in the order they were requested: a seeded buffer gives the same batches
with and without prefetching (TorchRL's N threads race for the generator, so its order varies).

The draws run the buffer's own ``_sample`` under its lock, so they are serialized with
``extend`` and priority updates: a prefetched batch reflects the buffer as it was when it was
drawn, as in TorchRL. ``invalidate`` (on ``empty``, ``loads``, ``load_state_dict``) waits for
the draws in flight and drops them.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Prefetcher"]


class Prefetcher:
    def __init__(self, size: int):
        if int(size) < 1:
            raise ValueError(f"prefetch must be a positive int, got {size!r}.")
        self.size = int(size)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frb-prefetch")
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def next(self, draw, sampler):
        """The oldest prefetched batch (or a fresh one), then top the queue up with draws."""
        with self._lock:
            result = self._queue.popleft().result() if self._queue else draw()
            while len(self._queue) < min(sampler.remaining_batches, self.size) and \
                    not sampler.ran_out:
                self._queue.append(self._pool.submit(draw))
        return result

    def invalidate(self) -> None:
        with self._lock:
            while self._queue:
                fut = self._queue.popleft()
                try:
                    fut.result()
                except Exception:  # a dropped draw's error belongs to no caller
                    pass

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
