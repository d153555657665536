"""TorchRL's ``ReplayBuffer``, composed of a storage, a writer and a sampler that stand alone.

The buffer does what TorchRL's does and no more: ``extend`` asks the writer where the items go
(the writer writes them into the storage) and tells the sampler; ``sample`` asks the sampler for
indices, reads them from the storage, collates and transforms. Each component owns its state
and its on-disk format; the buffer adds the transforms, the batch size, the random generator
and the lock.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tensordict import is_tensor_collection

from functional_rb.adapters import errors
from functional_rb.adapters._utils import data as D
from functional_rb.adapters.query import query_buffer
from functional_rb.adapters.replay_buffers._buffer_io import Persistence
from functional_rb.adapters.replay_buffers._construction import ServiceDispatch, build, check_args
from functional_rb.adapters.replay_buffers._editing import DirectService, InPlace, set_multi
from functional_rb.adapters.replay_buffers._follower import Follower, Processes
from functional_rb.adapters.replay_buffers._prefetch import Prefetcher, Prefetching
from functional_rb.adapters.replay_buffers._transforms import shallow_copy
from functional_rb.adapters.replay_buffers._whole_rows import sample_whole
from functional_rb.adapters.samplers._stale_priorities import StalePriorities
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR
from functional_rb.adapters.samplers.consuming import write_reusing_slots
from functional_rb.adapters.samplers.random import RandomSampler, SamplerWithoutReplacement
from functional_rb.adapters.writers.round_robin import RoundRobinWriter

if TYPE_CHECKING:  # the annotations' types (read by type checkers and the API reference)
    from functional_rb.adapters.checkpointers.base import StorageCheckpointerBase
    from functional_rb.adapters.sample_units import SampleUnit
    from functional_rb.adapters.samplers.base import Sampler
    from functional_rb.adapters.storages.base import Storage
    from functional_rb.adapters.writers.base import Writer

__all__ = ["ReplayBuffer"]


def _ready(method):
    """Build the components on first use when the buffer was made with ``delayed_init``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not self._initialized:
            self._init()
        return method(self, *args, **kwargs)

    return wrapper


_TORCH_SAMPLERS = (RandomSampler, SamplerWithoutReplacement)  # (they run no JAX)
_FORKED_JAX = (
    "{name}.sample: this buffer was inherited by a process started with fork from one that ran "
    "JAX, and its {sampler} samples with JAX, which is not fork-safe (the call could wait for "
    "ever on threads the child does not have). Start the worker with "
    "multiprocessing.get_context('spawn') or get_context('forkserver') (a worker that only "
    "extends may use fork), or sample with RandomSampler / SamplerWithoutReplacement."
)


class ReplayBuffer(
    InPlace, Persistence, Prefetching, Processes, DirectService, metaclass=ServiceDispatch
):
    """TorchRL's ``ReplayBuffer`` (same keyword arguments, methods and behaviour).

    Args:
      storage: a storage, or a callable making one (default ``ListStorage(1000)``).
      sampler: which items ``sample`` draws (default
        :class:`~functional_rb.adapters.RandomSampler`).
      writer: where ``extend`` puts new items (default
        :class:`~functional_rb.adapters.RoundRobinWriter`).
      collate_fn: merges the items the storage returns into a batch (default: the
        storage's own).
      pin_memory: pin the memory of sampled tensors.
      prefetch: how many batches a background thread samples ahead (None or 0: none).
      transform: applied to samples, and inverted on what ``extend`` writes.
      transform_factory: a callable making the transform (exclusive with ``transform``).
      batch_size: the default size of a ``sample``.
      dim_extend: the dim of the data ``extend`` runs along (default ``storage.ndim - 1``).
      checkpointer: the storage's on-disk format for ``dumps`` / ``loads``.
      generator: the ``torch.Generator`` every sampler draws from (default: torch's global
        one, and NumPy's for the prioritized samplers, as in TorchRL).
      consume_after_n_samples: an item is removed from the sampleable set after it was
        returned this many times (None: never).
      sample_unit: expands each drawn anchor into a unit of items
        (:class:`~functional_rb.adapters.SampleUnit`).
      shared: the buffer will be handed to other processes.
      compilable: TorchRL's flag for ``torch.compile``-able writers; accepted.
      delayed_init: build the storage, writer, sampler and transform at first use (default:
        True with ``transform_factory``).
      service_backend: ``"direct"`` (this process) or ``"ray"`` (a
        :class:`~functional_rb.adapters.RayReplayBuffer` hosting this buffer).
      service_backend_options: Ray's options (``ray_init_config``, ``remote_config``).
      transport: how a remote buffer's payloads travel (``"auto"``, ``"ray"`` or
        ``"distributed"``).
      transport_options: the transport's options.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
        >>> rb.extend(torch.arange(6))
        tensor([0, 1, 2, 3, 4, 5])
        >>> rb.sample().shape
        torch.Size([4])
    """

    _is_tensordict = False
    _default_writer = RoundRobinWriter

    def __init__(
        self,
        *,
        storage: Storage | Callable[[], Storage] | None = None,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        transform_factory: Callable[[], Callable] | None = None,
        batch_size: int | None = None,
        dim_extend: int | None = None,
        checkpointer: StorageCheckpointerBase | None = None,
        generator: torch.Generator | None = None,
        consume_after_n_samples: int | None = None,
        sample_unit: SampleUnit | None = None,
        shared: bool = False,
        compilable: bool | None = None,
        delayed_init: bool | None = None,
        service_backend: str = "direct",
        service_backend_options: dict | None = None,
        transport: str = "auto",
        transport_options: dict | None = None,
    ):
        check_args(
            type(self).__name__,
            service_backend,
            transport,
            service_backend_options or transport_options,
            sample_unit,
            consume_after_n_samples,
            prefetch,
            transform,
            transform_factory,
            batch_size,
            shared,
            dim_extend,
        )
        self._sample_unit = sample_unit
        self._init_args = dict(
            storage=storage,
            sampler=sampler,
            writer=writer,
            collate_fn=collate_fn,
            transform=transform,
            transform_factory=transform_factory,
            checkpointer=checkpointer,
            generator=generator,
            compilable=compilable,
            consume=consume_after_n_samples,
        )
        self._batch_size = batch_size
        self._dim_extend = dim_extend
        self._pin_memory = pin_memory
        self._prefetcher = Prefetcher(prefetch) if prefetch else None
        self._warned_bs = False
        self._lock = threading.RLock()
        self._register()  # (a forked child rebuilds the lock: see _follower)
        self._forked_from_jax = False  # inherited by fork from a process that ran JAX
        self._follower = Follower()  # what the sampler knows of a shared storage's writes
        self._stale = StalePriorities()  # writes and draws: delayed updates of rewritten slots
        self._updater, self._pending = None, []  # submit_update_if_present
        self._initialized = False
        self.shared = bool(shared)
        if delayed_init is None:
            delayed_init = transform_factory is not None
        if not delayed_init:
            self._init()

    def _init(self) -> None:
        a = self._init_args
        parts = build(
            a,
            type(self).__name__,
            self._default_writer,
            self._batch_size,
            prefetch=self._prefetcher is not None,
        )
        self._storage, self._sampler, self._writer = parts.storage, parts.sampler, parts.writer
        self._collate_fn, self._transform = parts.collate_fn, parts.transform
        self._storage.attach(self)
        if self._dim_extend is None:
            self._dim_extend = self._storage.ndim - 1
        self._sampler.bind(self._batch_size)
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
            self._follower.rebase(self._storage)
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

    @batch_size.setter
    def batch_size(self, value) -> None:
        self._batch_size = value

    @property
    def generator(self):
        """The ``torch.Generator`` sampling uses (None: torch's global one)."""
        return self._rng

    @property
    def sample_unit(self):
        return self._sample_unit

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

    @_ready
    def __len__(self) -> int:
        if self._sampler.reuses_slots:  # consumed items are gone
            return self._sampler.sampleable_count(self._storage, 1)
        return self._storage.committed_len()  # (less rows other processes are writing)

    @property
    def consume_after_n_samples(self):
        return self._sampler.max_sample_count if self._sampler.reuses_slots else None

    def __repr__(self):
        if not self._initialized:
            return f"{type(self).__name__}(<not initialized>, batch_size={self._batch_size})"
        return (
            f"{type(self).__name__}(\n    storage={self._storage!r},\n    sampler="
            f"{self._sampler!r},\n    writer={self._writer!r},\n    batch_size="
            f"{self._batch_size})"
        )

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
            out = {
                "size": int(size),
                "write_count": int(self._writer.write_count),
                "prefetch_queue_size": len(self._prefetcher or ()),
                "initialized": True,
            }
        out.update(capacity=int(cap), utilization=float(size) / cap if cap else 0.0)
        return out

    # ------------------------------------------------------------------ writing
    @_ready
    def add(self, data) -> int:
        """Add one item; returns its index."""
        if len(self._transform):
            tc = is_tensor_collection(data)
            data = self._transform.inv(data.unsqueeze(-1) if tc else data)
            data = data.squeeze(-1) if tc and data is not None else data
        else:
            data = shallow_copy(data)  # (see extend)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        if (
            is_tensor_collection(data)
            and data.ndim
            and os.environ.get("RL_WARNINGS", "1") not in ("0", "False", "false")
        ):
            warnings.warn(
                f"Using `add()` with a TensorDict that has batch_size="
                f"{data.batch_size}. Use `extend()` to add multiple elements, or "
                "`add()` with a single element (batch_size=torch.Size([])). Silence "
                "this warning with RL_WARNINGS=0.",
                stacklevel=2,
            )
        return self._add(data)

    def _add(self, data):
        with self._lock:
            if self._sampler.reuses_slots:
                index = write_reusing_slots(
                    self._sampler, self._writer, self._storage, data, single=True
                )
            else:
                index = self._writer.add(data)
                self._follower.written(self._storage, self._sampler, self._writer, index)
            if self._sampler.prioritized:
                self._stale.on_write(index, self._storage)
        return index

    @_ready
    def extend(self, data, *, update_priority: bool | None = None) -> torch.Tensor:
        """Add a batch (its leading dim, or ``dim_extend``); inverse transforms run first.
        Returns the indices written. A top-level list is a list of items."""
        if update_priority is not None:
            raise NotImplementedError(
                "update_priority is not supported in this class; see TensorDictReplayBuffer.extend."
            )
        # (a shallow copy without transforms too: a writer such as TensorDictRoundRobinWriter
        # writes "index" into what it is given, never into the caller's TensorDict)
        data = self._transform.inv(data) if len(self._transform) else shallow_copy(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._extend(data)

    def _extend(self, data):
        with self._lock:
            if self._dim_extend > 0:
                data = D.transpose(data, self._dim_extend)
            if self._sampler.reuses_slots:
                index = write_reusing_slots(self._sampler, self._writer, self._storage, data)
            else:
                index = self._writer.extend(data)
                self._follower.written(self._storage, self._sampler, self._writer, index)
            if self._sampler.prioritized:
                self._stale.on_write(index, self._storage)
        return index

    @_ready
    def update_priority(self, index, priority) -> None:
        """Set the priorities of ``index``. Entries whose slot was rewritten since the sample
        that drew it are dropped and counted (:attr:`dropped_priority_updates`; see
        ``functional_rb.adapters.samplers._stale_priorities``)."""
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        priority = torch.as_tensor(priority)
        if self._dim_extend > 0 and priority.ndim > 1:
            priority = D.transpose(priority, self._dim_extend).flatten()
        with self._lock:
            if self._sampler.prioritized:
                index, priority = self._fresh_entries(index, priority)
                if index is None:
                    return
            self._sampler.update_priority(index, priority, storage=self._storage)

    def _fresh_entries(self, index, priority):
        """``(index, priority)`` without the entries of rewritten slots (None: none left)."""
        keep = self._stale.keep(index, self._storage)
        if keep is None:
            return index, priority
        index = torch.as_tensor(index, dtype=torch.long)
        rows = (
            index.reshape(-1, index.shape[-1])
            if (self._storage.ndim > 1 and index.ndim > 1 and index.shape[-1] == self._storage.ndim)
            else index.reshape(-1)
        )
        if priority.numel() > 1:
            priority = priority.reshape(-1)[torch.from_numpy(keep)]
        if not keep.any():
            return None, None
        return rows[torch.from_numpy(keep)], priority

    @property
    def dropped_priority_updates(self) -> int:
        """Priority-update entries dropped so far because their slot was rewritten after the
        sample that drew it (prioritized samplers; cumulative)."""
        return self._stale.dropped

    # ------------------------------------------------------------------ sampling
    def _resolve_batch_size(self, batch_size):
        if (
            batch_size is not None
            and self._batch_size is not None
            and batch_size != self._batch_size
            and not self._warned_bs
        ):
            self._warned_bs = True
            warnings.warn(
                f"Got conflicting batch_sizes in constructor ({self._batch_size}) and "
                f"`sample` ({batch_size}). The batch-size provided to the sample "
                "method will prevail.",
                stacklevel=3,
            )
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError(
                "batch_size not specified. You can specify the batch_size when "
                "constructing the replay buffer, or pass it to the sample "
                "method."
            )
        return int(batch_size)

    @_ready
    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A batch: the stored structure with leading dim ``batch_size``; ``return_info``:
        also the sampler's info (``"index"``, and e.g. ``"priority_weight"``)."""
        bs = self._resolve_batch_size(batch_size)
        self.wait_updates()
        if self._prefetcher is not None and bs == self._batch_size:
            data, info = self._prefetcher.next(functools.partial(self._sample, bs), self._sampler)
        else:
            data, info = self._sample(bs)
        return (data, info) if return_info else data

    def _sample(self, batch_size: int):
        if getattr(self, "_forked_from_jax", False) and type(self._sampler) not in _TORCH_SAMPLERS:
            raise RuntimeError(
                _FORKED_JAX.format(name=type(self).__name__, sampler=type(self._sampler).__name__)
            )
        with self._lock:
            self._follower.catch_up(self._storage, self._sampler, self._writer)
            index, info, data = sample_whole(
                functools.partial(self._draw, batch_size),
                self._storage,
                self._sampler,
                self._rng,
                type(self).__name__,
            )
            info["index"] = index
            if self._sampler.prioritized:
                self._stale.on_draw(index, self._storage)
            if self._writer.tracks_generations:
                info["index_generation"] = self._writer.generations_of(index)
        if not isinstance(index, int):
            data = self._collate_fn(data)
        if self._pin_memory and torch.cuda.is_available():
            data = D.tree_map(lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x, data)
        if len(self._transform):
            data = self._transform(data)
        return data, info

    def _draw(self, batch_size: int):
        try:
            index, info = self._sampler.sample(self._storage, batch_size)
        except RuntimeError as e:
            if not str(e).startswith(EMPTY_STORAGE_ERROR):
                raise
            raise self._empty_error() from None
        if self._sample_unit is not None:
            index, info = self._sample_unit.expand(index, info, self._storage)
        return index, info

    def _empty_error(self) -> RuntimeError:
        """TorchRL's empty-storage error, saying which buffer and storage and what to do."""
        name, held = type(self).__name__, len(self._storage)
        what = f"its {type(self._storage).__name__}"
        if held and self._sampler.reuses_slots:
            why = (
                f"each of the {held} items {what} holds was consumed (sampled "
                f"consume_after_n_samples={self.consume_after_n_samples} times)."
            )
        else:
            why = f"{what} holds no items."
        return errors.torchrl_error(
            RuntimeError,
            EMPTY_STORAGE_ERROR,
            f"{name}.sample: the buffer is empty: {why} Call extend() or add() before "
            "sampling, or check len(buffer) > 0 (or buffer.can_sample(batch_size)) first.",
        )

    @_ready
    def can_sample(self, batch_size: int | None = None) -> bool:
        batch_size = self._batch_size if batch_size is None else batch_size
        if batch_size is None:
            raise errors.torchrl_error(
                RuntimeError,
                "batch_size not specified.",
                "Configure it on the replay buffer or pass it to can_sample().",
            )
        with self._lock:
            self._follower.catch_up(self._storage, self._sampler, self._writer)
            return bool(self._sampler.can_sample(self._storage, batch_size))

    @_ready
    def __iter__(self):
        if self._batch_size is None:
            raise RuntimeError(
                "Cannot iterate over the replay buffer. Batch_size was not "
                "specified during construction of the replay buffer."
            )
        self._sampler.ran_out = False
        # prefetched batches of the epoch are still served after the sampler ran out
        while not self._sampler.ran_out or len(self._prefetcher or ()):
            yield self.sample()

    _iterator = None  # next()'s epoch in progress

    @_ready
    def next(self):
        """The next batch of an epoch of ``iter(self)`` (TorchRL's ``next``: for code that
        cannot hold an iterator, such as a remote caller); None at the end of the epoch, and
        the following call starts a new one. A TensorDict comes back as a device-less copy, as
        TorchRL's does (its device test compares a ``torch.device`` with a string, which never
        holds), so that it travels to other processes without a device reference."""
        if self._iterator is None:
            self._iterator = iter(self)
        try:
            out = next(self._iterator)
        except StopIteration:
            self._iterator = None
            return None
        if is_tensor_collection(out) and out.device is not None:
            out = out.copy().clear_device_()
        return out

    # TorchRL's query(predicate=None, *, trajectory_key=None): see functional_rb.adapters.query
    query = _ready(query_buffer)

    # ------------------------------------------------------------------ reading in place
    def _storage_index(self, index):
        if self._dim_extend > 0:
            return (slice(None),) * self._dim_extend + (index,)
        return index

    @_ready
    def __getitem__(self, index):
        if isinstance(index, str) or (
            isinstance(index, tuple) and index and all(isinstance(k, str) for k in index)
        ):
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
        if isinstance(index, str) or (
            isinstance(index, tuple) and index and all(isinstance(k, str) for k in index)
        ):
            self[:][index] = value  # writes through the storage's view
            self._storage.touched()
            return
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if len(self._transform):
            value = self._transform.inv(value)
        if isinstance(index, tuple):
            with self._lock:
                return set_multi(self._storage, self._dim_extend, index, value, type(self).__name__)
        if self._dim_extend > 0:
            value = D.transpose(value, self._dim_extend)
        with self._lock:
            self._storage[self._storage_index(D.as_long_index(index))] = value

    @property
    def lock(self):
        """The buffer's re-entrant lock: held by every read and write of its components."""
        return self._lock

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
        if self.shared:
            self._transform.share_memory()
        return self

    # ------------------------------------------------------------------ lifecycle
    @_ready
    def empty(self, empty_write_count: bool = True) -> None:
        """Remove every item (the storage keeps its allocation, as in TorchRL)."""
        # (draws in flight take the lock: settle them first)
        with self.prefetch_settled(clear=True), self._lock:
            self._writer.empty(empty_write_count=empty_write_count)
            self._stale.on_empty()
            self._sampler.empty()
            self._storage.empty()
            self.refresh()
