"""Conditional updates of stored records: ``update_if_present`` (TorchRL's generation API).

A ring writer reuses slots, so an index captured at sampling time may name another record by
the time an asynchronous computation writes back. With ``RoundRobinWriter(
track_generations=True)`` every dim-0 slot carries a stamp that advances with each write;
``update_if_present(index=, generation=, patch=)`` patches only the records whose slot still
holds the stamp they were sampled with, optionally only when an incoming ``version`` beats the
stored one. The whole patch is validated (keys, shapes, dtypes) before anything is written.

:func:`patch_if_present` does it under the buffer's lock; the buffer's methods
``update_if_present``, ``submit_update_if_present`` (on a background thread) and
``wait_updates`` are at the end, bound by name in
:class:`~functional_rb.adapters.ReplayBuffer`'s class body.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from tensordict import TensorClass, TensorDictBase
from tensordict.utils import unravel_key

__all__ = [
    "ConditionalUpdateResult",
    "patch_if_present",
    "submit_update_if_present",
    "update_if_present",
    "wait_updates",
]


class ConditionalUpdateResult(TensorClass["nocast"]):
    """What :func:`patch_if_present` did, aligned with the input order.

    updated: bool ``[N]``: the record was live and patched.
    version_rejected: bool ``[N]`` or None: live, but lost the version comparison (only with
      ``version_key``). Every record is in exactly one of updated / version_rejected / stale.
    """

    updated: torch.Tensor
    version_rejected: torch.Tensor | None = None

    @property
    def updated_count(self) -> int:
        return int(self.updated.sum().item())

    @property
    def version_rejected_count(self) -> int:
        return 0 if self.version_rejected is None else int(self.version_rejected.sum().item())

    @property
    def stale_count(self) -> int:
        return int(self.updated.numel()) - self.updated_count - self.version_rejected_count


def _version_patch(storage, index, n: int, version_key, version, patch: dict):
    """Checks ``version_key`` and adds the incoming versions ``[n, *feature]`` to the patch."""
    if isinstance(version_key, str) and "." in version_key:
        raise ValueError(
            f"Dotted-string version keys are not supported: got {version_key!r}. "
            f"Pass the nested key in tuple form, e.g. "
            f"{tuple(version_key.split('.'))!r}."
        )
    version_key = unravel_key(version_key)
    if version_key in patch:
        raise ValueError(f"version_key {version_key!r} may not appear in patch.")
    leaf = storage.patch_leaf(version_key)
    feature = leaf.shape[index.shape[-1] if index.ndim > 1 else 1 :]
    if any(d != 1 for d in feature):
        raise ValueError(
            f"version_key {version_key!r} must reference a per-record scalar "
            f"field; the storage holds feature shape {tuple(feature)}."
        )
    v = torch.as_tensor(version)
    while v.ndim > 1 and v.shape[-1] == 1:
        v = v.squeeze(-1)
    if v.ndim == 0:
        v = v.expand(n)
    elif v.ndim != 1 or v.numel() != n:
        raise ValueError(
            f"version must be a scalar or hold one entry per record, got shape "
            f"{tuple(torch.as_tensor(version).shape)} for {n} records."
        )
    patch[version_key] = v.reshape((n, *feature))
    return version_key, leaf


def _best_rows(rows: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: per record addressed several times, the row with the highest incoming
    version (the last one on ties) — the others lose, so the outcome does not depend on the
    write order."""
    if rows.ndim > 1:
        slots, ids = torch.unique(rows, dim=0, return_inverse=True)
    else:
        slots, ids = torch.unique(rows, return_inverse=True)
    n = slots.shape[0]
    if n == ids.numel():
        return torch.ones_like(ids, dtype=torch.bool)
    lowest = (torch.finfo if incoming.is_floating_point() else torch.iinfo)(incoming.dtype).min
    best = torch.full((n,), lowest, dtype=incoming.dtype).scatter_reduce(0, ids, incoming, "amax")
    row = torch.arange(ids.numel())
    last = torch.full((n,), -1, dtype=torch.int64).scatter_reduce(
        0, ids, torch.where(incoming == best[ids], row, -1), "amax"
    )
    return row == last[ids]


def patch_if_present(
    buffer, *, index, generation, patch, version_key=None, version=None, require_newer: bool = False
) -> ConditionalUpdateResult:
    """Patch the records at ``index`` whose slot generation is still ``generation``."""
    storage, writer = buffer.storage, buffer.writer
    if not storage.supports_conditional_update or not writer.tracks_generations:
        raise RuntimeError(
            f"Conditional updates are not supported by {type(storage).__name__} with "
            f"{type(writer).__name__}: the storage must support conditional updates (a tensor "
            "storage) and the writer must track slot generations "
            "(RoundRobinWriter(track_generations=True))."
        )
    index = torch.as_tensor(index, dtype=torch.long)
    dim0 = index[..., 0] if index.ndim > 1 else index.reshape(-1)
    generation = torch.as_tensor(generation, dtype=torch.long).reshape(-1)
    if generation.numel() != dim0.numel():
        raise ValueError(
            f"index and generation must address the same number of records, got "
            f"{dim0.numel()} indices and {generation.numel()} generations."
        )
    if (version_key is None) != (version is None):
        raise ValueError("version_key and version must be provided together.")
    patch = dict(
        patch.items(include_nested=True, leaves_only=True)
        if isinstance(patch, TensorDictBase)
        else patch
    )
    patch = {unravel_key(k): v for k, v in patch.items()}
    if version_key is not None:
        version_key, vleaf = _version_patch(
            storage, index, dim0.numel(), version_key, version, patch
        )
    patch = storage.validate_patch(index, patch)
    rejected = None
    with buffer.lock:
        current = writer.generations_of(dim0)
        live = (current >= 0) & (generation >= 0) & (current == generation)
        if version_key is not None:
            rejected = torch.zeros_like(live)
            if live.any():
                rows = index[live]
                coords = tuple(rows.unbind(-1)) if rows.ndim > 1 else (rows,)
                stored = vleaf[coords].reshape(-1)
                incoming = patch[version_key][live].reshape(-1)
                ok = (incoming > stored) if require_newer else (incoming >= stored)
                ok = ok & _best_rows(rows, incoming)
                rejected[live] = ~ok
                live = live.clone()
                live[live.clone()] = ok
        if live.any():
            storage.apply_patch(index[live], {k: v[live] for k, v in patch.items()})
    return ConditionalUpdateResult(updated=live, version_rejected=rejected, batch_size=live.shape)


# ---------------------------------------------------------------------- the buffer's methods
def update_if_present(
    self,
    *,
    index,
    generation,
    patch,
    version_key=None,
    version=None,
    require_newer: bool = False,
):
    """Patch the records at ``index`` whose slot still holds the ``generation`` they were
    sampled with (TorchRL's generation API; needs ``RoundRobinWriter(
    track_generations=True)``). Returns a :class:`ConditionalUpdateResult`."""
    self.synchronize()
    return patch_if_present(
        self,
        index=index,
        generation=generation,
        patch=patch,
        version_key=version_key,
        version=version,
        require_newer=require_newer,
    )


def submit_update_if_present(self, **kwargs):
    """:meth:`update_if_present` on a background thread, in submission order; samples drawn
    after this call see it. Returns a ``concurrent.futures.Future``."""
    if self._updater is None:
        self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frb-update")
    fut = self._updater.submit(patch_if_present, self, **kwargs)
    self._pending.append(fut)
    return fut


def wait_updates(self) -> None:
    """Wait for the updates :meth:`submit_update_if_present` queued."""
    while self._pending:
        self._pending.pop(0).result()
