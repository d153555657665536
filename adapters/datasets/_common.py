"""Shared machinery of the dataset loaders: the read-only storage and the base class.

The cache on disk (where it lives, how a converted dataset is written into it) is in
:mod:`._cache`.

Storage: :class:`DatasetStorage` is a :class:`~functional_rb.adapters.TensorStorage` over the
memory-mapped TensorDict itself (read-only, full from the start): samples are gathered from the
files with torch indexing, and slice samplers read the episode ends from them. Leaves can also
be *virtual* (computed from other leaves at read time: Atari's ``("next", "observation")`` is
``observation[i + 1]``, so the frames are stored once).

The arguments the loaders share, documented once here (the API reference gives each loader's
page these descriptions for the arguments its signature takes; ``docs/adapters_plumbing.py``):

Args:
  dataset_id: the dataset's name (the loader's ``available_datasets`` lists those it knows).
  root: where the converted data is cached (default ``$FRB_DATASETS_CACHE/<loader>`` or
    ``~/.cache/functional_rb/datasets/<loader>``).
  download: ``True``: fetch and convert when missing; ``False``: use the cache only;
    ``"force"``: fetch and convert again.
  writer: an ``ImmutableDatasetWriter`` or None: a dataset is read-only.
  split_trajs: store whole trajectories, zero-padded to the longest, with a ``"mask"`` entry.
  base_url: the server to download from instead of the default (e.g. a mirror).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_tensor_collection

from functional_rb.adapters.datasets._cache import atomic_dir, build_split, read_marker
from functional_rb.adapters.datasets._progress import progress_bar
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer
from functional_rb.adapters.storages.tensor import TensorStorage
from functional_rb.adapters.writers.immutable import ImmutableDatasetWriter


# ---------------------------------------------------------------------------- storage
class DatasetStorage(TensorStorage):
    """The converted dataset: a full, read-only :class:`TensorStorage` over its memory-mapped
    TensorDict.

    ``virtual``: ``{key: factory}``; ``factory(leaves)`` (``leaves``: ``{key tuple: numpy
    array}``) returns an array-like (``__getitem__`` with an index array, ``shape``,
    ``dtype``) computed from the stored leaves, read at ``get`` time.
    """

    def __init__(self, path, td: TensorDictBase, virtual: dict | None = None):
        super().__init__(td)
        self.scratch_dir = str(path)
        self._virtual = {}
        if virtual:
            leaves = {
                k: self.leaf(k)
                for k in (
                    (key,) if isinstance(key, str) else tuple(key)
                    for key in td.keys(include_nested=True, leaves_only=True)
                )
            }
            self._virtual = {key: factory(leaves) for key, factory in virtual.items()}

    def leaf(self, key) -> np.ndarray:
        """A stored leaf as a read-only numpy view of its file."""
        arr = self._storage.get(key if isinstance(key, str) or len(key) > 1 else key[0])
        arr = arr.numpy().view()
        arr.flags.writeable = False  # the cache is shared by every construction
        return arr

    def get(self, index):
        data = super().get(index)
        if self._virtual and is_tensor_collection(data):
            flat = np.arange(len(self))[D_index(index)]
            for key, values in self._virtual.items():
                v = torch.from_numpy(np.asarray(values[flat.reshape(-1)]))
                data.set(
                    key if len(key) > 1 else key[0],
                    v.reshape(tuple(flat.shape) + tuple(v.shape[1:])),
                )
        return data

    def set(self, cursor, data, *, set_cursor: bool = True):
        raise RuntimeError("DatasetStorage: datasets are read-only (ImmutableDatasetWriter).")

    def loads(self, path) -> None:
        raise NotImplementedError(
            "DatasetStorage.loads: datasets are read-only memory maps; "
            "load the dump into a LazyMemmapStorage buffer instead."
        )

    load = loads


def D_index(index):  # noqa: N802 - numpy's view of a torch index
    if isinstance(index, torch.Tensor):
        return index.cpu().numpy()
    if isinstance(index, tuple):
        return tuple(D_index(i) for i in index)
    return index


class ShiftedNext:
    """``next[i] = stored[i + 1]``, zero where ``done[i]`` (episode ends: the next observation
    of a terminal step is not in the data). Read-only, array-like."""

    def __init__(self, source, done_key, maps):
        self._src = maps[source]
        self._done = maps[done_key].reshape(len(maps[done_key]), -1).any(-1)
        self.shape = self._src.shape
        self.dtype = self._src.dtype
        self.ndim = self._src.ndim

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        idx = np.arange(self.shape[0])[index] if isinstance(index, slice) else np.asarray(index)
        nxt = np.minimum(idx + 1, self.shape[0] - 1)
        out = np.array(self._src[nxt.reshape(-1)], copy=True)
        out[self._done[idx.reshape(-1)]] = 0
        return out.reshape(idx.shape + self.shape[1:])

    def __array__(self, dtype=None, copy=None):
        out = self[np.arange(self.shape[0])]
        return out if dtype is None else out.astype(dtype)


class shifted_next:
    """A picklable virtual-leaf factory for :class:`ShiftedNext`."""

    def __init__(self, source, done_key=("next", "done")):
        self.source, self.done_key = tuple(source), tuple(done_key)

    def __call__(self, maps):
        return ShiftedNext(self.source, self.done_key, maps)


# ---------------------------------------------------------------------------- transforms
class _ImageTransform:
    """A callable applying ``_apply`` to each of ``in_keys`` present in a TensorDict."""

    def __init__(self, in_keys):
        self.in_keys = [tuple(k) if not isinstance(k, str) else (k,) for k in in_keys]

    def __call__(self, td):
        for key in self.in_keys:
            k = key if len(key) > 1 else key[0]
            x = td.get(k, None)
            if x is not None:
                td.set(k, self._apply(x))
        return td


class ToTensorImage(_ImageTransform):
    """TorchRL's ``ToTensorImage(in_keys, shape_tolerant=True)`` as a plain callable: uint8
    ``[..., H, W, C]`` (C in 1, 3) -> float32 ``[..., C, H, W]`` in ``[0, 1]``; channel-first
    or float images are only scaled/kept (shape tolerant)."""

    def _apply(self, x):
        if x.shape[-1] in (1, 3):
            x = x.movedim(-1, -3)
        if not x.is_floating_point():
            x = x.to(torch.float32).div_(255)
        return x

    def __repr__(self):
        return f"ToTensorImage(in_keys={self.in_keys})"


class Resize(_ImageTransform):
    """TorchRL's ``Resize(w, h, in_keys)`` (bilinear) for ``[..., C, H, W]`` float images."""

    def __init__(self, size, in_keys):
        super().__init__(in_keys)
        if isinstance(size, int):
            size = (size, size)
        self.size = tuple(int(s) for s in size)

    def _apply(self, x):
        lead = x.shape[:-3]
        y = torch.nn.functional.interpolate(
            x.reshape((-1,) + tuple(x.shape[-3:])).float(),
            size=self.size,
            mode="bilinear",
            align_corners=False,
        )
        return y.reshape(tuple(lead) + tuple(y.shape[1:]))

    def __repr__(self):
        return f"Resize(size={self.size}, in_keys={self.in_keys})"


# ---------------------------------------------------------------------------- base class
class BaseDatasetExperienceReplay(TensorDictReplayBuffer):
    """Parent of the offline datasets (TorchRL's ``BaseDatasetExperienceReplay``): a read-only
    :class:`~functional_rb.adapters.TensorDictReplayBuffer` over a memory-mapped dataset.

    Every TorchRL buffer method works (``sample``, ``__getitem__``, ``__len__``, iteration,
    ``append_transform``/``insert_transform``, ``state_dict``, ``dumps``, save/load hooks);
    ``extend``/``add`` raise (the writer is :class:`ImmutableDatasetWriter`). Slice samplers
    (``SliceSampler(end_key=("next", "done"))``...) read episode ends from the data and mark
    ``("next", "truncated")``/``("next", "done")`` at the end of every slice, as TorchRL's do.

    Extra methods: :meth:`delete` (remove the converted files), :meth:`preprocess` (TorchRL's:
    map a function over the dataset into a new memory-mapped storage).

    Args:
      priority_key: as in :class:`~functional_rb.adapters.TensorDictReplayBuffer`.
      **kwargs: the arguments of :class:`~functional_rb.adapters.ReplayBuffer`; each loader
        builds its buffer with its own arguments (see the loaders).
    """

    #: set by loaders whose items are whole trajectories (split_trajs=True): the padded length
    _traj_len: int | None = None
    #: non-tensor (text) fields: {key: (per, values)}; per is "episode" (values indexed by the
    #: "episode" leaf) or "step" (values indexed by the storage index)
    _text: dict = {}

    @property
    def root(self) -> Path:
        return self._root

    @root.setter
    def root(self, value):
        self._root = None if value is None else Path(value)

    @property
    def data_path(self) -> Path:
        """Path of the converted dataset in use (the ``_split`` copy with split_trajs=True)."""
        return self._data_path

    @property
    def data_path_root(self) -> Path:
        """Path of the converted dataset (``<root>/<dataset_id>``)."""
        return Path(self._root) / self.dataset_id

    def _is_downloaded(self) -> bool:
        return (self.data_path_root / "meta.json").exists()

    # ---------------------------------------------------------------- construction
    def _open(
        self,
        data_path,
        *,
        batch_size=None,
        sampler=None,
        writer=None,
        collate_fn=None,
        pin_memory=False,
        prefetch=None,
        transform=None,
        virtual=None,
    ):
        if writer is not None and not isinstance(writer, ImmutableDatasetWriter):
            raise ValueError(
                f"{type(self).__name__}: datasets are read-only memory maps; writer must be "
                f"ImmutableDatasetWriter (or None), got {type(writer).__name__}. To modify the "
                "data, copy it into a buffer with LazyMemmapStorage and extend that."
            )
        data_path = Path(data_path)
        if not (data_path / "meta.json").exists():
            raise RuntimeError(
                f"{type(self).__name__}: the dataset could not be found in "
                f"{data_path}; construct it with download=True."
            )
        self._data_path = data_path
        marker = read_marker(data_path)
        if marker.get("max_len") is not None:  # a split_trajs copy: items are trajectories
            self._traj_len = int(marker["max_len"])
            marker = read_marker(self.data_path_root)
        self.metadata = marker.get("metadata", {})
        td = TensorDict.load_memmap(str(data_path))
        storage = DatasetStorage(data_path, td, virtual)
        super().__init__(
            storage=storage,
            sampler=sampler,
            writer=ImmutableDatasetWriter(),
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            prefetch=prefetch,
            transform=transform,
            batch_size=batch_size,
        )

    def _prepare(
        self,
        download,
        build: Callable[[Path], None],
        *,
        split_trajs=False,
        options: dict | None = None,
    ):
        """TorchRL's ``download`` semantics: ``"force"`` rebuilds, ``True`` builds when
        missing, ``False`` only loads. ``build(tmp_dir)`` writes the converted dataset (and its
        marker). ``options``: conversion options recorded in the marker; a cached dataset
        converted with other options raises instead of silently giving other data."""
        if download not in (True, False, "force"):
            raise ValueError(
                f"{type(self).__name__}: download must be True, False or 'force', got {download!r}."
            )
        root_path = self.data_path_root
        if download == "force" or (download and not self._is_downloaded()):
            with atomic_dir(root_path) as tmp:
                build(tmp)
            split_path = root_path.with_name(root_path.name + "_split")
            if download == "force" and split_path.exists():
                shutil.rmtree(split_path)
        elif not self._is_downloaded():
            raise RuntimeError(
                f"{type(self).__name__}: the dataset could not be found in "
                f"{root_path} and download=False."
            )
        if options:
            cached = read_marker(root_path).get("options", {})
            diff = {k: (cached.get(k), v) for k, v in options.items() if cached.get(k) != v}
            if diff:
                raise ValueError(
                    f"{type(self).__name__}: the dataset cached in {root_path} was converted "
                    f"with other options ({ {k: c for k, (c, _) in diff.items()} }, asked "
                    f"{ {k: v for k, (_, v) in diff.items()} }); pass download='force' to "
                    "convert it again, or another root."
                )
        if split_trajs:
            split_path = root_path.with_name(root_path.name + "_split")
            if not (split_path / "meta.json").exists():
                build_split(root_path, split_path, where=type(self).__name__)
            return split_path
        return root_path

    # ---------------------------------------------------------------- reading
    def _finish(self, data, flat_idx):
        """Per-item extras of the stored data: text fields (``NonTensorStack``) and, for
        split trajectories, the time dimension in the batch size."""
        if not is_tensor_collection(data):
            return data
        data = data.copy()  # a shallow copy: `data` may be a view of the dataset's TensorDict
        if self._text:
            idx = np.asarray(flat_idx).reshape(-1)
            for key, (per, values) in self._text.items():
                if per == "episode":
                    ep = np.asarray(self._storage.leaf(("episode",))[idx]).reshape(-1)
                    strs = [values[int(e)] for e in ep]
                else:
                    strs = [values[int(i)] for i in idx]
                if data.batch_dims == 0:
                    data.set_non_tensor(key, strs[0])
                else:
                    data.set(key, NonTensorStack.from_list(strs).reshape(data.batch_size))
        if self._traj_len is not None:
            data.batch_size = torch.Size(tuple(data.batch_size) + (self._traj_len,))
        return data

    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        include_info: bool | None = None,
    ):
        data, info = ReplayBuffer.sample(self, batch_size, return_info=True)
        index = info["index"]
        index = index[0] if isinstance(index, tuple) else index
        data = self._attach_info(self._finish(data, index.numpy()), info, include_info)
        return (data, info) if return_info else data

    def __getitem__(self, index):
        data = super().__getitem__(index)
        if (
            is_tensor_collection(data)
            and (self._text or self._traj_len is not None)
            and not isinstance(index, str)
        ):
            data = self._finish(data, np.arange(len(self))[D_index(index)])
        return data

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """As the buffers' ``state_dict``, without a copy of the (read-only) data: the dataset
        files are referenced by ``"_dataset_path"``."""
        sd = {k: v for k, v in super().state_dict().items() if k != "_storage"}
        sd["_dataset_path"] = str(self.data_path)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if Path(state_dict["_dataset_path"]) != Path(self.data_path):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state is of the "
                f"dataset at {state_dict['_dataset_path']}, this one is at "
                f"{self.data_path}."
            )
        self._sampler.load_state_dict(state_dict["_sampler"])
        self._transform.load_state_dict(state_dict["_transforms"])
        self._batch_size = state_dict["_batch_size"]

    def loads(self, path) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.loads: datasets are read-only memory maps and cannot be "
            "overwritten with a dump. Load the dump into a TensorDictReplayBuffer with a "
            "LazyMemmapStorage instead."
        )

    load = loads

    def delete(self):
        """Delete the converted dataset from disk (the buffer is unusable afterwards)."""
        shutil.rmtree(self.data_path)

    def preprocess(
        self,
        fn: Callable,
        dim: int = 0,
        num_workers: int | None = None,
        *,
        chunksize: int | None = None,
        num_chunks: int | None = None,
        pool=None,
        generator=None,
        max_tasks_per_child=None,
        worker_threads: int = 1,
        index_with_generator: bool = False,
        pbar: bool = False,
        mp_start_method: str | None = None,
        num_frames: int | None = None,
        dest,
    ) -> TensorStorage:
        """Apply ``fn`` (a TensorDict -> TensorDict function working on batches of items) to
        the dataset (its first ``num_frames`` items) chunk by chunk and write the results as a
        memory-mapped TensorDict at ``dest``; returns a ``TensorStorage`` over it (TorchRL's
        method; runs in this process: ``num_workers``/``pool`` are accepted and ignored)."""
        if dim != 0:
            raise ValueError(f"{type(self).__name__}.preprocess: only dim=0 is supported.")
        n = len(self) if num_frames is None else int(num_frames)
        if num_chunks:
            chunk = max(1, -(-n // int(num_chunks)))
        else:
            chunk = int(chunksize or 4096)
        out = None
        bar = progress_bar(
            n, f"{type(self).__name__}.preprocess", unit="item", progress=pbar or None
        )
        try:
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                idx = np.arange(start, stop)
                res = fn(self._finish(self._storage.get(torch.from_numpy(idx)), idx))
                if out is None:
                    out = res[0].expand(n).memmap_like(str(dest))
                out[start:stop] = res
                bar.update(stop - start)
        finally:
            bar.close()
        return TensorStorage(out)
