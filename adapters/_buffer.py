"""TorchRL's replay-buffer classes, backed by the functional core.

Each adapter buffer holds a frozen core :class:`functional_rb.ReplayBuffer` and its
:class:`functional_rb.BufferState`; ``extend``/``sample``/``update_priority`` convert torch data
at the boundary and call the core's pure functions, jitted once per configuration (the jitted
functions are cached on the hashable core config, so buffers built alike share compilations).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection

import functional_rb as frb
from functional_rb.adapters import _convert as cv
from functional_rb.adapters._components import (ListStorage, PrioritizedSampler, RandomSampler,
                                                RoundRobinWriter, Sampler, Storage,
                                                TensorDictRoundRobinWriter, TensorStorage,
                                                Writer)

_SINGLE = "_-single-tensor-_"  # TorchRL's file name for a storage that is one tensor
_DUMMY = "_frb_slot"           # the core's only leaf for list storages


# ---------------------------------------------------------------------- jitted core calls
@functools.lru_cache(maxsize=None)
def _jitted(core: frb.ReplayBuffer):
    """``(add, sample, update)`` jitted for one core config (hashable, so cached)."""

    def add(state, items):
        layout = core.layout(state)
        checked = core.check_items(state, items, where="extend")
        positions, mask, _ = core.writer.write(state.writer, checked, layout)
        return positions, mask, core.add(state, items)

    # sample / update return only the sampler state: returning the whole state would make XLA
    # copy the storage into fresh output buffers on every call
    def sample(state, seed, batch_size):
        s, new_state = core.sample(state, jax.random.key(seed), batch_size=batch_size)
        return s, new_state.sampler

    def update(state, indices, priorities):
        return core.update(state, indices, priorities).sampler

    return (jax.jit(add, donate_argnums=0),
            jax.jit(sample, static_argnums=2),
            jax.jit(update))


class _Transforms:
    """A chain of transforms: forward on sample, inverse (in reverse order) on extend.

    Elements are TorchRL ``Transform`` objects (callable, with ``.inv``) or plain callables
    (forward only; their inverse is the identity). ``invert=True`` swaps the two directions.
    """

    def __init__(self):
        self.items: list = []  # (transform, inverted)

    def __len__(self):
        return len(self.items)

    @staticmethod
    def _fwd(t, data):
        return t(data)

    @staticmethod
    def _inv(t, data):
        inv = getattr(t, "inv", None)
        return data if inv is None else inv(data)

    def forward(self, data):
        for t, inverted in self.items:
            data = self._inv(t, data) if inverted else self._fwd(t, data)
        return data

    def inv(self, data):
        for t, inverted in reversed(self.items):
            data = self._fwd(t, data) if inverted else self._inv(t, data)
        return data

    def state_dict(self):
        return {str(i): t.state_dict() for i, (t, _) in enumerate(self.items)
                if hasattr(t, "state_dict")}

    def load_state_dict(self, sd):
        for i, (t, _) in enumerate(self.items):
            if str(i) in sd and hasattr(t, "load_state_dict"):
                t.load_state_dict(sd[str(i)])


def _tree_np(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


def _get_nested(tree, key):
    for k in key:
        tree = tree[k]
    return tree


def _host_np(x: torch.Tensor) -> np.ndarray:
    """Host (memmap) arrays keep the torch dtype exactly (no x64 restriction on the host)."""
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(cv.ml_dtypes.bfloat16)
    return x.numpy()


def _as_np_index(index) -> np.ndarray:
    if isinstance(index, torch.Tensor):
        return index.detach().cpu().numpy()
    return np.asarray(index)


class ReplayBuffer:
    """TorchRL's ``ReplayBuffer`` (same keyword arguments and methods), backed by the
    functional core.

    Keyword Args:
      storage: a :class:`ListStorage` (default, ``max_size=1000``), :class:`TensorStorage`,
        :class:`LazyTensorStorage` or :class:`LazyMemmapStorage`.
      sampler: default :class:`RandomSampler`. writer: default :class:`RoundRobinWriter`.
      transform: a TorchRL ``Transform`` or a callable applied to samples.
      batch_size: default sample size. dim_extend: as TorchRL (``storage.ndim - 1`` by default).
      generator: a ``torch.Generator``: each ``sample`` draws one seed from it (or from torch's
        global generator) for the JAX key, so ``torch.manual_seed`` makes sampling reproducible.

    Data: tensors or PyTrees (tuples/dicts) of tensors with leading batch axis for tensor
    storages; any Python objects for ``ListStorage``. See :mod:`functional_rb.adapters._convert`
    for the dtype rule (int64 is stored as int32 while JAX x64 is off and returned as int64).
    """

    _is_tensordict = False

    def __init__(self, *, storage: Storage | Callable | None = None,
                 sampler: Sampler | Callable | None = None,
                 writer: Writer | Callable | None = None, collate_fn: Callable | None = None,
                 pin_memory: bool = False, prefetch: int | None = None, transform=None,
                 batch_size: int | None = None, dim_extend: int | None = None,
                 generator: torch.Generator | None = None, shared: bool = False,
                 compilable: bool | None = None, **unsupported):
        unsupported = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if unsupported:
            raise NotImplementedError(f"{type(self).__name__}: arguments {sorted(unsupported)} "
                                      "are not supported by the functional adapters.")
        if prefetch:
            warnings.warn(f"{type(self).__name__}: prefetch is ignored (sampling is one jitted "
                          "call).", stacklevel=2)
        storage = ListStorage(1000) if storage is None else storage
        storage = storage() if callable(storage) and not isinstance(storage, Storage) else storage
        sampler = RandomSampler() if sampler is None else sampler
        sampler = sampler() if callable(sampler) and not isinstance(sampler, Sampler) else sampler
        if writer is None:
            writer = TensorDictRoundRobinWriter() if self._is_tensordict else RoundRobinWriter()
        writer = writer() if callable(writer) and not isinstance(writer, Writer) else writer
        for name, obj, base in (("storage", storage, Storage), ("sampler", sampler, Sampler),
                                ("writer", writer, Writer)):
            if not isinstance(obj, base):
                raise TypeError(f"{type(self).__name__}: {name} must be a functional_rb.adapters "
                                f"{base.__name__} (e.g. functional_rb.adapters.{type(obj).__name__}"
                                f"), got {type(obj).__module__}.{type(obj).__name__}. TorchRL "
                                "objects cannot drive the functional core.")
        if storage.kind == "list" and (sampler.slices or writer.needed_keys()):
            raise ValueError(f"{type(self).__name__}: {type(sampler).__name__}/"
                             f"{type(writer).__name__} read keys of the data; use a tensor "
                             "storage (LazyTensorStorage), not ListStorage.")
        if isinstance(sampler, PrioritizedSampler) and sampler.max_capacity != storage.max_size:
            raise ValueError(f"{type(self).__name__}: PrioritizedSampler(max_capacity="
                             f"{sampler.max_capacity}) must match the storage max_size="
                             f"{storage.max_size}.")
        self._storage, self._sampler, self._writer = storage, sampler, writer
        storage._rb = self
        self._collate_fn = collate_fn
        self._batch_size = batch_size
        self._dim_extend = storage.ndim - 1 if dim_extend is None else dim_extend
        self._rng = generator
        self._transform = _Transforms()
        if transform is not None:
            self.append_transform(transform)
        self._save_hooks: list = []
        self._load_hooks: list = []
        self._core = frb.ReplayBuffer(capacity=storage.max_size, sampler=sampler.core(),
                                      writer=writer.core(), storage=frb.DeviceStorage(pack=False),
                                      batch_size=self._core_batch_size(), ndim=storage.ndim)
        self._state = None      # frb.BufferState once the first item arrived
        self._specs = None      # tuple of LeafSpec (tensor storages)
        self._treedef = None    # PyTree structure of non-TensorDict data
        self._td_mode = None    # True: TensorDict data; False: tensor PyTrees; None: objects
        self._write_count = 0
        self._ran_out = False
        self._warned_bs = False
        if isinstance(storage, TensorStorage):
            self._init_from_data(storage._initial)

    def _core_batch_size(self) -> int:
        if self._batch_size is not None:
            return int(self._batch_size)
        s = self._sampler
        if s.slices:
            return int(s.num_slices or s.slice_len or 1) * (1 if s.num_slices is None else
                                                            int(s.slice_len or 1))
        return 1

    # ------------------------------------------------------------------ properties
    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def writer(self) -> Writer:
        return self._writer

    @property
    def batch_size(self):
        return self._batch_size

    @property
    def dim_extend(self) -> int:
        return self._dim_extend

    @property
    def write_count(self) -> int:
        cur = self._shared_cursor()
        return cur.count() if cur is not None else self._write_count

    @property
    def core(self) -> frb.ReplayBuffer:
        """The frozen core :class:`functional_rb.ReplayBuffer` behind this adapter."""
        return self._core

    @property
    def state(self):
        """The core :class:`functional_rb.BufferState` (None before the first write)."""
        return self._state

    def set_rng(self, generator: torch.Generator) -> None:
        self._rng = generator

    def __len__(self) -> int:
        return self._len()

    def _len(self) -> int:
        self._sync_shared()
        if self._state is None:
            return 0
        return int(self._state.writer.filled) * self._state.num_envs

    # ------------------------------------------------------------------ cross-process writes
    def _shared_cursor(self):
        """The storage's cross-process cursor when this configuration can use it: a
        LazyMemmapStorage (ndim=1) with a round-robin writer and a sampler without per-item
        bookkeeping (RandomSampler / SamplerWithoutReplacement). Then the write position comes
        from the shared counter, so worker processes may ``extend`` the same buffer (pickled
        to them) without losing writes, as with TorchRL."""
        st = self._storage
        if st.kind != "memmap" or getattr(st, "_cursor", None) is None or st.ndim != 1:
            return None
        if type(self._writer.core()) is not frb.RoundRobinWriter:
            return None
        if not isinstance(self._sampler.core(), (frb.RandomSampler,
                                                 frb.SamplerWithoutReplacement)):
            return None
        return st._cursor

    def _sync_shared(self, count: int | None = None):
        cur = self._shared_cursor()
        if cur is None or self._state is None:
            return
        count = cur.count() if count is None else count
        cap = self._storage.max_size
        w = self._state.writer
        if int(w.cursor) != count % cap or int(w.filled) != min(count, cap):
            self._state = dataclasses.replace(self._state, writer=frb.writers.RoundRobinState(
                cursor=jnp.int32(count % cap), filled=jnp.int32(min(count, cap))))

    def _shared_reset(self):
        cur = self._shared_cursor()
        if cur is None:
            return
        if self._state is None:
            cur.reset(0)
            return
        cap, w = self._storage.max_size, self._state.writer
        filled, cursor = int(w.filled), int(w.cursor)
        cur.reset(filled if filled < cap else cap + cursor)

    def __repr__(self):
        return (f"{type(self).__name__}(storage={self._storage!r}, sampler={self._sampler!r}, "
                f"writer={self._writer!r}, batch_size={self._batch_size}, len={len(self)})")

    # ------------------------------------------------------------------ conversion
    def _to_core_layout(self, x):
        """Torch data -> the core's batch layout ([B] or [num_envs, T])."""
        if self._storage.ndim == 2 and self._dim_extend == 0:
            return x.transpose(0, 1)
        return x

    def _leaves_of(self, data, where):
        """``{key: tensor}`` in the core's batch layout for TD / tensor-PyTree data."""
        if is_tensor_collection(data):
            mode = True
            if self._storage.ndim == 2:
                if data.batch_dims < 2:
                    raise ValueError(f"{where}: a ndim=2 storage takes data with 2 batch dims, "
                                     f"got batch_size {tuple(data.batch_size)}.")
                data = self._to_core_layout(data)
            leaves = cv.td_leaves(data, where)
            treedef = None
        else:
            mode = False
            treedef, leaves = cv.pytree_to_leaves(data, where)
            leaves = {k: self._to_core_layout(v) for k, v in leaves.items()}
        if self._td_mode is not None and self._td_mode != mode:
            raise TypeError(f"{where}: this buffer holds "
                            f"{'TensorDicts' if self._td_mode else 'tensor PyTrees'}; got "
                            f"{type(data).__name__}.")
        if self._treedef is not None and treedef is not None and treedef != self._treedef:
            raise ValueError(f"{where}: the data structure {treedef} differs from the stored "
                             f"one {self._treedef}.")
        return mode, treedef, leaves

    def _core_tree(self, leaves: dict, n_lead: int, where: str):
        """What the core stores, as numpy: every leaf (device storages), or a dummy slot plus
        only the leaves its writer/sampler read (host storages keep the data themselves)."""
        if self._storage.kind == "device":
            return cv.leaves_to_tree(leaves, where)
        needed = set(self._sampler.needed_keys() + self._writer.needed_keys())
        lead = tuple(next(iter(leaves.values())).shape[:n_lead])
        tree = cv.leaves_to_tree({k: v for k, v in leaves.items() if k in needed}, where)
        tree[_DUMMY] = np.zeros(lead, np.uint8)
        return tree

    def _ensure_init(self, mode, treedef, leaves, n_lead):
        if self._state is not None:
            return
        self._td_mode, self._treedef = mode, treedef
        self._specs = cv.specs_of(leaves, n_lead)
        example = jax.tree_util.tree_map(
            lambda x: x[0] if n_lead == 1 else x[:, 0],
            self._core_tree(leaves, n_lead, "extend"))
        self._state = self._core.init(example)
        self._storage._host_init(self._specs, self._storage.max_size)

    def _init_from_data(self, data):
        """TensorStorage(storage): the buffer starts full of ``data`` (TorchRL's behaviour)."""
        mode, treedef, leaves = self._leaves_of(data, "TensorStorage")
        n_lead = self._storage.ndim
        self._ensure_init(mode, treedef, leaves, n_lead)
        self._state = self._core.init_from_data(self._core_tree(leaves, n_lead, "TensorStorage"))
        self._write_count = self._len()

    # ------------------------------------------------------------------ writing
    def extend(self, data, *, update_priority: bool | None = None) -> torch.Tensor:
        """Add a batch (leading axis = items; ndim=2: per ``dim_extend``); inverse transforms
        run first. Returns the storage indices, int64 ``[B]`` (ndim=2: ``[B*T, 2]`` of
        ``(t, env)``), -1 for items a max-value writer rejected."""
        if len(self._transform):
            data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._extend(data)

    def _extend(self, data) -> torch.Tensor:
        if self._storage.kind == "list":
            return self._extend_list(data)
        mode, treedef, leaves = self._leaves_of(data, f"{type(self).__name__}.extend")
        n_lead = self._storage.ndim
        self._ensure_init(mode, treedef, leaves, n_lead)
        want = {s.key: s for s in self._specs}
        if set(leaves) != set(want):
            raise KeyError(f"{type(self).__name__}.extend: keys {sorted(leaves)} differ from the "
                           f"stored keys {sorted(want)} (missing {sorted(set(want) - set(leaves))}"
                           f", unexpected {sorted(set(leaves) - set(want))}).")
        for k, v in leaves.items():
            if tuple(v.shape[n_lead:]) != want[k].shape:
                raise ValueError(f"{type(self).__name__}.extend: leaf {k!r} has item shape "
                                 f"{tuple(v.shape[n_lead:])}, expected {want[k].shape}.")
        tree = self._core_tree(leaves, n_lead, f"{type(self).__name__}.extend")
        cur = self._shared_cursor()
        if cur is not None:
            self._sync_shared(cur.reserve(int(next(iter(leaves.values())).shape[0])))
        add, _, _ = _jitted(self._core)
        positions, mask, self._state = add(self._state, tree)
        positions, mask = np.asarray(positions), np.asarray(mask)
        n = int(np.prod(positions.shape))
        self._write_count += n
        if self._storage.kind == "memmap":
            flat_pos = positions.reshape(-1)[mask.reshape(-1)]
            sel = mask.reshape(-1)
            self._storage._host_set(flat_pos, {
                k: _host_np(v).reshape((n,) + want[k].shape)[sel] for k, v in leaves.items()})
        return self._positions_to_index(positions, mask)

    def _positions_to_index(self, positions, mask) -> torch.Tensor:
        if self._storage.ndim == 2:
            layout = self._core.layout(self._state)
            env, t = positions // layout.row_capacity, positions % layout.row_capacity
            # TorchRL's ndim=2 storage is [time, env]; index pairs are (t, env).
            idx = np.stack([t.T.reshape(-1), env.T.reshape(-1)], -1)
            return cv.to_index_tensor(idx)
        if isinstance(self._writer.core(), frb.MaxValueWriter):
            positions = np.where(mask, positions, -1)
        return cv.to_index_tensor(positions)

    def _extend_list(self, data) -> torch.Tensor:
        if isinstance(data, (torch.Tensor, TensorDictBase)):
            items = list(data.unbind(0))
        elif isinstance(data, list):
            items = data
        else:
            raise TypeError(f"{type(self).__name__}.extend: ListStorage takes a list of items "
                            f"(or a tensor/TensorDict to split along dim 0), got "
                            f"{type(data).__name__}. Use add() for one item.")
        if not items:
            return torch.zeros((0,), dtype=torch.long)
        if self._state is None:
            self._state = self._core.init({_DUMMY: np.zeros((), np.uint8)})
        add, _, _ = _jitted(self._core)
        positions, mask, self._state = add(self._state,
                                           {_DUMMY: np.zeros((len(items),), np.uint8)})
        positions, mask = np.asarray(positions), np.asarray(mask)
        self._storage._host_set(positions[mask], [it for it, m in zip(items, mask) if m])
        self._write_count += len(items)
        return cv.to_index_tensor(positions)

    def add(self, data) -> int:
        """Add one item (no batch axis). Returns its index (an int; ndim=2 storages: the
        ``[num_envs, 2]`` index tensor)."""
        if len(self._transform):
            is_tc = is_tensor_collection(data)
            if is_tc:
                data = self._transform.inv(data.unsqueeze(-1)).squeeze(-1)
            else:
                data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._add(data)

    def _add(self, data):
        if self._storage.kind == "list":
            return int(self._extend_list([data])[0])
        if is_tensor_collection(data):
            batch = data.unsqueeze(0)
        else:
            batch = jax.tree_util.tree_map(lambda x: torch.as_tensor(x).unsqueeze(0), data,
                                           is_leaf=lambda x: isinstance(x, torch.Tensor))
        if self._storage.ndim == 2:
            # one vectorized step [num_envs, ...]: a T=1 slice in the core layout
            batch = batch.transpose(0, 1) if is_tensor_collection(batch) else batch
            saved = self._dim_extend
            self._dim_extend = 1
            try:
                return self._extend(batch)
            finally:
                self._dim_extend = saved
        return int(self._extend(batch)[0])

    # ------------------------------------------------------------------ sampling
    def _seed(self) -> np.uint32:
        """A seed for the JAX key, drawn from torch's generator (so torch.manual_seed or
        ``generator=`` make sampling reproducible)."""
        return np.uint32(torch.randint(0, 2 ** 31 - 1, (1,), generator=self._rng).item())

    def _resolve_batch_size(self, batch_size):
        if batch_size is not None and self._batch_size is not None and \
                batch_size != self._batch_size and not self._warned_bs:
            self._warned_bs = True
            warnings.warn(f"Got conflicting batch_sizes in constructor ({self._batch_size}) and "
                          f"`sample` ({batch_size}). The batch-size provided to the sample method "
                          "will prevail.", stacklevel=3)
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError("batch_size not specified. You can specify the batch_size when "
                               "constructing the replay buffer, or pass it to the sample method.")
        return int(batch_size)

    def _sample_raw(self, batch_size: int):
        """(data, info) before transforms. ``info``: {"index", and "priority_weight" for
        prioritized samplers}."""
        if self._state is None or self._len() == 0:
            raise RuntimeError("Cannot sample from an empty replay buffer (0 items stored); "
                               "extend it first.")
        _, sample, _ = _jitted(self._core)
        s, sampler_state = sample(self._state, self._seed(), batch_size)
        self._state = dataclasses.replace(self._state, sampler=sampler_state)
        s = jax.device_get(s)  # one transfer for data, indices, weights and mask
        indices, weights, mask = s.indices, s.weights, s.mask
        self._update_ran_out(batch_size)
        flat_idx = indices.reshape(-1)
        keep = mask.reshape(-1)
        all_kept = bool(keep.all())
        sel = slice(None) if all_kept else keep
        flat_idx = flat_idx[sel]
        n = flat_idx.shape[0]
        info: dict = {}
        if self._storage.ndim == 2:
            layout = self._core.layout(self._state)
            info["index"] = cv.to_index_tensor(
                np.stack([flat_idx % layout.row_capacity, flat_idx // layout.row_capacity], -1))
        else:
            info["index"] = cv.to_index_tensor(flat_idx)
        if self._sampler.prioritized:
            w = torch.from_numpy(np.array(weights.reshape(-1)[sel], np.float32, copy=True))
            # TorchRL 0.14 names it "priority_weight"; earlier releases (and code written for
            # them) read "_weight". Both keys hold the same tensor.
            info["priority_weight"] = w
            info["_weight"] = w
        data = self._gather(s.data, flat_idx, sel, n, indices.ndim)
        return data, info

    def _update_ran_out(self, batch_size):
        st = self._state.sampler
        if self._sampler.without_replacement and hasattr(st, "pos") and hasattr(st, "epoch_size"):
            remaining = int(st.epoch_size) - int(st.pos)
            drop_last = getattr(self._sampler, "drop_last", False)
            self._ran_out = remaining <= 0 or (drop_last and remaining < batch_size)
        elif self._sampler.without_replacement:
            self._ran_out = bool(getattr(st, "ran_out", False))
        else:
            self._ran_out = False

    def _gather(self, core_data, flat_idx, sel, n, lead_nd):
        kind = self._storage.kind
        if kind == "list":
            return self._collate(self._storage._host_get(flat_idx))
        lead = (n,)
        if kind == "device":
            tree = jax.tree_util.tree_map(
                lambda x: np.asarray(x).reshape((-1,) + x.shape[lead_nd:])[sel], core_data)
        else:
            host = self._storage._host_get(flat_idx)
            tree = {}
            for k, v in host.items():
                node = tree
                for kk in k[:-1]:
                    node = node.setdefault(kk, {})
                node[k[-1]] = v
        return self._from_tree(tree, lead)

    def _from_tree(self, tree, lead):
        dev = self._storage.device
        if self._td_mode:
            return cv.tree_to_td(tree, self._specs, torch.Size(lead), dev)
        return cv.leaves_to_pytree(self._treedef, tree, self._specs, dev)

    def _collate(self, items):
        if self._collate_fn is not None:
            return self._collate_fn(items)
        if items and all(isinstance(x, torch.Tensor) for x in items):
            return torch.stack(items)
        if items and all(is_tensor_collection(x) for x in items):
            return torch.stack(items)
        return items

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A batch: the data structure given to ``extend`` with leading axis ``batch_size``
        (slice samplers: ``num_slices * slice_len``; without-replacement: shorter at the end of
        an epoch). ``return_info=True`` also returns ``{"index": int64, ["priority_weight"]}``."""
        bs = self._resolve_batch_size(batch_size)
        data, info = self._sample_raw(bs)
        if len(self._transform):
            data = self._transform.forward(data)
        if return_info:
            return data, info
        return data

    def update_priority(self, index, priority) -> None:
        """Set priorities at ``index`` (int64 ``[B]``, or ``[B, 2]`` / a tuple for ndim=2)."""
        if self._state is None:
            raise RuntimeError("update_priority: the buffer is empty.")
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        idx = _as_np_index(index).astype(np.int64)
        if self._storage.ndim == 2:
            layout = self._core.layout(self._state)
            idx = idx.reshape(-1, 2)
            idx = idx[:, 1] * layout.row_capacity + idx[:, 0]
        idx = idx.reshape(-1)
        pr = np.asarray(torch.as_tensor(priority).detach().cpu().to(torch.float32).numpy())
        pr = np.broadcast_to(pr.reshape(-1) if pr.size == idx.size else pr, idx.shape)
        if idx.size and (idx.min() < 0 or idx.max() >= self._storage.max_size):
            raise IndexError(f"update_priority: indices must be in [0, {self._storage.max_size}),"
                             f" got [{idx.min()}, {idx.max()}].")
        _, _, update = _jitted(self._core)
        self._state = dataclasses.replace(self._state, sampler=update(
            self._state, np.asarray(idx, np.int32), np.asarray(pr, np.float32)))

    def can_sample(self, batch_size: int | None = None) -> bool:
        if self._state is None:
            return False
        bs = batch_size or self._batch_size or 1
        return bool(self._core.sampler.can_sample(self._state.sampler,
                                                  self._core.context(self._state), bs))

    # ------------------------------------------------------------------ reading
    def _positions_of(self, index) -> np.ndarray:
        n = self._len()
        if self._storage.ndim == 2:
            raise NotImplementedError("__getitem__ on ndim=2 storages is not supported; sample "
                                      "or use rb.core.get(rb.state, flat_indices).")
        if isinstance(index, slice):
            return np.arange(n)[index]
        idx = _as_np_index(index).astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"index out of range for a buffer of {n} items.")
        return np.where(idx < 0, idx + n, idx)

    def __getitem__(self, index):
        if isinstance(index, str) or (isinstance(index, tuple) and index and
                                      all(isinstance(k, str) for k in index)):
            return self[:][index]
        if self._state is None:
            raise IndexError("the buffer is empty")
        pos = self._positions_of(index)
        scalar = pos.ndim == 0
        flat = pos.reshape(-1)
        if self._storage.kind == "list":
            items = self._storage._host_get(flat)
            data = items[0] if scalar else self._collate(items)
        else:
            if self._storage.kind == "device":
                tree = _tree_np(self._core.get(self._state, jnp.asarray(flat, jnp.int32)))
            else:
                tree = {}
                for k, v in self._storage._host_get(flat).items():
                    node = tree
                    for kk in k[:-1]:
                        node = node.setdefault(kk, {})
                    node[k[-1]] = v
            data = self._from_tree(tree, (flat.shape[0],))
            if scalar:
                data = data[0] if self._td_mode else jax.tree_util.tree_map(
                    lambda x: x[0], data, is_leaf=lambda x: isinstance(x, torch.Tensor))
        if len(self._transform):
            data = self._transform.forward(data)
        return data

    def __iter__(self):
        if self._batch_size is None:
            raise RuntimeError("Cannot iterate over the replay buffer. Batch_size was not "
                               "specified during construction of the replay buffer.")
        self._ran_out = False
        while not self._ran_out:
            yield self.sample()

    # ------------------------------------------------------------------ transforms
    def append_transform(self, transform, *, invert: bool = False):
        """Append a transform (applied on sample; its inverse on extend). ``invert=True``: its
        forward runs on extend and its inverse on sample. Returns self."""
        if hasattr(transform, "eval"):
            transform.eval()
        self._transform.items.append((transform, invert))
        return self

    def insert_transform(self, index: int, transform, *, invert: bool = False):
        if hasattr(transform, "eval"):
            transform.eval()
        self._transform.items.insert(index, (transform, invert))
        return self

    @property
    def transform(self):
        return self._transform

    # ------------------------------------------------------------------ lifecycle
    def empty(self, empty_write_count: bool = True):
        """Remove every item; the storage keeps its structure (as TorchRL)."""
        if self._state is not None:
            self._state = self._reinit_state()
        self._storage._host_empty()
        self._ran_out = False
        self._shared_reset()
        if empty_write_count:
            self._write_count = 0

    def _reinit_state(self):
        spec = self._core.storage.item_spec(self._state.storage)
        n = self._state.num_envs
        example = jax.tree_util.tree_map(
            lambda s: jnp.zeros(((n,) if self._storage.ndim == 2 else ()) + s.shape, s.dtype),
            spec)
        return self._core.init(example)

    def register_save_hook(self, hook: Callable[[Any], Any]):
        """``hook(data, path=path) -> data`` runs on the storage's data before ``dumps`` writes
        it (TorchRL semantics; hooks with ``shift``/``is_full`` attributes get them set)."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable[[Any], Any]):
        """``hook(data, out=None) -> data`` runs on the loaded data before it is stored."""
        self._load_hooks.append(hook)

    # ------------------------------------------------------------------ state_dict
    def _component_states(self):
        leaves, treedef = jax.tree_util.tree_flatten(self._state)
        return [torch.from_numpy(np.array(x, copy=True)) if np.asarray(x).dtype !=
                np.dtype(cv.ml_dtypes.bfloat16) else cv.numpy_to_tensor(x, torch.bfloat16)
                for x in leaves]

    def state_dict(self) -> dict:
        """Everything needed to restore this buffer with :meth:`load_state_dict` (the core state
        leaves as tensors, the leaf specs, host data, writer count, transforms, batch size)."""
        sd = {"_batch_size": self._batch_size, "_write_count": self._write_count,
              "_transforms": self._transform.state_dict(),
              "_rng": None if self._rng is None else self._rng.get_state().clone(),
              "_core_state": None}
        if self._state is not None:
            sd["_core_state"] = self._component_states()
            sd["_num_envs"] = self._state.num_envs
            sd["_specs"] = [(s.key, s.shape, s.dtype) for s in (self._specs or ())]
            sd["_td_mode"] = self._td_mode
            sd["_treedef"] = self._treedef
            if self._storage.kind == "memmap":
                dtypes = {sp.key: sp.dtype for sp in self._specs}
                sd["_host"] = {k: cv.numpy_to_tensor(m, dtypes[k]) for k, m in
                               self._storage._maps.items()}
            elif self._storage.kind == "list":
                sd["_host"] = list(self._storage._items)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self._batch_size = state_dict["_batch_size"]
        self._write_count = state_dict["_write_count"]
        self._transform.load_state_dict(state_dict.get("_transforms", {}))
        if state_dict.get("_rng") is not None:
            self._rng = self._rng or torch.Generator()
            self._rng.set_state(state_dict["_rng"])
        if state_dict["_core_state"] is None:
            self._state = None
            return
        self._specs = tuple(cv.LeafSpec(tuple(k), tuple(s), d) for k, s, d in
                            state_dict["_specs"])
        self._td_mode, self._treedef = state_dict["_td_mode"], state_dict["_treedef"]
        template = self._template_state(state_dict["_num_envs"])
        treedef = jax.tree_util.tree_structure(template)
        leaves = [jnp.asarray(cv.tensor_to_numpy(t) if t.dtype == torch.bfloat16
                              else t.numpy()) for t in state_dict["_core_state"]]
        self._state = jax.tree_util.tree_unflatten(treedef, leaves)
        if self._storage.kind == "memmap":
            self._storage._host_init(self._specs, self._storage.max_size) \
                if not self._storage._maps else None
            for k, t in state_dict["_host"].items():
                self._storage._maps[k][:] = _host_np(t)
        elif self._storage.kind == "list":
            self._storage._items = list(state_dict["_host"])
        self._shared_reset()

    def _template_state(self, num_envs):
        """A fresh core state of the right structure from the stored specs."""
        if self._storage.kind == "list":
            return self._core.init({_DUMMY: np.zeros((), np.uint8)})
        lead = (num_envs,) if self._storage.ndim == 2 else (1,)
        leaves = {s.key: torch.zeros(lead + s.shape, dtype=s.dtype) for s in self._specs}
        tree = self._core_tree(leaves, 1, "loads")
        if self._storage.ndim == 1:
            tree = jax.tree_util.tree_map(lambda x: x[0], tree)
        return self._core.init(tree)

    # ------------------------------------------------------------------ dumps / loads
    def _storage_td(self) -> TensorDictBase:
        """The whole storage ([max_size, ...], TorchRL's ndim=2 shape [max_size/envs, envs]) as
        a TensorDict (PyTree data: keys '0', '1', ... or TorchRL's single-tensor name)."""
        cap = self._storage.max_size
        if self._storage.kind == "device":
            tree = _tree_np(self._state.storage.data)
        else:
            tree = cv._nest({k: np.asarray(m) for k, m in self._storage._maps.items()})
        if self._storage.ndim == 2:
            n = self._state.num_envs
            tree = jax.tree_util.tree_map(
                lambda x: np.swapaxes(x.reshape((n, cap // n) + x.shape[1:]), 0, 1), tree)
            batch = (cap // n, n)
        else:
            batch = (cap,)
        td = TensorDict({}, batch_size=batch)
        for s in self._specs:
            arr = _get_nested(tree, s.key)
            key = s.key if len(s.key) > 1 else s.key[0]
            if not self._td_mode:
                key = _SINGLE if len(self._specs) == 1 else s.key[0]
            td.set(key, cv.numpy_to_tensor(arr, s.dtype))
        return td

    def dumps(self, path) -> None:
        """Save to ``path`` in TorchRL's layout: ``storage/`` (a memmapped TensorDict of the
        whole storage + ``storage_metadata.json``), ``sampler/``, ``writer/metadata.json`` and
        ``buffer_metadata.json``."""
        if self._storage.kind == "list":
            raise NotImplementedError(
                "ListStorage doesn't support serialization via `dumps` - `loads` API.")
        if self._state is None:
            raise RuntimeError("Cannot save a non-initialized storage.")
        path = Path(path).absolute()
        path.mkdir(exist_ok=True, parents=True)
        spath = path / "storage"
        spath.mkdir(exist_ok=True)
        data = self._storage_td()
        n = self._len()
        cursor = int(self._state.writer.cursor)
        is_full = n >= self._storage.max_size
        for hook in self._save_hooks:
            if hasattr(hook, "is_full"):
                hook.is_full = is_full
            if hasattr(hook, "shift"):
                # TorchRL: last written position + 1
                hook.shift = (cursor - 1) % (self._core.layout(self._state).row_capacity) + 1 \
                    if n else 0
        for hook in self._save_hooks:
            data = hook(data, path=spath)
        if is_tensor_collection(data):
            data.memmap(spath, copy_existing=True)
        with open(spath / "storage_metadata.json", "w") as f:
            json.dump({"metadata": {}, "is_pytree": False,
                       "len": n if self._storage.ndim == 1 else int(self._state.writer.filled),
                       "frb_specs": [[list(s.key), list(s.shape), str(s.dtype)]
                                     for s in self._specs],
                       "frb_td_mode": self._td_mode, "frb_num_envs": self._state.num_envs}, f)
        # sampler and writer: the core states' leaves, memmapped
        for name, st in (("sampler", self._state.sampler), ("writer", self._state.writer)):
            p = path / name
            p.mkdir(exist_ok=True)
            leaves = jax.tree_util.tree_leaves(st)
            if leaves:
                TensorDict({f"leaf{i}": torch.from_numpy(np.array(x, copy=True)).reshape(-1)
                            if np.ndim(x) == 0 else torch.from_numpy(np.array(x, copy=True))
                            for i, x in enumerate(leaves)}, []).memmap(p, copy_existing=True)
        with open(path / "writer" / "metadata.json", "w") as f:
            json.dump({"cursor": cursor, "write_count": self._write_count}, f)
        with open(path / "buffer_metadata.json", "w") as f:
            json.dump({"batch_size": self._batch_size, "consume_after_n_samples": None}, f)
        tsd = self._transform.state_dict()
        if tsd:
            torch.save(tsd, path / "transform.t")

    def loads(self, path) -> None:
        """Restore what :meth:`dumps` saved (into this buffer, built with the same components)."""
        path = Path(path).absolute()
        spath = path / "storage"
        with open(spath / "storage_metadata.json") as f:
            meta = json.load(f)
        data = TensorDict.load_memmap(spath)
        for hook in self._load_hooks:
            data = hook(data, out=None)
        num_envs = meta.get("frb_num_envs", 1)
        if "frb_specs" in meta:
            self._specs = tuple(cv.LeafSpec(tuple(k), tuple(s), getattr(torch, d.split(".")[-1]))
                                for k, s, d in meta["frb_specs"])
            self._td_mode = meta["frb_td_mode"]
        elif meta.get("is_pytree") or not is_tensor_collection(data):
            if self._specs is None:
                raise RuntimeError("Cannot fill a non-initialized pytree-based storage: extend "
                                   "the buffer once before loads().")
        else:
            # a TorchRL dump: the specs come from the memmapped TensorDict itself
            nb = self._storage.ndim
            if nb == 2:
                num_envs = data.batch_size[1]
            self._specs = cv.specs_of(cv.td_leaves(data, "loads"), nb)
            self._td_mode = True
        if self._td_mode is False and self._treedef is None:
            raise RuntimeError("Cannot fill a non-initialized pytree-based storage: extend the "
                               "buffer once (or build it alike) before loads().")
        template = self._template_state(num_envs)
        cap = self._storage.max_size
        leaves = {}
        for s in self._specs:
            if self._td_mode:
                t = data.get(s.key if len(s.key) > 1 else s.key[0])
            else:
                t = data.get(_SINGLE if len(self._specs) == 1 else s.key[0])
            if self._storage.ndim == 2:
                t = t.transpose(0, 1).reshape((cap,) + tuple(t.shape[2:]))
            leaves[s.key] = t
        # storage
        if self._storage.kind == "device":
            tree = cv.leaves_to_tree(leaves, "loads")
            storage_state = frb.storages.DeviceStorageState(
                data=jax.tree_util.tree_map(jnp.asarray, tree))
        else:
            if not self._storage._maps:
                self._storage._host_init(self._specs, cap)
            for k, t in leaves.items():
                self._storage._maps[k][:] = _host_np(t)
            core_tree = self._core_tree(leaves, 1, "loads")
            storage_state = frb.storages.DeviceStorageState(
                data=jax.tree_util.tree_map(jnp.asarray, core_tree))
        with open(path / "writer" / "metadata.json") as f:
            wmeta = json.load(f)
        stored = int(meta["len"])
        parts = {}
        for name, st in (("sampler", template.sampler), ("writer", template.writer)):
            old, treedef = jax.tree_util.tree_flatten(st)
            if old and (path / name / "leaf0.memmap").exists():
                td = TensorDict.load_memmap(path / name)
                new = [jnp.asarray(td.get(f"leaf{i}").numpy().reshape(np.shape(o)))
                       for i, o in enumerate(old)]
                parts[name] = jax.tree_util.tree_unflatten(treedef, new)
            elif name == "writer":
                if not isinstance(st, frb.writers.RoundRobinState):
                    raise NotImplementedError(
                        f"loads: {type(self._writer).__name__} state cannot be rebuilt from a "
                        "TorchRL dump (only round-robin writers).")
                row = self._core.layout(template).row_capacity
                parts[name] = frb.writers.RoundRobinState(
                    cursor=jnp.int32(int(wmeta["cursor"]) % row),
                    filled=jnp.int32(min(stored, row)))
            else:
                parts[name] = st
        if "sampler" in parts and not (path / "sampler" / "leaf0.memmap").exists() and stored:
            # no core sampler state saved (a TorchRL dump): tell the sampler about every stored
            # item, as if they had just been added
            ctx = frb.Context(layout=self._core.layout(template), filled=parts["writer"].filled,
                              cursor=parts["writer"].cursor)
            n = int(ctx.size)
            env, t = np.divmod(np.arange(n), max(int(ctx.filled), 1))
            pos = jnp.asarray(env * ctx.layout.row_capacity + t, jnp.int32)
            items = self._core.get(frb.BufferState(storage_state, parts["writer"],
                                                   parts["sampler"], template.num_envs), pos)
            parts["sampler"] = self._core.sampler.on_add(parts["sampler"], pos,
                                                         jnp.ones((n,), bool), items, ctx)
        self._state = frb.BufferState(storage=storage_state, writer=parts["writer"],
                                      sampler=parts["sampler"], num_envs=template.num_envs)
        self._shared_reset()
        self._write_count = wmeta.get("write_count", self._len())
        with open(path / "buffer_metadata.json") as f:
            self._batch_size = json.load(f)["batch_size"]
        if (path / "transform.t").exists():
            self._transform.load_state_dict(torch.load(path / "transform.t"))

    save = dumps
    dump = dumps
    load = loads


class TensorDictReplayBuffer(ReplayBuffer):
    """TorchRL's ``TensorDictReplayBuffer``: TensorDict data; samples carry ``"index"`` (int64)
    and, with a prioritized sampler, ``"priority_weight"`` (float32). ``priority_key``
    (default ``"td_error"``) is read by :meth:`extend` and :meth:`update_tensordict_priority`."""

    _is_tensordict = True

    def __init__(self, *, priority_key="td_error", **kwargs):
        if kwargs.get("storage") is None:
            kwargs["storage"] = ListStorage(1000)
        super().__init__(**kwargs)
        self.priority_key = priority_key

    def _priority_vector(self, td: TensorDictBase) -> torch.Tensor | None:
        p = td.get(self.priority_key, None)
        if p is None:
            return None
        p = p.reshape(p.shape[0], -1) if p.ndim > 1 else p.reshape(-1, 1)
        red = getattr(self._sampler, "reduction", "max")
        return {"max": lambda x: x.amax(1), "min": lambda x: x.amin(1),
                "sum": lambda x: x.sum(1), "mean": lambda x: x.mean(1),
                "median": lambda x: x.median(1).values}[red](p.float())

    def extend(self, tensordicts, *, update_priority: bool | None = None) -> torch.Tensor:
        if not isinstance(tensordicts, TensorDictBase):
            raise ValueError(f"{type(self).__name__} only accepts TensorDictBase subclasses. "
                             "Please use a regular `ReplayBuffer` instead.")
        if len(self._transform):
            tensordicts = self._transform.inv(tensordicts)
        if tensordicts is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        index = self._extend_td(tensordicts)
        if self._storage.ndim == 1 and index.shape[:1] == tensordicts.shape[:1]:
            try:
                tensordicts.set("index", index.reshape(index.shape + (1,) * (
                    tensordicts.ndim - 1)).expand(tensordicts.shape))
            except RuntimeError:  # a locked TensorDict: TorchRL would fail; we skip
                pass
        if update_priority is None:
            update_priority = True
        if update_priority and self._sampler.prioritized and self._storage.ndim == 1:
            vec = self._priority_vector(tensordicts)
            if vec is not None:
                keep = index >= 0
                self.update_priority(index[keep], vec[keep])
        return index

    def _stores_index(self) -> bool:
        # TorchRL's TensorDictRoundRobinWriter writes "index" into the stored data
        return (self._storage.ndim == 1 and self._storage.kind != "list"
                and type(self._writer) is TensorDictRoundRobinWriter)

    def _extend_td(self, td: TensorDictBase) -> torch.Tensor:
        keys = {s.key for s in self._specs} if self._specs is not None else None
        stored = td.exclude("index") if "index" in td.keys() else td.copy()
        if self._stores_index() and (keys is None or ("index",) in keys):
            cursor = 0 if self._state is None else int(self._state.writer.cursor)
            n = td.shape[0]
            stored.set("index", (cursor + torch.arange(n)) % self._storage.max_size)
        elif keys is not None and ("index",) in keys and "index" in td.keys():
            stored = td
        return self._extend(stored)

    def add(self, data: TensorDictBase) -> int:
        if len(self._transform):
            data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        if self._storage.ndim == 1 and self._storage.kind != "list":
            index = int(self._extend_td(data.unsqueeze(0))[0])
        else:
            index = self._add(data)
        if self._sampler.prioritized and self.priority_key in data.keys(True):
            self.update_priority(torch.as_tensor([index]),
                                 self._priority_vector(data.unsqueeze(0)))
        return index

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Set priorities of ``data["index"]`` from ``data[priority_key]`` (reduced per item
        with the sampler's ``reduction``). No-op for non-prioritized samplers."""
        if not self._sampler.prioritized:
            return
        if data.ndim:
            priority = self._priority_vector(data)
        else:
            priority = torch.as_tensor(data.get(self.priority_key)).reshape(1, -1).amax(1)
        if priority is None:
            priority = torch.ones(data.shape[:1] or (1,))
        index = data.get("index")
        if self._storage.ndim == 1:
            while index.ndim > priority.ndim:
                index = index[..., 0]
        self.update_priority(index, priority)

    def sample(self, batch_size: int | None = None, return_info: bool = False,
               include_info: bool | None = None):
        bs = self._resolve_batch_size(batch_size)
        data, info = self._sample_raw(bs)
        if len(self._transform):
            data = self._transform.forward(data)
        if is_tensor_collection(data):
            for k, v in info.items():
                if v.ndim < data.ndim:
                    v = v.reshape(v.shape + (1,) * (data.ndim - v.ndim)).expand(data.shape)
                data.set(k, v)
        if return_info:
            return data, info
        return data


class PrioritizedReplayBuffer(ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer(alpha, beta, eps, ...)`` on the core's jittable
    prioritized sampler. ``sample(return_info=True)`` gives ``info["priority_weight"]``."""

    def __init__(self, *, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, storage=None, sampler=None, **kwargs):
        storage = ListStorage(1000) if storage is None else storage
        if sampler is None:
            sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, dtype)
        super().__init__(storage=storage, sampler=sampler, **kwargs)


class TensorDictPrioritizedReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer``: ``extend`` reads priorities from
    ``priority_key`` (default ``"td_error"``), samples carry ``"index"`` and
    ``"priority_weight"``; ``update_tensordict_priority(sample)`` after computing the loss."""

    def __init__(self, *, alpha: float, beta: float, priority_key="td_error",
                 eps: float = 1e-8, storage=None, reduction: str = "max", **kwargs):
        storage = ListStorage(1000) if storage is None else storage
        sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, reduction=reduction)
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, **kwargs)
