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

Nested and H5 hooks
-------------------

TorchRL's nested and H5 storage formats for TED data: one row (or H5 group) per trajectory.

Hooks (TorchRL 0.14's names and signatures)::

    TED2Nested(done_key=("next", "done"), shift_key="shift", is_full_key="is_full",
               done_keys=DEFAULT_DONE_KEYS, reward_keys=("reward",))
        hook(data, path=None) -> nested TensorDict      # save hook; hook.shift, hook.is_full
    Nested2TED(done_key="done", ...)   hook(nested, out=None) -> TED TensorDict   # load hook
    H5Split()                          hook(nested) -> {"traj_<i>": TensorDict, ...}
    H5Combine()                        hook(split, out=None) -> nested TensorDict

Checkpointers::

    NestedStorageCheckpointer(done_keys=None, reward_keys=None)
    H5StorageCheckpointer(*, checkpoint_file="checkpoint.h5", done_keys=None,
                          reward_keys=None, h5_kwargs=None, **ted_kwargs)

The nested layout starts from :class:`TED2Flat`'s flat
layout (``N = R * T`` rows, the rows of ``R`` time lines of ``T`` steps, oldest first) and cuts
it into trajectories. A trajectory ends at a row whose done flag (the flat ``done`` entry, any
element) is set, at the step written last (line position ``shift - 1`` when the storage is not
full) and at the end of each line. A trajectory of ``L`` steps holds ``L`` rows of every
``[N, ...]`` entry and ``L + 1`` rows of every ``[N + E, ...]`` entry (the observations) when
its last row is one of TED2Flat's ends (a done row or the step written last), ``L`` otherwise.

- Nested (``NestedStorageCheckpointer``; a directory): a memory-mapped TensorDict of batch
  ``[n_traj]`` in tensordict's format: per entry ``<key>.memmap`` (the flat entry's bytes,
  unchanged) and ``<key>.shape.memmap`` (int64 ``[n_traj, ndim]``: each trajectory's shape;
  ``meta.json`` marks the entry ``"is_nested": true``), the non-tensor entries ``shift``,
  ``is_full`` and ``_storage_shape`` as sub-directories, and ``storage_metadata.json``
  (``{"metadata": {}, "is_pytree": false, "len": len(storage)}``).
- H5 (``H5StorageCheckpointer``; one file, ``<path>/checkpoint.h5`` or ``path`` itself when it
  ends with ``.h5``): one group ``traj_<i>`` per trajectory (``i`` zero-padded to
  ``ceil(log10(n_traj))`` digits, so that the names sort in trajectory order) holding one
  dataset per entry (nested keys are sub-groups), and the scalar datasets ``_len``, ``shift``,
  ``is_full`` and ``_storage_shape`` in tensordict's non-tensor encoding (an HDF5 opaque type
  over the NumPy value).

Both load back through :class:`Flat2TED`, so the round trip
returns the storage as :class:`~functional_rb.adapters.checkpointers.FlatStorageCheckpointer`
does (same assumptions: root done entries all False, ``("next", obs)`` of a step equal to the
next step's ``obs`` within a trajectory).

Differences from TorchRL 0.14 (same files for the same valid data):

- ``h5_kwargs`` (e.g. ``compression="gzip"``) are given to the datasets of the trajectories
  only; TorchRL gives them to the scalar metadata datasets too, which h5py refuses ("Scalar
  datasets don't support chunk/filter options"), so TorchRL cannot write a compressed file.
  TorchRL reads ours.
- A trajectory's extra observation row follows TED2Flat's ends (above); TorchRL's TED2Nested
  adds none to the trajectory that closes a line of a storage that is not full, even when its
  last (unwritten) row holds a True done flag, so its shapes then miss a row of the file.
- ``ndim=2`` storages whose ring wrapped: TorchRL 0.14 does not reload its own dumps of those
  correctly (its Flat2TED); ours reloads both its dumps and ours.
- Loading an H5 file reads it whole into memory (TorchRL stages it in temporary memory maps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase, unravel_key
from tensordict.utils import NestedKey

from functional_rb._internal.lazy import lazy_module

_core = lazy_module("functional_rb.adapters._utils.core")  # the core's flat <-> TED (JAX)

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
"""The entries whose True value ends a trajectory (under ``"next"`` in TorchRL's layout):
TorchRL's ``torchrl.data.DEFAULT_DONE_KEYS``. Defined here, the lowest module that uses it (the
checkpointers import this one; :mod:`functional_rb.adapters.boundaries` imports the slice
samplers, whose storages import the checkpointers)."""

__all__ = [
    "DEFAULT_DONE_KEYS",
    "DEFAULT_REWARD_KEYS",
    "Flat2TED",
    "H5Combine",
    "H5Split",
    "Nested2TED",
    "TED2Flat",
    "TED2Nested",
]

DEFAULT_REWARD_KEYS = ("reward",)
STORAGE_SHAPE_KEY = "_storage_shape"

Key = tuple  # a nested TensorDict key as a tuple of str

# dtypes NumPy lacks travel as same-width integers (a bit view, no copy)
_BIT_VIEWS = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = torch.uint8


def _key_set(keys, name: str) -> set:
    """TorchRL's form of ``done_keys`` / ``reward_keys``: a set of unravelled keys (a
    one-element tuple becomes its string)."""
    if isinstance(keys, str):  # (a str would be read as its characters)
        raise TypeError(
            f"{name} must be a collection of keys, got the single key {keys!r}; pass ({keys!r},)."
        )
    return {unravel_key(k) for k in keys}


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


def _tensor(x: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
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

    Args:
      done_key: the TED done flag the trajectories are cut at.
      shift_key: the flat entry holding ``shift``.
      is_full_key: the flat entry holding ``is_full``.
      done_keys: the ``"next"`` entries that are done flags (stored once per step).
      reward_keys: the ``"next"`` entries that are rewards (stored once per step).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (FlatStorageCheckpointer, LazyTensorStorage,
        ...                                     TensorDictReplayBuffer)
        >>> rb = TensorDictReplayBuffer(
        ...     storage=LazyTensorStorage(10, checkpointer=FlatStorageCheckpointer()))
        >>> done = torch.tensor([[False], [True], [False], [True]])
        >>> index = rb.extend(TensorDict({"obs": torch.arange(4.0), "next": TensorDict(
        ...     {"obs": torch.arange(1.0, 5.0), "done": done, "terminated": done,
        ...      "truncated": torch.zeros(4, 1, dtype=torch.bool),
        ...      "reward": torch.ones(4, 1)}, [4])}, [4]))
        >>> rb.dumps(tempfile.mkdtemp())  # saved flat: TED2Flat is its save hook
    """

    def __init__(
        self,
        done_key: NestedKey = ("next", "done"),
        shift_key: NestedKey = "shift",
        is_full_key: NestedKey = "is_full",
        done_keys: Sequence[NestedKey] = DEFAULT_DONE_KEYS,
        reward_keys: Sequence[NestedKey] = DEFAULT_REWARD_KEYS,
    ):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = _key_set(done_keys, "done_keys")
        self.reward_keys = _key_set(reward_keys, "reward_keys")
        self.shift: int | None = None
        self.is_full: bool | None = None

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        """``data``: the whole storage, batch ``[T, *B]``. ``path`` (where the checkpointer
        writes the result) is accepted for TorchRL's interface; the result is built in memory."""
        if self.shift is None or self.is_full is None:
            raise RuntimeError(
                "TED2Flat: hook.shift and hook.is_full are unset; the "
                "checkpointer sets them (dump_storage(..., last_cursor=...) or a "
                "TorchRL storage's dumps)."
            )
        if "next" not in data.keys():
            raise KeyError(
                "TED2Flat: the data has no 'next' entry; TED data (TorchRL's "
                "collector output) keeps each step's successor entries under "
                "'next'. Remove the hook for data that is not TED."
            )
        shape = list(data.batch_size)
        shift, is_full = int(self.shift), bool(self.is_full)
        arrays, dtypes = _numpy_leaves(data)
        # [T, *B, ...] -> [T, R, ...]: the core reads TorchRL's time-major order in place
        steps, lines = shape[0], _numel(shape[1:])
        arrays = {k: v.reshape((steps, lines) + v.shape[len(shape) :]) for k, v in arrays.items()}
        flat_np = _core.ted_to_flat_lines(
            arrays,
            _key(self.done_key),
            shift,
            is_full,
            self.done_keys,
            self.reward_keys,
            "TED2Flat",
            time_major=True,
        )
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

    Args:
      done_key: the flat key of the done flags (the ``"next"`` done values).
      shift_key: the flat entry holding ``shift``.
      is_full_key: the flat entry holding ``is_full``.
      done_keys: the ``"next"`` entries that are done flags.
      reward_keys: the ``"next"`` entries that are rewards.

    Example:
        >>> from functional_rb.adapters import Flat2TED, TED2Flat
        >>> Flat2TED().done_key, TED2Flat().done_key
        ('done', ('next', 'done'))
    """

    def __init__(
        self,
        done_key: NestedKey = "done",
        shift_key: NestedKey = "shift",
        is_full_key: NestedKey = "is_full",
        done_keys: Sequence[NestedKey] = DEFAULT_DONE_KEYS,
        reward_keys: Sequence[NestedKey] = DEFAULT_REWARD_KEYS,
    ):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = _key_set(done_keys, "done_keys")
        self.reward_keys = _key_set(reward_keys, "reward_keys")

    def __call__(self, data: TensorDictBase, out: TensorDictBase | None = None) -> TensorDictBase:
        """``data``: a flat TensorDict (batch ``[]``). Returns the TED storage ``[T, *B]``; with
        ``out`` (a TED TensorDict of that batch) the values are written into ``out`` in place
        (its other keys are kept) and ``out`` is returned."""
        for key in (self.shift_key, self.is_full_key, STORAGE_SHAPE_KEY):
            if key not in data.keys():
                raise KeyError(
                    f"Flat2TED: the data has no {key!r} entry, so it was not "
                    "written by TED2Flat; load it without the Flat2TED hook."
                )
        shift = int(_plain(data.get(self.shift_key)))
        is_full = bool(_plain(data.get(self.is_full_key)))
        shape = [int(s) for s in _plain(data.get(STORAGE_SHAPE_KEY))]
        arrays, dtypes = _numpy_leaves(data)
        ted_np = _core.flat_to_ted_lines(
            arrays,
            shape,
            shift,
            is_full,
            _key(self.done_key),
            self.done_keys,
            self.reward_keys,
            "saved",
            "Flat2TED",
            time_major=True,
        )
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


# =========================================================================== nested, H5
TRAJ_PREFIX = "traj_"
LEN_KEY = "_len"


def _tensor_items(td) -> list:
    """``[(tuple key, tensor)]`` of ``td``'s tensor leaves (non-tensor entries left out)."""
    return [(_key(k), v) for k, v in td.items(True, True) if isinstance(v, torch.Tensor)]


def _plain_value(value):
    """A non-tensor entry's Python value (NonTensorData, NumPy scalar or array, tensor)."""
    value = getattr(value, "data", value)
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    return value


# --------------------------------------------------------------------------- trajectories
def _trajectory_rows(flat: TensorDictBase, done_key, shape, shift: int, is_full: bool):
    """``(lengths, extra)``: int64 ``[n_traj]`` steps per trajectory in flat row order, and
    1 where the trajectory also holds its last step's successor observation (one of
    TED2Flat's ends), else 0."""
    if done_key not in flat.keys(True, True):
        raise KeyError(
            f"TED2Nested: the flat data has no {done_key!r} entry to cut "
            "trajectories at; pass done_key=('next', <your done key>)."
        )
    steps, lines = int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))
    done = flat.get(done_key).detach().cpu().reshape(lines * steps, -1).any(-1).numpy()
    done = done.reshape(lines, steps)
    last_written = np.zeros_like(done)
    last_written[:, (steps - 1) if is_full else (shift - 1)] = True
    flat_end = done | last_written  # TED2Flat's ends: one successor row each
    cut = flat_end.copy()
    cut[:, -1] = True  # a trajectory never runs past its line
    stops = np.flatnonzero(cut.reshape(-1))
    lengths = np.diff(np.concatenate([[-1], stops]))
    extra = flat_end.reshape(-1)[stops].astype(np.int64)
    return lengths.astype(np.int64), extra


def _shapes(per_traj: np.ndarray, value: torch.Tensor) -> torch.Tensor:
    """int64 ``[n_traj, value.ndim]``: each trajectory's shape (its rows, then the features)."""
    feature = np.broadcast_to(
        np.asarray(value.shape[1:], np.int64), (per_traj.shape[0], value.dim() - 1)
    )
    return torch.from_numpy(np.concatenate([per_traj[:, None], feature], 1))


class TED2Nested(TED2Flat):
    """Save hook: TED storage ``[T, *B]`` -> TensorDict of batch ``[n_traj]`` whose entries are
    nested tensors (one row per trajectory; layout in the module docstring).

    With ``path`` the result is memory-mapped there (the checkpointer's directory) in
    tensordict's format; without it, the nested tensors are views of the flat data in memory.
    ``shift`` and ``is_full`` are set on the hook by the checkpointer, as for ``TED2Flat``.

    Args:
      *args: :class:`TED2Flat`'s arguments.
      **kwargs: :class:`TED2Flat`'s arguments.
    """

    def __init__(self, *args, **kwargs):
        if not hasattr(torch, "_nested_compute_contiguous_strides_offsets"):
            raise ValueError(
                f"Unsupported torch version {torch.__version__}: "
                f"torch>=2.4 is required for {type(self).__name__}."
            )
        super().__init__(*args, **kwargs)

    def _flat_done_key(self) -> tuple:
        key = _key(self.done_key)
        return key[1:] if key[0] == "next" and len(key) > 1 else key

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        flat = super().__call__(data)
        shape = list(data.batch_size)
        shift, is_full = int(self.shift), bool(self.is_full)
        lengths, extra = _trajectory_rows(flat, self._flat_done_key(), shape, shift, is_full)
        n_rows, n_traj = int(lengths.sum()), int(lengths.shape[0])
        items = _tensor_items(flat)
        shapes = {}
        for key, value in items:
            per = lengths if value.shape[0] == n_rows else lengths + extra
            if int(per.sum()) != value.shape[0]:
                raise RuntimeError(
                    f"TED2Nested: flat entry {key} has {value.shape[0]} rows; "
                    f"its {n_traj} trajectories span {int(per.sum())}."
                )
            shapes[key] = _shapes(per, value)
        meta = {
            k: _plain_value(flat.get(k))
            for k in (self.shift_key, self.is_full_key, STORAGE_SHAPE_KEY)
        }
        out = TensorDict(batch_size=[n_traj])
        for k, v in meta.items():
            out.set_non_tensor(k, v)
        if path is None:
            for key, value in items:
                out.set(
                    key,
                    MemoryMappedTensor.from_storage(
                        value.untyped_storage(), shape=shapes[key], dtype=value.dtype
                    ),
                )
            return out
        # tensordict writes a nested entry as the raw buffer of its rows plus a shape file:
        # the flat files written here are that buffer, so they are written once.
        mapped = flat.memmap(Path(path), copy_existing=True)
        out.memmap_(Path(path))
        for key, _ in items:
            buffer = mapped.get(key)
            out.make_memmap_from_storage(
                key, buffer.untyped_storage(), dtype=buffer.dtype, shape=shapes[key]
            )
        return out


def _flat_buffer(value: torch.Tensor) -> torch.Tensor:
    """A nested ``[n_traj, L_i, *F]`` tensor as the ``[sum L_i, *F]`` tensor of its rows."""
    if not value.is_nested:
        return value.reshape(-1, *value.shape[2:])
    if value.layout == torch.jagged:
        return value.values()
    feature = [value.size(i) for i in range(2, value.dim())]
    # the whole buffer: a TorchRL file may hold rows past its last trajectory's shape
    rows = torch.empty(0, dtype=value.dtype, device=value.device).set_(value.untyped_storage())
    return rows.view(-1, *feature)


class Nested2TED(Flat2TED):
    """Load hook: nested TensorDict (one row per trajectory) -> TED storage ``[T, *B]``; with
    ``out`` (the storage's data) the values are written into it in place.
    """

    def __call__(self, data: TensorDictBase, out: TensorDictBase | None = None) -> TensorDictBase:
        flat = TensorDict(batch_size=[])
        for key, value in _tensor_items(data):
            flat.set(key, _flat_buffer(value))
        for key, value in data.non_tensor_items():
            flat.set_non_tensor(key, _plain_value(value))
        if STORAGE_SHAPE_KEY in flat.keys() and out is not None:
            saved = [int(s) for s in _plain_value(flat.get(STORAGE_SHAPE_KEY))]
            if saved != list(out.batch_size):
                raise RuntimeError(
                    f"Nested2TED: the dump holds a storage of shape {saved}; "
                    f"the storage to fill has shape {list(out.batch_size)}. "
                    "Load into a buffer built like the one that was dumped "
                    "(same capacity and ndim)."
                )
        return super().__call__(flat, out=out)


# --------------------------------------------------------------------------- H5 hooks
class H5Split(TED2Flat):
    """Save hook: nested TensorDict -> TensorDict ``{"traj_<i>": trajectory i}`` plus the
    non-tensor metadata, the layout :class:`H5StorageCheckpointer` writes to HDF5.

    (A ``TED2Flat`` subclass as in TorchRL, so checkpointers set ``shift`` / ``is_full`` on it;
    it does not read them.)
    """

    def __call__(self, data: TensorDictBase, path=None) -> TensorDictBase:
        del path
        n_traj = int(data.batch_size[0]) if data.batch_dims else 0
        if n_traj < 1:
            raise ValueError(
                "H5Split: the data holds no trajectory; it takes TED2Nested's "
                "output (a TensorDict of batch [n_traj])."
            )
        digits = math.ceil(math.log10(n_traj))
        rows = {key: value.unbind(0) for key, value in _tensor_items(data)}
        result = TensorDict()
        for i in range(n_traj):
            traj = TensorDict()
            for key, parts in rows.items():
                traj.set(key, parts[i])
            result.set(f"{TRAJ_PREFIX}{str(i).zfill(digits)}", traj)
        for key, value in data.non_tensor_items():
            result.set_non_tensor(key, _plain_value(value))
        return result


def _traj_number(name: str) -> int:
    try:
        return int(name[len(TRAJ_PREFIX) :])
    except ValueError:
        raise KeyError(f"H5Combine: entry {name!r} is not named traj_<number>.") from None


class H5Combine:
    """Load hook: the H5 layout (a ``PersistentTensorDict`` or any TensorDict with
    ``traj_<i>`` sub-TensorDicts) -> nested TensorDict of batch ``[n_traj]`` (in memory) with
    the other entries as non-tensor metadata. ``out`` is accepted and ignored (as TorchRL's)."""

    def __call__(self, data, out=None) -> TensorDictBase:
        del out
        names = sorted((k for k in data.keys() if k.startswith(TRAJ_PREFIX)), key=_traj_number)
        if not names:
            raise KeyError(
                "H5Combine: the data has no traj_<i> entry, so it was not written "
                "by H5Split / H5StorageCheckpointer."
            )
        trajs = [data.get(name) for name in names]
        keys = [k for k, _ in _tensor_items(trajs[0])]
        result = TensorDict(batch_size=[len(trajs)])
        for key in keys:
            parts = [torch.as_tensor(t.get(key)) for t in trajs]
            buffer = torch.cat(parts).contiguous()
            shapes = torch.tensor([list(p.shape) for p in parts], dtype=torch.int64)
            result.set(
                key,
                MemoryMappedTensor.from_storage(
                    buffer.untyped_storage(), shape=shapes, dtype=buffer.dtype
                ),
            )
        for name in data.keys():
            if not name.startswith(TRAJ_PREFIX):
                result.set_non_tensor(name, _plain_value(data.get(name)))
        return result
