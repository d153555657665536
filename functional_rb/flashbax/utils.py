"""flashbax's ``utils`` module: shape helpers and the wrapper that adds batch axes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from functional_rb.flashbax._core import FlashbaxArgumentError

__all__ = ("add_dim_to_args", "get_timestep_count", "get_tree_shape_prefix")


def get_tree_shape_prefix(tree, n_axes: int = 1) -> tuple:
    """The leading ``n_axes`` dimensions shared by every leaf of ``tree``.

    >>> get_tree_shape_prefix({"a": jnp.zeros((2, 3, 4)), "b": jnp.zeros((2, 3))}, 2)
    (2, 3)
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    prefix = tuple(leaves[0][1].shape[:n_axes])
    for path, leaf in leaves:
        if tuple(leaf.shape[:n_axes]) != prefix:
            raise FlashbaxArgumentError(
                f"get_tree_shape_prefix: leaf {jax.tree_util.keystr(path)} has leading shape "
                f"{tuple(leaf.shape[:n_axes])}, expected {prefix} (the first leaf's); every "
                f"leaf must share its first {n_axes} axes."
            )
    return prefix


def add_dim_to_args(
    func: Callable,
    axis: int = 1,
    starting_arg_index: int | None = 1,
    ending_arg_index: int | None = None,
    kwargs_on_device_keys: list | None = None,
) -> Callable:
    """``func`` with a new axis ``axis`` added to every leaf of the positional arguments
    ``[starting_arg_index, ending_arg_index)`` (and of the keyword arguments named in
    ``kwargs_on_device_keys``, all of them when None, at axis 1 as flashbax does).

    >>> f = add_dim_to_args(lambda s, x: x.shape, axis=0)
    >>> f(None, jnp.zeros(3))
    (1, 3)
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        end = len(args) if ending_arg_index is None else ending_arg_index
        args = list(args)
        args[starting_arg_index:end] = [
            jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, axis=axis), a)
            for a in args[starting_arg_index:end]
        ]
        for k, v in kwargs.items():
            if kwargs_on_device_keys is None or k in kwargs_on_device_keys:
                kwargs[k] = jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, axis=1), v)
        return func(*args, **kwargs)

    return wrapper


def get_timestep_count(buffer_state) -> int:
    """Time steps stored in a trajectory buffer state (all rows together).

    >>> from functional_rb.flashbax.buffers import trajectory_buffer as tb
    >>> state = tb.add(tb.init({"obs": jnp.zeros(())}, 2, 8), {"obs": jnp.ones((2, 3))})
    >>> int(get_timestep_count(state))
    6
    """
    for name in ("experience", "current_index", "is_full"):
        if not hasattr(buffer_state, name):
            raise FlashbaxArgumentError(
                f"get_timestep_count: expected a trajectory buffer state (with experience, "
                f"current_index and is_full), got {type(buffer_state).__name__} without "
                f"{name!r}."
            )
    rows, length = get_tree_shape_prefix(buffer_state.experience, 2)
    return rows * jnp.where(buffer_state.is_full, length, buffer_state.current_index)
