"""The state of a :class:`~functional_rb.ted.TEDStorage` (:class:`TEDStorageState`), and how
a checkpoint of an older layout of it becomes today's (:meth:`TEDStorageState.from_saved`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal.names import stable
from functional_rb._internal.tree import loaded, saved_columns
from functional_rb.ted import rows as ted_rows

PyTree = Any


@stable("TEDStorageState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TEDStorageState:
    """State of a :class:`TEDStorage` (``C = capacity``, ``E = num_envs``, ``S`` side rows,
    ``k`` = frame_stack).

    data:       the item without its paired ``"next"`` leaves and without the leaves kept in
                ``rows``. Other leaves are ``[C, ...]``; each paired root leaf is a frame table
                ``[C + S + E*(k-1), ...]``: rows ``[0, C)`` are the stored steps, ``[C, C+S)``
                the side table (real next observations of episode ends), the last
                ``E*(k-1)`` the ``k-1`` frames that preceded the oldest stored step of each
                row (for stacks across the ring wrap).
    rows:       int32 ``[C, n]``, one row per slot (:mod:`functional_rb.ted.rows`): column 0
                the side-table row holding the step's next observation, or -1 (``ptr``);
                with ``k > 1`` column 1 the steps since the episode start, capped at
                ``k - 1`` (``dist``); then the item's small leaves (``packed``).
    owner:      int32 ``[S]``: flat slot owning each side row, or -1.
    counts:     int32 ``[2]``: the next side row to allocate (``head``: the side table is a
                ring) and the side rows overwritten while their step was still stored
                (``lost``: 0 unless ``min_episode_len`` was too optimistic; see
                :class:`TEDStorage`).
    carry:      int32 ``[E, 2]``: ``dist`` of each row's newest step (``carry_dist``) and
                whether it ended its episode (``carry_end``; 1 at init, so the first step
                added starts an episode).
    pending:    the paired root leaves only (same nesting as ``data``), each ``[E, ...]``: the
                next observation of each row's newest step, until its successor arrives.
    packed:     static: ``((key, item_shape, dtype_name), ...)`` of the leaves in ``rows``.

    The per-step and per-row values share arrays because a sampled step then reads them from
    one cache line, and each array a jitted call hands over costs it dispatch time
    (``benchmarks/NOTES.md``, W5). ``ptr``, ``dist``, ``head``, ``lost``, ``carry_dist`` and
    ``carry_end`` read them back. ``pending`` is a leaf of its own, apart from the frame
    tables, so that ``add`` never reads a table it writes: a read of the old table would make
    XLA copy the whole donated table on every add (O(capacity)).

    States saved in the older layouts load into this one with
    :func:`functional_rb.checkpoint.load`: those that kept ``ptr``, ``dist``, the counters,
    the carries and the small leaves in arrays of their own (:meth:`from_saved`), and those
    that kept the pending rows in the tables (``[C + S, C + S + E)``,
    :mod:`functional_rb.checkpoint.legacy`); ``pending`` is ``None`` only in such a state as
    read from the file, before the conversion.
    """

    data: PyTree
    rows: jax.Array
    owner: jax.Array
    counts: jax.Array
    carry: jax.Array
    pending: PyTree = None
    packed: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def stacks(self) -> bool:
        """Whether ``rows`` holds frame-stack distances (``frame_stack > 1``)."""
        return self.rows.shape[-1] > ted_rows.width(self.packed, False)

    @property
    def ptr(self) -> jax.Array:
        """int32 ``[C]``: the side row holding each step's next observation, or -1."""
        return self.rows[..., 0]

    @property
    def dist(self) -> jax.Array:
        """int32 ``[C]`` (``[0]`` when ``frame_stack == 1``): steps since the episode start,
        capped at ``k - 1``."""
        if self.stacks:
            return self.rows[..., 1]
        return jnp.zeros(self.rows.shape[:-2] + (0,), jnp.int32)

    @property
    def head(self) -> jax.Array:
        """int32 ``[]``: the next side row to allocate."""
        return self.counts[..., 0]

    @property
    def lost(self) -> jax.Array:
        """int32 ``[]``: side rows overwritten while their step was still stored."""
        return self.counts[..., 1]

    @property
    def carry_dist(self) -> jax.Array:
        """int32 ``[E]``: ``dist`` of each row's newest step."""
        return self.carry[..., 0]

    @property
    def carry_end(self) -> jax.Array:
        """bool ``[E]``: whether each row's newest step ended its episode."""
        return self.carry[..., 1] != 0

    @classmethod
    def from_saved(cls, **fields) -> TEDStorageState:
        """The state from a checkpoint's fields; a file written when ``ptr``, ``dist``,
        ``head``, ``lost``, ``carry_dist`` and ``carry_end`` were arrays of their own, and
        the small leaves too, holds those (any leading axes: a sharded or vmapped state's)."""
        if "ptr" not in fields:
            return cls(**fields)
        ptr = loaded(fields.pop("ptr"))
        lead = ptr.ndim - 1
        data, rows, packed = ted_rows.from_separate(
            jax.tree_util.tree_map(loaded, fields.pop("data")),
            ptr,
            loaded(fields.pop("dist")),
            lead,
            ptr.shape[-1],
        )
        return cls(
            data=data,
            rows=rows,
            counts=saved_columns(fields, ("head", "lost")),  # type: ignore[arg-type]  # host arrays, as loaded
            carry=saved_columns(fields, ("carry_dist", "carry_end")),  # type: ignore[arg-type]
            packed=packed,
            **fields,
        )
