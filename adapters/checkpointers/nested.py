"""TorchRL's ``NestedStorageCheckpointer`` and ``H5StorageCheckpointer``: TED data saved one
row (or H5 group) per trajectory, with the nested and H5 hooks of
:mod:`functional_rb.adapters.ted_hooks` (layout and differences from TorchRL there)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDictBase, is_tensor_collection
from tensordict.utils import NestedKey

from functional_rb.adapters.checkpointers.tensor import FlatStorageCheckpointer
from functional_rb.adapters.ted_hooks import (
    LEN_KEY,
    H5Combine,
    H5Split,
    Nested2TED,
    TED2Nested,
    _plain_value,
    _tensor_items,
)

__all__ = ["NestedStorageCheckpointer", "H5StorageCheckpointer"]


def _ted_data(checkpointer, storage, action: str):
    """The storage's TensorDict, or an error naming the checkpointer and the fix."""
    who = type(checkpointer).__name__
    if not getattr(storage, "initialized", False):
        raise RuntimeError(
            f"{who}.{action}: cannot save a non-initialized storage "
            f"({type(storage).__name__} holds no data yet); extend the buffer "
            "with TED data first."
        )
    data = getattr(storage, "data", None)
    if not is_tensor_collection(data):
        raise ValueError(
            f"{who}.{action}: only TensorDict storages of TED data are supported; "
            f"this {type(storage).__name__} holds {type(data).__name__}. Use "
            "TensorStorageCheckpointer (the default) for tensor and PyTree "
            "storages."
        )
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

    Args:
      done_keys: the ``"next"`` entries that are done flags (default
        :data:`~functional_rb.adapters.DEFAULT_DONE_KEYS`), as for ``TED2Flat``.
      reward_keys: the ``"next"`` entries that are rewards (default ``("reward",)``).
    """

    def __init__(
        self,
        done_keys: Sequence[NestedKey] | None = None,
        reward_keys: Sequence[NestedKey] | None = None,
    ):
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
            h5.create_dataset(key, data=_non_tensor_h5(_plain_value(value)))
        h5.create_dataset(LEN_KEY, data=_non_tensor_h5(int(length)))


class H5StorageCheckpointer(NestedStorageCheckpointer):
    """TorchRL's ``H5StorageCheckpointer``: TED data saved to one HDF5 file, one group per
    trajectory (hooks :class:`TED2Nested`, :class:`H5Split`; loading :class:`H5Combine`,
    :class:`Nested2TED`; layout and differences from TorchRL in the module docstring).

    Args:
        checkpoint_file: the file name under the directory given to ``dumps`` / ``loads``;
            ignored when that path ends with ``.h5`` (it is then the file). Default
            ``"checkpoint.h5"``.
        done_keys: the done entries, as for ``TED2Flat``.
        reward_keys: the reward entries, as for ``TED2Flat``.
        h5_kwargs: keyword arguments for :meth:`h5py.Group.create_dataset` of every
            trajectory dataset (e.g. ``{"compression": "gzip"}``); a dict or pairs.
        **kwargs: more ``TED2Nested`` / ``Nested2TED`` arguments.

    Needs ``h5py``. Assumes, without checking, what :class:`NestedStorageCheckpointer` does.
    """

    def __init__(
        self,
        *,
        checkpoint_file: str = "checkpoint.h5",
        done_keys: Sequence[NestedKey] | None = None,
        reward_keys: Sequence[NestedKey] | None = None,
        h5_kwargs: dict | Sequence[tuple] | None = None,
        **kwargs,
    ):
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
                raise RuntimeError(
                    f"H5StorageCheckpointer.dumps: failed to create the "
                    f"checkpoint directory {path}: {e}."
                ) from None
        return (path / self.checkpoint_file).absolute()

    def dumps(self, storage, path) -> None:
        data = _ted_data(self, storage, "dumps")
        file = self._get_path(path, create=True)
        if storage.last_cursor is None:
            warnings.warn(
                "H5StorageCheckpointer.dumps: last_cursor is None; save hooks get "
                "shift=0 (as in TorchRL).",
                stacklevel=2,
            )
        shift = 0 if storage.last_cursor is None else _shift(storage.last_cursor)
        for hook in self._save_hooks:
            if hasattr(hook, "shift"):
                hook.shift = shift
            if hasattr(hook, "is_full"):
                hook.is_full = bool(storage.is_full)
        for hook in self._save_hooks:
            data = hook(data)
        if not is_tensor_collection(data):
            raise ValueError(
                "H5StorageCheckpointer.dumps: the save hooks returned a "
                f"{type(data).__name__}; only tensor collections are supported."
            )
        _write_h5(file, data, len(storage), self.kwargs)

    def loads(self, storage, path) -> None:
        from tensordict import PersistentTensorDict

        dest = _loadable(self, storage)
        file = self._get_path(path, create=False)
        if not file.is_file():
            raise FileNotFoundError(
                f"H5StorageCheckpointer.loads: {file} does not exist; pass "
                "the directory given to dumps (the file is "
                f"{self.checkpoint_file!r} in it) or the .h5 file."
            )
        h5 = PersistentTensorDict.from_h5(str(file), mode="r")
        try:
            if LEN_KEY not in h5.keys():
                raise KeyError(
                    f"H5StorageCheckpointer.loads: {file} has no {LEN_KEY!r} "
                    "entry, so it was not written by H5StorageCheckpointer."
                )
            length = int(_plain_value(h5.get(LEN_KEY)))
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
