"""The distributed transport's wire format: framed, authenticated headers; nothing unpickled.

Every header the transport puts in its ``TCPStore`` is one *frame*::

    magic    4 bytes   b"FRBW"
    version  1 byte    VERSION; a peer speaking another version is refused
    kind     1 byte    HELLO, WELCOME, REFUSED, REQUEST, REPLY or BYE
    length   4 bytes   big-endian length of the body, at most MAX_BODY
    body     length    one JSON object, UTF-8
    tag      32 bytes  HMAC-SHA256 of every byte before it

:func:`decode` checks the type, the size bounds, magic, version, kind and declared length, then
the tag (:func:`hmac.compare_digest`), and only then parses the body: bytes from a process that
does not hold the key are never parsed beyond their fixed 10-byte prefix. Any failure raises
:class:`ProtocolError`; the server then drops that connection and keeps serving the others.

Keys. The service creates a random 32-byte *secret*; clients receive it through Ray's bootstrap
call (the same channel that carries the actor's handle). A connection starts with a HELLO
tagged with the secret over the server's one-time *challenge* and the client's nonce; both
ends then derive the connection's two keys (:func:`session_keys`: one per direction, so a
frame cannot be reflected back to its sender), which tag every later frame and key the
payload digest (:func:`digest`), an HMAC-SHA256 over the tensors sent beside the header. A
REFUSED frame is tagged with the empty key: it carries no authority, only a reason.

Exceptions travel as their type name and message (:func:`error_body`); the receiver raises the
built-in of that name or a :class:`RemoteError` (:func:`remote_exception`), never an object it
unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch

__all__ = [
    "BYE",
    "HELLO",
    "MAX_BODY",
    "MAX_MESSAGE_BYTES",
    "REFUSED",
    "REPLY",
    "REQUEST",
    "VERSION",
    "WELCOME",
    "ProtocolError",
    "RemoteError",
    "decode",
    "describe_tensors",
    "digest",
    "digest_field",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "error_body",
    "field",
    "remote_exception",
    "session_keys",
]

MAGIC = b"FRBW"
VERSION = 1
HELLO, WELCOME, REFUSED, REQUEST, REPLY, BYE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    HELLO: "HELLO",
    WELCOME: "WELCOME",
    REFUSED: "REFUSED",
    REQUEST: "REQUEST",
    REPLY: "REPLY",
    BYE: "BYE",
}
_PREFIX = struct.Struct(">4sBBI")
TAG_BYTES = 32
MAX_BODY = 1 << 20  # 1 MiB of JSON: a header, or a reply's layout of many leaves
MAX_MESSAGE_BYTES = 1 << 36  # 64 GiB: the most one message's tensors may claim
MAX_ERROR_CHARS = 8_000  # an error message sent back is cut to this length

# the dtypes that travel, by name (a name outside the table is refused, never looked up)
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# exceptions raised on the receiving side as themselves (built-ins, rebuilt from a message)
_BUILTIN_ERRORS = {
    e.__name__: e
    for e in (
        ArithmeticError,
        AssertionError,
        AttributeError,
        EOFError,
        FileExistsError,
        FileNotFoundError,
        IndexError,
        KeyError,
        LookupError,
        MemoryError,
        NotImplementedError,
        OSError,
        OverflowError,
        PermissionError,
        RuntimeError,
        StopIteration,
        TimeoutError,
        TypeError,
        ValueError,
        ZeroDivisionError,
    )
}


class ProtocolError(ValueError):
    """A frame or body that breaks the wire format (or is not tagged with the right key)."""


class RemoteError(RuntimeError):
    """An exception the service raised whose type is not a Python built-in: its type name
    (``type_name``) and message, re-raised in the client's process.

    Examples:
      >>> from functional_rb.adapters.comm import wire
      >>> error = wire.remote_exception("CheckpointError", "rb/ckpt: damaged")
      >>> isinstance(error, wire.RemoteError), error.type_name, str(error)
      (True, 'CheckpointError', 'CheckpointError: rb/ckpt: damaged')
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ``TypeError`` for a dtype that does not travel."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"the distributed transport does not send tensors of dtype {dtype}; "
            f"it sends {sorted(_DTYPES)}."
        ) from None


def dtype_from_name(name) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ProtocolError(f"unknown dtype {name!r:.40}; expected one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def encode(kind: int, body: dict, key: bytes) -> bytes:
    """One frame: ``body`` (a JSON-serialisable dict) tagged with ``key``.

    Examples:
      >>> from functional_rb.adapters.comm import wire
      >>> frame = wire.encode(wire.REQUEST, {"seq": 0, "op": "sample"}, b"key")
      >>> wire.decode(frame, b"key", (wire.REQUEST,))
      (4, {'seq': 0, 'op': 'sample'})
      >>> wire.decode(frame, b"other", (wire.REQUEST,))  # doctest: +IGNORE_EXCEPTION_DETAIL
      Traceback (most recent call last):
      ProtocolError: the frame's tag does not match: not sent by a holder of this ...
    """
    data = json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
    if len(data) > MAX_BODY:
        raise ValueError(
            f"a {KIND_NAMES[kind]} header of {len(data)} bytes exceeds the "
            f"transport's limit of {MAX_BODY} (a reply layout of too many leaves)."
        )
    head = _PREFIX.pack(MAGIC, VERSION, kind, len(data)) + data
    return head + hmac.new(key, head, hashlib.sha256).digest()


def decode(frame, key: bytes, kinds) -> tuple[int, dict]:
    """``(kind, body)`` of a frame tagged with ``key``, whose kind is one of ``kinds``;
    :class:`ProtocolError` otherwise (checked before anything is parsed)."""
    if not isinstance(frame, (bytes, bytearray)):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}.")
    if len(frame) < _PREFIX.size + TAG_BYTES:
        raise ProtocolError(
            f"a frame of {len(frame)} bytes is shorter than the "
            f"{_PREFIX.size + TAG_BYTES} of an empty one (truncated)."
        )
    if len(frame) > _PREFIX.size + MAX_BODY + TAG_BYTES:
        raise ProtocolError(
            f"a frame of {len(frame)} bytes exceeds the limit of "
            f"{_PREFIX.size + MAX_BODY + TAG_BYTES}."
        )
    magic, version, kind, length = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}).")
    if version != VERSION:
        raise ProtocolError(f"wire version {version}; this side speaks version {VERSION}.")
    if kind not in kinds:
        expected = [KIND_NAMES[k] for k in kinds]
        raise ProtocolError(
            f"a frame of kind {KIND_NAMES.get(kind, kind)} where {expected} was expected."
        )
    if len(frame) != _PREFIX.size + length + TAG_BYTES:
        raise ProtocolError(
            f"the header declares a body of {length} bytes, the frame holds "
            f"{len(frame) - _PREFIX.size - TAG_BYTES}."
        )
    head = bytes(frame[:-TAG_BYTES])
    if not hmac.compare_digest(
        hmac.new(key, head, hashlib.sha256).digest(), bytes(frame[-TAG_BYTES:])
    ):
        raise ProtocolError(
            "the frame's tag does not match: not sent by a holder of this connection's key."
        )
    try:
        body = json.loads(head[_PREFIX.size :].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"the body is not JSON ({type(e).__name__}).") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"the body is a JSON {type(body).__name__}, not an object.")
    return kind, body


def field(body: dict, name: str, kind, *, where: str = "header"):
    """``body[name]``, which must be of type ``kind`` (bools are not ints here)."""
    value = body.get(name)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError(
            f"{where} field {name!r}: expected {names}, got {type(value).__name__} {value!r:.40}."
        )
    return value


def digest_field(body: dict, *, where: str = "header") -> str:
    """``body["digest"]``: 64 lowercase hex digits (what :func:`digest` returns)."""
    value = field(body, "digest", str, where=where)
    if len(value) != 64 or value.strip("0123456789abcdef"):
        raise ProtocolError(f"{where} field 'digest': expected 64 hex digits, got {value!r:.40}.")
    return value


def session_keys(secret: bytes, challenge: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    """The connection's ``(client-to-server, server-to-client)`` keys."""
    root = hmac.new(secret, b"frb-session\0" + challenge + nonce, hashlib.sha256).digest()
    return (
        hmac.new(root, b"client", hashlib.sha256).digest(),
        hmac.new(root, b"server", hashlib.sha256).digest(),
    )


def describe_tensors(tensors) -> list:
    """``[[dtype name, shape], ...]``: what a message's tensors are, for the header."""
    return [[dtype_name(t.dtype), list(t.shape)] for t in tensors]


def digest(key: bytes, seq: int, tensors) -> str:
    """HMAC-SHA256 of the tensors' bytes (CPU tensors, contiguous), bound to ``seq``.

    Examples:
      >>> import torch
      >>> from functional_rb.adapters.comm import wire
      >>> a = wire.digest(b"key", 0, [torch.arange(3)])
      >>> len(a), a == wire.digest(b"key", 1, [torch.arange(3)])
      (64, False)
    """
    h = hmac.new(key, struct.pack(">Q", seq), hashlib.sha256)
    for t in tensors:
        h.update(struct.pack(">Q", t.numel() * t.element_size()))
        h.update(_raw(t))
    return h.hexdigest()


def _raw(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy."""
    try:
        return t.numpy()
    except TypeError:  # (bfloat16 and the like: NumPy has no such dtype)
        return t.reshape(-1).view(torch.uint8).numpy()


def error_body(error: BaseException) -> dict:
    """An exception as it travels: its type name and its message (cut to a bound)."""
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return {"type": type(error).__name__, "message": message[:MAX_ERROR_CHARS]}


def remote_exception(type_name, message) -> Exception:
    """The exception to raise for an error body: the built-in of that name, else a
    :class:`RemoteError` carrying the name."""
    type_name, message = str(type_name)[:200], str(message)[:MAX_ERROR_CHARS]
    cls = _BUILTIN_ERRORS.get(type_name)
    return cls(message) if cls is not None else RemoteError(type_name, message)
