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

A service that comes back: ``checkpoint_every=`` / ``checkpoint_path=`` have the actor
``dumps`` the buffer (atomically) as it serves (:mod:`functional_rb.service.checkpoints`); with
Ray's ``max_restarts`` (``remote_config={"max_restarts": 3}``) a restarted actor ``loads`` the
newest checkpoint and clients go on: reads are sent again, an interrupted write raises
:class:`~functional_rb.service.ServiceInterrupted`, the distributed transport reconnects.
The actor's life (Ray's lease, start, kill on failure, close, pickling to a client) is
:mod:`functional_rb.service.actor`'s, shared with the core's service.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

from functional_rb.adapters.comm import backends as scoped
from functional_rb.adapters.comm import replay_service
from functional_rb.adapters.replay_buffers import _construction
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.service import runtime
from functional_rb.service.actor import ServiceActor, ServiceOwner
from functional_rb.service.checkpoints import Checkpointer, checkpoint_policy

__all__ = ["RayReplayBuffer"]

_WHERE = "RayReplayBuffer"
_DUNDERS = ("__len__", "__getitem__", "__setitem__", "__repr__")
_LIFECYCLE = frozenset({"client", "clients", "close", "shutdown", "start"})
# attributes whose value is a live component of the hosted buffer: a copy would mislead
_IN_ACTOR = frozenset(
    {"storage", "sampler", "writer", "transform", "lock", "generator", "prioritized_sampler"}
)
# calls that change nothing a checkpoint holds, and may be sent again after a restart
_UNCHANGING = frozenset(
    {"stats", "__len__", "__getitem__", "__repr__", "state_dict", "dumps", "save", "dump"}
)
_RETRIED = _UNCHANGING | {"sample"}  # (a sample moves a sampler: a change, sent again)


class _Self:
    """What the actor returns for "the buffer itself" (``append_transform`` returns it)."""

    def __reduce__(self):
        return "_SELF"


_SELF = _Self()


class _Host:
    """What the actor serves: the user's buffer, the iterator ``next()`` walks, the
    distributed transport's server and the checkpoints. Built again, from the same
    arguments, when Ray restarts the actor: it then loads the newest checkpoint."""

    def __init__(self, cls, args, kwargs, transport_options=None, checkpoint=None) -> None:
        self._iterator = None
        self._service = None  # the distributed transport's server
        # the Ray methods and the distributed transport's threads use the buffer in turn
        self._lock = threading.RLock()
        self._rb = cls(*args, **kwargs)
        self._checkpoints = None
        if checkpoint is not None:
            self._checkpoints = Checkpointer(
                checkpoint, save=self._rb.dumps, load=self._rb.loads, lock=self._lock, where=_WHERE
            )
            if self._checkpoints.restore() is not None:
                self._checkpoints.restored.update(
                    items=len(self._rb), write_count=int(self._rb.write_count)
                )
            self._checkpoints.start()
        if transport_options is not None:
            options = dict(transport_options)
            ray = runtime.import_ray(_WHERE)
            host = options.pop("host", None) or ray.util.get_node_ip_address()
            self._service = replay_service.ReplayService(
                self._rb,
                self._lock,
                host=host,
                where=_WHERE,
                changed=self._changed,
                extra_stats=self._checkpoint_stats,
                **options,
            )

    def _changed(self, items: int) -> None:
        if self._checkpoints is not None:
            self._checkpoints.changed(items)

    def _checkpoint_stats(self) -> dict:
        return {} if self._checkpoints is None else self._checkpoints.stats()

    def call(self, name: str, args, kwargs):
        if name.startswith("_") and name not in _DUNDERS:
            raise AttributeError(f"{_WHERE}: {name!r} is private to the hosted buffer.")
        with self._lock:
            before = self._rb.write_count if self._checkpoints is not None else 0
            out = getattr(self._rb, name)(*args, **kwargs)
            if name == "stats":
                out = dict(out, **self._checkpoint_stats())
            elif name not in _UNCHANGING:
                self._changed(max(0, int(self._rb.write_count) - int(before)))
        return _SELF if out is self._rb else out

    def get(self, name: str):
        with self._lock:
            out = getattr(self._rb, name)
        return _SELF if out is self._rb else out

    def set(self, name: str, value) -> None:
        with self._lock:
            setattr(self._rb, name, value)
            self._changed(0)

    # the distributed transport: started with the actor, bootstrapped by each client
    def distributed_connect(self) -> dict:
        if self._service is None:
            raise RuntimeError(f"{_WHERE}: the distributed transport is not running.")
        return self._service.connect()

    def distributed_bind(self, op: str, layout):
        return self._service.bind(op, layout)

    def close(self) -> list[str]:
        """Stop the distributed transport (the threads still running are returned) and
        write a last checkpoint."""
        service, self._service = self._service, None
        left = [] if service is None else service.close()
        if self._checkpoints is not None:
            self._checkpoints.close()
        return left

    def next(self):
        """The next batch of ``iter(buffer)``; None (and a fresh iterator next time) at the
        end of an epoch."""
        if self._iterator is None:
            self._iterator = iter(self._rb)
        try:
            with self._lock:
                out = next(self._iterator)
                self._changed(0)
                return out
        except StopIteration:
            self._iterator = None
            return None


def _to_cpu(value):
    return value.to("cpu") if callable(getattr(value, "to", None)) else value


class _RayClient:
    """A picklable handle on the actor: the buffer's methods as remote calls, without the
    lifecycle (``close``, ``shutdown``, ``client``). Through a restart of the actor, reads
    are sent again and an interrupted write raises ``ServiceInterrupted``."""

    def __init__(self, actor, has_gpu: bool) -> None:
        self._actor = actor
        self.has_gpu = has_gpu

    def _remote(self, method: str, name: str, *args, retry: bool):
        return runtime.call(self._actor, method, name, *args, where=f"{_WHERE}.{name}", retry=retry)

    def _call(self, name: str, args=(), kwargs=None):
        if not self.has_gpu:  # a CPU actor gets CPU tensors (TorchRL's rule)
            args = tuple(_to_cpu(a) for a in args)
            kwargs = {k: _to_cpu(v) for k, v in (kwargs or {}).items()}
        out = self._remote("call", name, args, kwargs or {}, retry=name in _RETRIED)
        return self if out is _SELF else out

    def _get(self, name: str):
        out = self._remote("get", name, retry=True)
        return self if out is _SELF else out

    def _set(self, name: str, value) -> None:
        self._remote("set", name, value, retry=False)

    # the methods of TorchRL's client, spelled out; the others go through __getattr__
    batch_size = property(lambda self: self._get("batch_size"))
    write_count = property(lambda self: self._get("write_count"))
    dim_extend = property(
        lambda self: self._get("dim_extend"), lambda self, value: self._set("dim_extend", value)
    )

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
        return runtime.call(self._actor, "next", where=f"{_WHERE}.next")

    def __iter__(self):
        while (data := self.next()) is not None:
            yield data

    def __getattr__(self, name: str):
        if name.startswith("_") or name in _LIFECYCLE:
            raise AttributeError(
                f"{type(self).__name__} has no lifecycle capability {name!r}."
                if name in _LIFECYCLE
                else name
            )
        if name in _IN_ACTOR:
            raise AttributeError(_in_actor(name))

        def remote_call(*args, **kwargs):
            return self._call(name, args, kwargs)

        remote_call.__name__ = name
        return remote_call


def _in_actor(name: str) -> str:
    return (
        f"{_WHERE}.{name}: the {name} lives in the Ray actor hosting the buffer; a copy "
        "here would not see its writes. Use the buffer's methods (sample, rb[...], "
        "stats(), state_dict(), ...), which run in the actor."
    )


class RayReplayBuffer(ServiceOwner, ReplayBuffer):
    """TorchRL's ``RayReplayBuffer``: a buffer hosted by a Ray actor, extended and sampled
    remotely.

    Keyword Args:
      replay_buffer_cls: the hosted class (default :class:`ReplayBuffer`; e.g.
        ``TensorDictReplayBuffer``, ``TensorDictPrioritizedReplayBuffer``).
      ray_init_config: ``ray.init`` keyword arguments, used only when Ray is not running yet
        (e.g. ``{"address": "auto"}`` to join a cluster).
      remote_config: ``ray.remote`` options of the actor (default ``{"num_cpus": 1}``);
        ``num_gpus > 0`` lets tensors reach the actor on their device (otherwise they are
        moved to CPU first); ``max_restarts`` has Ray restart the actor when its process
        dies (from the newest checkpoint, with ``checkpoint_every``).
      transport: ``"auto"`` or ``"ray"`` (Ray's object store), or ``"distributed"``
        (torch.distributed point-to-point between the actor and each client; the layout of
        each operation is bound by its first call). Default: the enclosing
        :func:`~functional_rb.adapters.transport_backend`, else ``"auto"``.
      transport_options: only for ``"distributed"``: ``timeout`` (seconds, default 300: the
        rendezvous and the default of each call's ``timeout=``), ``backend`` (``"gloo"``, or
        ``"nccl"`` for CUDA tensors), ``extend_spec`` / ``sample_spec`` / ``priority_spec``
        (TensorDict examples binding those layouts up front), ``host`` (the address the
        service listens on; default: the node's address as Ray knows it).
      checkpoint_every: seconds between checkpoints (``dumps`` of the whole buffer), or
        ``{"items": n}`` (written by the extend that brings the items written since the last
        one to ``n``), or both; needs ``checkpoint_path``.
      checkpoint_path: a directory on the actor's machine. The buffer starts from the newest
        checkpoint there, and so does its actor when Ray restarts it; ``stats()["restored"]``
        says what was loaded. ``close()`` writes a last one.
      delayed_init: passed to the hosted buffer.
      **kwargs: the hosted buffer's arguments (``storage``, ``sampler``, ``writer``,
        ``transform`` / ``transform_factory``, ``batch_size``, ...). Factories
        (``functools.partial(LazyTensorStorage, 100)``) avoid shipping built components.

    Examples:
      >>> from functools import partial
      >>> from functional_rb.adapters import LazyTensorStorage, RayReplayBuffer
      >>> rb = RayReplayBuffer(storage=partial(LazyTensorStorage, 1000),  # doctest: +SKIP
      ...                      batch_size=32, checkpoint_every=60.0,
      ...                      checkpoint_path="/data/rb", remote_config={"max_restarts": 3})
      >>> rb.stats()["restored"]                                          # doctest: +SKIP
      >>> rb.close()                                                      # doctest: +SKIP
    """

    _where = _WHERE
    # isinstance(rb, TensorDictReplayBuffer) sees the class of the hosted buffer (isinstance
    # reads __class__ when the type itself does not match)
    __class__ = property(lambda self: self.__dict__.get("_hosted_cls", RayReplayBuffer))

    def __init__(
        self,
        *args,
        replay_buffer_cls: type = ReplayBuffer,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        transport: str | None = None,
        transport_options: dict[str, Any] | None = None,
        checkpoint_every=None,
        checkpoint_path=None,
        delayed_init: bool = False,
        use_ray_service: bool = False,
        **kwargs,
    ) -> None:
        if "_service" in self.__dict__:
            # built by ReplayBuffer(..., service_backend="ray"), whose __new__ returned this
            # service; Python then calls __init__ again with the caller's arguments
            return
        del use_ray_service  # (TorchRL's spelling of service_backend="ray": read by __new__)
        backend = kwargs.pop("service_backend", None)
        backend = "ray" if backend is None else scoped.normalize_service_backend(backend)
        if backend != "ray":
            raise ValueError(
                f"{_WHERE}: service_backend={backend!r} contradicts the class "
                "(a RayReplayBuffer is the 'ray' backend); build "
                f"{replay_buffer_cls.__name__}(...) for an in-process buffer."
            )
        chosen = transport is None and scoped.current_transport_backend() is not None
        if transport is None:  # the enclosing transport_backend context's, else "auto"
            transport = scoped.current_transport_backend() or "auto"
        try:
            transport_options = _check_transport(transport, transport_options)
        except ValueError as err:
            if not (chosen and "transport" in str(err)):
                raise
            raise ValueError(scoped.contextual_error(str(err), transport=True)) from err
        if not (
            isinstance(replay_buffer_cls, type) and issubclass(replay_buffer_cls, ReplayBuffer)
        ):
            raise TypeError(
                f"{_WHERE}: replay_buffer_cls must be a functional_rb.adapters "
                f"replay buffer class, got {replay_buffer_cls!r}."
            )
        if remote_config is not None and not isinstance(remote_config, dict):
            raise TypeError(
                f"{_WHERE}: remote_config must be a dict of ray.remote options, "
                f"got {type(remote_config).__name__}."
            )
        policy = checkpoint_policy(checkpoint_every, checkpoint_path, _WHERE)
        options = {"num_cpus": 1} if remote_config is None else dict(remote_config)
        self._hosted_cls = replay_buffer_cls
        self._transport_kind = transport if transport == "distributed" else "ray"
        distributed = transport_options if transport == "distributed" else None
        # (the buffer's own errors raise here, as themselves)
        self._service = ServiceActor(
            _WHERE,
            _Host,
            (replay_buffer_cls, args, dict(kwargs, delayed_init=delayed_init)),
            {"transport_options": distributed, "checkpoint": policy},
            options=options,
            ray_init_config=ray_init_config,
        )
        self._client = self._payload = _RayClient(
            self._service.handle, has_gpu=(options.get("num_gpus") or 0) > 0
        )
        if distributed is not None:
            try:
                self._distributed = (self._client._get("batch_size"), distributed["timeout"])
            except BaseException:
                self._service.close()
                raise
            self._payload = self._distributed_client()

    def _distributed_client(self):
        batch_size, timeout = self._distributed
        return replay_service.DistributedReplayClient(
            self._client._actor, batch_size=batch_size, timeout=timeout
        )

    # ------------------------------------------------------------------ lifecycle
    service_backend = property(lambda self: "ray", doc="The deployment backend: ``'ray'``.")
    transport_kind = property(
        lambda self: self._transport_kind,
        doc="How payloads move: ``'ray'`` (the object store) or "
        "``'distributed'`` (torch.distributed).",
    )

    def start(self) -> RayReplayBuffer:
        if not self.is_alive:
            raise RuntimeError("A closed RayReplayBuffer cannot be restarted.")
        return self

    def _new_client(self):
        # (with transport="distributed", a client that connects in the process using it)
        if self._transport_kind == "distributed":
            return self._distributed_client()
        return _RayClient(self._client._actor, self._client.has_gpu)

    def _before_close(self) -> None:
        if self._transport_kind == "distributed":
            self._payload.disconnect()  # this process's connection, before the server

    def _after_close(self, stopped) -> None:
        # every connection thread, process group and the store ended before the actor
        if stopped:  # (a handler stuck in the buffer: killing the actor ended it)
            warnings.warn(
                f"{_WHERE}.close: the distributed transport's threads {stopped} "
                "did not stop in time; the actor was killed with them.",
                RuntimeWarning,
                stacklevel=3,
            )
        del self._client, self._payload

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

    write_count = property(
        lambda self: self._payload.write_count, doc="Items written so far (a remote read)."
    )

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else "closed"
        return f"{_WHERE}({self._hosted_cls.__name__} in a Ray actor, {state})"

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


def _check_transport(transport, transport_options):
    """The transport's options, checked (TorchRL's errors)."""
    if transport not in ("auto", "ray", "distributed"):
        raise ValueError("RayReplayBuffer transport must be 'auto', 'ray', or 'distributed'.")
    if transport in ("auto", "ray") and transport_options:
        raise ValueError("transport_options are not used by the Ray replay transport.")
    if transport == "distributed":
        return replay_service.check_options(transport_options, _WHERE)
    return transport_options


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
    if (
        (_name.startswith("_") and _name not in _DUNDERS[:3])
        or _name in RayReplayBuffer.__dict__
        or _name in ServiceOwner.__dict__
    ):
        continue
    _member = inspect.getattr_static(ReplayBuffer, _name)
    if isinstance(_member, property):
        setattr(RayReplayBuffer, _name, _forward_property(_name, _member.fset is not None))
    elif callable(_member):
        setattr(RayReplayBuffer, _name, _forward_method(_name))
del _name, _member


_SERVICE_OPTIONS = ("ray_init_config", "remote_config", "checkpoint_every", "checkpoint_path")


def _ray_service(cls, *args, service_backend_options=None, **kwargs):
    """``cls(..., service_backend="ray", service_backend_options={"ray_init_config": ...,
    "remote_config": ..., "checkpoint_every": ..., "checkpoint_path": ...})`` (the last two
    may also be given as keyword arguments of ``cls``)."""
    options = dict(service_backend_options or {})
    unknown = sorted(set(options) - set(_SERVICE_OPTIONS))
    if unknown:
        raise TypeError(f"Unexpected Ray replay-buffer service options: {unknown}")
    both = sorted(set(options) & set(kwargs))
    if both:
        raise TypeError(
            f"{_WHERE}: {both} given both as arguments and in "
            "service_backend_options; give each once."
        )
    return RayReplayBuffer(*args, replay_buffer_cls=cls, **options, **kwargs)


_construction.register("ray", _ray_service, RayReplayBuffer)
