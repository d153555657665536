"""Storages: where items live.

A storage is a frozen, hashable config object with four pure functions::

    init(item, layout)                        -> state      # item: ONE element, no batch axis
    item_spec(state)                          -> PyTree of jax.ShapeDtypeStruct (one element)
    set(state, positions, items, mask, ctx)   -> state      # positions int32 [N], items [N, ...]
    get(state, indices, ctx)                  -> PyTree     # indices int32 [...] -> [..., ...]

Positions are flat (see :mod:`functional_rb.layout`). ``set`` writes ``items[i]`` at
``positions[i]`` only where ``mask[i]`` is True; masked positions are never touched, so a
masked write cannot corrupt stored data. Writers guarantee that unmasked positions are unique
within one call.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb.layout import Context, Layout

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceStorageState:
    data: PyTree  # leaves [capacity, *item_shape], the item's dtype


def scatter_rows(leaf: jax.Array, positions: jax.Array, values: jax.Array,
                 mask: jax.Array) -> jax.Array:
    """``leaf[positions[mask]] = values[mask]`` along axis 0, in place when ``leaf`` is donated.

    Masked rows are sent to distinct out-of-range rows and dropped, which keeps the indices
    unique (so XLA may scatter without ordering) and never writes them.
    """
    n = positions.shape[0]
    oob = jnp.int32(leaf.shape[0]) + jnp.arange(n, dtype=jnp.int32)
    pos = jnp.where(mask, positions.astype(jnp.int32), oob)
    return leaf.at[pos].set(values.astype(leaf.dtype), mode="drop", unique_indices=True)


def gather_rows(leaf: jax.Array, indices: jax.Array) -> jax.Array:
    """``leaf[indices]`` along axis 0 for int32 indices of any shape (clipped, never OOB).

    The indices are clipped explicitly and the gather is then told they are in bounds: XLA's
    CPU gather is several times slower in its own "clip" mode than on in-bounds indices.
    """
    idx = jnp.clip(indices.astype(jnp.int32), 0, leaf.shape[0] - 1)
    return leaf.at[idx].get(mode="promise_in_bounds")


@dataclasses.dataclass(frozen=True)
class DeviceStorage:
    """Items as JAX arrays in device memory (the default storage).

    State: :class:`DeviceStorageState` with leaves ``[capacity, *item_shape]``, zero-filled at
    ``init``. With ``jax.jit(rb.add, donate_argnums=0)`` writes happen in place.
    """

    def init(self, item: PyTree, layout: Layout) -> DeviceStorageState:
        data = jax.tree_util.tree_map(
            lambda x: jnp.zeros((layout.capacity,) + tuple(x.shape), x.dtype), item)
        return DeviceStorageState(data=data)

    def item_spec(self, state: DeviceStorageState) -> PyTree:
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.data)

    def set(self, state: DeviceStorageState, positions: jax.Array, items: PyTree,
            mask: jax.Array, ctx: Context) -> DeviceStorageState:
        del ctx
        data = jax.tree_util.tree_map(
            lambda leaf, x: scatter_rows(leaf, positions, x, mask), state.data, items)
        return DeviceStorageState(data=data)

    def get(self, state: DeviceStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        return jax.tree_util.tree_map(lambda leaf: gather_rows(leaf, indices), state.data)
