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
import os
import time
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
# replaying other processes' writes (shared memmap buffers) uses these batch sizes only
_REPLAY_CHUNKS = (4096, 512, 64, 8, 1)
# how long the creating process's extend waits for writes reserved before its own
_WAIT_FOR_WRITERS_S = 10.0


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
        self.shared = bool(shared)
        self._owner_pid = os.getpid()  # see _foreign
        self._synced = 0         # shared memmap buffers: items replayed into self._state
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
        """Items written so far (ndim=2: time steps, as TorchRL counts them), by every process
        for a shared memmap buffer."""
        cur = self._shared_cursor()
        if cur is not None and self._state is not None:
            return cur.count()
        return self._write_count

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

    def share(self, shared: bool = True):
        """TorchRL's ``share``: accepted for compatibility. Sharing needs no switch here: a
        buffer over a :class:`LazyMemmapStorage` with a round-robin writer can always be
        extended from other processes (see :meth:`_shared_cursor`); other buffers raise when
        written from another process. Returns self."""
        self.shared = bool(shared)
        return self

    def __len__(self) -> int:
        return self._len()

    def _len(self) -> int:
        cur = self._shared_cursor()
        if cur is not None and self._state is not None and self._foreign():
            # a worker counts from the shared counter (written or being written, as TorchRL's
            # shared length) without replaying: no JAX, so forked workers may call len()
            rc = self._core.layout(self._state).row_capacity
            return min(cur.count(), rc) * self._state.num_envs
        self._sync_shared()
        return self._stored_len()

    def _stored_len(self) -> int:
        """Items in this process's core state (no sync)."""
        if self._state is None:
            return 0
        return int(self._state.writer.filled) * self._state.num_envs

    # ------------------------------------------------------------------ processes
    # A buffer object is owned by the process that built it. Pickled to a worker (spawn,
    # forkserver, a queue) or inherited by fork it keeps that owner, so a worker can tell that
    # its copy is not the original: only writes that reach the shared files are allowed there.
    def _foreign(self) -> bool:
        return os.getpid() != self._owner_pid

    def _shared_cursor(self):
        """The storage's cross-process cursor when this buffer is shareable: a
        :class:`LazyMemmapStorage` (``ndim`` 1 or 2, initialized) with a round-robin writer,
        any sampler. Every process then reserves write positions from the shared counter and
        derives its core state (writer cursor, sampler bookkeeping: trajectory boundaries,
        priorities of new items) by replaying, in order, the items every process committed
        (:meth:`_sync_shared`)."""
        st = self._storage
        if st.kind != "memmap" or getattr(st, "_cursor", None) is None:
            return None
        if type(self._core.writer) is not frb.RoundRobinWriter:
            return None
        return st._cursor

    def _why_not_shared(self) -> str:
        st = self._storage
        if st.kind == "device":
            return (f"its {type(st).__name__} keeps the data in JAX arrays of that process, so "
                    "this copy's writes would never reach it")
        if st.kind == "list":
            return "its ListStorage is a Python list of that process"
        if self._state is None:
            return ("its LazyMemmapStorage was not initialized before it was shared, so each "
                    "process would create its own files; extend it once in the creating "
                    "process first (TorchRL shares instantiated storages only)")
        return (f"{type(self._writer).__name__} decides where items go from state held by that "
                "process (TorchRL refuses to share it too)")

    def _check_process(self, what: str) -> None:
        """Raise when ``what`` (a write) would be silently lost in this process's copy."""
        if not self._foreign():
            return
        name = f"{type(self).__name__}.{what}"
        if what in ("extend", "add"):
            if self._shared_cursor() is not None:
                return
            raise RuntimeError(
                f"{name}: this buffer was created in process {self._owner_pid} and is used in "
                f"process {os.getpid()}; {self._why_not_shared()}. To fill one buffer from "
                "several processes use LazyMemmapStorage with a round-robin writer (any "
                "sampler); otherwise build a separate buffer in this process.")
        if what in ("update_priority", "sample"):
            raise RuntimeError(
                f"{name}: this prioritized buffer was created in process {self._owner_pid}; "
                f"its priorities live there, and this copy (process {os.getpid()}) only sees "
                "the priorities new items start with, so this call would be lost or wrong. "
                "Workers extend the shared buffer; sample and update priorities in the creating "
                "process (TorchRL's TensorDictPrioritizedReplayBuffer(sync=False) design).")
        raise RuntimeError(
            f"{name}: this buffer was created in process {self._owner_pid}; call {what}() "
            f"there, not in process {os.getpid()} (the other processes' copies would not follow).")

    def _sync_shared(self) -> None:
        """Bring this process's core state up to the items every process committed: replay
        items ``[synced, committed)`` in order through the core's ``add`` (only the keys the
        sampler reads come from the memmaps), so trajectory boundaries and priorities of new
        items are those a single process would have after the same writes."""
        cur = self._shared_cursor()
        if cur is None or self._state is None:
            return
        count = cur.count()
        if count == self._synced:
            return
        rc = self._core.layout(self._state).row_capacity
        if count < self._synced:
            # emptied or reloaded by another process: rebuild from a ring-aligned start
            self._state = self._reinit_state()
            self._synced = max(0, count - rc) // rc * rc
        end = cur.committed(self._synced, count)
        add, _, _ = _jitted(self._core)
        start = self._synced
        while start < end:
            # a few fixed chunk sizes: one compilation each, whatever the workers wrote
            size = next(c for c in _REPLAY_CHUNKS if c <= end - start)
            tree = self._replay_tree(np.arange(start, start + size) % rc, rc)
            _, _, self._state = add(self._state, tree)
            start += size
        self._synced = end

    def _replay_tree(self, t: np.ndarray, rc: int):
        """The core items for ring positions ``t`` along time, read back from the memmaps
        (only the leaves the core keeps: see :meth:`_core_tree`)."""
        if self._storage.ndim == 1:
            flat, lead = t, (t.shape[0],)
        else:
            n = self._state.num_envs
            flat = (np.arange(n)[:, None] * rc + t[None, :]).reshape(-1)
            lead = (n, t.shape[0])
        needed = set(self._sampler.needed_keys() + self._writer.needed_keys())
        leaves = {}
        for s in self._specs:
            if s.key in needed:
                arr = np.asarray(self._storage._maps[s.key][flat])
                leaves[s.key] = cv.numpy_to_tensor(arr.reshape(lead + s.shape), s.dtype)
        tree = cv.leaves_to_tree(leaves, "extend") if leaves else {}
        tree[_DUMMY] = np.zeros(lead, np.uint8)
        return tree

    def _shared_reset(self):
        """After the owner replaced the whole state (loads, empty, load_state_dict): the
        shared counter and commit marks say exactly the items this state holds."""
        cur = self._shared_cursor()
        if cur is None:
            return
        if self._state is None:
            cur.reset(0)
            self._synced = 0
            return
        rc = self._core.layout(self._state).row_capacity
        w = self._state.writer
        filled, cursor = int(w.filled), int(w.cursor)
        self._synced = filled if filled < rc else rc + cursor
        cur.reset(self._synced)

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
        self._synced = 0
        self._storage._host_init(self._specs, self._storage.max_size,
                                 self._core.layout(self._state).row_capacity)

    def _init_from_data(self, data):
        """TensorStorage(storage): the buffer starts full of ``data`` (TorchRL's behaviour)."""
        mode, treedef, leaves = self._leaves_of(data, "TensorStorage")
        n_lead = self._storage.ndim
        self._ensure_init(mode, treedef, leaves, n_lead)
        self._state = self._core.init_from_data(self._core_tree(leaves, n_lead, "TensorStorage"))
        self._write_count = int(self._state.writer.filled)

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

    def _extend(self, data, index_key: bool = False) -> torch.Tensor:
        """Write ``data``. ``index_key``: also store each item's storage index under
        ``"index"`` (TorchRL's TensorDictRoundRobinWriter does), computed from the position the
        writer gives it."""
        self._check_process("extend")
        if self._storage.kind == "list":
            return self._extend_list(data)
        where = f"{type(self).__name__}.extend"
        mode, treedef, leaves = self._leaves_of(data, where)
        n_lead = self._storage.ndim
        if index_key:  # placeholder, so that the stored specs include it from the first write
            leaves[("index",)] = torch.zeros(next(iter(leaves.values())).shape[:n_lead],
                                             dtype=torch.int64)
        self._ensure_init(mode, treedef, leaves, n_lead)
        want = {s.key: s for s in self._specs}
        if set(leaves) != set(want):
            raise KeyError(f"{where}: keys {sorted(leaves)} differ from the "
                           f"stored keys {sorted(want)} (missing {sorted(set(want) - set(leaves))}"
                           f", unexpected {sorted(set(leaves) - set(want))}).")
        for k, v in leaves.items():
            if tuple(v.shape[n_lead:]) != want[k].shape:
                raise ValueError(f"{where}: leaf {k!r} has item shape "
                                 f"{tuple(v.shape[n_lead:])}, expected {want[k].shape}.")
        lead = tuple(next(iter(leaves.values())).shape[:n_lead])
        if n_lead == 2 and lead[0] != self._state.num_envs:
            raise ValueError(f"{where}: the data holds {lead[0]} envs, the storage "
                             f"{self._state.num_envs} (from the first write).")
        cur = self._shared_cursor()
        if cur is not None:
            return self._extend_shared(cur, leaves, want, index_key, where)
        if index_key:  # TorchRL's stored "index": the position along time
            rc = self._core.layout(self._state).row_capacity
            t = (int(self._state.writer.cursor) + torch.arange(lead[-1])) % rc
            leaves[("index",)] = t.expand(lead).clone()
        tree = self._core_tree(leaves, n_lead, where)
        add, _, _ = _jitted(self._core)
        positions, mask, self._state = add(self._state, tree)
        positions, mask = np.asarray(positions), np.asarray(mask)
        n = int(np.prod(positions.shape))
        self._write_count += int(positions.shape[-1])  # items, or time steps (ndim=2)
        if self._storage.kind == "memmap":
            flat_pos = positions.reshape(-1)[mask.reshape(-1)]
            sel = mask.reshape(-1)
            self._storage._host_set(flat_pos, {
                k: _host_np(v).reshape((n,) + want[k].shape)[sel] for k, v in leaves.items()})
        return self._positions_to_index(positions, mask)

    def _extend_shared(self, cur, leaves, want, index_key, where) -> torch.Tensor:
        """Extend a shared memmap buffer: reserve ring positions from the cross-process
        counter, write the memmaps, commit, then bring the core state up to date (directly when
        no other process wrote since this one last synced, else by replaying)."""
        ndim = self._storage.ndim
        rc = self._core.layout(self._state).row_capacity
        first = next(iter(leaves.values()))
        steps = int(first.shape[ndim - 1])          # items (ndim=1) or time steps (ndim=2)
        start = cur.reserve(steps)
        t = (start + np.arange(steps)) % rc
        keep = np.arange(steps) >= steps - rc      # a call larger than the ring keeps its tail
        if index_key:
            leaves[("index",)] = torch.from_numpy(t.astype(np.int64)).expand(
                first.shape[:ndim]).clone()
        if ndim == 1:
            positions, mask = t, keep
            host = {k: _host_np(v)[keep] for k, v in leaves.items()}
            flat = t[keep]
        else:
            n = self._state.num_envs
            positions = np.arange(n)[:, None] * rc + t[None, :]
            mask = np.broadcast_to(keep[None, :], positions.shape)
            flat = positions[:, keep].reshape(-1)
            host = {k: _host_np(v)[:, keep].reshape((-1,) + want[k].shape)
                    for k, v in leaves.items()}
        self._storage._host_set(flat, host)
        cur.commit(start, steps)
        self._write_count += steps
        if self._foreign():
            # a worker only writes: its core state catches up when it reads. So a forked
            # worker runs no JAX code to extend (JAX is not fork-safe; torch and numpy are)
            return self._positions_to_index(positions, mask)
        if start == self._synced:
            add, _, _ = _jitted(self._core)
            _, _, self._state = add(self._state, self._core_tree(leaves, ndim, where))
            self._synced = start + steps
        else:
            # other processes reserved before us: let their writes land (they are memmap
            # copies), so that this process's items are in its state when extend returns
            # (rb[index], update_priority on them); a writer stuck past the deadline leaves
            # them for a later sync
            deadline = time.monotonic() + _WAIT_FOR_WRITERS_S
            while cur.committed(self._synced, start + steps) < start + steps and \
                    time.monotonic() < deadline:
                time.sleep(1e-3)
        self._sync_shared()
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

    def _add(self, data, index_key: bool = False):
        if self._storage.kind == "list":
            return int(self._extend([data])[0])
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
                return self._extend(batch, index_key)
            finally:
                self._dim_extend = saved
        return int(self._extend(batch, index_key)[0])

    # ------------------------------------------------------------------ sampling
    def _seed(self) -> np.uint32:
        """A seed for the JAX key, drawn from torch's generator (so torch.manual_seed or
        ``generator=`` make sampling reproducible)."""
        return np.uint32(torch.randint(0, 2 ** 31 - 1, (1,), generator=self._rng).item())

    def _resolve_batch_size(self, batch_size):
        # every sample() starts here: refuse first what this process must not do
        if self._sampler.prioritized:
            self._check_process("sample")
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
        """(data, info) before transforms, as TorchRL's ``_sample`` gives them.

        ``info["index"]``: int64 ``[B]`` storage positions; a tuple of ``[B]`` tensors, one per
        storage dim (``(t, env)`` for ``ndim=2``, ``(position,)`` for slice samplers), where
        TorchRL's samplers give a tuple. Prioritized samplers add ``"priority_weight"`` (and
        ``"_weight"``). Slice samplers with a ``truncated_key`` add that key, its sibling
        ``done`` (stored done OR the marker) and ``terminated`` (stored, or False), bool
        ``[B, 1]``, True at the last step of each slice; the data itself is the stored data.
        """
        if self._sampler.prioritized:
            self._check_process("sample")
        self._sync_shared()
        if self._state is None or self._stored_len() == 0:
            raise RuntimeError("Cannot sample from an empty replay buffer (0 items stored); "
                               "extend it first.")
        _, sample, _ = _jitted(self._core)
        state = self._sampler.state_for(self._core, self._state, batch_size)
        s, sampler_state = sample(state, self._seed(), batch_size)
        if state is self._state:  # a state converted for this batch size is not kept
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
            rc = self._core.layout(self._state).row_capacity
            info["index"] = (cv.to_index_tensor(flat_idx % rc), cv.to_index_tensor(flat_idx // rc))
        elif self._sampler.slices:
            info["index"] = (cv.to_index_tensor(flat_idx),)
        else:
            info["index"] = cv.to_index_tensor(flat_idx)
        if self._sampler.prioritized:
            w = torch.from_numpy(np.array(weights.reshape(-1)[sel], np.float32, copy=True))
            # TorchRL 0.14 names it "priority_weight"; earlier releases (and code written for
            # them) read "_weight". Both keys hold the same tensor.
            info["priority_weight"] = w
            info["_weight"] = w
        if self._storage.kind == "list":
            return self._collate(self._storage._host_get(flat_idx)), info
        tree = self._gather_tree(s.data, flat_idx, sel, indices.ndim)
        if self._sampler.slices and self._sampler.truncated_key is not None:
            info.update(self._slice_markers(tree, mask, sel, n))
        return self._from_tree(tree, (n,)), info

    def _slice_markers(self, tree, mask, sel, n) -> dict:
        """TorchRL's slice-end entries: truncated at each slice's last valid step, done =
        stored done | truncated, terminated = stored terminated (or False)."""
        nxt = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
        last = (mask & ~nxt).reshape(-1)[sel]
        truncated = torch.from_numpy(np.ascontiguousarray(last)).reshape(n, 1)
        tk = self._sampler.truncated_key
        stored = {sp.key: sp for sp in self._specs}

        def raw(key):
            if key not in stored:
                return None
            return cv.numpy_to_tensor(_get_nested(tree, key), stored[key].dtype).bool()

        done_key, term_key = tk[:-1] + ("done",), tk[:-1] + ("terminated",)
        done = raw(done_key)
        if done is None:
            done = truncated.clone()
        else:
            done = done | truncated.reshape((n,) + (1,) * (done.ndim - 1))
        terminated = raw(term_key)
        if terminated is None:
            terminated = torch.zeros_like(truncated)
        out = {tk: truncated, done_key: done, term_key: terminated}
        return {k if len(k) > 1 else k[0]: v for k, v in out.items()}

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

    def _gather_tree(self, core_data, flat_idx, sel, lead_nd):
        """The stored items at ``flat_idx`` as a nested dict of numpy arrays ``[n, ...]``, as
        stored: a slice sampler's core ``finalize`` marks slice ends in ``core_data``, TorchRL
        returns the stored values and puts the marks in ``info`` (:meth:`_slice_markers`)."""
        if self._storage.kind == "device":
            tree = jax.tree_util.tree_map(
                lambda x: np.asarray(x).reshape((-1,) + x.shape[lead_nd:])[sel], core_data)
            if self._sampler.slices and self._sampler.truncated_key is not None:
                tk = self._sampler.truncated_key
                stored = self._state.storage.data
                for key in (tk, tk[:-1] + ("done",)):
                    if any(sp.key == key for sp in self._specs):
                        node = tree
                        for kk in key[:-1]:
                            node = node[kk]
                        node[key[-1]] = np.asarray(_get_nested(stored, key))[flat_idx]
            return tree
        tree = {}
        for k, v in self._storage._host_get(flat_idx).items():
            node = tree
            for kk in k[:-1]:
                node = node.setdefault(kk, {})
            node[k[-1]] = v
        return tree

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
        """Set priorities at ``index`` (int64 ``[B]`` or ``[B, 1]``; ndim=2: ``[B, 2]`` or a
        tuple of ``(t, env)``, as ``sample`` gives them). Non-prioritized samplers: no-op."""
        if self._sampler.prioritized:
            self._check_process("update_priority")
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
        self._sync_shared()
        if self._state is None:
            return False
        bs = batch_size or self._batch_size or 1
        state = self._sampler.state_for(self._core, self._state, bs)
        return bool(self._core.sampler.can_sample(state.sampler, self._core.context(state), bs))

    # ------------------------------------------------------------------ reading
    def _positions_of(self, index, storage_order: bool = False) -> np.ndarray:
        """Flat storage positions for ``index``, shaped like the result's batch.

        The stored items are seen as TorchRL shows them: ``[len]`` (ndim=1); ndim=2
        ``[num_envs, filled]`` with ``dim_extend=1`` (TorchRL's default for ndim=2) and in
        storage order ``[filled, num_envs]`` with ``dim_extend=0`` or ``storage_order``; an
        int, slice, bool mask or integer array indexes the first axis. A tuple ``(t, env)`` of
        index tensors (``info["index"]`` of ``sample``) picks single elements of an ndim=2
        storage."""
        n = self._stored_len()
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if self._storage.ndim == 1:
            view = np.arange(n)
        else:
            rc = self._core.layout(self._state).row_capacity
            envs, filled = self._state.num_envs, int(self._state.writer.filled)
            if isinstance(index, tuple) and len(index) == 2:
                t, env = (_as_np_index(i).astype(np.int64) for i in index)
                if t.size and (t.min() < 0 or t.max() >= filled or env.min() < 0
                               or env.max() >= envs):
                    raise IndexError(f"(t, env) index out of range for a [{filled}, {envs}] "
                                     "storage.")
                return env * rc + t
            view = np.arange(envs)[:, None] * rc + np.arange(filled)[None, :]
            if storage_order or self._dim_extend == 0:
                view = view.T
        if isinstance(index, tuple):
            raise IndexError(f"index {index!r}: a tuple index needs (t, env) tensors of an ndim=2 "
                             "storage.")
        if isinstance(index, slice):
            return view[index]
        idx = _as_np_index(index)
        if idx.dtype == np.bool_:
            return view[idx]
        idx = idx.astype(np.int64)
        m = view.shape[0]
        if idx.size and (idx.min() < -m or idx.max() >= m):
            raise IndexError(f"index out of range for {m} stored entries along the first axis.")
        return view[idx]

    def _read(self, index, storage_order: bool = False):
        """Stored items at ``index`` (see :meth:`_positions_of`), no transforms."""
        self._sync_shared()
        if self._state is None:
            raise IndexError("the buffer is empty")
        pos = self._positions_of(index, storage_order)
        flat = pos.reshape(-1)
        if self._storage.kind == "list":
            items = self._storage._host_get(flat)
            return items[0] if pos.ndim == 0 else self._collate(items)
        if self._storage.kind == "device":
            tree = _tree_np(self._core.get(self._state, jnp.asarray(flat, jnp.int32)))
        else:
            tree = self._gather_tree(None, flat, slice(None), 1)
        data = self._from_tree(tree, (flat.shape[0],))
        if self._td_mode:
            return data.reshape(pos.shape) if pos.ndim else data[0]
        return jax.tree_util.tree_map(lambda x: x.reshape(pos.shape + x.shape[1:]), data,
                                      is_leaf=lambda x: isinstance(x, torch.Tensor))

    def __getitem__(self, index):
        if isinstance(index, str) or (isinstance(index, tuple) and index and
                                      all(isinstance(k, str) for k in index)):
            return self[:][index]
        if isinstance(index, tuple) and len(index) == 1:
            return self[index[0]]
        data = self._read(index)
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
        self._check_process("empty")
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
        it (TorchRL semantics; hooks with ``shift``/``is_full`` attributes get them set). The
        hook belongs to the storage, as in TorchRL."""
        self._storage.register_save_hook(hook)

    def register_load_hook(self, hook: Callable[[Any], Any]):
        """``hook(data, out=None) -> data`` runs on the loaded data before it is stored."""
        self._storage.register_load_hook(hook)

    # ------------------------------------------------------------------ state_dict
    def _component_states(self):
        leaves, treedef = jax.tree_util.tree_flatten(self._state)
        return [torch.from_numpy(np.array(x, copy=True)) if np.asarray(x).dtype !=
                np.dtype(cv.ml_dtypes.bfloat16) else cv.numpy_to_tensor(x, torch.bfloat16)
                for x in leaves]

    def state_dict(self) -> dict:
        """Everything needed to restore this buffer with :meth:`load_state_dict` (the core state
        leaves as tensors, the leaf specs, host data, writer count, transforms, batch size)."""
        self._sync_shared()
        sd = {"_batch_size": self._batch_size, "_write_count": self.write_count,
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
        self._check_process("load_state_dict")
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
            if not self._storage._maps:
                self._storage._host_init(self._specs, self._storage.max_size,
                                         self._core.layout(template).row_capacity)
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
    def _storage_tree(self):
        """The whole storage as a nested dict of numpy arrays in TorchRL's storage order:
        ``[max_size, ...]``, ndim=2 ``[max_size // num_envs, num_envs, ...]``."""
        cap = self._storage.max_size
        if self._storage.kind == "device":
            tree = _tree_np(self._state.storage.data)
        else:
            tree = cv._nest({k: np.asarray(m) for k, m in self._storage._maps.items()})
        if self._storage.ndim == 2:
            n = self._state.num_envs
            tree = jax.tree_util.tree_map(
                lambda x: np.swapaxes(x.reshape((n, cap // n) + x.shape[1:]), 0, 1), tree)
        return tree

    def _storage_td(self) -> TensorDictBase:
        """The whole storage as a TensorDict, batch ``[max_size]`` (ndim=2: TorchRL's
        ``[max_size // num_envs, num_envs]``)."""
        cap = self._storage.max_size
        tree = self._storage_tree()
        n = self._state.num_envs
        td = TensorDict({}, batch_size=(cap // n, n) if self._storage.ndim == 2 else (cap,))
        for s in self._specs:
            td.set(s.key if len(s.key) > 1 else s.key[0],
                   cv.numpy_to_tensor(_get_nested(tree, s.key), s.dtype))
        return td

    def _storage_pytree(self):
        """Non-TensorDict data: the whole storage in the structure ``extend`` was given (what
        TorchRL's pytree checkpointer writes)."""
        tree = self._storage_tree()
        return cv.leaves_to_pytree(self._treedef, tree, self._specs)

    def _dump_storage(self, spath: Path) -> None:
        """``storage/`` of a dump: TorchRL's ``TensorStorageCheckpointer`` layout."""
        if self._storage.kind == "list":
            raise NotImplementedError(
                "ListStorage doesn't support serialization via `dumps` - `loads` API.")
        if self._state is None:
            raise RuntimeError("Cannot save a non-initialized storage.")
        self._sync_shared()
        n = self._stored_len()
        cursor = int(self._state.writer.cursor)
        # TorchRL gives save hooks the slot after the one written last and whether it is full
        shift = (cursor - 1) % self._core.layout(self._state).row_capacity + 1 if n else 0
        extra = {"frb_specs": [[list(s.key), list(s.shape), str(s.dtype)] for s in self._specs],
                 "frb_td_mode": self._td_mode, "frb_num_envs": self._state.num_envs}
        if self._td_mode:
            hooks = self._storage._save_hooks
            for hook in hooks:
                if hasattr(hook, "is_full"):
                    hook.is_full = n >= self._storage.max_size
                if hasattr(hook, "shift"):
                    hook.shift = shift
            spath.mkdir(exist_ok=True, parents=True)
            data = self._storage_td()
            for hook in hooks:
                data = hook(data, path=spath)
            if is_tensor_collection(data):
                data.memmap(spath, copy_existing=True)
            meta = {"metadata": {}, "is_pytree": False, "len": n}
        else:
            from functional_rb.adapters.serialization import STORAGE_METADATA, dump_storage
            spath.mkdir(exist_ok=True, parents=True)
            dump_storage(self._storage_pytree(), spath, length=n)
            with open(spath / STORAGE_METADATA) as f:
                meta = json.load(f)
        with open(spath / "storage_metadata.json", "w") as f:
            json.dump({**meta, **extra}, f)

    def _load_storage(self, spath: Path):
        """Read ``storage/`` of a dump (ours or TorchRL's) into a new core storage state.
        Returns ``(storage_state, template, stored)``: the template core state gives the
        writer/sampler structure, ``stored`` the number of items (TorchRL's ``len``)."""
        from functional_rb.adapters.serialization import load_storage
        loaded = load_storage(spath, load_hooks=self._storage._load_hooks)
        with open(spath / "storage_metadata.json") as f:
            meta = json.load(f)
        data, stored = loaded.data, int(meta["len"])
        num_envs = meta.get("frb_num_envs", 1)
        if "frb_specs" in meta:
            specs = tuple(cv.LeafSpec(tuple(k), tuple(s), getattr(torch, d.split(".")[-1]))
                          for k, s, d in meta["frb_specs"])
            td_mode = meta["frb_td_mode"]
        elif loaded.is_pytree:
            if self._specs is None or self._td_mode is not False:
                raise RuntimeError("Cannot fill a non-initialized pytree-based storage: extend "
                                   "the buffer once with data of the same structure before "
                                   "loads().")
            specs, td_mode = self._specs, False
        else:
            # a TorchRL dump: the specs come from the memmapped TensorDict itself
            if self._storage.ndim == 2:
                num_envs = data.batch_size[1]
            specs = cv.specs_of(cv.td_leaves(data, "loads"), self._storage.ndim)
            td_mode = True
        if td_mode is False and self._treedef is None:
            raise RuntimeError("Cannot fill a non-initialized pytree-based storage: extend the "
                               "buffer once (or build it alike) before loads().")
        self._specs, self._td_mode = specs, td_mode
        template = self._template_state(num_envs)
        cap = self._storage.max_size
        rc = cap // num_envs
        if td_mode:
            tensors = [data.get(s.key if len(s.key) > 1 else s.key[0]) for s in specs]
        elif isinstance(data, torch.Tensor):
            tensors = [data]
        else:
            from functional_rb.adapters.serialization import _tree_leaves
            named = dict(_tree_leaves(data))
            paths = [tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                     for path, _ in jax.tree_util.tree_flatten_with_path(
                         jax.tree_util.tree_unflatten(self._treedef, [0] * len(specs)))[0]]
            tensors = [named[p] for p in paths]
        filled = min(stored // max(num_envs, 1), rc)
        leaves = {}
        for s, t in zip(specs, tensors):
            if filled < rc:
                # rows past len are scratch (uninitialised memory in a TorchRL
                # LazyTensorStorage): never read them as data
                t = t.clone()
                t[filled:] = 0
            if self._storage.ndim == 2:
                t = t.transpose(0, 1).reshape((cap,) + tuple(t.shape[2:]))
            leaves[s.key] = t
        if self._storage.kind == "device":
            tree = cv.leaves_to_tree(leaves, "loads")
        else:
            if not self._storage._maps:
                self._storage._host_init(specs, cap, rc)
            for k, t in leaves.items():
                self._storage._maps[k][:] = _host_np(t)
            tree = self._core_tree(leaves, 1, "loads")
        storage_state = frb.storages.DeviceStorageState(
            data=jax.tree_util.tree_map(jnp.asarray, tree))
        return storage_state, template, stored

    def _finish_load(self, storage_state, template, writer_state, sampler_state) -> None:
        """Install a loaded state. ``sampler_state=None``: no sampler state was saved (a
        TorchRL dump, or a storage-only load); the sampler is told about every stored item,
        oldest first, as if they had just been added."""
        if sampler_state is None:
            sampler_state = template.sampler
            filled, cursor = int(writer_state.filled), int(writer_state.cursor)
            if filled:
                layout = self._core.layout(template)
                rc = layout.row_capacity
                start = cursor if filled == rc else 0
                t = (start + np.arange(filled)) % rc
                pos = (np.arange(template.num_envs)[:, None] * rc + t[None, :]).reshape(-1)
                pos = jnp.asarray(pos, jnp.int32)
                ctx = frb.Context(layout=layout, filled=writer_state.filled,
                                  cursor=writer_state.cursor)
                items = self._core.get(frb.BufferState(storage_state, writer_state,
                                                       sampler_state, template.num_envs), pos)
                sampler_state = self._core.sampler.on_add(
                    sampler_state, pos, jnp.ones(pos.shape, bool), items, ctx)
        self._state = frb.BufferState(storage=storage_state, writer=writer_state,
                                      sampler=sampler_state, num_envs=template.num_envs)
        self._shared_reset()

    def _writer_from_data(self, storage_state, template, stored, cursor=None):
        """The core writer state for ``stored`` items when none was saved: a ring at TorchRL's
        cursor, or a max-value writer's ranks read from the stored items."""
        rc = self._core.layout(template).row_capacity
        filled = min(stored // template.num_envs, rc)
        w = template.writer
        if isinstance(w, frb.writers.MaxValueState):
            ranks = np.full(w.ranks.shape, -np.inf, np.float32)
            if filled:
                items = self._core.get(frb.BufferState(storage_state, w, template.sampler,
                                                       template.num_envs),
                                       jnp.arange(filled, dtype=jnp.int32))
                ranks[:filled] = np.asarray(self._core.writer.item_ranks(items))
            return frb.writers.MaxValueState(cursor=jnp.int32(filled % rc),
                                             filled=jnp.int32(filled), ranks=jnp.asarray(ranks))
        if not isinstance(w, frb.writers.RoundRobinState):
            raise NotImplementedError(f"loads: {type(self._writer).__name__} state cannot be "
                                      "rebuilt from this dump.")
        cursor = filled % rc if cursor is None else int(cursor) % rc
        return frb.writers.RoundRobinState(cursor=jnp.int32(cursor), filled=jnp.int32(filled))

    def _load_storage_only(self, spath: Path) -> None:
        """TorchRL's ``storage.loads(path)``: the data of a storage dump; writer and sampler
        start from it (ring cursor after the stored items, new items' priorities)."""
        self._check_process("loads")
        storage_state, template, stored = self._load_storage(Path(spath).absolute())
        writer = self._writer_from_data(storage_state, template, stored)
        self._finish_load(storage_state, template, writer, None)
        self._write_count = int(writer.filled)

    def _component_dump(self, name: str, st, path: Path) -> None:
        """``sampler/`` or ``writer/``: the core state's leaves (``leaf<i>``), memmapped, plus
        the entries TorchRL's component of the same kind reads back."""
        p = path / name
        p.mkdir(exist_ok=True)
        entries = {f"leaf{i}": torch.from_numpy(np.array(x, copy=True)).reshape(-1)
                   if np.ndim(x) == 0 else torch.from_numpy(np.array(x, copy=True))
                   for i, x in enumerate(jax.tree_util.tree_leaves(st))}
        if name == "sampler" and self._sampler.without_replacement:
            entries.update(self._torchrl_wor_entries(st))
        if entries:
            TensorDict(entries, []).memmap(p, copy_existing=True)

    def _torchrl_wor_entries(self, st) -> dict:
        """TorchRL's ``SamplerWithoutReplacement`` state for our epoch: the storage indices
        still to draw. Slice samplers and ndim=2 storages number their draws differently in
        TorchRL: there ``len_storage=0`` makes TorchRL start a new epoch."""
        n = self._stored_len()
        plain = not self._sampler.slices and self._storage.ndim == 1
        if plain and int(st.epoch_size) and int(st.pos) < int(st.epoch_size):
            rest = np.asarray(st.perm)[int(st.pos):int(st.epoch_size)].astype(np.int64)
            len_storage = int(st.epoch_size)
        elif plain:  # epoch exhausted: TorchRL holds the next epoch's order already
            rest = np.arange(n, dtype=np.int64)
            if self._sampler.shuffle:
                rest = np.random.default_rng(int(st.epoch)).permutation(n).astype(np.int64)
            len_storage = n
        else:
            rest, len_storage = np.zeros((0,), np.int64), 0
        return {"len_storage": torch.tensor(len_storage, dtype=torch.int64),
                "_sample_list": torch.from_numpy(rest),
                "drop_last": torch.tensor(bool(getattr(self._sampler, "drop_last", False))),
                "_ran_out": torch.tensor(bool(self._ran_out))}

    def _torchrl_wor_state(self, td, template):
        """Our epoch state from TorchRL's ``SamplerWithoutReplacement`` entries (ndim=1, not
        slices; else None: a new epoch starts)."""
        if self._sampler.slices or self._storage.ndim != 1 or "_sample_list" not in td.keys():
            return None
        n, rest = int(td.get("len_storage")), td.get("_sample_list").numpy().astype(np.int64)
        st = template.sampler
        cap = int(np.shape(st.perm)[0])
        if not n or rest.size == 0 or rest.max() >= n:
            return None
        done = np.setdiff1d(np.arange(n), rest)
        perm = np.concatenate([done, rest, np.arange(n, cap)]).astype(np.int32)
        return dataclasses.replace(st, perm=jnp.asarray(perm), pos=jnp.int32(done.size),
                                   epoch_size=jnp.int32(n), epoch=jnp.int32(1))

    # TorchRL's PrioritizedSampler (and PrioritizedSliceSampler) dump: ``sumtree.memmap`` and
    # ``mintree.memmap``, float64 ``[max_capacity]`` raw files holding each item's
    # ``(priority + eps) ** alpha`` by TorchRL's flat index (never-written leaves: 0 in the sum
    # tree, the float type's largest finite value, the compiled min tree's identity, in the min
    # tree), and ``sampler_metadata.json`` (alpha, beta, eps, the raw max priority, capacity).
    _TORCHRL_PRIO_SCHEMA = 1

    def _torchrl_prio_positions(self, max_capacity: int) -> np.ndarray:
        """int64 ``[max_capacity]``: the core flat position of the item at each TorchRL flat
        index; -1 where no item is stored. TorchRL's ndim=2 storage is ``[time, env]``,
        raveled ``t * num_envs + env``; the core's position of ``(env, t)`` is
        ``env * rc + t``."""
        rc = self._core.layout(self._state).row_capacity
        f = np.arange(max_capacity, dtype=np.int64)
        if self._storage.ndim == 2:
            t, env = f // self._state.num_envs, f % self._state.num_envs
        else:
            t, env = f, np.zeros_like(f)
        held = t < min(int(self._state.writer.filled), rc)
        return np.where(held, env * rc + t, -1)

    def _torchrl_prio_files(self, st, path: Path) -> None:
        """Write TorchRL's prioritized-sampler files for the core sampler state ``st``."""
        cap_t = int(self._sampler.max_capacity)
        pos = self._torchrl_prio_positions(cap_t)
        values = np.asarray(st.prio if isinstance(st, frb.slices.PrioritizedSliceState)
                            else st.tree.leaves, np.float64)
        held = pos >= 0
        v = np.where(held, values[np.maximum(pos, 0)], 0.0)
        big = float(torch.finfo(getattr(self._sampler, "dtype", torch.float32)).max)
        np.asarray(v, np.float64).tofile(path / "sumtree.memmap")
        np.where(held, v, big).astype(np.float64).tofile(path / "mintree.memmap")
        meta = {"_alpha": float(self._sampler.alpha), "_beta": float(self._sampler.beta),
                "_eps": float(self._sampler.eps),
                "_max_priority": [float(st.max_priority), None],
                "_max_capacity": float(cap_t), "_schema_version": self._TORCHRL_PRIO_SCHEMA}
        with open(path / "sampler_metadata.json", "w") as f:
            json.dump(meta, f)

    def _apply_torchrl_priorities(self, path: Path) -> None:
        """Install the priorities of TorchRL's prioritized-sampler files at ``path`` into the
        loaded state (whose sampler was rebuilt from the data, every item at the max
        priority). The stored values are taken as they are when alpha and eps match (bit for
        bit, float32); otherwise each is mapped back to its raw priority and re-weighted with
        this sampler's alpha and eps, as TorchRL does when alpha changes."""
        meta = json.loads((path / "sampler_metadata.json").read_text())
        cap_t = int(meta["_max_capacity"])
        if cap_t != int(self._sampler.max_capacity):
            raise RuntimeError(f"loads: the dumped prioritized sampler has max_capacity {cap_t}, "
                               f"this one {self._sampler.max_capacity}.")
        values = np.fromfile(path / "sumtree.memmap", dtype=np.float64, count=cap_t)
        if values.size != cap_t:
            raise RuntimeError(f"loads: {path / 'sumtree.memmap'} holds {values.size} values, "
                               f"expected {cap_t}.")
        st = self._state.sampler
        pos = self._torchrl_prio_positions(cap_t)
        held = pos >= 0
        pos, v = pos[held], values[held]
        alpha, eps = float(self._sampler.alpha), float(self._sampler.eps)
        a0, e0 = float(meta["_alpha"]), float(meta["_eps"])
        reweight = (a0, e0) != (alpha, eps)
        if reweight and a0 == 0 and alpha != 0:
            warnings.warn("loads: the dump was made with alpha=0, which stores 1.0 for every "
                          "item: the raw priorities cannot be recovered, so sampling stays "
                          "uniform until priorities are updated (TorchRL does the same).")
        with np.errstate(all="ignore"):
            if reweight and a0 != 0:
                raw = np.maximum(np.where(v > 0, v, 0.0) ** (1.0 / a0) - e0, 0.0)
                v = np.where(v > 0, (raw + eps) ** alpha, 0.0)
            v = np.where(np.isfinite(v) & (v > 0), v, 0.0).astype(np.float32)
        mp = (meta.get("_max_priority") or [None])[0]
        if meta.get("_schema_version", 0) < 1 and mp is not None and a0 != 0 and \
                getattr(self._sampler, "max_priority_within_buffer", False):
            # TorchRL's rule: such older payloads hold a transformed max; recompute it
            top = float(values.max(initial=0.0))
            mp = max(top ** (1.0 / a0) - e0, 0.0) if top > 0 else None
        max_priority = st.max_priority if mp is None or not np.isfinite(mp) else jnp.float32(mp)
        p, vj = jnp.asarray(pos, jnp.int32), jnp.asarray(v)
        if isinstance(st, frb.slices.PrioritizedSliceState):
            valid = st.valid[p]
            st = dataclasses.replace(
                st, prio=st.prio.at[p].set(vj),
                tree=frb.sum_tree.set(st.tree, p, jnp.where(valid, vj, 0.0), unique=True),
                max_priority=max_priority)
        else:
            st = dataclasses.replace(st, tree=frb.sum_tree.set(st.tree, p, vj, unique=True),
                                     max_priority=max_priority)
        self._state = dataclasses.replace(self._state, sampler=st)

    def _torchrl_writer_files(self, path: Path, metadata: dict) -> None:
        """TorchRL's ``TensorDictMaxValueWriter`` files: its heap of ``(rank, index)``."""
        w = self._state.writer
        if not isinstance(w, frb.writers.MaxValueState):
            return
        from tensordict import MemoryMappedTensor
        filled = int(w.filled)
        ranks = np.asarray(w.ranks)[:filled]
        order = np.argsort(ranks, kind="stable")  # ascending: a valid min-heap
        top = torch.tensor(np.stack([ranks[order], order.astype(np.float32)], -1)
                           if filled else np.zeros((0,), np.float32), dtype=torch.float32)
        file = path / "current_top_values.memmap"
        if file.exists():
            file.unlink()
        MemoryMappedTensor.from_tensor(top, filename=file)
        metadata.update(rank_key=list(self._writer.rank_key)
                        if len(self._writer.rank_key) > 1 else self._writer.rank_key[0],
                        dtype=str(top.dtype), shape=list(top.shape))

    def dumps(self, path) -> None:
        """Save to ``path`` in TorchRL's layout: ``storage/`` (a memmapped TensorDict of the
        whole storage + ``storage_metadata.json``; PyTree data in TorchRL's PyTree layout),
        ``sampler/``, ``writer/`` (``metadata.json``) and ``buffer_metadata.json``. Samplers
        and writers keep their exact core state and, where TorchRL has the same component, the
        entries TorchRL reads (SamplerWithoutReplacement's epoch, TensorDictMaxValueWriter's
        heap, a prioritized sampler's ``sumtree.memmap`` / ``mintree.memmap`` /
        ``sampler_metadata.json``)."""
        self._sync_shared()
        path = Path(path).absolute()
        self._dump_storage(path / "storage")
        self._component_dump("sampler", self._state.sampler, path)
        if self._sampler.prioritized:
            self._torchrl_prio_files(self._state.sampler, path / "sampler")
        self._component_dump("writer", self._state.writer, path)
        wmeta = {"cursor": int(self._state.writer.cursor), "write_count": self.write_count}
        self._torchrl_writer_files(path / "writer", wmeta)
        with open(path / "writer" / "metadata.json", "w") as f:
            json.dump(wmeta, f)
        with open(path / "buffer_metadata.json", "w") as f:
            json.dump({"batch_size": self._batch_size, "consume_after_n_samples": None}, f)
        tsd = self._transform.state_dict()
        if tsd:
            torch.save(tsd, path / "transform.t")

    def loads(self, path) -> None:
        """Restore what :meth:`dumps` (or TorchRL's ``dumps``) saved, into this buffer built with
        the same components."""
        self._check_process("loads")
        path = Path(path).absolute()
        storage_state, template, stored = self._load_storage(path / "storage")
        wpath = path / "writer" / "metadata.json"
        wmeta = json.loads(wpath.read_text()) if wpath.exists() else {}
        parts = {}
        for name, st in (("sampler", template.sampler), ("writer", template.writer)):
            old, treedef = jax.tree_util.tree_flatten(st)
            if old and (path / name / "leaf0.memmap").exists():
                td = TensorDict.load_memmap(path / name)
                new = [jnp.asarray(td.get(f"leaf{i}").numpy().reshape(np.shape(o)))
                       for i, o in enumerate(old)]
                parts[name] = jax.tree_util.tree_unflatten(treedef, new)
            elif name == "writer":
                parts[name] = self._writer_from_data(storage_state, template, stored,
                                                     wmeta.get("cursor"))
            elif old and (path / name / "meta.json").exists():
                parts[name] = self._torchrl_wor_state(TensorDict.load_memmap(path / name),
                                                      template)
            else:
                parts[name] = None if old else st
        self._finish_load(storage_state, template, parts["writer"], parts["sampler"])
        if parts["sampler"] is None and self._sampler.prioritized and \
                (path / "sampler" / "sampler_metadata.json").exists():
            self._apply_torchrl_priorities(path / "sampler")
        self._write_count = wmeta.get("write_count", int(self._state.writer.filled))
        bpath = path / "buffer_metadata.json"
        if bpath.exists():
            self._batch_size = json.loads(bpath.read_text())["batch_size"]
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
        # in a worker the creating process owns the priorities: the new items get the max
        # priority there (TorchRL's sync=False)
        if update_priority and self._sampler.prioritized and self._storage.ndim == 1 \
                and not self._foreign():
            vec = self._priority_vector(tensordicts)
            if vec is not None:
                keep = index >= 0
                self.update_priority(index[keep], vec[keep])
        return index

    def _stores_index(self) -> bool:
        # TorchRL's TensorDictRoundRobinWriter writes "index" (the position along time) into
        # the stored data
        return (self._storage.kind != "list"
                and type(self._writer) is TensorDictRoundRobinWriter)

    def _extend_td(self, td: TensorDictBase) -> torch.Tensor:
        keys = {s.key for s in self._specs} if self._specs is not None else None
        if self._stores_index() and (keys is None or ("index",) in keys):
            stored = td.exclude("index") if "index" in td.keys() else td
            return self._extend(stored, index_key=True)
        if keys is not None and ("index",) in keys and "index" in td.keys():
            return self._extend(td)
        return self._extend(td.exclude("index") if "index" in td.keys() else td)

    def add(self, data: TensorDictBase) -> int:
        if len(self._transform):
            data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        if self._storage.kind == "list":
            index = self._add(data)
        elif self._storage.ndim == 1:
            index = int(self._extend_td(data.unsqueeze(0))[0])
        else:
            # one vectorized step [num_envs]: a T=1 slice in the core layout
            saved, self._dim_extend = self._dim_extend, 1
            try:
                index = self._extend_td(data.unsqueeze(1))
            finally:
                self._dim_extend = saved
        if self._sampler.prioritized and self.priority_key in data.keys(True) \
                and not self._foreign():
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
                if k == "index" and isinstance(v, tuple):
                    v = torch.stack(v, -1)  # as TorchRL: [B, storage ndim]
                if v.ndim < data.ndim:
                    v = v.reshape(v.shape + (1,) * (data.ndim - v.ndim)).expand(data.shape)
                data.set(k, v)
        if return_info:
            return data, info
        return data


_SYNC_DOC = """``sync`` (TorchRL 0.14): accepted, both values behave alike. In one process the
    priorities follow every write (TorchRL's ``sync=True``). Shared across processes (a
    LazyMemmapStorage buffer handed to workers), workers only ``extend`` and the creating
    process owns the priorities, catching up on the workers' writes before it samples (TorchRL's
    ``sync=False`` design); ``sample`` / ``update_priority`` in a worker raise."""


def _check_sampler_device(cls, sampler_device, sampler):
    if sampler_device is None:
        return
    if sampler is not None:
        raise TypeError("sampler_device cannot be passed when sampler is provided.")
    if torch.device(sampler_device).type != "cpu":
        raise NotImplementedError(f"{cls}: sampler_device={sampler_device!r}: the priority tree "
                                  "is a JAX array on JAX's default device.")


class PrioritizedReplayBuffer(ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer(alpha, beta, eps, ...)`` on the core's jittable
    prioritized sampler. ``sample(return_info=True)`` gives ``info["priority_weight"]``.
    """

    def __init__(self, *, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, storage=None, sampler=None,
                 sampler_device=None, sync: bool = True, **kwargs):
        _check_sampler_device(type(self).__name__, sampler_device, sampler)
        storage = ListStorage(1000) if storage is None else storage
        if sampler is None:
            sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, dtype)
        super().__init__(storage=storage, sampler=sampler, **kwargs)
        self._sync = bool(sync)


class TensorDictPrioritizedReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer``: ``extend`` reads priorities from
    ``priority_key`` (default ``"td_error"``), samples carry ``"index"`` and
    ``"priority_weight"``; ``update_tensordict_priority(sample)`` after computing the loss.
    """

    def __init__(self, *, alpha: float, beta: float, priority_key="td_error",
                 eps: float = 1e-8, storage=None, reduction: str = "max",
                 sampler_device=None, sync: bool = True, **kwargs):
        _check_sampler_device(type(self).__name__, sampler_device, None)
        storage = ListStorage(1000) if storage is None else storage
        sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, reduction=reduction)
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, **kwargs)
        self._sync = bool(sync)


PrioritizedReplayBuffer.__doc__ += "\n    " + _SYNC_DOC
TensorDictPrioritizedReplayBuffer.__doc__ += "\n    " + _SYNC_DOC
