"""The files of one :class:`~functional_rb.MemmapStorage` directory in this process.

The manifest (each leaf's path, file, shape and dtype), the mappings (opened once per process
and directory, shared by eager calls and jitted host callbacks), the lock (a shared ``flock``
per opening process; only a process that opens the directory alone rolls back), the roll back
of writes after the last checkpoint, and the host reads and writes themselves. The format and
its crash safety: :mod:`functional_rb.storages.memmap` and
:mod:`functional_rb.storages.journal`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np

from functional_rb._internal import hugepages
from functional_rb._internal.errors import keystr
from functional_rb._internal.item_spec import ItemSpec
from functional_rb.checkpoint import state_io as _checkpoint
from functional_rb.checkpoint.atomic import fsync_path
from functional_rb.storages import journal as _journal

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]  # no advisory locks: None says so

MANIFEST = "manifest.json"
STATE_DIR = "state"
LOCK = "lock"
FORMAT = "functional_rb.MemmapStorage"
FORMAT_VERSION = 2  # 2: a journal and undo files (the commit record)


@dataclasses.dataclass
class Files:
    """One directory opened by this process: its layout and mappings.

    ``data_views``, ``undo_views``, ``journal_view``: plain ``np.ndarray`` views of the maps,
    for the reads and writes of every call (indexing an ``np.memmap`` builds a memmap object
    per result, ~8 us each, several per write); the memmaps themselves are kept for ``flush``.
    ``last``: ``(version array, write count)`` of the last eager write (:func:`wrote`)."""

    manifest: dict
    data: list
    undo: list
    journal: np.memmap
    lock: int | None
    data_views: list = dataclasses.field(init=False)
    undo_views: list = dataclasses.field(init=False)
    journal_view: np.ndarray = dataclasses.field(init=False)
    last: tuple | None = None

    def __post_init__(self):
        self.data_views = [np.asarray(a) for a in self.data]
        self.undo_views = [np.asarray(a) for a in self.undo]
        self.journal_view = np.asarray(self.journal)


# Open directories per absolute path. Process-local so that jitted callbacks and eager calls
# share one mapping per file.
_OPEN: dict[str, Files] = {}


def opened(directory: str) -> Files | None:
    """This process's mapping of ``directory`` if it has one (nothing is opened)."""
    return _OPEN.get(directory)


def as_version(count: int) -> np.ndarray:
    return np.array(count, np.int64).astype(np.int32)


def _file_name(i: int, path) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", keystr(path)).strip("_") or "leaf"
    return f"{i:03d}_{safe[:80]}.npy"


def manifest_for(item: ItemSpec, capacity: int) -> dict:
    leaves = []
    for i, (p, x) in enumerate(jax.tree_util.tree_flatten_with_path(item.shapes())[0]):
        name = _file_name(i, p)
        leaves.append(
            {
                "path": keystr(p),
                "file": name,
                "undo": name[:-4] + ".undo.npy",
                "shape": list(x.shape),
                "dtype": np.dtype(x.dtype).name,
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "capacity": int(capacity),
        "leaves": leaves,
    }


def describe(manifest: dict) -> str:
    return (
        f"capacity {manifest.get('capacity')}, leaves "
        f"{[(l['path'], l['shape'], l['dtype']) for l in manifest.get('leaves', [])]}"
    )


def read_manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw.decode("utf-8"))
        manifest["leaves"], manifest["capacity"]  # noqa: B018 - the fields every reader needs
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise _checkpoint.CheckpointError(
            "MemmapStorage", path, f"is not a MemmapStorage manifest ({e!r})"
        ) from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"MemmapStorage: {directory} holds a buffer of format version "
            f"{manifest.get('format_version')!r}; this functional_rb reads version "
            f"{FORMAT_VERSION} (with a commit record). Copy its items into a new buffer "
            "with the functional_rb that wrote it, or use a new path."
        )
    return manifest


def create(directory: str, manifest: dict) -> None:
    """The files of an empty buffer; the manifest goes last: its presence means they are
    complete."""
    close_directory(directory)
    os.makedirs(directory, exist_ok=True)
    capacity = manifest["capacity"]
    for leaf in manifest["leaves"]:
        for name in (leaf["file"], leaf["undo"]):
            np.lib.format.open_memmap(
                os.path.join(directory, name),
                mode="w+",
                dtype=np.dtype(leaf["dtype"]),
                shape=(capacity, *leaf["shape"]),
            ).flush()
    _journal.create(directory, capacity)
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fsync_path(directory, directory=True)


def saved_count(directory: str) -> int | None:
    """The write count recorded by the last ``checkpoint`` (None if none is readable)."""
    try:
        meta = _checkpoint.verify(os.path.join(directory, STATE_DIR), data=False).meta
        return int(meta["user"]["memmap_writes"])
    except (FileNotFoundError, _checkpoint.CheckpointError, KeyError, TypeError):
        return None


def roll_back(directory: str, files: Files, saved: int | None, where: str) -> None:
    """Roll back the writes after the last checkpoint (``saved``: its recorded write count)."""
    if saved is not None:
        problem = _journal.adopt(files.journal, saved)
        if problem:
            raise _checkpoint.CheckpointError(
                where,
                os.path.join(directory, STATE_DIR),
                problem,
                "Restore from a state saved by rb.storage.checkpoint on this directory.",
            )
    _journal.recover(files.journal, files.data, files.undo)
    files.journal.flush()


def lock(fd: int | None, exclusive: bool, wait: bool = True) -> bool:
    if fd is None or fcntl is None:
        return True
    flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    return True


def open_directory(directory: str) -> Files:
    """This process's mapping of ``directory``; the first open by a process that has the
    directory to itself rolls back the writes after the last checkpoint."""
    entry = _OPEN.get(directory)
    if entry is not None:
        return entry
    manifest = read_manifest(directory)
    if manifest is None:
        raise FileNotFoundError(
            f"MemmapStorage: {os.path.join(directory, MANIFEST)} does not exist (the files "
            "were removed after init?). Call rb.init(example) again to recreate them."
        )
    capacity = manifest["capacity"]

    def mapped(name, leaf):
        path = os.path.join(directory, name)
        a, problem = _journal.map_npy(path, (capacity, *leaf["shape"]), leaf["dtype"])
        if a is None:
            raise _checkpoint.CheckpointError("MemmapStorage", path, problem)
        return a

    data = [mapped(leaf["file"], leaf) for leaf in manifest["leaves"]]
    for a in data:  # large maps ask for huge pages (the kernel falls back where it cannot)
        hugepages.advise(a)
    undo = [mapped(leaf["undo"], leaf) for leaf in manifest["leaves"]]
    journal, problem = _journal.open_journal(directory, capacity)
    if journal is None:
        raise _checkpoint.CheckpointError(
            "MemmapStorage", os.path.join(directory, _journal.JOURNAL), problem
        )
    fd = (
        os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None
        else None
    )
    files = Files(manifest, data, undo, journal, fd)
    if lock(fd, exclusive=True, wait=False):
        roll_back(directory, files, saved_count(directory), "MemmapStorage")
    lock(fd, exclusive=False)
    _OPEN[directory] = files
    return files


def close_directory(directory: str) -> None:
    """Flush and unmap ``directory`` in this process and release its lock."""
    files = _OPEN.pop(os.path.abspath(directory), None)
    if files is None:
        return
    for a in files.data + files.undo + [files.journal]:
        a.flush()
    if files.lock is not None:
        os.close(files.lock)


def wrote(files: Files, version) -> None:
    """Record that this process's last write left the files at ``version`` (a device array)."""
    files.last = (version, _journal.current(files.journal_view))


def written(files: Files, version) -> bool:
    """Whether ``version`` is the very array :func:`wrote` recorded: its write ran on the host
    and is done, so nothing needs to wait for the device to compute it."""
    return files.last is not None and files.last[0] is version


def check_current(node, files: Files, where: str) -> int:
    """The directory's write count, after checking that ``node`` (a ``MemmapStorageState``) is
    its newest state. A state whose version is :func:`written`, with no write since, is
    current without reading that array back from the device."""
    last = files.last
    if last is not None and written(files, node.version):
        count = _journal.current(files.journal_view)
        if last[1] == count:
            return count
    version = int(np.asarray(node.version))  # waits for the write that produced it
    count = _journal.current(files.journal_view)  # read after that wait: it counts the write
    if as_version(count) != version:
        raise ValueError(
            f"{where}: {node.directory} has completed {count} writes, but this state's "
            f"storage version is {version}: it is not the newest state of these files (a "
            "later add wrote over its items). Pass the state returned by the last add."
        )
    return count


def host_set(directory, version, positions, mask, *leaves):
    """Write ``leaves`` (one row per position) at ``positions`` where ``mask`` as one journaled
    write; returns the new version (the write count as int32)."""
    del version  # an input only so that the write waits for the state it extends
    files = open_directory(directory)
    mask = np.asarray(mask).reshape(-1).astype(bool)
    pos = np.asarray(positions).reshape(-1)
    rows = [np.asarray(x) for x in leaves]
    if not mask.all():
        pos, rows = pos[mask], [x[mask] for x in rows]
    return as_version(
        _journal.write(files.journal_view, files.data_views, files.undo_views, pos, rows)
    )


def host_get(directory, capacity, indices):
    """Every leaf's rows at ``indices``, as fresh arrays."""
    files = open_directory(directory)
    idx = np.clip(np.asarray(indices), 0, capacity - 1)  # like gather_rows
    return [a[idx] for a in files.data_views]
