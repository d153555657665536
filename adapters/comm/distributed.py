"""Request/reply channels over torch.distributed: a server process and its client processes.

The server hosts a :class:`torch.distributed.TCPStore` on a socket bound to the address it was
given (not every interface). Each client connection gets its own two-rank process group (gloo
for CPU tensors, bound to the same address; NCCL for CUDA ones) rendezvoused through that
store, and one server thread. The default process group is never touched, so training code
keeps ``init_process_group`` for itself.

Who is served. A TCPStore authenticates nobody, so the channel does it itself
(:mod:`.wire`): the server holds a random secret, handed to clients with their connection
grant (:meth:`ChannelServer.accept`, called through Ray by the bootstrap); a connection's
keys in the store carry a random 128-bit name, and its first frame must prove the secret (an
HMAC over the server's one-time challenge) before the server pairs a process group with it.
A wrong proof is refused and logged, and the client raises ``PermissionError``. Every later
header is tagged with the connection's key and numbered, and the tensors beside it carry a
keyed digest (HMAC-SHA256; gloo only: NCCL's CUDA tensors are not hashed), so a frame pushed
by anyone else, replayed or altered, and a payload that does not match its header, are never
acted on.

A call is: the client pushes a REQUEST frame (op, sequence number, the dtype and shape of each
tensor, their digest) onto the connection's request queue and posts its tensors as
point-to-point sends; the server thread checks the frame, and the tensors it announces against
the layout bound for ``op``, *before* it allocates anything, receives the tensors, checks
their digest, runs the handler, posts the reply tensors and pushes a REPLY frame (the reply's
layout as JSON when it changed since the last reply of that op on this connection, or the
handler's exception as its type name and message). A frame that breaks any rule ends that
connection only: the server logs it, tells the client why (a BYE frame) and keeps serving
the others; the buffer is untouched, because nothing is handled before every check passed.

Waiting happens on the store's queues, never in a gloo receive: a store pop has a timeout that
leaves the connection usable (a gloo receive that times out cannot be abandoned safely), and a
server thread blocked on its queue is woken by :meth:`ChannelServer.close`, which ends every
thread and process group it started. When the server's process dies its store goes with it
and a waiting client gets a connection error at once.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from functional_rb.adapters.comm import wire
from functional_rb.adapters.comm.message_layout import (
    MessageLayout,
    flatten,
    from_wire,
    to_wire,
    unflatten,
)

__all__ = ["ChannelClient", "ChannelServer", "ServiceGone", "check_backend"]

_LOG = logging.getLogger(__name__)
_WAKE = b""  # close()'s wake-up; popped while the server is open, it is a bad frame
_FOREVER = timedelta(days=365)
_PROBE_EVERY_S = 10.0  # a call without a timeout checks that the server lives this often


class ServiceGone(RuntimeError):
    """The server's store is unreachable (its process ended or it was closed), or the server
    dropped this connection."""


def check_backend(backend: str, where: str) -> torch.device:
    """The device tensors travel on for ``backend``; a clear error when it cannot run here."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"{where}: transport_options['backend'] must be 'gloo' (CPU tensors) "
            f"or 'nccl' (CUDA tensors), got {backend!r}."
        )
    if not dist.is_available():
        raise RuntimeError(
            f"{where}: torch.distributed is not available in this torch build; "
            "the distributed transport needs it (use transport='ray')."
        )
    if backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError(
                f"{where}: transport_options['backend']='nccl' moves CUDA tensors, but CUDA "
                "(or NCCL) is not available in this process (torch.cuda.is_available() is "
                f"{torch.cuda.is_available()}). Use backend='gloo' on CPU, or give the actor a "
                "GPU (remote_config={'num_gpus': 1}) and run the clients on GPU machines."
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _key(connection: str, queue: str) -> str:
    return f"frb/{connection}/{queue}"


def _listen(host: str) -> tuple[int, int]:
    """A listening socket bound to ``host`` only: ``(descriptor, port)``. The store takes
    the descriptor over (and closes it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def _store(address, timeout: float):
    host, port = address
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )


def _pair(store, connection: str, rank: int, backend: str, host: str, timeout: float):
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


def _announced(layout: MessageLayout) -> list:
    """The ``tensors`` field a request of ``layout`` must carry."""
    return [[wire.dtype_name(leaf.dtype), list(leaf.shape)] for leaf in layout.leaves if leaf.sent]


class ChannelServer:
    """The server's end: accepts connections and serves each in its own thread.

    ``handler`` provides ``request_layout(op) -> MessageLayout`` (what a request of ``op`` holds;
    ``KeyError`` for an op it does not serve) and ``handle(op, value)`` (the reply; an
    exception is sent back as its type name and message). ``host``: the address to listen on.
    ``rejected`` counts the connections refused or dropped for breaking the protocol.
    """

    def __init__(self, handler, *, host: str, backend: str, timeout: float, name: str):
        self._handler, self._backend, self._timeout, self._name = handler, backend, timeout, name
        self._device = check_backend(backend, name)
        self._digests = backend == "gloo"  # (CUDA tensors are not copied to the host to hash)
        self._secret = secrets.token_bytes(32)
        fd, port = _listen(host)
        self._master = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=fd,
        )
        self.address = (host, port)
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._groups: dict[str, object] = {}
        self._closed = False
        self.rejected = 0

    def accept(self) -> dict:
        """Open a connection and start the thread that will serve it. The grant returned
        (``connection``, ``challenge``, ``secret``) goes to one client, by the bootstrap
        call; it must never be printed or logged."""
        token, challenge = secrets.token_hex(16), secrets.token_bytes(32)
        with self._lock:
            if self._closed:
                raise ServiceGone(f"{self._name}: the service is closed.")
            thread = threading.Thread(
                target=self._serve,
                args=(token, challenge),
                daemon=True,
                name=f"{self._name}-conn-{token[:8]}",
            )
            self._threads[token] = thread
            thread.start()
        return {"connection": token, "challenge": challenge, "secret": self._secret}

    def __repr__(self) -> str:  # (never the secret)
        return f"ChannelServer({self._name}, {self.address[0]}:{self.address[1]})"

    def _serve(self, token: str, challenge: bytes) -> None:
        # its own store client: a blocking pop holds the store object's lock
        store = _store(self.address, self._timeout)
        group = None
        try:
            keys = self._handshake(store, token, challenge)
            if keys is None:
                return
            store.set_timeout(timedelta(seconds=self._timeout))  # a bounded rendezvous
            group = _pair(store, token, 0, self._backend, self.address[0], self._timeout)
            with self._lock:
                self._groups[token] = group
            store.set_timeout(_FOREVER)  # woken by the client's next frame, or close()
            self._loop(store, group, token, keys)
        except Exception as e:  # the client's process ended mid-call: only its thread ends
            if not self._closed:
                _LOG.warning("%s: connection %s ended: %r", self._name, token[:8], e)
        finally:
            if group is not None:
                _shutdown(group)
            with self._lock:
                self._groups.pop(token, None)

    def _handshake(self, store, token: str, challenge: bytes):
        """The connection's keys once its first frame proved the secret; None when refused."""
        store.set_timeout(timedelta(seconds=self._timeout))  # (a grant nobody uses expires)
        frame = store.queue_pop(_key(token, "req"))
        if self._closed:
            return None
        try:
            _, body = wire.decode(frame, self._secret, (wire.HELLO,))
            if (
                wire.field(body, "connection", str) != token
                or wire.field(body, "challenge", str) != challenge.hex()
            ):
                raise wire.ProtocolError("a hello for another connection or challenge.")
            nonce = bytes.fromhex(wire.field(body, "nonce", str))
            if len(nonce) != 32:
                raise wire.ProtocolError(f"a nonce of {len(nonce)} bytes (32 expected).")
        except ValueError as e:  # (ProtocolError, or a nonce that is not hex)
            self._reject(store, token, wire.REFUSED, b"", f"refused: {e}")
            return None
        c2s, s2c = wire.session_keys(self._secret, challenge, nonce)
        store.queue_push(_key(token, "rep"), wire.encode(wire.WELCOME, {"connection": token}, s2c))
        return c2s, s2c

    def _reject(self, store, token: str, kind: int, key: bytes, reason: str) -> None:
        """Log why a connection is refused or dropped, and tell its client."""
        with self._lock:
            self.rejected += 1
        _LOG.warning("%s: connection %s %s", self._name, token[:8], reason)
        try:
            store.queue_push(_key(token, "rep"), wire.encode(kind, {"reason": reason[:500]}, key))
        except Exception as e:  # (the store is closing): the log says it all
            _LOG.debug("could not tell connection %s: %r", token[:8], e)

    def _request(self, frame, key: bytes, seq: int):
        """``(op, layout, digest)`` of a REQUEST frame, checked; None for a BYE."""
        kind, body = wire.decode(frame, key, (wire.REQUEST, wire.BYE))
        if kind == wire.BYE:
            return None
        got = wire.field(body, "seq", int)
        if got != seq:
            raise wire.ProtocolError(
                f"request {got} where {seq} was due (replayed or out of order)."
            )
        op = wire.field(body, "op", str)
        try:
            layout = self._handler.request_layout(op)
        except KeyError:
            raise wire.ProtocolError(f"no operation {op[:40]!r} is bound.") from None
        announced = wire.field(body, "tensors", list)
        if announced != _announced(layout):
            raise wire.ProtocolError(
                f"{op}: the request announces tensors {announced!r:.200}; "
                f"the bound layout is {_announced(layout)!r:.200}."
            )
        digest = wire.digest_field(body) if self._digests else None
        return op, layout, digest

    def _loop(self, store, group, token: str, keys) -> None:
        c2s, s2c = keys
        sent: dict[str, MessageLayout] = {}  # the reply layouts this client knows, per op
        pending: list = []
        seq = 0
        while True:
            frame = store.queue_pop(_key(token, "req"))
            if self._closed:
                return
            try:
                request = self._request(frame, c2s, seq)
            except ValueError as e:  # (ProtocolError): this connection ends, no other
                self._reject(store, token, wire.BYE, s2c, f"dropped: {e}")
                return
            if request is None:  # the client said goodbye
                return
            op, layout, digest = request
            for work in pending:  # the client read the last reply before sending this
                work.wait()
            buffers = layout.empty(self._device)
            for work in [group.recv([b], 1, tag) for tag, b in enumerate(buffers)]:
                work.wait()
            if digest is not None and not hmac.compare_digest(
                wire.digest(c2s, seq, buffers), digest
            ):
                self._reject(
                    store,
                    token,
                    wire.BYE,
                    s2c,
                    f"dropped: {op}: the payload does not match its header's digest.",
                )
                return
            pending, reply = self._answer(op, layout, buffers, seq, s2c, sent, group)
            store.queue_push(_key(token, "rep"), reply)
            seq += 1

    def _answer(self, op, layout, buffers, seq: int, key: bytes, sent: dict, group):
        """Run the handler: ``(the reply's send works, its REPLY frame)``."""
        try:
            tensors, reply = flatten(
                self._handler.handle(op, unflatten(buffers, layout)), where=self._name, strict=False
            )
            body = {
                "seq": seq,
                "status": "ok",
                "layout": None if sent.get(op) == reply else to_wire(reply),
            }
            tensors = [t.to(self._device).contiguous() for t in tensors]
            body["digest"] = wire.digest(key, seq, tensors) if self._digests else None
            frame = wire.encode(wire.REPLY, body, key)
        except Exception as e:  # the handler's, or a reply that cannot travel: to the client
            error = {"seq": seq, "status": "error", "error": wire.error_body(e)}
            return [], wire.encode(wire.REPLY, error, key)
        sent[op] = reply
        return [group.send([t], 1, tag) for tag, t in enumerate(tensors)], frame

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop every connection thread, release their process groups and the store; the
        names of threads still running after ``timeout`` (one stuck in a handler)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            threads = dict(self._threads)
        for token in threads:
            self._master.queue_push(_key(token, "req"), _WAKE)
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


class ChannelClient:
    """One connection's client end, in the process that uses it (not picklable: each
    process connects anew). ``grant``: what :meth:`ChannelServer.accept` returned, through the
    bootstrap call. ``alive()`` says whether the server still lives; a call without a timeout
    asks it every few seconds. ``PermissionError`` when the server refuses the grant."""

    def __init__(
        self,
        address,
        grant: dict,
        *,
        host: str,
        backend: str,
        timeout: float,
        alive: Callable[[], bool],
        name: str,
    ):
        self._connection, self._name, self._alive = grant["connection"], name, alive
        self._device = check_backend(backend, name)
        self._digests = backend == "gloo"
        self._lock = threading.Lock()
        self._layouts: dict[str, MessageLayout] = {}
        self._pending = None  # (seq, op, send works, tensors) of an unanswered call
        self._next = 0
        self._broken: str | None = None  # why the server dropped this connection
        self._store = _store(address, timeout)
        self._c2s, self._s2c = self._handshake(grant)
        self._group = _pair(self._store, self._connection, 1, backend, host, timeout)
        self._closed = False

    def __repr__(self) -> str:  # (never the keys)
        return f"ChannelClient({self._name}, connection {self._connection[:8]})"

    def _handshake(self, grant: dict) -> tuple[bytes, bytes]:
        nonce = secrets.token_bytes(32)
        hello = {
            "connection": self._connection,
            "challenge": grant["challenge"].hex(),
            "nonce": nonce.hex(),
        }
        self._store.queue_push(
            _key(self._connection, "req"), wire.encode(wire.HELLO, hello, grant["secret"])
        )
        c2s, s2c = wire.session_keys(grant["secret"], grant["challenge"], nonce)
        frame = self._store.queue_pop(_key(self._connection, "rep"))
        try:
            wire.decode(frame, s2c, (wire.WELCOME,))
            return c2s, s2c
        except wire.ProtocolError as e:
            try:
                _, body = wire.decode(frame, b"", (wire.REFUSED,))
            except wire.ProtocolError:
                raise ServiceGone(
                    f"{self._name}: the service's answer to this connection "
                    f"breaks the wire format ({e})."
                ) from None
        raise PermissionError(
            f"{self._name}: the service refused this connection ({body.get('reason')!s:.300}). "
            "A client proves the secret its service handed out through Ray's bootstrap call "
            "(use rb.client(), or the buffer itself, pickled); a secret of another service "
            "or of an earlier run of this one is refused."
        )

    def call(self, op: str, tensors: list[torch.Tensor], timeout: float | None):
        """Send ``op``'s request tensors (already in the bound layout's order) and return the
        reply. ``TimeoutError`` when no reply came in time (the call still runs; its reply is
        read and dropped by the next call); :class:`ServiceGone` when the server is gone or
        dropped the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(
                f"{self._name}.{op}: another call of this client held it for "
                f"the whole timeout ({timeout} s)."
            )
        try:
            if self._closed or self._broken:
                raise ServiceGone(
                    f"{self._name}: this connection was "
                    f"{'closed' if self._closed else 'dropped: ' + self._broken}."
                )
            if self._pending is not None:
                self._reply(deadline, late=True)
            seq, self._next = self._next, self._next + 1
            tensors = [t.to(self._device).contiguous() for t in tensors]
            body = {
                "seq": seq,
                "op": op,
                "tensors": wire.describe_tensors(tensors),
                "digest": wire.digest(self._c2s, seq, tensors) if self._digests else None,
            }
            self._push(wire.encode(wire.REQUEST, body, self._c2s))
            try:
                works = [self._group.send([t], 0, tag) for tag, t in enumerate(tensors)]
            except RuntimeError as e:  # gloo: the server's end of the pair is gone
                raise self._broke(op, f"the service is unreachable ({e})") from None
            self._pending = (seq, op, works, tensors)
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
                    raise ServiceGone(
                        f"{self._name}: the service's store is unreachable ({e})."
                    ) from e
            if not self._alive():
                raise ServiceGone(f"{self._name}: the service's process is gone.")

    def _wait(self, op: str, works) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:  # gloo: the server's end of the pair is gone
            raise self._broke(op, f"the service is unreachable ({e})") from None

    def _broke(self, op: str, reason: str) -> ServiceGone:
        self._broken, self._pending = reason, None
        return ServiceGone(f"{self._name}.{op}: {reason}")

    def _reply(self, deadline: float | None, late: bool = False):
        """The reply of the pending call; ``late``: of a call that timed out, whose caller
        has gone (its result is dropped, its error logged)."""
        seq, op, works, _ = self._pending
        digest = None
        try:
            kind, body = wire.decode(self._pop(deadline, op), self._s2c, (wire.REPLY, wire.BYE))
            if kind == wire.BYE:
                raise self._broke(
                    op, f"the service dropped this connection ({body.get('reason')!s:.300})."
                )
            if wire.field(body, "seq", int) != seq:
                raise wire.ProtocolError(f"reply {body['seq']} to request {seq}.")
            status = body.get("status")
            if status == "error":
                error = wire.field(body, "error", dict)
                result = wire.remote_exception(error.get("type"), error.get("message"))
            elif status == "ok":
                if body.get("layout") is not None:
                    self._layouts[op] = from_wire(body["layout"])
                result = self._layouts.get(op)
                if result is None:
                    raise wire.ProtocolError(f"the first reply of {op!r} has no layout.")
                digest = wire.digest_field(body, where="reply") if self._digests else None
            else:
                raise wire.ProtocolError(f"unknown status {status!r:.40}.")
        except wire.ProtocolError as e:
            raise self._broke(op, f"a reply that breaks the wire format ({e}).") from None
        self._wait(op, works)  # (received by the server before it replied)
        self._pending = None
        if isinstance(result, Exception):
            if late:
                _LOG.warning(
                    "%s.%s: a call that timed out failed later: %r", self._name, op, result
                )
                return None
            raise result
        buffers = result.empty(self._device)  # (from_wire bounded its bytes)
        self._wait(op, [self._group.recv([b], 0, tag) for tag, b in enumerate(buffers)])
        if digest is not None and not hmac.compare_digest(
            wire.digest(self._s2c, seq, buffers), digest
        ):
            raise self._broke(op, "the reply's payload does not match its header's digest.")
        return unflatten(buffers, result)

    def close(self, notify: bool = True) -> None:
        """End this connection: its server thread stops (told so unless ``notify`` is False:
        a server known to be gone) and both ends release the group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if notify and self._broken is None:
                with contextlib.suppress(dist.DistError):  # the server is gone already
                    self._store.queue_push(
                        _key(self._connection, "req"),
                        wire.encode(wire.BYE, {"seq": self._next}, self._c2s),
                    )
            _shutdown(self._group)
            self._store = self._group = None
