"""A replay buffer served over the distributed channels: TorchRL's ``transport="distributed"``.

:class:`ReplayService` runs where the buffer lives (a Ray actor) and serves ``extend``,
``add``, ``sample``, ``stats`` (``len``, ``write_count``), ``update_priority`` and
``update_tensordict_priority`` over :mod:`.distributed` channels.
:class:`DistributedReplayClient` is the picklable handle the users' processes call; it
connects lazily, in the process that uses it, through two bootstrap calls on the actor (which
must provide ``distributed_connect()``, ``distributed_bind(op, layout)`` and, for
``dim_extend``, ``get(name)`` / ``set(name, value)``); payloads never travel through Ray.

TorchRL's rules: the layout (keys, shapes, dtypes, batch size) of each operation is bound by its
first call, from any client, or by ``extend_spec`` / ``sample_spec`` / ``priority_spec``; a call
with another layout raises ``ValueError`` before anything is sent, and ``sample`` is bound to
one batch size. Replies may change layout (it is announced when it does), except a sample that
``sample_spec`` declared. ``update_if_present`` is not served (``transport='ray'`` does it).

Who is served (:mod:`.distributed`, :mod:`.wire`): ``distributed_connect`` hands each client
process, through Ray, a grant holding the service's secret, which its connection proves
before anything is served; nothing read from the store is unpickled. The service listens on
``transport_options["host"]`` (default: the node's address as Ray knows it), not on every
interface.

Restarts. Each start of the service has its own secret and ``incarnation``: when the actor
was restarted by Ray (``max_restarts``), a client's next call finds its connection gone,
waits until the actor is back, and connects again; a read (``sample``, ``stats``, ``len``) is
sent again, and an interrupted write raises
:class:`~functional_rb.service.ServiceInterrupted`.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_rb.adapters.comm.distributed import (
    ChannelClient,
    ChannelServer,
    ServiceGone,
    check_backend,
)
from functional_rb.adapters.comm.message_layout import MessageLayout, conform, flatten
from functional_rb.service import runtime

__all__ = ["OPTIONS", "DistributedReplayClient", "ReplayService", "check_options"]

# TorchRL's options, and ours: "host" (the address the service listens on)
OPTIONS = ("timeout", "backend", "extend_spec", "sample_spec", "priority_spec", "host")
_PAYLOAD_OPS = ("extend", "add", "update_priority", "update_tensordict_priority")
_EMPTY = flatten(None, where="", strict=True)[1]
_LIFECYCLE = frozenset({"start", "shutdown", "close", "client", "clients"})


def check_options(options: dict | None, where: str) -> dict:
    """``transport_options`` for ``transport='distributed'``, checked: TorchRL's keys only."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(
            f"{where}: unexpected distributed transport_options {unknown}; "
            f"accepted: {list(OPTIONS)}."
        )
    timeout = options.setdefault("timeout", 300.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(
            f"{where}: transport_options['timeout'] must be a positive number of "
            f"seconds, got {timeout!r}."
        )
    options.setdefault("backend", "gloo")
    if options["backend"] not in ("gloo", "nccl"):
        check_backend(options["backend"], where)  # (raises, naming the choices)
    host = options.get("host")
    if host is not None and (not isinstance(host, str) or not host):
        raise TypeError(
            f"{where}: transport_options['host'] must be the address to listen on "
            f"(a str such as '10.0.0.5'), got {host!r}."
        )
    for name in ("extend_spec", "sample_spec", "priority_spec"):
        spec = options.get(name)
        if spec is not None and not isinstance(spec, TensorDictBase):
            raise TypeError(
                f"{where}: transport_options[{name!r}] must be a TensorDict "
                f"example of the payload, got {type(spec).__name__}."
            )
    if options.get("sample_spec") is not None and not options["sample_spec"].batch_size:
        raise ValueError(f"{where}: sample_spec must have a non-empty batch size.")
    return options


class ReplayService:
    """Serves ``buffer`` to distributed clients. ``lock`` serializes the buffer's use with
    the other callers of the process (the actor's Ray methods). ``changed(items)`` runs
    (holding ``lock``) after every call but ``stats``, with the items it wrote;
    ``extra_stats()`` adds to ``stats``' reply (a service's checkpoints)."""

    def __init__(
        self,
        buffer,
        lock,
        *,
        host: str,
        where: str,
        timeout: float = 300.0,
        backend: str = "gloo",
        extend_spec=None,
        sample_spec=None,
        priority_spec=None,
        changed: Callable[[int], None] | None = None,
        extra_stats: Callable[[], dict] | None = None,
    ) -> None:
        self._buffer, self._lock, self._where = buffer, lock, where
        self._changed, self._extra_stats = changed, extra_stats
        self._incarnation = secrets.token_hex(8)
        self._binding = threading.Lock()
        self._bound: dict[str, Any] = {}  # op -> request MessageLayout ("sample": a batch size)
        self._sample_reply = None
        self._device = check_backend(backend, where)
        if extend_spec is not None:
            self.bind("extend", _layout(extend_spec, f"{where}: extend_spec"))
        if sample_spec is not None:
            self.bind("sample", int(sample_spec.batch_size[0]))
            self._sample_reply = _layout(sample_spec, f"{where}: sample_spec")
            if priority_spec is None:  # TorchRL's default: priorities are updated on samples
                priority_spec = sample_spec
        if priority_spec is not None:
            self.bind(
                "update_tensordict_priority", _layout(priority_spec, f"{where}: priority_spec")
            )
        self._settings = {"backend": backend, "timeout": float(timeout)}
        self._server = ChannelServer(
            self, host=host, backend=backend, timeout=timeout, name=f"{where} (distributed)"
        )

    # ------------------------------------------------------------------ bootstrap (Ray)
    def connect(self) -> dict:
        """What a client needs to open its connection (its grant holds the service's
        secret: this goes to the client through Ray, and nowhere else)."""
        with self._binding:
            bound = dict(self._bound)
        return dict(
            self._settings,
            address=self._server.address,
            grant=self._server.accept(),
            bound=bound,
            incarnation=self._incarnation,
        )

    def bind(self, op: str, layout):
        """Bind ``op``'s request layout (a sample's batch size) unless bound; the bound one."""
        if op not in (*_PAYLOAD_OPS, "sample"):
            raise ValueError(f"{self._where}: no distributed operation {op!r}.")
        with self._binding:
            return self._bound.setdefault(op, layout)

    # ------------------------------------------------------------------ serving (channels)
    def request_layout(self, op: str) -> MessageLayout:
        if op in ("sample", "stats"):
            return _EMPTY
        with self._binding:
            return self._bound[op]

    def handle(self, op: str, value):
        with self._lock:
            if op == "stats":
                out = self._buffer.stats()
                return out if self._extra_stats is None else dict(out, **self._extra_stats())
            before = self._buffer.write_count if self._changed is not None else 0
            out = self._apply(op, value)
            if self._changed is not None:
                self._changed(max(0, self._buffer.write_count - before))
            return out

    def _apply(self, op: str, value):
        rb = self._buffer
        if op == "extend":
            return rb.extend(value)
        if op == "add":
            return rb.add(value)
        if op == "sample":
            return self._sample(rb)
        if op == "update_priority":
            return rb.update_priority(*value)
        update = getattr(rb, "update_tensordict_priority", None)
        if update is None:
            raise AttributeError(
                f"{self._where}.update_tensordict_priority: the hosted "
                f"{type(rb).__name__} has no such method (a TensorDict "
                "buffer's); use update_priority(index, priority)."
            )
        return update(value)

    def _sample(self, rb):
        out = rb.sample(self._bound["sample"])
        if self._sample_reply is not None:
            tensors, layout = flatten(out, where=self._where, strict=False)
            try:
                conform(self._sample_reply, layout, tensors, where=f"{self._where}.sample")
            except ValueError as e:
                raise RuntimeError(
                    f"{e} (the layout declared by transport_options['sample_spec'])"
                ) from None
        return out

    def close(self) -> list[str]:
        """Stop every connection thread and process group, and the store."""
        return self._server.close()


def _layout(spec, where: str) -> MessageLayout:
    return flatten(spec.detach().cpu(), where=where, strict=True)[1]


class _Connection:
    """A client's connection in one process (rebuilt after pickling, forking or a restart
    of the service). ``info``: what ``connect`` returned, through Ray; its grant is used
    here and not kept."""

    def __init__(self, info: dict, alive, where: str) -> None:
        self.pid = os.getpid()
        self.bound = dict(info["bound"])
        self.incarnation = info["incarnation"]
        ray = runtime.import_ray(where)
        self.channel = ChannelClient(
            info["address"],
            info["grant"],
            host=ray.util.get_node_ip_address(),
            backend=info["backend"],
            timeout=info["timeout"],
            alive=alive,
            name=where,
        )


def _client(actor, batch_size, timeout, where) -> DistributedReplayClient:
    return DistributedReplayClient(actor, batch_size=batch_size, timeout=timeout, where=where)


class DistributedReplayClient:
    """TorchRL's distributed replay client: ``extend`` / ``add`` / ``sample`` / ``stats`` /
    ``len`` / ``write_count`` / ``update_priority`` / ``update_tensordict_priority`` over
    torch.distributed, each taking ``timeout=`` (seconds; default the transport's
    ``timeout``; None: no limit). Picklable: pass it to other Ray actors and tasks; it connects
    in the process that uses it. It has no lifecycle (``close``, ``shutdown``, ``client``).

    After a restart of the service's actor the next call connects again: ``sample`` and
    ``stats`` are sent again, and a write that was in flight raises
    :class:`~functional_rb.service.ServiceInterrupted`.

    Examples:
      >>> from functional_rb.adapters.comm import DistributedReplayClient
      >>> client = DistributedReplayClient(None, batch_size=32, timeout=60.0)
      >>> client.batch_size, client
      (32, DistributedReplayClient(RayReplayBuffer, transport='distributed'))
    """

    def __init__(
        self, actor, *, batch_size: int | None, timeout: float, where: str = "RayReplayBuffer"
    ) -> None:
        self._actor, self._batch_size, self._timeout, self._where = (
            actor,
            batch_size,
            timeout,
            where,
        )
        self._conn: _Connection | None = None
        self._conn_lock = threading.Lock()

    def __reduce__(self):
        # the handle travels; its connection is this process's (the receiver opens its own)
        return _client, (self._actor, self._batch_size, self._timeout, self._where)

    # ------------------------------------------------------------------ bootstrap
    def _ray(self, method: str, *args, retry: bool = True):
        return runtime.call(self._actor, method, *args, where=self._where, retry=retry)

    def _alive(self) -> bool:
        ray = runtime.import_ray(self._where)
        try:
            ray.get(self._actor.__ray_ready__.remote(), timeout=5.0)
            return True
        except (ray.exceptions.RayError, TimeoutError):  # dead, restarting or unreachable
            return False

    def _connection(self) -> _Connection:
        with self._conn_lock:
            if self._conn is None or self._conn.pid != os.getpid():
                self._conn = _Connection(self._ray("distributed_connect"), self._alive, self._where)
            return self._conn

    def _bind(self, conn: _Connection, op: str, layout):
        if op not in conn.bound:
            conn.bound[op] = self._ray("distributed_bind", op, layout)
        return conn.bound[op]

    def _call(self, op: str, tensors, timeout):
        conn = self._connection()
        timeout = self._timeout if timeout is ... else timeout
        try:
            return conn.channel.call(op, tensors, timeout)
        except ServiceGone as e:
            raise self._lost(conn, op, e) from None

    def _lost(self, conn: _Connection, op: str, error: ServiceGone) -> Exception:
        """The connection ended: connect again (for the next call) and say why."""
        with self._conn_lock:
            if self._conn is conn:
                self._conn = None
        conn.channel.close(notify=False)  # (its server is gone, or dropped it)
        where = f"{self._where}.{op}"
        if not runtime.wait_back(self._actor, where):
            return runtime.dead(where)
        try:
            fresh = self._connection()
        except RuntimeError as e:
            return RuntimeError(
                f"{where}: the Ray actor hosting the buffer stopped serving "
                f"(shut down); nothing more can be sent. ({e})"
            )
        if fresh.incarnation != conn.incarnation:
            return runtime.ServiceInterrupted(
                f"{where}: the service's actor died during this call and Ray restarted it from "
                "its newest checkpoint; the call may or may not have been applied (the next "
                "call is served, on a new connection)."
            )
        return RuntimeError(f"{where}: {error} (the next call opens a new connection)")

    def _read(self, call):
        """A read, sent again once when the service restarted while it ran."""
        try:
            return call()
        except runtime.ServiceInterrupted:
            return call()

    def _payload(self, op: str, value, timeout):
        conn = self._connection()
        tensors, layout = flatten(value, where=f"{self._where}.{op}", strict=True)
        bound = self._bind(conn, op, layout)
        try:
            tensors = conform(bound, layout, tensors, where=f"{self._where}.{op}")
        except ValueError as e:
            raise ValueError(
                f"{e} The distributed transport binds the layout of each operation at its "
                f"first call (or by transport_options); bound: {bound.describe()}. Send data "
                "of that layout, or use transport='ray' for varying layouts."
            ) from None
        return self._call(op, tensors, timeout)

    # ------------------------------------------------------------------ the API
    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def write_count(self) -> int:
        return int(self.stats()["write_count"])

    @property
    def dim_extend(self):
        return self._ray("get", "dim_extend")

    @dim_extend.setter
    def dim_extend(self, value) -> None:
        self._ray("set", "dim_extend", value, retry=False)

    def stats(self, *, timeout: float | None = ...) -> dict:
        """The hosted buffer's ``stats()`` (size, write_count, capacity, ...; with
        checkpoints, ``restored`` and ``checkpoint``)."""
        return self._read(lambda: self._call("stats", [], timeout))

    def __len__(self) -> int:
        return int(self.stats()["size"])

    def extend(self, data, *, timeout: float | None = ...):
        """``extend`` in the actor; the indices written."""
        return self._payload("extend", data, timeout)

    def add(self, data, *, timeout: float | None = ...):
        """``add`` of one item (its own bound layout, beside extend's); its index."""
        return self._payload("add", data, timeout)

    def sample(self, batch_size: int | None = None, *, timeout: float | None = ...):
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError("A sample batch size must be provided.")
        return self._read(lambda: self._sample(int(batch_size), timeout))

    def _sample(self, batch_size: int, timeout):
        bound = self._bind(self._connection(), "sample", batch_size)
        if batch_size != bound:
            raise ValueError(
                "The distributed replay schema is bound to sample batch size "
                f"{bound}, got {batch_size}."
            )
        return self._call("sample", [], timeout)

    def update_priority(self, index, priority=None, *, timeout: float | None = ...):
        """``update_priority(index, priority)``; a single TensorDict argument is a sample
        given back with its priority key: :meth:`update_tensordict_priority`."""
        if priority is None and isinstance(index, TensorDictBase):
            return self.update_tensordict_priority(index, timeout=timeout)
        if priority is None:
            raise TypeError(f"{self._where}.update_priority(index, priority): priority is missing.")
        pair = (torch.as_tensor(index), torch.as_tensor(priority))
        return self._payload("update_priority", pair, timeout)

    def update_tensordict_priority(self, data, *, timeout: float | None = ...) -> None:
        return self._payload("update_tensordict_priority", data, timeout)

    def update_if_present(self, **kwargs):
        raise RuntimeError(
            "Conditional updates are not supported by the distributed replay "
            "transport. Use transport='ray' for update_if_present."
        )

    def disconnect(self) -> None:
        """Close this process's connection (the next call opens a new one)."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None and conn.pid == os.getpid():
            conn.channel.close()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _LIFECYCLE:
            raise AttributeError(f"{type(self).__name__} has no lifecycle capability {name!r}.")
        raise AttributeError(
            f"{type(self).__name__} has no {name!r}: a distributed-transport client serves "
            "extend, add, sample, stats, len, write_count, update_priority and "
            "update_tensordict_priority; the owner (RayReplayBuffer) reaches the rest through "
            "Ray."
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._where}, transport='distributed')"
