"""Vaults and core buffers: the experience of an ``ndim=2`` :class:`~functional_rb.ReplayBuffer`
state into a vault, and a vault back into a buffer state.

A vault's rows are env rows: leaf ``[num_envs, time, ...]``, as an ``ndim=2`` buffer stores
them (``[num_envs, capacity // num_envs]``). The buffer's ring is read oldest first from its
counters (``filled``, ``cursor``), so these functions run on the host, not under ``jit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from functional_rb._internal.errors import config_int
from functional_rb.vault.store import VaultStore, append, length, read

if TYPE_CHECKING:
    from functional_rb.buffer import ReplayBuffer
    from functional_rb.protocol import BufferState

PyTree = Any


def _require_ndim2(rb, where: str) -> None:
    if getattr(rb, "ndim", None) != 2:
        raise ValueError(
            f"{where}: a vault's rows are env rows ([num_envs, time]), so the buffer must be "
            f"ReplayBuffer(..., ndim=2), got ndim={getattr(rb, 'ndim', None)!r}. For an ndim=1 "
            "buffer flatten what you read: rb.init_from_data(jax.tree.map(lambda x: "
            "x.reshape(-1, *x.shape[2:]), frb.vault.read(store)))."
        )


def structure(rb: ReplayBuffer, state: BufferState) -> PyTree:
    """The experience tree of an ``ndim=2`` buffer state as flashbax describes a buffer's:
    ``jax.ShapeDtypeStruct`` leaves ``[num_envs, capacity // num_envs, ...]`` (a template for
    :func:`create`).

    >>> import jax.numpy as jnp, functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=40, ndim=2)
    >>> frb.vault.structure(rb, rb.init({"obs": jnp.zeros((4, 3))}))["obs"].shape
    (4, 10, 3)
    """
    _require_ndim2(rb, "functional_rb.vault.structure")
    rb.size(state)  # raises unless the state is this buffer's
    layout = rb.layout(state)
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct((layout.num_envs, layout.row_capacity, *s.shape), s.dtype),
        rb.storage.item_spec(state.storage),
    )


# one compiled gather per buffer and number of steps (called eagerly, rb.get would compile
# each of its operations for every new number of steps)
_get = jax.jit(lambda rb, state, indices: rb.get(state, indices), static_argnums=0)


def buffer_items(rb: ReplayBuffer, state: BufferState, steps: int | None = None) -> PyTree:
    """The newest ``steps`` time steps (default: all stored) of every row of an ``ndim=2``
    buffer state, oldest first: leaves ``[num_envs, steps, ...]``.

    >>> import jax.numpy as jnp, functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=8, ndim=2)
    >>> state = rb.init({"t": jnp.zeros(2, jnp.int32)})
    >>> state = rb.add(state, {"t": jnp.arange(12, dtype=jnp.int32).reshape(2, 6)})
    >>> state = rb.add(state, {"t": jnp.full((2, 1), 9, jnp.int32)})   # the ring wraps
    >>> frb.vault.buffer_items(rb, state, steps=3)["t"].tolist()
    [[4, 5, 9], [10, 11, 9]]
    """
    where = "functional_rb.vault.buffer_items"
    _require_ndim2(rb, where)
    rb.size(state)
    ctx = rb.context(state)
    if isinstance(ctx.filled, jax.core.Tracer):
        raise TypeError(
            f"{where}: the state is traced (inside jax.jit, vmap or scan); call "
            "this on the host, with the state your jitted function returns."
        )
    filled, cursor = int(ctx.filled), int(ctx.cursor)
    steps = (
        filled
        if steps is None
        else config_int(
            where,
            "steps",
            steps,
            minimum=0,
            maximum=filled,
            fix=f"(each row holds {filled} steps now; write to the vault at least once every "
            f"{ctx.layout.row_capacity} steps added, or older ones are overwritten first).",
        )
    )
    t = (cursor - steps + np.arange(steps)) % ctx.layout.row_capacity
    rows = np.arange(ctx.layout.num_envs)[:, None]
    flat = (rows * ctx.layout.row_capacity + t[None, :]).astype(np.int32)
    return _get(rb, state, flat)


def append_buffer(
    store: VaultStore, rb: ReplayBuffer, state: BufferState, steps: int | None = None
) -> int:
    """Append the newest ``steps`` time steps of every row of an ``ndim=2`` buffer state
    (default: all it holds) to the vault, oldest first; returns the steps written. Call it
    after every ``steps`` steps added, at least once per ``capacity // num_envs`` of them.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=8, ndim=2)
    >>> state = rb.init({"t": jnp.zeros(2, jnp.int32)})
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", frb.vault.structure(rb, state))
    >>> for i in range(3):
    ...     state = rb.add(state, {"t": jnp.full((2, 3), i, jnp.int32)})
    ...     n = frb.vault.append_buffer(store, rb, state, steps=3)
    >>> frb.vault.read(store)["t"][0].tolist()
    [0, 0, 0, 1, 1, 1, 2, 2, 2]
    """
    return append(store, buffer_items(rb, state, steps))


def read_buffer(
    store: VaultStore,
    rb: ReplayBuffer,
    *,
    timesteps: int | None = None,
    percentiles: tuple[float, float] | None = None,
) -> BufferState:
    """A state of the ``ndim=2`` buffer ``rb`` holding what :func:`read` returns (through
    ``rb.init_from_data``: when a row holds fewer steps than read, the newest are kept).
    ``rb.capacity`` must be a multiple of the vault's ``num_envs``.

    >>> import tempfile, numpy as np, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"x": np.zeros((2, 4), np.int32)})
    >>> _ = frb.vault.append(store, {"x": np.arange(10, dtype=np.int32).reshape(2, 5)})
    >>> rb = frb.ReplayBuffer(capacity=20, ndim=2, batch_size=4)
    >>> int(rb.size(frb.vault.read_buffer(store, rb)))
    10
    """
    where = "functional_rb.vault.read_buffer"
    _require_ndim2(rb, where)
    data = read(store, timesteps=timesteps, percentiles=percentiles)
    if jax.tree_util.tree_leaves(data)[0].shape[1] == 0:
        raise ValueError(
            f"{where}: nothing to read (the vault holds {length(store)} steps and "
            "the interval asked for is empty); a buffer state needs at least one."
        )
    return rb.init_from_data(data)
