"""The bridge from flashbax's state layout to the core's components.

flashbax keeps a trajectory buffer as ``experience`` leaves ``[E, R, ...]`` (``E`` rows of
``R`` time steps), ``current_index`` and ``is_full`` (plus, when prioritised, a sum tree and a
``running_index``). That is exactly the core's ``ndim=2`` layout (flat position ``e * R + t``,
:class:`~functional_rb.protocol.Layout`), so each function here reshapes the leaves (free under
``jit``), builds the core's component states around them, and calls the core's
:class:`~functional_rb.RoundRobinWriter`, ``DeviceStorage(pack=False)``,
:class:`~functional_rb.SequenceSampler` and :class:`~functional_rb.PrioritizedSequenceSampler`.
One implementation serves both APIs; this module holds no buffer logic of its own.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb import generations as _generations
from functional_rb._internal import checks as _checks
from functional_rb._internal.errors import checked_indices
from functional_rb._internal.tree import get_key
from functional_rb.protocol import Context, Layout
from functional_rb.samplers import binary_tree
from functional_rb.samplers.sequences import (
    PrioritizedSequenceSampler,
    SequenceSampler,
    SequenceState,
)
from functional_rb.storages.device import DeviceStorageState, LeafStorage
from functional_rb.writers import RoundRobinState, RoundRobinWriter

PyTree = Any

_STORAGE = LeafStorage()  # DeviceStorage(pack=False)
_WRITER = RoundRobinWriter()


class FlashbaxArgumentError(ValueError, TypeError, AssertionError):
    """A bad argument to a ``functional_rb.flashbax`` function. flashbax reports these with
    chex's ``AssertionError``; the core with ``ValueError`` / ``TypeError``: this error is all
    three, so code written for either catches it."""


def check_arrays(tree: PyTree, where: str) -> None:
    """Raise :class:`FlashbaxArgumentError` at the first leaf of ``tree`` that is not a JAX or
    NumPy array or a Python/NumPy scalar (a torch tensor, a list), naming it and the fix."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            raise FlashbaxArgumentError(
                f"{where}: leaf {jax.tree_util.keystr(path)} is a {type(x).__module__}."
                f"{type(x).__qualname__}, expected a JAX or NumPy array; convert it first "
                "(a torch tensor: jnp.asarray(x.numpy()), or jax.dlpack.from_dlpack(x))."
            )


def time_axis(max_length_time_axis, max_size, add_batch_size: int, where: str) -> int:
    """The rows' length: ``max_size // add_batch_size`` when ``max_size`` is given, else
    ``max_length_time_axis``; neither given raises (flashbax asserts one is)."""
    if max_size is not None:
        return max_size // add_batch_size
    if max_length_time_axis is None:
        raise FlashbaxArgumentError(
            f"{where}: got neither max_length_time_axis nor max_size; give one of them (the "
            "steps each row of the buffer holds, or the steps of all rows together)."
        )
    return max_length_time_axis


def zero_index() -> jax.Array:
    return jnp.int32(0)


def false() -> jax.Array:
    return jnp.bool_(False)


def empty_experience(experience: PyTree, rows: int, length: int) -> PyTree:
    """Zero leaves ``[rows, length, *leaf.shape]`` of each leaf's dtype."""

    check_arrays(experience, "init")

    def empty(x):
        x = jnp.asarray(x)
        return jnp.zeros((rows, length) + x.shape, x.dtype)

    return jax.tree_util.tree_map(empty, experience)


def layout_of(experience: PyTree) -> Layout:
    """The core layout of ``experience`` leaves ``[E, R, ...]``."""
    rows, length = jax.tree_util.tree_leaves(experience)[0].shape[:2]
    return Layout(capacity=rows * length, num_envs=rows, row_capacity=length, ndim=2)


def storage_of(experience: PyTree, layout: Layout) -> DeviceStorageState:
    return DeviceStorageState(
        data=jax.tree_util.tree_map(
            lambda x: x.reshape((layout.capacity,) + x.shape[2:]), experience
        )
    )


def experience_of(storage: DeviceStorageState, layout: Layout) -> PyTree:
    return jax.tree_util.tree_map(
        lambda x: x.reshape((layout.num_envs, layout.row_capacity) + x.shape[1:]), storage.data
    )


def context(current_index, is_full, layout: Layout) -> Context:
    cursor = jnp.asarray(current_index).astype(jnp.int32)
    filled = jnp.where(is_full, jnp.int32(layout.row_capacity), cursor)
    return Context(layout=layout, filled=filled, cursor=cursor)


def check_batch(experience: PyTree, batch: PyTree, where: str) -> PyTree:
    """``batch`` (leaves ``[E, T, ...]``, ``T <= R``) checked against the stored leaves and cast
    to their dtypes; a mismatch raises :class:`FlashbaxArgumentError` naming the leaf."""
    check_arrays(batch, where)
    layout = layout_of(experience)
    spec = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), experience)
    try:
        items = _checks.check_items(spec, batch, ndim=2, num_envs=layout.num_envs, where=where)
    except (ValueError, TypeError) as e:
        raise FlashbaxArgumentError(str(e)) from None
    steps = jax.tree_util.tree_leaves(items)[0].shape[1]
    if steps > layout.row_capacity:
        raise FlashbaxArgumentError(
            f"{where}: the batch has {steps} time steps (axis 1), more than the buffer's "
            f"max_length_time_axis ({layout.row_capacity}); add at most that many per call "
            "(split the batch along time), or build a longer buffer."
        )
    return items


def write(
    experience,
    current_index,
    is_full,
    batch,
    *,
    where: str,
    sampler=None,
    sampler_state=None,
    generations=None,
):
    """Append ``batch`` with the core's ring writer and storage (and tell ``sampler``; stamp
    ``generations``, a :class:`~functional_rb.generations.GenerationState`, when given).
    Returns ``(experience, current_index, is_full, sampler_state, generations)``."""
    items = check_batch(experience, batch, where)
    layout = layout_of(experience)
    ctx = context(current_index, is_full, layout)
    record, ws = _WRITER.write(RoundRobinState.of(ctx.cursor, ctx.filled), items, layout)
    flat = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
    storage = _STORAGE.set(storage_of(experience, layout), record, flat, ctx)
    if sampler is not None:
        after = Context(layout=layout, filled=ws.filled, cursor=ws.cursor)
        sampler_state = sampler.on_add(sampler_state, record, flat, after)
    if generations is not None:
        generations = _generations.stamp(generations, record)
    full = jnp.asarray(is_full) | (ws.filled == jnp.int32(layout.row_capacity))
    return experience_of(storage, layout), ws.cursor, full, sampler_state, generations


@functools.lru_cache(maxsize=128)
def uniform_sampler(sequence_length: int, period: int) -> SequenceSampler:
    return SequenceSampler(sequence_length=sequence_length, period=period)


@functools.lru_cache(maxsize=128)
def prioritised_sampler(
    sequence_length: int, period: int, end_key=None
) -> PrioritizedSequenceSampler:
    """flashbax's prioritisation on the core sampler: values are stored as given (alpha 1,
    eps 0: flashbax applies its exponent in ``set_priorities``), new items get the largest
    value recorded, draws are stratified."""
    return PrioritizedSequenceSampler(
        sequence_length=sequence_length,
        period=period,
        end_key=end_key,
        alpha=1.0,
        beta=0.0,
        eps=0.0,
        stratified=True,
    )


def sample_uniform(
    experience, current_index, is_full, key, batch_size: int, sequence_length: int, period: int
):
    """``(data [B, L, ...], drawn)`` drawn by :class:`~functional_rb.SequenceSampler`."""
    layout = layout_of(experience)
    ctx = context(current_index, is_full, layout)
    sampler = uniform_sampler(sequence_length, period)
    drawn, _ = sampler.sample(
        SequenceState(steps=jnp.int32(0)), key, batch_size * sequence_length, ctx
    )
    return _STORAGE.get(storage_of(experience, layout), drawn.indices, ctx), drawn


def read(experience, current_index, is_full, indices) -> PyTree:
    """The steps at flat positions ``indices`` (int32, any shape ``S``): leaves ``[*S, ...]``."""
    layout = layout_of(experience)
    ctx = context(current_index, is_full, layout)
    return _STORAGE.get(storage_of(experience, layout), indices, ctx)


def sample_with(sampler, sampler_state, experience, current_index, is_full, key, steps: int):
    """``(data, drawn)``: ``steps`` steps drawn by a core ``sampler`` from its state (the
    ``episodes=True`` trajectory buffer's :class:`~functional_rb.EpisodeSampler`)."""
    layout = layout_of(experience)
    ctx = context(current_index, is_full, layout)
    drawn, _ = sampler.sample(sampler_state, key, steps, ctx)
    return _STORAGE.get(storage_of(experience, layout), drawn.indices, ctx), drawn


def can_sample_with(sampler, sampler_state, experience, current_index, is_full, steps: int):
    """bool ``[]``: the core ``sampler`` can draw ``steps`` steps now."""
    ctx = context(current_index, is_full, layout_of(experience))
    return jnp.asarray(sampler.can_sample(sampler_state, ctx, steps))


def sequence_state(running_index, tree, max_value, experience, end_key) -> SequenceState:
    """The core sampler state of a prioritised flashbax state (``ends`` is a view of the
    done leaf of ``experience`` when ``end_key`` is given)."""
    ends = None
    if end_key is not None:
        flags = get_key(experience, end_key, where="functional_rb.flashbax")
        ends = jnp.asarray(flags).astype(bool).reshape(-1)
    return SequenceState(
        steps=jnp.asarray(running_index).astype(jnp.int32),
        tree=tree,
        ends=ends,
        max_priority=jnp.asarray(max_value, jnp.float32),
    )


def sample_prioritised(
    experience,
    current_index,
    is_full,
    st: SequenceState,
    key,
    batch_size: int,
    sampler: PrioritizedSequenceSampler,
):
    """``(data [B, L, ...], item indices [B], probabilities [B], drawn)``."""
    layout = layout_of(experience)
    ctx = context(current_index, is_full, layout)
    drawn, _ = sampler.sample(st, key, batch_size * sampler.sequence_length, ctx)
    items = sampler.item_of(drawn.indices[:, 0], layout)
    total = binary_tree.total(st.tree)
    probabilities = binary_tree.get(st.tree, items) / jnp.where(total > 0, total, 1.0)
    data = _STORAGE.get(storage_of(experience, layout), drawn.indices, ctx)
    return data, items, probabilities, drawn


def set_item_values(
    experience,
    current_index,
    is_full,
    st: SequenceState,
    items,
    values,
    sampler: PrioritizedSequenceSampler,
    where: str,
    *,
    drawable_only: bool = False,
    generations=None,
    drawn_generations=None,
):
    """The core sampler's ``set_priorities`` of the items ``items`` (flashbax's item indices)
    to the stored values ``values`` (``drawable_only``: only items drawable now). With
    ``generations`` (the state's) and ``drawn_generations`` (the sample's), an item whose first
    step was rewritten since the draw is dropped and counted. Returns ``(sampler state,
    generations)``."""
    layout = layout_of(experience)
    n_items = layout.num_envs * sampler.items_per_row(layout)
    items, ok = checked_indices(
        items, n_items, where=where, fallback="out-of-range indices are ignored", clip=True
    )
    ctx = context(current_index, is_full, layout)
    starts = sampler.start_of(items, layout)
    if drawn_generations is not None:
        found = _generations.check(generations.slots, starts, drawn_generations)
        generations = _generations.count_dropped(generations, found.stale & ok)
        ok = ok & found.keep
    st = sampler.set_priorities(st, starts, values, ctx, keep=ok, drawable_only=drawable_only)
    return st, generations
