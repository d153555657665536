"""Samplers, writers and storages under TorchRL's names, mapped to the core configs.

Each adapter sampler/writer is a small mutable holder of TorchRL's constructor arguments whose
:meth:`core` returns the frozen core config it stands for (looked up by name in
``functional_rb``: a core sampler that is not available raises ``NotImplementedError`` when the
adapter is constructed). Storages decide where the *data* lives:

- :class:`TensorStorage` / :class:`LazyTensorStorage`: in the core state (``frb.DeviceStorage``,
  JAX arrays); sampling gathers inside the jitted core ``sample``.
- :class:`LazyMemmapStorage`: numpy memory-mapped files in ``scratch_dir`` (host); the core
  keeps only the leaves its writer/sampler read (done/truncated/trajectory/rank keys) and the
  adapter gathers the data from the memmaps with the sampled indices.
- :class:`ListStorage`: a Python list of arbitrary objects; the core keeps the bookkeeping only.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import numpy as np
import torch

import functional_rb as frb


def _core_class(name: str, adapter: str):
    cls = getattr(frb, name, None)
    if cls is None:
        raise NotImplementedError(
            f"{adapter}: the core sampler functional_rb.{name} is not available in this "
            f"installation of functional_rb (version {frb.__version__}), so {adapter} cannot be "
            "built. Use RandomSampler / SamplerWithoutReplacement, or update functional_rb.")
    return cls


def _norm_key(key):
    if key is None:
        return None
    return (key,) if isinstance(key, str) else tuple(key)


class _Component:
    """Base of the adapter samplers and writers: a TorchRL-named wrapper of a core config."""

    def core(self):
        """The frozen core config (``functional_rb`` sampler or writer)."""
        raise NotImplementedError

    def needed_keys(self) -> tuple:
        """Nested keys of the items the core component reads (kept in the core for host
        storages)."""
        return ()

    def __repr__(self):
        return f"{type(self).__name__}()"


# ====================================================================== samplers
class Sampler(_Component):
    """Base of the adapter samplers. ``core()`` gives the frozen core sampler config."""

    prioritized = False
    slices = False
    without_replacement = False

    def state_for(self, core, state, batch_size: int):
        """The core state to sample ``batch_size`` items from: ``state`` itself, except where
        TorchRL's semantics need the sampler state converted for this batch size (then a new
        state, which the buffer uses for this call and does not keep)."""
        del core, batch_size
        return state


class RandomSampler(Sampler):
    """Uniform sampling with replacement (TorchRL's ``RandomSampler``)."""

    def __init__(self, batch_size: int | None = None):
        self._batch_size = batch_size
        self._core = frb.RandomSampler()

    def core(self):
        return self._core


class SamplerWithoutReplacement(Sampler):
    """Each stored item once per epoch (TorchRL's ``SamplerWithoutReplacement``); the last batch
    of an epoch is shorter when ``drop_last=False``, as in TorchRL."""

    without_replacement = True

    def __init__(self, drop_last: bool = False, shuffle: bool = True):
        self.drop_last = drop_last
        self.shuffle = shuffle
        self._core = frb.SamplerWithoutReplacement(drop_last=drop_last, shuffle=shuffle)

    def core(self):
        return self._core

    def __repr__(self):
        return f"SamplerWithoutReplacement(drop_last={self.drop_last}, shuffle={self.shuffle})"


class PrioritizedSampler(Sampler):
    """Prioritized sampling (TorchRL's ``PrioritizedSampler``) backed by the core's jittable
    sum tree ``frb.PrioritizedSampler(alpha, beta, eps)``.

    ``max_capacity`` must equal the storage's size (the core tree is sized by the buffer).
    ``reduction`` reduces non-scalar priorities per item (``"max"``, ``"min"``, ``"sum"``,
    ``"mean"``), as TorchRL does in ``update_tensordict_priority``.
    """

    prioritized = True

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max",
                 max_priority_within_buffer: bool = False, device=None):
        if reduction not in ("max", "min", "sum", "mean", "median"):
            raise ValueError(f"PrioritizedSampler: reduction must be one of max/min/sum/mean/"
                             f"median, got {reduction!r}.")
        self.max_capacity = int(max_capacity)
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.dtype, self.reduction = dtype, reduction
        self.max_priority_within_buffer = max_priority_within_buffer
        self._core = self._make_core()

    def _make_core(self):
        cls = _core_class("PrioritizedSampler", type(self).__name__)
        return cls(alpha=self.alpha, beta=self.beta, eps=self.eps)

    def core(self):
        return self._core

    @property
    def default_priority(self) -> float:
        return 1.0

    def __repr__(self):
        return (f"{type(self).__name__}(max_capacity={self.max_capacity}, alpha={self.alpha}, "
                f"beta={self.beta}, eps={self.eps})")


class SliceSampler(Sampler):
    """Contiguous sub-trajectories (TorchRL's ``SliceSampler``) backed by ``frb.SliceSampler``.

    Samples come flattened to ``[num_slices * slice_len]`` as in TorchRL; with
    ``strict_length=False`` the padding of short trajectories is dropped (TorchRL returns the
    shorter slices concatenated).
    """

    slices = True

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 end_key=None, traj_key=None, truncated_key=("next", "truncated"),
                 strict_length: bool = True, **torchrl_only):
        self._init_slices(num_slices, slice_len, end_key, traj_key, truncated_key,
                          strict_length, torchrl_only)
        cls = _core_class("SliceSampler", type(self).__name__)
        self._core = cls(**self._slice_kwargs())

    def _init_slices(self, num_slices, slice_len, end_key, traj_key, truncated_key,
                     strict_length, torchrl_only):
        unsupported = {k: v for k, v in torchrl_only.items()
                       if v not in (None, False) and k not in ("step_key", "init_key",
                                                               "cache_values", "compile",
                                                               "use_gpu")}
        if unsupported:
            raise NotImplementedError(
                f"{type(self).__name__}: arguments {sorted(unsupported)} are not supported by "
                "the functional core (it reads episode ends from end_key/traj_key).")
        self.num_slices, self.slice_len = num_slices, slice_len
        if end_key is None and traj_key is None:
            end_key = ("next", "done")
        self.end_key = _norm_key(end_key)
        self.traj_key = _norm_key(traj_key)
        self.truncated_key = _norm_key(truncated_key)
        self.strict_length = strict_length

    def _slice_kwargs(self) -> dict:
        kw = dict(num_slices=self.num_slices, slice_len=self.slice_len,
                  truncated_key=self.truncated_key, strict_length=self.strict_length)
        if self.end_key is not None:
            kw["end_key"] = self.end_key
        if self.traj_key is not None:
            kw["traj_key"] = self.traj_key
        return kw

    def core(self):
        return self._core

    def needed_keys(self):
        return tuple(k for k in (self.end_key, self.traj_key, self.truncated_key) if k)

    def __repr__(self):
        return (f"{type(self).__name__}(num_slices={self.num_slices}, slice_len="
                f"{self.slice_len}, end_key={self.end_key}, traj_key={self.traj_key})")


class SliceSamplerWithoutReplacement(SliceSampler):
    """TorchRL's ``SliceSamplerWithoutReplacement``, backed by
    ``frb.SliceSamplerWithoutReplacement``."""

    without_replacement = True

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 drop_last: bool = False, end_key=None, traj_key=None,
                 truncated_key=("next", "truncated"), strict_length: bool = True,
                 shuffle: bool = True, **torchrl_only):
        self._init_slices(num_slices, slice_len, end_key, traj_key, truncated_key,
                          strict_length, torchrl_only)
        self.drop_last, self.shuffle = drop_last, shuffle
        cls = _core_class("SliceSamplerWithoutReplacement", type(self).__name__)
        self._core = cls(**self._slice_kwargs(), drop_last=drop_last, shuffle=shuffle)


class PrioritizedSliceSampler(SliceSampler, PrioritizedSampler):
    """TorchRL's ``PrioritizedSliceSampler`` backed by ``frb.PrioritizedSliceSampler``.

    ``num_slices``: as in TorchRL, each ``sample(batch_size)`` draws ``num_slices`` slices of
    ``batch_size // num_slices`` steps. The core keeps valid slice starts for one slice length:
    the buffer's ``batch_size // num_slices`` (1 when the buffer has no ``batch_size``). A
    ``sample`` implying another length recomputes them for that call from the kept priorities
    (O(capacity), as TorchRL does on every call), cached until the next write or priority
    update; the buffer's state keeps its own slice length.
    """

    prioritized = True

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max", *,
                 num_slices: int | None = None, slice_len: int | None = None, end_key=None,
                 traj_key=None, truncated_key=("next", "truncated"),
                 strict_length: bool = True, **torchrl_only):
        self._init_slices(num_slices, slice_len, end_key, traj_key, truncated_key,
                          strict_length, torchrl_only)
        self.max_capacity = int(max_capacity)
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.dtype, self.reduction = dtype, reduction
        cls = _core_class("PrioritizedSliceSampler", type(self).__name__)
        self._core = cls(alpha=self.alpha, beta=self.beta, eps=self.eps, **self._slice_kwargs())
        self._converted = None  # (source sampler state, slice_len, converted sampler state)

    def state_for(self, core, state, batch_size: int):
        if self.num_slices is None or state is None or batch_size % self.num_slices:
            return state  # (a batch_size that does not divide: the core raises its own error)
        slice_len = batch_size // self.num_slices
        if state.sampler.slice_len == slice_len:
            return state
        c = self._converted
        # keyed on the source state object: every add/update makes a new one
        if c is None or c[0] is not state.sampler or c[1] != slice_len:
            c = (state.sampler, slice_len,
                 core.sampler.with_slice_len(state.sampler, core.context(state), slice_len))
            self._converted = c
        return dataclasses.replace(state, sampler=c[2])


# ====================================================================== writers
class Writer(_Component):
    """Base of the adapter writers; ``core()`` gives the frozen core writer config."""


class RoundRobinWriter(Writer):
    """FIFO ring (TorchRL's ``RoundRobinWriter``) -> ``frb.RoundRobinWriter``."""

    def __init__(self, compilable: bool = False, *, track_generations: bool = False):
        if track_generations:
            raise NotImplementedError("RoundRobinWriter: track_generations is not supported.")

    def core(self):
        return frb.RoundRobinWriter()


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """TorchRL's ``TensorDictRoundRobinWriter`` (the same FIFO ring)."""


class TensorDictMaxValueWriter(Writer):
    """Keeps the highest-ranked items (TorchRL's ``TensorDictMaxValueWriter``) ->
    ``frb.MaxValueWriter``. ``rank_key`` defaults to ``("next", "reward")`` as in TorchRL;
    ``extend`` returns -1 for items that were not stored, as TorchRL does."""

    def __init__(self, rank_key=None, reduction: str = "sum", **kwargs):
        self.rank_key = _norm_key(rank_key) or ("next", "reward")
        self.reduction = reduction
        self._core = frb.MaxValueWriter(rank_key=self.rank_key, reduction=reduction)

    def core(self):
        return self._core

    def needed_keys(self):
        return (self.rank_key,)


class ImmutableDatasetWriter(Writer):
    """A read-only buffer (TorchRL's ``ImmutableDatasetWriter``): ``extend``/``add`` raise."""

    def core(self):
        return frb.ImmutableWriter()


# ====================================================================== storages
class Storage:
    """Base of the adapter storages. ``kind`` is ``"device"`` (data in the core state),
    ``"memmap"`` (numpy memmaps on the host) or ``"list"`` (Python objects)."""

    kind = "device"
    ndim = 1

    def __init__(self, max_size: int, device="cpu", ndim: int = 1):
        if max_size is None or isinstance(max_size, bool) or int(max_size) < 1:
            raise ValueError(f"{type(self).__name__}: max_size must be a positive int (functional "
                             f"buffers have a fixed capacity), got {max_size!r}.")
        self.max_size = int(max_size)
        self.device = torch.device(device) if device not in (None, "auto") else torch.device("cpu")
        if ndim not in (1, 2):
            raise ValueError(f"{type(self).__name__}: ndim must be 1 or 2, got {ndim}.")
        self.ndim = ndim
        self._rb = None  # the adapter buffer using this storage (the core state lives there)
        self._save_hooks: list = []
        self._load_hooks: list = []

    def __len__(self):
        return 0 if self._rb is None else self._rb._len()

    def __repr__(self):
        return f"{type(self).__name__}(max_size={self.max_size}, device={self.device})"

    def _buffer(self, what: str):
        if self._rb is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: this storage is not attached to a "
                               "buffer yet; the functional core keeps its state in the buffer "
                               "(pass it as ReplayBuffer(storage=...)).")
        return self._rb

    # TorchRL's storage-level API; the data and its bookkeeping live in the attached buffer
    def get(self, index):
        """Stored items at ``index`` in storage order (``[len]``; ndim=2: ``[filled,
        num_envs]``, TorchRL's ``[time, env]``), without the buffer's transforms."""
        return self._buffer("get")._read(index, storage_order=True)

    def __getitem__(self, index):
        return self.get(index)

    def register_save_hook(self, hook) -> None:
        """``hook(data, path=path) -> data`` runs on the storage data before it is dumped."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook) -> None:
        """``hook(data, out=None) -> data`` runs on loaded data before it is stored."""
        self._load_hooks.append(hook)

    def dumps(self, path) -> None:
        """TorchRL's ``storage.dumps(path)``: the storage directory of a buffer dump
        (``storage_metadata.json`` + memmapped data; TorchRL's ``storage.loads`` reads it)."""
        from pathlib import Path
        rb = self._buffer("dumps")
        rb._sync_shared()
        rb._dump_storage(Path(path).absolute())

    def loads(self, path) -> None:
        """TorchRL's ``storage.loads(path)``: the data of a storage directory (ours or
        TorchRL's); the buffer's writer continues after the stored items and its sampler is
        rebuilt from them."""
        self._buffer("loads")._load_storage_only(path)

    save = dumps
    dump = dumps
    load = loads

    # host storages override these
    def _host_init(self, specs, capacity, slots):
        pass

    def _host_set(self, positions: np.ndarray, tree: Any):
        pass

    def _host_get(self, indices: np.ndarray):
        raise NotImplementedError

    def _host_empty(self):
        pass


class TensorStorage(Storage):
    """A storage over pre-allocated data (TorchRL's ``TensorStorage``): ``storage`` is a
    TensorDict / tensor with leading axis ``max_size``; the buffer starts full of it."""

    def __init__(self, storage, max_size=None, *, device="cpu", ndim: int = 1,
                 compilable: bool = False):
        if storage is None:
            raise ValueError("TensorStorage: storage must be given (use LazyTensorStorage to "
                             "allocate on first write).")
        n = storage.shape[0] if hasattr(storage, "shape") else None
        if max_size is not None and n is not None and max_size != n:
            raise ValueError(f"TensorStorage: max_size={max_size} but the storage has "
                             f"shape {tuple(storage.shape)}.")
        super().__init__(n if max_size is None else max_size, device, ndim)
        self._initial = storage


class LazyTensorStorage(Storage):
    """Allocated on the first write from the first item (TorchRL's ``LazyTensorStorage``);
    data lives in the core state as JAX arrays."""

    def __init__(self, max_size: int, *, device="cpu", ndim: int = 1, compilable: bool = False,
                 **torchrl_only):
        super().__init__(max_size, device, ndim)


class LazyMemmapStorage(LazyTensorStorage):
    """Numpy memory-mapped files under ``scratch_dir`` (TorchRL's ``LazyMemmapStorage``).

    One file per leaf, ``<scratch_dir>/<key path joined by '/'>.memmap`` (TorchRL's file
    layout), shape ``[max_size, ...]`` in the leaf's numpy dtype (int64/float64 kept as they
    are: host storage has no x64 restriction). The maps stay on the host; ``device`` is where
    sampled tensors are sent, as in TorchRL.
    """

    kind = "memmap"

    def __init__(self, max_size: int, *, scratch_dir=None, device="cpu", ndim: int = 1,
                 existsok: bool = False, compilable: bool = False, **torchrl_only):
        super().__init__(max_size, device=device, ndim=ndim)
        self._tmp = None
        if scratch_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="frb_memmap_")
            scratch_dir = self._tmp.name
        self.scratch_dir = str(scratch_dir)
        self.existsok = existsok
        self._maps: dict = {}
        self._cursor = None  # SharedCursor once the files exist (cross-process writes)
        self._td = None

    def __getstate__(self):
        # Pickled to worker processes: the memory maps are reopened from scratch_dir there (a
        # pickled numpy view would be a private copy), and the temporary directory stays owned
        # by the creating process.
        state = self.__dict__.copy()
        state["_tmp"] = None
        state["_maps"] = {}
        state["_td"] = None
        state["_reopen"] = bool(self._maps)
        return state

    def __setstate__(self, state):
        reopen = state.pop("_reopen", False)
        self.__dict__.update(state)
        if reopen:
            self._open_maps(self._specs)

    def _open_maps(self, specs):
        from tensordict import TensorDict
        if self._td is None:
            self._td = TensorDict.load_memmap(self.scratch_dir)
        self._maps = {}
        for s in specs:
            t = self._td.get(s.key if len(s.key) > 1 else s.key[0])
            if s.dtype == torch.bfloat16:
                import ml_dtypes
                self._maps[s.key] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            else:
                self._maps[s.key] = t.numpy()
        self._specs = specs

    def _host_init(self, specs, capacity, slots):
        # Like TorchRL: a memmapped TensorDict under scratch_dir (meta.json + one
        # <key>.memmap per leaf), so scratch_dir itself is loadable with TensorDict.load_memmap;
        # the adapter reads and writes it through numpy views of the same memory. A shared
        # cursor file (with commit marks for the `slots` ring positions along time) lets
        # several processes extend the same buffer without losing writes.
        from tensordict import TensorDict

        from functional_rb.adapters._shared_cursor import SharedCursor
        item = TensorDict({}, [])
        for s in specs:
            item.set(s.key if len(s.key) > 1 else s.key[0], torch.zeros(s.shape, dtype=s.dtype))
        os.makedirs(self.scratch_dir, exist_ok=True)
        try:
            self._td = item.expand(capacity).memmap_like(prefix=self.scratch_dir,
                                                         existsok=self.existsok)
        except RuntimeError as e:
            raise RuntimeError(f"LazyMemmapStorage: cannot create the memory maps in "
                               f"{self.scratch_dir} ({e}); pass existsok=True to overwrite "
                               "existing files or choose another scratch_dir.") from e
        self._open_maps(specs)
        self._cursor = SharedCursor(os.path.join(self.scratch_dir, "cursor.bin"), slots=slots)
        self._cursor.reset(0)

    def _host_set(self, positions, leaves):
        for key, arr in leaves.items():
            self._maps[key][positions] = arr

    def _host_get(self, indices):
        return {k: np.asarray(m[indices]) for k, m in self._maps.items()}


class ListStorage(Storage):
    """Any Python objects (TorchRL's ``ListStorage``). Sampling stacks tensors / TensorDicts
    as TorchRL does and returns a list for other objects. Bookkeeping (writer cursor, sampler
    state) is the functional core's; the objects stay in a Python list."""

    kind = "list"

    def __init__(self, max_size: int | None = None, *, compilable: bool = False, device=None):
        if max_size is None:
            raise ValueError("ListStorage: pass max_size (functional buffers have a fixed "
                             "capacity; TorchRL's default buffer uses 1000).")
        super().__init__(max_size, device or "cpu", 1)
        self._items: list = [None] * self.max_size

    def _host_set(self, positions, items):
        for p, it in zip(positions, items):
            self._items[int(p)] = it

    def _host_get(self, indices):
        return [self._items[int(i)] for i in np.asarray(indices).reshape(-1)]

    def _host_empty(self):
        self._items = [None] * self.max_size
