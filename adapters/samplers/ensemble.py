"""TorchRL's ``SamplerEnsemble``: which members a ``ReplayBufferEnsemble`` batch comes from.

A call ``sample(storage_ensemble, batch_size)`` picks ``num_buffer_sampled`` member ids and
draws ``sub = batch_size // num_buffer_sampled`` items for each pick with that member's own
sampler over that member's storage. Ids are drawn with the sampler's generator (torch's global
one when None): ``torch.multinomial(p, nb, replacement=True)`` with ``p``,
``torch.randint(len, (nb,))`` without, and ``p="sampleable"`` weights each member by what it
can serve now (``sampler.sampleable_count``). Each member picked is then asked once, for all of
its picks (``sub * picks`` items), members in increasing id order, so a seeded call draws what
TorchRL's does. ``sample_from_all=True`` asks every member once instead.

The index returned is a TensorDict ``[nb]``: ``"buffer_ids"`` int64 ``[nb]`` and ``"index"``
``[nb, sub]`` (``[nb, sub, ndim]`` when the members return one tensor per storage dim); the
info is the members' infos stacked to ``[nb]``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from functional_rb.adapters._utils.ensemble import Members, check_members
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.storages.ensemble import StorageEnsemble

__all__ = ["SamplerEnsemble"]


def _as_tensor_index(index) -> torch.Tensor:
    return index if isinstance(index, torch.Tensor) else torch.stack(index, -1)


def _merge_infos(infos: list, sizes: list) -> dict:
    """The infos of several draws from one member as one: entries with one row per item are
    concatenated, others keep the last value given."""
    if len(infos) == 1:
        return infos[0]
    out = {}
    for key in set().union(*(i.keys() for i in infos)):
        values = [i.get(key) for i in infos]
        if all(
            isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n
            for v, n in zip(values, sizes)
        ):
            out[key] = torch.cat(values)
        else:
            out[key] = next(v for v in reversed(values) if v is not None)
    return out


class SamplerEnsemble(Members, Sampler):
    """Member samplers and the rule picking members (TorchRL's ``SamplerEnsemble``).

    Args:
      *samplers: the member samplers.
      p: the members' relative weights (a list or tensor, normalised), or ``"sampleable"``:
        weights recomputed at each call from what each member can serve, members that cannot
        serve excluded (default: uniform).
      sample_from_all: every member once per call (exclusive with ``p``).
      num_buffer_sampled: member picks per call (default: the number of members; every
        member with ``sample_from_all``).

    Example:
        >>> from functional_rb.adapters import RandomSampler, SamplerEnsemble
        >>> ensemble = SamplerEnsemble(RandomSampler(), RandomSampler(), p=[0.25, 0.75])
        >>> ensemble.p.tolist()
        [0.25, 0.75]
    """

    def __init__(
        self,
        *samplers: Sampler,
        p: Sequence[float] | torch.Tensor | str | None = None,
        sample_from_all: bool = False,
        num_buffer_sampled: int | None = None,
    ):
        self._members = check_members("SamplerEnsemble", samplers, Sampler, "sampler")
        self._rng_private = None
        if sample_from_all and p is not None:
            raise RuntimeError(
                "SamplerEnsemble: cannot pass both `p` and "
                "`sample_from_all=True`; drop one of them."
            )
        self.sample_from_all = bool(sample_from_all)
        self.p = p
        self.num_buffer_sampled = num_buffer_sampled

    _kind = "samplers"

    @property
    def samplers(self) -> tuple:
        return self._members

    @property
    def p(self):
        return self._p

    @p.setter
    def p(self, value) -> None:
        if isinstance(value, str):
            if value != "sampleable":
                raise ValueError(
                    f"SamplerEnsemble: the only dynamic probability is "
                    f"'sampleable', got p={value!r}."
                )
        elif value is not None:
            value = torch.as_tensor(value)
            n = len(self._members)
            if value.shape != (n,) or not torch.isfinite(value).all() or (value < 0).any():
                raise ValueError(
                    f"SamplerEnsemble: p must hold {n} finite non-negative "
                    f"weights (one per member), got {value.tolist()}."
                )
            value = value / value.sum().clamp_min(1e-6)
        self._p = value

    @property
    def num_buffer_sampled(self) -> int:
        n = self._num_buffer_sampled
        return len(self._members) if n is None or self.sample_from_all else n

    @num_buffer_sampled.setter
    def num_buffer_sampled(self, value) -> None:
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ValueError(
                f"SamplerEnsemble: num_buffer_sampled must be a positive int, got {value!r}."
            )
        self._num_buffer_sampled = None if value is None else int(value)

    # ------------------------------------------------------------------ sampling
    def sample(self, storage, batch_size: int):
        nb = self.num_buffer_sampled
        if batch_size % nb:
            raise ValueError(
                f"The batch size must be divisible by num_buffer_sampled, got "
                f"batch_size={batch_size} and num_buffer_sampled={nb}."
            )
        if not isinstance(storage, StorageEnsemble):
            raise TypeError(
                f"SamplerEnsemble requires a StorageEnsemble, got {type(storage).__name__}."
            )
        sub = batch_size // nb
        if self.sample_from_all:
            samples, infos = zip(
                *(s.sample(st, sub) for st, s in zip(storage.storages, self._members))
            )
            ids = torch.arange(len(samples))
            infos = [TensorDict.from_dict(i, batch_dims=0) if i else TensorDict() for i in infos]
        else:
            ids = self._draw_ids(storage, sub)
            samples, infos = self._draw_members(storage, ids, sub)
        samples = [_as_tensor_index(s) for s in samples]
        stacked = (
            torch.stack(samples)
            if all(s.shape == samples[0].shape for s in samples)
            else torch.nested.nested_tensor(samples)
        )
        index = TensorDict({"index": stacked, "buffer_ids": ids}, batch_size=[nb])
        return index, torch.stack(list(infos))

    def _draw_ids(self, storage, sub: int) -> torch.Tensor:
        nb, n = self.num_buffer_sampled, len(self._members)
        if isinstance(self._p, str):
            counts = torch.tensor(
                [
                    float(s.sampleable_count(st, sub))
                    for st, s in zip(storage.storages, self._members)
                ],
                device=self.rng.device if self.rng is not None else "cpu",
            )
            if not counts.any():
                raise RuntimeError("None of the replay-buffer ensemble members can be sampled.")
            return torch.multinomial(counts / counts.sum(), nb, True, generator=self.rng)
        if self._p is None:
            return torch.randint(n, (nb,), generator=self.rng)
        if not self._p.sum() > 0:
            raise RuntimeError(
                "SamplerEnsemble.sample: every member has weight 0 in p "
                f"({self._p.tolist()}); give some member a positive weight."
            )
        return torch.multinomial(self._p, nb, True, generator=self.rng)

    def _draw_member(self, member: int, storage, n: int):
        """``n`` items from one member (asked again while its sampler returns fewer):
        ``(index [n, ...], info)``."""
        parts, infos, remaining = [], [], n
        while remaining:
            index, info = self._members[member].sample(storage.storages[member], remaining)
            index = _as_tensor_index(index)
            if not index.shape[0] or index.shape[0] > remaining:
                raise RuntimeError(
                    f"Sampler {member} returned {index.shape[0]} records for a "
                    f"requested batch of {remaining}."
                )
            parts.append(index)
            infos.append(info)
            remaining -= index.shape[0]
        return torch.cat(parts), _merge_infos(infos, [p.shape[0] for p in parts])

    def _draw_members(self, storage, ids: torch.Tensor, sub: int):
        samples, infos = [None] * ids.numel(), [None] * ids.numel()
        for member in ids.unique(sorted=True).tolist():
            rows = (ids == member).nonzero().flatten().tolist()
            total = sub * len(rows)
            index, info = self._draw_member(member, storage, total)
            info = TensorDict.from_dict(info, batch_dims=0) if info else TensorDict()
            for k, (row, chunk) in enumerate(zip(rows, index.split(sub, dim=0))):
                samples[row] = chunk
                part = info.clone(False)
                for key, value in info.items(include_nested=True, leaves_only=True):
                    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == total:
                        part.set(key, value[k * sub : (k + 1) * sub])
                infos[row] = part
        return samples, infos

    def can_sample(self, storage, batch_size: int) -> bool:
        """Whether the picking rule can serve ``batch_size`` now (every member with
        ``sample_from_all``; a member of positive weight otherwise)."""
        if batch_size % self.num_buffer_sampled:
            return False
        sub = batch_size // self.num_buffer_sampled
        ready = [s.can_sample(st, sub) for st, s in zip(storage.storages, self._members)]
        if self.sample_from_all:
            return all(ready)
        if self._p is None or isinstance(self._p, str):
            return any(ready)
        return any(r and w > 0 for r, w in zip(ready, self._p.tolist()))

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Priorities of the items named by an ensemble index (``info["index"]``: int64
        ``"index"`` ``[nb, sub, ...]`` and ``"buffer_ids"`` ``[nb]`` or ``[nb, sub]``),
        ``priority`` ``[nb, sub]``, flat or a scalar; each member's items go to its own sampler.
        (TorchRL's ensemble warns and ignores them; a member whose sampler is not prioritized
        warns here.)"""
        if not isinstance(index, TensorDictBase):
            raise TypeError(
                "SamplerEnsemble.update_priority: expected the ensemble index "
                "(info['index'], a TensorDict of 'buffer_ids' and 'index'), got "
                f"{type(index).__name__}. Pass the index the ensemble sampled."
            )
        local, ids = index.get("index"), index.get("buffer_ids")
        lead = local.shape[:2]
        if ids.shape != lead:
            ids = ids.reshape(-1, 1).expand(lead)
        priority = torch.as_tensor(priority)
        priority = priority.expand(lead) if priority.numel() == 1 else priority.reshape(lead)
        ids, priority = ids.reshape(-1), priority.reshape(-1)
        local = local.reshape(ids.numel(), *local.shape[2:])
        for member in ids.unique(sorted=True).tolist():
            rows = (ids == member).nonzero().flatten()
            st = None if storage is None else storage.storages[member]
            self._members[member].update_priority(local[rows], priority[rows], storage=st)

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        for s in self._members:
            s.empty()

    def _subset(self, positions: list):
        p = self._p[positions] if isinstance(self._p, torch.Tensor) else self._p
        return SamplerEnsemble(
            *(self._members[i] for i in positions),
            p=p,
            sample_from_all=self.sample_from_all,
            num_buffer_sampled=self.num_buffer_sampled,
        )

    def __repr__(self):
        samplers = textwrap.indent(f"samplers={self._members}", " " * 4)
        return f"SamplerEnsemble(\n{samplers})"
