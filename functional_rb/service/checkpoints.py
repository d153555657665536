"""Checkpoints a service writes while it serves, and the newest one it resumes from.

A Ray service built with ``checkpoint_path=`` and ``checkpoint_every=`` writes its whole
buffer (items, priorities, writer and sampler state, the rate limiter's counters, the PRNG key)
into ``checkpoint_path/ckpt-<n>``, each with the library's atomic machinery (the core's
:func:`functional_rb.checkpoint.save`, the adapters' ``dumps``): a directory appears complete,
fsynced and checksummed, or not at all. The newest :data:`KEEP` are kept.

``checkpoint_every``:

- a number: seconds; a timer in the actor writes a checkpoint when anything changed since the
  last one (an add, a sample, a priority update);
- ``{"items": n}``: after every ``n`` items inserted, written by the add that reaches ``n``
  before it returns (so an add that returned is lost only if fewer than ``n`` items were
  inserted after the newest checkpoint);
- ``{"seconds": s, "items": n}``: both.

When the service starts (built anew, or restarted by Ray's ``max_restarts`` after its process
died) it loads the newest checkpoint under ``checkpoint_path`` that verifies; a damaged one is
logged, renamed ``damaged-ckpt-<n>`` (kept for inspection) and the one before it is tried.
What is lost is what happened after that checkpoint was written: the items inserted since (at
most ``n - 1`` acknowledged ones with ``{"items": n}``), and the samples and priority updates
since. ``stats()`` reports what was
restored (``restored``) and the newest checkpoint written (``checkpoint``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from functional_rb.checkpoint.atomic import CheckpointError

__all__ = ["KEEP", "CheckpointPolicy", "Checkpointer", "checkpoint_policy"]

_LOG = logging.getLogger(__name__)
KEEP = 2  # checkpoints kept: the newest, and the one before it should the newest be damaged
_NAME = re.compile(r"^ckpt-(\d+)$")
_LEFTOVER = re.compile(r"^\.ckpt-(\d+)\.frb-(tmp|old)-")  # a save killed while it wrote


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """Where and when a service writes checkpoints (see :func:`checkpoint_policy`)."""

    path: str
    seconds: float | None = None
    items: int | None = None


def checkpoint_policy(every, path, where: str) -> CheckpointPolicy | None:
    """The policy of ``checkpoint_every=every, checkpoint_path=path``; None when neither is
    given. ``ValueError`` / ``TypeError`` naming the argument otherwise.

    Examples:
      >>> checkpoint_policy(30, "/tmp/rb", "RayBufferService")
      CheckpointPolicy(path='/tmp/rb', seconds=30.0, items=None)
      >>> checkpoint_policy({"items": 10_000}, "/tmp/rb", "RayBufferService").items
      10000
    """
    if every is None and path is None:
        return None
    if every is None or path is None:
        missing = "checkpoint_path" if path is None else "checkpoint_every"
        raise ValueError(
            f"{where}: checkpoint_every and checkpoint_path go together; "
            f"{missing} is missing (e.g. checkpoint_every=60.0, "
            "checkpoint_path='/data/rb')."
        )
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"{where}: checkpoint_path must be a directory path (a str), got {path!r}.")
    spec = {"seconds": every} if _is_number(every) else every
    if not isinstance(spec, dict) or not spec or set(spec) - {"seconds", "items"}:
        raise ValueError(
            f"{where}: checkpoint_every must be a number of seconds, or a dict "
            f"with 'seconds' and/or 'items' (e.g. {{'items': 10_000}}), got "
            f"{every!r}."
        )
    seconds, items = spec.get("seconds"), spec.get("items")
    if seconds is not None and not (_is_number(seconds) and 0 < seconds < math.inf):
        raise ValueError(
            f"{where}: checkpoint_every seconds must be a positive number, got {seconds!r}."
        )
    if items is not None and (isinstance(items, bool) or not isinstance(items, int) or items < 1):
        raise ValueError(f"{where}: checkpoint_every items must be a positive int, got {items!r}.")
    return CheckpointPolicy(os.fspath(path), None if seconds is None else float(seconds), items)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Checkpointer:
    """Writes a service's checkpoints by ``policy`` and restores the newest.

    ``save(directory)`` / ``load(directory)`` are the service's own writer and reader (atomic,
    checked); both run holding ``lock``, the lock that serializes the service's calls, so a
    checkpoint is one consistent state. The service calls :meth:`changed` (holding ``lock``)
    after every call that changed its buffer.

    Examples:
      >>> import os, tempfile, threading
      >>> root = tempfile.mkdtemp()
      >>> written = []
      >>> ckpts = Checkpointer(checkpoint_policy({"items": 10}, root, "Demo"),
      ...                      save=lambda d: (os.mkdir(d), written.append(d)),
      ...                      load=print, lock=threading.Lock(), where="Demo")
      >>> ckpts.restore() is None  # (an empty directory: nothing to resume)
      True
      >>> ckpts.changed(6); ckpts.changed(6)  # the second reaches 10 items: written now
      >>> [os.path.basename(d) for d in written]
      ['ckpt-0000000001']
    """

    def __init__(
        self,
        policy: CheckpointPolicy,
        *,
        save: Callable[[str], Any],
        load: Callable[[str], Any],
        lock,
        where: str,
    ) -> None:
        self.policy, self._save, self._load, self._lock = policy, save, load, lock
        self._where = where
        self._seq = 0
        self._items = 0  # items inserted since the newest checkpoint
        self._changed = False  # anything changed since the newest checkpoint
        self._written = 0
        self._newest: dict | None = None
        self._error: str | None = None
        self.restored: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _entries(self) -> list[tuple[int, str, bool]]:
        """``(n, name, complete)`` of what ``policy.path`` holds."""
        out = []
        for name in os.listdir(self.policy.path):
            m = _NAME.match(name) or _LEFTOVER.match(name)
            if m:
                out.append((int(m.group(1)), name, m.re is _NAME))
        return out

    def restore(self) -> dict | None:
        """Load the newest checkpoint that verifies (a damaged one is logged and skipped);
        what was restored (``path``, ``saved_at``, ``skipped``), or None when there is none.
        Raises when every checkpoint there is damaged (rather than start empty), and the
        reader's own errors (a checkpoint of another configuration)."""
        os.makedirs(self.policy.path, exist_ok=True)
        entries = self._entries()
        self._seq = max((n for n, _, _ in entries), default=0)
        skipped = []
        for _, name, _ in sorted((e for e in entries if e[2]), reverse=True):
            directory = os.path.join(self.policy.path, name)
            try:
                with self._lock:
                    self._load(directory)
            except CheckpointError as e:  # damaged: the one before it may not be
                _LOG.warning("%s: skipping a damaged checkpoint: %s", self._where, e)
                skipped.append(f"{name}: {e}")
                # kept for inspection, out of the way of the next restore and of pruning
                os.replace(directory, os.path.join(self.policy.path, f"damaged-{name}"))
                continue
            saved_at = os.path.getmtime(directory)
            self._newest = {"path": directory, "time": saved_at}
            self.restored = {"path": directory, "saved_at": saved_at, "skipped": skipped}
            return self.restored
        if skipped:
            raise CheckpointError(
                self._where,
                self.policy.path,
                f"every checkpoint there is damaged ({'; '.join(skipped)})",
                "Move the directory aside to start the service empty.",
            )
        return None

    def start(self) -> None:
        """Start the timer of a ``seconds`` policy."""
        if self.policy.seconds is not None and self._thread is None:
            self._thread = threading.Thread(
                target=self._tick, daemon=True, name=f"{self._where}-checkpoints"
            )
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.policy.seconds):
            with self._lock:
                if self._changed and not self._stop.is_set():
                    self._save_logged()

    def changed(self, items: int = 0) -> None:
        """Record a change (``items`` inserted); with an ``items`` policy, write a
        checkpoint now when enough were. Called holding the service's lock."""
        self._changed = True
        self._items += items
        if self.policy.items is not None and self._items >= self.policy.items:
            self._save_logged()

    def _save_logged(self) -> None:
        # a checkpoint that fails (disk full) must not fail the add that triggered it: that
        # add is applied, and its caller, told otherwise, might send it again
        try:
            self.save()
        except Exception as e:
            self._error = f"{type(e).__name__}: {e}"
            _LOG.error(
                "%s: writing a checkpoint failed (serving goes on): %s", self._where, self._error
            )

    def save(self) -> dict:
        """Write a checkpoint now (holding the service's lock); its ``path`` and ``time``."""
        self._seq += 1
        directory = os.path.join(self.policy.path, f"ckpt-{self._seq:010d}")
        self._save(directory)
        self._items, self._changed, self._error = 0, False, None
        self._written += 1
        self._newest = {"path": directory, "time": time.time()}
        self._prune()
        return self._newest

    def _prune(self) -> None:
        """Delete all but the newest KEEP checkpoints, and what killed saves left."""
        entries = self._entries()
        complete = sorted(name for _, name, done in entries if done)
        doomed = complete[:-KEEP] + [
            name for n, name, done in entries if not done and n < self._seq
        ]
        for name in doomed:
            shutil.rmtree(os.path.join(self.policy.path, name), ignore_errors=True)

    def stats(self) -> dict:
        """``restored`` (None, or what was loaded at start) and ``checkpoint`` (the newest
        written or loaded, how many were written, items inserted since, the last error)."""
        return {
            "restored": self.restored,
            "checkpoint": {
                "path": self.policy.path,
                "newest": self._newest,
                "written": self._written,
                "inserted_since": self._items,
                "error": self._error,
            },
        }

    def close(self, final: bool = True) -> None:
        """Stop the timer; with ``final``, write a last checkpoint if anything changed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if final and self._changed:
                self._save_logged()
