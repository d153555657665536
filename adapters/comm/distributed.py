"""Request/reply channels over torch.distributed: a server process and its client processes.

The server hosts a :class:`torch.distributed.TCPStore` on its node's address. Each client
connection gets its own two-rank process group (gloo for CPU tensors, NCCL for CUDA ones)
rendezvoused through that store, and one server thread. The default process group is never
touched, so training code keeps ``init_process_group`` for itself.

A call is: the client pushes a small header ``(op, request id)`` onto the connection's request
queue in the store and posts its tensors as point-to-point sends; the server thread pops the
header, receives the tensors into buffers shaped by the request layout it bound for ``op``,
runs the handler, posts the reply tensors and pushes a reply header (the reply's layout when it
changed since the last reply of that op on this connection, or the handler's exception) onto
the reply queue. Waiting happens on the store's queues, never in a gloo receive: a store pop
has a timeout that leaves the connection usable (a gloo receive that times out cannot be
abandoned safely), and a server thread blocked on its queue is woken by a stop message, so
:meth:`ChannelServer.close` ends every thread and process group it started. When the server's
process dies its store goes with it and a waiting client gets a connection error at once.
"""
from __future__ import annotations

import logging
import pickle
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from functional_rb.adapters.comm.layout import Layout, flatten, unflatten

__all__ = ["ChannelClient", "ChannelServer", "ServiceGone", "check_backend"]

_LOG = logging.getLogger(__name__)
_STOP = b"stop"
_HELLO = b"hello"
_FOREVER = timedelta(days=365)
_PROBE_EVERY_S = 10.0  # a call without a timeout checks that the server lives this often


class ServiceGone(RuntimeError):
    """The server's store is unreachable: its process ended or it was closed."""


def check_backend(backend: str, where: str) -> torch.device:
    """The device tensors travel on for ``backend``; a clear error when it cannot run here."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"{where}: transport_options['backend'] must be 'gloo' (CPU tensors) "
                         f"or 'nccl' (CUDA tensors), got {backend!r}.")
    if not dist.is_available():
        raise RuntimeError(f"{where}: torch.distributed is not available in this torch build; "
                           "the distributed transport needs it (use transport='ray').")
    if backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError(
                f"{where}: transport_options['backend']='nccl' moves CUDA tensors, but CUDA "
                "(or NCCL) is not available in this process (torch.cuda.is_available() is "
                f"{torch.cuda.is_available()}). Use backend='gloo' on CPU, or give the actor a "
                "GPU (remote_config={'num_gpus': 1}) and run the clients on GPU machines.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _key(connection: int, queue: str) -> str:
    return f"frb/{connection}/{queue}"


def _store(address, timeout: float, master: bool = False):
    host, port = address
    return dist.TCPStore(host, port, is_master=master, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def _pair(store, connection: int, rank: int, backend: str, host: str, timeout: float):
    """The connection's process group: rank 0 the server's end, rank 1 the client's."""
    prefixed = dist.PrefixStore(f"frb/{connection}/pg", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def _shutdown(group) -> None:
    try:
        group.shutdown()
    except Exception as e:  # (a peer already gone): nothing left to release
        _LOG.debug("process group shutdown: %r", e)


class ChannelServer:
    """The server's end: accepts connections and serves each in its own thread.

    ``handler`` provides ``request_layout(op) -> Layout`` (what a request of ``op`` holds;
    requests must be checked against it by the client before they are sent) and
    ``handle(op, value)`` (the reply; an exception is sent back and raised by the client).
    """

    def __init__(self, handler, *, host: str, backend: str, timeout: float, name: str):
        self._handler, self._backend, self._timeout, self._name = handler, backend, timeout, name
        self._device = check_backend(backend, name)
        self._master = _store((host, 0), timeout, master=True)
        self.address = (host, int(self._master.port))
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._groups: dict[int, object] = {}
        self._closed = False

    def accept(self) -> int:
        """Reserve a connection and start the thread that will serve it."""
        with self._lock:
            if self._closed:
                raise ServiceGone(f"{self._name}: the service is closed.")
            connection = len(self._threads)
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True,
                                      name=f"{self._name}-conn{connection}")
            self._threads[connection] = thread
            thread.start()
        return connection

    def _serve(self, connection: int) -> None:
        # its own store client: a blocking pop holds the store object's lock
        store = _store(self.address, self._timeout)
        group = None
        try:
            store.set_timeout(_FOREVER)  # woken by the client's hello, or close()'s stop
            if store.queue_pop(_key(connection, "req")) == _STOP:
                return
            store.set_timeout(timedelta(seconds=self._timeout))  # a bounded rendezvous
            group = _pair(store, connection, 0, self._backend, self.address[0], self._timeout)
            with self._lock:
                self._groups[connection] = group
            store.set_timeout(_FOREVER)
            self._loop(store, group, connection)
        except Exception as e:  # the client's process ended mid-call: only its thread ends
            if not self._closed:
                _LOG.warning("%s: connection %d ended: %r", self._name, connection, e)
        finally:
            if group is not None:
                _shutdown(group)
            with self._lock:
                self._groups.pop(connection, None)

    def _loop(self, store, group, connection: int) -> None:
        sent: dict[str, Layout] = {}  # the reply layouts this client knows, per op
        pending: list = []
        while (header := store.queue_pop(_key(connection, "req"))) != _STOP:
            op, request_id = pickle.loads(header)
            for work in pending:  # the client read the last reply before sending this
                work.wait()
            layout = self._handler.request_layout(op)
            buffers = layout.empty(self._device)
            for work in [group.recv([b], 1, tag) for tag, b in enumerate(buffers)]:
                work.wait()
            try:
                tensors, reply = flatten(self._handler.handle(op, unflatten(buffers, layout)),
                                         where=self._name, strict=False)
                body = None if sent.get(op) == reply else reply
                sent[op] = reply
                tensors = [t.to(self._device).contiguous() for t in tensors]
                pending = [group.send([t], 1, tag) for tag, t in enumerate(tensors)]
                message = (request_id, "ok", body)
            except Exception as e:
                pending, message = [], (request_id, "error", _picklable(e))
            store.queue_push(_key(connection, "rep"), pickle.dumps(message))

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop every connection thread, release their process groups and the store; the
        names of threads still running after ``timeout`` (one stuck in a handler)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            threads = dict(self._threads)
        for connection in threads:
            self._master.queue_push(_key(connection, "req"), _STOP)
        deadline = time.monotonic() + timeout
        for thread in threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads.values() if t.is_alive()]
        with self._lock:
            for group in self._groups.values():  # (threads that did not end in time)
                _shutdown(group)
            self._groups.clear()
        del self._master  # the store's server thread ends with its last reference
        return left


def _picklable(error: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class ChannelClient:
    """One connection's client end, in the process that uses it (not picklable: each
    process connects anew). ``alive()`` says whether the server still lives; a call without
    a timeout asks it every few seconds."""

    def __init__(self, address, connection: int, *, host: str, backend: str, timeout: float,
                 alive: Callable[[], bool], name: str):
        self._connection, self._name, self._alive = connection, name, alive
        self._device = check_backend(backend, name)
        self._lock = threading.Lock()
        self._layouts: dict[str, Layout] = {}
        self._pending = None  # (request id, op, send works, tensors) of an unanswered call
        self._next = 0
        self._store = _store(address, timeout)
        self._store.queue_push(_key(connection, "req"), _HELLO)
        self._group = _pair(self._store, connection, 1, backend, host, timeout)
        self._closed = False

    def call(self, op: str, tensors: list[torch.Tensor], timeout: float | None):
        """Send ``op``'s request tensors (already in the bound layout's order) and return the
        reply. ``TimeoutError`` when no reply came in time (the call still runs; its reply is
        read and dropped by the next call); :class:`ServiceGone` when the server is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"{self._name}.{op}: another call of this client held it for "
                               f"the whole timeout ({timeout} s).")
        try:
            if self._closed:
                raise ServiceGone(f"{self._name}: this connection was closed.")
            if self._pending is not None:
                self._reply(deadline, late=True)
            request_id, self._next = self._next, self._next + 1
            tensors = [t.to(self._device).contiguous() for t in tensors]
            self._push(pickle.dumps((op, request_id)))
            works = [self._group.send([t], 0, tag) for tag, t in enumerate(tensors)]
            self._pending = (request_id, op, works, tensors)
            return self._reply(deadline)
        finally:
            self._lock.release()

    def _push(self, message: bytes) -> None:
        try:
            self._store.queue_push(_key(self._connection, "req"), message)
        except dist.DistError as e:
            raise ServiceGone(f"{self._name}: the service's store is unreachable ({e}).") from e

    def _pop(self, deadline: float | None, op: str) -> bytes:
        while True:
            wait = _PROBE_EVERY_S if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError(f"{self._name}.{op}: no reply within the timeout.")
            self._store.set_timeout(timedelta(seconds=min(wait, _PROBE_EVERY_S)))
            try:
                return self._store.queue_pop(_key(self._connection, "rep"))
            except dist.DistError as e:
                if "timeout" not in str(e).lower():
                    raise ServiceGone(f"{self._name}: the service's store is unreachable "
                                      f"({e}).") from e
            if not self._alive():
                raise ServiceGone(f"{self._name}: the service's process is gone.")

    def _reply(self, deadline: float | None, late: bool = False):
        """The reply of the pending call; ``late``: of a call that timed out, whose caller
        has gone (its result is dropped, its error logged)."""
        request_id, op, works, _ = self._pending
        answer, status, body = pickle.loads(self._pop(deadline, op))
        if answer != request_id:
            raise ServiceGone(f"{self._name}.{op}: reply {answer} to request {request_id}: the "
                              "connection is out of step.")
        for work in works:  # received by the server before it replied
            work.wait()
        self._pending = None
        if status == "error":
            if late:
                _LOG.warning("%s.%s: a call that timed out failed later: %r", self._name, op,
                             body)
                return None
            raise body
        if body is not None:
            self._layouts[op] = body
        layout = self._layouts[op]
        buffers = layout.empty(self._device)
        for work in [self._group.recv([b], 0, tag) for tag, b in enumerate(buffers)]:
            work.wait()
        return unflatten(buffers, layout)

    def close(self) -> None:
        """End this connection: its server thread stops and both ends release the group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._store.queue_push(_key(self._connection, "req"), _STOP)
            except dist.DistError:  # the server is gone already
                pass
            _shutdown(self._group)
            self._store = self._group = None
