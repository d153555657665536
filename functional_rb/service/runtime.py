"""Ray, imported when a service is built, and a process-wide lease on its runtime.

Ray is an optional dependency (the ``functional_rb[ray]`` extra): nothing imports it until a
service is constructed or a client is used, and then :func:`import_ray` explains how to install
it. :class:`RayRuntime` starts Ray only when it is not running yet (a runtime the user started,
``ray.init(address=...)`` for a cluster included, is used as it is) and shuts down only a
runtime it started, when the last service holding it closes. :func:`get` waits for a remote
call and re-raises the remote exception itself (a ``ValueError`` raised in the actor arrives
as that ``ValueError``, its message naming the actor's call), not Ray's wrapper.
"""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["INSTALL_HINT", "RayRuntime", "get", "import_ray"]

INSTALL_HINT = 'pip install "functional_rb[ray]"'


def import_ray(where: str):
    """The ``ray`` module; ``ImportError`` naming ``where`` and the extra when it is missing."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"{where} needs Ray, which is not installed (ImportError: {e}). Install the "
            f"optional extra: {INSTALL_HINT} (or pip install ray).") from e
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
    def acquire(cls, where: str, ray_init_config: dict | None = None) -> "RayRuntime":
        ray = import_ray(where)
        if ray_init_config is not None and not isinstance(ray_init_config, dict):
            raise TypeError(f"{where}: ray_init_config must be a dict of ray.init keyword "
                            f"arguments, got {type(ray_init_config).__name__}.")
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
