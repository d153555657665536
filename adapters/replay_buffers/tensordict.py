"""TorchRL's ``TensorDictReplayBuffer``: TensorDict data; writes each item's ``"index"``, puts
the sampler's info (``"index"``, ``"priority_weight"``, slice markers) into the sampled
TensorDict, and reads priorities from ``priority_key`` in ``extend`` /
``update_tensordict_priority``."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase, is_tensor_collection, is_tensorclass

from functional_rb.adapters._utils import data as D
from functional_rb.adapters.replay_buffers.base import ReplayBuffer, _ready
from functional_rb.adapters.sample_units import Sequence
from functional_rb.adapters.writers.round_robin import TensorDictRoundRobinWriter

__all__ = ["TensorDictReplayBuffer"]


_REDUCE = {
    "max": lambda x: x.amax(-1),
    "min": lambda x: x.amin(-1),
    "sum": lambda x: x.sum(-1),
    "mean": lambda x: x.mean(-1),
    "median": lambda x: x.median(-1).values,
}


class TensorDictReplayBuffer(ReplayBuffer):
    """TorchRL's ``TensorDictReplayBuffer``: TensorDict data; samples carry ``"index"`` and the
    sampler's info (``"priority_weight"``, slice markers).

    Args:
      priority_key: the entry a prioritized sampler's priorities are read from, by ``extend``
        and ``update_tensordict_priority``.
      **kwargs: the arguments of :class:`~functional_rb.adapters.ReplayBuffer`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import LazyTensorStorage, TensorDictReplayBuffer
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
        >>> index = rb.extend(TensorDict({"obs": torch.randn(6, 3)}, [6]))
        >>> sorted(rb.sample().keys())
        ['index', 'obs']
    """

    _is_tensordict = True
    _default_writer = TensorDictRoundRobinWriter

    def __init__(self, *, priority_key: str | tuple[str, ...] = "td_error", **kwargs):
        super().__init__(**kwargs)
        self.priority_key = priority_key

    def _priority_vector(self, td: TensorDictBase) -> torch.Tensor:
        """One priority per item of ``td`` (``[B]``; ``ndim=2``: ``[B, T]``), reduced with the
        sampler's ``reduction`` over the trailing dims; the default priority when the key is
        absent."""
        nd = max(self._storage.ndim, 1)
        p = td.get(self.priority_key, None)
        lead = td.shape[:nd] if td.ndim >= nd else td.shape
        if p is None:
            return torch.full(lead, float(self._sampler.default_priority))
        p = p.reshape(*lead, -1).float()
        return _REDUCE[getattr(self._sampler, "reduction", "max")](p)

    def _set_index(self, td, index) -> None:
        if index is None or is_tensorclass(td):
            return
        if isinstance(index, int):
            index = torch.as_tensor(index, device=td.device)
            td.set("index", index.expand(td.shape) if td.ndim else index)
            return
        if index.ndim == 2 and td.ndim >= 2:  # one (t, env) row per element of td[:dim]
            for dim in range(td.ndim, 1, -1):
                if index.shape[0] == td.shape[:dim].numel():
                    td.set("index", self._index_per_element(index, td.shape[:dim]))
                    return
        if index.ndim == 2 and index.shape[:1] != td.shape[:1]:
            raise RuntimeError(
                f"could not reshape the index of shape {tuple(index.shape)} to "
                f"the tensordict's shape {tuple(td.shape)}."
            )
        td.set("index", D.expand_leading(index.to(td.device), td.shape))

    def _index_per_element(self, index: torch.Tensor, shape) -> torch.Tensor:
        """The ``[N, ndim]`` rows of an extend as ``[*shape, ndim]``: the rows follow the data
        with its dims 0 and ``dim_extend`` swapped (the order it was written in), so each
        element gets its own position (TorchRL 0.14 unflattens without the swap)."""
        d = self.dim_extend
        if not 0 < d < len(shape):
            return index.unflatten(0, shape)
        swapped = list(shape)
        swapped[0], swapped[d] = swapped[d], swapped[0]
        return index.unflatten(0, swapped).transpose(0, d)

    @_ready
    def add(self, data: TensorDictBase):
        # (a shallow copy: "index" is written into it, never into the caller's TensorDict)
        data = self._inverse(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        index = self._add(data)
        if index is not None:
            if is_tensor_collection(data):
                self._set_index(data, index)
            self.update_tensordict_priority(data)
        return index

    @_ready
    def extend(self, tensordicts, *, update_priority: bool | None = None) -> torch.Tensor:
        if not isinstance(tensordicts, TensorDictBase):
            raise ValueError(
                f"{type(self).__name__} only accepts TensorDictBase subclasses. "
                "tensorclasses and other types are not compatible with that class. "
                "Please use a regular `ReplayBuffer` instead."
            )
        tensordicts = self._inverse(tensordicts)  # (see add)
        if tensordicts is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        index = self._extend(tensordicts)
        try:
            self._set_index(tensordicts, index)
        except RuntimeError:
            if not tensordicts.is_locked:
                raise
        if update_priority is None or update_priority:
            vector = tensordicts.get(self.priority_key, None)
            if vector is not None and self._sampler.prioritized:
                with self._stale.unchecked():  # the items just written: nothing to check
                    self.update_priority(index, self._priority_vector(tensordicts).reshape(-1))
        return index

    @_ready
    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Set the priorities of ``data["index"]`` from ``data[priority_key]``, reduced per item
        with the sampler's ``reduction``. No-op for samplers without priorities."""
        if not self._sampler.prioritized:
            return
        if data.ndim:
            priority = self._priority_vector(data)
            anchored = self._anchored(data, priority)
            if anchored is not None:
                return self.update_priority(*anchored)
        else:
            p = data.get(self.priority_key, None)
            priority = torch.as_tensor(
                self._sampler.default_priority
                if p is None
                else _REDUCE[self._sampler.reduction](torch.as_tensor(p).float().reshape(1, -1))[0]
            )
        index = data.get("index")
        if self._storage.ndim > 1 and index.ndim == 2:
            index = index.unbind(-1)
        else:
            while index.shape != priority.shape and index.ndim > priority.ndim:
                index = index[..., 0]
        self.update_priority(index, priority)

    def _anchored(self, data, priority):
        """With a ``Sequence`` sample unit: per-record priorities reduced to their anchors
        (max over each window's valid records), so padded and bootstrap records never set the
        priority of another item. ``(anchors, priorities)`` or None."""
        anchor = data.get("anchor_index", None)
        if not isinstance(self._sample_unit, Sequence) or anchor is None:
            return None
        valid = data.get("validity_mask", None)
        nd = self._storage.ndim
        anchor = anchor.reshape(-1, nd) if nd > 1 else anchor.reshape(-1)
        priority = priority.reshape(-1)
        if anchor.shape[0] != priority.shape[0]:
            return None
        if valid is not None:
            valid = valid.reshape(-1)
            anchor, priority = anchor[valid], priority[valid]
        if nd > 1:
            shape = tuple(self._storage.shape)
            stride = anchor.new_tensor([int(torch.Size(shape[d + 1 :]).numel()) for d in range(nd)])
            flat = (anchor * stride).sum(-1)
        else:
            flat = anchor
        unique, inverse = torch.unique(flat, return_inverse=True)
        reduced = torch.zeros_like(unique, dtype=priority.dtype).scatter_reduce_(
            0, inverse, priority, reduce="amax", include_self=False
        )
        if nd > 1:
            unique = (unique.unsqueeze(-1) // stride) % anchor.new_tensor(shape)
        return unique, reduced

    @_ready
    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        include_info: bool | None = None,
    ):
        data, info = super().sample(batch_size, return_info=True)
        data = self._attach_info(data, info, include_info)
        return (data, info) if return_info else data

    @staticmethod
    def _attach_info(data, info: dict, include_info=None):
        """The sample with the sampler's info as entries (``"index"`` stacked to
        ``[B, storage ndim]`` when a tuple), each expanded to the sample's batch shape."""
        if is_tensor_collection(data) and not is_tensorclass(data) and include_info in (True, None):
            locked = data.is_locked
            if locked:
                data.unlock_()
            for key, val in info.items():
                if key == "index" and isinstance(val, tuple):
                    val = torch.stack(val, -1)
                val = torch.as_tensor(val, device=data.device)
                try:
                    if val.ndim < data.ndim:
                        val = D.expand_leading(val, data.shape)
                    data.set(key, val)
                except RuntimeError as err:  # TorchRL's message, then what did not fit
                    raise RuntimeError(
                        "Failed to set the metadata (e.g., indices or weights) in the sampled "
                        "tensordict within TensorDictReplayBuffer.sample. This is probably "
                        "caused by a shape mismatch (one of the transforms has probably "
                        "modified the shape of the output tensordict). You can always recover "
                        "these items from the `sample` method from a regular ReplayBuffer "
                        "instance with the 'return_info' flag set to True. (Here: info "
                        f"{key!r} of shape {tuple(val.shape)}, sample of batch "
                        f"{tuple(data.shape)}.)"
                    ) from err
            if locked:
                data.lock_()
        elif not is_tensor_collection(data) and include_info:
            raise RuntimeError("Cannot include info in non-tensordict data")
        return data
