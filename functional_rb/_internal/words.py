"""Small leaves as int32 columns, so that several share one row of a ``[capacity, n]`` array.

A random read of one item then touches one row (one cache line for up to 16 columns) instead
of one per leaf, and a jitted call hands over one buffer instead of several. Every dtype of at
most 4 bytes but complex is kept bit for bit: 4-byte dtypes as their bits, narrower ones
zero-extended (bool as 0 / 1).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# a row of this many int32 columns is one 64-byte cache line
LINE = 16


def packable(shape: tuple, dtype) -> bool:
    """Whether a leaf of ``shape`` / ``dtype`` per item can be kept as int32 columns."""
    dtype = np.dtype(dtype)
    return dtype.itemsize <= 4 and dtype.kind in "biuf" and math.prod(shape) <= LINE


def width(shape: tuple) -> int:
    """Columns a leaf of ``shape`` per item takes."""
    return math.prod(shape)


def to_words(x, lead: int, xp=jnp):
    """``x`` (``lead`` leading axes, then the item's) as int32 ``[*lead_shape, width]``;
    ``xp``: ``jax.numpy`` (traced or not) or ``numpy`` (a loaded file's arrays).

    >>> to_words(jnp.array([[1.0, -2.0]]), 1).tolist()
    [[1065353216, -1073741824]]
    >>> to_words(jnp.array([True, False]), 1).tolist()
    [[1], [0]]
    """
    x = xp.asarray(x)
    x = x.reshape(tuple(x.shape[:lead]) + (-1,))
    if x.dtype.kind == "b":
        return x.astype(np.int32)
    size = x.dtype.itemsize
    unsigned = np.dtype(f"uint{8 * size}")
    bits = _view(x, np.dtype(np.int32) if size == 4 else unsigned, xp)
    return bits.astype(np.int32)


def from_words(cols, shape: tuple, dtype, xp=jnp):
    """The leaf ``to_words`` kept: int32 ``cols`` ``[..., width]`` as ``[..., *shape]`` of
    ``dtype``.

    >>> from_words(jnp.array([[1065353216, -1073741824]]), (2,), jnp.float32).tolist()
    [[1.0, -2.0]]
    """
    dtype = np.dtype(dtype)
    cols = xp.asarray(cols)
    if dtype.kind == "b":
        out = cols != 0
    elif dtype.itemsize == 4:
        out = _view(cols, dtype, xp)
    else:
        out = _view(cols.astype(np.dtype(f"uint{8 * dtype.itemsize}")), dtype, xp)
    return out.reshape(tuple(cols.shape[:-1]) + tuple(shape))


def _view(x, dtype, xp):
    """``x``'s bits as ``dtype`` (the same item size)."""
    if x.dtype == dtype:
        return x
    if xp is np:
        return x.view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)
