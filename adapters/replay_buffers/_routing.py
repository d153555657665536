"""Writes through a :class:`~functional_rb.adapters.ReplayBufferEnsemble` (TorchRL's routed
writes): ``extend`` / ``add`` send each record to the member named by ``routing_key`` (a member
id per record) or by its position along ``routing_dim``; ``update_if_present`` sends each
conditional patch to the member named by its index; ``end_streams`` closes every member's
stream before restarted producers append.

Methods of :class:`~functional_rb.adapters.ReplayBufferEnsemble`, bound by name in its class
body; they use its public surface only: ``members`` (the member buffers, in order),
``routing_key``, ``routing_dim``, ``transform``, ``writer``, ``lock`` and ``wait_updates``.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import unravel_key

from functional_rb.adapters import errors
from functional_rb.adapters.replay_buffers.conditional import ConditionalUpdateResult
from functional_rb.adapters.samplers.slice import SliceSampler
from functional_rb.adapters.samplers.streaming import StreamingSliceSampler
from functional_rb.adapters.writers.round_robin import RoundRobinWriter

__all__ = ["add", "end_streams", "extend", "update_if_present"]


def _route(self, data):
    """``(flat data [N], member id per record int64 [N])``."""
    if self.routing_key is None and self.routing_dim is None:
        raise RuntimeError(
            "ReplayBufferEnsemble writes are disabled. Configure routing_key "
            "or routing_dim to enable routed writes, or extend a member "
            "buffer (ensemble[i].extend(data))."
        )
    if not isinstance(data, TensorDictBase):
        raise TypeError(
            f"Routed replay writes require a TensorDict input, got {type(data).__name__}."
        )
    if len(self.transform):
        data = self.transform.inv(data)
    flat, n = data.reshape(-1), len(self.members)
    if self.routing_key is not None:
        ids = errors.entry(
            flat,
            self.routing_key,
            where="ReplayBufferEnsemble.extend",
            argument="routing_key",
            fix="Store each record's member id "
            "under routing_key, or route by position with routing_dim=.",
        )
        while ids.ndim > 1 and ids.shape[-1] == 1:
            ids = ids.squeeze(-1)
        if ids.shape != flat.batch_size:
            raise ValueError(
                f"routing_key {self.routing_key!r} must contain one member id "
                f"per record, got shape {tuple(ids.shape)} for batch size "
                f"{tuple(flat.batch_size)}."
            )
    else:
        if not data.ndim:
            raise ValueError("routing_dim requires batched input.")
        dim = self.routing_dim % data.ndim
        if data.shape[dim] != n:
            raise ValueError(
                f"routing_dim {self.routing_dim} has size {data.shape[dim]}, "
                f"expected {n} ensemble members."
            )
        shape = [1] * data.ndim
        shape[dim] = n
        ids = torch.arange(n).reshape(shape).expand(data.batch_size).reshape(-1)
    if ids.dtype == torch.bool or ids.is_floating_point():
        raise TypeError(f"ReplayBufferEnsemble member ids must be integers, got {ids.dtype}.")
    ids = ids.to(torch.long)
    if ids.numel() and ((ids < 0).any() or (ids >= n).any()):
        raise ValueError(
            f"ReplayBufferEnsemble member ids must lie in [0, {n - 1}], got "
            f"{sorted(set(ids.tolist()))}."
        )
    return flat, ids


def extend(self, data, *, update_priority: bool | None = None) -> TensorDictBase:
    """Route ``data`` to the members (``routing_key`` / ``routing_dim``). Returns a flat
    TensorDict aligned with ``data.reshape(-1)``: ``"buffer_ids"``, member-local
    ``"index"`` and, when every member writer tracks them, ``"index_generation"``."""
    if update_priority is not None:
        raise NotImplementedError("update_priority is not supported by routed ensemble writes.")
    flat, ids = _route(self, data)
    local, gens = None, None
    with self.lock:
        for member, rb in enumerate(self.members):
            rows = (ids == member).nonzero().flatten()
            if not rows.numel():
                continue
            index = rb.extend(flat[rows])
            index = (
                torch.stack(index, -1)
                if isinstance(index, tuple)
                else torch.as_tensor(index).reshape(-1, *torch.as_tensor(index).shape[1:])
            )
            if local is None:
                local = torch.empty((ids.numel(), *index.shape[1:]), dtype=index.dtype)
            elif index.shape[1:] != local.shape[1:]:
                raise RuntimeError(
                    "All routed replay-buffer members must use compatible "
                    f"index shapes, got {tuple(index.shape[1:])} and "
                    f"{tuple(local.shape[1:])}."
                )
            local[rows] = index
            if self.writer.tracks_generations:
                if gens is None:
                    gens = torch.empty(ids.numel(), dtype=torch.int64)
                gens[rows] = _write_generations(rb, index)
    if local is None:
        local = torch.empty(0, dtype=torch.long)
    meta = TensorDict({"buffer_ids": ids, "index": local}, batch_size=[ids.numel()])
    if gens is not None:
        meta.set("index_generation", gens)
    return meta


def add(self, data) -> TensorDictBase:
    """Route one record (``routing_key``); returns its metadata."""
    if self.routing_dim is not None:
        raise RuntimeError("Use extend() for routing_dim writes.")
    if isinstance(data, TensorDictBase) and data.ndim:
        raise ValueError(
            f"add() expects a scalar TensorDict record, got batch size "
            f"{tuple(data.batch_size)}; use extend()."
        )
    return self.extend(data.unsqueeze(0) if isinstance(data, TensorDictBase) else data)[0]


def update_if_present(
    self,
    *,
    index,
    generation,
    patch,
    version_key=None,
    version=None,
    require_newer: bool = False,
) -> ConditionalUpdateResult:
    """Each member patches its records (``index``: the routed metadata ``extend`` returned,
    or a sample's ``("index", ...)``; ``generation`` and ``patch`` aligned with it)."""
    if not isinstance(index, TensorDictBase):
        raise TypeError(
            "ReplayBufferEnsemble conditional updates require routed index "
            f"metadata (a TensorDict of 'buffer_ids' and 'index'), got "
            f"{type(index).__name__}."
        )
    ids, local = index.get("buffer_ids"), index.get("index")
    lead = ids.shape
    if local.shape[: len(lead)] != lead:
        raise ValueError(
            f"Member-local indices must start with the buffer-id shape, got "
            f"{tuple(local.shape)} and {tuple(lead)}."
        )
    if ids.dtype == torch.bool or ids.is_floating_point():
        raise TypeError("ReplayBufferEnsemble member ids must be integers.")
    n, flat_ids = ids.numel(), ids.reshape(-1)
    if n and ((flat_ids < 0).any() or (flat_ids >= len(self.members)).any()):
        raise ValueError(
            f"ReplayBufferEnsemble member ids must lie in [0, {len(self.members) - 1}]."
        )
    if (version_key is None) != (version is None):
        raise ValueError("version_key and version must be provided together.")
    if not self.writer.tracks_generations:
        raise RuntimeError(
            "Conditional updates require every ensemble member writer to "
            "track slot generations (RoundRobinWriter(track_generations="
            "True))."
        )
    local = local.reshape(n, *local.shape[len(lead) :])
    generation = torch.as_tensor(generation).reshape(-1)
    if generation.numel() != n:
        raise ValueError(
            "generation and routed index metadata must address the same "
            f"number of records, got {generation.numel()} and {n}."
        )
    patch = _flat_patch(patch, lead)
    updated = torch.zeros(n, dtype=torch.bool)
    rejected = torch.zeros_like(updated) if version_key is not None else None
    with self.lock:
        for member, rb in enumerate(self.members):
            rows = (flat_ids == member).nonzero().flatten()
            if not rows.numel():
                continue
            v = version
            if isinstance(version, torch.Tensor) and version.numel() > 1:
                v = version.reshape(n, *version.shape[len(lead) :])[rows]
            result = rb.update_if_present(
                index=local[rows],
                generation=generation[rows],
                patch={k: x[rows] for k, x in patch.items()},
                version_key=version_key,
                version=v,
                require_newer=require_newer,
            )
            updated[rows] = result.updated
            if rejected is not None:
                rejected[rows] = result.version_rejected
    return ConditionalUpdateResult(
        updated=updated.reshape(lead),
        version_rejected=None if rejected is None else rejected.reshape(lead),
        batch_size=lead,
    )


def end_streams(
    self,
    *,
    end_key=("next", "done"),
    terminated_key=("next", "terminated"),
    truncated_key=("next", "truncated"),
) -> None:
    """Close each member's stream before restarted producers append (TorchRL's
    ``end_streams``): the last stored step of every non-empty member gets ``end_key`` set
    and, when it has one and is not terminated, ``truncated_key``; a
    :class:`StreamingSliceSampler` drops its unfinished window. Each member must hold one
    chronological stream: a one-dimensional tensor storage, a ``RoundRobinWriter(
    track_generations=True)`` and a slice sampler reading ``end_key`` (with a ``traj_key``,
    one trajectory id per member). Write counts and slot generations do not change;
    unsupported members are refused before any step is changed."""
    end_key = unravel_key(end_key)
    terminated_key = None if terminated_key is None else unravel_key(terminated_key)
    truncated_key = None if truncated_key is None else unravel_key(truncated_key)
    keys = [k for k in (end_key, terminated_key, truncated_key) if k is not None]
    if len(set(keys)) != len(keys):
        raise ValueError("end, terminated and truncated keys must be distinct.")
    self.wait_updates()
    with ExitStack() as stack:
        stack.enter_context(self.lock)
        for rb in self.members:
            rb.wait_updates()
            stack.enter_context(rb.lock)
        patches = [
            p
            for p in (
                _tail_patch(rb, end_key, terminated_key, truncated_key) for rb in self.members
            )
            if p is not None
        ]
        for rb, index, generation, patch in patches:
            rb.update_if_present(index=index, generation=generation, patch=patch)
            # the plain slice samplers re-read the patched flags through the storage
            # revision; only the streaming one keeps stream state of its own
            if isinstance(rb.sampler, StreamingSliceSampler):
                rb.sampler.end_stream(index, storage=rb.storage)


def _tail_patch(rb, end_key, terminated_key, truncated_key):
    """``(member, index [1], generation [1], patch)`` closing the member's stream, or None
    for an empty member; refuses a member that cannot hold one stream."""
    storage, writer, sampler = rb.storage, rb.writer, rb.sampler
    if (
        storage.ndim != 1
        or not storage.supports_conditional_update
        or not isinstance(writer, RoundRobinWriter)
        or not writer.tracks_generations
        or not isinstance(sampler, SliceSampler)
        or end_key not in [unravel_key(k) for k in (sampler.end_keys or [sampler.end_key])]
    ):
        raise RuntimeError(
            "end_streams requires one-dimensional conditional-update storage, "
            "generation-tracking round-robin writers and end-key slice samplers: member has "
            f"{type(storage).__name__}(ndim={storage.ndim}), {type(writer).__name__}"
            f"(tracks_generations={writer.tracks_generations}), {type(sampler).__name__}. Use "
            "LazyTensorStorage, RoundRobinWriter(track_generations=True) and a SliceSampler "
            f"with end_key={end_key!r}."
        )
    n = len(rb)
    if not n:
        return None
    if sampler.traj_key is not None:
        traj = storage.data.get(sampler.traj_key, None)
        if traj is None or not bool((traj[:n] == traj[0]).all()):
            raise RuntimeError(
                "end_streams supports trajectory-keyed slice samplers only when "
                "every record of a member carries the same trajectory id (a "
                "per-stream key such as the environment index); restarted "
                "producers may otherwise reuse old ids."
            )
    index = torch.tensor([(storage.next_row() - 1) % n])
    last = storage.get(index)
    done = errors.entry(last, end_key, where="end_streams", argument="end_key")
    if done.dtype != torch.bool:
        raise TypeError(
            f"end_streams requires a boolean end_key field, {end_key!r} holds {done.dtype}."
        )
    patch = {end_key: torch.ones_like(done)}
    if truncated_key is not None and truncated_key in last.keys(True):
        unfinished = ~done
        terminated = None if terminated_key is None else last.get(terminated_key, None)
        if terminated is not None:
            unfinished = unfinished & ~terminated
        patch[truncated_key] = last.get(truncated_key) | unfinished
    return rb, index, writer.generations_of(index), patch


def _write_generations(rb, index: torch.Tensor) -> torch.Tensor:
    """The generation each record of one routed write got: a slot written twice in the write
    gives its earlier records the stamps they had before the later ones overwrote them."""
    gen = rb.writer.generations_of(index)
    slots = (index[..., 0] if rb.storage.ndim > 1 else index).reshape(-1)
    if slots.unique().numel() != slots.numel():
        later, seen = torch.empty_like(slots), {}
        for pos in range(slots.numel() - 1, -1, -1):
            slot = int(slots[pos])
            later[pos] = seen.get(slot, 0)
            seen[slot] = seen.get(slot, 0) + 1
        gen = gen.reshape(-1) - later
    return gen.reshape(-1)


def _flat_patch(patch, lead) -> dict:
    """``{key: [N, ...]}`` from a patch whose entries start with ``lead``."""
    n = lead.numel()
    if isinstance(patch, TensorDictBase):
        if patch.batch_size != lead:
            raise ValueError(
                f"The patch batch size must match the routed index metadata, got "
                f"{tuple(patch.batch_size)} and {tuple(lead)}."
            )
        flat = patch.reshape(-1)
        return dict(flat.items(include_nested=True, leaves_only=True))
    out = {}
    for key, value in patch.items():
        if value.shape[: len(lead)] != lead:
            raise ValueError(
                f"Patch entry {key!r} must start with shape {tuple(lead)}, got "
                f"{tuple(value.shape)}."
            )
        out[key] = value.reshape(n, *value.shape[len(lead) :])
    return out
