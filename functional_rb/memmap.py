"""Host storage in NumPy memory-mapped files: for data larger than device memory.

``MemmapStorage(path)`` keeps one ``.npy`` file per leaf under ``path`` (leaves
``[capacity, *item_shape]``) plus ``manifest.json`` naming each leaf's path, file, shape and
dtype. Items never live on the device: ``set`` writes host pages, ``get`` copies the requested
rows into a fresh array.

How it runs
-----------
- Eagerly (concrete arrays) ``set``/``get`` are plain NumPy writes/reads.
- Under ``jax.jit`` / ``lax.scan`` they become ``jax.experimental.io_callback(ordered=True)``
  calls. The state carries an int32 ``version`` that ``set`` increments and ``get`` takes as an
  input: a read in a later jitted call data-depends on the write that produced its state, so it
  waits for it (JAX dispatches asynchronously); inside one traced function the ``ordered``
  effect keeps reads and writes in program order (a ``sample`` traced before an ``add`` reads the
  old rows).
- ``jax.vmap`` over a state is NOT supported: all states would share the same files, and JAX
  cannot batch ordered callbacks. ``set``/``get`` raise a ``TypeError`` when they see a batched
  value (JAX's own "Cannot vmap ordered IO callback" when vmap wraps a jitted function).
- ``donate_argnums`` works (only the small version counter is donated).

Persistence
-----------
Writes land in the page cache and reach the files at the latest when the process exits;
``flush()`` and ``checkpoint()`` force them. ``init`` on a path that already holds a matching
manifest reopens the files and keeps their data; ``checkpoint(state)`` stores the rest of the
buffer state (writer counters, sampler state) next to it and ``restore(state)`` brings it back,
so a new process continues where the old one left off::

    rb = frb.ReplayBuffer(capacity, storage=frb.MemmapStorage("/data/rb"))
    state = rb.init(example)
    ...                                   # add / sample
    rb.storage.checkpoint(state)
    # later, in another process
    state = rb.storage.restore(rb.init(example))

Files may also be shared by several processes (each opens its own mapping); this module does
not coordinate concurrent writers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from functional_rb._errors import is_traced, keystr
from functional_rb.layout import Context, Layout

PyTree = Any

MANIFEST = "manifest.json"
STATE_FILE = "buffer_state.npz"
_FORMAT = "functional_rb.MemmapStorage"
_FORMAT_VERSION = 1

# Open mappings per (absolute directory): (manifest dict, [np.memmap per leaf]). Process-local
# so that jitted callbacks and eager calls share one mapping per file.
_OPEN: dict[str, tuple[dict, list]] = {}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MemmapStorageState:
    """Only a counter is dynamic; the layout of the files is static (hashable) metadata."""

    version: jax.Array  # int32 []: number of set() calls; orders reads after writes
    treedef: Any = dataclasses.field(metadata=dict(static=True))          # item PyTreeDef
    shapes: tuple = dataclasses.field(metadata=dict(static=True))         # per leaf item shape
    dtypes: tuple = dataclasses.field(metadata=dict(static=True))         # per leaf dtype name
    capacity: int = dataclasses.field(metadata=dict(static=True))
    directory: str = dataclasses.field(metadata=dict(static=True))        # absolute path


def _file_name(i: int, path) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", keystr(path)).strip("_") or "leaf"
    return f"{i:03d}_{safe[:80]}.npy"


def _check_not_batched(where: str, *xs):
    for x in xs:
        if type(x).__name__ == "BatchTracer":  # jax keeps the class private
            raise TypeError(
                f"{where}: MemmapStorage does not support jax.vmap (every state would share "
                "the same files on disk, and ordered host callbacks cannot be batched). Use one "
                "buffer with a larger batch, ndim=2 for several environments, or DeviceStorage "
                "to vmap over independent buffers.")


@dataclasses.dataclass(frozen=True)
class MemmapStorage:
    """Items in NumPy memory-mapped files under ``path`` (one ``.npy`` per leaf).

    Args:
      path: a directory (created if missing). If it already holds a ``manifest.json`` for the
        same capacity and item spec, its data is kept (see :meth:`restore`); if it holds a
        different one, ``init`` raises.

    State: :class:`MemmapStorageState` (an int32 version counter; the rest is static).
    """

    path: str
    state_types = (MemmapStorageState,)  # what init builds

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"MemmapStorage: path must be a str or os.PathLike, got "
                            f"{type(self.path).__name__}.")
        object.__setattr__(self, "path", os.fspath(self.path))

    # ------------------------------------------------------------------ files
    @property
    def directory(self) -> str:
        return os.path.abspath(self.path)

    def _manifest_for(self, item: PyTree, layout: Layout) -> dict:
        leaves = []
        for i, (p, x) in enumerate(jax.tree_util.tree_flatten_with_path(item)[0]):
            dtype = np.dtype(x.dtype)
            if dtype.kind not in "biufc":
                raise TypeError(
                    f"MemmapStorage.init: leaf {keystr(p)} has dtype {dtype}, which NumPy "
                    "cannot memory-map portably; store it as a numeric or bool array.")
            leaves.append({"path": keystr(p), "file": _file_name(i, p),
                           "shape": [int(d) for d in np.shape(x)], "dtype": dtype.name})
        return {"format": _FORMAT, "format_version": _FORMAT_VERSION,
                "capacity": int(layout.capacity), "leaves": leaves}

    def _open(self, directory: str) -> list:
        entry = _OPEN.get(directory)
        if entry is None:
            manifest_path = os.path.join(directory, MANIFEST)
            if not os.path.exists(manifest_path):
                raise FileNotFoundError(
                    f"MemmapStorage: {manifest_path} does not exist (the files were removed "
                    "after init?). Call rb.init(example) again to recreate them.")
            with open(manifest_path) as f:
                manifest = json.load(f)
            arrays = [np.load(os.path.join(directory, leaf["file"]), mmap_mode="r+")
                      for leaf in manifest["leaves"]]
            entry = (manifest, arrays)
            _OPEN[directory] = entry
        return entry[1]

    def init(self, item: PyTree, layout: Layout) -> MemmapStorageState:
        directory = self.directory
        manifest = self._manifest_for(item, layout)
        os.makedirs(directory, exist_ok=True)
        manifest_path = os.path.join(directory, MANIFEST)
        if os.path.exists(manifest_path):
            with open(manifest_path) as f:
                old = json.load(f)
            if old != manifest:
                raise ValueError(
                    f"MemmapStorage.init: {directory} already holds a buffer with a different "
                    f"layout (capacity {old.get('capacity')}, leaves "
                    f"{[(l['path'], l['shape'], l['dtype']) for l in old.get('leaves', [])]}) "
                    f"than requested (capacity {manifest['capacity']}, leaves "
                    f"{[(l['path'], l['shape'], l['dtype']) for l in manifest['leaves']]}). "
                    "Use a new path, or delete the directory to start over.")
            self._open(directory)  # reopen: keep the data
        else:
            _OPEN.pop(directory, None)
            arrays = []
            for leaf in manifest["leaves"]:
                arrays.append(np.lib.format.open_memmap(
                    os.path.join(directory, leaf["file"]), mode="w+",
                    dtype=np.dtype(leaf["dtype"]),
                    shape=(layout.capacity, *leaf["shape"])))
            for a in arrays:
                a.flush()
            # The manifest goes last: its presence means the files are complete.
            tmp = manifest_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
            os.replace(tmp, manifest_path)
            _OPEN[directory] = (manifest, arrays)
        treedef = jax.tree_util.tree_structure(item)
        return MemmapStorageState(
            version=jnp.int32(0), treedef=treedef,
            shapes=tuple(tuple(l["shape"]) for l in manifest["leaves"]),
            dtypes=tuple(l["dtype"] for l in manifest["leaves"]),
            capacity=int(layout.capacity), directory=directory)

    def check_state(self, state: MemmapStorageState, capacity: int,
                    num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items (None if it
        can)."""
        del num_envs
        if state.capacity != capacity:
            return (f"state.storage.capacity is {state.capacity} (the files under "
                    f"{state.directory} hold {state.capacity} items), expected "
                    f"capacity={capacity}")
        return None

    def item_spec(self, state: MemmapStorageState) -> PyTree:
        leaves = [jax.ShapeDtypeStruct(s, np.dtype(d))
                  for s, d in zip(state.shapes, state.dtypes)]
        return jax.tree_util.tree_unflatten(state.treedef, leaves)

    # ------------------------------------------------------------------ host side
    def _host_set(self, directory, version, positions, mask, *leaves):
        arrays = self._open(directory)
        positions = np.asarray(positions).reshape(-1)
        mask = np.asarray(mask).reshape(-1).astype(bool)
        pos = positions[mask]
        for a, x in zip(arrays, leaves):
            a[pos] = np.asarray(x)[mask]
        return np.asarray(version, np.int32) + np.int32(1)

    def _host_get(self, directory, capacity, indices):
        arrays = self._open(directory)
        idx = np.clip(np.asarray(indices), 0, capacity - 1)  # like gather_rows' mode="clip"
        return [np.ascontiguousarray(a[idx]) for a in arrays]

    # ------------------------------------------------------------------ protocol
    def set(self, state: MemmapStorageState, positions: jax.Array, items: PyTree,
            mask: jax.Array, ctx: Context) -> MemmapStorageState:
        del ctx
        leaves = jax.tree_util.tree_leaves(items)
        args = (state.version, positions, mask, *leaves)
        _check_not_batched("MemmapStorage.set", *args)
        if not any(is_traced(a) for a in args):
            version = self._host_set(state.directory, *(np.asarray(a) for a in args))
            return dataclasses.replace(state, version=jnp.asarray(version, jnp.int32))
        version = io_callback(
            lambda *a: self._host_set(state.directory, *a),
            jax.ShapeDtypeStruct((), jnp.int32), *args, ordered=True)
        return dataclasses.replace(state, version=version)

    def get(self, state: MemmapStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        indices = jnp.asarray(indices, jnp.int32) if not isinstance(indices, np.ndarray) \
            else indices.astype(np.int32)
        _check_not_batched("MemmapStorage.get", state.version, indices)
        if not (is_traced(state.version) or is_traced(indices)):
            np.asarray(state.version)  # blocks until the write that produced it has run
            leaves = self._host_get(state.directory, state.capacity, np.asarray(indices))
            leaves = [jnp.asarray(x) for x in leaves]
        else:
            shapes = [jax.ShapeDtypeStruct(tuple(indices.shape) + s, np.dtype(d))
                      for s, d in zip(state.shapes, state.dtypes)]
            leaves = io_callback(
                lambda v, i: self._host_get(state.directory, state.capacity, i),
                shapes, state.version, indices, ordered=True)
        return jax.tree_util.tree_unflatten(state.treedef, list(leaves))

    # ------------------------------------------------------------------ persistence
    def flush(self) -> None:
        """Write dirty pages of this storage's files to disk."""
        entry = _OPEN.get(self.directory)
        if entry is not None:
            for a in entry[1]:
                a.flush()

    def checkpoint(self, state) -> str:
        """Flush the files and save the small arrays of a ``BufferState`` (writer, sampler,
        version) to ``<path>/buffer_state.npz``; returns that file's path."""
        self.flush()
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        arrays = {f"{i:04d}": np.asarray(x) for i, (_, x) in enumerate(leaves)}
        arrays["__paths__"] = np.asarray(json.dumps([keystr(p) for p, _ in leaves]))
        out = os.path.join(self.directory, STATE_FILE)
        tmp = out + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, out)
        return out

    def restore(self, state):
        """``state`` (a fresh ``rb.init(example)`` on this path) with every leaf replaced by
        the one saved by :meth:`checkpoint`. Raises if the structures differ."""
        src = os.path.join(self.directory, STATE_FILE)
        if not os.path.exists(src):
            raise FileNotFoundError(
                f"MemmapStorage.restore: {src} does not exist; call "
                "rb.storage.checkpoint(state) before restoring.")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        with np.load(src) as f:
            saved_paths = json.loads(str(f["__paths__"]))
            paths = [keystr(p) for p, _ in leaves]
            if saved_paths != paths:
                raise ValueError(
                    f"MemmapStorage.restore: the saved state has leaves {saved_paths}, the "
                    f"given state {paths}. Restore into a state built by the same ReplayBuffer "
                    "configuration (sampler, writer) and example.")
            new = []
            for i, (p, x) in enumerate(leaves):
                y = f[f"{i:04d}"]
                if y.shape != np.shape(x) or y.dtype != np.dtype(x.dtype):
                    raise ValueError(
                        f"MemmapStorage.restore: leaf {keystr(p)} was saved with shape "
                        f"{y.shape} dtype {y.dtype}, expected {np.shape(x)} {x.dtype}.")
                new.append(jnp.asarray(y))
        return jax.tree_util.tree_unflatten(treedef, new)
