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
def to_lines(x: torch.Tensor, storage_shape: Sequence[int], shift: int,
             is_full: bool) -> torch.Tensor:
    """Storage ``[T, *B, ...]`` -> flat row order ``[N, ...]`` (``N = T * R``, ``R = prod(B)``).

    Flat row ``p = r * T + j`` is step ``j`` of env line ``r``: storage slot ``(j + shift) % T``
    for a full ring (oldest first), slot ``j`` otherwise.
    """
    steps, lines = storage_shape[0], _numel(storage_shape[1:])
    feature = x.shape[len(storage_shape):]
    x = x.reshape(steps, lines, *feature)
    if is_full and shift % steps:
        x = _rotate(x, shift % steps)
    return x.transpose(0, 1).reshape(steps * lines, *feature)


def from_lines(x: torch.Tensor, storage_shape: Sequence[int], shift: int,
               is_full: bool) -> torch.Tensor:
    """Flat row order ``[N, ...]`` -> storage ``[T, *B, ...]``; the inverse of :func:`to_lines`."""
    steps, lines = storage_shape[0], _numel(storage_shape[1:])
    feature = x.shape[1:]
    x = x.reshape(lines, steps, *feature).transpose(0, 1)
    if is_full and shift % steps:
        x = _rotate(x, steps - shift % steps)
    return x.reshape(*storage_shape, *feature)


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


def next_positions(at: torch.Tensor, ends: torch.Tensor, steps: int) -> torch.Tensor:
    """int64 ``[N]``: where row ``i``'s ``"next"`` value lies in a ``[N + E]`` interleaved tensor.

    Right after its root value: its own next row for an end, the following step's root value
    otherwise. -1 for a row with neither (the last slot of a line that does not end there: a
    storage that is not full), whose ``"next"`` values are loaded as zeros.
    """
    last_in_line = torch.arange(at.shape[0]) % steps == steps - 1
    return torch.where(ends | ~last_in_line, at + 1, -1)


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

        def lines(key: Key) -> torch.Tensor:
            return to_lines(data.get(key), shape, shift, is_full)

        ends = trajectory_ends(lines(_key(self.done_key)), shape, shift, is_full)
        flat = TensorDict(batch_size=[], device=data.device)
        for key in roles.plain:
            flat.set(key, lines(key))
        for key in roles.from_next:
            flat.set(key, lines(("next", *key)))
        if roles.paired:
            # per storage row: where its root value goes, and whether its next value follows
            at = from_lines(root_positions(ends), shape, shift, is_full).reshape(-1)
            with_next = from_lines(ends, shape, shift, is_full).reshape(-1)
            for key in roles.paired:
                root, nxt = (data.get(k) for k in (key, ("next", *key)))
                flat.set(key, interleave(root.reshape(-1, *root.shape[len(shape):]),
                                         nxt.reshape(-1, *nxt.shape[len(shape):]),
                                         at, with_next))
        flat.set_non_tensor(self.shift_key, shift)
        flat.set_non_tensor(self.is_full_key, is_full)
        flat.set_non_tensor(STORAGE_SHAPE_KEY, tuple(data.batch_size))
        return flat


def interleave(root: torch.Tensor, nxt: torch.Tensor, at: torch.Tensor,
               ends: torch.Tensor) -> torch.Tensor:
    """``[N + E, ...]``: the ``root [N, ...]`` rows at positions ``at`` (int64 ``[N]``), each
    end row's (bool ``ends [N]``) ``nxt [N, ...]`` row right after it.

    Rows may come in any order (one scatter pass, no rotated copy of the storage): ``at`` is
    :func:`root_positions` of the flat-order ends, taken to the same row order as the data.
    """
    out = root.new_empty((root.shape[0] + int(ends.sum()), *root.shape[1:]))
    out.index_copy_(0, at, root)
    out.index_copy_(0, at[ends] + 1, nxt[ends])
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
        ends = trajectory_ends(data.get(_key(self.done_key)), shape, shift, is_full)
        total = rows + int(ends.sum())
        at = root_positions(ends)
        # where each storage row's values are, as flat (or interleaved) row indices [N]
        from_flat = from_lines(torch.arange(rows), shape, shift, is_full).reshape(-1)
        from_root = from_lines(at, shape, shift, is_full).reshape(-1)
        from_next = from_lines(next_positions(at, ends, shape[0]), shape, shift,
                               is_full).reshape(-1)
        dones = {_key(k) for k in self.done_keys}
        to_next = dones | {_key(k) for k in self.reward_keys}

        no_next = torch.nonzero(from_next < 0)[:, 0]
        from_next = from_next.clamp(min=0)

        def storage(x: torch.Tensor, source: torch.Tensor, zero_rows=None) -> torch.Tensor:
            """Rows ``source`` of ``x [N or N + E, ...]`` -> ``[T, *B, ...]``."""
            out = x.index_select(0, source)
            if zero_rows is not None and zero_rows.numel():
                out[zero_rows] = 0
            return out.reshape(*shape, *x.shape[1:])

        ted = TensorDict(batch_size=shape, device=data.device)
        for key in _tensor_keys(data):
            x = data.get(key)
            if x.shape[0] == rows:
                if key in to_next:
                    ted.set(("next", *key), storage(x, from_flat))
                    if key in dones:  # TED root done flags are False (steps are not done yet)
                        ted.set(key, torch.zeros(shape + list(x.shape[1:]), dtype=x.dtype))
                else:
                    ted.set(key, storage(x, from_flat))
            elif x.shape[0] == total:
                ted.set(key, storage(x, from_root))
                ted.set(("next", *key), storage(x, from_next, no_next))
            else:
                raise ValueError(
                    f"Flat2TED: {key} has {x.shape[0]} rows; expected {rows} (the storage "
                    f"{shape}) or {total} (one more per trajectory end). The "
                    "dump's done flags, shift or is_full do not match its data; was it written "
                    "with a different done_key?")
        if out is None:
            return ted
        out.update(ted, inplace=True)
        return out


# --------------------------------------------------------------------------- small helpers
def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _rotate(x: torch.Tensor, first: int) -> torch.Tensor:
    """``x`` with row ``first`` moved to the front (``torch.roll(x, -first, 0)``, as two block
    copies: torch.roll gathers element by element and is several times slower)."""
    return torch.cat((x[first:], x[:first]))


def _plain(value):
    """A non-tensor entry's Python value (TensorDict may hand back a NonTensorData)."""
    value = getattr(value, "data", value)
    return value.tolist() if isinstance(value, torch.Tensor) else value
