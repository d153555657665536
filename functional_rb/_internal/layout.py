"""How items are laid out in storage, and the per-call context the components share.

Every storage keeps its leaves *flat*: ``[capacity, ...]``. With ``ndim=2`` the buffer is a
``[num_envs, row_capacity]`` grid (``capacity = num_envs * row_capacity``) and the element at
``(env, t)`` lives at flat position ``env * row_capacity + t``: the same convention as TorchRL's
``ravel_multi_index`` over a ``[num_envs, time]`` storage. Writers fill each row along time from
``t = 0``, so at any moment the stored elements are exactly ``t < filled`` in every row; this
prefix property is what lets samplers draw valid positions in O(1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
from functional_rb._internal.names import stable


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of the storage grid (hashable; lives in closures, never in the state)."""

    capacity: int  # total elements = num_envs * row_capacity
    num_envs: int  # 1 when ndim == 1
    row_capacity: int  # time steps per row; == capacity when ndim == 1
    ndim: int  # 1 or 2

    def to_flat(self, env, t):
        """int32 flat positions for ``(env, t)`` pairs (any broadcastable shapes)."""
        return jnp.asarray(env, jnp.int32) * jnp.int32(self.row_capacity) + jnp.asarray(
            t, jnp.int32
        )

    def from_flat(self, pos):
        """``(env, t)`` int32 arrays for flat positions ``pos``."""
        pos = jnp.asarray(pos, jnp.int32)
        if self.ndim == 1:
            return jnp.zeros_like(pos), pos
        return pos // jnp.int32(self.row_capacity), pos % jnp.int32(self.row_capacity)

    def rank_to_flat(self, u, filled):
        """Map ranks ``u`` in ``[0, num_envs * filled)`` to flat positions of stored elements.

        Rank ``u`` is element ``t = u % filled`` of row ``env = u // filled``. ``filled`` is an
        int32 scalar (> 0 for a meaningful result; callers mask otherwise).
        """
        u = jnp.asarray(u, jnp.int32)
        if self.ndim == 1:
            return u
        f = jnp.maximum(jnp.asarray(filled, jnp.int32), 1)
        return (u // f) * jnp.int32(self.row_capacity) + u % f


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What every component may know about the buffer when it is called.

    Built inside ``ReplayBuffer`` methods from the writer state; never stored. A PyTree whose
    ``layout`` is static, so a component method compiled with ``jax.jit`` takes it as is.
    """

    layout: Layout = dataclasses.field(metadata=dict(static=True))
    filled: jax.Array  # int32 []: time steps stored per row (ndim=1: items stored)
    cursor: jax.Array  # int32 []: next time index a ring writer will write (per row)

    @property
    def size(self):
        """int32 []: elements currently stored."""
        return self.filled * jnp.int32(self.layout.num_envs)


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
