"""TorchRL's ``ReplayBuffer``, composed of a storage, a writer and a sampler that stand alone.

The buffer does what TorchRL's does and no more: ``extend`` asks the writer where the items go
(the writer writes them into the storage) and tells the sampler; ``sample`` asks the sampler for
indices, reads them from the storage, collates and transforms. Each component owns its state
and its on-disk format; the buffer adds the transforms, the batch size, the random generator
and the lock.

What ``extend`` and ``sample`` run is here, in the sampler's module and in the storage's (with
a storage shared by processes, also ``_processes.Follower``, which tells the sampler about the
steps other processes wrote). The buffer's other methods are grouped by role in modules of their own and
bound by name in the class body: in-place reads and edits (:mod:`._in_place`), conditional
updates (:mod:`.conditional`), saving and loading (:mod:`._saving`), the prefetch queue
(:mod:`._prefetch`), epochs (:mod:`._iteration`), other processes (:mod:`._processes`, which
also redraws the rows another process was writing, when a shared storage reports some), and
what a constructor returns (:mod:`._construction`: the buffer, or the service a
``service_backend=`` asks for).
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
from functional_rb.adapters.replay_buffers import (
    _construction,
    _in_place,
    _iteration,
    _prefetch,
    _processes,
    _saving,
)
from functional_rb.adapters.replay_buffers import conditional as _conditional
from functional_rb.adapters.replay_buffers._prefetch import Prefetcher
from functional_rb.adapters.replay_buffers._processes import Follower, without_torn_rows
from functional_rb.adapters.samplers._stale_priorities import StalePriorities
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, empty_storage_error
from functional_rb.adapters.samplers.consuming import write_reusing_slots
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


class ReplayBuffer:
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
      service_backend: ``"direct"`` (this process) or ``"ray"`` (the constructor returns a
        :class:`~functional_rb.adapters.RayReplayBuffer`, a service hosting this buffer).
      service_backend_options: Ray's options (``ray_init_config``, ``remote_config``).
      transport: how a service's payloads travel (``"auto"``, ``"ray"`` or
        ``"distributed"``).
      transport_options: the transport's options.
      use_ray_service: TorchRL's deprecated spelling of ``service_backend="ray"``.

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
    # TorchRL's service API: a buffer in this process is its own client
    service_backend = "direct"

    def __new__(cls, *args, **kwargs):
        # the service a service_backend= asks for, else a buffer of this process (whose
        # backend arguments service_for checked: __init__ does not look at them again)
        service = _construction.service_for(cls, args, kwargs)
        return object.__new__(cls) if service is None else service

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
        use_ray_service: bool = False,
    ):
        del service_backend, service_backend_options, transport, transport_options
        del use_ray_service  # (all read by __new__)
        _construction.check_args(
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
        _processes.register(self)  # (a forked child rebuilds the lock)
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
        parts = _construction.build(
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
    def _inverse(self, data):
        """The inverse transforms of ``data``, which start from a shallow copy (TorchRL's
        ``Compose.inv``): what the buffer writes into it (``"index"``, priorities read back)
        never reaches the caller's TensorDict, and no tensor is copied."""
        if len(self._transform):
            return self._transform.inv(data)
        return data.copy() if is_tensor_collection(data) else data

    @_ready
    def add(self, data) -> int:
        """Add one item; returns its index."""
        if len(self._transform):
            tc = is_tensor_collection(data)
            data = self._transform.inv(data.unsqueeze(-1) if tc else data)
            data = data.squeeze(-1) if tc and data is not None else data
        else:
            data = self._inverse(data)
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
                self._tell_sampler(index)
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
        data = self._inverse(data)
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
                self._tell_sampler(index)
            if self._sampler.prioritized:
                self._stale.on_write(index, self._storage)
        return index

    def _tell_sampler(self, index) -> None:
        """The sampler learns of the steps this process wrote at ``index`` and, with a storage
        shared by processes, of every step committed since it was last told, in reservation
        order (:class:`~functional_rb.adapters.replay_buffers._processes.Follower`)."""
        got = self._storage.committed(self._follower.seen)
        if got is not None:
            self._follower.catch_up(got, self._storage, self._sampler, self._writer, own_write=True)
        elif self._follower.owner == os.getpid():  # (a copy in another process only writes)
            self._sampler.extend(index, storage=self._storage)

    def _catch_up(self) -> None:
        """With a storage shared by processes: the sampler learns of the steps other processes
        committed since it was last told."""
        got = self._storage.committed(self._follower.seen)
        if got is not None:
            self._follower.catch_up(got, self._storage, self._sampler, self._writer)

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
                index, priority = self._stale.fresh(index, priority, self._storage)
                if index is None:
                    return
            self._sampler.update_priority(index, priority, storage=self._storage)

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
        if self._pending:
            self.wait_updates()
        if self._prefetcher is not None and bs == self._batch_size:
            data, info = self._prefetcher.next(functools.partial(self._sample, bs), self._sampler)
        else:
            data, info = self._sample(bs)
        return (data, info) if return_info else data

    def _sample(self, batch_size: int):
        if getattr(self, "_forked_from_jax", False):
            _processes.refuse_jax_after_fork(self)
        with self._lock:
            self._catch_up()
            draw = functools.partial(self._draw, batch_size)
            index, info = draw()
            data, torn = self._storage.read_checked(index)
            if torn is not None:  # rows another process was writing: put back
                drawn = (index, info, data, torn)
                index, info, data = without_torn_rows(
                    drawn, draw, self._storage, self._sampler, self._rng, type(self).__name__
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
            name, consume = type(self).__name__, self.consume_after_n_samples
            raise empty_storage_error(name, self._storage, self._sampler, consume) from None
        if self._sample_unit is not None:
            index, info = self._sample_unit.expand(index, info, self._storage)
        return index, info

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
            self._catch_up()
            return bool(self._sampler.can_sample(self._storage, batch_size))

    # epochs: iter(rb) and TorchRL's next() (see _iteration)
    __iter__ = _ready(_iteration.iterate)

    @_ready
    def next(self):
        """The next batch of an epoch of ``iter(self)`` (TorchRL's ``next``, for a caller that
        cannot hold an iterator); None at the end of the epoch, and the following call starts
        a new one (see ``_iteration``)."""
        return _iteration.next_batch(self)

    _iterator = None  # next()'s epoch in progress

    # TorchRL's query(predicate=None, *, trajectory_key=None): see functional_rb.adapters.query
    query = _ready(query_buffer)

    @property
    def lock(self):
        """The buffer's re-entrant lock: held by every read and write of its components."""
        return self._lock

    # ------------------------------------------------------------------ in-place (_in_place)
    __getitem__ = _ready(_in_place.getitem)
    __setitem__ = _ready(_in_place.setitem)
    read_all_in_order = _in_place.read_all_in_order
    set_ = _in_place.set_
    set_at_ = _in_place.set_at_
    update_ = _in_place.update_
    write_all = _in_place.write_all

    # ------------------------------------------------------------------ conditional updates
    submit_update_if_present = _conditional.submit_update_if_present
    update_if_present = _conditional.update_if_present
    wait_updates = _conditional.wait_updates

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

    # ------------------------------------------------------------------ saving and loading
    # (TorchRL's layout and atomic dumps: see _saving)
    dump_config = _saving.dump_config
    dumps = _saving.dumps
    load_state_dict = _saving.load_state_dict
    loads = _saving.loads
    register_load_hook = _saving.register_load_hook
    register_save_hook = _saving.register_save_hook
    state_dict = _saving.state_dict

    def save(self, *args, **kwargs):
        return self.dumps(*args, **kwargs)

    dump = save

    def load(self, *args, **kwargs):
        return self.loads(*args, **kwargs)

    # ------------------------------------------------------------------ prefetching
    @property
    def prefetch(self) -> int:
        """The number of batches sampled ahead (0: no prefetching)."""
        return _prefetch.prefetch(self)

    def prefetch_settled(self, *, clear: bool = False):
        """A context in which no batch is drawn ahead: it waits for the draws in flight and
        yields their results (``clear``: drops them). Take ``self.lock`` inside it."""
        return _prefetch.prefetch_settled(self, clear=clear)

    def restore_prefetch(
        self, state, *, clone: bool = True, where: str = "load_state_dict"
    ) -> None:
        """Queue a checkpoint's prefetched batches (TorchRL's ``_prefetch_state``)."""
        _prefetch.restore_prefetch(self, state, clone=clone, where=where)

    _prefetch_queue = property(_prefetch.queue)  # (TorchRL's private names, which its tests
    _futures_lock = property(_prefetch.queue_lock)  # read)
    _prefetch_cap = prefetch

    # ------------------------------------------------------------------ processes
    share = _processes.share
    refresh = _processes.refresh

    def synchronize(self, *, updates: bool = True) -> None:
        """Wait for queued conditional updates (``updates``), and bring the sampler up to date
        with the steps other processes wrote to a shared storage."""
        _processes.synchronize(self, updates=updates)

    owner_pid = property(_processes.owner_pid)
    __reduce__ = _processes.reduce
    __getstate__ = _processes.getstate
    __setstate__ = _processes.setstate

    def mark_update(self, index) -> None:
        """Items at ``index`` changed (the storage tells its attached buffers)."""
        if self._follower.owner == os.getpid():  # (a copy in another process only writes)
            self._sampler.mark_update(index, storage=self._storage)

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

    # ------------------------------------------------------------------ service API
    # (TorchRL's; a buffer in this process is its own client)
    is_alive = property(lambda self: not getattr(self, "_shut", False))

    def client(self):
        return self

    def start(self):
        return self

    def shutdown(self, timeout=None) -> None:
        self._shut = True
