"""TorchRL's ``SliceSamplerWithoutReplacement``: each stored trajectory once per epoch."""


from __future__ import annotations

import torch

from functional_rb.adapters.samplers.base import _ReplacementDispatch
from functional_rb.adapters.samplers.random import SamplerWithoutReplacement
from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["SliceSamplerWithoutReplacement"]


class SliceSamplerWithoutReplacement(SliceSampler, SamplerWithoutReplacement):
    """Each stored trajectory once per epoch (TorchRL's ``SliceSamplerWithoutReplacement``):
    an epoch is a ``torch.randperm`` of TorchRL's list of stored trajectories (``shuffle=False``:
    in order), a batch takes the next ``num_slices`` of them, each giving one slice whose start
    is drawn as :class:`SliceSampler` draws it. The generator is asked what TorchRL's asks, so
    the same seed gives the same slices. A change in the number of stored trajectories starts a
    new epoch; ``drop_last``, ``shuffle``, ``state_dict`` / ``dumps`` (the epoch's remaining
    trajectories) as in TorchRL.
    """

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 drop_last: bool = False, end_key=None, end_keys=None, traj_key=None,
                 ends=None, trajectories=None, truncated_key=("next", "truncated"),
                 init_key="is_init", strict_length: bool = True, shuffle: bool = True,
                 compile=False, cache_values: bool = False, pad_output: bool = False,
                 span=False, use_gpu=False):
        SliceSampler.__init__(
            self, num_slices=num_slices, slice_len=slice_len, end_key=end_key,
            end_keys=end_keys, traj_key=traj_key, ends=ends, trajectories=trajectories,
            cache_values=cache_values, truncated_key=truncated_key, init_key=init_key,
            strict_length=strict_length, pad_output=pad_output, compile=compile, span=span,
            use_gpu=use_gpu)
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
        traj_idx = self._take(int(lengths.numel()), num_slices,
                              getattr(storage, "device", None))
        return self._sample_slices(storage, start, lengths, seq, num_slices,
                                   traj_idx=traj_idx.to(torch.long))

    def _empty(self) -> None:
        SliceSampler._empty(self)
        SamplerWithoutReplacement._empty(self)

    state_dict = SamplerWithoutReplacement.state_dict
    load_state_dict = SamplerWithoutReplacement.load_state_dict
    dumps = SamplerWithoutReplacement.dumps
    loads = SamplerWithoutReplacement.loads

    def __repr__(self):
        perc = (len(self._sample_list) / self.len_storage * 100
                if self._sample_list is not None and self.len_storage else 0.0)
        return (f"{type(self).__name__}(num_slices={self.num_slices}, slice_len="
                f"{self.slice_len}, end_key={self.end_key}, traj_key={self.traj_key}, "
                f"truncated_key={self.truncated_key}, strict_length={self.strict_length},"
                f"{perc}% sampled)")


_ReplacementDispatch.without[SliceSampler] = SliceSamplerWithoutReplacement
