"""TorchRL's nested and H5 storage formats for TED data: one row (or H5 group) per trajectory.

Hooks (TorchRL 0.14's names and signatures)::

    TED2Nested(done_key=("next", "done"), shift_key="shift", is_full_key="is_full",
               done_keys=DEFAULT_DONE_KEYS, reward_keys=("reward",))
        hook(data, path=None) -> nested TensorDict      # save hook; hook.shift, hook.is_full
    Nested2TED(done_key="done", ...)   hook(nested, out=None) -> TED TensorDict   # load hook
    H5Split()                          hook(nested) -> {"traj_<i>": TensorDict, ...}
    H5Combine()                        hook(split, out=None) -> nested TensorDict

Checkpointers::

    NestedStorageCheckpointer(done_keys=None, reward_keys=None)
    H5StorageCheckpointer(*, checkpoint_file="checkpoint.h5", done_keys=None,
                          reward_keys=None, h5_kwargs=None, **ted_kwargs)

The nested layout starts from :class:`~functional_rb.adapters.ted_hooks.TED2Flat`'s flat
layout (``N = R * T`` rows, the rows of ``R`` time lines of ``T`` steps, oldest first) and cuts
it into trajectories. A trajectory ends at a row whose done flag (the flat ``done`` entry, any
element) is set, at the step written last (line position ``shift - 1`` when the storage is not
full) and at the end of each line. A trajectory of ``L`` steps holds ``L`` rows of every
``[N, ...]`` entry and ``L + 1`` rows of every ``[N + E, ...]`` entry (the observations) when
its last row is one of TED2Flat's ends (a done row or the step written last), ``L`` otherwise.

- Nested (``NestedStorageCheckpointer``; a directory): a memory-mapped TensorDict of batch
  ``[n_traj]`` in tensordict's format: per entry ``<key>.memmap`` (the flat entry's bytes,
  unchanged) and ``<key>.shape.memmap`` (int64 ``[n_traj, ndim]``: each trajectory's shape;
  ``meta.json`` marks the entry ``"is_nested": true``), the non-tensor entries ``shift``,
  ``is_full`` and ``_storage_shape`` as sub-directories, and ``storage_metadata.json``
  (``{"metadata": {}, "is_pytree": false, "len": len(storage)}``).
- H5 (``H5StorageCheckpointer``; one file, ``<path>/checkpoint.h5`` or ``path`` itself when it
  ends with ``.h5``): one group ``traj_<i>`` per trajectory (``i`` zero-padded to
  ``ceil(log10(n_traj))`` digits, so that the names sort in trajectory order) holding one
  dataset per entry (nested keys are sub-groups), and the scalar datasets ``_len``, ``shift``,
  ``is_full`` and ``_storage_shape`` in tensordict's non-tensor encoding (an HDF5 opaque type
  over the NumPy value).

Both load back through :class:`~functional_rb.adapters.ted_hooks.Flat2TED`, so the round trip
returns the storage as :class:`~functional_rb.adapters.checkpointers.FlatStorageCheckpointer`
does (same assumptions: root done entries all False, ``("next", obs)`` of a step equal to the
next step's ``obs`` within a trajectory).

Differences from TorchRL 0.14 (same files for the same valid data):

- ``h5_kwargs`` (e.g. ``compression="gzip"``) are given to the datasets of the trajectories
  only; TorchRL gives them to the scalar metadata datasets too, which h5py refuses ("Scalar
  datasets don't support chunk/filter options"), so TorchRL cannot write a compressed file.
  TorchRL reads ours.
- A trajectory's extra observation row follows TED2Flat's ends (above); TorchRL's TED2Nested
  adds none to the trajectory that closes a line of a storage that is not full, even when its
  last (unwritten) row holds a True done flag, so its shapes then miss a row of the file.
- ``ndim=2`` storages whose ring wrapped: TorchRL 0.14 does not reload its own dumps of those
  correctly (its Flat2TED); ours reloads both its dumps and ours.
- Loading an H5 file reads it whole into memory (TorchRL stages it in temporary memory maps).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase, is_tensor_collection

from functional_rb.adapters.checkpointers import FlatStorageCheckpointer
from functional_rb.adapters.ted_hooks import STORAGE_SHAPE_KEY, Flat2TED, TED2Flat

__all__ = ["TED2Nested", "Nested2TED", "H5Split", "H5Combine", "NestedStorageCheckpointer",
           "H5StorageCheckpointer"]

TRAJ_PREFIX = "traj_"
LEN_KEY = "_len"


def _key(key) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def _tensor_items(td) -> list:
    """``[(tuple key, tensor)]`` of ``td``'s tensor leaves (non-tensor entries left out)."""
    return [(_key(k), v) for k, v in td.items(True, True) if isinstance(v, torch.Tensor)]


def _plain(value):
    """A non-tensor entry's Python value (NonTensorData, NumPy scalar or array, tensor)."""
    value = getattr(value, "data", value)
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    return value


# --------------------------------------------------------------------------- trajectories
def _trajectory_rows(flat: TensorDictBase, done_key, shape, shift: int, is_full: bool):
    """``(lengths, extra)``: int64 ``[n_traj]`` steps per trajectory in flat row order, and
    1 where the trajectory also holds its last step's successor observation (one of
    TED2Flat's ends), else 0."""
    if done_key not in flat.keys(True, True):
        raise KeyError(f"TED2Nested: the flat data has no {done_key!r} entry to cut "
                       "trajectories at; pass done_key=('next', <your done key>).")
    steps, lines = int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))
    done = flat.get(done_key).detach().cpu().reshape(lines * steps, -1).any(-1).numpy()
    done = done.reshape(lines, steps)
    last_written = np.zeros_like(done)
    last_written[:, (steps - 1) if is_full else (shift - 1)] = True
    flat_end = done | last_written      # TED2Flat's ends: one successor row each
    cut = flat_end.copy()
    cut[:, -1] = True                   # a trajectory never runs past its line
    stops = np.flatnonzero(cut.reshape(-1))
    lengths = np.diff(np.concatenate([[-1], stops]))
    extra = flat_end.reshape(-1)[stops].astype(np.int64)
    return lengths.astype(np.int64), extra


def _shapes(per_traj: np.ndarray, value: torch.Tensor) -> torch.Tensor:
    """int64 ``[n_traj, value.ndim]``: each trajectory's shape (its rows, then the features)."""
    feature = np.broadcast_to(np.asarray(value.shape[1:], np.int64),
                              (per_traj.shape[0], value.dim() - 1))
    return torch.from_numpy(np.concatenate([per_traj[:, None], feature], 1))


class TED2Nested(TED2Flat):
    """Save hook: TED storage ``[T, *B]`` -> TensorDict of batch ``[n_traj]`` whose entries are
    nested tensors (one row per trajectory; layout in the module docstring).

    With ``path`` the result is memory-mapped there (the checkpointer's directory) in
    tensordict's format; without it, the nested tensors are views of the flat data in memory.
    ``shift`` and ``is_full`` are set on the hook by the checkpointer, as for ``TED2Flat``.
    """

    def __init__(self, *args, **kwargs):
        if not hasattr(torch, "_nested_compute_contiguous_strides_offsets"):
            raise ValueError(f"Unsupported torch version {torch.__version__}: "
                             f"torch>=2.4 is required for {type(self).__name__}.")
        super().__init__(*args, **kwargs)

    def _flat_done_key(self) -> tuple:
        key = _key(self.done_key)
        return key[1:] if key[0] == "next" and len(key) > 1 else key

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        flat = super().__call__(data)
        shape = list(data.batch_size)
        shift, is_full = int(self.shift), bool(self.is_full)
        lengths, extra = _trajectory_rows(flat, self._flat_done_key(), shape, shift, is_full)
        n_rows, n_traj = int(lengths.sum()), int(lengths.shape[0])
        items = _tensor_items(flat)
        shapes = {}
        for key, value in items:
            per = lengths if value.shape[0] == n_rows else lengths + extra
            if int(per.sum()) != value.shape[0]:
                raise RuntimeError(f"TED2Nested: flat entry {key} has {value.shape[0]} rows; "
                                   f"its {n_traj} trajectories span {int(per.sum())}.")
            shapes[key] = _shapes(per, value)
        meta = {k: _plain(flat.get(k))
                for k in (self.shift_key, self.is_full_key, STORAGE_SHAPE_KEY)}
        out = TensorDict(batch_size=[n_traj])
        for k, v in meta.items():
            out.set_non_tensor(k, v)
        if path is None:
            for key, value in items:
                out.set(key, MemoryMappedTensor.from_storage(
                    value.untyped_storage(), shape=shapes[key], dtype=value.dtype))
            return out
        # tensordict writes a nested entry as the raw buffer of its rows plus a shape file:
        # the flat files written here are that buffer, so they are written once.
        mapped = flat.memmap(Path(path), copy_existing=True)
        out.memmap_(Path(path))
        for key, _ in items:
            buffer = mapped.get(key)
            out.make_memmap_from_storage(key, buffer.untyped_storage(), dtype=buffer.dtype,
                                         shape=shapes[key])
        return out


def _flat_buffer(value: torch.Tensor) -> torch.Tensor:
    """A nested ``[n_traj, L_i, *F]`` tensor as the ``[sum L_i, *F]`` tensor of its rows."""
    if not value.is_nested:
        return value.reshape(-1, *value.shape[2:])
    if value.layout == torch.jagged:
        return value.values()
    feature = [value.size(i) for i in range(2, value.dim())]
    # the whole buffer: a TorchRL file may hold rows past its last trajectory's shape
    rows = torch.empty(0, dtype=value.dtype, device=value.device).set_(value.untyped_storage())
    return rows.view(-1, *feature)


class Nested2TED(Flat2TED):
    """Load hook: nested TensorDict (one row per trajectory) -> TED storage ``[T, *B]``; with
    ``out`` (the storage's data) the values are written into it in place."""

    def __call__(self, data: TensorDictBase, out: Optional[TensorDictBase] = None
                 ) -> TensorDictBase:
        flat = TensorDict(batch_size=[])
        for key, value in _tensor_items(data):
            flat.set(key, _flat_buffer(value))
        for key, value in data.non_tensor_items():
            flat.set_non_tensor(key, _plain(value))
        if STORAGE_SHAPE_KEY in flat.keys() and out is not None:
            saved = [int(s) for s in _plain(flat.get(STORAGE_SHAPE_KEY))]
            if saved != list(out.batch_size):
                raise RuntimeError(f"Nested2TED: the dump holds a storage of shape {saved}; "
                                   f"the storage to fill has shape {list(out.batch_size)}. "
                                   "Load into a buffer built like the one that was dumped "
                                   "(same capacity and ndim).")
        return super().__call__(flat, out=out)


# --------------------------------------------------------------------------- H5 hooks
class H5Split(TED2Flat):
    """Save hook: nested TensorDict -> TensorDict ``{"traj_<i>": trajectory i}`` plus the
    non-tensor metadata, the layout :class:`H5StorageCheckpointer` writes to HDF5.

    (A ``TED2Flat`` subclass as in TorchRL, so checkpointers set ``shift`` / ``is_full`` on it;
    it does not read them.)"""

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        del path
        n_traj = int(data.batch_size[0]) if data.batch_dims else 0
        if n_traj < 1:
            raise ValueError("H5Split: the data holds no trajectory; it takes TED2Nested's "
                             "output (a TensorDict of batch [n_traj]).")
        digits = math.ceil(math.log10(n_traj))
        rows = {key: value.unbind(0) for key, value in _tensor_items(data)}
        result = TensorDict()
        for i in range(n_traj):
            traj = TensorDict()
            for key, parts in rows.items():
                traj.set(key, parts[i])
            result.set(f"{TRAJ_PREFIX}{str(i).zfill(digits)}", traj)
        for key, value in data.non_tensor_items():
            result.set_non_tensor(key, _plain(value))
        return result


def _traj_number(name: str) -> int:
    try:
        return int(name[len(TRAJ_PREFIX):])
    except ValueError:
        raise KeyError(f"H5Combine: entry {name!r} is not named traj_<number>.") from None


class H5Combine:
    """Load hook: the H5 layout (a ``PersistentTensorDict`` or any TensorDict with
    ``traj_<i>`` sub-TensorDicts) -> nested TensorDict of batch ``[n_traj]`` (in memory) with
    the other entries as non-tensor metadata. ``out`` is accepted and ignored (as TorchRL's)."""

    def __call__(self, data, out=None) -> TensorDictBase:
        del out
        names = sorted((k for k in data.keys() if k.startswith(TRAJ_PREFIX)), key=_traj_number)
        if not names:
            raise KeyError("H5Combine: the data has no traj_<i> entry, so it was not written "
                           "by H5Split / H5StorageCheckpointer.")
        trajs = [data.get(name) for name in names]
        keys = [k for k, _ in _tensor_items(trajs[0])]
        result = TensorDict(batch_size=[len(trajs)])
        for key in keys:
            parts = [torch.as_tensor(t.get(key)) for t in trajs]
            buffer = torch.cat(parts).contiguous()
            shapes = torch.tensor([list(p.shape) for p in parts], dtype=torch.int64)
            result.set(key, MemoryMappedTensor.from_storage(
                buffer.untyped_storage(), shape=shapes, dtype=buffer.dtype))
        for name in data.keys():
            if not name.startswith(TRAJ_PREFIX):
                result.set_non_tensor(name, _plain(data.get(name)))
        return result


# --------------------------------------------------------------------------- checkpointers
def _ted_data(checkpointer, storage, action: str):
    """The storage's TensorDict, or an error naming the checkpointer and the fix."""
    who = type(checkpointer).__name__
    if not getattr(storage, "initialized", False):
        raise RuntimeError(f"{who}.{action}: cannot save a non-initialized storage "
                           f"({type(storage).__name__} holds no data yet); extend the buffer "
                           "with TED data first.")
    data = getattr(storage, "data", None)
    if not is_tensor_collection(data):
        raise ValueError(f"{who}.{action}: only TensorDict storages of TED data are supported; "
                         f"this {type(storage).__name__} holds {type(data).__name__}. Use "
                         "TensorStorageCheckpointer (the default) for tensor and PyTree "
                         "storages.")
    return data


def _loadable(checkpointer, storage):
    """The storage's TensorDict to load into in place, or None (an empty storage)."""
    if not getattr(storage, "initialized", False):
        return None
    return _ted_data(checkpointer, storage, "loads")


class NestedStorageCheckpointer(FlatStorageCheckpointer):
    """TorchRL's ``NestedStorageCheckpointer``: TED data saved as a memory-mapped TensorDict
    of nested tensors, one row per trajectory, with the :class:`TED2Nested` /
    :class:`Nested2TED` hooks (layout and differences from TorchRL in the module docstring).

    Assumes, without checking (as TorchRL): root done entries are all False, and
    ``("next", obs)`` of a step equals ``obs`` of the next step within a trajectory.
    Arguments: ``done_keys``, ``reward_keys`` (see ``TED2Flat``).
    """

    def __init__(self, done_keys=None, reward_keys=None):
        super().__init__(done_keys=done_keys, reward_keys=reward_keys)
        kwargs = {}
        if done_keys is not None:
            kwargs["done_keys"] = done_keys
        if reward_keys is not None:
            kwargs["reward_keys"] = reward_keys
        self._save_hooks = [TED2Nested(**kwargs)]
        self._load_hooks = [Nested2TED(**kwargs)]

    def dumps(self, storage, path) -> None:
        _ted_data(self, storage, "dumps")
        super().dumps(storage, path)

    def loads(self, storage, path) -> None:
        _loadable(self, storage)
        super().loads(storage, path)


def _shift(last_cursor) -> int:
    """``hook.shift`` from the index written last, TorchRL's rule (a slice gives stop + 1)."""
    if isinstance(last_cursor, slice):
        return last_cursor.stop + 1
    if isinstance(last_cursor, range):
        return last_cursor[-1] + 1
    if isinstance(last_cursor, (torch.Tensor, np.ndarray)):
        return int(last_cursor.reshape(-1)[-1]) + 1
    return int(last_cursor) + 1


def _non_tensor_h5(value):
    """tensordict's HDF5 encoding of a non-tensor entry (what ``PersistentTensorDict`` reads
    back as ``NonTensorData``): strings as they are, anything else as an opaque-typed array."""
    import h5py
    if isinstance(value, str):
        return value
    array = np.array(value)
    return array.astype(h5py.opaque_dtype(array.dtype))


def _write_h5(file: Path, split: TensorDictBase, length: int, kwargs: dict) -> None:
    import h5py
    with h5py.File(file, "w") as h5:
        for key, value in _tensor_items(split):
            array = value.detach().cpu().numpy()
            # h5py refuses chunking/filter options on scalar datasets
            h5.create_dataset("/".join(key), data=array, **(kwargs if array.ndim else {}))
        for key, value in split.non_tensor_items():
            h5.create_dataset(key, data=_non_tensor_h5(_plain(value)))
        h5.create_dataset(LEN_KEY, data=_non_tensor_h5(int(length)))


class H5StorageCheckpointer(NestedStorageCheckpointer):
    """TorchRL's ``H5StorageCheckpointer``: TED data saved to one HDF5 file, one group per
    trajectory (hooks :class:`TED2Nested`, :class:`H5Split`; loading :class:`H5Combine`,
    :class:`Nested2TED`; layout and differences from TorchRL in the module docstring).

    Keyword Args:
        checkpoint_file: the file name under the directory given to ``dumps`` / ``loads``;
            ignored when that path ends with ``.h5`` (it is then the file). Default
            ``"checkpoint.h5"``.
        done_keys, reward_keys: as for ``TED2Flat``.
        h5_kwargs: keyword arguments for :meth:`h5py.Group.create_dataset` of every
            trajectory dataset (e.g. ``{"compression": "gzip"}``); a dict or pairs.
        **kwargs: more ``TED2Nested`` / ``Nested2TED`` arguments.

    Needs ``h5py``. Assumes, without checking, what :class:`NestedStorageCheckpointer` does.
    """

    def __init__(self, *, checkpoint_file: str = "checkpoint.h5", done_keys=None,
                 reward_keys=None, h5_kwargs=None, **kwargs):
        super().__init__()
        if done_keys is not None:
            kwargs["done_keys"] = done_keys
        if reward_keys is not None:
            kwargs["reward_keys"] = reward_keys
        self._save_hooks = [TED2Nested(**kwargs), H5Split()]
        self._load_hooks = [H5Combine(), Nested2TED(**kwargs)]
        self.kwargs = {} if h5_kwargs is None else dict(h5_kwargs)
        self.checkpoint_file = checkpoint_file

    def _get_path(self, path, create: bool) -> Path:
        path = Path(path)
        if path.suffix == ".h5":
            if create:
                path.parent.mkdir(parents=True, exist_ok=True)
            return path.absolute()
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RuntimeError(f"H5StorageCheckpointer.dumps: failed to create the "
                                   f"checkpoint directory {path}: {e}.") from None
        return (path / self.checkpoint_file).absolute()

    def dumps(self, storage, path) -> None:
        data = _ted_data(self, storage, "dumps")
        file = self._get_path(path, create=True)
        if storage.last_cursor is None:
            warnings.warn("H5StorageCheckpointer.dumps: last_cursor is None; save hooks get "
                          "shift=0 (as in TorchRL).")
        shift = 0 if storage.last_cursor is None else _shift(storage.last_cursor)
        for hook in self._save_hooks:
            if hasattr(hook, "shift"):
                hook.shift = shift
            if hasattr(hook, "is_full"):
                hook.is_full = bool(storage.is_full)
        for hook in self._save_hooks:
            data = hook(data)
        if not is_tensor_collection(data):
            raise ValueError("H5StorageCheckpointer.dumps: the save hooks returned a "
                             f"{type(data).__name__}; only tensor collections are supported.")
        _write_h5(file, data, len(storage), self.kwargs)

    def loads(self, storage, path) -> None:
        from tensordict import PersistentTensorDict
        dest = _loadable(self, storage)
        file = self._get_path(path, create=False)
        if not file.is_file():
            raise FileNotFoundError(f"H5StorageCheckpointer.loads: {file} does not exist; pass "
                                    "the directory given to dumps (the file is "
                                    f"{self.checkpoint_file!r} in it) or the .h5 file.")
        h5 = PersistentTensorDict.from_h5(str(file), mode="r")
        try:
            if LEN_KEY not in h5.keys():
                raise KeyError(f"H5StorageCheckpointer.loads: {file} has no {LEN_KEY!r} "
                               "entry, so it was not written by H5StorageCheckpointer.")
            length = int(_plain(h5.get(LEN_KEY)))
            data = h5
            for hook in self._load_hooks:
                data = hook(data, out=dest)
        finally:
            h5.close()
        if dest is None:
            storage.restore(storage.adopt_loaded(data, file), length)
            return
        if data is not dest:
            dest.update_(data)
        storage.restore(dest, length)
