"""Ray, imported when a service is built, and a process-wide lease on its runtime.

Ray is an optional dependency (the ``functional_rb[ray]`` extra): nothing imports it until a
service is constructed or a client is used, and then :func:`import_ray` explains how to install
it. :class:`RayRuntime` starts Ray only when it is not running yet (a runtime the user started,
``ray.init(address=...)`` for a cluster included, is used as it is) and shuts down only a
runtime it started, when the last service holding it closes. :func:`get` waits for a remote
call and re-raises the remote exception itself (a ``ValueError`` raised in the actor arrives
as that ``ValueError``, its message naming the actor's call), not Ray's wrapper.

Services that come back. A service's actor started with Ray's ``max_restarts`` is restarted by
Ray when its process dies, and resumes from its newest checkpoint. :func:`call` makes a call
on it through that: a call in flight when the process died, or sent while it restarts, waits
until the actor is back (:func:`wait_back`, up to :data:`RESTART_WAIT_S`); then a read is sent
again, and a write raises :class:`ServiceInterrupted` (it may or may not have been applied, so
only the caller can say whether to send it again). An actor that will not come back raises a
``RuntimeError`` saying it is dead.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "RESTART_WAIT_S",
    "RayRuntime",
    "ServiceInterrupted",
    "call",
    "dead",
    "get",
    "import_ray",
    "wait_back",
]

INSTALL_HINT = 'pip install -c constraints.txt ".[ray]" (from a clone of functional_rb)'
RESTART_WAIT_S = 300.0  # how long a call waits for a restarting service's actor


class ServiceInterrupted(ConnectionError):
    """A write whose service's actor died while it ran (or before it ran) and was restarted by
    Ray from the service's newest checkpoint: the write may or may not be in the buffer now.

    Writes are not sent again on their own: one that was applied and checkpointed before the
    process died would then be stored twice. Reads (``sample``, ``stats``, ``len``, ...) are
    sent again. The service is back when this is raised: the next call is served.

    Examples:
      >>> from functional_rb.service import ServiceInterrupted
      >>> issubclass(ServiceInterrupted, ConnectionError)
      True
    """


def import_ray(where: str):
    """The ``ray`` module; ``ImportError`` naming ``where`` and the extra when it is missing."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"{where} needs Ray, which is not installed (ImportError: {e}). Install the "
            f"optional extra: {INSTALL_HINT} (or pip install ray)."
        ) from e
    return ray


def get(ref, where: str) -> Any:
    """``ray.get(ref)``, re-raising the exception the actor raised (its type and message)."""
    ray = import_ray(where)
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def dead(where: str, error: BaseException | None = None) -> RuntimeError:
    """The error for a service whose actor is dead and will not be restarted.

    Examples:
      >>> from functional_rb.service import runtime
      >>> error = runtime.dead("RayBufferService.add")
      >>> str(error).split(". ")[0]
      'RayBufferService.add: the Ray actor hosting the buffer is dead and will not be restarted'
    """
    return RuntimeError(
        f"{where}: the Ray actor hosting the buffer is dead and will not be restarted"
        + (f" ({type(error).__name__})" if error is not None else "")
        + ". What it held "
        "is gone, except what its newest checkpoint holds: a service built with the same "
        "checkpoint_path resumes from it (pass remote_config={'max_restarts': n} to have Ray "
        "restart it on its own)."
    )


def wait_back(actor, where: str, timeout: float = RESTART_WAIT_S) -> bool:
    """Wait until ``actor`` answers: True once it does (at once when it never left, or after
    Ray restarted it), False when it is dead or still away after ``timeout`` seconds.

    Examples:
      >>> runtime.wait_back(service._service.handle, "demo")  # doctest: +SKIP
      True
    """
    ray = import_ray(where)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, min(5.0, left)))
            return True
        except ray.exceptions.ActorDiedError:
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if left <= 0:
                return False
            time.sleep(0.1)  # restarting: its process is starting, or loading a checkpoint


def call(actor, name: str, *args, where: str, retry: bool = False, **kwargs) -> Any:
    """``name(*args, **kwargs)`` on the object a service's actor serves
    (:class:`~functional_rb.service.actor.ServiceBody`), through restarts: ``retry`` (a read)
    sends it again once the actor is back; otherwise :class:`ServiceInterrupted`.

    Examples:
      >>> runtime.call(service._service.handle, "size", where="demo", retry=True)  # doctest: +SKIP
      0
    """
    ray = import_ray(where)
    while True:
        try:
            return get(actor.invoke.remote(name, args, kwargs), where)
        except ray.exceptions.ActorDiedError as e:
            raise dead(where, e) from None
        except ray.exceptions.ActorUnavailableError:
            if not wait_back(actor, where):
                raise dead(where) from None
            if not retry:
                raise ServiceInterrupted(
                    f"{where}: the service's actor died during this call and Ray restarted it "
                    "from the newest checkpoint; the call may or may not have been applied. "
                    "Send it again if storing it twice is acceptable (the service is back: "
                    "the next call is served)."
                ) from None


class RayRuntime:
    """A lease on the process's Ray runtime: :meth:`acquire` starts Ray with
    ``ray_init_config`` unless it is already running (then the running one is used and the
    config is not applied: Ray cannot be re-initialised in a process); :meth:`release` shuts
    it down when this process started it and the last lease is released."""

    _lock = threading.Lock()
    _leases = 0
    _owned = False

    def __init__(self, ray) -> None:
        self._ray = ray
        self._released = False

    @classmethod
    def acquire(cls, where: str, ray_init_config: dict | None = None) -> RayRuntime:
        ray = import_ray(where)
        if ray_init_config is not None and not isinstance(ray_init_config, dict):
            raise TypeError(
                f"{where}: ray_init_config must be a dict of ray.init keyword "
                f"arguments, got {type(ray_init_config).__name__}."
            )
        with cls._lock:
            if not ray.is_initialized():
                ray.init(**dict(ray_init_config or {}))
                RayRuntime._owned = True
            RayRuntime._leases += 1
        return cls(ray)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            RayRuntime._leases -= 1
            if RayRuntime._leases == 0 and RayRuntime._owned:
                RayRuntime._owned = False
                if self._ray.is_initialized():
                    self._ray.shutdown()
