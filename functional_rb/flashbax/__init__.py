"""flashbax 0.1.3's public API on functional_rb's core: ``import functional_rb.flashbax as fbx``
replaces ``import flashbax as fbx``.

The builders (``make_flat_buffer``, ``make_item_buffer``, ``make_trajectory_buffer``, their
prioritised forms, ``make_trajectory_queue``, ``make_mixer``), the modules under
``functional_rb.flashbax.buffers``, ``utils`` and ``vault.Vault`` have flashbax's names,
signatures, defaults, state fields and semantics; underneath, every buffer is the core's
storage, ring writer and sequence samplers (:mod:`functional_rb.flashbax._core`). What differs,
and the opt-ins flashbax lacks, are listed in the guide's "For flashbax users" page.

>>> import functional_rb.flashbax as fbx
>>> buffer = fbx.make_flat_buffer(max_length=32, min_length=2, sample_batch_size=4)
>>> state = buffer.init({"obs": jnp.zeros(2)})
>>> state = buffer.add(state, {"obs": jnp.ones(2)})
>>> state.experience["obs"].shape
(1, 32, 2)
"""

from functional_rb._internal.lazy import lazy_exports
from functional_rb.flashbax import buffers, utils
from functional_rb.flashbax.buffers import (
    flat_buffer,
    item_buffer,
    make_flat_buffer,
    make_item_buffer,
    make_prioritised_flat_buffer,
    make_prioritised_item_buffer,
    make_prioritised_trajectory_buffer,
    make_trajectory_buffer,
    prioritised_flat_buffer,
    prioritised_item_buffer,
    prioritised_trajectory_buffer,
    trajectory_buffer,
)

# the queue and the mixer on first use; vault needs tensorstore (the "vault" extra)
_LAZY = {
    "make_mixer": "functional_rb.flashbax.buffers.mixer:make_mixer",
    "make_trajectory_queue": "functional_rb.flashbax.buffers.trajectory_queue:"
    "make_trajectory_queue",
    "mixer": "functional_rb.flashbax.buffers.mixer",
    "trajectory_queue": "functional_rb.flashbax.buffers.trajectory_queue",
    "vault": "functional_rb.flashbax.vault",
}

__all__ = (
    "buffers",
    "flat_buffer",
    "item_buffer",
    "make_flat_buffer",
    "make_item_buffer",
    "make_mixer",
    "make_prioritised_flat_buffer",
    "make_prioritised_item_buffer",
    "make_prioritised_trajectory_buffer",
    "make_trajectory_buffer",
    "make_trajectory_queue",
    "mixer",
    "prioritised_flat_buffer",
    "prioritised_item_buffer",
    "prioritised_trajectory_buffer",
    "trajectory_buffer",
    "trajectory_queue",
    "utils",
    "vault",
)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
