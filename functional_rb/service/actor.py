"""The life of a service's Ray actor, written once for every service.

A *service* is a buffer served from a Ray actor: the core's
:class:`~functional_rb.service.RayBufferService` and the adapters'
:class:`~functional_rb.adapters.RayReplayBuffer`. Three pieces, shared by both:

- :class:`ServiceBody`, what the actor is: it builds the served object in the actor's
  process (and again when Ray restarts the actor) and dispatches calls to it. An error
  building it is kept and raised by :meth:`ServiceBody.ready` and every call, as itself
  (Ray would otherwise report only that the actor died, the error's type lost).
- :class:`ServiceActor`, the actor seen from the process that started it: a lease on Ray
  (:class:`~functional_rb.service.runtime.RayRuntime`), ``ray.remote`` with the user's
  options, the actor killed and the lease released if anything fails while it starts, calls
  that live through restarts (:func:`~functional_rb.service.runtime.call`), and one
  :meth:`ServiceActor.close`.
- :class:`ServiceOwner`, the lifecycle the owning object offers its user: ``is_alive``,
  ``client()`` / ``clients(n)``, ``close()`` / ``shutdown()``, a ``with`` block, and pickling
  as a client (shipped to another process, the owner is a client there: the actor's life
  stays with the process that built it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from functional_rb.service import runtime

__all__ = ["ServiceActor", "ServiceBody", "ServiceOwner"]


class ServiceBody:
    """The object a service's Ray actor is: ``factory(*args, **kwargs)`` built in the actor.

    Examples:
      >>> body = ServiceBody(dict, (), {"size": 3})
      >>> body.invoke("get", ("size",))
      3
      >>> ServiceBody(int, ("x",), {}).ready()
      Traceback (most recent call last):
      ...
      ValueError: invalid literal for int() with base 10: 'x'
    """

    def __init__(self, factory: Callable, args: tuple, kwargs: dict) -> None:
        try:
            self._served, self._error = factory(*args, **kwargs), None
        except Exception as e:  # raised by ready() and every call, as itself
            self._served, self._error = None, e

    def ready(self) -> None:
        """Raise the error that building the served object raised, if any."""
        if self._error is not None:
            raise self._error

    def invoke(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``served.name(*args, **kwargs)``; names starting with ``_`` are not served."""
        self.ready()
        if name.startswith("_"):
            raise AttributeError(f"{type(self._served).__name__}.{name} is private to the service.")
        return getattr(self._served, name)(*args, **(kwargs or {}))


class ServiceActor:
    """A service's Ray actor, from the process that started it.

    Starts Ray if it is not running (``ray_init_config``), then the actor
    (``ray.remote(**options)(ServiceBody)`` building ``factory(*args, **kwargs)``), and waits
    until the served object is built: its error raises here, as itself, after the actor is
    killed and the lease on Ray released.

    Examples:
      >>> from functional_rb.service.actor import ServiceActor
      >>> service = ServiceActor("Demo", dict, (), {"size": 3},  # doctest: +SKIP
      ...                        options={"num_cpus": 0})
      >>> service.call("get", "size"), service.is_alive           # doctest: +SKIP
      (3, True)
      >>> service.close()                                         # doctest: +SKIP
    """

    def __init__(
        self,
        where: str,
        factory: Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        options: dict,
        ray_init_config: dict | None = None,
    ) -> None:
        self._where = where
        if options.get("max_task_retries", 0):
            raise ValueError(
                f"{where}: remote_config['max_task_retries']={options['max_task_retries']!r} "
                "would have Ray send a write again after the actor restarts, and a write that "
                "was applied and checkpointed before its process died would then be stored "
                "twice. Leave it out: the service sends reads again itself, and an "
                "interrupted write raises ServiceInterrupted for its caller to decide."
            )
        self._lease = runtime.RayRuntime.acquire(where, ray_init_config)
        ray = runtime.import_ray(where)
        self.handle = None
        try:
            self.handle = ray.remote(**options)(ServiceBody).remote(
                factory, tuple(args), dict(kwargs or {})
            )
            runtime.get(self.handle.ready.remote(), where)
        except BaseException:
            self._end()
            raise

    @property
    def is_alive(self) -> bool:
        """Whether :meth:`close` has not run (the actor may still be restarting)."""
        return self.handle is not None

    def call(self, name: str, *args, retry: bool = False, **kwargs) -> Any:
        """``name(*args, **kwargs)`` on the served object, through restarts (``retry``: a
        read, sent again after one)."""
        if self.handle is None:
            raise RuntimeError(f"{self._where}.{name}: the service is closed.")
        return runtime.call(
            self.handle, name, *args, where=f"{self._where}.{name}", retry=retry, **kwargs
        )

    def close(self, stop: str | None = None) -> Any:
        """Call ``stop`` on the served object (at most once, best effort: the actor may be
        gone), kill the actor without restart and release Ray; ``stop``'s result."""
        if self.handle is None:
            return None
        out = None
        if stop is not None:
            # the actor may be gone already: so is what stop would end
            with contextlib.suppress(Exception):
                out = runtime.get(self.handle.invoke.remote(stop, (), {}), self._where)
        self._end()
        return out

    def _end(self) -> None:
        if self.handle is not None:
            # already gone with ray.shutdown(): nothing left to end
            with contextlib.suppress(Exception):
                runtime.import_ray(self._where).kill(self.handle, no_restart=True)
            self.handle = None
        self._lease.release()


def _same(client):
    return client


class ServiceOwner:
    """The owner's lifecycle, for a class that keeps its :class:`ServiceActor` in
    ``self._service`` and names itself in ``_where``. Subclasses give :meth:`_new_client`
    (a picklable handle without lifecycle rights) and may extend :meth:`_before_close` /
    :meth:`_after_close`; the served object's ``close`` runs before the actor is killed.

    Examples:
      >>> from functional_rb.service import RayBufferService
      >>> from functional_rb.adapters import RayReplayBuffer
      >>> issubclass(RayBufferService, ServiceOwner), issubclass(RayReplayBuffer, ServiceOwner)
      (True, True)
    """

    _where = "service"
    _service: Any  # the ServiceActor (the subclass sets it)

    def _new_client(self):
        raise NotImplementedError

    def _before_close(self) -> None:
        """Runs first in :meth:`close` (e.g. closing this process's own connection)."""

    def _after_close(self, stopped) -> None:
        """Runs last in :meth:`close`, with what the served object's ``close`` returned."""

    @property
    def is_alive(self) -> bool:
        """Whether the service runs (until :meth:`close`)."""
        service = self.__dict__.get("_service")
        return service is not None and service.is_alive

    def client(self):
        """A picklable handle without lifecycle rights, for another process."""
        if not self.is_alive:
            raise RuntimeError(f"{self._where}.client: the service is closed.")
        return self._new_client()

    def clients(self, num_clients: int) -> list:
        """``num_clients`` independent handles (one per actor, collector or learner)."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError(
                f"{self._where}.clients: num_clients must be an int, got {num_clients!r}."
            )
        if num_clients < 1:
            raise ValueError(
                f"{self._where}.clients: num_clients must be at least 1, got {num_clients}."
            )
        return [self.client() for _ in range(num_clients)]

    def close(self) -> None:
        """End the service: the served object's ``close`` (its final checkpoint, its
        threads), then the actor, then Ray when this service started it. Once."""
        if not self.is_alive:
            return
        self._before_close()
        self._after_close(self._service.close(stop="close"))

    def shutdown(self, timeout: float | None = None) -> None:
        """:meth:`close` (``timeout`` is accepted for TorchRL's signature)."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        # shipped to another process, the owner is a client there
        return _same, (self.client(),)
