"""States saved in an older layout: what :func:`~functional_rb.checkpoint.load` converts.

Write generations (:mod:`functional_rb.generations`). ``BufferState.generations`` did not exist
before; a file written then rebuilds a ``BufferState`` whose ``generations`` is None. A buffer
whose sampler tracks generations (the prioritized ones) needs a
:class:`~functional_rb.generations.GenerationState`, so :func:`add_generations` gives it one with
every slot at generation 0, the write clock at 0 and no dropped updates. That is sound: no
sample can carry a generation from before the load (samples of that code had none), so an
update made from any sample drawn after it compares stamps that the loaded state itself made.

Which states need one: with a template (``like=``), those whose template has generations
(any sampler, your own included; zeros of the template's shapes); without, the states of the
built-in samplers that track them (``PrioritizedState``, ``PrioritizedSliceState``), with the
leading axes of their own arrays (a sharded state's shard axis, a vmapped population's).

TED pending frames (:class:`~functional_rb.ted.TEDStorageState`). ``pending`` did not exist
before: each row's pending next observation was row ``C + S + e`` of every frame table
(``C = capacity``, ``S`` side rows, ``E`` rows, ``e < E``), between the side table and the
frame-stack pre-history. A file written then rebuilds a state whose ``pending`` is None;
:func:`split_ted_pending` moves those ``E`` rows of each table into ``pending`` (same nesting
as ``data``) and closes the gap, so the tables are ``[C + S + E*(k-1), ...]``. ``C``, ``S`` and
``E`` are read from ``ptr``, ``owner`` and ``carry_end``; the frame tables are the data
leaves with other than ``C`` rows; leading axes (a sharded or vmapped state) are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from functional_rb._internal import names
from functional_rb._internal.tree import loaded, set_key
from functional_rb.generations import GenerationState
from functional_rb.protocol import BufferState
from functional_rb.samplers.prioritized import PrioritizedState
from functional_rb.samplers.prioritized_slices import PrioritizedSliceState

__all__ = ("add_generations", "split_ted_pending")


def _is_state(x) -> bool:
    return isinstance(x, BufferState)


# the ignores below: host (NumPy) zeros, as a loaded checkpoint holds them, in fields that
# GenerationState annotates as jax.Array (a PyTree of arrays, device or host)
def _zeros(shape, lead: tuple = ()) -> GenerationState:
    return GenerationState(
        slots=np.zeros(lead + tuple(shape), np.int32),  # type: ignore[arg-type]
        clock=np.zeros(lead, np.int32),  # type: ignore[arg-type]
        dropped=np.zeros(lead, np.int32),  # type: ignore[arg-type]
    )


def _builtin(state: BufferState) -> GenerationState | None:
    """Zero generations for a built-in tracking sampler's state, else None."""
    sampler = state.sampler
    if isinstance(sampler, PrioritizedState):
        lead = tuple(np.shape(sampler.tree.values))[:-1]
        return _zeros((sampler.tree.capacity,), lead)
    if isinstance(sampler, PrioritizedSliceState):
        shape = tuple(np.shape(sampler.prio))
        return _zeros(shape[-1:], shape[:-1])
    return None


def _from_template(template: BufferState) -> GenerationState | None:
    g = getattr(template, "generations", None)
    if not isinstance(g, GenerationState):
        return None
    return GenerationState(
        *(np.zeros(tuple(x.shape), x.dtype) for x in (g.slots, g.clock, g.dropped))  # type: ignore[arg-type]
    )


def add_generations(saved: Any, like: Any = None) -> Any:
    """``saved`` (a loaded tree) with zero generations given to every ``BufferState`` that
    lacks them and needs them (see the module docstring); other nodes are unchanged."""

    def fill(state, template=None):
        if not _is_state(state) or state.generations is not None:
            return state
        gens = _builtin(state) if template is None else _from_template(template)
        return state if gens is None else dataclasses.replace(state, generations=gens)

    if like is not None:
        try:
            return jax.tree_util.tree_map(fill, saved, like, is_leaf=_is_state)
        except (TypeError, ValueError):  # another tree: load's comparison says how it differs
            pass
    return jax.tree_util.tree_map(fill, saved, is_leaf=_is_state)


def _split_pending(ts: Any) -> Any:
    lead = tuple(np.shape(ts.ptr))[:-1]
    ax = len(lead)
    cap, side, envs = (np.shape(x)[-1] for x in (ts.ptr, ts.owner, ts.carry_end))
    pending: dict = {}

    def move(path, leaf):
        nonlocal pending
        if np.shape(leaf)[ax] == cap:
            return leaf
        table = loaded(leaf)
        rows = np.arange(cap + side, cap + side + envs)
        pending = set_key(pending, tuple(p.key for p in path), np.take(table, rows, axis=ax))
        return np.delete(table, rows, axis=ax)

    data = jax.tree_util.tree_map_with_path(move, ts.data)
    return dataclasses.replace(ts, data=data, pending=pending)


def split_ted_pending(saved: Any) -> Any:
    """``saved`` (a loaded tree) with every ``TEDStorageState`` of the older layout (no
    ``pending``) converted to today's (see the module docstring); other nodes unchanged."""

    def is_ted(x):
        # by stable name: ted imports storages, which import this package (no cycle this way)
        return isinstance(x, names.lookup("TEDStorageState", "checkpoint.load"))

    return jax.tree_util.tree_map(
        lambda x: _split_pending(x) if is_ted(x) and x.pending is None else x, saved, is_leaf=is_ted
    )
