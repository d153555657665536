"""flashbax's trajectory queue (``flashbax.buffers.trajectory_queue``) on the core's
:class:`functional_rb.TrajectoryQueue`: the same names, signatures, defaults and behaviour.

The state keeps flashbax's fields (``experience`` ``[add_batch_size, max_length_time_axis,
...]``, ``write_index``, ``read_index``, ``is_full``); each function converts it to the core's
:class:`~functional_rb.QueueState` (the experience reshaped to the storage's flat rows, the
indices renamed), runs the core's code, and converts back. flashbax's behaviour is kept where
it surprises:

- ``add`` writes whether or not the queue can take the batch: a batch that does not fit
  overwrites unread steps, and ``is_full`` becomes ``write_index == read_index`` after the
  write (so it may be False although data was lost). Check ``can_add`` first, as flashbax
  users do. (The core's ``TrajectoryQueue.add`` refuses instead.)
- ``sample`` reads whether or not enough steps are unread: the read index may pass the write
  index, and the sample then holds stale or never-written steps. ``is_full`` is always False
  afterwards. ``sample`` returns ``(state, sample)``, in that order.
- ``can_add`` is False whenever ``is_full``, even for zero steps; ``can_sample`` for a
  zero-length sample is True only when the queue is neither empty nor full.

Differences, none reachable through flashbax's own checks: ``write_index`` / ``read_index``
are int32 also under ``jax_enable_x64``; bad batches raise the core's ``ValueError`` /
``TypeError`` naming the leaf (flashbax: ``AssertionError`` from chex), and batches of another
floating or integer dtype of the same kind are cast (flashbax requires equal dtypes);
``can_add`` with ``add_sequence_length`` over ``max_length_time_axis`` is False (flashbax's
arithmetic may say True for an add its ``add`` then refuses) and ``can_sample`` with a
``sample_sequence_length`` over it is False.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import config_int, keystr
from functional_rb.flashbax import _notices
from functional_rb.flashbax._records import Record, record
from functional_rb.queue import QueueState, unread_steps
from functional_rb.queue import TrajectoryQueue as CoreQueue
from functional_rb.storages.device import DeviceStorageState, LeafStorage

Experience = TypeVar("Experience")
Array = jax.Array

_WHERE = "trajectory_queue"


@record
class TrajectoryQueueState(Record, Generic[Experience]):
    """State of the trajectory queue (flashbax's fields).

    experience: the stored steps, leaves ``[add_batch_size, max_length_time_axis, ...]``.
    write_index: int32 ``[]``: the time index the next ``add`` writes first.
    read_index: int32 ``[]``: the time index the next ``sample`` reads first.
    is_full: bool ``[]``: every slot holds unread data (then ``write_index == read_index``).

    >>> state = init({"obs": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=5)
    >>> state.experience["obs"].shape, int(state.write_index), bool(state.is_full)
    ((2, 5, 3), 0, False)
    """

    experience: Experience
    write_index: Array
    read_index: Array
    is_full: Array


@record
class TrajectoryQueueSample(Record, Generic[Experience]):
    """A sample: ``experience`` leaves ``[add_batch_size, sample_sequence_length, ...]``.

    >>> TrajectoryQueueSample(experience={"obs": jnp.zeros((2, 4, 3))}).experience["obs"].shape
    (2, 4, 3)
    """

    experience: Experience


# the compat states hold one array per leaf, so that they convert to the core's by reshapes
_LEAF_STORAGE = LeafStorage()  # DeviceStorage(pack=False)


@functools.cache
def _core(max_length_time_axis: int) -> CoreQueue:
    # every call here passes its sequence length explicitly: the default is never read
    return CoreQueue(
        max_length_time_axis=max_length_time_axis, sample_sequence_length=1, storage=_LEAF_STORAGE
    )


def _grid(experience, where: str) -> tuple[int, int]:
    """``(add_batch_size, max_length_time_axis)``: the shape prefix every leaf shares."""
    prefix = None
    for path, x in jax.tree_util.tree_flatten_with_path(experience)[0]:
        shape = tuple(np.shape(x))
        if len(shape) < 2 or (prefix is not None and shape[:2] != prefix[0]):
            want = (
                "at least two axes" if prefix is None else f"the prefix {prefix[0]} of {prefix[1]}"
            )
            raise ValueError(
                f"{where}: state.experience{keystr(path)} has shape {shape}, expected "
                f"[add_batch_size, max_length_time_axis, ...] ({want}). Pass the state that "
                "trajectory_queue.init (or the queue's init) returned."
            )
        prefix = prefix or (shape[:2], keystr(path))
    if prefix is None:
        raise ValueError(
            f"{where}: state.experience has no array leaves; pass the state that "
            "trajectory_queue.init returned."
        )
    return prefix[0]


def _to_core(state: TrajectoryQueueState, where: str) -> tuple[QueueState, int]:
    """The core's state for ``state`` (experience reshaped to flat rows) and its time axis."""
    if not isinstance(state, TrajectoryQueueState):
        raise TypeError(
            f"{where}: the state must be a TrajectoryQueueState (from "
            f"trajectory_queue.init), got {type(state).__name__}."
        )
    envs, length = _grid(state.experience, where)
    data = jax.tree_util.tree_map(
        lambda x: jnp.reshape(x, (envs * length,) + x.shape[2:]), state.experience
    )
    core = QueueState(
        storage=DeviceStorageState(data=data),
        write_index=state.write_index,
        read_index=state.read_index,
        is_full=state.is_full,
        dropped_adds=jnp.int32(0),
        num_envs=envs,
    )
    return core, length


def _from_core(core: QueueState, length: int) -> TrajectoryQueueState:
    experience = jax.tree_util.tree_map(
        lambda x: jnp.reshape(x, (core.num_envs, length) + x.shape[1:]), core.storage.data
    )
    return TrajectoryQueueState(
        experience=experience,
        write_index=core.write_index,
        read_index=core.read_index,
        is_full=core.is_full,
    )


def init(
    experience: Experience, add_batch_size: int, max_length_time_axis: int
) -> TrajectoryQueueState[Experience]:
    """The empty queue state: ``experience`` is ONE time step (no batch axis), broadcast to
    ``[add_batch_size, max_length_time_axis, ...]`` and zero-filled.

    >>> state = init({"obs": jnp.zeros(3)}, 2, 5)
    >>> int(state.read_index), state.experience["obs"].dtype
    (0, dtype('float32'))
    """
    where = f"{_WHERE}.init"
    envs = config_int(where, "add_batch_size", add_batch_size, minimum=1)
    length = config_int(where, "max_length_time_axis", max_length_time_axis, minimum=1)
    example = jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (envs,) + jnp.shape(x)), experience
    )
    return _from_core(_core(length).init(example), length)


def can_add(
    state: TrajectoryQueueState[Experience], add_sequence_length: int, max_length_time_axis: int
) -> Array:
    """bool: whether ``add_sequence_length`` steps fit without overwriting unread steps (False
    whenever ``is_full``). Reads the indices only, so a batch of states (``pmap``) gives one
    answer per state.

    >>> state = init({"obs": jnp.zeros(3)}, 2, 5)
    >>> bool(can_add(state, 5, 5)), bool(can_add(state, 6, 5))
    (True, False)
    """
    free = jnp.int32(max_length_time_axis) - unread_steps(
        state.write_index, state.read_index, state.is_full, max_length_time_axis
    )
    return ~jnp.asarray(state.is_full) & (add_sequence_length <= free)


def add(
    state: TrajectoryQueueState[Experience], batch: Experience
) -> TrajectoryQueueState[Experience]:
    """Append ``batch`` (leaves ``[add_batch_size, T, ...]``, ``T <= max_length_time_axis``)
    along the time axis at ``write_index``, continuing the trajectories of the previous add.

    As flashbax's, it writes even when ``can_add`` is False, overwriting unread steps.

    >>> state = init({"obs": jnp.zeros(3)}, 2, 5)
    >>> state = add(state, {"obs": jnp.ones((2, 4, 3))})
    >>> int(state.write_index), bool(state.is_full)
    (4, False)
    """
    where = f"{_WHERE}.add"
    core, length = _to_core(state, where)
    queue = _core(length)
    items, _ = queue.checked_items(core, batch, where)
    return _from_core(queue.write_unguarded(core, items, True), length)


def sample(
    state: TrajectoryQueueState[Experience], sequence_length: int
) -> tuple[TrajectoryQueueState, TrajectoryQueueSample[Experience]]:
    """Read ``sequence_length`` steps of every row from ``read_index`` on, in order; returns
    ``(state, sample)`` with the read index past them and ``is_full`` False.

    As flashbax's, it reads even when ``can_sample`` is False (stale or never-written steps).

    >>> state = add(init({"t": jnp.int32(0)}, 1, 5), {"t": jnp.arange(4)[None]})
    >>> state, batch = sample(state, 3)
    >>> batch.experience["t"].tolist(), int(state.read_index)
    ([[0, 1, 2]], 3)
    """
    where = f"{_WHERE}.sample"
    sequence_length = config_int(where, "sequence_length", sequence_length, minimum=0)
    core, length = _to_core(state, where)
    data, _, read = _core(length).read_unguarded(core, sequence_length)
    return _from_core(read, length), TrajectoryQueueSample(experience=data)


def can_sample(
    state: TrajectoryQueueState[Experience], sample_sequence_length: int, max_length_time_axis: int
) -> Array:
    """bool: whether ``sample_sequence_length`` unread steps are there to sample (a length of
    0: whether the queue is neither empty nor full, as flashbax's arithmetic has it). Reads the
    indices only, so a batch of states (``pmap``) gives one answer per state.

    >>> state = add(init({"t": jnp.int32(0)}, 1, 5), {"t": jnp.arange(4)[None]})
    >>> bool(can_sample(state, 4, 5)), bool(can_sample(state, 5, 5))
    (True, False)
    """
    unread = unread_steps(state.write_index, state.read_index, state.is_full, max_length_time_axis)
    return jnp.where(
        jnp.asarray(sample_sequence_length) == 0,
        jnp.asarray(state.read_index) != jnp.asarray(state.write_index),
        unread >= sample_sequence_length,
    )


@record(pytree=False)
class TrajectoryQueue(Record, Generic[Experience]):
    """The queue's pure functions (flashbax's fields), as ``make_trajectory_queue`` binds
    them: ``init(experience)``, ``add(state, batch)``, ``sample(state) -> (state, sample)``,
    ``can_sample(state)``, ``can_add(state)``. A frozen record:
    ``queue.replace(add=jax.jit(queue.add, donate_argnums=0))`` works.

    >>> queue = make_trajectory_queue(8, add_batch_size=2, add_sequence_length=4,
    ...                               sample_sequence_length=4)
    >>> queue = queue.replace(add=jax.jit(queue.add, donate_argnums=0))
    >>> state = queue.add(queue.init({"obs": jnp.zeros(3)}), {"obs": jnp.ones((2, 4, 3))})
    >>> state, batch = queue.sample(state)
    >>> batch.experience["obs"].shape, bool(queue.can_sample(state))
    ((2, 4, 3), False)
    """

    init: Callable
    add: Callable
    sample: Callable
    can_sample: Callable
    can_add: Callable


def validate_trajectory_queue_args(
    max_length_time_axis: int,
    add_batch_size: int,
    sample_sequence_length: int,
    max_size: int | None,
) -> None:
    """flashbax's checks: ``max_size`` (if given) replaces ``max_length_time_axis`` by
    ``max_size // add_batch_size``, with a warning saying so; ``sample_sequence_length`` over
    the time axis raises ``ValueError``.

    >>> validate_trajectory_queue_args(8, 2, 9, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: make_trajectory_queue: `sample_sequence_length` (9) must be less than or ...
    """
    if max_size is not None:
        _notices.warn(
            "Setting max_size dynamically sets the `max_length_time_axis` to "
            f"be `max_size`//`add_batch_size = {max_size // add_batch_size}`. "
            "This allows one to control exactly how many timesteps/transitions "
            "are stored in the queue. Note that this overrides the `max_length_time_axis` "
            "argument."
        )
        max_length_time_axis = max_size // add_batch_size
    if sample_sequence_length > max_length_time_axis:
        raise ValueError(
            f"make_trajectory_queue: `sample_sequence_length` ({sample_sequence_length}) must "
            "be less than or equal to `max_length_time_axis` "
            f"({max_length_time_axis})."
        )


def make_trajectory_queue(
    max_length_time_axis: int,
    add_batch_size: int,
    add_sequence_length: int,
    sample_sequence_length: int,
    max_size: int | None = None,
) -> TrajectoryQueue:
    """flashbax's ``make_trajectory_queue``: a :class:`TrajectoryQueue` whose functions are
    the module's, bound to these arguments. ``max_size`` (optional) sets the time axis to
    ``max_size // add_batch_size`` (with flashbax's warning).

    >>> queue = make_trajectory_queue(16, 2, add_sequence_length=8, sample_sequence_length=4)
    >>> state = queue.init({"obs": jnp.zeros(3)})
    >>> bool(queue.can_add(state)), bool(queue.can_sample(state))
    (True, False)
    """
    validate_trajectory_queue_args(
        max_length_time_axis=max_length_time_axis,
        add_batch_size=add_batch_size,
        sample_sequence_length=sample_sequence_length,
        max_size=max_size,
    )
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    return TrajectoryQueue(
        init=functools.partial(
            init, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
        ),
        add=functools.partial(add),
        sample=functools.partial(sample, sequence_length=sample_sequence_length),
        can_sample=functools.partial(
            can_sample,
            sample_sequence_length=sample_sequence_length,
            max_length_time_axis=max_length_time_axis,
        ),
        can_add=functools.partial(
            can_add,
            add_sequence_length=add_sequence_length,
            max_length_time_axis=max_length_time_axis,
        ),
    )
