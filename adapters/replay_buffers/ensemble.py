"""TorchRL's ``ReplayBufferEnsemble`` and ``ReplayBufferTrainer`` over the adapter buffers.

A :class:`ReplayBufferEnsemble` is a :class:`~functional_rb.adapters.ReplayBuffer` whose
storage, sampler and writer are ensembles of its members' (:class:`StorageEnsemble`,
:class:`SamplerEnsemble`, :class:`WriterEnsemble`). It is built, as TorchRL's, from member
buffers (``ReplayBufferEnsemble(rb0, rb1, p=...)``) or from those three components
(``ReplayBufferEnsemble(storages=..., samplers=..., writers=...)``, member buffers made over
them). Everything else follows from the components: sampling, ``state_dict`` (members under
``"0"``, ``"1"``, ...), ``dumps`` / ``loads`` (TorchRL's layout, ``storage/<i>``,
``sampler/<i>``, ``writer/<i>``).

A sample of ``batch_size`` items from ``num_buffer_sampled`` picks is ``[nb, batch_size //
nb]``: each pick's items are read from its member storage, transformed by that member's
transforms, collated by that member's ``collate_fn``, then the picks are stacked
(``collate_fn``) and the ensemble's own transform runs. TensorDict samples carry
``("index", "buffer_ids")`` and ``("index", "index")`` (int64 ``[nb, sub]``) and the members'
sampler infos; ``return_info=True`` also returns that info.

Writes go to the members (``ensemble[i].extend(data)``), or, with ``routing_key`` (a member
id per record) or ``routing_dim`` (a batch dim with one entry per member), through
``ensemble.extend``, which returns the member-local indices (and generations) per record;
``update_if_present`` routes conditional patches the same way, and ``end_streams`` closes
every member's stream (see :mod:`functional_rb.adapters.replay_buffers._routing`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensor_collection
from tensordict.utils import NestedKey, expand_right, unravel_key
from torch.utils._pytree import tree_map

from functional_rb.adapters import errors
from functional_rb.adapters._utils.ensemble import member_positions
from functional_rb.adapters.replay_buffers import _routing
from functional_rb.adapters.replay_buffers.base import ReplayBuffer
from functional_rb.adapters.samplers.ensemble import SamplerEnsemble
from functional_rb.adapters.storages.ensemble import StorageEnsemble
from functional_rb.adapters.writers.ensemble import WriterEnsemble

__all__ = ["ReplayBufferEnsemble", "ReplayBufferTrainer"]


def _stack_anything(samples):
    """TorchRL's default collate of the picks: TensorDicts stacked (lazily when their shapes
    differ), PyTrees of tensors leaf by leaf."""
    if is_tensor_collection(samples[0]):
        return LazyStackedTensorDict.maybe_dense_stack(samples)
    return tree_map(
        lambda *x: torch.stack(x),
        *samples,
        is_leaf=lambda x: isinstance(x, torch.Tensor) or is_tensor_collection(x),
    )


def _member_collate(rb: ReplayBuffer) -> Callable:
    # The buffer keeps the collate_fn it was given (or its storage's) as ``_collate_fn``, the
    # attribute TorchRL's ensemble reads too; ReplayBuffer offers no public accessor.
    return rb._collate_fn


def _not_torchrl(obj, what: str) -> None:
    if not isinstance(obj, ReplayBuffer):
        raise errors.not_an_adapter(
            "ReplayBufferEnsemble",
            what,
            "ReplayBuffer",
            obj,
            torchrl_fix="build it with functional_rb.adapters.{name} (same arguments).",
        )


def _components_from_buffers(rbs, p, sample_from_all, num_buffer_sampled):
    for i, rb in enumerate(rbs):
        _not_torchrl(rb, f"member {i}")
    storages = StorageEnsemble(*(rb.storage for rb in rbs), transforms=[rb.transform for rb in rbs])
    samplers = SamplerEnsemble(
        *(rb.sampler for rb in rbs),
        p=p,
        sample_from_all=sample_from_all,
        num_buffer_sampled=num_buffer_sampled,
    )
    return storages, samplers, WriterEnsemble(*(rb.writer for rb in rbs))


def _buffers_from_components(storages, samplers, writers, collate_fns):
    for arg, cls in (
        ("storages", StorageEnsemble),
        ("samplers", SamplerEnsemble),
        ("writers", WriterEnsemble),
    ):
        value = {"storages": storages, "samplers": samplers, "writers": writers}[arg]
        if not isinstance(value, cls):
            raise errors.not_an_adapter(
                "ReplayBufferEnsemble",
                f"without member buffers, {arg}=",
                cls.__name__,
                value,
                fix="Pass ReplayBufferEnsemble(rb0, rb1, ...) or all three ensembles.",
            )
    n = len(storages)
    if len(samplers) != n or len(writers) != n or len(collate_fns) != n:
        raise ValueError(
            f"ReplayBufferEnsemble: storages, samplers, writers and collate_fns "
            f"must have one entry per member, got {n}, {len(samplers)}, "
            f"{len(writers)} and {len(collate_fns)}."
        )
    transforms = storages.transforms or [None] * n
    return tuple(
        ReplayBuffer(
            storage=st,
            sampler=sm,
            writer=wr,
            transform=t,
            collate_fn=c,
            checkpointer=st.checkpointer,
        )
        for st, sm, wr, t, c in zip(
            storages.storages, samplers.samplers, writers.writers, transforms, collate_fns
        )
    )


class ReplayBufferEnsemble(ReplayBuffer):
    """Sample from several buffers at once (TorchRL's ``ReplayBufferEnsemble``).

    Args:
      *rbs: the member buffers (or, instead, ``storages``, ``samplers`` and ``writers``).
      storages: a :class:`~functional_rb.adapters.StorageEnsemble`, without member buffers.
      samplers: a :class:`~functional_rb.adapters.SamplerEnsemble`, without member buffers.
      writers: a :class:`~functional_rb.adapters.WriterEnsemble`, without member buffers.
      transform: the ensemble's transform, applied after the members'.
      batch_size: the default size of a ``sample``.
      collate_fn: stacks the members' picks into one batch.
      collate_fns: one per member (default: each storage's own).
      p: with member buffers, the members' relative weights, as in
        :class:`~functional_rb.adapters.SamplerEnsemble`.
      sample_from_all: with member buffers, every member once per ``sample``.
      num_buffer_sampled: with member buffers, member picks per ``sample``.
      routing_key: the entry naming each written record's member (routed writes).
      routing_dim: the dim of written data whose positions name the members (exclusive with
        ``routing_key``).
      generator: the ``torch.Generator`` the member picks and draws use.
      shared: the buffer will be handed to other processes.
      **kwargs: the other arguments of :class:`ReplayBuffer`.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import (LazyTensorStorage, ReplayBuffer,
        ...                                     ReplayBufferEnsemble)
        >>> a = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> b = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> index = a.extend(torch.zeros(4)); index = b.extend(torch.ones(4))
        >>> ensemble = ReplayBufferEnsemble(a, b, batch_size=4, sample_from_all=True)
        >>> len(ensemble.sample())  # one batch of 2 from each member
        2
    """

    _collate_fn_val = None

    # routed writes (routing_key / routing_dim): see _routing
    extend = _routing.extend
    add = _routing.add
    update_if_present = _routing.update_if_present
    end_streams = _routing.end_streams

    def __init__(
        self,
        *rbs: ReplayBuffer,
        storages: StorageEnsemble | None = None,
        samplers: SamplerEnsemble | None = None,
        writers: WriterEnsemble | None = None,
        transform: Callable | None = None,
        batch_size: int | None = None,
        collate_fn: Callable | None = None,
        collate_fns: Sequence[Callable] | None = None,
        p: Sequence[float] | torch.Tensor | str | None = None,
        sample_from_all: bool = False,
        num_buffer_sampled: int | None = None,
        routing_key: NestedKey | None = None,
        routing_dim: int | None = None,
        generator: torch.Generator | None = None,
        shared: bool = False,
        **kwargs,
    ):
        if routing_key is not None and routing_dim is not None:
            raise ValueError("routing_key and routing_dim are mutually exclusive.")
        if routing_dim is not None and (
            isinstance(routing_dim, bool) or not isinstance(routing_dim, int)
        ):
            raise TypeError(f"routing_dim must be an integer, got {routing_dim!r}.")
        if rbs:
            if storages is not None or samplers is not None or writers is not None:
                raise RuntimeError(
                    "ReplayBufferEnsemble: pass either member buffers or "
                    "storages= / samplers= / writers=, not both."
                )
            storages, samplers, writers = _components_from_buffers(
                rbs, p, sample_from_all, num_buffer_sampled
            )
            collate_fns = (
                [_member_collate(rb) for rb in rbs] if collate_fns is None else list(collate_fns)
            )
        else:
            if p is not None or sample_from_all or num_buffer_sampled is not None:
                raise ValueError(
                    "ReplayBufferEnsemble(storages=, samplers=, writers=): p, "
                    "sample_from_all and num_buffer_sampled belong to the "
                    "SamplerEnsemble; pass them to SamplerEnsemble(...)."
                )
            if collate_fns is None and isinstance(storages, StorageEnsemble):
                collate_fns = [st.default_collate for st in storages.storages]
            rbs = _buffers_from_components(storages, samplers, writers, list(collate_fns or ()))
        self._rbs = tuple(rbs)
        self._collate_fns = list(collate_fns)
        self.routing_key = None if routing_key is None else unravel_key(routing_key)
        self.routing_dim = routing_dim
        super().__init__(
            storage=storages,
            sampler=samplers,
            writer=writers,
            transform=transform,
            batch_size=batch_size,
            collate_fn=collate_fn or _stack_anything,
            generator=generator,
            shared=shared,
            **kwargs,
        )

    @property
    def members(self) -> tuple:
        """The member buffers, in order (built over the components when given those)."""
        return self._rbs

    # ------------------------------------------------------------------ sampling
    @property
    def _collate_fn(self):
        fns, stack = self._collate_fns, self._collate_fn_val

        def collate(samples):
            return stack([fns[i](sample) for i, sample in samples])

        return collate

    @_collate_fn.setter
    def _collate_fn(self, value) -> None:
        self._collate_fn_val = value

    def _sample(self, batch_size: int):
        for rb in self._rbs:  # writes other processes made to the members' shared storages
            rb.synchronize()
        data, info = super()._sample(batch_size)
        if isinstance(data, TensorDictBase):
            ids = info.get(("index", "buffer_ids"))
            info.set(("index", "buffer_ids"), expand_right(ids, data.batch_size))
            if isinstance(info, LazyStackedTensorDict):
                for part, d in zip(info.unbind(info.stack_dim), data.unbind(info.stack_dim)):
                    part.batch_size = d.batch_size
                info = torch.stack(info.tensordicts, info.stack_dim)
            else:
                info.batch_size = data.batch_size
            data.update(info)
        return data, info

    def refresh(self) -> None:
        super().refresh()
        for rb in self._rbs:
            rb.refresh()

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, index):
        """An int: that member buffer; a slice, list, array or 1-d tensor: the ensemble of
        those members; ``(members, items)``: those items of the members (collated)."""
        if isinstance(index, tuple):
            if index[0] is Ellipsis:
                index = (slice(None), index[1:])
            rb = self[index[0]]
            if len(index) == 1:
                return rb
            if rb is self:
                return self._collate_fn(
                    [(i, st[index[1:]]) for i, st in enumerate(self.storage.storages)]
                )
            if isinstance(rb, ReplayBufferEnsemble):
                return rb[(slice(None), *index[1:])]
            return rb[index[1:]]
        pos = member_positions(index, len(self._rbs), "ReplayBufferEnsemble")
        if pos is None:
            return self
        if isinstance(pos, int):
            return self._rbs[pos]
        sampler = self.sampler
        p = sampler.p[pos] if isinstance(sampler.p, torch.Tensor) else sampler.p
        return ReplayBufferEnsemble(
            *(self._rbs[i] for i in pos),
            transform=self.transform,
            batch_size=self.batch_size,
            collate_fn=self._collate_fn_val,
            collate_fns=[self._collate_fns[i] for i in pos],
            sample_from_all=sampler.sample_from_all,
            num_buffer_sampled=sampler.num_buffer_sampled,
            p=p,
        )

    # ------------------------------------------------------------------ reports
    def stats(self) -> dict:
        out = super().stats()
        if out["initialized"]:
            storages = self.storage.storages
            size, cap = sum(len(s) for s in storages), sum(s.max_size for s in storages)
            out.update(
                size=int(size), capacity=int(cap), utilization=float(size) / cap if cap else 0.0
            )
        out["num_buffers"] = len(self._rbs)
        return out

    def __repr__(self):
        storages = textwrap.indent(f"storages={self.storage}", " " * 4)
        writers = textwrap.indent(f"writers={self.writer}", " " * 4)
        samplers = textwrap.indent(f"samplers={self.sampler}", " " * 4)
        return (
            f"ReplayBufferEnsemble(\n{storages}, \n{samplers}, \n{writers}, \nbatch_size="
            f"{self.batch_size}, \ntransform={self.transform}, \ncollate_fn="
            f"{self._collate_fn_val})"
        )


class ReplayBufferTrainer:
    """TorchRL's ``ReplayBufferTrainer`` hook provider for an adapter buffer.

    ``register(trainer)`` registers :meth:`extend` on ``"batch_process"``, :meth:`sample` on
    ``"process_optim_batch"`` and :meth:`update_priority` on ``"post_loss"``, and itself as a
    module under ``name`` (any object with TorchRL's ``register_op`` / ``register_module``).
    """

    def __init__(
        self,
        replay_buffer: ReplayBuffer,
        batch_size: int | None = None,
        memmap: bool = False,
        device=None,
        flatten_tensordicts: bool = False,
        max_dims: Sequence[int] | None = None,
        iterate: bool = False,
    ):
        self.replay_buffer = replay_buffer
        if hasattr(replay_buffer, "update_tensordict_priority"):
            self._update_priority = replay_buffer.update_tensordict_priority
        else:
            if replay_buffer.sampler.prioritized:
                raise ValueError(
                    "Prioritized sampler not supported for replay buffer trainer "
                    "if not within a TensorDictReplayBuffer"
                )
            self._update_priority = None
        self.batch_size = batch_size
        self.memmap = memmap
        self.device = device
        self.flatten_tensordicts = flatten_tensordicts
        self.max_dims = max_dims
        self.iterate = iterate
        if iterate:
            self.replay_buffer_iter = iter(self.replay_buffer)

    def extend(self, batch: TensorDictBase) -> TensorDictBase:
        if self.flatten_tensordicts:
            if ("collector", "mask") in batch.keys(True):
                batch = batch[batch.get(("collector", "mask"))]
            else:
                if "next" in batch.keys() and "truncated" in batch["next"].keys():
                    batch["next", "truncated"][..., -1] = True
                batch = batch.reshape(-1)
        elif self.max_dims is not None:
            from tensordict import pad

            pads = []
            for d in range(batch.ndimension()):
                pads += [0, 0 if self.max_dims[d] == -1 else self.max_dims[d] - batch.batch_size[d]]
            batch = pad(batch, pads)
        batch = batch.cpu()
        self.replay_buffer.extend(batch)
        return batch

    def sample(self, batch: TensorDictBase) -> TensorDictBase:
        if self.iterate:
            try:
                sample = next(self.replay_buffer_iter)
            except StopIteration:
                self.replay_buffer_iter = iter(self.replay_buffer)
                raise
        else:
            sample = self.replay_buffer.sample(batch_size=self.batch_size)
        return sample.to(self.device) if self.device is not None else sample

    def update_priority(self, batch: TensorDictBase) -> None:
        if self._update_priority is not None:
            self._update_priority(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"replay_buffer": self.replay_buffer.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.replay_buffer.load_state_dict(state_dict["replay_buffer"])

    def register(self, trainer, name: str = "replay_buffer"):
        trainer.register_op("batch_process", self.extend)
        trainer.register_op("process_optim_batch", self.sample)
        trainer.register_op("post_loss", self.update_priority)
        trainer.register_module(name, self)
