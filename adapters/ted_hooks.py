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
  ``is_full_key`` (bool) and ``"_storage_shape"`` (the storage batch shape: a tuple, a list once reloaded).

``Flat2TED`` inverts it: for TED data (``next`` values equal the following step's root values
within a trajectory, root done entries False) the round trip gives the storage back, rows past
``len`` included. A row without a successor in its line that is not an end (the last slot of a
storage that is not full) gets zeros as its ``"next"`` values.

Differences from TorchRL 0.14's ``Flat2TED`` (same files, same valid data): it reloads full
``ndim=2`` dumps (TorchRL's loses rows there) and rows past ``len`` come back as they were saved.
``TED2Flat`` raises a ``KeyError`` naming the key where TorchRL fails with an ``AttributeError``:
a ``"next"`` key with no root counterpart that is not a done/reward key, or a root done key
without its ``"next"`` counterpart.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["DEFAULT_DONE_KEYS", "DEFAULT_REWARD_KEYS", "Flat2TED", "TED2Flat"]

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
DEFAULT_REWARD_KEYS = ("reward",)
STORAGE_SHAPE_KEY = "_storage_shape"

Key = tuple  # a nested TensorDict key as a tuple of str


def _key(key) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _tensor_keys(td: TensorDictBase) -> list[Key]:
    """Every tensor leaf of ``td`` as a tuple key (non-tensor entries left out)."""
    return [_key(k) for k, v in td.items(True, True) if isinstance(v, torch.Tensor)]


# --------------------------------------------------------------------------- time lines
def line_order(storage_shape: Sequence[int], shift: int, is_full: bool) -> torch.Tensor:
    """The storage row each flat row reads: int64 ``[N]``, ``N = prod(storage_shape)``.

    ``storage_shape = [T, *B]``; flat row ``p = r * T + j`` (env line ``r`` of ``R = prod(B)``,
    line position ``j``) reads storage row ``t * R + r`` of the row-major ``[T * R]`` view, with
    ``t = (j + shift) % T`` for a full ring (oldest first) and ``t = j`` otherwise.
    """
    steps, lines = storage_shape[0], _numel(storage_shape[1:])
    slot = torch.arange(steps)
    if is_full:
        slot = (slot + shift) % steps
    return (slot[None, :] * lines + torch.arange(lines)[:, None]).reshape(-1)


def last_written(storage_shape: Sequence[int], shift: int, is_full: bool) -> torch.Tensor:
    """bool ``[N]``: the flat rows holding the step written last (one per env line).

    That is line position ``T - 1`` for a full ring (its lines are rotated to end there) and
    ``shift - 1`` otherwise (none when nothing was written: ``shift == 0``).
    """
    steps, lines = storage_shape[0], _numel(storage_shape[1:])
    position = steps - 1 if is_full else shift - 1
    return (torch.arange(steps) == position).repeat(lines)


def trajectory_ends(done: torch.Tensor, storage_shape: Sequence[int], shift: int,
                    is_full: bool) -> torch.Tensor:
    """bool ``[N]``: the flat rows that end a trajectory (stored with their ``"next"`` row).

    ``done``: the done flags in flat row order, ``[N, ...]`` (any element set ends the row).
    """
    flags = done.reshape(done.shape[0], -1).any(-1)
    return flags | last_written(storage_shape, shift, is_full)


def root_positions(ends: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: where row ``i``'s root value lies in a ``[N + E]`` interleaved tensor.

    Each earlier end row added one extra row (its ``"next"`` value), so position ``i`` plus the
    number of ends before ``i``. An end row's ``"next"`` value is right after its root value.
    """
    ends = ends.long()
    return torch.arange(ends.shape[0]) + torch.cumsum(ends, 0) - ends


# --------------------------------------------------------------------------- key roles
class _Roles:
    """Which TED keys are stored how (tuple keys; ``"next"`` keys given without ``"next"``).

    - ``paired``: at the root and under ``"next"``: one interleaved ``[N + E]`` flat tensor.
    - ``from_next``: done/reward keys under ``"next"``: flat ``[N]`` tensors of next values.
    - ``plain``: other root keys: flat ``[N]`` tensors.
    """

    def __init__(self, data: TensorDictBase, done_keys, reward_keys, who: str):
        if "next" not in data.keys():
            raise KeyError(f"{who}: the data has no 'next' entry; TED data (TorchRL's collector "
                           "output) keeps each step's successor entries under 'next'. Remove "
                           "the hook for data that is not TED.")
        nxt = data.get("next")
        special = {_key(k) for k in (*done_keys, *reward_keys)}
        dones = {_key(k) for k in done_keys}
        root = [k for k in _tensor_keys(data) if k[0] != "next"]
        root_set = set(root)
        self.from_next, self.paired = [], []
        for key in _tensor_keys(nxt):
            if key in special:
                self.from_next.append(key)
            elif key in root_set:
                self.paired.append(key)
            else:
                raise KeyError(
                    f"{who}: {('next', *key)} has no root counterpart {key}. The flat format "
                    "stores a 'next' entry only as the following step's root entry (or as a "
                    "done/reward key). Add the key to reward_keys/done_keys, or store a root "
                    f"{key} entry too.")
        missing = [k for k in root if k in dones and k not in self.from_next]
        if missing:
            raise KeyError(f"{who}: root done key(s) {missing} have no 'next' counterpart; the "
                           "flat format stores done keys from 'next' only. Add "
                           f"{[('next', *k) for k in missing]} or drop the key from done_keys.")
        paired = set(self.paired)
        self.plain = [k for k in root if k not in paired and k not in dones]


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
        shape = list(data.batch_size)
        shift, is_full = int(self.shift), bool(self.is_full)
        roles = _Roles(data, self.done_keys, self.reward_keys, "TED2Flat")
        order = line_order(shape, shift, is_full)

        def lines(key: Key) -> torch.Tensor:  # [T, *B, ...] -> [N, ...] in flat row order
            x = data.get(key)
            return x.reshape(order.shape[0], *x.shape[len(shape):])[order]

        ends = trajectory_ends(lines(_key(self.done_key)), shape, shift, is_full)
        flat = TensorDict(batch_size=[], device=data.device)
        for key in roles.plain:
            flat.set(key, lines(key))
        for key in roles.from_next:
            flat.set(key, lines(("next", *key)))
        if roles.paired:
            at = root_positions(ends)
            for key in roles.paired:
                flat.set(key, interleave(lines(key), lines(("next", *key)), ends, at))
        flat.set_non_tensor(self.shift_key, shift)
        flat.set_non_tensor(self.is_full_key, is_full)
        flat.set_non_tensor(STORAGE_SHAPE_KEY, tuple(data.batch_size))
        return flat


def interleave(root: torch.Tensor, nxt: torch.Tensor, ends: torch.Tensor,
               at: torch.Tensor) -> torch.Tensor:
    """``[N + E, ...]``: ``root [N, ...]`` rows, each end row followed by its ``nxt`` row.

    ``ends``: bool ``[N]``; ``at = root_positions(ends)``.
    """
    out = root.new_zeros((root.shape[0] + int(ends.sum()), *root.shape[1:]))
    out[at] = root
    out[at[ends] + 1] = nxt[ends]
    return out


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
        rows = _numel(shape)
        order = line_order(shape, shift, is_full)
        ends = trajectory_ends(data.get(_key(self.done_key)), shape, shift, is_full)
        at = root_positions(ends)
        successor = ends | (torch.arange(rows) % shape[0] != shape[0] - 1)
        dones = {_key(k) for k in self.done_keys}
        to_next = dones | {_key(k) for k in self.reward_keys}

        def storage(x: torch.Tensor) -> torch.Tensor:  # [N, ...] flat order -> [T, *B, ...]
            back = torch.empty_like(x)
            back[order] = x
            return back.reshape(*shape, *x.shape[1:])

        ted = TensorDict(batch_size=shape, device=data.device)
        for key in _tensor_keys(data):
            x = data.get(key)
            if x.shape[0] == rows:
                if key in to_next:
                    ted.set(("next", *key), storage(x))
                    if key in dones:  # TED root done flags are False (steps are not done yet)
                        ted.set(key, torch.zeros(shape + list(x.shape[1:]), dtype=x.dtype))
                else:
                    ted.set(key, storage(x))
            elif x.shape[0] == rows + int(ends.sum()):
                root, nxt = deinterleave(x, at, successor)
                ted.set(key, storage(root))
                ted.set(("next", *key), storage(nxt))
            else:
                raise ValueError(
                    f"Flat2TED: {key} has {x.shape[0]} rows; expected {rows} (the storage "
                    f"{shape}) or {rows + int(ends.sum())} (one more per trajectory end). The "
                    "dump's done flags, shift or is_full do not match its data; was it written "
                    "with a different done_key?")
        if out is None:
            return ted
        out.update(ted, inplace=True)
        return out


def deinterleave(flat: torch.Tensor, at: torch.Tensor, successor: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat [N + E, ...]`` -> ``(root [N, ...], next [N, ...])``, the inverse of
    :func:`interleave`.

    A row's ``"next"`` value is the flat row after its root value: its own next row for an end,
    the following step's root value otherwise. ``successor``: bool ``[N]``, False for rows that
    have neither (zeros).
    """
    root = flat[at]
    nxt = flat[(at + 1).clamp(max=flat.shape[0] - 1)]
    keep = successor.reshape(-1, *([1] * (flat.ndim - 1)))
    return root, torch.where(keep, nxt, torch.zeros((), dtype=flat.dtype))


# --------------------------------------------------------------------------- small helpers
def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _plain(value):
    """A non-tensor entry's Python value (TensorDict may hand back a NonTensorData)."""
    value = getattr(value, "data", value)
    return value.tolist() if isinstance(value, torch.Tensor) else value
