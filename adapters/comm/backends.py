"""TorchRL's scoped construction defaults: ``service_backend(...)`` and ``transport_backend(...)``.

Inside ``with service_backend("ray"):`` a buffer built without ``service_backend=`` is built as
if it had been passed; ``transport_backend("distributed")`` does the same for ``transport=``.
An explicit constructor argument always wins. The names, accepted values and aliases
(``"threading"`` -> ``"thread"``, ``"multiprocessing"`` -> ``"process"``) are TorchRL's: a value
TorchRL knows but a constructor does not support is accepted here and refused by the
constructor, whose error then names the context that selected it (:func:`contextual_error`).

The defaults live in :mod:`contextvars` (so threads and asyncio tasks see the value of the
context they run in) tagged with the process id: a process forked inside the ``with`` block
does not inherit it, because a worker building a buffer must not become the owner of yet
another service.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

__all__ = [
    "SERVICE_BACKENDS",
    "TRANSPORT_BACKENDS",
    "contextual_error",
    "current_service_backend",
    "current_transport_backend",
    "dispatching",
    "is_dispatching",
    "normalize_service_backend",
    "normalize_transport_backend",
    "service_backend",
    "transport_backend",
]

SERVICE_BACKENDS = frozenset(
    {"direct", "thread", "process", "ray", "rpc", "submitit", "monarch", "distributed"}
)
SERVICE_ALIASES = {"threading": "thread", "multiprocessing": "process"}
TRANSPORT_BACKENDS = frozenset(
    {
        "auto",
        "direct",
        "thread",
        "queue",
        "process",
        "shared_memory",
        "ray",
        "monarch",
        "distributed",
    }
)

_SERVICE = contextvars.ContextVar("functional_rb_service_backend", default=None)
_TRANSPORT = contextvars.ContextVar("functional_rb_transport_backend", default=None)
# set while a service factory builds its service: constructions nested in it (the service's
# own wrapper class) were resolved by the outer call and must not dispatch again
_DISPATCHING = contextvars.ContextVar("functional_rb_service_dispatching", default=None)


def normalize_service_backend(backend: str) -> str:
    """The canonical name of a service backend (aliases resolved); ``ValueError`` when unknown."""
    canonical = SERVICE_ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if canonical not in SERVICE_BACKENDS:
        choices = sorted(SERVICE_BACKENDS | set(SERVICE_ALIASES))
        raise ValueError(f"Unsupported service backend {backend!r}. Expected one of {choices}.")
    return canonical


def normalize_transport_backend(backend: str) -> str:
    """A validated transport name; ``ValueError`` when unknown."""
    if not isinstance(backend, str) or backend not in TRANSPORT_BACKENDS:
        raise ValueError(
            f"Unsupported transport backend {backend!r}. Expected one of "
            f"{sorted(TRANSPORT_BACKENDS)}."
        )
    return backend


def _this_process(var: contextvars.ContextVar) -> str | None:
    value = var.get()
    if value is None or value[0] != os.getpid():  # set by the parent before a fork
        return None
    return value[1]


def current_service_backend() -> str | None:
    """The backend of the innermost enclosing :func:`service_backend` of this process."""
    return _this_process(_SERVICE)


def current_transport_backend() -> str | None:
    """The transport of the innermost enclosing :func:`transport_backend` of this process."""
    return _this_process(_TRANSPORT)


def contextual_error(message: str, *, service: bool = False, transport: bool = False) -> str:
    """``message``, saying which enclosing context chose the refused value."""
    contexts = [
        name
        for name, chosen in (
            ("functional_rb.adapters.service_backend", service),
            ("functional_rb.adapters.transport_backend", transport),
        )
        if chosen
    ]
    if not contexts:
        return message
    return f"{message} (selected by an enclosing {' and '.join(contexts)} context.)"


@contextlib.contextmanager
def dispatching() -> Iterator[None]:
    """Mark this process as building a service: nested constructions ignore the context."""
    token = _DISPATCHING.set(os.getpid())
    try:
        yield
    finally:
        _DISPATCHING.reset(token)


def is_dispatching() -> bool:
    return _DISPATCHING.get() == os.getpid()


@contextlib.contextmanager
def service_backend(backend: str) -> Iterator[None]:
    """Set the default ``service_backend`` of the buffers constructed in this block.

    TorchRL's ``torchrl.service_backend``. An explicit ``service_backend=`` argument takes
    precedence; the default is local to the current context and process (a forked worker does
    not inherit it) and the previous one is restored on exit.

    Args:
      backend: ``"direct"``, ``"ray"`` (the values the buffers support), or another of
        TorchRL's backend names, which the buffers then refuse naming this context.

    Examples:
      >>> from functional_rb.adapters import ReplayBuffer, service_backend
      >>> with service_backend("direct"):
      ...     rb = ReplayBuffer()
      >>> rb.service_backend
      'direct'
    """
    token = _SERVICE.set((os.getpid(), normalize_service_backend(backend)))
    try:
        yield
    finally:
        _SERVICE.reset(token)


@contextlib.contextmanager
def transport_backend(backend: str) -> Iterator[None]:
    """Set the default ``transport`` of the buffers constructed in this block.

    TorchRL's ``torchrl.transport_backend``. An explicit ``transport=`` argument takes
    precedence; constructors still check that the transport suits their service backend (a
    direct buffer accepts only ``"auto"`` / ``"direct"``, a Ray-hosted one ``"auto"``,
    ``"ray"`` and ``"distributed"``). Scoped like :func:`service_backend`.

    Examples:
      >>> from functional_rb.adapters import ReplayBuffer, transport_backend
      >>> with transport_backend("direct"):
      ...     rb = ReplayBuffer()
      >>> rb.service_backend
      'direct'
    """
    token = _TRANSPORT.set((os.getpid(), normalize_transport_backend(backend)))
    try:
        yield
    finally:
        _TRANSPORT.reset(token)
