"""A FIFO trajectory queue, for on-policy and streaming learners: every time step added is read
exactly once, in the order it was added, and never overwritten before it is read.

Storage is a ``[num_envs, max_length_time_axis]`` grid (an ``ndim=2`` buffer's layout,
:class:`~functional_rb.protocol.Layout`, kept flat by a :class:`~functional_rb.DeviceStorage`):
``add`` appends ``[num_envs, T, ...]`` along time at the write index, ``sample`` returns the
``[num_envs, sample_sequence_length, ...]`` steps after the read index, in order, without a key,
and advances it. Both indices wrap around the time axis; ``is_full`` tells a full ring from an
empty one (both have the indices equal).

What happens when the queue cannot do what is asked (the error policy of
:mod:`functional_rb._internal.errors`):

- ``add`` of more time steps than are free (``max_length_time_axis`` minus the unread ones):
  eagerly ``ValueError``; under ``jit`` the whole add is dropped (nothing is written, the
  indices stay) and ``state.dropped_adds`` counts it. Unread data is never overwritten.
- ``sample`` with fewer unread steps than ``sample_sequence_length``: eagerly ``ValueError``;
  under ``jit`` the sample has ``mask`` all False and ``weights`` 0, and the state is returned
  unchanged (nothing is consumed).
- An add of more than ``max_length_time_axis`` steps can never fit: ``ValueError`` at trace time.

``functional_rb.flashbax.buffers.trajectory_queue`` (flashbax's queue) is this class without
its two guards: it calls :meth:`TrajectoryQueue.write_unguarded` and
:meth:`TrajectoryQueue.read_unguarded` directly, which is how it keeps flashbax's behaviour of
overwriting unread data when asked to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import checks as _checks
from functional_rb._internal import eager as _eager
from functional_rb._internal.errors import (
    check_not_consumed,
    config_int,
    enforce,
    keystr,
)
from functional_rb._internal.names import stable
from functional_rb.protocol import Context, Layout, Sample, WriteRecord
from functional_rb.storages.device import DeviceStorage

PyTree = Any


@stable("QueueState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueueState:
    """State of a :class:`TrajectoryQueue` (a PyTree; ``frb.checkpoint`` saves and loads it).

    storage: the storage's state; items flat, ``[num_envs * max_length_time_axis, ...]``,
      the step ``(env, t)`` at ``env * max_length_time_axis + t``.
    write_index: int32 ``[]``: the time index the next ``add`` writes first.
    read_index: int32 ``[]``: the time index the next ``sample`` reads first.
    is_full: bool ``[]``: every slot holds unread data (then ``write_index == read_index``,
      as when the queue is empty).
    dropped_adds: int32 ``[]``: adds dropped under ``jit`` because they did not fit
      (cumulative since ``init``).
    num_envs: static: rows of the grid (the leading axis of the example given to ``init``).
    """

    storage: PyTree
    write_index: jax.Array
    read_index: jax.Array
    is_full: jax.Array
    dropped_adds: jax.Array
    num_envs: int = dataclasses.field(metadata={"static": True})


def unread_steps(write_index, read_index, is_full, max_length_time_axis: int) -> jax.Array:
    """int32: time steps written and not yet read, per env row, from a queue's indices.

    Elementwise, so it takes the indices of one state or of a population of states.

    >>> int(unread_steps(jnp.int32(2), jnp.int32(6), jnp.bool_(False), 8))  # wrapped around
    4
    """
    length = jnp.int32(max_length_time_axis)
    gap = (jnp.asarray(write_index, jnp.int32) - jnp.asarray(read_index, jnp.int32)) % length
    return jnp.where(is_full, length, gap)


def _num_envs(example, where: str) -> int:
    """The leading axis that every leaf of one vectorized step shares."""
    sizes: dict = {}
    for path, x in jax.tree_util.tree_flatten_with_path(example)[0]:
        if np.ndim(x) < 1:
            raise ValueError(
                f"{where}: the example is one vectorized step, every leaf [num_envs, ...], but "
                f"leaf {keystr(path)} is a scalar (shape {np.shape(x)}). Give it a leading "
                "num_envs axis (a Python list of numbers is read as one scalar leaf per number: "
                "convert it with jnp.asarray)."
            )
        sizes.setdefault(int(np.shape(x)[0]), keystr(path))
    if len(sizes) > 1:
        raise ValueError(
            f"{where}: every leaf of the example shares the leading num_envs axis, "
            f"got {{size: first leaf}} = {sizes}."
        )
    return next(iter(sizes))


@dataclasses.dataclass(frozen=True)
class TrajectoryQueue:
    """A FIFO queue of trajectories: a frozen config whose methods are pure functions of a
    :class:`QueueState` (see the module docstring for what happens when it is full or empty).

    Args:
      max_length_time_axis: time steps each env row holds (a Python int >= 1).
      sample_sequence_length: time steps per env that ``sample`` reads (default; 1 to
        ``max_length_time_axis``); ``sample(state, sequence_length=n)`` overrides it.
      storage: a :class:`~functional_rb.DeviceStorage` (default packed;
        ``DeviceStorage(pack=False)`` keeps one array per leaf).

    ``jax.jit(queue.add, donate_argnums=0)``, ``jax.vmap`` over states and ``lax.scan`` all
    work. Called outside ``jit``, ``add`` and ``sample`` run as one cached, compiled call that
    updates the state in place and consumes the state passed in, as ``ReplayBuffer``'s do
    (:mod:`functional_rb._internal.eager`): keep the returned state.

    >>> import jax.numpy as jnp, functional_rb as frb
    >>> queue = frb.TrajectoryQueue(max_length_time_axis=8, sample_sequence_length=3)
    >>> state = queue.init({"obs": jnp.zeros((2, 4))})            # 2 envs, obs [4]
    >>> steps = jnp.arange(5, dtype=jnp.float32)[None, :, None]   # time 0..4
    >>> state = queue.add(state, {"obs": jnp.broadcast_to(steps, (2, 5, 4))})
    >>> sample, state = queue.sample(state)
    >>> sample.data["obs"][0, :, 0].tolist(), bool(sample.mask.all())
    ([0.0, 1.0, 2.0], True)
    >>> int(queue.unread(state)), bool(queue.can_sample(state))
    (2, False)
    """

    max_length_time_axis: int
    sample_sequence_length: int
    storage: DeviceStorage = dataclasses.field(default_factory=DeviceStorage)

    def __post_init__(self):
        where = "TrajectoryQueue"
        config_int(where, "max_length_time_axis", self.max_length_time_axis, minimum=1)
        config_int(
            where,
            "sample_sequence_length",
            self.sample_sequence_length,
            minimum=1,
            maximum=self.max_length_time_axis,
            fix="A sample reads at most the whole time axis.",
        )
        if not isinstance(self.storage, DeviceStorage):
            raise TypeError(
                f"{where}: storage must be a functional_rb.DeviceStorage (packed or not), got "
                f"{self.storage!r}. The queue reads and writes its storage inside compiled "
                "calls; host storages (MemmapStorage) and TEDStorage are not supported."
            )

    # ------------------------------------------------------------------ layout and checks
    def layout(self, num_envs: int) -> Layout:
        """The static ``[num_envs, max_length_time_axis]`` grid of a state's storage."""
        length = self.max_length_time_axis
        return Layout(capacity=num_envs * length, num_envs=num_envs, row_capacity=length, ndim=2)

    def _context(self, state: QueueState) -> Context:
        # what the storage protocol hands a storage; a DeviceStorage reads none of it
        return Context(
            layout=self.layout(state.num_envs), filled=self.unread(state), cursor=state.write_index
        )

    def _check_state(self, state, where: str, *, storage: bool = True) -> None:
        """Raise unless ``state`` is a :class:`QueueState` laid out as ``init`` builds it
        (static facts only; ``storage=False``: the index fields only, which a population of
        states also passes)."""
        if not isinstance(state, QueueState):
            raise TypeError(
                f"{where}: the state must be the QueueState returned by "
                f"queue.init(example), got {type(state).__name__}."
            )
        check_not_consumed(state, where)
        if not storage:
            return
        n = state.num_envs
        expected = self.storage.state_types
        problem = None
        if not isinstance(state.storage, expected):
            problem = (
                f"state.storage is a {type(state.storage).__name__}, expected "
                f"{' or '.join(t.__name__ for t in expected)}"
            )
        else:
            problem = self.storage.check_state(state.storage, n * self.max_length_time_axis, n)
        if problem:
            raise ValueError(
                f"{where}: {problem}. The state was built by another queue configuration; pass "
                f"the state returned by this queue's init (max_length_time_axis="
                f"{self.max_length_time_axis}, {type(self.storage).__name__}). A population of "
                "states (jax.vmap(queue.init)) needs the call mapped too, e.g. "
                f"jax.vmap(queue.{where.rsplit('.', 1)[-1]})."
            )

    def _length(self, sequence_length, where: str) -> int:
        if sequence_length is None:
            return self.sample_sequence_length
        return config_int(
            where,
            "sequence_length",
            sequence_length,
            minimum=1,
            maximum=self.max_length_time_axis,
            fix="A sample reads at most the whole time axis.",
        )

    # ------------------------------------------------------------------ init and counts
    def init(self, example: PyTree) -> QueueState:
        """An empty queue for steps shaped like ``example``: ONE vectorized step, every leaf
        ``[num_envs, ...]`` (a PyTree of arrays); the storage is zero-filled."""
        where = "TrajectoryQueue.init"
        if not jax.tree_util.tree_leaves(example):
            raise ValueError(
                f"{where}: the example has no array leaves; pass one vectorized "
                "step, e.g. {'obs': jnp.zeros((num_envs, 4))}."
            )
        example = jax.tree_util.tree_map(jnp.asarray, example)
        num_envs = _num_envs(example, where)
        item = jax.tree_util.tree_map(lambda x: x[0], example)
        return QueueState(
            storage=self.storage.init(item, self.layout(num_envs)),
            write_index=jnp.int32(0),
            read_index=jnp.int32(0),
            is_full=jnp.bool_(False),
            dropped_adds=jnp.int32(0),
            num_envs=num_envs,
        )

    def unread(self, state: QueueState) -> jax.Array:
        """int32 ``[]``: time steps per env added and not yet sampled."""
        self._check_state(state, "TrajectoryQueue.unread", storage=False)
        return unread_steps(
            state.write_index, state.read_index, state.is_full, self.max_length_time_axis
        )

    def can_add(self, state: QueueState, num_steps: int) -> jax.Array:
        """bool ``[]``: whether an add of ``num_steps`` time steps (a Python int) fits
        without overwriting unread data."""
        where = "TrajectoryQueue.can_add"
        num_steps = config_int(where, "num_steps", num_steps, minimum=0)
        return jnp.int32(num_steps) <= jnp.int32(self.max_length_time_axis) - self.unread(state)

    def can_sample(self, state: QueueState, sequence_length: int | None = None) -> jax.Array:
        """bool ``[]``: whether ``sequence_length`` (default ``sample_sequence_length``) steps
        per env are unread, so that ``sample`` can read them."""
        n = self._length(sequence_length, "TrajectoryQueue.can_sample")
        return self.unread(state) >= jnp.int32(n)

    # ------------------------------------------------------------------ add
    def add(self, state: QueueState, items: PyTree) -> QueueState:
        """Append ``items`` (leaves ``[num_envs, T, ...]``) along time, after the steps added
        before. Shapes and dtypes are checked at trace time against the example given to
        ``init`` (same-kind casts are made, as ``ReplayBuffer.add`` does).

        When the ``T`` steps do not fit (``can_add(state, T)`` is False): eagerly
        ``ValueError``; under ``jit`` the add is dropped whole and ``state.dropped_adds``
        grows by one. ``T`` larger than ``max_length_time_axis`` raises at trace time.
        """
        where = "TrajectoryQueue.add"
        self._check_state(state, where)
        if _eager.top_level():
            return _eager.call(self, "add", state, items)
        items, num_steps = self.checked_items(state, items, where)
        if num_steps == 0:
            return state
        fits = self.can_add(state, num_steps)
        enforce(
            ~fits,
            lambda i, n: (
                f"{where}: the queue cannot take {num_steps} time steps: it holds "
                f"{int(self.unread(state))} unread of max_length_time_axis="
                f"{self.max_length_time_axis}, so {self.max_length_time_axis - int(self.unread(state))}"
                " are free, and unread data is never overwritten. Sample first (queue.can_add("
                "state, num_steps) tells whether an add fits); under jax.jit such an add is dropped "
                "and counted in state.dropped_adds."
            ),
        )
        return self.write_unguarded(state, items, fits)

    def checked_items(self, state: QueueState, items: PyTree, where: str):
        """``(items cast to the stored dtypes, T)``; raises at trace time, naming the leaf.

        >>> q = TrajectoryQueue(max_length_time_axis=4, sample_sequence_length=2)
        >>> q.checked_items(q.init({"x": jnp.zeros((1,))}), {"x": jnp.ones((1, 3))}, "add")[1]
        3
        """
        spec = self.storage.item_spec(state.storage)
        items = _checks.check_items(spec, items, ndim=2, num_envs=state.num_envs, where=where)
        num_steps = int(np.shape(jax.tree_util.tree_leaves(items)[0])[1])
        if num_steps > self.max_length_time_axis:
            raise ValueError(
                f"{where}: the items hold {num_steps} time steps (axis 1), more than "
                f"max_length_time_axis={self.max_length_time_axis}: no add that long can ever "
                "fit. Add them in pieces of at most max_length_time_axis steps (sampling in "
                "between), or build the queue with a longer time axis."
            )
        return items, num_steps

    def write_unguarded(self, state: QueueState, items: PyTree, ok) -> QueueState:
        """Write ``items`` (checked, ``[num_envs, T, ...]`` with ``T <= max_length_time_axis``)
        at the write index where the bool ``[]`` ``ok`` is True, whatever is unread there;
        where it is False write nothing and count a dropped add. ``is_full`` becomes
        ``new write index == read index``. flashbax's ``add`` is this with ``ok=True``.

        >>> q = TrajectoryQueue(max_length_time_axis=4, sample_sequence_length=2)
        >>> state = q.init({"x": jnp.zeros((1,))})
        >>> state = q.write_unguarded(state, {"x": jnp.ones((1, 3))}, True)
        >>> int(state.write_index), int(q.unread(state))
        (3, 3)
        """
        length = jnp.int32(self.max_length_time_axis)
        leaves = jax.tree_util.tree_leaves(items)
        num_steps = int(np.shape(leaves[0])[1])
        rows = jnp.arange(state.num_envs, dtype=jnp.int32)[:, None] * length
        times = (state.write_index + jnp.arange(num_steps, dtype=jnp.int32)) % length
        positions = (rows + times[None, :]).reshape(-1)
        ok = jnp.asarray(ok, bool)
        flat = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
        record = WriteRecord(positions=positions, mask=jnp.broadcast_to(ok, positions.shape))
        storage = self.storage.set(state.storage, record, flat, self._context(state))
        written = (state.write_index + jnp.int32(num_steps)) % length
        return dataclasses.replace(
            state,
            storage=storage,
            write_index=jnp.where(ok, written, state.write_index),
            is_full=jnp.where(ok, written == state.read_index, state.is_full),
            dropped_adds=state.dropped_adds + (~ok).astype(jnp.int32),
        )

    # ------------------------------------------------------------------ sample
    def sample(
        self, state: QueueState, sequence_length: int | None = None
    ) -> tuple[Sample, QueueState]:
        """Read the oldest ``sequence_length`` (default ``sample_sequence_length``) unread
        steps of every env, in order, and mark them read. Returns ``(Sample, new_state)``:
        ``data`` leaves ``[num_envs, sequence_length, ...]``; ``indices`` int32
        ``[num_envs, sequence_length]``, the flat storage positions read; ``weights`` 1 and
        ``mask`` True. No key: the queue is deterministic.

        Too few unread steps: eagerly ``ValueError``; under ``jit`` ``mask`` is all False,
        ``weights`` 0 and the state comes back unchanged (``data`` then holds whatever those
        slots hold: stale or never-written steps).
        """
        where = "TrajectoryQueue.sample"
        n = self._length(sequence_length, where)
        self._check_state(state, where)
        ok = self.can_sample(state, n)
        enforce(
            ~ok,
            lambda i, k: (
                f"{where}: {n} time steps per env were asked for, but only "
                f"{int(self.unread(state))} are unread. Add more first (queue.can_sample(state) "
                "tells whether a sample can be read); under jax.jit such a sample has mask False "
                "and weights 0, and the state is left unchanged."
            ),
        )
        if _eager.top_level():
            return _eager.call(self, "sample", state, sequence_length=n)
        data, indices, read = self.read_unguarded(state, n)
        mask = jnp.broadcast_to(ok, indices.shape)
        # only the indices change; the storage is the input's either way
        new_state = dataclasses.replace(
            state,
            read_index=jnp.where(ok, read.read_index, state.read_index),
            is_full=jnp.where(ok, read.is_full, state.is_full),
        )
        return Sample(data, indices, mask.astype(jnp.float32), mask), new_state

    def read_unguarded(self, state: QueueState, sequence_length: int):
        """``(data, indices, state)``: the ``sequence_length`` steps of every env from the
        read index on, unread or not, and the state with the read index past them and
        ``is_full`` False. flashbax's ``sample`` is exactly this.

        >>> q = TrajectoryQueue(max_length_time_axis=4, sample_sequence_length=2)
        >>> data, indices, state = q.read_unguarded(q.init({"x": jnp.zeros((1,))}), 2)
        >>> indices.tolist(), int(state.read_index)
        ([[0, 1]], 2)
        """
        length = jnp.int32(self.max_length_time_axis)
        rows = jnp.arange(state.num_envs, dtype=jnp.int32)[:, None] * length
        times = (state.read_index + jnp.arange(sequence_length, dtype=jnp.int32)) % length
        indices = rows + times[None, :]
        data = self.storage.get(state.storage, indices, self._context(state))
        read = dataclasses.replace(
            state,
            read_index=(state.read_index + jnp.int32(sequence_length)) % length,
            is_full=jnp.bool_(False),
        )
        return data, indices, read
