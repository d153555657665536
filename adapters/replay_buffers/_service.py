"""Which class a buffer constructor returns: TorchRL's ``service_backend=`` dispatch.

``ReplayBuffer(..., service_backend="ray")`` returns a
:class:`~functional_rb.adapters.RayReplayBuffer` hosting a ``ReplayBuffer`` built from the same
arguments, as TorchRL's metaclass does. Backends register a factory here
(:func:`register`) from their own module, so that the buffer classes do not import them;
``"direct"`` (the in-process buffer) is the default. TorchRL's deprecated spelling
``use_ray_service=True`` still means ``service_backend="ray"`` (with TorchRL's
``FutureWarning``).

Arguments left out are read from the enclosing
:func:`~functional_rb.adapters.service_backend` / :func:`~functional_rb.adapters.transport_backend`
contexts (an explicit argument wins); a ``ValueError`` refusing a value a context chose says so.
"""
from __future__ import annotations

import warnings
from typing import Callable

from functional_rb.adapters.comm import backends as scoped

__all__ = ["ServiceDispatch", "backends", "register"]

_BACKENDS: dict[str, Callable] = {}


def register(name: str, factory: Callable) -> None:
    """``factory(cls, *args, **kwargs)`` builds ``cls(..., service_backend=name)``."""
    _BACKENDS[name] = factory


def backends() -> tuple[str, ...]:
    return ("direct", *sorted(_BACKENDS))


class ServiceDispatch(type):
    """Metaclass of the buffers: a registered ``service_backend`` other than ``"direct"``
    builds the service instead of the class; ``isinstance`` sees through a service to the
    class it hosts (``isinstance(ray_td_buffer, TensorDictReplayBuffer)``)."""

    def __call__(cls, *args, **kwargs):
        if kwargs.pop("use_ray_service", False):
            if kwargs.get("service_backend") not in (None, "ray"):
                raise ValueError("use_ray_service=True conflicts with "
                                 f"service_backend={kwargs['service_backend']!r}.")
            warnings.warn("use_ray_service is deprecated and will be removed in v0.16. Use "
                          "service_backend='ray' instead.", FutureWarning, stacklevel=2)
            kwargs["service_backend"] = "ray"
        # a service class itself (RayReplayBuffer), or a construction nested in a service
        # factory, was resolved by the caller: the context does not apply to it again
        resolved = cls.__dict__.get("_service_backend_resolved", False) or \
            scoped.is_dispatching()
        from_service = _resolve(kwargs, "service_backend", scoped.normalize_service_backend,
                                None if resolved else scoped.current_service_backend())
        # (an explicit transport is checked by the constructor, as TorchRL's is)
        from_transport = _resolve(kwargs, "transport", None,
                                  scoped.current_transport_backend())
        factory = None if resolved else _BACKENDS.get(kwargs.get("service_backend"))
        try:
            if factory is None:  # "direct", or a name __init__ rejects with the list
                return super().__call__(*args, **kwargs)
            del kwargs["service_backend"]
            with scoped.dispatching():
                return factory(cls, *args, **kwargs)
        except ValueError as err:
            message = str(err)
            service = from_service and "service_backend" in message
            transport = from_transport and "transport" in message
            if not (service or transport):
                raise
            raise ValueError(scoped.contextual_error(message, service=service,
                                                     transport=transport)) from err

    def __instancecheck__(cls, instance) -> bool:
        if super().__instancecheck__(instance):
            return True
        hosted = getattr(instance, "__dict__", {}).get("_service_cls")
        return isinstance(hosted, type) and issubclass(hosted, cls)


def _resolve(kwargs: dict, name: str, normalize, scoped_default) -> bool:
    """Fill ``kwargs[name]`` from the context when the caller left it out (or passed None);
    whether the context chose it. An explicit value is normalized (TorchRL's aliases)."""
    value = kwargs.pop(name, None)
    if value is not None:
        kwargs[name] = value if normalize is None else normalize(value)
        return False
    if scoped_default is not None:
        kwargs[name] = scoped_default
        return True
    return False
