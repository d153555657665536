"""TorchRL's ``ReplayBuffer``, composed of a storage, a writer and a sampler that stand alone.

The buffer does what TorchRL's does and no more: ``extend`` asks the writer where the items go
(the writer writes them into the storage) and tells the sampler; ``sample`` asks the sampler for
indices, reads them from the storage, collates and transforms. Each component owns its state
and its on-disk format; the buffer adds the transforms, the batch size, the random generator
and the lock.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict, is_tensor_collection

from functional_rb.adapters import _data as D
from functional_rb.adapters._prefetch import Prefetcher
from functional_rb.adapters._transforms import TransformChain
from functional_rb.adapters.samplers import RandomSampler, Sampler
from functional_rb.adapters.storages import ListStorage, Storage
from functional_rb.adapters.writers import RoundRobinWriter, Writer

__all__ = ["ReplayBuffer"]


def _component(obj, base: type, default: Callable, name: str, adapter: str):
    """A storage / sampler / writer from what the user passed (an object, a factory, None)."""
    if obj is None:
        obj = default()
    elif not isinstance(obj, base) and callable(obj) and not hasattr(obj, "sample") and \
            not hasattr(obj, "extend") and not hasattr(obj, "get"):
        obj = obj()
    if isinstance(obj, base):
        return obj
    kind = f"{type(obj).__module__}.{type(obj).__name__}"
    hint = (f" This is TorchRL's own class: use functional_rb.adapters.{type(obj).__name__} "
            "(the same name and arguments) with the functional_rb buffers."
            if type(obj).__module__.startswith("torchrl") else "")
    raise TypeError(f"{adapter}: {name} must be a functional_rb.adapters {base.__name__} (or a "
                    f"callable returning one), got {kind}.{hint}")


def _ready(method):
    """Build the components on first use when the buffer was made with ``delayed_init``."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not self._initialized:
            self._init()
        return method(self, *args, **kwargs)
    return wrapper


class ReplayBuffer:
    """TorchRL's ``ReplayBuffer`` (same keyword arguments, methods and behaviour).

    Keyword Args:
      storage: a storage or a callable making one (default ``ListStorage(1000)``).
      sampler: default :class:`~functional_rb.adapters.RandomSampler`.
      writer: default :class:`~functional_rb.adapters.RoundRobinWriter`.
      collate_fn: merges what the storage returns (default: the storage's own).
      pin_memory: pin sampled tensors. prefetch: batches sampled ahead in a thread pool.
      transform / transform_factory: applied to samples (inverse on writes).
      batch_size: default sample size. dim_extend: the data dim ``extend`` runs along
        (default ``storage.ndim - 1``). checkpointer: the storage's on-disk format.
      generator: a ``torch.Generator`` for sampling (default: torch's global one).
      shared: the buffer is handed to other processes. delayed_init: build the components at
        first use (default True with ``transform_factory``).
    """

    _is_tensordict = False
    _default_writer = RoundRobinWriter

    def __init__(self, *, storage=None, sampler=None, writer=None, collate_fn=None,
                 pin_memory: bool = False, prefetch: int | None = None, transform=None,
                 transform_factory=None, batch_size: int | None = None,
                 dim_extend: int | None = None, checkpointer=None, generator=None,
                 consume_after_n_samples: int | None = None, sample_unit=None,
                 shared: bool = False, compilable: bool | None = None,
                 delayed_init: bool | None = None, service_backend: str = "direct",
                 service_backend_options=None, transport: str = "auto",
                 transport_options=None):
        name = type(self).__name__
        if service_backend != "direct" or transport not in ("auto", "direct"):
            raise NotImplementedError(f"{name}: service_backend={service_backend!r} / transport="
                                      f"{transport!r}: only the in-process ('direct') buffer is "
                                      "provided; share a LazyMemmapStorage buffer with workers.")
        if service_backend_options or transport_options:
            raise ValueError(f"{name}: transport options are only valid for a remote buffer.")
        if sample_unit is not None:
            raise NotImplementedError(f"{name}: sample_unit is not supported; sample slices with "
                                      "SliceSampler instead.")
        if consume_after_n_samples is not None:
            raise NotImplementedError(f"{name}: consume_after_n_samples is not supported.")
        if transform is not None and transform_factory is not None:
            raise TypeError("transform and transform_factory are mutually exclusive.")
        if batch_size is None and prefetch:
            raise ValueError("Dynamic batch-size specification is incompatible with "
                             "multithreaded sampling: pass batch_size with prefetch.")
        if shared and prefetch:
            raise ValueError("Cannot share prefetched replay buffers. Pass prefetch=0 or "
                             "shared=False.")
        if dim_extend is not None and dim_extend < 0:
            raise ValueError("dim_extend must be a positive value.")
        self._init_args = dict(storage=storage, sampler=sampler, writer=writer,
                               collate_fn=collate_fn, transform=transform,
                               transform_factory=transform_factory, checkpointer=checkpointer,
                               generator=generator, compilable=compilable)
        self._batch_size = batch_size
        self._dim_extend = dim_extend
        self._pin_memory = pin_memory
        self._prefetcher = Prefetcher(prefetch) if prefetch else None
        self._warned_bs = False
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()
        self._seen = 0  # shared storages: steps (every process's) the sampler has been told of
        self._initialized = False
        self.shared = bool(shared)
        if delayed_init is None:
            delayed_init = transform_factory is not None
        if not delayed_init:
            self._init()

    def _init(self) -> None:
        a, name = self._init_args, type(self).__name__
        self._storage = _component(a["storage"], Storage, lambda: ListStorage(1000), "storage",
                                   name)
        self._sampler = _component(a["sampler"], Sampler, RandomSampler, "sampler", name)
        self._writer = _component(a["writer"], Writer, self._default_writer, "writer", name)
        self._storage.attach(self)
        self._writer.register_storage(self._storage)
        self._collate_fn = a["collate_fn"] or self._storage.default_collate
        transform = a["transform_factory"]() if a["transform_factory"] else a["transform"]
        self._transform = TransformChain()
        if transform is not None:
            for t in (transform if isinstance(transform, TransformChain) else [transform]):
                self._transform.append(t)
        if self._batch_size is None and getattr(self._sampler, "drop_last", False):
            raise ValueError("Samplers with drop_last=True must work with a predictable "
                             "batch-size. Please pass the batch-size to the ReplayBuffer "
                             "constructor.")
        if self._dim_extend is None:
            self._dim_extend = self._storage.ndim - 1
        if a["checkpointer"] is not None:
            self._storage.checkpointer = a["checkpointer"]
        self._initialized = True
        self.set_rng(a["generator"])
        if self.shared:
            self._transform.share_memory()
        n = len(self._storage)
        if n:  # a storage given full (TensorStorage): its items start at the default priority
            index = torch.arange(n)
            if self._storage.ndim > 1:
                index = torch.stack(torch.unravel_index(index, tuple(self._storage.shape)), -1)
            self._sampler.mark_update(index, storage=self._storage)
            self._seen = self._storage.len_along_dim0
        self._init_args = None

    # ------------------------------------------------------------------ components
    @property
    def initialized(self) -> bool:
        return self._initialized

    storage = property(_ready(lambda self: self._storage))
    sampler = property(_ready(lambda self: self._sampler))
    writer = property(_ready(lambda self: self._writer))
    transform = property(_ready(lambda self: self._transform))

    @property
    def batch_size(self):
        return self._batch_size

    @property
    def dim_extend(self) -> int:
        return self._dim_extend

    @property
    @_ready
    def write_count(self) -> int:
        return self._writer.write_count

    @_ready
    def set_rng(self, generator) -> None:
        self._rng = generator
        for c in (self._storage, self._sampler, self._writer):
            c.rng = generator

    @_ready
    def set_storage(self, storage, collate_fn=None):
        prev, self._storage = self._storage, storage
        storage.attach(self)
        self._collate_fn = collate_fn or storage.default_collate
        return prev

    @_ready
    def set_writer(self, writer):
        prev, self._writer = self._writer, writer
        writer.register_storage(self._storage)
        return prev

    @_ready
    def set_sampler(self, sampler):
        prev, self._sampler = self._sampler, sampler
        return prev

    def share(self, shared: bool = True):
        self.shared = bool(shared)
        if shared and self._initialized:
            self._transform.share_memory()
        return self

    @_ready
    def __len__(self) -> int:
        return len(self._storage)

    def __repr__(self):
        if not self._initialized:
            return f"{type(self).__name__}(<not initialized>, batch_size={self._batch_size})"
        return (f"{type(self).__name__}(\n    storage={self._storage!r},\n    sampler="
                f"{self._sampler!r},\n    writer={self._writer!r},\n    batch_size="
                f"{self._batch_size})")

    def stats(self) -> dict:
        """A cheap snapshot: size, write_count, prefetch queue, capacity and utilization."""
        if not self._initialized:
            storage = self._init_args["storage"]
            out = {"size": 0, "write_count": 0, "prefetch_queue_size": 0, "initialized": False}
            cap = getattr(storage, "max_size", None)
            if isinstance(cap, int):
                out.update(capacity=cap, utilization=0.0)
            return out
        with self._lock:
            size, cap = len(self), self._storage.max_size
            out = {"size": int(size), "write_count": int(self._writer.write_count),
                   "prefetch_queue_size": len(self._prefetcher or ()), "initialized": True}
        out.update(capacity=int(cap), utilization=float(size) / cap if cap else 0.0)
        return out

    # ------------------------------------------------------------------ writing
    def _foreign(self) -> bool:
        """Whether this copy runs in another process than the one that built the buffer."""
        return os.getpid() != self._owner_pid

    @_ready
    def add(self, data) -> int:
        """Add one item; returns its index."""
        if len(self._transform):
            tc = is_tensor_collection(data)
            data = self._transform.inv(data.unsqueeze(-1) if tc else data)
            data = data.squeeze(-1) if tc and data is not None else data
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._add(data)

    def _add(self, data):
        with self._lock:
            index = self._writer.add(data)
            self._tell_sampler(index)
        return index

    @_ready
    def extend(self, data, *, update_priority: bool | None = None) -> torch.Tensor:
        """Add a batch (its leading dim, or ``dim_extend``); inverse transforms run first.
        Returns the indices written. A top-level list is a list of items."""
        if update_priority is not None:
            raise NotImplementedError("update_priority is not supported in this class; see "
                                      "TensorDictReplayBuffer.extend.")
        if len(self._transform):
            data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._extend(data)

    def _extend(self, data):
        with self._lock:
            if self._dim_extend > 0:
                data = D.transpose(data, self._dim_extend)
            index = self._writer.extend(data)
            self._tell_sampler(index)
        return index

    def _tell_sampler(self, index) -> None:
        if self._storage.committed(self._seen) is not None:
            self._catch_up(own_write=True)  # every process's steps, in reservation order
        elif not self._foreign():
            self._sampler.extend(index, storage=self._storage)

    def _catch_up(self, own_write: bool = False) -> None:
        """Tell the sampler about the steps every process committed to a shared storage since
        it was last told, in ring order (a range larger than the ring: its last ``rows``)."""
        got = self._storage.committed(self._seen)
        if got is None or self._foreign() or got[1] <= got[0]:
            return
        start, end = got
        rows = self._storage.max_size_along_dim0()
        start = max(start, end - rows)
        if not own_write:
            self._storage.touched()  # other processes changed the data this process reads
        index = self._writer.replicate_index((start + torch.arange(end - start)) % rows)
        self._sampler.mark_update(index, storage=self._storage)
        self._sampler.extend(index, storage=self._storage)
        self._seen = end

    def mark_update(self, index) -> None:
        """Items at ``index`` changed (the storage tells its attached buffers)."""
        if not self._foreign():
            self._sampler.mark_update(index, storage=self._storage)

    @_ready
    def update_priority(self, index, priority) -> None:
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        priority = torch.as_tensor(priority)
        if self._dim_extend > 0 and priority.ndim > 1:
            priority = D.transpose(priority, self._dim_extend).flatten()
        with self._lock:
            self._sampler.update_priority(index, priority, storage=self._storage)

    # ------------------------------------------------------------------ sampling
    def _resolve_batch_size(self, batch_size):
        if batch_size is not None and self._batch_size is not None and \
                batch_size != self._batch_size and not self._warned_bs:
            self._warned_bs = True
            warnings.warn(f"Got conflicting batch_sizes in constructor ({self._batch_size}) and "
                          f"`sample` ({batch_size}). The batch-size provided to the sample "
                          "method will prevail.", stacklevel=3)
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError("batch_size not specified. You can specify the batch_size when "
                               "constructing the replay buffer, or pass it to the sample "
                               "method.")
        return int(batch_size)

    @_ready
    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A batch: the stored structure with leading dim ``batch_size``; ``return_info``:
        also the sampler's info (``"index"``, and e.g. ``"priority_weight"``)."""
        bs = self._resolve_batch_size(batch_size)
        if self._prefetcher is not None and bs == self._batch_size:
            data, info = self._prefetcher.next(functools.partial(self._sample, bs),
                                               self._sampler)
        else:
            data, info = self._sample(bs)
        return (data, info) if return_info else data

    def _sample(self, batch_size: int):
        with self._lock:
            self._catch_up()
            index, info = self._sampler.sample(self._storage, batch_size)
            info["index"] = index
            if self._writer.tracks_generations:
                info["index_generation"] = self._writer.generations_of(index)
            data = self._storage.get(index)
        if not isinstance(index, int):
            data = self._collate_fn(data)
        if self._pin_memory and torch.cuda.is_available():
            data = D.tree_map(lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x,
                              data)
        if len(self._transform):
            data = self._transform(data)
        return data, info

    def _prefetch_reset(self) -> None:
        """Drop the batches drawn ahead (the buffer was replaced or emptied)."""
        if self._prefetcher is not None:
            self._prefetcher.invalidate()

    @_ready
    def can_sample(self, batch_size: int | None = None) -> bool:
        batch_size = self._batch_size if batch_size is None else batch_size
        if batch_size is None:
            raise RuntimeError("batch_size not specified. Configure it on the replay buffer or "
                               "pass it to can_sample().")
        with self._lock:
            self._catch_up()
            return bool(self._sampler.can_sample(self._storage, batch_size))

    @_ready
    def __iter__(self):
        if self._batch_size is None:
            raise RuntimeError("Cannot iterate over the replay buffer. Batch_size was not "
                               "specified during construction of the replay buffer.")
        self._sampler.ran_out = False
        while not self._sampler.ran_out:
            yield self.sample()

    # ------------------------------------------------------------------ reading in place
    def _storage_index(self, index):
        if self._dim_extend > 0:
            return (slice(None),) * self._dim_extend + (index,)
        return index

    @_ready
    def __getitem__(self, index):
        if isinstance(index, str) or (isinstance(index, tuple) and index and
                                      all(isinstance(k, str) for k in index)):
            return self[:][index]
        if isinstance(index, tuple):
            return self[index[0]] if len(index) == 1 else self[:][index]
        with self._lock:
            data = self._storage[self._storage_index(D.as_long_index(index))]
        if self._dim_extend > 0:
            data = D.transpose(data, self._dim_extend)
        if not isinstance(index, int):
            data = self._collate_fn(data)
        if len(self._transform):
            data = self._transform(data)
        return data

    @_ready
    def __setitem__(self, index, value) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and
                                      all(isinstance(k, str) for k in index)):
            self[:][index] = value  # writes through the storage's view
            self._storage.touched()
            return
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if len(self._transform):
            value = self._transform.inv(value)
        if self._dim_extend > 0:
            value = D.transpose(value, self._dim_extend)
        with self._lock:
            self._storage[self._storage_index(D.as_long_index(index))] = value

    def read_all_in_order(self, end: int | None = None):
        """The stored items in storage order (``rb[:end]``)."""
        return self[:] if end is None else self[:end]

    @_ready
    def write_all(self, data, end: int | None = None) -> None:
        """Write ``data`` back in storage order (``rb[:end] = data``)."""
        if end is None:
            if len(self) == self._storage.max_size:
                self[:] = data
                return
            end = data.shape[0] if is_tensor_collection(data) else len(data)
        self[:end] = data

    def _edit_all(self, edit) -> "ReplayBuffer":
        with self._lock:
            edit(self._storage[:])
            self._storage.touched()
        return self

    @_ready
    def set_at_(self, key, value, index):
        return self._edit_all(lambda td: td.set_at_(key, value, D.as_long_index(index)))

    @_ready
    def set_(self, key, value):
        return self._edit_all(lambda td: td.set_(key, value))

    @_ready
    def update_(self, input_dict_or_td, clone: bool = False, *, keys_to_update=None):
        return self._edit_all(lambda td: td.update_(input_dict_or_td, clone=clone,
                                                    keys_to_update=keys_to_update))

    # ------------------------------------------------------------------ transforms
    @_ready
    def append_transform(self, transform, *, invert: bool = False):
        self._transform.append(transform, invert=invert)
        if self.shared:
            self._transform.share_memory()
        return self

    @_ready
    def insert_transform(self, index: int, transform, *, invert: bool = False):
        self._transform.insert(index, transform, invert=invert)
        return self

    # ------------------------------------------------------------------ lifecycle
    @_ready
    def empty(self, empty_write_count: bool = True) -> None:
        """Remove every item (the storage keeps its allocation, as in TorchRL)."""
        with self._lock:
            self._prefetch_reset()
            self._writer.empty(empty_write_count=empty_write_count)
            self._sampler.empty()
            self._storage.empty()
            self._seen = 0

    @_ready
    def register_save_hook(self, hook) -> None:
        self._storage.register_save_hook(hook)

    @_ready
    def register_load_hook(self, hook) -> None:
        self._storage.register_load_hook(hook)

    @_ready
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            self._catch_up()
            return {"_storage": self._storage.state_dict(),
                    "_sampler": self._sampler.state_dict(),
                    "_writer": self._writer.state_dict(),
                    "_transforms": self._transform.state_dict(),
                    "_batch_size": self._batch_size,
                    "_rng": None if self._rng is None else (self._rng.get_state().clone(),
                                                            str(self._rng.device))}

    @_ready
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self._lock:
            self._prefetch_reset()
            self._storage.load_state_dict(state_dict["_storage"])
            self._sampler.load_state_dict(state_dict["_sampler"])
            self._writer.load_state_dict(state_dict["_writer"])
            self._transform.load_state_dict(state_dict["_transforms"])
            self._batch_size = state_dict["_batch_size"]
            self._restore_rng(state_dict.get("_rng"))
            self._seen = self._storage.committed(0)[1] \
                if self._storage.committed(0) is not None else 0

    def _restore_rng(self, rng) -> None:
        if rng is None:
            return
        if isinstance(rng, tuple):
            state, device = rng
        else:
            state, device = rng, "cpu"
        gen = torch.Generator(device=device)
        gen.set_state(state)
        self.set_rng(gen)

    @_ready
    def dumps(self, path) -> None:
        """Save in TorchRL's layout: ``storage/``, ``sampler/``, ``writer/``, ``rng_state/``,
        ``transform.t``, ``buffer_metadata.json``. TorchRL loads it and we load TorchRL's."""
        path = Path(path).absolute()
        with self._lock:
            self._catch_up()
            path.mkdir(exist_ok=True)
            self._storage.dumps(path / "storage")
            self._sampler.dumps(path / "sampler")
            self._writer.dumps(path / "writer")
            if self._rng is not None:
                TensorDict(rng_state=self._rng.get_state().clone(),
                           device=self._rng.device).memmap(path / "rng_state",
                                                           copy_existing=True)
            tsd = self._transform.state_dict()
            if tsd:
                torch.save(tsd, path / "transform.t")
            with open(path / "buffer_metadata.json", "w") as f:
                json.dump({"batch_size": self._batch_size, "consume_after_n_samples": None}, f)

    @_ready
    def loads(self, path) -> None:
        """Load what :meth:`dumps` (ours or TorchRL's) saved at ``path``."""
        path = Path(path).absolute()
        with self._lock:
            self._prefetch_reset()
            self._storage.loads(path / "storage")
            self._sampler.loads(path / "sampler")
            self._writer.loads(path / "writer")
            if (path / "rng_state").exists():
                td = TensorDict.load_memmap(path / "rng_state")
                self._restore_rng((td["rng_state"].clone(), str(td.device or "cpu")))
            if (path / "transform.t").exists():
                self._transform.load_state_dict(torch.load(path / "transform.t"))
            meta = json.loads((path / "buffer_metadata.json").read_text())
            self._batch_size = meta["batch_size"]
            got = self._storage.committed(0)
            self._seen = 0 if got is None else got[1]

    save = dump = dumps
    load = loads

    # ------------------------------------------------------------------ processes
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_lock")
        rng = state.get("_rng")
        if rng is not None:
            state["_rng"] = (rng.get_state().clone(), str(rng.device))
        state["_prefetcher"] = None if self._prefetcher is None else self._prefetcher.size
        return state

    def __setstate__(self, state):
        rng = state.pop("_rng", None)
        pref = state.pop("_prefetcher", None)
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._prefetcher = Prefetcher(pref) if pref else None
        self._rng = None
        if rng is not None:
            self._restore_rng(rng)
