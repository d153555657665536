"""TorchRL's storage save/load hooks for TED data: ``TED2Flat`` and ``Flat2TED``.

TED ("TorchRL Episode Data") stores every step with its ``("next", ...)`` entries, so each
observation is held twice. ``TED2Flat`` is a save hook that writes a compact layout: the
``"next"`` entries that are not done/reward keys are merged into the root ones (one extra row
per trajectory end), done/reward keys move from ``"next"`` to the root, and ``shift``,
``is_full`` and ``_storage_shape`` are stored as non-tensor entries. ``Flat2TED`` is the load
hook that rebuilds the TED layout.

Constructor arguments, attributes (``shift``, ``is_full``, set by the checkpointer before a
save) and call conventions (``hook(storage_td, path=path)`` for saving, ``hook(td, out=dest)``
for loading) are TorchRL's, and so is the on-disk layout: this module follows TorchRL 0.14.1's
``torchrl/data/replay_buffers/utils.py`` (MIT licence, Copyright (c) Meta Platforms, Inc. and
affiliates) line for line, so that a buffer dumped by TorchRL with ``TED2Flat`` loads here with
``Flat2TED`` and the other way round. Use them with
:func:`functional_rb.adapters.serialization.dump_storage` / ``load_storage``, or register them on
the adapters' buffers with ``register_save_hook`` / ``register_load_hook``.

Assumptions (TorchRL's, not checked): root done states are False, and ``("next", key)`` at
step ``t`` equals ``key`` at ``t + 1`` unless the step is done.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack, unravel_key
from torch.nn import functional as F

__all__ = ["DEFAULT_DONE_KEYS", "Flat2TED", "TED2Flat"]

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")


class TED2Flat:
    """A storage saving hook to serialize TED data in a compact format.

    Args:
        done_key (NestedKey, optional): the key where the done states should be read.
            Defaults to ``("next", "done")``.
        shift_key (NestedKey, optional): the key where the shift will be written.
            Defaults to "shift".
        is_full_key (NestedKey, optional): the key where the is_full attribute will be written.
            Defaults to "is_full".
        done_keys (Tuple[NestedKey], optional): a tuple of nested keys indicating the done entries.
            Defaults to :data:`DEFAULT_DONE_KEYS`, i.e.
            ``("done", "truncated", "terminated")``.
        reward_keys (Tuple[NestedKey], optional): a tuple of nested keys indicating the reward entries.
            Defaults to ("reward",)


    Examples:
        >>> from functional_rb.adapters import ReplayBuffer, LazyMemmapStorage, TED2Flat
        >>> rb = ReplayBuffer(storage=LazyMemmapStorage(200))
        >>> rb.register_save_hook(TED2Flat())
        >>> rb.extend(collector_data)            # TED data, e.g. a collector's batch
        >>> rb.dumps(path)                       # path/storage holds the flat layout
        >>> # the same files as TorchRL's rb.dumps(path) with TED2Flat registered

    """

    _shift: int | None = None
    _is_full: bool | None = None

    def __init__(
        self,
        done_key=("next", "done"),
        shift_key="shift",
        is_full_key="is_full",
        done_keys=DEFAULT_DONE_KEYS,
        reward_keys=("reward",),
    ):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = {unravel_key(key) for key in done_keys}
        self.reward_keys = {unravel_key(key) for key in reward_keys}

    @property
    def shift(self):
        return self._shift

    @shift.setter
    def shift(self, value: int):
        self._shift = value

    @property
    def is_full(self):
        return self._is_full

    @is_full.setter
    def is_full(self, value: int):
        self._is_full = value

    def __call__(self, data: TensorDictBase, path: Path = None):
        # Get the done state
        shift = self.shift
        is_full = self.is_full

        # Create an output storage
        output = TensorDict()
        output.set_non_tensor(self.is_full_key, is_full)
        output.set_non_tensor(self.shift_key, shift)
        output.set_non_tensor("_storage_shape", tuple(data.shape))
        output.memmap_(path)

        # Preallocate the output
        done = data.get(self.done_key).squeeze(-1).clone()
        if not is_full:
            # shift is the cursor place
            done[shift - 1] = True
        else:
            done = done.roll(-shift, dims=0)
            done[-1] = True
        ntraj = done.sum()

        # Get the keys that require extra storage
        keys_to_expand = set(data.get("next").keys(True, True)) - (
            self.done_keys.union(self.reward_keys)
        )

        total_keys = data.exclude("next").keys(True, True)
        total_keys = set(total_keys).union(set(data.get("next").keys(True, True)))

        len_with_offset = data.numel() + ntraj  # + done[0].numel()
        for key in total_keys:
            if key in (self.done_keys.union(self.reward_keys)):
                entry = data.get(("next", key))
            else:
                entry = data.get(key)

            if key in keys_to_expand:
                shape = torch.Size([len_with_offset, *entry.shape[data.ndim :]])
                dtype = entry.dtype
                output.make_memmap(key, shape=shape, dtype=dtype)
            else:
                shape = torch.Size([data.numel(), *entry.shape[data.ndim :]])
                output.make_memmap(key, shape=shape, dtype=entry.dtype)

        if data.ndim == 1:
            return self._call(
                data=data,
                output=output,
                is_full=is_full,
                shift=shift,
                done=done,
                total_keys=total_keys,
                keys_to_expand=keys_to_expand,
            )

        with data.flatten(1, -1) if data.ndim > 2 else contextlib.nullcontext(
            data
        ) as data_flat:
            if data.ndim > 2:
                done = done.flatten(1, -1)
            traj_per_dim = done.sum(0)
            nsteps = data_flat.shape[0]

            start = 0
            start_with_offset = start
            stop_with_offset = 0
            stop = 0
            for data_slice, done_slice, traj_for_dim in zip(
                data_flat.unbind(1), done.unbind(1), traj_per_dim
            ):
                stop_with_offset = stop_with_offset + nsteps + traj_for_dim
                cur_slice_offset = slice(start_with_offset, stop_with_offset)
                start_with_offset = stop_with_offset

                stop = stop + data.shape[0]
                cur_slice = slice(start, stop)
                start = stop

                def _index(
                    key,
                    val,
                    keys_to_expand=keys_to_expand,
                    cur_slice=cur_slice,
                    cur_slice_offset=cur_slice_offset,
                ):
                    if key in keys_to_expand:
                        return val[cur_slice_offset]
                    return val[cur_slice]

                out_slice = output.named_apply(_index, nested_keys=True)
                self._call(
                    data=data_slice,
                    output=out_slice,
                    is_full=is_full,
                    shift=shift,
                    done=done_slice,
                    total_keys=total_keys,
                    keys_to_expand=keys_to_expand,
                )
        return output

    def _call(self, *, data, output, is_full, shift, done, total_keys, keys_to_expand):
        # capture for each item in data where the observation should be written
        idx = torch.arange(data.shape[0])
        idx_done = (idx + done.cumsum(0))[done]
        idx += torch.nn.functional.pad(done, [1, 0])[:-1].cumsum(0)

        for key in total_keys:
            if key in (self.done_keys.union(self.reward_keys)):
                entry = data.get(("next", key))
            else:
                entry = data.get(key)

            if key in keys_to_expand:
                mmap = output.get(key)
                shifted_next = data.get(("next", key))
                if is_full:
                    _roll_inplace(entry, shift=-shift, out=mmap, index_dest=idx)
                    _roll_inplace(
                        shifted_next,
                        shift=-shift,
                        out=mmap,
                        index_dest=idx_done,
                        index_source=done,
                    )
                else:
                    mmap[idx] = entry
                    mmap[idx_done] = shifted_next[done]
            elif is_full:
                mmap = output.get(key)
                _roll_inplace(entry, shift=-shift, out=mmap)
            else:
                mmap = output.get(key)
                mmap.copy_(entry)
        return output


class Flat2TED:
    """A storage loading hook to deserialize flattened TED data to TED format.

    Args:
        done_key (NestedKey, optional): the key where the done states should be read.
            Defaults to ``("next", "done")``.
        shift_key (NestedKey, optional): the key where the shift will be written.
            Defaults to "shift".
        is_full_key (NestedKey, optional): the key where the is_full attribute will be written.
            Defaults to "is_full".
        done_keys (Tuple[NestedKey], optional): a tuple of nested keys indicating the done entries.
            Defaults to :data:`DEFAULT_DONE_KEYS`, i.e.
            ``("done", "truncated", "terminated")``.
        reward_keys (Tuple[NestedKey], optional): a tuple of nested keys indicating the reward entries.
            Defaults to ("reward",)

    Examples:
        >>> from functional_rb.adapters import ReplayBuffer, LazyMemmapStorage, Flat2TED
        >>> rb_load = ReplayBuffer(storage=LazyMemmapStorage(200))
        >>> rb_load.register_load_hook(Flat2TED())
        >>> rb_load.loads(path)                  # also reads dumps written by TorchRL

    """

    def __init__(
        self,
        done_key="done",
        shift_key="shift",
        is_full_key="is_full",
        done_keys=DEFAULT_DONE_KEYS,
        reward_keys=("reward",),
    ):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = {unravel_key(key) for key in done_keys}
        self.reward_keys = {unravel_key(key) for key in reward_keys}

    def __call__(self, data: TensorDictBase, out: TensorDictBase = None):
        _storage_shape = data.get_non_tensor("_storage_shape", default=None)
        if isinstance(_storage_shape, int):
            _storage_shape = torch.Size([_storage_shape])
        shift = data.get_non_tensor(self.shift_key, default=None)
        is_full = data.get_non_tensor(self.is_full_key, default=None)
        done = (
            data.get("done")
            .reshape((*_storage_shape[1:], -1))
            .contiguous()
            .permute(-1, *range(0, len(_storage_shape) - 1))
            .clone()
        )
        if not is_full:
            # shift is the cursor place
            done[shift - 1] = True
        else:
            # done = done.roll(-shift, dims=0)
            done[-1] = True

        if _storage_shape is not None and len(_storage_shape) > 1:
            # iterate over data and allocate
            if out is None:
                # out = TensorDict(batch_size=_storage_shape)
                # for i in range(out.ndim):
                #     if i >= 2:
                #         # FLattening the lazy stack will make the data unavailable - we need to find a way to make this
                #         # possible.
                #         raise RuntimeError(
                #             "Checkpointing an uninitialized buffer with more than 2 dimensions is currently not supported. "
                #             "Please file an issue on GitHub to ask for this feature!"
                #         )
                #     out = LazyStackedTensorDict(*out.unbind(i), stack_dim=i)
                out = TensorDict(batch_size=_storage_shape)
                for i in range(1, out.ndim):
                    if i >= 2:
                        # FLattening the lazy stack will make the data unavailable - we need to find a way to make this
                        # possible.
                        raise RuntimeError(
                            "Checkpointing an uninitialized buffer with more than 2 dimensions is currently not supported. "
                            "Please file an issue on GitHub to ask for this feature!"
                        )
                    out_list = [
                        out._get_sub_tensordict((slice(None),) * i + (j,))
                        for j in range(out.shape[i])
                    ]
                    out = lazy_stack(out_list, i)

            # Create a function that reads slices of the input data
            with out.flatten(1, -1) if out.ndim > 2 else contextlib.nullcontext(
                out
            ) as out_flat:
                nsteps = done.shape[0]
                n_elt_batch = done.shape[1:].numel()
                traj_per_dim = done.sum(0)

                start = 0
                start_with_offset = start
                stop_with_offset = 0
                stop = 0

                for out_unbound, traj_for_dim in zip(out_flat.unbind(-1), traj_per_dim):
                    stop_with_offset = stop_with_offset + nsteps + traj_for_dim
                    cur_slice_offset = slice(start_with_offset, stop_with_offset)
                    start_with_offset = stop_with_offset

                    stop = stop + nsteps
                    cur_slice = slice(start, stop)
                    start = stop

                    def _index(
                        key,
                        val,
                        cur_slice=cur_slice,
                        nsteps=nsteps,
                        n_elt_batch=n_elt_batch,
                        cur_slice_offset=cur_slice_offset,
                    ):
                        if val.shape[0] != (nsteps * n_elt_batch):
                            return val[cur_slice_offset]
                        return val[cur_slice]

                    data_slice = data.named_apply(
                        _index, nested_keys=True, batch_size=[]
                    )
                    self._call(
                        data=data_slice,
                        out=out_unbound,
                        is_full=is_full,
                        shift=shift,
                        _storage_shape=_storage_shape,
                    )
            return out
        return self._call(
            data=data,
            out=out,
            is_full=is_full,
            shift=shift,
            _storage_shape=_storage_shape,
        )

    def _call(self, *, data, out, _storage_shape, shift, is_full):
        done = data.get(self.done_key)
        done = done.clone()

        nsteps = done.shape[0]

        # capture for each item in data where the observation should be written
        idx = torch.arange(done.shape[0])
        padded_done = F.pad(done.squeeze(-1), [1, 0])
        root_idx = idx + padded_done[:-1].cumsum(0)
        next_idx = root_idx + 1

        if out is None:
            out = TensorDict(batch_size=[nsteps])

        def maybe_roll(entry, out=None):
            if is_full and shift is not None:
                if out is not None:
                    _roll_inplace(entry, shift=shift, out=out)
                    return
                else:
                    return entry.roll(shift, dims=0)
            if out is not None:
                out.copy_(entry)
                return
            return entry

        root_idx = maybe_roll(root_idx)
        next_idx = maybe_roll(next_idx)
        if not is_full:
            next_idx = next_idx[:-1]

        for key, entry in data.items(True, True):
            if entry.shape[0] == nsteps:
                if key in (self.done_keys.union(self.reward_keys)):
                    if key != "reward" and key not in out.keys(True, True):
                        # Create a done state at the root full of 0s
                        out.set(key, torch.zeros_like(entry), inplace=True)
                    entry = maybe_roll(entry, out=out.get(("next", key), None))
                    if entry is not None:
                        out.set(("next", key), entry, inplace=True)
                else:
                    # action and similar
                    entry = maybe_roll(entry, out=out.get(key, default=None))
                    if entry is not None:
                        # then out is not locked
                        out.set(key, entry, inplace=True)
            else:
                dest_next = out.get(("next", key), None)
                if dest_next is not None:
                    if not is_full:
                        dest_next = dest_next[:-1]
                    dest_next.copy_(entry[next_idx])
                else:
                    if not is_full:
                        val = entry[next_idx]
                        val = torch.cat([val, torch.zeros_like(val[:1])])
                        out.set(("next", key), val, inplace=True)
                    else:
                        out.set(("next", key), entry[next_idx], inplace=True)

                dest = out.get(key, None)
                if dest is not None:
                    dest.copy_(entry[root_idx])
                else:
                    out.set(key, entry[root_idx], inplace=True)
        return out



def _roll_inplace(tensor, shift, out, index_dest=None, index_source=None):
    # slice 0
    source0 = tensor[:-shift]
    if index_source is not None:
        source0 = source0[index_source[shift:]]

    slice0_shift = source0.shape[0]
    if index_dest is not None:
        out[index_dest[-slice0_shift:]] = source0
    else:
        slice0 = out[-slice0_shift:]
        slice0.copy_(source0)

    # slice 1
    source1 = tensor[-shift:]
    if index_source is not None:
        source1 = source1[index_source[:shift]]
    if index_dest is not None:
        out[index_dest[:-slice0_shift]] = source1
    else:
        slice1 = out[:-slice0_shift]
        slice1.copy_(source1)
    return out
