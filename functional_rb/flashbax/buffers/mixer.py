"""flashbax's mixer (``flashbax.buffers.mixer``): one batch drawn from several flashbax-style
buffers in fixed proportions, on the core mixer's logic (:mod:`functional_rb.mixer`).

The names, signatures, defaults and behaviour are flashbax 0.1.3's, surprises included:

* **The split** is :func:`functional_rb.mixer.split_batch` with flashbax's rounding
  (``rounding="first"``): buffer ``k`` gets ``int(p_k / sum(p) * sample_batch_size)`` rows,
  computed in floating point, and buffer 0 gets whatever is left over. So
  ``proportions=(0.29, 0.71)`` with 100 rows gives ``[29, 71]`` because ``0.29 / 1.0 * 100`` is
  ``28.999...`` (28, and the missing row goes to buffer 0), and ``(1, 1, 1)`` with 10 rows gives
  ``[4, 3, 3]``. A proportion of 0 is allowed and gives that buffer no rows (it is still
  sampled). (The core :class:`~functional_rb.Mixer` defaults to the largest-remainder rule.)
* **Each buffer draws its own full batch** (``buffer.sample(state, key)``, its own
  ``sample_batch_size``), of which the first ``prop_batch_sizes[k]`` rows are kept: a buffer
  whose ``sample_batch_size`` is smaller than its share gives fewer rows, and the batch is
  shorter than ``sample_batch_size``, silently (as in flashbax). The key is split into one key
  per buffer, ``jax.random.split(key, len(states))[k]`` for buffer ``k``.
* **What comes back is one buffer's sample type** with every field concatenated along the
  batch axis, in buffer order: ``TrajectoryBufferSample.experience`` leaves
  ``[sample_batch_size, sequence_length, ...]``, ``TransitionSample.experience`` an
  ``ExperiencePair``; nothing says which buffer a row came from (the rows of buffer ``k`` are
  ``sum(prop_batch_sizes[:k])`` onwards). With prioritised buffers ``indices`` point into each
  buffer's own sum tree and ``probabilities`` are each buffer's own ``P_k(i)``, not the
  mixture's ``p_k * P_k(i)``: to set priorities, cut the batch by ``prop_batch_sizes`` and call
  each buffer's ``set_priorities`` with its part. The mixer returns no new states (flashbax's
  buffers do not change on sampling).
* ``make_mixer`` asserts that the numbers of buffers and proportions match, that every buffer
  is an instance of the first one's type (so a prioritised buffer may follow a plain
  trajectory buffer, its base class, but not precede it) and that ``sample_batch_size > 0``;
  those raise :class:`~functional_rb.flashbax._core.FlashbaxArgumentError` (an
  ``AssertionError`` as in flashbax, and a ``ValueError``). Samples whose structures,
  trailing shapes or dtypes differ raise ``ValueError`` naming the leaf (flashbax raises
  whatever ``jnp.concatenate`` or ``tree_map`` raise).

The core's :class:`~functional_rb.Mixer` goes further: exact proportions per batch, the source
of each row, importance weights correct for the mixture and priority updates routed to each
buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

# chex's names for these, without depending on chex (no extra declares it)
PRNGKey = Array
Numeric = float | int | Array

from functional_rb import mixer as _mixer
from functional_rb.flashbax._core import FlashbaxArgumentError
from functional_rb.flashbax._records import Record, record
from functional_rb.flashbax.buffers.flat_buffer import TransitionSample
from functional_rb.flashbax.buffers.prioritised_trajectory_buffer import (
    PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferSample,
    PrioritisedTrajectoryBufferState,
)
from functional_rb.flashbax.buffers.trajectory_buffer import (
    TrajectoryBuffer,
    TrajectoryBufferSample,
    TrajectoryBufferState,
)

# flashbax's module-level names: the sample, state and buffer types a mixer takes
sample_types = [
    TrajectoryBufferSample,
    PrioritisedTrajectoryBufferSample,
    TransitionSample,
]
SampleTypes = TypeVar(
    "SampleTypes", TrajectoryBufferSample, PrioritisedTrajectoryBufferSample, TransitionSample
)

state_types = [TrajectoryBufferState, PrioritisedTrajectoryBufferState]
StateTypes = TypeVar("StateTypes", TrajectoryBufferState, PrioritisedTrajectoryBufferState)

BufferTypes = TypeVar("BufferTypes", TrajectoryBuffer, PrioritisedTrajectoryBuffer)


@record(pytree=False)
class Mixer(Record):
    """Pure functions defining the mixer (flashbax's record).

    sample: ``(states, key) -> sample``: a batch drawn from every buffer in proportion,
      concatenated along the batch axis.
    can_sample: ``(states) -> bool []``: whether every buffer can sample.

    A frozen dataclass: ``mixer.replace(sample=jax.jit(mixer.sample))`` works.

    >>> m = Mixer(sample=lambda states, key: None, can_sample=lambda states: True)
    >>> m.replace(can_sample=lambda states: False).can_sample([])
    False
    """

    sample: Callable
    can_sample: Callable


def _batch_slicer(sample: SampleTypes, batch_start: int, batch_end: int) -> SampleTypes:
    """Rows ``batch_start`` to ``batch_end`` of every leaf of ``sample`` (flashbax's helper).

    >>> _batch_slicer({"x": jnp.arange(5)}, 1, 3)["x"].tolist()
    [1, 2]
    """
    return jax.tree_util.tree_map(lambda x: x[batch_start:batch_end, ...], sample)


def _check_lengths(where: str, states, **named) -> None:
    for name, seq in named.items():
        if len(seq) != len(states):
            raise ValueError(
                f"{where}: {len(states)} states but {len(seq)} {name}; pass one "
                "state per buffer, in the order the mixer was made with."
            )


def sample_mixer_fn(
    states: Sequence[StateTypes],
    key: PRNGKey,
    prop_batch_sizes: Sequence[int],
    sample_fns: Sequence[Callable[[StateTypes, PRNGKey], SampleTypes]],
) -> SampleTypes:
    """Sample every buffer and keep ``prop_batch_sizes[k]`` rows of buffer ``k``'s batch,
    concatenated along the batch axis, in buffer order (flashbax's function; see the module
    docstring for what the rows are).

    Every buffer's sample must have the same PyTree structure and trailing shapes (e.g. the
    same sequence length); the batch sizes may differ.

    >>> import functional_rb.flashbax as fbx
    >>> bufs = [fbx.make_item_buffer(max_length=8, min_length=1, sample_batch_size=4,
    ...                              add_sequences=True)
    ...         for _ in range(2)]
    >>> states = [b.add(b.init(jnp.float32(0)), jnp.full(3, float(k)))
    ...           for k, b in enumerate(bufs)]
    >>> batch = sample_mixer_fn(states, jax.random.PRNGKey(0), [3, 1],
    ...                         [b.sample for b in bufs])
    >>> batch.experience.tolist()
    [0.0, 0.0, 0.0, 1.0]
    """
    where = "sample_mixer_fn"
    _check_lengths(where, states, prop_batch_sizes=prop_batch_sizes, sample_fns=sample_fns)
    keys = jax.random.split(key, len(states))
    parts = [
        _batch_slicer(fn(state, keys[k]), 0, n)
        for k, (state, fn, n) in enumerate(zip(states, sample_fns, prop_batch_sizes))
    ]
    return _mixer.concatenate(
        parts, where=where, names=[f"buffer {k}'s sample" for k in range(len(parts))]
    )


def can_sample_mixer_fn(
    states: Sequence[StateTypes],
    can_sample_fns: Sequence[Callable[[StateTypes], Array]],
) -> Array:
    """bool ``[]``: whether every buffer can sample (flashbax's function).

    >>> bool(can_sample_mixer_fn([1, 2], [lambda s: s > 0, lambda s: s > 1]))
    True
    """
    _check_lengths("can_sample_mixer_fn", states, can_sample_fns=can_sample_fns)
    return jnp.all(jnp.asarray([fn(state) for state, fn in zip(states, can_sample_fns)]))


def _number(p):
    """A 0-d array proportion as its Python number (flashbax sums them with Python's ``sum``)."""
    return p.item() if isinstance(p, (np.ndarray, jax.Array)) and np.ndim(p) == 0 else p


def make_mixer(
    buffers: Sequence[BufferTypes],
    sample_batch_size: int,
    proportions: Sequence[Numeric],
) -> Mixer:
    """Create the mixer (flashbax's builder): ``sample_batch_size`` rows split between
    ``buffers`` by ``proportions`` (ratios), with flashbax's rounding (module docstring).

    >>> import functional_rb.flashbax as fbx
    >>> bufs = [fbx.make_item_buffer(max_length=8, min_length=1, sample_batch_size=4,
    ...                              add_sequences=True)
    ...         for _ in range(2)]
    >>> mixer = make_mixer(bufs, sample_batch_size=4, proportions=[0.5, 0.5])
    >>> states = [b.add(b.init(jnp.float32(0)), jnp.full(3, float(k)))
    ...           for k, b in enumerate(bufs)]
    >>> bool(mixer.can_sample(states))
    True
    >>> mixer.sample(states, jax.random.PRNGKey(0)).experience.tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    where = "make_mixer"
    if len(buffers) != len(proportions):
        raise FlashbaxArgumentError(
            f"{where}: Number of buffers and proportions must match: {len(buffers)} buffers, "
            f"{len(proportions)} proportions {list(proportions)}; pass one proportion per "
            "buffer."
        )
    for k, b in enumerate(buffers):
        if not isinstance(b, type(buffers[0])):
            raise FlashbaxArgumentError(
                f"{where}: All buffers must be of the same type: buffers[{k}] is a "
                f"{type(b).__name__}, not an instance of buffers[0]'s type "
                f"{type(buffers[0]).__name__}. (A subclass may follow its base class: put a "
                "plain buffer first to mix it with prioritised ones.)"
            )
    if not sample_batch_size > 0:
        raise FlashbaxArgumentError(
            f"{where}: Sample batch size must be greater than 0, got {sample_batch_size!r}."
        )
    prop_batch_sizes = list(
        _mixer.split_batch(sample_batch_size, [_number(p) for p in proportions], rounding="first")
    )
    return Mixer(
        sample=functools.partial(
            sample_mixer_fn,
            prop_batch_sizes=prop_batch_sizes,
            sample_fns=[b.sample for b in buffers],
        ),
        can_sample=functools.partial(
            can_sample_mixer_fn, can_sample_fns=[b.can_sample for b in buffers]
        ),
    )
