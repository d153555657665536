"""Processes killed on purpose (SIGKILL: no clean-up runs), to check what their writes leave.

``kill_at_random``: a child writes without end (adds, checkpoints, dumps) and reports over a
pipe; the parent kills it after a random delay and reads what it reported last, then checks
the files (MemmapStorage, ``frb.checkpoint``, the adapters' dumps). ``die``: a child kills
itself at a chosen point of a write (the shared storages' writers).

The random-moment children start from a forkserver that imported only the libraries they need
(``forkserver``): a fork of a test process whose JAX and torch thread pools are running may
deadlock, and a fork of a clean server costs a fork, not an interpreter start.
"""

import multiprocessing as mp
import os
import signal
import time
import warnings


def die():
    """Kill this process at once with SIGKILL (no ``finally``, no ``atexit``, no flush)."""
    os.kill(os.getpid(), signal.SIGKILL)


def forkserver(*preload):
    """multiprocessing's forkserver context, its server importing the modules ``preload``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def kill_at_random(ctx, target, args, delay, ready_s=None):
    """Start ``target(*args, conn)`` in a daemon process of ``ctx``, wait up to ``ready_s``
    seconds for it to send ``"ready"`` through ``conn`` (not at all when None), sleep ``delay``
    seconds, SIGKILL it and reap it.

    Returns ``(ready, last)``: whether ``"ready"`` arrived in time, and the last other value
    the child sent (0 if none). The caller asserts on ``ready`` when the trial needs it."""
    recv, send = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's "os.fork()" warning
        proc = ctx.Process(target=target, args=(*args, send), daemon=True)
        proc.start()
    ready = False
    try:
        if ready_s is not None:
            ready = bool(recv.poll(ready_s)) and recv.recv() == "ready"
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    last = 0
    while recv.poll():
        sent = recv.recv()
        if sent != "ready":
            last = sent
    return ready, last
