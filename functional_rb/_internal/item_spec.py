"""The static description of one stored item (:class:`ItemSpec`): its tree and leaf specs."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal.names import stable

PyTree = Any

# leaves with more elements per item than this keep a slab of their own when packed
PACK_MAX_WIDTH = 1024


@stable("ItemSpec")
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
    def from_tree(cls, item: PyTree) -> ItemSpec:
        flat, treedef = jax.tree_util.tree_flatten(item)
        return cls(
            treedef,
            tuple(
                (tuple(int(d) for d in jnp.shape(x)), jnp.dtype(jnp.result_type(x)).name)
                for x in flat
            ),
        )

    def shapes(self) -> PyTree:
        """The item's tree with ``jax.ShapeDtypeStruct(item_shape, dtype)`` leaves."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct(shape, jnp.dtype(d)) for shape, d in self.leaves]
        )


@functools.lru_cache(maxsize=256)
def packing(item: ItemSpec):
    """How a packed storage lays ``item`` out: the leaves of one dtype side by side in one
    ``[capacity, width]`` slab (a leaf of more than ``PACK_MAX_WIDTH`` elements in its own).

    ``(leaves, slabs)``: per item leaf ``(slab name, item shape, column offset, width)``
    and ``{slab name: (dtype, width)}``; all static (from shapes and dtypes only)."""
    leaves: list = []
    slabs: dict = {}
    for i, (shape, dtype_name) in enumerate(item.leaves):
        dtype = jnp.dtype(dtype_name)
        width = math.prod(shape)
        name = dtype.name if width <= PACK_MAX_WIDTH else f"leaf{i}_{dtype.name}"
        offset = slabs.get(name, (dtype, 0))[1]
        leaves.append((name, shape, offset, width))
        slabs[name] = (dtype, offset + width)
    return leaves, slabs
