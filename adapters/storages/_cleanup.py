"""Removing a :class:`~functional_rb.adapters.LazyMemmapStorage`'s files when it goes away
(``auto_cleanup=True``, TorchRL's): when the storage is collected, when the interpreter exits
(``atexit``; an uncaught Ctrl+C ends in a normal exit), and on ``SIGTERM``.

Only the process that created the files removes them: a forked child inherits the parent's
finalizers and exit hooks, and a worker handed the storage by pickling must never delete the
files the others still map.

Where this differs from TorchRL: TorchRL also catches ``SIGINT`` and removes the files before
re-raising it, so a program that catches ``KeyboardInterrupt`` to save its buffer finds the
files gone. Here Ctrl+C raises ``KeyboardInterrupt`` as usual and the files go at exit. The
``SIGTERM`` handler is installed only where ``SIGTERM`` still has its default action (a handler
of the program's own is left in place; exit hooks still run after it exits), and only from the
main thread (Python's rule for signal handlers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import weakref

__all__ = ["remove_dir", "watch", "unwatch", "cleanup_all"]

_WATCHED: weakref.WeakSet = weakref.WeakSet()  # storages with auto_cleanup, this process
_SIGTERM_PID = None  # the process that installed the SIGTERM handler


def remove_dir(path: str, owner: int) -> bool:
    """Remove ``path`` (recursively) if this is process ``owner`` and it exists."""
    if os.getpid() != owner or not os.path.isdir(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def cleanup_all() -> None:
    """Run ``cleanup()`` on every storage still watched (errors are ignored: the process is
    going away and each storage may be half gone already)."""
    for storage in list(_WATCHED):
        with contextlib.suppress(Exception):  # (see the docstring)
            storage.cleanup()


def _on_sigterm(signum, frame) -> None:
    cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of SIGTERM, as without the handler


def watch(storage) -> None:
    """Clean ``storage`` up on SIGTERM too (its finalizer covers collection and exit)."""
    global _SIGTERM_PID
    _WATCHED.add(storage)
    if os.getpid() == _SIGTERM_PID or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
        _SIGTERM_PID = os.getpid()
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        pass


def unwatch(storage) -> None:
    _WATCHED.discard(storage)
