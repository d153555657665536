"""How a buffer is constructed: what ``ReplayBuffer(...)`` returns (:func:`service_for`: the
service a ``service_backend=`` asks for, or a buffer in this process), TorchRL's checks of the
arguments (:func:`check_args`), and the storage, sampler, writer and transforms built from them
(:func:`build`).

A *service* is a buffer hosted by another process and reached through a proxy:
``ReplayBuffer(..., service_backend="ray")`` returns a
:class:`~functional_rb.adapters.RayReplayBuffer` hosting a ``ReplayBuffer`` built from the same
arguments, as TorchRL's does. Service backends register a factory here (:func:`register`) from
their own module, so that the buffer classes do not import them; ``"direct"`` (no service: the
buffer lives in this process) is the default. TorchRL's deprecated spelling
``use_ray_service=True`` still means ``service_backend="ray"`` (with TorchRL's
``FutureWarning``).

Arguments left out are read from the enclosing
:func:`~functional_rb.adapters.service_backend` / :func:`~functional_rb.adapters.transport_backend`
contexts (an explicit argument wins); a ``ValueError`` refusing a value a context chose says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

from functional_rb.adapters import errors
from functional_rb.adapters.comm import backends as scoped
from functional_rb.adapters.replay_buffers._transforms import TransformChain
from functional_rb.adapters.sample_units import SampleUnit
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.consuming import consuming_sampler
from functional_rb.adapters.samplers.random import RandomSampler
from functional_rb.adapters.storages.base import Storage
from functional_rb.adapters.storages.list import ListStorage
from functional_rb.adapters.writers.base import Writer

__all__ = [
    "Components",
    "backends",
    "build",
    "check_args",
    "register",
    "service_for",
]

_BACKENDS: dict[str, Callable] = {}
_SERVICE_CLASSES: set[type] = set()  # the proxies the factories return


def register(name: str, factory: Callable, service_cls: type) -> None:
    """``factory(cls, *args, **kwargs)`` builds ``cls(..., service_backend=name)``, an
    instance of ``service_cls``."""
    _BACKENDS[name] = factory
    _SERVICE_CLASSES.add(service_cls)


def backends() -> tuple[str, ...]:
    return ("direct", *sorted(_BACKENDS))


def service_for(cls: type, args: tuple, kwargs: dict):
    """What ``cls(*args, **kwargs)`` returns in place of a new ``cls`` (called by
    ``ReplayBuffer.__new__``): the service a registered ``service_backend`` builds, or None
    for a buffer in this process, whose backend arguments are checked here (a service class
    such as ``RayReplayBuffer`` checks its own)."""
    kwargs = dict(kwargs)
    if kwargs.pop("use_ray_service", False):
        if kwargs.get("service_backend") not in (None, "ray"):
            raise ValueError(
                f"use_ray_service=True conflicts with service_backend={kwargs['service_backend']!r}."
            )
        warnings.warn(
            "use_ray_service is deprecated and will be removed in v0.16. Use "
            "service_backend='ray' instead.",
            FutureWarning,
            stacklevel=3,  # (the caller of ReplayBuffer(...))
        )
        kwargs["service_backend"] = "ray"
    # a service class itself (RayReplayBuffer), or a construction nested in a service
    # factory, was resolved by the caller: the context does not apply to it again
    service_cls = cls in _SERVICE_CLASSES
    resolved = service_cls or scoped.is_dispatching()
    from_service = _resolve(
        kwargs,
        "service_backend",
        scoped.normalize_service_backend,
        None if resolved else scoped.current_service_backend(),
    )
    from_transport = _resolve(kwargs, "transport", None, scoped.current_transport_backend())
    factory = None if resolved else _BACKENDS.get(kwargs.get("service_backend"))
    try:
        if factory is None:
            if not service_cls:
                _check_direct(cls.__name__, kwargs)
            return None
        del kwargs["service_backend"]
        with scoped.dispatching():
            return factory(cls, *args, **kwargs)
    except ValueError as err:
        message = str(err)
        service = from_service and "service_backend" in message
        transport = from_transport and "transport" in message
        if not (service or transport):
            raise
        raise ValueError(
            scoped.contextual_error(message, service=service, transport=transport)
        ) from err


def _check_direct(name: str, kwargs: dict) -> None:
    """TorchRL's checks of a direct buffer's backend arguments, with its errors."""
    service_backend = kwargs.get("service_backend", "direct")
    if service_backend != "direct":
        raise ValueError(
            f"{name} supports service_backend in {backends()}, not {service_backend!r}."
        )
    transport = kwargs.get("transport", "auto")
    if transport not in ("auto", "direct"):
        raise ValueError(
            f"A direct {name} only supports transport='auto' or 'direct' (got "
            f"{transport!r}); pass service_backend='ray' for a remote buffer."
        )
    if kwargs.get("service_backend_options") or kwargs.get("transport_options"):
        raise ValueError(
            f"{name}: service_backend_options / transport_options are only valid "
            "for a remote buffer (service_backend='ray')."
        )


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


def _component(obj, base: type, default: Callable, name: str, adapter: str):
    """A storage / sampler / writer from what the user passed (an object, a factory, None)."""
    if obj is None:
        obj = default()
    elif (
        not isinstance(obj, base)
        and callable(obj)
        and (
            isinstance(obj, type)
            or (
                not hasattr(obj, "sample")
                and not hasattr(obj, "extend")
                and not hasattr(obj, "get")
            )
        )
    ):  # a class (TorchRL's sampler=SamplerWithoutReplacement)
        obj = obj()
    if isinstance(obj, base):
        return obj
    fix = None
    if errors.is_torchrl(obj):
        cls = type(obj).__name__
        fix = (
            f"This is TorchRL's own class: use functional_rb.adapters.{cls} (the same name "
            "and arguments) with the functional_rb buffers."
            if errors.counterpart(cls) is not None
            else f"TorchRL's {cls} has no functional_rb counterpart yet; the adapters provide "
            f"{', '.join(errors.exported(base.__name__))}."
        )
    raise errors.not_an_adapter(
        adapter, name, f"{base.__name__} (or a callable returning one)", obj, fix=fix
    )


def check_args(
    sample_unit,
    consume_after_n_samples,
    prefetch,
    transform,
    transform_factory,
    batch_size,
    shared,
    dim_extend,
) -> None:
    """TorchRL's checks of a buffer's arguments, with its errors (the backend arguments were
    checked by :func:`service_for`)."""
    if sample_unit is not None and not isinstance(sample_unit, SampleUnit):
        raise TypeError(
            f"sample_unit must be a SampleUnit instance (functional_rb.adapters."
            f"sample_units), got {type(sample_unit).__name__}."
        )
    if consume_after_n_samples is not None:
        if isinstance(consume_after_n_samples, bool) or not isinstance(
            consume_after_n_samples, int
        ):
            raise TypeError("consume_after_n_samples must be a positive integer.")
        if consume_after_n_samples < 1:
            raise ValueError("consume_after_n_samples must be a positive integer.")
        if prefetch:
            raise ValueError("Prefetching is not supported when consume_after_n_samples is set.")
    if transform is not None and transform_factory is not None:
        raise TypeError("transform and transform_factory are mutually exclusive.")
    if batch_size is None and prefetch:
        raise ValueError(
            "Dynamic batch-size specification is incompatible with "
            "multithreaded sampling: pass batch_size with prefetch."
        )
    if shared and prefetch:
        raise ValueError("Cannot share prefetched replay buffers. Pass prefetch=0 or shared=False.")
    if dim_extend is not None and dim_extend < 0:
        raise ValueError("dim_extend must be a positive value.")


class Components(NamedTuple):
    """What :func:`build` makes of a buffer's arguments."""

    storage: Storage
    sampler: Sampler
    writer: Writer
    collate_fn: Callable
    transform: TransformChain


def build(args: dict, name: str, default_writer: type, batch_size, *, prefetch: bool) -> Components:
    """The components of buffer ``name`` from its constructor's ``args`` (storage, sampler,
    writer, collate_fn, transform, transform_factory, consume), with TorchRL's checks of how
    they combine; the writer is registered with the storage."""
    storage = _component(args["storage"], Storage, lambda: ListStorage(1000), "storage", name)
    sampler = _component(args["sampler"], Sampler, RandomSampler, "sampler", name)
    sampler = consuming_sampler(sampler, args["consume"])
    writer = _component(args["writer"], Writer, default_writer, "writer", name)
    writer.register_storage(storage)
    if sampler.reuses_slots:
        if prefetch:
            raise ValueError("Prefetching is not supported with ConsumingSampler.")
        if storage.ndim != 1:
            raise ValueError(
                "ConsumingSampler only supports 1-dimensional storages. Got "
                f"storage.ndim={storage.ndim}."
            )
        if not callable(getattr(writer, "write_at", None)):
            raise TypeError(
                f"{name}: ConsumingSampler requires a writer with a callable "
                "write_at(index, data) method (consumed slots are rewritten "
                "first); use RoundRobinWriter."
            )
    given = args["transform_factory"]() if args["transform_factory"] else args["transform"]
    transform = TransformChain()
    if given is not None:
        for t in given if isinstance(given, TransformChain) else [given]:
            transform.append(t)
    if batch_size is None and getattr(sampler, "drop_last", False):
        raise ValueError(
            "Samplers with drop_last=True must work with a predictable "
            "batch-size. Please pass the batch-size to the ReplayBuffer "
            "constructor."
        )
    return Components(
        storage, sampler, writer, args["collate_fn"] or storage.default_collate, transform
    )
