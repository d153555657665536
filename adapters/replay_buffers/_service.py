"""Which class a buffer constructor returns: TorchRL's ``service_backend=`` dispatch.

``ReplayBuffer(..., service_backend="ray")`` returns a
:class:`~functional_rb.adapters.RayReplayBuffer` hosting a ``ReplayBuffer`` built from the same
arguments, as TorchRL's metaclass does. Backends register a factory here
(:func:`register`) from their own module, so that the buffer classes do not import them;
``"direct"`` (the in-process buffer) is the default. TorchRL's deprecated spelling
``use_ray_service=True`` still means ``service_backend="ray"`` (with TorchRL's
``FutureWarning``).
"""
from __future__ import annotations

import warnings
from typing import Callable

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
        if cls.__dict__.get("_service_backend_resolved", False):
            return super().__call__(*args, **kwargs)
        if kwargs.pop("use_ray_service", False):
            if kwargs.get("service_backend") not in (None, "ray"):
                raise ValueError("use_ray_service=True conflicts with "
                                 f"service_backend={kwargs['service_backend']!r}.")
            warnings.warn("use_ray_service is deprecated and will be removed in v0.16. Use "
                          "service_backend='ray' instead.", FutureWarning, stacklevel=2)
            kwargs["service_backend"] = "ray"
        factory = _BACKENDS.get(kwargs.get("service_backend"))
        if factory is None:  # "direct", or a name __init__ rejects with the list
            return super().__call__(*args, **kwargs)
        del kwargs["service_backend"]
        return factory(cls, *args, **kwargs)

    def __instancecheck__(cls, instance) -> bool:
        if super().__instancecheck__(instance):
            return True
        hosted = getattr(instance, "__dict__", {}).get("_service_cls")
        return isinstance(hosted, type) and issubclass(hosted, cls)
