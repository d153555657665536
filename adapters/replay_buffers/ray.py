"""TorchRL's ``RayReplayBuffer``: any of the adapters' buffers, hosted by a Ray actor.

``RayReplayBuffer(storage=..., sampler=..., ...)`` (or ``ReplayBuffer(...,
service_backend="ray")``) starts Ray if it is not running (``ray_init_config``), builds the
buffer *inside* an actor (``remote_config``: ``ray.remote`` options) from the arguments the
user gave (components as objects or factories, transforms, ``replay_buffer_cls``) and forwards
every method as one remote call: ``extend``, ``add``, ``sample``, ``update_priority``,
``update_if_present``, ``state_dict`` / ``load_state_dict``, ``dumps`` / ``loads`` (paths on the
actor's machine), ``next()``, ``stats()``, ``len``, ``write_count``, ``rb[i]``, ... Methods
that return the buffer itself (``append_transform``) return this proxy.

:meth:`RayReplayBuffer.client` gives a picklable handle without lifecycle rights, to pass to
other Ray actors and tasks (pickling the buffer itself gives the same); :meth:`close` ends the
actor (and Ray, when this buffer started it). The components live in the actor: ``rb.storage``
and the like raise ``AttributeError`` here rather than hand out a copy that would not see the
actor's writes.

Transports: ``"auto"`` / ``"ray"`` move data through Ray's object store.
``"distributed"`` (TorchRL's) moves the payloads of ``extend`` / ``add`` / ``sample`` /
``stats`` / ``update_priority`` / ``update_tensordict_priority`` over torch.distributed (a gloo
or NCCL pair between the actor and each client process, rendezvoused through a ``TCPStore`` the
actor hosts): :mod:`functional_rb.adapters.comm.replay_service`. Ray then carries only the
bootstrap calls and the other methods (``state_dict``, ``rb[i]``, ``next()``, ...).
"""
from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

from functional_rb.adapters.comm import replay_service
from functional_rb.adapters.replay_buffers import _construction
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.service import runtime

__all__ = ["RayReplayBuffer"]

_WHERE = "RayReplayBuffer"
_DUNDERS = ("__len__", "__getitem__", "__setitem__", "__repr__")
_LIFECYCLE = frozenset({"client", "clients", "close", "shutdown", "start"})
# attributes whose value is a live component of the hosted buffer: a copy would mislead
_IN_ACTOR = frozenset({"storage", "sampler", "writer", "transform", "lock", "generator",
                       "prioritized_sampler"})


class _Self:
    """What the actor returns for "the buffer itself" (``append_transform`` returns it)."""

    def __reduce__(self):
        return "_SELF"


_SELF = _Self()


class _Host:
    """The object inside the actor: the user's buffer and the iterator ``next()`` walks."""

    def __init__(self, cls, args, kwargs) -> None:
        self._iterator = None
        self._service = None  # the distributed transport's server, when started
        # the Ray methods and the distributed transport's threads use the buffer in turn
        self._lock = threading.RLock()
        # an error here would reach the caller as Ray's ActorDiedError, its type lost: keep
        # it for ready() to raise as itself
        try:
            self._rb, self._error = cls(*args, **kwargs), None
        except Exception as e:
            self._rb, self._error = None, e

    def ready(self) -> None:
        if self._error is not None:
            raise self._error

    def call(self, name: str, args, kwargs):
        if name.startswith("_") and name not in _DUNDERS:
            raise AttributeError(f"{_WHERE}: {name!r} is private to the hosted buffer.")
        with self._lock:
            out = getattr(self._rb, name)(*args, **kwargs)
        return _SELF if out is self._rb else out

    def get(self, name: str):
        with self._lock:
            out = getattr(self._rb, name)
        return _SELF if out is self._rb else out

    def set(self, name: str, value) -> None:
        with self._lock:
            setattr(self._rb, name, value)

    # the distributed transport: started by the owner, bootstrapped by each client
    def distributed_start(self, options: dict) -> int | None:
        ray = runtime.import_ray(_WHERE)
        self._service = replay_service.ReplayService(
            self._rb, self._lock, host=ray.util.get_node_ip_address(), where=_WHERE,
            **options)
        return self._rb.batch_size

    def distributed_connect(self) -> dict:
        if self._service is None:
            raise RuntimeError(f"{_WHERE}: the distributed transport is not running.")
        return self._service.connect()

    def distributed_bind(self, op: str, layout):
        return self._service.bind(op, layout)

    def distributed_stop(self) -> list[str]:
        service, self._service = self._service, None
        return [] if service is None else service.close()

    def next(self):
        """The next batch of ``iter(buffer)``; None (and a fresh iterator next time) at the
        end of an epoch."""
        if self._iterator is None:
            self._iterator = iter(self._rb)
        try:
            with self._lock:
                return next(self._iterator)
        except StopIteration:
            self._iterator = None
            return None


def _to_cpu(value):
    return value.to("cpu") if callable(getattr(value, "to", None)) else value


class _RayClient:
    """A picklable handle on the actor: the buffer's methods as remote calls, without the
    lifecycle (``close``, ``shutdown``, ``client``)."""

    def __init__(self, actor, has_gpu: bool) -> None:
        self._actor = actor
        self.has_gpu = has_gpu

    def _remote(self, method: str, *args):
        return runtime.get(getattr(self._actor, method).remote(*args), f"{_WHERE}.{args[0]}")

    def _call(self, name: str, args=(), kwargs=None):
        if not self.has_gpu:  # a CPU actor gets CPU tensors (TorchRL's rule)
            args = tuple(_to_cpu(a) for a in args)
            kwargs = {k: _to_cpu(v) for k, v in (kwargs or {}).items()}
        out = self._remote("call", name, args, kwargs or {})
        return self if out is _SELF else out

    def _get(self, name: str):
        out = self._remote("get", name)
        return self if out is _SELF else out

    def _set(self, name: str, value) -> None:
        self._remote("set", name, value)

    # the methods of TorchRL's client, spelled out; the others go through __getattr__
    batch_size = property(lambda self: self._get("batch_size"))
    write_count = property(lambda self: self._get("write_count"))
    dim_extend = property(lambda self: self._get("dim_extend"),
                          lambda self, value: self._set("dim_extend", value))

    def extend(self, *args, **kwargs):
        return self._call("extend", args, kwargs)

    def add(self, *args, **kwargs):
        return self._call("add", args, kwargs)

    def sample(self, *args, **kwargs):
        return self._call("sample", args, kwargs)

    def update_priority(self, *args, **kwargs):
        return self._call("update_priority", args, kwargs)

    def update_if_present(self, **kwargs):
        return self._call("update_if_present", (), kwargs)

    def stats(self) -> dict:
        return self._call("stats")

    def __len__(self) -> int:
        return self._call("__len__")

    def __getitem__(self, index):
        return self._call("__getitem__", (index,))

    def __setitem__(self, index, value) -> None:
        self._call("__setitem__", (index, value))

    def next(self):
        """The next batch of an epoch over the buffer; None at its end."""
        return runtime.get(self._actor.next.remote(), f"{_WHERE}.next")

    def __iter__(self):
        while (data := self.next()) is not None:
            yield data

    def __getattr__(self, name: str):
        if name.startswith("_") or name in _LIFECYCLE:
            raise AttributeError(f"{type(self).__name__} has no lifecycle capability {name!r}."
                                 if name in _LIFECYCLE else name)
        if name in _IN_ACTOR:
            raise AttributeError(_in_actor(name))

        def remote_call(*args, **kwargs):
            return self._call(name, args, kwargs)
        remote_call.__name__ = name
        return remote_call


def _in_actor(name: str) -> str:
    return (f"{_WHERE}.{name}: the {name} lives in the Ray actor hosting the buffer; a copy "
            "here would not see its writes. Use the buffer's methods (sample, rb[...], "
            "stats(), state_dict(), ...), which run in the actor.")


class RayReplayBuffer(ReplayBuffer):
    """TorchRL's ``RayReplayBuffer``: a buffer hosted by a Ray actor, extended and sampled
    remotely.

    Keyword Args:
      replay_buffer_cls: the hosted class (default :class:`ReplayBuffer`; e.g.
        ``TensorDictReplayBuffer``, ``TensorDictPrioritizedReplayBuffer``).
      ray_init_config: ``ray.init`` keyword arguments, used only when Ray is not running yet
        (e.g. ``{"address": "auto"}`` to join a cluster).
      remote_config: ``ray.remote`` options of the actor (default ``{"num_cpus": 1}``);
        ``num_gpus > 0`` lets tensors reach the actor on their device (otherwise they are
        moved to CPU first).
      transport: ``"auto"`` or ``"ray"`` (Ray's object store), or ``"distributed"``
        (torch.distributed point-to-point between the actor and each client; the layout of
        each operation is bound by its first call). Default: the enclosing
        :func:`~functional_rb.adapters.transport_backend`, else ``"auto"``.
      transport_options: only for ``"distributed"``: ``timeout`` (seconds, default 300: the
        rendezvous and the default of each call's ``timeout=``), ``backend`` (``"gloo"``, or
        ``"nccl"`` for CUDA tensors), ``extend_spec`` / ``sample_spec`` / ``priority_spec``
        (TensorDict examples binding those layouts up front).
      delayed_init: passed to the hosted buffer.
      **kwargs: the hosted buffer's arguments (``storage``, ``sampler``, ``writer``,
        ``transform`` / ``transform_factory``, ``batch_size``, ...). Factories
        (``functools.partial(LazyTensorStorage, 100)``) avoid shipping built components.
    """

    _service_backend_resolved = True

    def __init__(self, *args, replay_buffer_cls: type = ReplayBuffer,
                 ray_init_config: dict[str, Any] | None = None,
                 remote_config: dict[str, Any] | None = None, transport: str = "auto",
                 transport_options: dict[str, Any] | None = None,
                 delayed_init: bool = False, **kwargs) -> None:
        backend = kwargs.pop("service_backend", "ray")
        if backend != "ray":
            raise ValueError(f"{_WHERE}: service_backend={backend!r} contradicts the class "
                             "(a RayReplayBuffer is the 'ray' backend); build "
                             f"{replay_buffer_cls.__name__}(...) for an in-process buffer.")
        if transport not in ("auto", "ray", "distributed"):
            raise ValueError("RayReplayBuffer transport must be 'auto', 'ray', or "
                             "'distributed'.")
        if transport in ("auto", "ray") and transport_options:
            raise ValueError("transport_options are not used by the Ray replay transport.")
        if transport == "distributed":
            transport_options = replay_service.check_options(transport_options, _WHERE)
        if not (isinstance(replay_buffer_cls, type) and issubclass(replay_buffer_cls,
                                                                    ReplayBuffer)):
            raise TypeError(f"{_WHERE}: replay_buffer_cls must be a functional_rb.adapters "
                            f"replay buffer class, got {replay_buffer_cls!r}.")
        if remote_config is not None and not isinstance(remote_config, dict):
            raise TypeError(f"{_WHERE}: remote_config must be a dict of ray.remote options, "
                            f"got {type(remote_config).__name__}.")
        options = {"num_cpus": 1} if remote_config is None else dict(remote_config)
        self._lease = runtime.RayRuntime.acquire(_WHERE, ray_init_config)
        ray = runtime.import_ray(_WHERE)
        self._service_cls = replay_buffer_cls
        self._transport_kind = transport if transport == "distributed" else "ray"
        try:
            actor = ray.remote(**options)(_Host).remote(
                replay_buffer_cls, args, dict(kwargs, delayed_init=delayed_init))
            self._client = _RayClient(actor, has_gpu=(options.get("num_gpus") or 0) > 0)
            runtime.get(actor.ready.remote(), _WHERE)  # the buffer's own errors raise here
            self._payload = self._client
            if transport == "distributed":
                batch_size = runtime.get(actor.distributed_start.remote(transport_options),
                                         _WHERE)
                self._distributed = (batch_size, transport_options["timeout"])
                self._payload = self._distributed_client()
        except BaseException:
            if "_client" in self.__dict__:
                ray.kill(self._client._actor, no_restart=True)
                del self._client
            self._lease.release()
            raise

    def _distributed_client(self):
        batch_size, timeout = self._distributed
        return replay_service.DistributedReplayClient(self._client._actor,
                                                      batch_size=batch_size, timeout=timeout)

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_alive(self) -> bool:
        return "_client" in self.__dict__

    service_backend = property(lambda self: "ray", doc="The deployment backend: ``'ray'``.")
    transport_kind = property(lambda self: self._transport_kind,
                              doc="How payloads move: ``'ray'`` (the object store) or "
                                  "``'distributed'`` (torch.distributed).")

    def start(self) -> "RayReplayBuffer":
        if not self.is_alive:
            raise RuntimeError("A closed RayReplayBuffer cannot be restarted.")
        return self

    def client(self):
        """A picklable handle without shutdown rights, for other actors and tasks (with
        ``transport="distributed"``, a client that connects in the process using it)."""
        if not self.is_alive:
            raise RuntimeError("RayReplayBuffer is closed.")
        if self._transport_kind == "distributed":
            return self._distributed_client()
        return _RayClient(self._client._actor, self._client.has_gpu)

    def clients(self, num_clients: int) -> list:
        """One handle per concurrent consumer."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError("num_clients must be an integer.")
        if num_clients < 1:
            raise ValueError("num_clients must be at least 1.")
        return [self.client() for _ in range(num_clients)]

    def close(self) -> None:
        """End the actor (and Ray, when this buffer started it)."""
        if not self.is_alive:
            return
        ray = runtime.import_ray(_WHERE)
        left = []
        try:
            if self._transport_kind == "distributed":
                self._payload.disconnect()
                # every connection thread, process group and the store end before the actor
                left = runtime.get(self._client._actor.distributed_stop.remote(), _WHERE)
        except Exception:  # the actor is gone already: so is everything it served
            pass
        if left:  # (a handler stuck in the buffer: killing the actor ends it)
            warnings.warn(f"{_WHERE}.close: the distributed transport's threads {left} did "
                          "not stop in time; the actor is killed with them.", RuntimeWarning)
        try:
            ray.kill(self._client._actor, no_restart=True)
        except Exception:  # already gone with ray.shutdown(): nothing left to end
            pass
        del self._client, self._payload
        self._lease.release()

    def shutdown(self, timeout: float | None = None) -> None:
        """:meth:`close` (``timeout`` is accepted for TorchRL's signature; killing the actor
        does not wait)."""
        self.close()

    def __reduce__(self):
        # shipped to another process (ray.remote(fn).remote(rb)), the buffer is a client there
        if self._transport_kind == "distributed":
            return self._payload.__reduce__()
        return _RayClient, (self._client._actor, self._client.has_gpu)

    # ------------------------------------------------------------------ payloads
    # (through the transport: the object store, or torch.distributed)
    def extend(self, *args, **kwargs):
        return self._payload.extend(*args, **kwargs)

    def add(self, *args, **kwargs):
        return self._payload.add(*args, **kwargs)

    def sample(self, *args, **kwargs):
        return self._payload.sample(*args, **kwargs)

    def update_priority(self, *args, **kwargs):
        return self._payload.update_priority(*args, **kwargs)

    def update_tensordict_priority(self, *args, **kwargs):
        return self._payload.update_tensordict_priority(*args, **kwargs)

    def update_if_present(self, **kwargs):
        return self._payload.update_if_present(**kwargs)

    def stats(self, **kwargs) -> dict:
        return self._payload.stats(**kwargs)

    def __len__(self) -> int:
        return len(self._payload)

    write_count = property(lambda self: self._payload.write_count,
                           doc="Items written so far (a remote read).")

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else "closed"
        return f"{_WHERE}({self._service_cls.__name__} in a Ray actor, {state})"

    # ------------------------------------------------------------------ forwarded
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _IN_ACTOR:
            raise AttributeError(_in_actor(name))
        if "_client" not in self.__dict__:
            raise AttributeError(f"{_WHERE}.{name}: the buffer is closed.")
        return getattr(self._client, name)

    def __iter__(self):
        return iter(self._client)

    def next(self):
        return self._client.next()


def _forward_method(name: str):
    def method(self, *args, **kwargs):
        out = self._client._call(name, args, kwargs)
        return self if out is self._client else out
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` of the hosted buffer, as one remote call."
    return method


def _forward_property(name: str, settable: bool):
    def fget(self):
        if name in _IN_ACTOR:
            raise AttributeError(_in_actor(name))
        return self._client._get(name)
    fset = (lambda self, value: self._client._set(name, value)) if settable else None
    return property(fget, fset, doc=f"``{name}`` of the hosted buffer (a remote read).")


# Every public member the direct buffer has is a remote call here, unless defined above.
for _name in sorted(set(dir(ReplayBuffer))):
    if (_name.startswith("_") and _name not in _DUNDERS[:3]) or _name in RayReplayBuffer.__dict__:
        continue
    _member = inspect.getattr_static(ReplayBuffer, _name)
    if isinstance(_member, property):
        setattr(RayReplayBuffer, _name, _forward_property(_name, _member.fset is not None))
    elif callable(_member):
        setattr(RayReplayBuffer, _name, _forward_method(_name))
del _name, _member


def _ray_service(cls, *args, service_backend_options=None, **kwargs):
    """``cls(..., service_backend="ray", service_backend_options={"ray_init_config": ...,
    "remote_config": ...})``."""
    options = dict(service_backend_options or {})
    ray_init_config = options.pop("ray_init_config", None)
    remote_config = options.pop("remote_config", None)
    if options:
        raise TypeError(f"Unexpected Ray replay-buffer service options: {sorted(options)}")
    return RayReplayBuffer(*args, replay_buffer_cls=cls, ray_init_config=ray_init_config,
                           remote_config=remote_config, **kwargs)


_construction.register("ray", _ray_service)
