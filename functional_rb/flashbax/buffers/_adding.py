"""How the flat and item buffers shape what they add before the trajectory buffer sees it.

flashbax's flat and item buffers are trajectory buffers whose ``add`` takes single items,
sequences, batches, or batches of sequences; these wrappers add the missing axes so that the
trajectory buffer always receives ``[add_batch_size, T, ...]``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from functional_rb._internal.checks import check_structure
from functional_rb.flashbax import _core
from functional_rb.flashbax.utils import get_tree_shape_prefix


def with_axes(
    add_fn: Callable, add_batches: bool, add_sequences: bool, batch_size: int | None = None
) -> Callable:
    """``add_fn`` taking items without the batch axis (``add_batches`` False) and/or without
    the time axis (``add_sequences`` False). The batch is checked as the user wrote it
    (``batch_size``: the size its batch axis must have, None for any) before the axes are
    added, so an error names the user's shapes."""
    axes = (["add_batch_size" if batch_size is not None else "batch"] if add_batches else []) + (
        ["T"] if add_sequences else []
    )

    def add(state, batch):
        check_leading(state.experience, batch, axes, batch_size, where="add")
        if not add_batches:
            batch = jax.tree_util.tree_map(lambda x: jax.numpy.expand_dims(x, 0), batch)
        if not add_sequences:
            batch = jax.tree_util.tree_map(lambda x: jax.numpy.expand_dims(x, 1), batch)
        return add_fn(state, batch)

    return add


def check_leading(experience, batch, axes: list, batch_size: int | None, where: str) -> None:
    """Raise :class:`~functional_rb.flashbax._core.FlashbaxArgumentError` unless every leaf of
    ``batch`` is an array shaped ``[*axes, *item shape]`` (the item shapes of the stored
    ``experience`` leaves ``[rows, time, *item shape]``)."""
    _core.check_arrays(batch, where)
    spec = jax.tree_util.tree_map(lambda x: x[0, 0], experience)
    try:
        check_structure(spec, batch, where)
    except ValueError as e:
        raise _core.FlashbaxArgumentError(str(e)) from None
    form = "[" + ", ".join(axes + ["*item shape"]) + "]"
    leads = []
    for (path, x), s in zip(
        jax.tree_util.tree_flatten_with_path(batch)[0], jax.tree_util.tree_leaves(spec)
    ):
        shape, item = tuple(jax.numpy.shape(x)), tuple(s.shape)
        lead = shape[: len(axes)]
        fits = len(shape) == len(axes) + len(item) and shape[len(axes) :] == item
        if fits and axes and axes[0] == "add_batch_size":
            fits = lead[0] == batch_size
        if not fits:
            want = ", ".join([str(batch_size) if a == "add_batch_size" else a for a in axes])
            want = "[" + ", ".join([want] * bool(axes) + [str(d) for d in item]) + "]"
            raise _core.FlashbaxArgumentError(
                f"{where}: leaf {jax.tree_util.keystr(path)} has shape {shape}, expected "
                f"{form} = {want} (the item's shape {item} as given to init"
                + (f", add_batch_size={batch_size}" if "add_batch_size" in axes else "")
                + "). Give every leaf that shape."
            )
        leads.append((lead, jax.tree_util.keystr(path)))
    for lead, name in leads[1:]:
        if lead != leads[0][0]:
            raise _core.FlashbaxArgumentError(
                f"{where}: leaves disagree on the leading axes {axes}: {leads[0][1]} has "
                f"{leads[0][0]}, {name} has {lead}; give every leaf the same."
            )


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
