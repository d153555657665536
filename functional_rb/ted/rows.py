"""One int32 row per stored step of a :class:`~functional_rb.ted.TEDStorage`: the step's
side-table pointer, its frame-stack distance and the item's small leaves, side by side.

Column 0 is the pointer (the side row holding the step's next observation, or -1); with frame
stacks column 1 is the distance to the episode start; then every small leaf of the item that
is stored as it is (an action, a reward, end flags), in the item's flatten order, 16 columns
in all at most (``words.LINE``), kept as :mod:`functional_rb._internal.words` keeps them. A
sampled step then reads its pointer and those leaves from one cache line instead of one per
array, and a jitted call hands over one array for all of them (``benchmarks/NOTES.md``, W5:
fewer arrays per call, and TED's row).

``packed``: ``((key, item_shape, dtype_name), ...)``, static: the leaves in the row, in column
order. Larger leaves, wider dtypes and what does not fit keep arrays of their own in ``data``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import words
from functional_rb._internal.tree import del_key

PyTree = Any


def base(stacks: bool) -> int:
    """The first column of the packed leaves (after the pointer, and the distance)."""
    return 2 if stacks else 1


def choose(candidates, stacks: bool) -> tuple:
    """``packed`` for a state: of ``candidates`` (``(key, item_shape, dtype_name)`` of the
    leaves stored as they are, in flatten order), those that are small enough, while they
    fit in one line.

    >>> choose([(("action",), (), "int32"), (("obs",), (84, 84), "uint8"),
    ...         (("next", "done"), (), "bool")], stacks=False)
    ((('action',), (), 'int32'), (('next', 'done'), (), 'bool'))
    """
    used, out = base(stacks), []
    for key, shape, dtype in candidates:
        w = words.width(shape)
        if words.packable(shape, dtype) and used + w <= words.LINE:
            out.append((tuple(key), tuple(shape), np.dtype(dtype).name))
            used += w
    return tuple(out)


def columns(packed: tuple, stacks: bool) -> list:
    """``[(key, shape, dtype, first column, width)]`` of the packed leaves."""
    out, c = [], base(stacks)
    for key, shape, dtype in packed:
        out.append((key, shape, dtype, c, words.width(shape)))
        c += words.width(shape)
    return out


def width(packed: tuple, stacks: bool) -> int:
    """Columns of a row."""
    return base(stacks) + sum(words.width(s) for _, s, _ in packed)


def empty_row(packed: tuple, stacks: bool) -> np.ndarray:
    """A row of a slot that holds no step: no side row (-1), everything else 0."""
    row = np.zeros((width(packed, stacks),), np.int32)
    row[0] = -1
    return row


def encode(ptr, dist, leaves: list, lead: int = 1, xp=jnp):
    """Rows ``[*lead_shape, width]`` from the pointers, distances (None without frame stacks)
    and packed leaf values (in column order), each with ``lead`` leading axes."""
    parts = [xp.asarray(ptr).astype(np.int32)[..., None]]
    if dist is not None:
        parts.append(xp.asarray(dist).astype(np.int32)[..., None])
    parts += [words.to_words(x, lead, xp) for x in leaves]
    return xp.concatenate(parts, axis=-1)


def decode(rows, packed: tuple, stacks: bool) -> dict:
    """``{key: leaf}`` of the packed leaves of gathered ``rows`` ``[..., width]``.

    >>> packed = ((("reward",), (), "float32"), (("done",), (), "bool"))
    >>> rows = encode(jnp.array([-1, 3]), None, [jnp.array([0.5, 2.0]), jnp.array([True, False])])
    >>> rows[:, 0].tolist(), {k[0]: v.tolist() for k, v in decode(rows, packed, False).items()}
    ([-1, 3], {'reward': [0.5, 2.0], 'done': [True, False]})
    """
    return {
        key: words.from_words(rows[..., c : c + w], shape, dtype)
        for key, shape, dtype, c, w in columns(packed, stacks)
    }


def from_separate(data, ptr, dist, lead: int, capacity: int, xp=np):
    """``(data, rows, packed)`` from a state that kept ``ptr``, ``dist`` (``[..., 0]``
    without frame stacks) and the small leaves in arrays of their own: the leaves of
    ``capacity`` rows (not the frame tables) are the candidates, as at ``init``."""
    stacks = xp.shape(dist)[-1] > 0
    flat = jax.tree_util.tree_flatten_with_path(data)[0]
    candidates = [
        (tuple(p.key for p in path), tuple(xp.shape(x)[lead + 1 :]), np.dtype(x.dtype).name)
        for path, x in flat
        if xp.shape(x)[lead] == capacity
    ]
    packed = choose(candidates, stacks)
    by_key = {tuple(p.key for p in path): x for path, x in flat}
    rows = encode(ptr, dist if stacks else None, [by_key[k] for k, _, _ in packed], lead + 1, xp)
    return without(data, packed), rows, packed


def without(data: PyTree, packed: tuple) -> PyTree:
    """``data`` without the packed leaves (empty sub-dicts dropped)."""
    for key, _, _ in packed:
        data = del_key(data, key)
    return data
