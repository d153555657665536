"""TorchRL's ``SliceSamplerWithoutReplacement``: each stored trajectory once per epoch."""


from __future__ import annotations

import torch
from tensordict import TensorDict

import functional_rb as frb
from functional_rb.adapters._utils import core as _core
from functional_rb.adapters.samplers.base import EpochSampler, _ReplacementDispatch
from functional_rb.adapters.samplers.random import SamplerWithoutReplacement
from functional_rb.adapters.samplers.slice import SliceSampler

__all__ = ["SliceSamplerWithoutReplacement"]


class SliceSamplerWithoutReplacement(SliceSampler, EpochSampler):
    """Each stored trajectory once per epoch (TorchRL's ``SliceSamplerWithoutReplacement``),
    over ``frb.SliceSamplerWithoutReplacement``. ``drop_last`` and ``shuffle`` as in TorchRL.
    """

    _core_cls = frb.SliceSamplerWithoutReplacement

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 drop_last: bool = False, end_key=None, end_keys=None, traj_key=None,
                 ends=None, trajectories=None, truncated_key=("next", "truncated"),
                 init_key="is_init", strict_length: bool = True, shuffle: bool = True,
                 compile=False, cache_values: bool = False, pad_output: bool = False,
                 span=False, use_gpu=False):
        super().__init__(num_slices=num_slices, slice_len=slice_len, end_key=end_key,
                         end_keys=end_keys, traj_key=traj_key, ends=ends,
                         trajectories=trajectories, cache_values=cache_values,
                         truncated_key=truncated_key, init_key=init_key,
                         strict_length=strict_length, pad_output=pad_output, compile=compile,
                         span=span, use_gpu=use_gpu)
        self.drop_last, self.shuffle = bool(drop_last), bool(shuffle)
        self._ran_out = False

    def _make_core(self):
        kw = dict(num_slices=self.num_slices, slice_len=self.slice_len, truncated_key=None,
                  strict_length=self.strict_length, drop_last=self.drop_last,
                  shuffle=self.shuffle, span=self.span)
        kw["traj_key" if self._signal == "traj" else "end_key"] = "sig"
        return self._core_cls(**kw)

    def _commit(self, state) -> None:
        self._state = state
        self._ran_out = bool(_core.epoch_exhausted(state))

    def _empty(self) -> None:
        super()._empty()
        self._ran_out = False

    def dumps(self, path) -> None:
        """TorchRL's file layout for this sampler's epoch. Epochs restart after a load (the
        trajectory records are rebuilt from the storage), so the entries say so to TorchRL
        too: ``len_storage=0`` makes it begin a new epoch."""
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        TensorDict({"len_storage": torch.tensor(0), "_sample_list": torch.zeros(0, dtype=torch.long),
                    "drop_last": torch.tensor(self.drop_last),
                    "_ran_out": torch.tensor(self._ran_out)}, []).memmap(path, copy_existing=True)

    def loads(self, path) -> None:
        del path
        self._empty()


_ReplacementDispatch.without[SliceSampler] = SliceSamplerWithoutReplacement
# TorchRL's SliceSamplerWithoutReplacement also derives from SamplerWithoutReplacement; here it
# only counts as one for isinstance / issubclass (it shares none of its code).
_ReplacementDispatch.virtual[SamplerWithoutReplacement] = (SliceSamplerWithoutReplacement,)
