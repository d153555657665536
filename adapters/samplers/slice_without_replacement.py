"""TorchRL's ``SliceSamplerWithoutReplacement``: each stored trajectory once per epoch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict.utils import NestedKey

from functional_rb.adapters.samplers.base import WITHOUT_REPLACEMENT
from functional_rb.adapters.samplers.random import SamplerWithoutReplacement
from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["SliceSamplerWithoutReplacement"]


class SliceSamplerWithoutReplacement(SliceSampler, SamplerWithoutReplacement):
    """Each stored trajectory once per epoch (TorchRL's ``SliceSamplerWithoutReplacement``):
    an epoch is a ``torch.randperm`` of TorchRL's list of stored trajectories (``shuffle=False``:
    in order), a batch takes the next ``num_slices`` of them, each giving one slice whose start
    is drawn as :class:`SliceSampler` draws it. The generator is asked what TorchRL's asks, so
    the same seed gives the same slices. A change in the number of stored trajectories starts a
    new epoch; ``state_dict`` / ``dumps`` keep the epoch's remaining trajectories, as in
    TorchRL.

    Args:
      drop_last: skip an epoch's last batch when fewer than ``num_slices`` trajectories
        remain.
      shuffle: draw each epoch's trajectories in a random order (False: in TorchRL's order).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage,
        ...                                     SliceSamplerWithoutReplacement,
        ...                                     TensorDictReplayBuffer)
        >>> done = torch.zeros(20, 1, dtype=torch.bool)
        >>> done[4::5] = True  # four episodes of 5 steps
        >>> rb = TensorDictReplayBuffer(
        ...     storage=LazyTensorStorage(100), batch_size=4,
        ...     sampler=SliceSamplerWithoutReplacement(slice_len=2))
        >>> index = rb.extend(TensorDict({"obs": torch.arange(20), ("next", "done"): done},
        ...                              [20]))
        >>> firsts = sorted(int(rb.sample()["obs"][0]) // 5 for _ in range(2))
        >>> firsts == sorted(set(firsts))  # no episode twice in the epoch's first batches
        True
    """

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        drop_last: bool = False,
        end_key: NestedKey | None = None,
        end_keys: Sequence[NestedKey] | None = None,
        traj_key: NestedKey | None = None,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        strict_length: bool = True,
        shuffle: bool = True,
        compile: bool | dict = False,
        cache_values: bool = False,
        pad_output: bool = False,
        span: bool | int | tuple = False,
        use_gpu: bool | torch.device = False,
    ):
        SliceSampler.__init__(
            self,
            num_slices=num_slices,
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            ends=ends,
            trajectories=trajectories,
            cache_values=cache_values,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            pad_output=pad_output,
            compile=compile,
            span=span,
            use_gpu=use_gpu,
        )
        SamplerWithoutReplacement.__init__(self, drop_last=drop_last, shuffle=shuffle)

    def storage_len(self, storage) -> int:
        """The epoch runs over trajectories: how many are stored."""
        self._sync(storage)
        return int(self._bounds_of(storage)[2].numel())

    def can_sample(self, storage, batch_size: int) -> bool:
        if self.sampleable_count(storage, batch_size) <= 0:
            return False
        return not self.drop_last or self.storage_len(storage) >= self._shape(batch_size)[0]

    def sample(self, storage, batch_size: int):
        self._sync(storage)
        start, _, lengths = self._bounds_of(storage)
        num_slices, seq = self._shape(batch_size)
        traj_idx = self._take(int(lengths.numel()), num_slices, getattr(storage, "device", None))
        return self._sample_slices(
            storage, start, lengths, seq, num_slices, traj_idx=traj_idx.to(torch.long)
        )

    def _empty(self) -> None:
        SliceSampler._empty(self)
        SamplerWithoutReplacement._empty(self)

    state_dict = SamplerWithoutReplacement.state_dict
    load_state_dict = SamplerWithoutReplacement.load_state_dict
    dumps = SamplerWithoutReplacement.dumps
    loads = SamplerWithoutReplacement.loads

    def __repr__(self):
        perc = (
            len(self._sample_list) / self.len_storage * 100
            if self._sample_list is not None and self.len_storage
            else 0.0
        )
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len="
            f"{self.slice_len}, end_key={self.end_key}, traj_key={self.traj_key}, "
            f"truncated_key={self.truncated_key}, strict_length={self.strict_length},"
            f"{perc}% sampled)"
        )


WITHOUT_REPLACEMENT[SliceSampler] = SliceSamplerWithoutReplacement
