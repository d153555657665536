"""The checkpoint envelope: a directory written whole or not at all, and checked when read.

``staged(path)`` gives the caller an empty directory beside ``path`` to write files into. When
the ``with`` block ends without an exception, every file and directory in it is fsynced and
checksummed, a manifest (``frb_manifest.json``) listing every file with its size and SHA-256
is written last, and the directory replaces ``path`` in one atomic rename; the parent directory
is then fsynced. ``verify(path)`` checks a directory against its manifest. The public names are
re-exported by :mod:`functional_rb.checkpoint`, which documents them for users.

Why a crash at any moment leaves ``path`` whole (the previous checkpoint or the new one):
- everything is written in a sibling ``.{name}.frb-tmp-{pid}-{token}``; ``path`` is untouched
  until the rename, and the rename happens only after the data and then the manifest are
  durable (fsync), so a renamed directory always holds complete files;
- an existing ``path`` is swapped with the staged directory by ``renameat2(RENAME_EXCHANGE)``
  (Linux 3.15+, most local filesystems): one atomic step, after which the old content sits at
  the staging name and is deleted. Where the exchange is not available the old directory is
  first renamed to ``.{name}.frb-old-{pid}-{token}`` and the new one renamed into place; a crash
  between the two renames leaves no ``path`` and the previous checkpoint at the ``-old`` name:
  ``verify`` and ``load`` read it from there, and the next ``staged(path)`` renames it back;
- siblings left by killed saves (their process is gone) are deleted by the next ``staged`` on
  the same path. Concurrent saves to one path are not supported (the last rename wins).

The manifest is plain JSON; its ``manifest_sha256`` member is the SHA-256 of the canonical
JSON (sorted keys, no spaces) of all its other members, so damage to the manifest itself is
found too.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from typing import Any

from functional_rb.errors import CheckpointError  # defined with the other public errors

MANIFEST = "frb_manifest.json"
ENVELOPE_FORMAT = "functional_rb.envelope"
ENVELOPE_VERSION = 1
_CHUNK = 1 << 24  # bytes hashed / copied per step: bounded memory for any file size
_SELF = "manifest_sha256"


class NoManifestError(CheckpointError):
    """The directory has no ``frb_manifest.json``: it was not written through :func:`staged`
    (for example a TorchRL dump), so there is nothing to check it against. Not damage: a
    caller that also accepts such directories catches this one and reads them its own way."""


_DAMAGED = (
    "The checkpoint is damaged; load an earlier one, or save it again from the original state."
)


# ------------------------------------------------------------------------------ helpers
def fsync_path(path: str, directory: bool = False) -> None:
    if directory and os.name == "nt":  # pragma: no cover - Windows cannot open a directory
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: str) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, read in bounded chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, h.hexdigest()
            h.update(chunk)
            size += len(chunk)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc < 2.28, musl: no wrapper
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths; False where this platform or filesystem cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _siblings(path: str) -> list[tuple[str, str, int]]:
    """``(full path, kind "tmp"/"old", pid)`` of the envelope's own siblings of ``path``."""
    parent, name = os.path.split(path)
    pattern = re.compile(r"\." + re.escape(name) + r"\.frb-(tmp|old)-(\d+)-[0-9a-f]+")
    out: list[tuple[str, str, int]] = []
    try:
        entries = os.listdir(parent or ".")
    except FileNotFoundError:
        return out
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m:
            out.append((os.path.join(parent, entry), m.group(1), int(m.group(2))))
    return out


_ACTIVE: set[str] = set()  # this process's staging directories in use (threads)


def _clean_leftovers(path: str) -> None:
    """Delete what killed saves of ``path`` left behind; first put back a previous checkpoint
    that a killed fallback save had moved aside (``path`` missing, an ``-old`` sibling)."""
    dead = [
        (p, kind)
        for p, kind, pid in _siblings(path)
        if p not in _ACTIVE and not _process_alive(pid)
    ]
    if not os.path.lexists(path):
        for p, kind in dead:
            if kind == "old":
                os.rename(p, path)
                fsync_path(os.path.dirname(path) or ".", directory=True)
                break
    for p, _ in dead:
        if os.path.lexists(p) and p != path:
            shutil.rmtree(p, ignore_errors=True)


def resolve(path: str | os.PathLike) -> str:
    """The directory holding the checkpoint ``path``: ``path`` itself, or, after a save
    killed between the two renames of the fallback (no atomic exchange), the previous
    checkpoint at its ``-old`` name. Raises ``FileNotFoundError`` when there is neither."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        return path
    olds = sorted(p for p, kind, _ in _siblings(path) if kind == "old")
    if olds:
        return olds[-1]
    raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", path)


# ------------------------------------------------------------------------------ writing
class Stage:
    """A directory being staged by :func:`staged`.

    directory: write any files (any subdirectories) under it; regular files only.
    meta: a JSON-serialisable dict stored in the manifest (``Manifest.meta`` when read).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.meta: dict = {}
        self._written: dict[str, tuple[int, str]] = {}

    def write(self, name: str, *parts) -> None:
        """Write ``parts`` (each bytes, a memoryview or a C-contiguous array), one after the
        other, to the file ``name`` (relative, ``/``-separated) in bounded chunks, hashing as
        it goes, and fsync it. Files written another way are read back and hashed when the
        stage is sealed."""
        full = self._full(name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        h, size = hashlib.sha256(), 0
        with open(full, "wb") as f:
            for part in parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), _CHUNK):
                    chunk = view[start : start + _CHUNK]
                    h.update(chunk)
                    f.write(chunk)
                size += len(view)
            f.flush()
            os.fsync(f.fileno())
        self._written[name] = (size, h.hexdigest())

    def _full(self, name: str) -> str:
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(
                f"checkpoint.staged: file name {name!r} must be a relative path "
                "without '.' or '..' parts."
            )
        if name == MANIFEST:
            raise ValueError(f"checkpoint.staged: {MANIFEST!r} is the envelope's own file.")
        return os.path.join(self.directory, *parts)

    def _seal(self) -> None:
        """fsync and hash every file, fsync every directory, then write the manifest."""
        files = {}
        for root, _dirs, names in os.walk(self.directory, topdown=False):
            for n in names:
                full = os.path.join(root, n)
                rel = os.path.relpath(full, self.directory).replace(os.sep, "/")
                if rel == MANIFEST:
                    continue
                if os.path.islink(full) or not os.path.isfile(full):
                    raise ValueError(
                        f"checkpoint.staged: {full} is not a regular file; a "
                        "checkpoint holds regular files only."
                    )
                size = os.path.getsize(full)
                known = self._written.get(rel)
                if known is None or known[0] != size:
                    fsync_path(full)
                    known = _hash_file(full)
                files[rel] = {"size": known[0], "sha256": known[1]}
            if root != self.directory:  # (the top one is synced once, after the manifest)
                fsync_path(root, directory=True)
        body = {
            "format": ENVELOPE_FORMAT,
            "version": ENVELOPE_VERSION,
            "files": files,
            "meta": self.meta,
        }
        try:
            canonical = _canonical(body)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint.staged: meta is not JSON serialisable ({e}).") from e
        body[_SELF] = hashlib.sha256(canonical).hexdigest()
        with open(os.path.join(self.directory, MANIFEST), "wb") as f:
            f.write(json.dumps(body, sort_keys=True, indent=1).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.directory, directory=True)


def _has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _install(staging: str, path: str, replace_foreign: bool, where: str) -> None:
    """Move the sealed ``staging`` directory to ``path`` in one atomic step."""
    parent = os.path.dirname(path)
    old = None
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(
                f"{where}: {path} exists and is not a directory; a checkpoint "
                "is a directory. Remove it or choose another path."
            )
        if not (replace_foreign or _has_manifest(path) or not os.listdir(path)):
            raise FileExistsError(
                f"{where}: {path} is a directory that is not a checkpoint (no {MANIFEST}); "
                "refusing to replace it. Remove it or choose another path."
            )
        if _exchange(staging, path):
            old = staging
        else:
            head, tail = os.path.split(staging)
            old = os.path.join(head, ".frb-old-".join(tail.rsplit(".frb-tmp-", 1)))
            os.rename(path, old)
            try:
                os.rename(staging, path)
            except BaseException:
                os.rename(old, path)  # put the previous checkpoint back
                raise
    else:
        try:
            os.rename(staging, path)
        except OSError as e:  # created meanwhile, not empty
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _exchange(staging, path):
                raise
            old = staging
    fsync_path(parent, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def staging_path(path: str | os.PathLike, pid: int, token: str) -> str:
    """The directory ``staged(path, token=token)`` stages in process ``pid``: the other
    processes of a multi-process save write their files into it
    (:mod:`functional_rb.checkpoint.sharded_io`)."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.frb-tmp-{pid}-{token}")


@contextlib.contextmanager
def staged(
    path: str | os.PathLike,
    *,
    replace_foreign: bool = False,
    where: str = "checkpoint.staged",
    token: str | None = None,
) -> Iterator[Stage]:
    """Stage a checkpoint directory for ``path``; see the module docstring.

    Yields a :class:`Stage` whose ``directory`` starts empty. On a normal exit the files are
    sealed (fsync, SHA-256, manifest last) and the directory atomically replaces ``path``; on
    an exception nothing at ``path`` changes and the staged files are deleted.

    ``path`` may be missing, an empty directory, or a directory with a manifest (an earlier
    checkpoint); a directory without one is replaced only with ``replace_foreign=True`` (e.g.
    over a TorchRL dump), and a file never. Leftovers of killed saves of ``path`` are removed
    first. ``token`` (lowercase hex): name the staging directory with it (:func:`staging_path`)
    so that other processes, told the token, can write into it; default a random one.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _clean_leftovers(path)
    staging = staging_path(path, os.getpid(), token or secrets.token_hex(6))
    os.mkdir(staging)
    _ACTIVE.add(staging)
    try:
        stage = Stage(staging)
        yield stage
        stage._seal()
        _install(staging, path, replace_foreign, where)
    finally:
        _ACTIVE.discard(staging)
        if os.path.lexists(staging):
            shutil.rmtree(staging, ignore_errors=True)


# ------------------------------------------------------------------------------ reading
@dataclasses.dataclass(frozen=True)
class _Digest:
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checked manifest. ``directory``: where the files are (``path``, or the previous
    checkpoint's ``-old`` name after an interrupted fallback save); ``meta``: what the writer
    stored; ``files``: ``{relative name: {"size": int, "sha256": hex}}``."""

    directory: str
    meta: dict
    files: dict
    where: str = "checkpoint.verify"

    def path(self, name: str) -> str:
        return os.path.join(self.directory, *name.split("/"))

    def check_file(self, name: str, data: bytes | _Digest | None = None) -> None:
        """Raise :class:`CheckpointError` unless file ``name`` (or ``data``, its bytes already
        read) has the recorded size and SHA-256."""
        rec = self.files.get(name)
        full = self.path(name)
        if rec is None:
            raise CheckpointError(self.where, full, "is not listed in the manifest")
        if isinstance(data, _Digest):
            size, digest = data.size, data.sha256
        elif data is None:
            try:
                size, digest = _hash_file(full)
            except FileNotFoundError:
                raise CheckpointError(self.where, full, "is missing", _DAMAGED) from None
        else:
            size, digest = len(data), hashlib.sha256(data).hexdigest()
        if size != rec["size"]:
            raise CheckpointError(
                self.where,
                full,
                f"has {size} bytes, the manifest records {rec['size']} "
                f"({'truncated' if size < rec['size'] else 'extended'})",
                _DAMAGED,
            )
        if digest != rec["sha256"]:
            raise CheckpointError(
                self.where,
                full,
                "its content does not match the checksum in the manifest (altered or damaged)",
                _DAMAGED,
            )

    def mapped(self, name: str):
        """A read-only memory map (``b""`` when empty) of file ``name``, checked against the
        manifest. The bytes hashed are the bytes mapped (one open file), even if a save
        replaces the directory meanwhile."""
        full = self.path(name)
        rec = self.files.get(name)
        if rec is None:
            raise CheckpointError(self.where, full, "is not listed in the manifest")
        try:  # (fstat and mmap of an open file raise no FileNotFoundError)
            with open(full, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except FileNotFoundError:
            raise CheckpointError(self.where, full, "is missing", _DAMAGED) from None
        h, view = hashlib.sha256(), memoryview(buf)
        for start in range(0, size, _CHUNK):
            h.update(view[start : start + _CHUNK])
        self.check_file(name, _Digest(size, h.hexdigest()))
        return buf

    def read(self, name: str) -> bytes:
        """The bytes of file ``name``, checked against the manifest."""
        full = self.path(name)
        if name not in self.files:
            raise CheckpointError(self.where, full, "is not listed in the manifest")
        try:
            with open(full, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(self.where, full, "is missing", _DAMAGED) from None
        self.check_file(name, data)
        return data


def _parse_manifest(directory: str, where: str) -> Manifest:
    full = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(
            where, directory, "is not a directory (a checkpoint is a directory holding a manifest)"
        )
    try:
        with open(full, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise NoManifestError(
            where,
            full,
            "does not exist: the directory was not written by "
            "functional_rb's checkpoint envelope, so it cannot be checked",
        ) from None
    if not raw:
        raise CheckpointError(where, full, "is empty (0 bytes)", _DAMAGED)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(where, full, f"is not valid JSON ({e})", _DAMAGED) from None
    if not isinstance(body, dict) or body.get("format") != ENVELOPE_FORMAT:
        raise CheckpointError(where, full, f"is not a {ENVELOPE_FORMAT} manifest", _DAMAGED)
    claimed = body.pop(_SELF, None)
    if claimed != hashlib.sha256(_canonical(body)).hexdigest():
        raise CheckpointError(
            where,
            full,
            "its content does not match its own checksum "
            f"({_SELF}): the manifest is altered or damaged",
            _DAMAGED,
        )
    if body.get("version") != ENVELOPE_VERSION:
        raise CheckpointError(
            where,
            full,
            f"has envelope version {body.get('version')!r}; "
            f"this functional_rb reads version {ENVELOPE_VERSION}",
            "Upgrade functional_rb to read it.",
        )
    files, meta = body.get("files"), body.get("meta")
    if (
        not isinstance(files, dict)
        or not isinstance(meta, dict)
        or not all(
            isinstance(r, dict)
            and isinstance(r.get("size"), int)
            and isinstance(r.get("sha256"), str)
            for r in files.values()
        )
    ):
        raise CheckpointError(
            where, full, "does not list its files as {name: {size, sha256}}", _DAMAGED
        )
    return Manifest(directory=directory, meta=meta, files=files, where=where)


def verify(
    path: str | os.PathLike, *, data: bool = True, where: str = "checkpoint.verify"
) -> Manifest:
    """Check the directory ``path`` against its manifest; returns the :class:`Manifest`.

    Raises :class:`NoManifestError` when the directory has no manifest (not written by
    :func:`staged`: nothing to check against), :class:`CheckpointError` naming the file when
    anything is wrong (manifest damaged, a file missing, of another size, or, with ``data``
    True, of another SHA-256), ``FileNotFoundError`` when there is no checkpoint at ``path``.
    ``data=False`` checks the manifest and the sizes only; check contents file by file with
    ``Manifest.read`` / ``Manifest.check_file``. Files not listed in the manifest are ignored.
    """
    manifest = _parse_manifest(resolve(path), where)
    for name, rec in manifest.files.items():
        full = manifest.path(name)
        try:
            size = os.path.getsize(full)
        except FileNotFoundError:
            raise CheckpointError(where, full, "is missing", _DAMAGED) from None
        if size != rec["size"]:
            manifest.check_file(name)  # raises, naming truncated / extended
    if data:
        for name in manifest.files:
            manifest.check_file(name)
    return manifest


def identity(path: str | os.PathLike) -> Any:
    """Something that changes when a save replaces ``path`` (to retry a read that raced one)."""
    try:
        st = os.stat(resolve(path))
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)
