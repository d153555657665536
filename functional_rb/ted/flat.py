"""TorchRL's TED <-> flat host format (``TED2Flat`` / ``Flat2TED``) on NumPy PyTrees.

:func:`ted_to_flat` / :func:`flat_to_ted` convert a whole storage's content (host functions:
the flat length depends on the number of episodes). :func:`ted_to_flat_lines` /
:func:`flat_to_ted_lines` are the same conversions on ``{key tuple: array}`` dicts in line
layout (or TorchRL's time-major storage order, read in place): what the torch hooks
``functional_rb.adapters.TED2Flat`` / ``Flat2TED`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from functional_rb._internal.tree import Key, normalize_key
from functional_rb._internal.tree import flat_items as _flat_items
from functional_rb._internal.tree import nest as _nest

PyTree = Any

__all__ = ("flat_to_ted", "flat_to_ted_lines", "ted_to_flat", "ted_to_flat_lines")


# ---------------------------------------------------------------------------- TED <-> flat
# The flat layout (TorchRL's TED2Flat / Flat2TED files, byte for byte), in this library's
# terms. A storage holds R env lines of T ring slots; here as arrays [R, T, ...] ("line
# layout": this library's [env, time] order; ndim=1 is R = 1). Read each line oldest step
# first (a full ring from slot `shift`, else from slot 0) and concatenate the lines: step j
# of line r is flat row p = r * T + j (N = R * T rows). A row ends a trajectory when its done
# flag is set or it is the step written last. A key present at the root and under "next" is
# stored once per row plus once more, right after it, for each end row ("paired": [N + E]);
# the "next" value of every other row is the following row's root value.
_FLAT_DONE_KEYS = ("done", "truncated", "terminated")
_FLAT_REWARD_KEYS = ("reward",)
_META = ("shift", "is_full", "_storage_shape")
_PAST_LEN = ("torchrl", "saved")


def _to_lines(x: np.ndarray, shift: int, is_full: bool) -> np.ndarray:
    """Line layout ``[R, T, ...]`` -> flat row order ``[R * T, ...]`` (oldest step first).

    A view when no rotation is needed; a rotated ring costs one copy (two block copies, not a
    gather)."""
    steps = x.shape[1]
    first = shift % steps if is_full and steps else 0
    if first:
        x = np.concatenate((x[:, first:], x[:, :first]), axis=1)
    return x.reshape((x.shape[0] * steps,) + x.shape[2:])


def _from_lines(x: np.ndarray, lines: int, shift: int, is_full: bool) -> np.ndarray:
    """Flat row order ``[R * T, ...]`` -> line layout ``[R, T, ...]``; inverts :func:`_to_lines`."""
    x = x.reshape((lines, x.shape[0] // max(lines, 1)) + x.shape[1:])
    steps = x.shape[1]
    first = shift % steps if is_full and steps else 0
    if first:
        x = np.concatenate((x[:, steps - first :], x[:, : steps - first]), axis=1)
    return x


def _line_position(lines: int, steps: int) -> np.ndarray:
    """int64 ``[R * T]``: each flat row's step within its line."""
    return np.tile(np.arange(steps), lines)


def _last_written(lines: int, steps: int, shift: int, is_full: bool) -> np.ndarray:
    """bool ``[R * T]``: the flat rows holding each line's newest step: line position ``T - 1``
    for a full ring (its lines are rotated to end there), ``shift - 1`` otherwise (none when
    ``shift == 0``: nothing written)."""
    return _line_position(lines, steps) == (steps - 1 if is_full else shift - 1)


def _done_flags(done: np.ndarray) -> np.ndarray:
    """bool ``[N]`` from done flags ``[N, ...]``: any element set."""
    done = np.asarray(done)
    return np.asarray(done.reshape(done.shape[0], -1).any(-1))


def _root_positions(ends: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: where flat row ``i``'s root value lies in a ``[N + E]`` paired leaf: ``i``
    plus the number of end rows before ``i`` (each stored one extra row, its "next" value)."""
    ends = ends.astype(np.int64)
    return np.arange(ends.shape[0]) + np.cumsum(ends) - ends


def _next_positions(at: np.ndarray, has_next: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: where flat row ``i``'s "next" value lies in a ``[N + E]`` paired leaf:
    right after its root value (its own next row for an end, the following row's root value
    otherwise), or -1 where ``has_next`` is False (loaded as zeros)."""
    return np.where(has_next, at + 1, -1)


def _roles(
    root_keys: Sequence[tuple], next_keys: Sequence[tuple], done_keys, reward_keys, who: str
):
    """Split TED keys by how the flat layout stores them (``next_keys`` without ``"next"``).

    Returns ``(plain, from_next, paired)``: other root keys (``[N]``), done/reward keys taken
    from ``"next"`` (``[N]``), keys at the root and under ``"next"`` (``[N + E]``)."""
    dones = _keyset(done_keys)
    special = dones | _keyset(reward_keys)
    root_set = set(root_keys)
    from_next, paired = [], []
    for key in next_keys:
        if key in special:
            from_next.append(key)
        elif key in root_set:
            paired.append(key)
        else:
            raise KeyError(
                f"{who}: {('next', *key)} has no root counterpart {key}. The flat format "
                "stores a 'next' entry only as the following step's root entry (or as a "
                "done/reward key). Add the key to reward_keys/done_keys, or store a root "
                f"{key} entry too."
            )
    missing = [k for k in root_keys if k in dones and k not in from_next]
    if missing:
        raise KeyError(
            f"{who}: root done key(s) {missing} have no 'next' counterpart; the "
            "flat format stores done keys from 'next' only. Add "
            f"{[('next', *k) for k in missing]} or drop the key from done_keys."
        )
    paired_set = set(paired)
    plain = [k for k in root_keys if k not in paired_set and k not in dones]
    return plain, from_next, paired


def _keyset(keys) -> set:
    return {normalize_key(k) for k in keys}


def ted_to_flat_lines(
    leaves: dict,
    done_key: tuple,
    shift: int,
    is_full: bool,
    done_keys,
    reward_keys,
    who: str,
    time_major: bool = False,
) -> dict:
    """The flat leaves ``{key tuple: [N or N + E, ...]}`` of TED leaves given in line layout
    ``{key tuple: [R, T, ...]}`` (arrays or array views), or ``[T, R, ...]`` with
    ``time_major`` (TorchRL's storage order; read in place). Ordered plain, from_next, paired."""

    def lines_of(x):
        return x.swapaxes(0, 1) if time_major else x

    if not any(k[0] == "next" for k in leaves):
        raise KeyError(
            f"{who}: the data has no 'next' entry; TED data (TorchRL's collector "
            "output) keeps each step's successor entries under 'next'. Remove the "
            "hook (or skip this conversion) for data that is not TED."
        )
    root_keys = [k for k in leaves if k[0] != "next"]
    next_keys = [k[1:] for k in leaves if k[0] == "next"]
    plain, from_next, paired = _roles(root_keys, next_keys, done_keys, reward_keys, who)
    if done_key not in leaves:
        raise KeyError(
            f"{who}: done_key {done_key} is not in the data (keys "
            f"{sorted(leaves)}); pass the key of the step's done flags."
        )
    done = lines_of(leaves[done_key])
    lines, steps = done.shape[0], done.shape[1]
    ends = _done_flags(_to_lines(done, shift, is_full)) | _last_written(
        lines, steps, shift, is_full
    )
    flat = {}
    for key in plain:
        flat[key] = _to_lines(lines_of(leaves[key]), shift, is_full)
    for key in from_next:
        flat[key] = _to_lines(lines_of(leaves[("next", *key)]), shift, is_full)
    if paired:
        # Scatter straight from the storage order (no rotated copy of the paired leaves): each
        # stored step's root row goes to `at`, an end's next row right after it.
        at = _from_lines(_root_positions(ends), lines, shift, is_full)  # [R, T]
        with_next = _from_lines(ends, lines, shift, is_full)  # [R, T]
        if time_major:
            at, with_next = at.T, with_next.T
        total = lines * steps + int(ends.sum())
        for key in paired:
            root, nxt = leaves[key], leaves[("next", *key)]
            out = np.empty((total,) + root.shape[2:], root.dtype)
            out[at] = root
            out[at[with_next] + 1] = nxt[with_next]
            flat[key] = out
    return flat


def ted_to_flat(
    data: PyTree,
    *,
    shift: int,
    is_full: bool,
    ndim: int = 1,
    done_key: Key = ("next", "done"),
    done_keys: Sequence[Key] = _FLAT_DONE_KEYS,
    reward_keys: Sequence[Key] = _FLAT_REWARD_KEYS,
) -> dict:
    """TorchRL's ``TED2Flat`` on a NumPy PyTree (a host function; sizes depend on the data).

    ``data`` is a storage's full content: nested dicts with leaves ``[T, ...]`` (``ndim=1``)
    or ``[num_envs, T, ...]`` (``ndim=2``, this library's ``[env, time]`` layout; TorchRL's
    ``[time, env]`` storage is its transpose). ``shift`` is the number of steps written before
    the cursor (TorchRL's ``last_cursor + 1``; for a functional_rb state
    ``((cursor - 1) % row_capacity) + 1``) and ``is_full`` whether the ring wrapped.

    Layout (byte-identical to TorchRL 0.14's files): each env line is read oldest step first
    (a full ring from slot ``shift``, else from slot 0; slots past the newest are written too)
    and the lines are concatenated, ``N = num_envs * T`` rows. A step ends a trajectory when
    ``done_key`` is set (any element) or it is its line's newest step. Returns a flat dict:

    - done and reward keys (``done_keys``, ``reward_keys``, matched on the whole key below
      ``"next"``): their ``"next"`` values, ``[N, ...]`` (root done keys are dropped);
    - keys at the root and under ``"next"``: ``[N + E, ...]`` (``E`` trajectory ends): each
      step's root value followed, for an end only, by its ``"next"`` value;
    - other root keys: ``[N, ...]``;
    - ``"shift"`` (int), ``"is_full"`` (bool), ``"_storage_shape"`` (tuple, TorchRL's
      ``[time, env]`` order).

    Raises ``KeyError`` naming the key for a ``"next"`` key with no root counterpart that is
    not a done/reward key, a root done key without its ``"next"`` counterpart, or no ``"next"``.
    """
    if ndim not in (1, 2):
        raise ValueError(f"ted_to_flat: ndim must be 1 or 2, got {ndim!r}.")
    leaves = {k: np.asarray(v) for k, v in _flat_items(data).items()}
    if ndim == 1:
        leaves = {k: v[None] for k, v in leaves.items()}
    flat = ted_to_flat_lines(
        leaves,
        normalize_key(done_key),
        int(shift),
        bool(is_full),
        done_keys,
        reward_keys,
        "ted_to_flat",
    )
    out = _nest(flat)
    out["shift"] = int(shift)
    out["is_full"] = bool(is_full)
    done = leaves[normalize_key(done_key)]
    out["_storage_shape"] = (done.shape[1],) if ndim == 1 else (done.shape[1], done.shape[0])
    return out


def flat_to_ted_lines(
    items: dict,
    storage_shape: Sequence[int],
    shift: int,
    is_full: bool,
    done_key: tuple,
    done_keys,
    reward_keys,
    past_len: str,
    who: str,
    time_major: bool = False,
) -> dict:
    """TED leaves ``{key tuple: [R, T, ...]}`` (line layout, ``R = prod(storage_shape[1:])``;
    ``[T, R, ...]`` with ``time_major``, gathered in that order, no transposed copy) from flat
    leaves ``{key tuple: [N or N + E, ...]}``. Ordered as the flat keys."""
    if past_len not in _PAST_LEN:
        raise ValueError(f"{who}: past_len must be one of {_PAST_LEN}, got {past_len!r}.")
    steps = int(storage_shape[0])
    lines = 1
    for s in storage_shape[1:]:
        lines *= int(s)
    rows = steps * lines
    if done_key not in items:
        raise KeyError(
            f"{who}: done_key {done_key} is not in the flat data (keys "
            f"{sorted(items)}); pass the flat key of the done flags."
        )
    flags = _done_flags(items[done_key])
    ends = flags | _last_written(lines, steps, shift, is_full)
    total = rows + int(ends.sum())
    at = _root_positions(ends)
    last_in_line = _line_position(lines, steps) == steps - 1
    if past_len == "saved":
        has_next = ends | ~last_in_line
    else:
        # TorchRL 0.14's Flat2TED reads positions from the stored done flags only, so past a
        # non-full line's newest step (whose end was forced on save) it reads one row early,
        # and the last slot of a non-full line always gets zeros as its next values.
        forced = (ends & ~flags).astype(np.int64).reshape(lines, steps)
        at = at - (np.cumsum(forced, axis=1) - forced).reshape(-1)
        has_next = ~last_in_line if not is_full else np.ones_like(last_in_line)
    nxt = _next_positions(at, has_next)
    # where each stored slot's values are, as flat (or paired) row indices, [R, T]
    from_flat = _from_lines(np.arange(rows), lines, shift, is_full)
    from_root = _from_lines(at, lines, shift, is_full)
    from_next = _from_lines(nxt, lines, shift, is_full)
    if time_major:
        from_flat, from_root, from_next = from_flat.T, from_root.T, from_next.T
    no_next = from_next < 0
    from_next = np.maximum(from_next, 0)
    dones = _keyset(done_keys)
    to_next = dones | _keyset(reward_keys)

    def take(x, source, zero=None):
        out = np.take(x, source, axis=0)
        if zero is not None and zero.any():
            out[zero] = 0
        return out

    ted = {}
    for key, x in items.items():
        if x.shape[0] == rows:
            if key in to_next:
                ted[("next", *key)] = take(x, from_flat)
                if key in dones:  # TED root done flags are False (steps are not done yet)
                    ted[key] = np.zeros(from_flat.shape + x.shape[1:], x.dtype)
            else:
                ted[key] = take(x, from_flat)
        elif x.shape[0] == total:
            ted[key] = take(x, from_root)
            ted[("next", *key)] = take(x, from_next, no_next)
        else:
            raise ValueError(
                f"{who}: {key} has {x.shape[0]} rows; expected {rows} (the storage "
                f"{list(storage_shape)}) or {total} (one more per trajectory end). The "
                "dump's done flags, shift or is_full do not match its data; was it written "
                "with a different done_key?"
            )
    return ted


def flat_to_ted(
    flat: PyTree,
    *,
    done_key: Key = "done",
    done_keys: Sequence[Key] = _FLAT_DONE_KEYS,
    reward_keys: Sequence[Key] = _FLAT_REWARD_KEYS,
    past_len: str = "torchrl",
) -> dict:
    """TorchRL's ``Flat2TED`` on a NumPy PyTree: the inverse of :func:`ted_to_flat`.

    ``flat``: the flat dict (with ``"shift"``, ``"is_full"``, ``"_storage_shape"``); ``done_key``
    its key of the done flags (the ``"next"`` done values). Returns TED nested dicts in storage
    order, leaves ``[T, ...]`` (``[num_envs, T, ...]`` when the flat data came from an
    ``ndim=2`` storage). For TED data (``"next"`` values equal the following step's root values
    within a trajectory) every written step comes back exactly; root done keys come back as
    zeros (the flat format keeps only the ``"next"`` ones). Full ``ndim=2`` dumps load too.

    ``past_len`` chooses the slots a non-full storage never wrote (past its newest step):
    ``"torchrl"`` (default): as TorchRL 0.14's ``Flat2TED`` gives them (read one row early,
    the last slot's ``"next"`` values zeros); ``"saved"``: as they were saved (only a last slot
    that does not end a trajectory gets zeros as its ``"next"`` values: it has no successor).
    """
    for key in _META:
        if key not in flat:
            raise KeyError(
                f"flat_to_ted: the data has no {key!r} entry, so it was not "
                "written by ted_to_flat / TED2Flat."
            )
    shape = tuple(int(s) for s in flat["_storage_shape"])
    items = {
        k: np.asarray(v)
        for k, v in _flat_items({k: v for k, v in flat.items() if k not in _META}).items()
    }
    ted = flat_to_ted_lines(
        items,
        shape,
        int(flat["shift"]),
        bool(flat["is_full"]),
        normalize_key(done_key),
        done_keys,
        reward_keys,
        past_len,
        "flat_to_ted",
    )
    if len(shape) == 1:
        ted = {k: v[0] for k, v in ted.items()}
    return _nest(ted)
