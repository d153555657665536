"""How the flat and item buffers shape what they add before the trajectory buffer sees it.

flashbax's flat and item buffers are trajectory buffers whose ``add`` takes single items,
sequences, batches, or batches of sequences; these wrappers add the missing axes so that the
trajectory buffer always receives ``[add_batch_size, T, ...]``.
"""

from __future__ import annotations

from typing import Callable

import jax

from functional_rb.flashbax.utils import add_dim_to_args, get_tree_shape_prefix


def with_axes(add_fn: Callable, add_batches: bool, add_sequences: bool) -> Callable:
    """``add_fn`` taking items without the batch axis (``add_batches`` False) and/or without
    the time axis (``add_sequences`` False)."""
    if not add_batches:
        add_fn = add_dim_to_args(add_fn, axis=0, starting_arg_index=1, ending_arg_index=2)
    if not add_sequences:
        add_fn = add_dim_to_args(
            add_fn, axis=1 if add_batches else 0, starting_arg_index=1, ending_arg_index=2
        )
    return add_fn


def as_one_row(add_fn: Callable) -> Callable:
    """``add_fn`` of a one-row trajectory buffer taking ``[B, T, ...]``: the items are laid
    along the row's time axis, batch-major (the item buffers' rule)."""

    def add(state, batch):
        rows, steps = get_tree_shape_prefix(batch, n_axes=2)
        return add_fn(
            state,
            jax.tree_util.tree_map(lambda x: x.reshape((1, rows * steps) + x.shape[2:]), batch),
        )

    return add
