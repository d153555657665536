"""The state of :mod:`functional_rb.samplers.sum_tree` and its layout: which level lives where.

:class:`SumTreeState` holds the leaves and every internal level; :func:`level_sizes`,
:func:`offsets`, :func:`split` and :func:`rows_of` say, from the capacity and fanout alone,
how many nodes each level has and in which rows of which array it lies. Checkpoints of older
layouts convert in :meth:`SumTreeState.from_saved`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.names import stable
from functional_rb._internal.tree import loaded

# a row of ``nodes`` / ``top`` with no positive leaf below: sums 0, minima inf
EMPTY_ROW = np.array([0.0, np.inf], np.float32).reshape(2, 1, 1)
# The most bytes of rows ``top`` holds. XLA's CPU backend splits a kernel across threads when
# its arrays add up to 512 KiB: a scatter into ``top`` (read and written whole, by its cost
# model) stays below that.
TOP_BYTES = 224 << 10


@stable("SumTreeState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SumTreeState:
    """A sum tree over ``capacity`` float32 leaves.

    values: float32 ``[n_0]``: the leaves (``n_0`` = capacity rounded up to a multiple of
      ``fanout``; the padding is 0).
    nodes, top: float32 ``[2, *, fanout]``: every internal level, one after the other (level 1
      first), in rows of ``fanout`` nodes: the large lower levels in ``nodes``, the levels
      above them in ``top`` (at most ``TOP_BYTES``; :func:`split`). ``[0, b]`` holds the sums
      of row ``b``'s nodes, ``[1, b]`` their minima over the positive leaves below (``inf`` if
      none). In flat node numbering (:attr:`sums`, :attr:`mins`: the two arrays' rows one
      after the other), level ``k >= 1`` has ``n_k`` nodes (a multiple of ``fanout``) from
      ``offsets[k]`` on; its node ``j`` is the sum of block ``j`` (``fanout`` consecutive
      nodes) of level ``k - 1``. The last level has exactly ``fanout`` nodes: the total is
      their sum. No rows when ``capacity <= fanout`` (the leaves are the top block).
    capacity, fanout: static.

    Three arrays whatever the depth, since each costs a jitted call dispatch time. The layout
    is for XLA's CPU backend, which splits a kernel across threads when the arrays it touches
    add up to 512 KiB, and on a small, shared machine each split kernel costs a hand-over
    between threads of a few us (``benchmarks/NOTES.md``, "Split kernels"). Sums and minima in
    one array make recomputing nodes one gather of their children's rows and one scatter of
    their two values (not two of each); the small levels in an array of their own keep their
    kernels whole. The sums lie apart from the minima, so a descent reads dense sums: one
    cache line per level with the default fanout.
    """

    values: jax.Array
    nodes: jax.Array
    top: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    fanout: int = dataclasses.field(metadata=dict(static=True))

    def _half(self, h: int) -> jax.Array:
        rows = jnp.concatenate([self.nodes, self.top], axis=-2)
        return rows[..., h, :, :].reshape(rows.shape[:-3] + (-1,))

    @property
    def sums(self) -> jax.Array:
        """float32 ``[..., S]``: every internal node's sum, in flat node numbering."""
        return self._half(0)

    @property
    def mins(self) -> jax.Array:
        """float32 ``[..., S]``: every internal node's minimum positive leaf (``inf`` if none),
        aligned with :attr:`sums`."""
        return self._half(1)

    @classmethod
    def from_saved(cls, **fields) -> SumTreeState:
        """The state from a checkpoint's fields; files written before the internal levels
        were rows of ``nodes`` and ``top`` hold them as flat ``sums`` and ``mins``, converted
        exactly.

        >>> from functional_rb.samplers import sum_tree
        >>> t = sum_tree.init(40, fanout=4)
        >>> old = dict(values=t.values, sums=t.sums, mins=t.mins, capacity=40, fanout=4)
        >>> bool((SumTreeState.from_saved(**old).top == t.top).all())
        True
        """
        if "nodes" in fields:
            return cls(**fields)
        f = fields["fanout"]
        sums, mins = loaded(fields.pop("sums")), loaded(fields.pop("mins"))
        lead = sums.shape[:-1]
        halves = [x.astype(np.float32).reshape(lead + (-1, f)) for x in (sums, mins)]
        rows = np.stack(halves, axis=-3)
        cut = split(fields["capacity"], f)
        return cls(nodes=rows[..., :cut, :], top=rows[..., cut:, :], **fields)  # type: ignore[arg-type]

    @property
    def leaves(self) -> jax.Array:
        """float32 [capacity]: the leaf values."""
        return self.values[: self.capacity]


@functools.cache
def level_sizes(capacity: int, fanout: int) -> tuple:
    """Nodes per level, leaves first, each a multiple of ``fanout``; the last is ``fanout``.

    >>> level_sizes(10_000, 16)
    (10000, 640, 48, 16)
    """
    sizes = [math.ceil(capacity / fanout) * fanout]
    while sizes[-1] > fanout:
        sizes.append(math.ceil(sizes[-1] // fanout / fanout) * fanout)
    return tuple(sizes)


@functools.cache
def offsets(capacity: int, fanout: int) -> tuple:
    """``offsets[k]`` (``k >= 1``): where level ``k`` starts in ``sums`` / ``mins`` (a
    multiple of ``fanout``); ``offsets[0]`` is unused (0).

    >>> offsets(10_000, 16)
    (0, 0, 640, 688)
    """
    sizes = level_sizes(capacity, fanout)
    offs = [0, 0]
    for n in sizes[1:-1]:
        offs.append(offs[-1] + n)
    return tuple(offs[: len(sizes)])


@functools.cache
def split(capacity: int, fanout: int) -> int:
    """The rows of internal levels that ``nodes`` holds (``top`` holds the rest): whole
    levels, from level 1 up, until the levels above them fit in ``TOP_BYTES``; ``top``
    always holds the last level (the total's block).

    >>> split(10**8, 16), split(100, 16), split(10**5, 32768)
    (415040, 0, 0)
    """
    sizes = level_sizes(capacity, fanout)
    row = 2 * fanout * 4
    rows = [n // fanout for n in sizes[1:]]
    cut = 0
    while cut < len(rows) - 1 and sum(rows[cut:]) * row > TOP_BYTES:
        cut += 1
    return sum(rows[:cut])


def rows_of(k: int, offs: tuple, f: int, cut: int) -> tuple:
    """``(which, row)``: level ``k``'s first row, in ``nodes`` (0) or ``top`` (1), for
    ``offs = offsets(...)`` and ``cut = split(...)``.

    >>> offs, cut = offsets(10**8, 16), split(10**8, 16)
    >>> rows_of(1, offs, 16, cut), rows_of(3, offs, 16, cut)
    ((0, 0), (1, 0))
    """
    b = offs[k] // f
    return (0, b) if b < cut else (1, b - cut)
