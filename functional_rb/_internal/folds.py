"""Small reductions written as pairwise folds, with no reducer computation.

``jnp.any``, ``jnp.all``, ``jnp.sum``, ``jnp.argmax`` and ``jnp.cumsum`` lower to XLA reduce
ops that each carry a reducer computation. XLA:CPU gives every scalar of every reducer a
buffer of its own, and its runtime wraps each buffer of a program in a new heap object at
every call, whether or not the code that uses it runs (about 0.2 us each on the 2-core host,
and more in what the allocator does afterwards: ``benchmarks/NOTES.md``, "Buffers the
runtime wraps at every call"). A sampler that reduces small arrays in a dozen places pays
that on every call. The folds here combine adjacent pairs, halving the axis each time:
elementwise ops on reshaped arrays, which XLA fuses, and no reducer at all. They are exact
(integer and boolean ops), and meant for the small arrays of a draw; a reduction over a
whole buffer keeps ``jnp``'s. Each is ``jax.jit``-wrapped, so that an eager call is one
dispatch (a fold is a dozen small ops); inside a caller's ``jit`` it inlines.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Above this many elements ``any_``/``all_``/``sum_`` reduce as ``jnp`` does: the data then
# costs more than the reducer's buffers, and a fold's halves could be stored as temporaries.
FOLD_MAX = 1 << 16


def fold(combine, xs: tuple, fill: tuple, axis: int = -1) -> tuple:
    """Fold the arrays ``xs`` (one shape) along ``axis`` with ``combine(left, right)`` over
    adjacent pairs, order kept (the left element comes first); ``fill`` pads an odd length.
    Returns the arrays without ``axis``.

    >>> fold(lambda a, b: (a[0] + b[0],), (jnp.arange(5),), (0,))[0]
    Array(10, dtype=int32)
    """
    xs = tuple(jnp.moveaxis(x, axis, -1) for x in xs)
    if xs[0].shape[-1] == 0:
        return tuple(jnp.full(x.shape[:-1], f, x.dtype) for x, f in zip(xs, fill))
    while xs[0].shape[-1] > 1:
        n = xs[0].shape[-1]
        if n % 2:
            xs = tuple(
                jnp.concatenate([x, jnp.full(x.shape[:-1] + (1,), f, x.dtype)], axis=-1)
                for x, f in zip(xs, fill)
            )
            n += 1
        pairs = tuple(x.reshape(x.shape[:-1] + (n // 2, 2)) for x in xs)
        xs = combine(tuple(p[..., 0] for p in pairs), tuple(p[..., 1] for p in pairs))
    return tuple(x[..., 0] for x in xs)


def _reduce(x: jax.Array, axis: int | None, op, fill, large) -> jax.Array:
    """``x`` reduced along ``axis`` (``None``: all of it) by the pairwise ``op``, or by
    ``large(x, axis=axis)`` (``jnp``'s) above ``FOLD_MAX`` elements."""
    if x.size > FOLD_MAX:
        return large(x, axis=axis)
    if axis is None:
        x, axis = x.reshape(-1), 0
    return fold(lambda a, b: (op(a[0], b[0]),), (x,), (fill,), axis)[0]


@functools.partial(jax.jit, static_argnames="axis")
def any_(x: jax.Array, axis: int | None = None) -> jax.Array:
    """``jnp.any(x, axis)`` for one axis or all (``None``), as a fold.

    >>> bool(any_(jnp.array([False, True, False])))
    True
    """
    return _reduce(jnp.asarray(x) != 0, axis, jnp.logical_or, False, jnp.any)


@functools.partial(jax.jit, static_argnames="axis")
def all_(x: jax.Array, axis: int | None = None) -> jax.Array:
    """``jnp.all(x, axis)`` for one axis or all (``None``), as a fold.

    >>> all_(jnp.array([[True, True], [True, False]]), axis=1).tolist()
    [True, False]
    """
    return _reduce(jnp.asarray(x) != 0, axis, jnp.logical_and, True, jnp.all)


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def sum_(x: jax.Array, axis: int | None = None, dtype=jnp.int32) -> jax.Array:
    """``jnp.sum(x, axis, dtype)`` of integers or booleans, as a fold (exact).

    >>> int(sum_(jnp.array([True, False, True])))
    2
    """
    large = functools.partial(jnp.sum, dtype=dtype)
    return _reduce(jnp.asarray(x).astype(dtype), axis, jnp.add, 0, large)


@jax.jit
def bucket_of(counts: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(i, r_in)``: the bucket ``i`` of ``counts`` (int32 ``[m]``) that holds item ``r``
    (0-based) of all the buckets' items in order, and ``r``'s rank inside it (the last bucket
    where ``r`` is past the end).

    >>> [int(v) for v in bucket_of(jnp.array([2, 0, 3]), jnp.int32(3))]
    [2, 1]
    """
    before = cumsum(counts)
    i = jnp.minimum(jnp.searchsorted(before, r, side="right"), counts.shape[0] - 1)
    i = i.astype(jnp.int32)
    return i, r - (before[i] - counts[i])


@functools.partial(jax.jit, static_argnames="axis")
def first_true(mask: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """``(index, found)`` of the first True along ``axis``: ``jnp.argmax(mask, axis)`` (0
    where there is none) and ``jnp.any(mask, axis)``, as one fold.

    >>> i, ok = first_true(jnp.array([[False, True, True], [False, False, False]]))
    >>> i.tolist(), ok.tolist()
    ([1, 0], [True, False])
    """
    mask = jnp.moveaxis(jnp.asarray(mask) != 0, axis, -1)
    idx = jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32), mask.shape)

    def combine(left, right):
        return left[0] | right[0], jnp.where(left[0], left[1], right[1])

    found, index = fold(combine, (mask, idx), (False, 0))
    return jnp.where(found, index, 0), found


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def cumsum(x: jax.Array, axis: int = -1, dtype=jnp.int32) -> jax.Array:
    """``jnp.cumsum(x, axis, dtype)`` of integers or booleans, as an associative scan (exact;
    slices, pads and adds, no reducer).

    >>> cumsum(jnp.array([1, 0, 2, 3])).tolist()
    [1, 1, 3, 6]
    """
    x = jnp.asarray(x).astype(dtype)
    if x.shape[axis] <= 1:
        return x
    return jax.lax.associative_scan(jnp.add, x, axis=axis % x.ndim)


@functools.partial(jax.jit, static_argnames="width")
def nth_true(mask: jax.Array, r: jax.Array, width: int = 128) -> jax.Array:
    """int32 index of the ``r``-th True (0-based) of the bool vector ``mask``: the first
    index whose running count of Trues exceeds ``r``, ``len(mask) - 1`` where none does
    (``min(searchsorted(cumsum(mask), r, "right"), n - 1)``). Counted in chunks of ``width``
    and then inside one chunk, so no running count of the whole vector is held.

    >>> int(nth_true(jnp.array([False, True, False, True, True]), jnp.int32(1)))
    3
    """
    n = mask.shape[0]
    m = -(-n // width)
    rows = jnp.pad(jnp.asarray(mask) != 0, (0, m * width - n)).reshape(m, width)
    # per-chunk counts fit a byte (width <= 255): a quarter of the temporaries of int32
    counts = sum_(rows, axis=1, dtype=jnp.uint8 if width <= 255 else jnp.int32).astype(jnp.int32)
    chunk, r_in = bucket_of(counts, r)
    inside = cumsum(rows[chunk])
    j = jnp.minimum(jnp.searchsorted(inside, r_in, side="right"), width - 1).astype(jnp.int32)
    return jnp.minimum(chunk * width + j, n - 1)
