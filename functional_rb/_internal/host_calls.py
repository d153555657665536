"""Eager calls of a buffer whose storage reads and writes host memory (``host_io``).

A storage such as :class:`~functional_rb.MemmapStorage` keeps its items in host files: with
concrete arrays its ``set`` and ``get`` are NumPy writes and reads, and under ``jit`` they are
ordered host callbacks. A host callback costs JAX 150-350 us per call on CPU (the arguments
are put on a device and back, ordered effects leave the fast dispatch path), several times
the buffer's own work. So an eager ``add`` / ``sample`` (no trace active, see
:mod:`functional_rb._internal.eager`) of such a buffer is split at the storage:

- ``add``: one compiled, donated call computes everything but the write (the writer's
  positions, the sampler's and the other counters' updates: ``ReplayBuffer._add_planned``);
  then the storage writes the rows with NumPy, with the concrete positions.
- ``sample``: one compiled call draws the indices (``_sample_drawn``, with ``sample``'s
  checks, read once per lineage as in any eager ``sample``); the storage reads the rows with
  NumPy (its ``read_host(state, indices)`` when it has one, which leaves them NumPy arrays,
  else its ``get``); a jitted call builds the :class:`~functional_rb.protocol.Sample` from them
  (``ReplayBuffer._finish``: the sampler's ``finalize``, mask, weights, generations).

The results are those of the traced method (the same code runs, cut in two places), and the
storage's own eager path keeps its guarantees (``MemmapStorage``'s journal records every write
as it does for any eager write). A write that raises (a full disk) leaves the input state
consumed like any eager call, and the storage as its own ``set`` leaves it after a failure.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from functional_rb._internal import eager as _eager


def host_io(storage) -> bool:
    """Whether ``storage`` declares that it reads and writes host memory itself."""
    return bool(getattr(storage, "host_io", False))


def add(rb, state, items):
    """``rb.add(state, items)`` as a compiled plan and a host write."""
    record, items, ctx, planned = _eager.call(rb, "_add_planned", state, items)
    new = dataclasses.replace(planned, storage=rb.storage.set(planned.storage, record, items, ctx))
    _eager.rebind(planned, new)
    return new


def sample(rb, state, key, batch_size, options: dict):
    """``rb.sample(state, key, batch_size, **options)`` as a compiled draw, a host read and a
    compiled finish."""
    drawn, ok, state = _eager.call(
        rb, "_sample_drawn", state, key, batch_size=batch_size, **options
    )
    indices = np.asarray(drawn.indices)
    ctx = rb.context(state)
    read = getattr(rb.storage, "read_host", None)
    data = (
        read(state.storage, indices)
        if read is not None
        else rb.storage.get(state.storage, indices, ctx)
    )
    return _finisher(rb)(state.generations, data, drawn, ok, ctx), state


# id(rb) -> (rb, the jitted finish): the finish reads the state and returns only the Sample,
# so it is a plain jitted call (nothing to donate or forward, no checks: an eager call's
# bookkeeping would cost more than the call). Bounded as the eager cache is.
_FINISH: dict = {}
_FINISH_MAX = 64


def _finisher(rb):
    entry = _FINISH.get(id(rb))
    if entry is None or entry[0] is not rb:
        if len(_FINISH) >= _FINISH_MAX:
            _FINISH.pop(next(iter(_FINISH)))
        entry = _FINISH[id(rb)] = (rb, jax.jit(rb._finish))
    return entry[1]


def clear_cache() -> None:
    """Forget the jitted finishes (with :func:`functional_rb._internal.eager.clear_cache`)."""
    _FINISH.clear()
