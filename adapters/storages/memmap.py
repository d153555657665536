"""``LazyMemmapStorage``: the data in memory-mapped files, shareable between processes.

Like TorchRL's: at the first write a memory-mapped TensorDict (or one ``.memmap`` file per
PyTree leaf) of ``[max_size, ...]`` is created under ``scratch_dir``. Any process holding the
storage (pickled to it, or inherited) maps the same files.

Processes write to the same ring without losing writes, and a sample never holds a torn row
or a dead writer's: the storage is a
:class:`~functional_rb.adapters.storages._shared_ring.SharedRing` from its first write (its
cursor file, with commit marks and row stamps, in ``scratch_dir``); that module describes the
reservations, what a reader sees while rows are rewritten, dead writers and the bounds.
"""

from __future__ import annotations

import os
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
from tensordict import MemoryMappedTensor, TensorDict, is_tensor_collection

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
from functional_rb.adapters.storages import _cleanup
from functional_rb.adapters.storages._hugepages import advise_tensors
from functional_rb.adapters.storages.tensor import LazyTensorStorage

_CURSOR = "cursor.bin"


try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: SharedCursor refuses to be built there
    fcntl = None


class _DirLock:
    """An exclusive ``flock`` on ``<dir>/init.lock``: one process at a time creates the files
    of a ``shared_init`` storage."""

    def __init__(self, root: str):
        self.path = os.path.join(root, "init.lock")

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _leaf_paths(tree):
    """``[(path parts, leaf)]`` of a torch PyTree, TorchRL's file naming."""
    from torch.utils._pytree import tree_flatten_with_path

    out = []
    for path, leaf in tree_flatten_with_path(tree)[0]:
        parts = []
        for p in path:
            key = getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))
            parts.append(str(key).replace(".", "_<dot>_"))
        out.append((parts, leaf))
    return out


class LazyMemmapStorage(LazyTensorStorage, shared_backing=True):
    """Memory-mapped files under ``scratch_dir`` (TorchRL's ``LazyMemmapStorage``).

    Args:
      max_size: the capacity, in elements.
      scratch_dir: where the files go (default: a temporary directory, removed with the
        storage when ``auto_cleanup``).
      device: CPU only, as in TorchRL (move samples with a transform).
      ndim: how many leading dims count as elements (``2``: ``[time, env]``).
      existsok: reuse files already in ``scratch_dir``.
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.
      shared_init: any process may be the first to write (``ndim=1`` only).
      auto_cleanup: remove the files when the storage goes away (default: True for a
        temporary directory, False for one you chose); :meth:`cleanup` removes them now.
      checkpointer: the on-disk format of ``dumps`` / ``loads``.

    Shared by processes, a sample never holds a row that a writer is copying or that a writer
    which died left half-written: such a row is not drawn (a row overwritten between the draw
    and the gather is replaced by another item of the same batch; see the module docstring).
    ``len(storage)`` is the rows samplers index; :meth:`committed_len` the rows drawable now.

    Example:
        >>> import tempfile, torch
        >>> from functional_rb.adapters import LazyMemmapStorage, ReplayBuffer
        >>> storage = LazyMemmapStorage(100, scratch_dir=tempfile.mkdtemp(), auto_cleanup=True)
        >>> rb = ReplayBuffer(storage=storage, batch_size=8)
        >>> index = rb.extend(torch.randn(10, 3))
        >>> rb.sample().shape
        torch.Size([8, 3])
        >>> storage.cleanup()
        True
    """

    def __init__(
        self,
        max_size: int,
        *,
        scratch_dir: str | os.PathLike | None = None,
        device: torch.device | str = "cpu",
        ndim: int = 1,
        existsok: bool = False,
        compilable: bool = False,
        shared_init: bool = False,
        auto_cleanup: bool | None = None,
        checkpointer: StorageCheckpointerBase | None = None,
    ):
        if getattr(self, "_built", False):
            return  # made by shared_in_memory, then handed to __init__ again by type.__call__
        super().__init__(
            max_size,
            device=device if device != "auto" else "cpu",
            ndim=ndim,
            compilable=compilable,
            checkpointer=checkpointer,
        )
        if self.device.type != "cpu":
            raise ValueError(
                "Memory map device other than CPU isn't supported. To cast your "
                "data to the desired device, use "
                "`buffer.append_transform(lambda x: x.to(device))`."
            )
        if shared_init and self.ndim != 1:
            raise NotImplementedError(
                f"LazyMemmapStorage(shared_init=True, ndim={ndim}): the ring's row count "
                "depends on the first item's shape, so processes cannot agree on it before "
                "any data exists. Extend the buffer once in the creating process, then hand "
                "it to the workers (shared_init is then not needed)."
            )
        self._scratch_dir_is_temp = scratch_dir is None  # (TorchRL's name)
        self.scratch_dir = None if scratch_dir is None else str(scratch_dir)
        self.existsok = existsok
        if auto_cleanup is not None and not isinstance(auto_cleanup, bool):
            raise TypeError(
                f"LazyMemmapStorage: auto_cleanup must be a bool or None, got {auto_cleanup!r}."
            )
        self._auto_cleanup = self._scratch_dir_is_temp if auto_cleanup is None else auto_cleanup
        self._cleaned_up = False
        self._finalizer = None  # removes the files when the storage is collected / at exit
        self._owner = os.getpid()
        if self._auto_cleanup:
            _cleanup.watch(self)
        self.shared_init = bool(shared_init)
        if self.shared_init:  # the directory and the cursor exist before any data, so every
            self._open_cursor(reset=True)  # process that gets the storage reserves from them

    @classmethod
    def shared_in_memory(
        cls,
        max_size: int,
        *,
        device="cpu",
        ndim: int = 1,
        compilable: bool = False,
        consolidated: bool = False,
        cleanup_memmap: bool = True,
        checkpointer=None,
    ):
        """What ``LazyTensorStorage(..., shared_init=True)`` builds: this storage over a
        temporary directory, removed with it."""
        del consolidated, cleanup_memmap
        out = cls(
            max_size, ndim=ndim, compilable=compilable, shared_init=True, checkpointer=checkpointer
        )
        # warned at the first write, as TorchRL does (when the CPU backing is allocated)
        out._unhonored_device = None if str(device) in ("cpu", "auto") else str(device)
        out._built = True
        return out

    # ------------------------------------------------------------------ allocation
    def _dir(self) -> str:
        if self.scratch_dir is None:
            self.scratch_dir = tempfile.mkdtemp(prefix="frb_memmap_")
        if self._auto_cleanup and self._finalizer is None and os.getpid() == self._owner:
            self._finalizer = weakref.finalize(
                self, _cleanup.remove_dir, self.scratch_dir, self._owner
            )
        os.makedirs(self.scratch_dir, exist_ok=True)
        return self.scratch_dir

    def _init(self, item) -> None:
        if getattr(self, "_unhonored_device", None) is not None:
            warnings.warn(
                f"LazyTensorStorage(device={self._unhonored_device!r}, "
                "shared_init=True): the device cannot be honored; processes share "
                "CPU memory maps. Move samples with "
                "buffer.append_transform(lambda x: x.to(device)).",
                stacklevel=2,
            )
            self._unhonored_device = None
        if not self.shared_init:
            return self._create(item)
        if not is_tensor_collection(item):
            raise TypeError(
                f"LazyMemmapStorage(shared_init=True) stores TensorDicts (a process "
                f"opens the files another one created by their metadata); got "
                f"{type(item).__name__}. Wrap the data in a TensorDict."
            )
        with _DirLock(self._dir()):  # one process creates the files, the others open them
            if not self._try_open():
                self._create(item)

    def _try_open(self) -> bool:
        """With ``shared_init``: map the files another process created, if there are any."""
        if (Path(self._dir()) / "meta.json").exists():
            self._storage = TensorDict.load_memmap(self._dir())
            advise_tensors(self._storage)  # each process maps the files anew: its own advice
            self.initialized = True
            return True
        return False

    def _create(self, item) -> None:
        root = self._dir()
        if is_tensor_collection(item):
            out = item.clone().to("cpu").expand(self._rows_shape(item.shape))
            try:
                out = out.memmap_like(prefix=root, existsok=self.existsok)
            except RuntimeError as e:
                raise RuntimeError(
                    f"LazyMemmapStorage: cannot create the memory maps in {root} "
                    f"({e}); pass existsok=True to reuse existing files or "
                    "choose another scratch_dir."
                ) from e
        else:
            spec = D.tree_flatten(item)[1]
            maps = []
            for parts, leaf in _leaf_paths(item):
                leaf = torch.as_tensor(leaf)
                file = Path(
                    root, *parts[:-1], (parts[-1] if parts else "_-single-tensor-_") + ".memmap"
                )
                if file.exists() and not self.existsok:
                    raise RuntimeError(
                        f"The storage of tensor {file} already exists; pass "
                        "existsok=True or choose another scratch_dir."
                    )
                file.parent.mkdir(parents=True, exist_ok=True)
                maps.append(
                    MemoryMappedTensor.empty(
                        self._rows_shape(leaf.shape), dtype=leaf.dtype, filename=file
                    )
                )
            out = D.tree_unflatten(maps, spec)
        advise_tensors(out)  # file maps: large folios where the file system has them
        self._storage = out
        self.initialized = True
        if not self.shared_init:  # else the cursor already counts every process's writes
            self._open_cursor(reset=True)
            self._reset_count(self._len // self.row_numel())  # counted before the files

    def get(self, index):
        if not self.initialized and self.shared_init:  # another process may have written
            with _DirLock(self._dir()):
                self._try_open()
        return super().get(index)

    def _cursor_path(self) -> str:
        return os.path.join(self._dir(), _CURSOR)

    def _adopt(self, data):
        """A TensorDict loaded by ``load_state_dict`` into an empty storage: mapped to files."""
        root = self._dir()
        data = (
            data.memmap_like(prefix=root, existsok=True).update_(data)
            if is_tensor_collection(data)
            else data
        )
        return data

    def adopt_loaded(self, data, path):
        """The storage data for a loaded dump (``TensorStorageCheckpointer``): the files
        themselves when the dump is this storage's ``scratch_dir``."""
        if self.scratch_dir and Path(self.scratch_dir).absolute() == Path(path).absolute():
            self._storage = data
            self.initialized = True
            self._open_cursor(reset=False)
            return data
        return super().adopt_loaded(data, path)

    def restore(self, data, length: int) -> None:
        self._storage = data
        self.initialized = data is not None
        if self.initialized and self._cursor is None:
            self._open_cursor(reset=False)
        if self._cursor is None:
            self._len = int(length)
        else:
            self._reset_count(-(int(length) // -self.row_numel()))
        self._bump()

    # ------------------------------------------------------------------ files
    def cleanup(self) -> bool:
        """Remove ``scratch_dir`` and everything in it now (the storage is unusable
        afterwards); called when the storage goes away if ``auto_cleanup`` (collected, at exit,
        on SIGTERM). Returns whether files were removed:
        False when already cleaned up, never written, gone already, or in another process
        than the one that created the storage (which alone removes its files)."""
        if self._cleaned_up or os.getpid() != self._owner:
            return False
        self._cleaned_up = True
        _cleanup.unwatch(self)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._storage, self.initialized, self._cursor = None, False, None
        if self.scratch_dir is None:
            return False
        return _cleanup.remove_dir(self.scratch_dir, self._owner)

    def __getstate__(self):
        import multiprocessing.context as mpc

        if mpc.get_spawning_popen() is not None and not self.initialized and not self.shared_init:
            raise RuntimeError(
                "Cowardly refusing to share a LazyMemmapStorage between processes: it has not "
                "been initialized yet (it holds no data), so each process would create its own "
                "files. Extend the buffer once in this process before handing it to workers, "
                "or build the storage with shared_init=True."
            )
        state = super().__getstate__()
        state["_storage"] = None
        state["_cursor"] = None
        state["_reopen"] = self.initialized
        state["_auto_cleanup"] = False  # only the creating process removes the files
        state["_finalizer"] = None
        return state

    def _for_process(self) -> dict:
        return self.__getstate__()  # the files are shared, whichever way it is pickled

    def _plain_state(self, state: dict) -> dict:
        return self._ring_state(state)  # (the cursor is reopened from the files)

    def __setstate__(self, state):
        reopen = state.pop("_reopen", False)
        self.__dict__.update(state)
        self._pid = os.getpid()
        self._home_pid = os.getpid()
        if reopen:
            self._storage = self._reopen()
            self._open_cursor(reset=False)
        elif self.shared_init:
            self._open_cursor(reset=False)

    def _reopen(self):
        root = Path(self.scratch_dir)
        if (root / "meta.json").exists():
            data = TensorDict.load_memmap(root)
            advise_tensors(data)  # this process's own maps of the files: its own advice
            return data
        raise RuntimeError(
            f"LazyMemmapStorage: cannot reopen the PyTree data under {root} in "
            "another process; share TensorDict data."
        )

    def __repr__(self):
        return (
            f"{type(self).__name__}(scratch_dir={self.scratch_dir}, len={len(self)}, "
            f"max_size={self.max_size})"
        )
