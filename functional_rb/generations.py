"""Write generations: priority updates that cannot land on a newer item.

A priority is computed from a sample (a TD error, say) some time after the sample was drawn;
meanwhile a ring writer may have put a newer item into the same slot. An update by bare
indices would then give the newer item the older one's priority. So every slot carries a
*write generation* in the buffer state, and a sample carries the generations of its items:

* **add**: every written slot is stamped with the buffer's write clock, which advances by one
  per ``add`` call (int32, wrapping at ``2**31``; one ``add`` writes a slot at most once).
  Slots never written hold 0; the first ``add`` stamps 1.
* **sample**: ``Sample.generations`` (int32, the shape of ``indices``) holds the stamp of each
  drawn slot at the draw, and -1 where ``mask`` is False (padding, nothing drawable).
* **update from a sample** (``rb.update(state, sample, priorities)``, or
  ``rb.update(state, indices, priorities, generations=g)``): an entry is applied only when its
  slot's stamp still equals the generation it was drawn with. Entries whose slot was rewritten
  are *dropped*: masked out (under ``jit`` as eagerly: never a host sync), their priorities
  neither applied, nor checked, nor raising the running maximum, and counted in the state
  (:attr:`GenerationState.dropped`, read with ``rb.dropped_updates(state)``). Entries with
  generation -1 (no item) are skipped and not counted.
* **update by bare indices** (``rb.update(state, sample.indices, priorities)``, today's code)
  cannot be checked: there is nothing to compare with. It applies every entry, as before.
  That is the closest sound reading of the contract for it: pass the sample to be protected.

The counter is cumulative and lives in the state, so it composes with ``jax.lax.scan`` (the
carry holds it), ``vmap`` (one per member) and donation; read the difference around a call to
get one call's figure. It wraps at ``2**31``.

Cost. Only samplers that declare ``tracks_generations`` (those whose ``update`` does
something: ``PrioritizedSampler``, ``PrioritizedSliceSampler``) get a generation array; for the
others ``BufferState.generations`` is None and nothing is stamped, gathered or checked. With
one: ``add`` scatters one int32 per written item, ``sample`` gathers one per drawn item,
``update`` gathers and compares one per entry.

Limits. A stamp identifies a write only within one lineage of states: restoring an older
checkpoint and writing again may reuse a stamp, so an update from a sample drawn before the
restore could match a different item. A sample held across ``2**31`` ``add`` calls could
match a rewritten slot whose stamp wrapped around. Checkpoints written before generations
existed load with every slot at generation 0, the clock at 0 and no dropped updates
(:mod:`functional_rb.checkpoint.legacy`): no sample can carry a generation from before the
load, so every update made from a sample drawn after it is checked soundly.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.jit import read_whole
from functional_rb._internal.names import stable
from functional_rb.protocol import Sample, WriteRecord

__all__ = (
    "GenerationState",
    "Check",
    "NO_ITEM",
    "as_generations",
    "check",
    "count_dropped",
    "drawn",
    "from_sample",
    "init",
    "stamp",
)

NO_ITEM = -1  # the generation of a sample entry that is no item (mask False)
_MASK = 0x7FFFFFFF  # stamps stay in [0, 2**31): -1 never names a write


@stable("GenerationState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerationState:
    """Write generations of one buffer (see :mod:`functional_rb.generations`).

    slots: int32 ``[C]``: the stamp of the last write into each flat slot (0: never written).
    clock: int32 ``[]``: the stamp of the last ``add`` (0 before any), in ``[0, 2**31)``.
    dropped: int32 ``[]``: update entries dropped so far because their slot was rewritten
      since the draw (cumulative; wraps at ``2**31``).
    """

    slots: jax.Array
    clock: jax.Array
    dropped: jax.Array


def init(capacity: int) -> GenerationState:
    """Every slot at generation 0, the clock at 0, nothing dropped."""
    return GenerationState(
        slots=jnp.zeros((capacity,), jnp.int32), clock=jnp.int32(0), dropped=jnp.int32(0)
    )


def stamp(state: GenerationState, record: WriteRecord) -> GenerationState:
    """Stamp the slots one ``add`` wrote (``record.mask`` True) with the next clock value."""
    clock = (state.clock + 1) & jnp.int32(_MASK)
    cap = state.slots.shape[-1]
    pos = jnp.where(record.mask, record.positions, cap)  # out of range: dropped
    slots = state.slots.at[pos].set(clock, mode="drop", unique_indices=True)
    return GenerationState(slots=slots, clock=clock, dropped=state.dropped)


def drawn(state: GenerationState, indices: jax.Array, mask: jax.Array) -> jax.Array:
    """int32, the shape of ``indices``: the stamps of the drawn slots, ``NO_ITEM`` where
    ``mask`` is False (``indices`` are in range: a sampler never draws outside)."""
    slots = state.slots
    stamps = read_whole(lambda: slots[indices], slots, indices)  # one thread on the CPU
    return jnp.where(mask, stamps, jnp.int32(NO_ITEM))


class Check(NamedTuple):
    """What an update's generations say, per entry (the shape of the indices).

    keep: bool: the entry may be applied (its slot still holds the item drawn).
    stale: bool: the entry is dropped because its slot was rewritten since the draw (an
      in-range index whose generation is not ``NO_ITEM``).
    """

    keep: jax.Array
    stale: jax.Array


def as_generations(generations, shape: tuple, where: str):
    """``generations`` checked against the indices' ``shape`` (integers, same shape)."""
    g = generations if isinstance(generations, jax.Array) else np.asarray(generations)
    if not np.issubdtype(g.dtype, np.integer):
        raise TypeError(
            f"{where}: generations must be integers (Sample.generations, int32), got {g.dtype}."
        )
    if tuple(g.shape) != tuple(shape):
        raise ValueError(
            f"{where}: generations have shape {tuple(g.shape)}, expected the shape "
            f"of indices {tuple(shape)}: pass the sample's own "
            "sample.generations (or the sample itself)."
        )
    return g


def check(slots: jax.Array, indices, generations) -> Check:
    """Compare ``generations`` (from a sample) with the current stamps in ``slots`` (int32
    ``[C]``) at ``indices`` (any integer dtype; out-of-range entries are neither kept nor
    stale: the sampler's own checks deal with them)."""
    cap = slots.shape[-1]
    idx = indices if isinstance(indices, jax.Array) else np.asarray(indices)
    in_range = (idx >= 0) & (idx < cap)  # in the indices' own dtype (no int32 wrap)
    pos = jnp.where(jnp.asarray(in_range), jnp.asarray(idx), 0).astype(jnp.int32)
    g = generations if isinstance(generations, jax.Array) else np.asarray(generations)
    item = jnp.asarray(g >= 0)
    # a value no stamp can take (beyond int32) never matches, whatever the int32 cast makes it
    fits = jnp.asarray(g <= _MASK)
    g32 = (
        np.where(g <= _MASK, g, NO_ITEM).astype(np.int32)
        if isinstance(g, np.ndarray)
        else g.astype(jnp.int32)
    )
    same = fits & (slots[pos] == g32)
    in_range = jnp.asarray(in_range)
    return Check(keep=item & same, stale=in_range & item & ~same)


def count_dropped(state: GenerationState, stale: jax.Array) -> GenerationState:
    """``state`` with the stale entries counted."""
    return dataclasses.replace(state, dropped=state.dropped + jnp.sum(stale, dtype=jnp.int32))


def from_sample(indices, generations, where: str):
    """``(indices, generations)`` of an update's first argument: a :class:`~functional_rb.Sample`
    gives both (refusing a second ``generations=``); anything else is the indices."""
    if not isinstance(indices, Sample):
        return indices, generations
    if generations is not None:
        raise ValueError(
            f"{where}: got a Sample and generations=; a Sample carries its own "
            "generations: pass one or the other."
        )
    return indices.indices, indices.generations
