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
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._errors import shape_mismatch
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


# Leaves of at most this many elements per item share their dtype's slab; a larger leaf (an
# image) keeps an array of its own: unpacking it from a shared gathered row would cost one more
# copy of the sampled batch, which for big leaves outweighs the saved gather.
PACK_MAX_WIDTH = 1024


@dataclasses.dataclass(frozen=True)
class ItemSpec:
    """Static description of one stored item: its tree structure and, per leaf in flatten order,
    ``(item_shape, dtype_name)``. Hashable, so it lives in the state's tree definition rather
    than in its leaves: a jitted call hands over only the slabs. Checkpoints store it in their
    manifest (``functional_rb.checkpoint``), as they store any tree.
    """

    treedef: Any
    leaves: tuple

    @classmethod
    def from_tree(cls, item: PyTree) -> "ItemSpec":
        flat, treedef = jax.tree_util.tree_flatten(item)
        return cls(treedef, tuple((tuple(int(d) for d in jnp.shape(x)),
                                   jnp.dtype(jnp.result_type(x)).name) for x in flat))

    def shapes(self) -> PyTree:
        """The item's tree with ``jax.ShapeDtypeStruct(item_shape, dtype)`` leaves."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct(shape, jnp.dtype(d)) for shape, d in self.leaves])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedStorageState:
    """State of a ``DeviceStorage(pack=True)``.

    slabs: ``{name: [capacity, width]}``. ``name`` is a dtype name (``"float32"``) for the
      slab holding every leaf of that dtype with at most ``PACK_MAX_WIDTH`` elements per item,
      each flattened to ``prod(item_shape)`` columns, side by side in tree order; a larger leaf
      ``i`` has its own slab ``"leaf<i>_<dtype>"``.
    item: static :class:`ItemSpec`: the structure, shapes and dtypes the slabs unpack to. It is
      static (part of the tree definition), not array leaves, because every leaf of a state
      costs dispatch time in each jitted call that takes it (~10 us per call for a
      four-leaf item on CPU); checkpoints store it in their manifest.
    """

    slabs: PyTree
    item: ItemSpec = dataclasses.field(metadata=dict(static=True))


@functools.lru_cache(maxsize=256)
def _packing(item: ItemSpec):
    """``(leaves, slabs)``: per item leaf ``(slab name, item shape, column offset, width)``
    and ``{slab name: (dtype, width)}``; all static (from shapes and dtypes only)."""
    leaves, slabs = [], {}
    for i, (shape, dtype_name) in enumerate(item.leaves):
        dtype = jnp.dtype(dtype_name)
        width = math.prod(shape)
        name = dtype.name if width <= PACK_MAX_WIDTH else f"leaf{i}_{dtype.name}"
        offset = slabs.get(name, (dtype, 0))[1]
        leaves.append((name, shape, offset, width))
        slabs[name] = (dtype, offset + width)
    return leaves, slabs


@dataclasses.dataclass(frozen=True)
class DeviceStorage:
    """Items as JAX arrays in device memory (the default storage).

    Args:
      pack: (default True) keep the leaves of one dtype in a single ``[capacity, width]``
        array (state :class:`PackedStorageState`; leaves over ``PACK_MAX_WIDTH`` elements per
        item keep their own array). An ``add`` is then one scatter and a ``sample`` one
        gather per dtype rather than per leaf: fewer memory operations and fewer buffers for
        each jitted call to hand over (W1 in ``benchmarks/``: 1.3-1.5x faster in
        ``lax.scan``). ``pack=False``: one array per leaf, ``[capacity, *item_shape]`` (state
        :class:`DeviceStorageState`; what the torch adapters use, to export leaves without
        copies). ``get``/``sample`` return the same tree, bit for bit, either way.

    State zero-filled at ``init``. With ``jax.jit(rb.add, donate_argnums=0)`` writes happen in
    place.
    """

    pack: bool = True
    state_types = (PackedStorageState, DeviceStorageState)  # what init builds

    def init(self, item: PyTree, layout: Layout):
        if self.pack:
            spec = ItemSpec.from_tree(item)
            _, slabs = _packing(spec)
            return PackedStorageState(
                slabs={name: jnp.zeros((layout.capacity, w), dtype)
                       for name, (dtype, w) in slabs.items()},
                item=spec)
        data = jax.tree_util.tree_map(
            lambda x: jnp.zeros((layout.capacity,) + tuple(x.shape), x.dtype), item)
        return DeviceStorageState(data=data)

    def check_state(self, state, capacity: int, num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items (None if it
        can): every array's leading axis is the capacity."""
        del num_envs
        tree, prefix = ((state.slabs, "state.storage.slabs") if isinstance(state, PackedStorageState)
                        else (state.data, "state.storage.data"))
        return shape_mismatch([(prefix + jax.tree_util.keystr(p), x, (capacity,), False,
                                f" (capacity={capacity})")
                               for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]])

    def item_spec(self, state) -> PyTree:
        if isinstance(state, PackedStorageState):
            return state.item.shapes()
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.data)

    def set(self, state, positions: jax.Array, items: PyTree, mask: jax.Array, ctx: Context):
        del ctx
        if isinstance(state, PackedStorageState):
            leaves, slabs = _packing(state.item)
            n = positions.shape[0]
            columns: dict = {name: [] for name in slabs}
            for (name, _, _, width), x in zip(leaves, jax.tree_util.tree_leaves(items)):
                columns[name].append(jnp.reshape(x, (n, width)).astype(slabs[name][0]))
            new = {name: scatter_rows(
                state.slabs[name], positions,
                cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1), mask)
                for name, cols in columns.items()}
            return PackedStorageState(slabs=new, item=state.item)
        data = jax.tree_util.tree_map(
            lambda leaf, x: scatter_rows(leaf, positions, x, mask), state.data, items)
        return DeviceStorageState(data=data)

    def get(self, state, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        if isinstance(state, PackedStorageState):
            leaves, _ = _packing(state.item)
            rows = {name: gather_rows(slab, indices) for name, slab in state.slabs.items()}
            batch = tuple(indices.shape)
            out = [jnp.reshape(rows[name][..., off:off + width], batch + shape)
                   for name, shape, off, width in leaves]
            return jax.tree_util.tree_unflatten(state.item.treedef, out)
        return jax.tree_util.tree_map(lambda leaf: gather_rows(leaf, indices), state.data)
