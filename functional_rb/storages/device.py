"""Storages: where items live (the protocol: :class:`functional_rb.protocol.Storage`).

A storage is a frozen, hashable config object with four pure functions::

    init(item, layout)                        -> state      # item: ONE element, no batch axis
    item_spec(state)                          -> PyTree of jax.ShapeDtypeStruct (one element)
    set(state, record, items, ctx)            -> state      # record: a WriteRecord, items [N, ...]
    get(state, indices, ctx)                  -> PyTree     # indices int32 [...] -> [..., ...]

Positions are flat (see :class:`~functional_rb.protocol.Layout`). ``set`` writes ``items[i]`` at
``record.positions[i]`` only where ``record.mask[i]`` is True; masked positions are never
touched, so a masked write cannot corrupt stored data. Writers guarantee that unmasked
positions are unique within one call.

:class:`DeviceStorage` keeps items in JAX arrays, in one of two layouts, each its own class:
:class:`PackedStorage` (``DeviceStorage(pack=True)``, the default: one slab per dtype) and
:class:`LeafStorage` (``DeviceStorage(pack=False)``: one array per leaf).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import folds, hugepages
from functional_rb._internal.errors import shape_mismatch
from functional_rb._internal.item_spec import ItemSpec, packing
from functional_rb._internal.jit import read_whole
from functional_rb._internal.names import stable
from functional_rb.protocol import Context, Layout, Storage, WriteRecord

PyTree = Any


@stable("DeviceStorageState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceStorageState:
    data: PyTree  # leaves [capacity, *item_shape], the item's dtype


def scatter_rows(
    leaf: jax.Array, positions: jax.Array, values: jax.Array, mask: jax.Array
) -> jax.Array:
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
    CPU gather is several times slower in its own "clip" mode than on in-bounds indices. On
    the CPU a few rows of a large leaf are read by one thread (:func:`read_whole`).
    """
    idx = jnp.clip(indices.astype(jnp.int32), 0, leaf.shape[0] - 1)
    return read_whole(lambda: leaf.at[idx].get(mode="promise_in_bounds"), leaf, indices)


# A read of [S, L] indices (L >= _RUN_MIN) whose every row is L consecutive positions (a slice
# sampler's slices) copies S windows of L rows instead of S * L single rows.
_RUN_MIN = 8


def gather_many(leaves, indices: jax.Array) -> list:
    """``[gather_rows(leaf, indices) for leaf in leaves]`` (leaves of one capacity).

    On the CPU, indices ``[S, L]`` whose every row is a run of ``L`` consecutive positions (a
    slice that neither wraps around the ring nor is padded) are read as ``S`` windows of ``L``
    rows, one copy each, where a gather copies ``S * L`` rows one at a time; the check is
    made at run time (a ``lax.cond``; any other read goes row by row, as before).

    >>> leaf = jnp.arange(20, dtype=jnp.int32).reshape(10, 2)
    >>> idx = jnp.array([[3, 4, 5, 6, 7, 8, 9, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    >>> [x[:, 0, 0].tolist() for x in gather_many([leaf], idx)]
    [[6, 0]]
    """
    leaves = list(leaves)
    if (
        not leaves
        or indices.ndim != 2
        or not _RUN_MIN <= indices.shape[1] <= leaves[0].shape[0]
        or jax.default_backend() != "cpu"
    ):
        return [gather_rows(leaf, indices) for leaf in leaves]
    idx = indices.astype(jnp.int32)
    n = idx.shape[1]
    cap = leaves[0].shape[0]
    starts = idx[:, 0]
    runs = folds.all_(
        idx == starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    ) & folds.all_((starts >= 0) & (starts <= cap - n))

    def windows(_):
        return [
            read_whole(
                lambda leaf=leaf: jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(leaf, s, n))(
                    starts
                ),
                leaf,
                starts,
            )
            for leaf in leaves
        ]

    return jax.lax.cond(runs, windows, lambda _: [gather_rows(x, idx) for x in leaves], None)


# Leaves of at most this many elements per item share their dtype's slab; a larger leaf (an
# image) keeps an array of its own: unpacking it from a shared gathered row would cost one more
# copy of the sampled batch, which for big leaves outweighs the saved gather.
@stable("PackedStorageState")
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


def _leading_dims(tree, prefix: str, capacity: int):
    """The first leaf of ``tree`` whose leading dimension is not ``capacity``, as a sentence."""
    return shape_mismatch(
        [
            (prefix + jax.tree_util.keystr(p), x, (capacity,), False, f" (capacity={capacity})")
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        ]
    )


class DeviceStorage(Storage):
    """Items as JAX arrays in device memory (the default storage).

    Args:
      pack: (default True) keep the leaves of one dtype in a single ``[capacity, width]``
        array: a :class:`PackedStorage` (state :class:`PackedStorageState`; leaves over
        ``PACK_MAX_WIDTH`` elements per item keep their own array). An ``add`` is then one
        scatter and a ``sample`` one gather per dtype rather than per leaf: fewer memory
        operations and fewer buffers for each jitted call to hand over (W1 in
        ``benchmarks/``: 1.3-1.5x faster in ``lax.scan``). ``pack=False``: a
        :class:`LeafStorage`, one array per leaf, ``[capacity, *item_shape]`` (state
        :class:`DeviceStorageState`; what the torch adapters use, to export leaves without
        copies). ``get``/``sample`` return the same tree, bit for bit, either way.

    ``DeviceStorage(pack=...)`` builds the class of that layout (both are ``DeviceStorage``
    subclasses). State zero-filled at ``init``. With ``jax.jit(rb.add, donate_argnums=0)``
    writes happen in place. On the CPU, arrays of 32 MiB or more ask Linux for huge pages
    (fewer TLB misses in random gathers; ``FRB_HUGEPAGES=0`` turns it off: see
    :mod:`functional_rb._internal.hugepages`); donated in-place calls keep them.
    """

    pack: bool

    def __new__(cls, pack: bool = True):
        if cls is DeviceStorage:
            cls = PackedStorage if pack else LeafStorage
        return super().__new__(cls)


@dataclasses.dataclass(frozen=True)
class PackedStorage(DeviceStorage):
    """``DeviceStorage(pack=True)``: the leaves of one dtype side by side in one slab."""

    pack: bool = True
    state_types = (PackedStorageState,)

    def __post_init__(self):
        if self.pack is not True:
            raise ValueError(
                f"PackedStorage: pack must be True, got {self.pack!r}; use "
                "DeviceStorage(pack=False) for one array per leaf."
            )

    def init(self, item: PyTree, layout: Layout) -> PackedStorageState:
        spec = ItemSpec.from_tree(item)
        _, slabs = packing(spec)
        return PackedStorageState(
            slabs={
                name: hugepages.zeros((layout.capacity, w), dtype)
                for name, (dtype, w) in slabs.items()
            },
            item=spec,
        )

    def check_state(self, state: PackedStorageState, capacity: int, num_envs: int):
        """Every slab's leading axis is the capacity (None if so, else a sentence)."""
        del num_envs
        return _leading_dims(state.slabs, "state.storage.slabs", capacity)

    def item_spec(self, state: PackedStorageState) -> PyTree:
        return state.item.shapes()

    def set(
        self, state: PackedStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> PackedStorageState:
        del ctx
        leaves, slabs = packing(state.item)
        n = record.positions.shape[0]
        columns: dict = {name: [] for name in slabs}
        for (name, _, _, width), x in zip(leaves, jax.tree_util.tree_leaves(items)):
            columns[name].append(jnp.reshape(x, (n, width)).astype(slabs[name][0]))
        new = {
            name: scatter_rows(
                state.slabs[name],
                record.positions,
                cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1),
                record.mask,
            )
            for name, cols in columns.items()
        }
        return PackedStorageState(slabs=new, item=state.item)

    def get(self, state: PackedStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        leaves, _ = packing(state.item)
        names = list(state.slabs)
        rows = dict(zip(names, gather_many([state.slabs[k] for k in names], indices), strict=True))
        batch = tuple(indices.shape)
        out = [
            jnp.reshape(rows[name][..., off : off + width], batch + shape)
            for name, shape, off, width in leaves
        ]
        return jax.tree_util.tree_unflatten(state.item.treedef, out)

    def read_host(self, state: PackedStorageState, indices) -> PyTree:
        """Items at ``indices`` (integers in range, any shape) as NumPy arrays, gathered on the
        host (:func:`host_rows`): for a caller outside ``jit`` that wants NumPy."""
        leaves, _ = packing(state.item)
        idx = np.asarray(indices)
        rows = {name: host_rows(slab, idx) for name, slab in state.slabs.items()}
        out = [
            rows[name][..., off : off + width].reshape(idx.shape + shape)
            for name, shape, off, width in leaves
        ]
        return jax.tree_util.tree_unflatten(state.item.treedef, out)


def host_rows(leaf: jax.Array, indices: np.ndarray) -> np.ndarray:
    """``leaf[indices]`` as a NumPy array. On a CPU device ``np.asarray`` of the leaf is a view
    of its buffer (no copy, no compiled call) and NumPy gathers the rows; the view is dropped
    at once, so a later donated write still updates the buffer in place. Elsewhere the rows are
    gathered on the device and copied back."""
    if all(d.platform == "cpu" for d in leaf.devices()):
        # take, not fancy indexing: ~3x faster for rows of a few words, and a new array too
        return np.asarray(leaf).take(indices, axis=0)
    return np.asarray(gather_rows(leaf, jnp.asarray(indices, jnp.int32)))


@dataclasses.dataclass(frozen=True)
class LeafStorage(DeviceStorage):
    """``DeviceStorage(pack=False)``: one ``[capacity, *item_shape]`` array per leaf."""

    pack: bool = False
    state_types = (DeviceStorageState,)

    def __post_init__(self):
        if self.pack is not False:
            raise ValueError(
                f"LeafStorage: pack must be False, got {self.pack!r}; use "
                "DeviceStorage(pack=True) for packed slabs."
            )

    def init(self, item: PyTree, layout: Layout) -> DeviceStorageState:
        return DeviceStorageState(
            data=jax.tree_util.tree_map(
                lambda x: hugepages.zeros((layout.capacity,) + tuple(x.shape), x.dtype), item
            )
        )

    def check_state(self, state: DeviceStorageState, capacity: int, num_envs: int):
        """Every leaf's leading axis is the capacity (None if so, else a sentence)."""
        del num_envs
        return _leading_dims(state.data, "state.storage.data", capacity)

    def item_spec(self, state: DeviceStorageState) -> PyTree:
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.data
        )

    def set(
        self, state: DeviceStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> DeviceStorageState:
        del ctx
        return DeviceStorageState(
            data=jax.tree_util.tree_map(
                lambda leaf, x: scatter_rows(leaf, record.positions, x, record.mask),
                state.data,
                items,
            )
        )

    def get(self, state: DeviceStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        flat, treedef = jax.tree_util.tree_flatten(state.data)
        return jax.tree_util.tree_unflatten(treedef, gather_many(flat, indices))

    def read_host(self, state: DeviceStorageState, indices) -> PyTree:
        """Items at ``indices`` (integers in range, any shape) as NumPy arrays, gathered on the
        host (:func:`host_rows`)."""
        idx = np.asarray(indices)
        return jax.tree_util.tree_map(lambda leaf: host_rows(leaf, idx), state.data)
