"""Host storage in NumPy memory-mapped files: for data larger than device memory.

``MemmapStorage(path)`` keeps one ``.npy`` file per leaf under ``path`` (leaves
``[capacity, *item_shape]``, readable with ``np.load``), ``manifest.json`` naming each leaf's
path, file, shape and dtype, and the commit record (``journal.npy`` and one ``.undo.npy`` per
leaf, see :mod:`functional_rb.storages.journal`). Items never live on the device: ``set`` writes host
pages, ``get`` copies the requested rows into a fresh array.

How it runs
-----------
- Eagerly (concrete arrays) ``set``/``get`` are plain NumPy writes/reads. The storage declares
  ``host_io``, so an eager ``rb.add`` / ``rb.sample`` compiles the buffer's other work and
  calls them with concrete arrays in between (:mod:`functional_rb._internal.host_calls`). An
  eager ``set`` refuses a state that is not the newest of its files (a later write moved them
  on), naming it; under ``jit`` the version is not checked.
- Under ``jax.jit`` / ``lax.scan`` they become ``jax.experimental.io_callback(ordered=True)``
  calls. The state carries an int32 ``version`` (the directory's count of writes, modulo
  2**32) that ``set`` advances and ``get`` takes as an input: a read in a later jitted call
  data-depends on the write that produced its state, so it waits for it (JAX dispatches
  asynchronously); inside one traced function the ``ordered`` effect keeps reads and writes
  in program order (a ``sample`` traced before an ``add`` reads the old rows).
- ``jax.vmap`` over a state is NOT supported: all states would share the same files, and JAX
  cannot batch ordered callbacks. ``set``/``get`` raise a ``TypeError`` when they see a batched
  value (JAX's own "Cannot vmap ordered IO callback" when vmap wraps a jitted function).
- ``donate_argnums`` works (only the small version counter is donated).

Persistence: commits and crashes
--------------------------------
``rb.storage.checkpoint(state)`` commits: it makes the files durable and saves the rest of
the buffer state (writer counters, sampler state: priorities, epochs) atomically, with
:mod:`functional_rb.checkpoint`, in ``path/state``. Writes after it are not committed yet: when
a process that wrote them dies (killed at any moment, even in the middle of an ``add``), the
next process to open the directory rolls them back, so the files hold exactly the items of the
writes up to the last checkpoint (never a torn item, with fields of two writes), and
``restore`` returns exactly the state that describes them::

    rb = frb.ReplayBuffer(capacity, storage=frb.MemmapStorage("/data/rb"))
    state = rb.init(example)
    ...                                   # add / sample
    rb.storage.checkpoint(state)          # commit: cheap, in place (no copy of the items)
    # later, in another process (e.g. after a crash)
    state = rb.storage.restore(rb.init(example))

Rolling back needs the old rows of the slots overwritten since the checkpoint: the first write
over a committed item copies its row to the undo files (at most one copy per slot per
checkpoint; the undo files are sparse until used). ``restore`` in the process that wrote rolls
back its own uncommitted writes. ``frb.checkpoint.save(path, state)`` instead copies the items
into a self-contained checkpoint, and ``frb.checkpoint.load`` writes them back (a write like
any other, committed by the next ``rb.storage.checkpoint``).

Crash safety covers a process that dies; after a power loss only what ``checkpoint`` saved is
durable (see :mod:`functional_rb.storages.journal`). One process writes a directory at a time: each
process that opens it holds a shared ``flock`` on ``path/lock``, and only a process that opens
it alone rolls back (others may read it; their writes are not coordinated). Where ``flock`` is
missing (Windows) every first open in a process rolls back.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from functional_rb._internal.errors import is_traced, keystr
from functional_rb._internal.item_spec import ItemSpec
from functional_rb._internal.jit import to_device
from functional_rb._internal.names import stable
from functional_rb.checkpoint import state_io as _checkpoint
from functional_rb.protocol import Context, Layout, Storage, WriteRecord
from functional_rb.storages import journal as _journal
from functional_rb.storages import memmap_files as _files
from functional_rb.storages.memmap_files import LOCK, MANIFEST, STATE_DIR, close_directory

PyTree = Any

__all__ = [
    "MemmapStorage",
    "MemmapStorageState",
    "close_directory",
    "LOCK",
    "MANIFEST",
    "STATE_DIR",
]


# ---------------------------------------------------------------------------------- state
@stable("MemmapStorageState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MemmapStorageState:
    """Only a counter is dynamic; where the files are and what they hold is static.

    version: int32 ``[]``: the directory's count of completed writes after this state's last
      write (modulo 2**32); orders reads after writes.
    item: the stored item's description (tree, per-leaf shapes and dtypes).
    """

    version: jax.Array
    item: ItemSpec = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    directory: str = dataclasses.field(metadata=dict(static=True))  # absolute path

    # -- frb.checkpoint.HostBacked: a checkpoint copies the items, a load writes them back
    def snapshot_arrays(self) -> dict:
        """``{leaf path: np.memmap [capacity, *item]}``: the files' rows, all of them."""
        files = _files.open_directory(self.directory)
        _files.check_current(self, files, "checkpoint.save")
        return {leaf["path"]: a for leaf, a in zip(files.manifest["leaves"], files.data)}

    def mismatch(self, other: MemmapStorageState, where: str) -> str | None:
        if self.capacity != other.capacity:
            return (
                f"{where}.capacity is {self.capacity} in the checkpoint, "
                f"{other.capacity} in the template (a different capacity?)"
            )
        if self.item != other.item:
            return (
                f"{where}.item is {_files.describe(_files.manifest_for(self.item, 0))} in the "
                f"checkpoint, {_files.describe(_files.manifest_for(other.item, 0))} in the template "
                "(a different example?)"
            )
        return None

    def restore_arrays(self, arrays: dict) -> MemmapStorageState:
        """Write the saved rows into this state's directory (created if missing) as one
        journaled write; returns the state with that write's version."""
        wanted = _files.manifest_for(self.item, self.capacity)
        found = _files.read_manifest(self.directory)
        if found is None:
            _files.create(self.directory, wanted)
        elif (found["capacity"], found["leaves"]) != (wanted["capacity"], wanted["leaves"]):
            raise ValueError(
                f"checkpoint.load: {self.directory} holds a MemmapStorage of another layout "
                f"({_files.describe(found)}) than the checkpoint's ({_files.describe(wanted)}). Pass "
                "like= a state whose storage is at another path, or remove the directory."
            )
        files = _files.open_directory(self.directory)
        rows = [arrays[leaf["path"]] for leaf in wanted["leaves"]]
        count = _journal.write(
            files.journal, files.data, files.undo, np.arange(self.capacity), rows
        )
        return dataclasses.replace(self, version=jnp.asarray(_files.as_version(count)))


def _check_not_batched(where: str, *xs):
    for x in xs:
        if type(x).__name__ == "BatchTracer":  # jax keeps the class private
            raise TypeError(
                f"{where}: MemmapStorage does not support jax.vmap (every state would share "
                "the same files on disk, and ordered host callbacks cannot be batched). Use one "
                "buffer with a larger batch, ndim=2 for several environments, or DeviceStorage "
                "to vmap over independent buffers."
            )


def _read(state: MemmapStorageState, indices) -> list:
    """Every leaf's rows at concrete ``indices``, as NumPy arrays, once the write that produced
    ``state`` has run."""
    if not _files.written(_files.open_directory(state.directory), state.version):
        np.asarray(state.version)  # blocks until that write has run
    return _files.host_get(state.directory, state.capacity, np.asarray(indices))


@jax.jit
def _next_version(version):
    return version + jnp.int32(1)


# ---------------------------------------------------------------------------------- storage
@dataclasses.dataclass(frozen=True)
class MemmapStorage(Storage):
    """Items in NumPy memory-mapped files under ``path`` (one ``.npy`` per leaf).

    Args:
      path: a directory (created if missing). If it already holds a buffer of the same
        capacity and item spec, ``init`` reopens it (rolling back writes after its last
        checkpoint when no other process has it open) and keeps its data (see
        :meth:`restore`); if it holds a different one, ``init`` raises.

    State: :class:`MemmapStorageState` (an int32 version counter; the rest is static).
    """

    path: str
    state_types = (MemmapStorageState,)
    host_io = True

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(
                f"MemmapStorage: path must be a str or os.PathLike, got {type(self.path).__name__}."
            )
        object.__setattr__(self, "path", os.fspath(self.path))

    @property
    def directory(self) -> str:
        return os.path.abspath(self.path)

    def init(self, item: PyTree, layout: Layout) -> MemmapStorageState:
        for p, x in jax.tree_util.tree_flatten_with_path(item)[0]:
            if np.dtype(x.dtype).kind not in "biufc":
                raise TypeError(
                    f"MemmapStorage.init: leaf {keystr(p)} has dtype {np.dtype(x.dtype)}, "
                    "which NumPy cannot memory-map portably; store it as a numeric or bool "
                    "array."
                )
        spec = ItemSpec.from_tree(item)
        directory = self.directory
        manifest = _files.manifest_for(spec, layout.capacity)
        old = _files.read_manifest(directory)
        if old is None:
            _files.create(directory, manifest)
        elif (old["capacity"], old["leaves"]) != (manifest["capacity"], manifest["leaves"]):
            raise ValueError(
                f"MemmapStorage.init: {directory} already holds a buffer with a different "
                f"layout ({_files.describe(old)}) than requested ({_files.describe(manifest)}). Use a new "
                "path, or delete the directory to start over."
            )
        files = _files.open_directory(directory)
        return MemmapStorageState(
            version=jnp.asarray(_files.as_version(_journal.current(files.journal))),
            item=spec,
            capacity=int(layout.capacity),
            directory=directory,
        )

    def check_state(self, state: MemmapStorageState, capacity: int, num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items (None if it
        can)."""
        del num_envs
        if state.capacity != capacity:
            return (
                f"state.storage.capacity is {state.capacity} (the files under "
                f"{state.directory} hold {state.capacity} items), expected "
                f"capacity={capacity}"
            )
        return None

    def item_spec(self, state: MemmapStorageState) -> PyTree:
        return state.item.shapes()

    def set(
        self, state: MemmapStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> MemmapStorageState:
        del ctx
        args = (state.version, record.positions, record.mask, *jax.tree_util.tree_leaves(items))
        _check_not_batched("MemmapStorage.set", *args)
        if not any(is_traced(a) for a in args):
            files = _files.open_directory(state.directory)
            _files.check_current(state, files, "MemmapStorage.set")
            # (the version is passed as it is: host_set only orders jitted writes by it, and
            # reading it here would wait for the device, which check_current just avoided)
            _files.host_set(state.directory, state.version, *(np.asarray(a) for a in args[1:]))
            # a write adds 1 to the count: the new version is computed where it lives
            # (copying the host's count to the device would cost several times more)
            version = _next_version(state.version)
            _files.wrote(files, version)
            return dataclasses.replace(state, version=version)
        version = io_callback(
            lambda *a: _files.host_set(state.directory, *a),
            jax.ShapeDtypeStruct((), jnp.int32),
            *args,
            ordered=True,
        )
        return dataclasses.replace(state, version=version)

    def get(self, state: MemmapStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        indices = (
            jnp.asarray(indices, jnp.int32)
            if not isinstance(indices, np.ndarray)
            else indices.astype(np.int32)
        )
        _check_not_batched("MemmapStorage.get", state.version, indices)
        if not (is_traced(state.version) or is_traced(indices)):
            leaves = to_device(*_read(state, indices))
        else:
            shapes = [
                jax.ShapeDtypeStruct(tuple(indices.shape) + x.shape, x.dtype)
                for x in jax.tree_util.tree_leaves(state.item.shapes())
            ]
            leaves = io_callback(
                lambda v, i: _files.host_get(state.directory, state.capacity, i),
                shapes,
                state.version,
                indices,
                ordered=True,
            )
        return jax.tree_util.tree_unflatten(state.item.treedef, list(leaves))

    def read_host(self, state: MemmapStorageState, indices: np.ndarray) -> PyTree:
        """``get`` for concrete ``indices``, as NumPy arrays: the read between the compiled
        calls of an eager ``sample`` (:mod:`functional_rb._internal.host_calls`), whose
        compiled finish takes them as they are (a copy to the device first would cost more
        than the read)."""
        return jax.tree_util.tree_unflatten(state.item.treedef, _read(state, indices))

    def touch(self) -> int:
        """Read every page of the item files through this process's mapping; returns the
        bytes touched.

        A random read of a page this process has not read yet costs a page fault (on a VM,
        ~10 us each: a 32 x 64 slice batch from a 10^9-item buffer touches ~64 new pages),
        and a page that is not in the OS page cache waits for the disk. Touching the files
        once maps every page (and reads from disk what is not cached), so that sampling
        runs at its steady cost from the first batch: call it after ``init`` reopens a large
        buffer, before a latency-sensitive loop. Pages the OS later evicts (files larger than
        free memory) fault again."""
        files = _files.open_directory(self.directory)
        page = mmap.PAGESIZE
        total = 0
        for a in files.data_views:
            flat = a.reshape(-1).view(np.uint8)
            for start in range(0, flat.size, 1 << 28):  # one byte per page, 256 MB at a time
                flat[start : start + (1 << 28) : page].max(initial=0)
            total += flat.size
        return total

    # ------------------------------------------------------------------ persistence
    def flush(self) -> None:
        """Write dirty pages of this storage's files to disk."""
        files = _files.opened(self.directory)
        if files is not None:
            for a in files.data + files.undo + [files.journal]:
                a.flush()

    def close(self) -> None:
        """Flush and unmap the files in this process and release its lock (the next use
        reopens them; a process that exits does the same implicitly)."""
        close_directory(self.directory)

    def _node(self, state: PyTree, where: str) -> MemmapStorageState:
        nodes = [
            x
            for x in jax.tree_util.tree_leaves(
                state, is_leaf=lambda x: isinstance(x, MemmapStorageState)
            )
            if isinstance(x, MemmapStorageState) and x.directory == self.directory
        ]
        if len(nodes) != 1:
            raise ValueError(
                f"{where}: the state holds {len(nodes)} MemmapStorage states of "
                f"{self.directory}, expected one; pass the BufferState of this "
                "buffer."
            )
        return nodes[0]

    @staticmethod
    def _stand_in(state: PyTree):
        """``state`` with its storage node replaced by its version leaf (what is saved)."""
        return jax.tree_util.tree_map(
            lambda x: x.version if isinstance(x, MemmapStorageState) else x,
            state,
            is_leaf=lambda x: isinstance(x, MemmapStorageState),
        )

    def checkpoint(self, state) -> str:
        """Commit: make the files durable and save the rest of ``state`` (a ``BufferState``
        of this buffer, the newest one) atomically to ``<path>/state``; returns that path.
        After it, a crash rolls the files back to here, never further."""
        node = self._node(state, "MemmapStorage.checkpoint")
        files = _files.open_directory(self.directory)
        count = _files.check_current(node, files, "MemmapStorage.checkpoint")
        self.flush()
        out = os.path.join(self.directory, STATE_DIR)
        _checkpoint.save(out, self._stand_in(state), meta={"memmap_writes": count})
        _journal.commit(files.journal, count)
        return out

    def restore(self, state):
        """The state saved by the last :meth:`checkpoint`, given ``state`` (a fresh
        ``rb.init(example)`` on this path) as the template; the files are rolled back to it
        first if this process wrote after it. Raises ``ValueError`` naming the difference if
        the saved state is of another configuration, :class:`~functional_rb.checkpoint.
        CheckpointError` naming the file if it is damaged."""
        where = "MemmapStorage.restore"
        self._node(state, where)  # the template holds this storage's state, once
        files = _files.open_directory(self.directory)
        src = os.path.join(self.directory, STATE_DIR)
        if not os.path.exists(src):
            raise FileNotFoundError(
                f"{where}: {src} does not exist; call rb.storage.checkpoint(state) before "
                "restoring."
            )
        try:
            saved = _checkpoint.load(src, like=self._stand_in(state))
        except _checkpoint.CheckpointError:  # damage: named by load (a ValueError too)
            raise
        except ValueError as e:
            raise ValueError(
                f"{where}: the state saved in {src} does not fit the given state: {e}"
            ) from e
        count = _files.saved_count(self.directory)
        if count is None:
            raise _checkpoint.CheckpointError(
                where,
                os.path.join(src, _checkpoint.MANIFEST),
                "records no write count: the directory was not written by MemmapStorage.checkpoint",
            )
        if (_journal.current(files.journal), _journal.committed(files.journal)) != (count,) * 2:
            if not _files.lock(files.lock, exclusive=True, wait=False):
                raise RuntimeError(
                    f"{where}: this process wrote to {self.directory} after its last "
                    "checkpoint, and other processes have it open, so it cannot roll those "
                    "writes back. Close the other processes' buffers first."
                )
            try:
                _files.roll_back(self.directory, files, count, where)
            finally:
                _files.lock(files.lock, exclusive=False)
        version = jnp.asarray(_files.as_version(count))
        return jax.tree_util.tree_map(
            lambda t, s: (
                dataclasses.replace(t, version=version) if isinstance(t, MemmapStorageState) else s
            ),
            state,
            saved,
            is_leaf=lambda x: isinstance(x, MemmapStorageState),
        )
