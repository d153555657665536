"""The static description of one stored item (:class:`ItemSpec`): its tree and leaf specs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal.names import stable

PyTree = Any


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
