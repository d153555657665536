"""flashbax's ``flashbax.buffers`` package: the builders, and one module per buffer family.

The queue and the mixer modules are imported when first used, so a program that uses only
the replay buffers does not import them."""

from functional_rb._internal.lazy import lazy_exports
from functional_rb.flashbax.buffers import (
    flat_buffer,
    item_buffer,
    prioritised_flat_buffer,
    prioritised_item_buffer,
    prioritised_trajectory_buffer,
    sum_tree,
    trajectory_buffer,
)
from functional_rb.flashbax.buffers.flat_buffer import make_flat_buffer
from functional_rb.flashbax.buffers.item_buffer import make_item_buffer
from functional_rb.flashbax.buffers.prioritised_flat_buffer import make_prioritised_flat_buffer
from functional_rb.flashbax.buffers.prioritised_item_buffer import make_prioritised_item_buffer
from functional_rb.flashbax.buffers.prioritised_trajectory_buffer import (
    make_prioritised_trajectory_buffer,
)
from functional_rb.flashbax.buffers.trajectory_buffer import make_trajectory_buffer

_LAZY = {
    "mixer": "functional_rb.flashbax.buffers.mixer",
    "make_mixer": "functional_rb.flashbax.buffers.mixer:make_mixer",
    "trajectory_queue": "functional_rb.flashbax.buffers.trajectory_queue",
    "make_trajectory_queue": "functional_rb.flashbax.buffers.trajectory_queue:"
    "make_trajectory_queue",
}

__all__ = (
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
    "sum_tree",
    "trajectory_buffer",
    "trajectory_queue",
)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
