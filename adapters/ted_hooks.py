"""TorchRL's ``TED2Flat`` / ``Flat2TED`` storage hooks: TED data on disk without duplicates.

Signatures (TorchRL's, a public interface)::

    TED2Flat(done_key=("next", "done"), shift_key="shift", is_full_key="is_full",
             done_keys=DEFAULT_DONE_KEYS, reward_keys=("reward",))
        hook(data, path=None) -> flat TensorDict          # save hook; hook.shift, hook.is_full
    Flat2TED(done_key="done", shift_key="shift", is_full_key="is_full",
             done_keys=DEFAULT_DONE_KEYS, reward_keys=("reward",))
        hook(flat, out=None) -> TED TensorDict            # load hook

``adapters.serialization.dump_storage`` / ``load_storage`` call them the way TorchRL's
``TensorStorageCheckpointer`` does (``dump_storage`` sets ``hook.shift`` and ``hook.is_full``),
and they work as TorchRL hooks too (``rb.register_save_hook(TED2Flat())``).

The TED layout (a storage of batch ``[T, *B]``: ``T`` ring slots over time, ``B`` envs when the
storage has ``ndim > 1``; ``B = []`` otherwise)::

    {"observation": o_t, "action": a_t, "done": ...,
     "next": {"observation": o_{t+1}, "reward": r_t, "done": d_t, ...}}

holds ``o_{t+1}`` twice: as ``("next", "observation")`` of step ``t`` and as ``"observation"`` of
step ``t+1``. The flat layout (byte-identical to what TorchRL 0.14 writes) keeps it once:

- Time lines: the storage is read env by env (``R = prod(B)`` lines of ``T`` steps, env-major),
  each line oldest step first: a full ring starts at slot ``shift`` (the slot after the one
  written last), a storage that is not full starts at slot 0 (rows past ``len`` are written too).
  Step ``j`` of line ``r`` is flat row ``p = r * T + j`` (``N = R * T`` rows).
- Trajectory ends: a row ends a trajectory when ``done_key`` is set (any element) or it is the
  step written last (line position ``T - 1`` when full, ``shift - 1`` otherwise).
- Keys: a key present both at the root and under ``"next"`` (and not a done/reward key) is one
  ``[N + E, ...]`` tensor (``E`` = number of ends): each row's root value, followed, for an end
  row only, by its ``"next"`` value. The ``"next"`` value of any other row is the following row's
  root value. Done and reward keys (``done_keys``, ``reward_keys``, matched on the whole key
  below ``"next"``) are ``[N, ...]`` tensors holding the ``"next"`` values (the root done values
  are dropped: TED root done entries are all False). Every other root key is ``[N, ...]``.
- The flat TensorDict has ``batch_size=[]`` and three non-tensor entries: ``shift_key`` (int),
  ``is_full_key`` (bool) and ``"_storage_shape"`` (the storage batch shape: a tuple; a list
  once reloaded).

``Flat2TED`` inverts it: for TED data (``next`` values equal the following step's root values
within a trajectory, root done entries False) the round trip gives the storage back, rows past
``len`` included. A row without a successor in its line that is not an end (the last slot of a
storage that is not full) gets zeros as its ``"next"`` values.

Differences from TorchRL 0.14's ``Flat2TED`` (same files, same valid data): it reloads every
full ``ndim=2`` dump (TorchRL's raises on those with ``shift == T``) and rows past ``len`` come
back as they were saved (scratch values in TorchRL's).
``TED2Flat`` raises a ``KeyError`` naming the key where TorchRL fails with an ``AttributeError``:
a ``"next"`` key with no root counterpart that is not a done/reward key, or a root done key
without its ``"next"`` counterpart.

The conversion itself is the core's (:func:`functional_rb.ted.ted_to_flat` /
:func:`functional_rb.ted.flat_to_ted`, NumPy); these hooks only move TensorDicts to NumPy views
and back (no copies on CPU), read the storage in TorchRL's ``[T, *B]`` order in place, and
write TorchRL's metadata entries. ``Flat2TED`` uses the core's ``past_len="saved"``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from functional_rb.ted_flat import flat_to_ted_lines, ted_to_flat_lines

__all__ = ["DEFAULT_DONE_KEYS", "DEFAULT_REWARD_KEYS", "Flat2TED", "H5Combine", "H5Split",
           "Nested2TED", "TED2Flat", "TED2Nested"]

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
DEFAULT_REWARD_KEYS = ("reward",)
STORAGE_SHAPE_KEY = "_storage_shape"

Key = tuple  # a nested TensorDict key as a tuple of str

# dtypes NumPy lacks travel as same-width integers (a bit view, no copy)
_BIT_VIEWS = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = torch.uint8


def _key(key) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _tensor_keys(td: TensorDictBase) -> list[Key]:
    """Every tensor leaf of ``td`` as a tuple key (non-tensor entries left out)."""
    return [_key(k) for k, v in td.items(True, True) if isinstance(v, torch.Tensor)]


def _numpy_leaves(td: TensorDictBase) -> tuple[dict, dict]:
    """``({key: ndarray view}, {key: torch dtype})`` of ``td``'s tensor leaves."""
    arrays, dtypes = {}, {}
    for key in _tensor_keys(td):
        x = td.get(key).detach()
        if x.device.type != "cpu":
            x = x.cpu()
        dtypes[key] = x.dtype
        if x.dtype in _BIT_VIEWS:
            x = x.view(_BIT_VIEWS[x.dtype])
        arrays[key] = x.numpy()
    return arrays, dtypes


def _tensor(x: np.ndarray, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``x`` as a tensor sharing its memory; ``dtype``: the source leaf's torch dtype (undoes
    the bit view of :func:`_numpy_leaves`)."""
    out = torch.from_numpy(x)
    if dtype in _BIT_VIEWS and out.dtype == _BIT_VIEWS[dtype]:
        out = out.view(dtype)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --------------------------------------------------------------------------- save hook
class TED2Flat:
    """Save hook: TED storage ``[T, *B]`` -> flat TensorDict (layout in the module docstring).

    ``shift`` (the slot after the one written last) and ``is_full`` are set on the hook before
    each call by the checkpointer (TorchRL's, or ``dump_storage``).
    """

    def __init__(self, done_key=("next", "done"), shift_key="shift", is_full_key="is_full",
                 done_keys=DEFAULT_DONE_KEYS, reward_keys=DEFAULT_REWARD_KEYS):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = done_keys
        self.reward_keys = reward_keys
        self.shift: Optional[int] = None
        self.is_full: Optional[bool] = None

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        """``data``: the whole storage, batch ``[T, *B]``. ``path`` (where the checkpointer
        writes the result) is accepted for TorchRL's interface; the result is built in memory."""
        if self.shift is None or self.is_full is None:
            raise RuntimeError("TED2Flat: hook.shift and hook.is_full are unset; the "
                               "checkpointer sets them (dump_storage(..., last_cursor=...) or a "
                               "TorchRL storage's dumps).")
        if "next" not in data.keys():
            raise KeyError("TED2Flat: the data has no 'next' entry; TED data (TorchRL's "
                           "collector output) keeps each step's successor entries under "
                           "'next'. Remove the hook for data that is not TED.")
        shape = list(data.batch_size)
        shift, is_full = int(self.shift), bool(self.is_full)
        arrays, dtypes = _numpy_leaves(data)
        # [T, *B, ...] -> [T, R, ...]: the core reads TorchRL's time-major order in place
        steps, lines = shape[0], _numel(shape[1:])
        arrays = {k: v.reshape((steps, lines) + v.shape[len(shape):])
                  for k, v in arrays.items()}
        flat_np = ted_to_flat_lines(arrays, _key(self.done_key), shift, is_full,
                                     self.done_keys, self.reward_keys, "TED2Flat",
                                     time_major=True)
        from_next = {_key(k) for k in (*self.done_keys, *self.reward_keys)}
        flat = TensorDict(batch_size=[], device=data.device)
        for key, x in flat_np.items():
            source = ("next", *key) if key in from_next else key
            flat.set(key, _tensor(x, dtypes.get(source)))
        flat.set_non_tensor(self.shift_key, shift)
        flat.set_non_tensor(self.is_full_key, is_full)
        flat.set_non_tensor(STORAGE_SHAPE_KEY, tuple(data.batch_size))
        return flat


# --------------------------------------------------------------------------- load hook
class Flat2TED:
    """Load hook: flat TensorDict -> TED storage ``[T, *B]`` (the inverse of :class:`TED2Flat`).

    ``done_key`` is the flat key of the done flags (the ``"next"`` done values).
    """

    def __init__(self, done_key="done", shift_key="shift", is_full_key="is_full",
                 done_keys=DEFAULT_DONE_KEYS, reward_keys=DEFAULT_REWARD_KEYS):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = done_keys
        self.reward_keys = reward_keys

    def __call__(self, data: TensorDictBase, out: Optional[TensorDictBase] = None
                 ) -> TensorDictBase:
        """``data``: a flat TensorDict (batch ``[]``). Returns the TED storage ``[T, *B]``; with
        ``out`` (a TED TensorDict of that batch) the values are written into ``out`` in place
        (its other keys are kept) and ``out`` is returned."""
        for key in (self.shift_key, self.is_full_key, STORAGE_SHAPE_KEY):
            if key not in data.keys():
                raise KeyError(f"Flat2TED: the data has no {key!r} entry, so it was not "
                               "written by TED2Flat; load it without the Flat2TED hook.")
        shift = int(_plain(data.get(self.shift_key)))
        is_full = bool(_plain(data.get(self.is_full_key)))
        shape = [int(s) for s in _plain(data.get(STORAGE_SHAPE_KEY))]
        arrays, dtypes = _numpy_leaves(data)
        ted_np = flat_to_ted_lines(arrays, shape, shift, is_full, _key(self.done_key),
                                    self.done_keys, self.reward_keys, "saved", "Flat2TED",
                                    time_major=True)
        ted = TensorDict(batch_size=shape, device=data.device)
        for key, x in ted_np.items():  # [T, R, ...] -> [T, *B, ...] (a view)
            x = x.reshape(shape + list(x.shape[2:]))
            ted.set(key, _tensor(x, dtypes.get(key[1:] if key[0] == "next" else key)))
        if out is None:
            return ted
        out.update(ted, inplace=True)
        return out


def _plain(value):
    """A non-tensor entry's Python value (TensorDict may hand back a NonTensorData)."""
    value = getattr(value, "data", value)
    return value.tolist() if isinstance(value, torch.Tensor) else value


def __getattr__(name):
    # The nested and H5 hooks build on the ones above (functional_rb.adapters._nested_h5).
    if name in ("TED2Nested", "Nested2TED", "H5Split", "H5Combine"):
        from functional_rb.adapters import _nested_h5
        return getattr(_nested_h5, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
