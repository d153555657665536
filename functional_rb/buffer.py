"""The replay buffer: a frozen composition of storage x writer x sampler, and its state."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb import generations as _generations
from functional_rb import rate_limiter as _rate_limiter
from functional_rb._internal import checks as _checks
from functional_rb._internal import eager as _eager
from functional_rb._internal import folds as _folds
from functional_rb._internal import host_calls as _host_calls
from functional_rb._internal import pages as _pages
from functional_rb._internal.errors import check_not_consumed, checked_indices, enforce
from functional_rb._internal.jit import passed_through, settled
from functional_rb.collectives import ops as _sharded_ops
from functional_rb.protocol import (
    BufferState,
    Context,
    Layout,
    Sample,
    Sampler,
    Storage,
    Writer,
    missing_members,
)
from functional_rb.rate_limiter import RateLimiter
from functional_rb.samplers.uniform import RandomSampler
from functional_rb.storages.device import DeviceStorage
from functional_rb.writers import ImmutableWriter, RoundRobinWriter

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ReplayBuffer:
    """A replay buffer whose methods are pure functions of an explicit state.

    Args:
      capacity: total elements stored; with ``ndim=2`` the total over ``[num_envs, time]``
        (must be a multiple of ``num_envs``).
      sampler: which items come out (default :class:`RandomSampler`).
      writer: where new items go (default :class:`RoundRobinWriter`).
      storage: where items live (default :class:`DeviceStorage`).
      batch_size: default number of items per ``sample`` (a Python int).
      ndim: 1 (items ``[B, ...]``) or 2 (storage ``[num_envs, time]``, items added as
        ``[num_envs, T, ...]``).
      rate_limiter: a :class:`~functional_rb.RateLimiter` (default None): its counters live in
        the state; ``can_sample`` and ``can_insert`` honour it (:mod:`functional_rb.rate_limiter`).

    ``ReplayBuffer`` is frozen and hashable; ``jax.jit(rb.add, donate_argnums=0)``,
    ``jax.jit(rb.sample, donate_argnums=0)``, ``jax.vmap`` over states and ``lax.scan`` all
    work.

    Called outside ``jax.jit``, ``add``, ``sample`` and ``update`` each run as one cached,
    compiled call that updates the state in place: the state passed in is consumed (as with
    ``donate_argnums``) and the returned one replaces it; passing the old one again raises an
    error saying so (:mod:`functional_rb._internal.eager`). Inside your own ``jit``/``scan``/``vmap``
    they are ordinary traced functions.
    """

    capacity: int
    sampler: Sampler = dataclasses.field(default_factory=RandomSampler)
    writer: Writer = dataclasses.field(default_factory=RoundRobinWriter)
    storage: Storage = dataclasses.field(default_factory=DeviceStorage)
    batch_size: int = 256
    ndim: int = 1
    rate_limiter: RateLimiter | None = None

    def __post_init__(self):
        _checks.check_int("capacity", self.capacity, 1)
        _checks.check_int("batch_size", self.batch_size, 1)
        if self.ndim not in (1, 2):
            raise ValueError(f"ReplayBuffer: ndim must be 1 or 2, got {self.ndim!r}.")
        for name, protocol, example in (
            ("sampler", Sampler, "RandomSampler"),
            ("writer", Writer, "RoundRobinWriter"),
            ("storage", Storage, "DeviceStorage"),
        ):
            obj = getattr(self, name)
            missing = missing_members(obj, protocol)
            if missing:
                raise TypeError(
                    f"ReplayBuffer: {name}={obj!r} is not a {name} (it lacks {missing}); pass "
                    f"e.g. frb.{example}(), or subclass frb.protocol.{protocol.__name__} (it "
                    "declares the optional members with their defaults)."
                )
            try:
                hash(obj)
            except TypeError as e:
                raise TypeError(
                    f"ReplayBuffer: {name}={obj!r} must be hashable (a frozen "
                    "config object) so that jit can cache on it."
                ) from e
        # a sampler whose state depends on the default batch size resolves it now
        object.__setattr__(self, "sampler", self.sampler.bind(batch_size=self.batch_size))
        self.sampler.validate(capacity=self.capacity, batch_size=self.batch_size, ndim=self.ndim)
        _rate_limiter.check_buffer(self.rate_limiter, batch_size=self.batch_size)
        # Slice samplers and TEDStorage follow time through the ring (a trajectory is a run of
        # consecutive slots); a writer that puts items elsewhere (MaxValueWriter: into the
        # lowest-ranked item's slot) would make them return silently wrong data.
        for name, obj in (("sampler", self.sampler), ("storage", self.storage)):
            if obj.requires_fifo and not self.writer.time_ordered:
                raise ValueError(
                    f"ReplayBuffer: {name}={type(obj).__name__} needs a FIFO writer "
                    "(RoundRobinWriter, or ImmutableWriter with the state built by "
                    "rb.init_from_data): it reads trajectories as consecutive slots of the "
                    f"ring, got writer={self.writer!r}, which does not write in time order. "
                    "Use writer=frb.RoundRobinWriter(), or a sampler/storage that does not "
                    "follow trajectories (e.g. RandomSampler, DeviceStorage)."
                )

    # ------------------------------------------------------------------ layout and context
    def layout(self, state_or_num_envs) -> Layout:
        """The static :class:`Layout` of a state (or of a number of envs)."""
        n = (
            state_or_num_envs.num_envs
            if isinstance(state_or_num_envs, BufferState)
            else int(state_or_num_envs)
        )
        return Layout(
            capacity=self.capacity, num_envs=n, row_capacity=self.capacity // n, ndim=self.ndim
        )

    def context(self, state: BufferState) -> Context:
        return Context(
            layout=self.layout(state), filled=state.writer.filled, cursor=state.writer.cursor
        )

    # ------------------------------------------------------------------ init
    def init(self, example: PyTree) -> BufferState:
        """A fresh, empty state for items shaped like ``example``.

        ``example`` is ONE item (no batch axis), any PyTree of arrays; with ``ndim=2`` it is one
        vectorized step, leaves ``[num_envs, ...]``.
        """
        _checks.check_example(example)
        leaves = jax.tree_util.tree_flatten_with_path(example)[0]
        if not leaves:
            raise ValueError(
                "ReplayBuffer.init: the example has no array leaves; pass one item, "
                "e.g. {'obs': jnp.zeros(4), 'reward': jnp.float32(0)}."
            )
        example = jax.tree_util.tree_map(jnp.asarray, example)
        num_envs = 1
        if self.ndim == 2:
            num_envs = _checks.num_envs_of(example)
            if self.capacity % num_envs:
                raise ValueError(
                    f"ReplayBuffer.init: with ndim=2 capacity ({self.capacity}) must be a "
                    f"multiple of num_envs ({num_envs}, the example's leading axis); e.g. "
                    f"capacity={self.capacity // num_envs * num_envs or num_envs}."
                )
            item = jax.tree_util.tree_map(lambda x: x[0], example)
        else:
            item = example
        # a writer that reads the items (MaxValueWriter's rank_key) checks them now rather
        # than at the first add, and before the storage creates anything (MemmapStorage files)
        self.writer.check_item_spec(
            jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), item)
        )
        layout = self.layout(num_envs)
        storage_state = self.storage.init(item, layout)
        spec = self.storage.item_spec(storage_state)
        return BufferState(
            storage=storage_state,
            writer=self.writer.init(layout),
            sampler=self.sampler.init(spec, layout),
            num_envs=num_envs,
            limiter=_rate_limiter.init(self.rate_limiter),
            generations=(
                _generations.init(self.capacity) if self.sampler.tracks_generations else None
            ),
        )

    def init_from_data(self, data: PyTree) -> BufferState:
        """A state holding ``data`` (leaves ``[N, ...]``, ``ndim=2``: ``[num_envs, T, ...]``).

        Works with every writer, ``ImmutableWriter`` included (this is how datasets are built):
        the items are written as a round-robin writer would, then the writer takes over.
        """
        first = jax.tree_util.tree_map(
            lambda x: jnp.asarray(x)[0] if self.ndim == 1 else jnp.asarray(x)[:, 0], data
        )
        state = self.init(first)
        writer = RoundRobinWriter() if isinstance(self.writer, ImmutableWriter) else self.writer
        if _eager.top_level() and any(
            getattr(x, "nbytes", 0) >= _pages.MIN_BYTES for x in jax.tree_util.tree_leaves(state)
        ):
            # a large state: written by the compiled, donated add, in place into init's
            # buffers, which keep their huge-page advice (op by op, each write returns a new,
            # unadvised buffer; measured at 256 MiB, the compiled write is also 2x faster)
            rb = self if writer is self.writer else dataclasses.replace(self, writer=writer)
            return rb.add(state, data)
        return self._add(state, data, writer)

    # ------------------------------------------------------------------ add
    def add(self, state: BufferState, items: PyTree) -> BufferState:
        """Add a batch: leaves ``[B, ...]`` (``ndim=2``: ``[num_envs, T, ...]``).

        If ``B`` exceeds the capacity only the last ``capacity`` items are kept, in order.
        Shapes and dtypes are checked at trace time against the stored items; values are cast
        to the stored dtype when the cast is of the same kind (float64 -> float32 is fine,
        float -> int raises ``TypeError``).

        Narrowing integer casts (e.g. int64 or int32 items into an int8 leaf): with concrete
        inputs (eager calls, NumPy arrays) a value outside the stored dtype's range raises
        ``OverflowError`` naming the leaf. Under ``jax.jit`` values are not inspected: an
        out-of-range integer wraps modulo ``2**bits`` like a C cast (300 is stored as 44 in an
        int8 leaf); only that value is affected, the rest of the state stays consistent.

        ``state`` must come from this buffer's ``init`` (same capacity, ndim, storage, writer
        and sampler); another one raises at trace time. Called outside ``jit`` the call is
        compiled and ``state`` is consumed (updated in place): keep the returned state.
        """
        if _eager.top_level():
            if _host_calls.host_io(self.storage):
                return _host_calls.add(self, state, items)
            return _eager.call(self, "add", state, items)
        return self._add(state, items, self.writer)

    def _add(self, state: BufferState, items: PyTree, writer) -> BufferState:
        record, items, ctx, state = self._plan_write(state, items, writer)
        return dataclasses.replace(
            state, storage=self.storage.set(state.storage, record, items, ctx)
        )

    def _plan_write(self, state: BufferState, items: PyTree, writer):
        """``add`` but the storage's write: ``(record, items as stored, ctx before the write,
        the new state with the input's storage)``."""
        items = self.check_items(state, items, where="ReplayBuffer.add")
        ctx = self.context(state)
        record, writer_state = writer.write(state.writer, items, ctx.layout)
        if self.ndim == 2:
            items = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
        after = Context(layout=ctx.layout, filled=writer_state.filled, cursor=writer_state.cursor)
        return (
            record,
            items,
            ctx,
            BufferState(
                storage=state.storage,
                writer=writer_state,
                sampler=self.sampler.on_add(state.sampler, record, items, after),
                num_envs=state.num_envs,
                limiter=_rate_limiter.inserted(
                    self.rate_limiter, state.limiter, record.positions.shape[0]
                ),
                generations=(
                    None
                    if state.generations is None
                    else _generations.stamp(state.generations, record)
                ),
            ),
        )

    def _add_planned(self, state: BufferState, items: PyTree):
        """:meth:`_plan_write` with the buffer's writer (the compiled part of an eager ``add``
        whose storage writes on the host, :mod:`functional_rb._internal.host_calls`). The
        context is returned as a copy: an output that is an input leaf would keep that leaf
        from being donated, and the call would not consume its state as every eager ``add``
        does."""
        record, items, ctx, state = self._plan_write(state, items, self.writer)
        return record, items, jax.tree_util.tree_map(jnp.copy, ctx), state

    def check_items(self, state: BufferState, items: PyTree, *, where: str) -> PyTree:
        """Check a batch against the stored item spec and cast it; returns jnp arrays.

        Raises at trace time, naming the leaf path, the expected and the received shape/dtype.
        """
        self._check_state(state, where)
        return _checks.check_items(
            self.storage.item_spec(state.storage),
            items,
            ndim=self.ndim,
            num_envs=state.num_envs,
            where=where,
        )

    def _check_state(self, state, where: str) -> None:
        """Raise unless ``state`` is laid out as this buffer's ``init`` builds it (static facts
        only, so it costs nothing in a compiled call; see ``_checks.state_problem``)."""
        if not isinstance(state, BufferState):
            raise TypeError(
                f"{where}: the first argument must be the BufferState returned by "
                f"rb.init(...), got {type(state).__name__}."
            )
        check_not_consumed(state, where)
        problem = _checks.state_problem(self, state)
        if problem is not None:
            what, exc = problem
            fn = where.rsplit(".", 1)[-1] if where.startswith("ReplayBuffer.") else "add"
            raise exc(
                f"{where}: {what}. "
                + _checks.FOREIGN_STATE_HINT.format(
                    capacity=self.capacity,
                    ndim=self.ndim,
                    storage=type(self.storage).__name__,
                    writer=type(self.writer).__name__,
                    sampler=type(self.sampler).__name__,
                    fn=fn,
                )
            )
        _rate_limiter.check_state(self.rate_limiter, state.limiter, where)

    # ------------------------------------------------------------------ sample / update
    def sample(
        self,
        state: BufferState,
        key: jax.Array,
        batch_size: int | None = None,
        *,
        axis_name: str | None = None,
        **options,
    ) -> tuple[Sample, BufferState]:
        """Draw a batch. Returns ``(Sample, new_state)``.

        ``key``: one PRNG key, ``jax.random.key(seed)`` (typed, shape ``()``) or
        ``jax.random.PRNGKey(seed)`` (raw ``uint32[2]``); a batch of keys raises (map over keys
        with ``jax.vmap(rb.sample, in_axes=(None, 0))`` to draw one batch per key).
        ``batch_size`` (a Python int) overrides the default. ``options`` go to the sampler
        (e.g. ``beta=`` for prioritized samplers); an option the sampler does not take raises
        ``TypeError`` listing those it does. When nothing can be sampled: eagerly a
        ``ValueError``; under jit/vmap a sample with ``mask`` all False and ``weights`` 0 (its
        indices are 0, its data is whatever slot 0 holds).

        Called outside ``jit`` the call is compiled and ``state`` is consumed: keep the
        returned state (its storage is the input's, not a copy). Jitting it yourself: a
        top-level ``jax.jit`` copies every input it returns unchanged, and the returned state
        holds the storage, so jit it as ``jax.jit(rb.sample, donate_argnums=0)``, or sample
        inside a larger jitted step, or, when :meth:`sample_keeps_state` is True, jit a
        function that returns the sample alone.

        ``axis_name``: inside ``shard_map``/``pmap`` over a mesh axis whose devices each hold
        one shard (``state`` is this device's), draw this device's ``batch_size`` items from
        the union of all shards, with collectives (:mod:`functional_rb.collectives.ops`).
        """
        if axis_name is not None:
            _sharded_ops.require_axis(axis_name, "ReplayBuffer.sample")
        if _eager.top_level():
            if axis_name is None and _host_calls.host_io(self.storage):
                return _host_calls.sample(self, state, key, batch_size, options)
            return _eager.call(self, "sample", state, key, batch_size=batch_size, **options)
        bs = self._sample_args(state, key, batch_size, options)
        if axis_name is not None:
            return _sharded_ops.sample(self, state, key, bs, axis_name, options)
        drawn, ok, new_state = self._draw(state, key, bs, options)
        ctx = self.context(state)
        data = self.storage.get(state.storage, drawn.indices, ctx)
        return self._finish(state.generations, data, drawn, ok, ctx), new_state

    def _sample_args(self, state: BufferState, key, batch_size, options) -> int:
        """Check ``sample``'s arguments (at trace time); returns the batch size."""
        bs = (
            self.batch_size
            if batch_size is None
            else _checks.check_int("batch_size", batch_size, 1)
        )
        self._check_state(state, "ReplayBuffer.sample")
        _checks.check_key(key, "ReplayBuffer.sample")
        unknown = sorted(set(options) - set(self.sampler.options))
        if unknown:
            names = self.sampler.options
            accepts = (
                f"accepts only {', '.join(f'{k}=' for k in names)}"
                if names
                else "accepts no options"
            )
            raise TypeError(
                f"ReplayBuffer.sample: unknown option(s) {unknown} for the sampler "
                f"{type(self.sampler).__name__}, which {accepts}. Options are passed to the "
                "sampler's sample (e.g. beta= for PrioritizedSampler and "
                "PrioritizedSliceSampler)."
            )
        if batch_size is not None:
            self.sampler.validate(capacity=self.capacity, batch_size=bs, ndim=self.ndim)
        return bs

    def _draw(self, state: BufferState, key, bs: int, options: dict):
        """``sample`` before the storage's read: ``(drawn, ok, new_state)``."""
        ctx = self.context(state)
        early = None  # a sampler whose draw reports that it can sample draws first
        if self.sampler.draw_reports_ok:
            early = self.sampler.sample(state.sampler, key, bs, ctx, **options)
            ok = _folds.any_(early[0].mask)
        else:
            ok = jnp.asarray(self.sampler.can_sample(state.sampler, ctx, bs))
        enforce(
            ~ok,
            lambda i, n: (
                f"ReplayBuffer.sample: nothing can be sampled yet ({int(ctx.size)} items stored"
                f", batch_size={bs}, sampler {type(self.sampler).__name__}). Add items first or "
                "check rb.can_sample(state); under jit an empty buffer returns mask=False, "
                "weights=0."
            ),
        )
        drawn, sampler_state = (
            early
            if early is not None
            else self.sampler.sample(state.sampler, key, bs, ctx, **options)
        )
        # held in a buffer before the storage's gathers read them (not recomputed in each)
        drawn = drawn._replace(indices=settled(drawn.indices, ok))
        limiter = _rate_limiter.sampled(self.rate_limiter, state.limiter, jnp.where(ok, bs, 0))
        return drawn, ok, dataclasses.replace(state, sampler=sampler_state, limiter=limiter)

    def _finish(self, generations, data, drawn, ok, ctx: Context) -> Sample:
        """``sample`` after the storage's read: the :class:`Sample` of ``data``
        (``generations``: the state's; an eager ``sample`` whose storage reads on the host
        compiles this alone, passing only what it reads: each leaf passed costs the call)."""
        data = self.sampler.finalize(data, drawn, ctx)
        mask = drawn.mask & ok
        weights = jnp.where(mask, drawn.weights, 0.0).astype(jnp.float32)
        indices = drawn.indices.astype(jnp.int32)
        generations = (
            None if generations is None else _generations.drawn(generations, indices, mask)
        )
        return Sample(data, indices, weights, mask, generations)

    def _sample_drawn(self, state: BufferState, key, batch_size=None, **options):
        """:meth:`_draw` with ``sample``'s checks (the first compiled part of an eager
        ``sample`` whose storage reads on the host, :mod:`functional_rb._internal.host_calls`)."""
        return self._draw(state, key, self._sample_args(state, key, batch_size, options), options)

    def sample_keeps_state(
        self, state: BufferState, batch_size: int | None = None, **options
    ) -> bool:
        """Whether ``sample`` returns ``state`` itself, every array unchanged (a Python bool).

        True for samplers that draw without bookkeeping (``RandomSampler``,
        ``PrioritizedSampler``, ``SliceSampler``...) in a buffer with no rate limiter; False
        when a sample advances the state (an epoch without replacement, sample counts, a rate
        limiter's counters). Found by tracing ``sample`` once (nothing runs, ``state`` is not
        consumed): each returned array must be its input, passed through.

        When True, a jitted function may return the sample alone and leave ``state`` to the
        caller: ``jax.jit(lambda s, k: rb.sample(s, k)[0])``, without donation. When False,
        dropping the returned state would draw from a state that never advances (the same
        epoch again, a rate limiter that never counts): keep it.

        >>> import jax, jax.numpy as jnp
        >>> import functional_rb as frb
        >>> rb = frb.ReplayBuffer(capacity=8, batch_size=2)
        >>> state = rb.add(rb.init({"x": jnp.float32(0)}), {"x": jnp.arange(3.0)})
        >>> rb.sample_keeps_state(state)
        True
        >>> draw = jax.jit(lambda s, k: rb.sample(s, k)[0])
        >>> draw(state, jax.random.key(0)).data["x"].shape
        (2,)
        >>> epochs = frb.ReplayBuffer(capacity=8, sampler=frb.SamplerWithoutReplacement())
        >>> epochs.sample_keeps_state(epochs.init({"x": jnp.float32(0)}))
        False
        """
        check_not_consumed(state, "ReplayBuffer.sample_keeps_state")
        leaves = jax.tree_util.tree_leaves(state)

        def new_state(s, k):
            return self.sample(s, k, batch_size, **options)[1]

        sources = passed_through(jax.make_jaxpr(new_state)(state, jax.random.key(0)))
        return sources == list(range(len(leaves)))

    def update(
        self,
        state: BufferState,
        indices,
        priorities: jax.Array,
        *,
        generations: jax.Array | None = None,
        axis_name: str | None = None,
    ) -> BufferState:
        """Set priorities of ``indices`` (from ``Sample.indices``; any integer dtype) to
        ``priorities`` (real, the shape of ``indices`` or a scalar). A no-op for samplers
        without priorities (the state is returned unchanged).

        Delayed updates (:mod:`functional_rb.generations`): pass the sample itself,
        ``rb.update(state, sample, priorities)``, or its generations,
        ``rb.update(state, sample.indices, priorities, generations=sample.generations)``, and
        every entry whose slot was rewritten since the draw is dropped (under ``jit`` as
        eagerly, masked out: no host sync) and counted in the state; read the count with
        :meth:`dropped_updates`. Entries the sample masked out (generation -1) are skipped.
        **Bare indices cannot be checked**: ``rb.update(state, sample.indices, priorities)``
        applies every entry, as before, even to a newer item in a rewritten slot.

        Prioritized samplers follow the error policy (:mod:`functional_rb._internal.errors`): an index
        outside ``[0, capacity)`` (checked in its own dtype, so an int64 ``2**32 + 3`` never
        aliases item 3) or a NaN, infinite or negative priority raises ``ValueError`` eagerly
        and is ignored under ``jit`` (the priorities of dropped entries are not checked); huge
        finite priorities are clamped
        (:func:`functional_rb.samplers.priorities.value_max`). With x64 disabled JAX itself casts
        int64 arguments of a jitted function to int32 at the call (wrapping them) before the
        buffer sees them: pass ``Sample.indices`` (int32), or enable x64.

        ``axis_name``: inside ``shard_map``/``pmap``, ``indices`` are global (from a sample
        drawn with ``axis_name``); each priority reaches the shard that owns its item, which
        checks its generation and counts it if dropped.
        """
        where = "ReplayBuffer.update"
        if axis_name is not None:
            _sharded_ops.require_axis(axis_name, where)
        self._check_state(state, where)
        indices, generations = _generations.from_sample(indices, generations, where)
        # NumPy and Python inputs keep their dtype: the sampler checks int64 indices' range
        # before any int32 cast (jnp.asarray would wrap 2**32 + 3 to 3 without x64)
        indices = indices if isinstance(indices, jax.Array) else np.asarray(indices)
        priorities = priorities if isinstance(priorities, jax.Array) else np.asarray(priorities)
        if not np.issubdtype(indices.dtype, np.integer):
            raise TypeError(f"{where}: indices must be integers, got {indices.dtype}.")
        if priorities.shape != indices.shape and priorities.ndim != 0:
            raise ValueError(
                f"{where}: priorities have shape {priorities.shape}, "
                f"expected the shape of indices {indices.shape} (or a scalar)."
            )
        if generations is not None:
            generations = _generations.as_generations(generations, indices.shape, where)
            if state.generations is None:
                raise ValueError(
                    f"{where}: generations were given, but this buffer keeps none (its "
                    f"sampler {type(self.sampler).__name__} does not declare "
                    "tracks_generations, so its samples carry generations=None): they come "
                    "from another buffer's sample. Pass this buffer's sample, or no "
                    "generations."
                )
        if _eager.top_level():
            extra = {} if generations is None else {"generations": generations}
            return _eager.call(self, "update", state, indices, priorities, **extra)
        if axis_name is not None:
            return _sharded_ops.update(
                self, state, indices, priorities, axis_name, generations=generations
            )
        ctx = self.context(state)
        if generations is None:
            return dataclasses.replace(
                state, sampler=self.sampler.update(state.sampler, indices, priorities, ctx)
            )
        found = _generations.check(state.generations.slots, indices, generations)
        sampler_state = self.sampler.update(
            state.sampler, indices, priorities, ctx, keep=found.keep
        )
        return dataclasses.replace(
            state,
            sampler=sampler_state,
            generations=_generations.count_dropped(state.generations, found.stale),
        )

    def dropped_updates(self, state: BufferState, *, axis_name: str | None = None) -> jax.Array:
        """int32 ``[]``: update entries dropped so far because their slot was rewritten since
        the sample they came from was drawn (cumulative since ``init``; 0 for samplers
        without generations; ``axis_name``: over all shards). A state field, so it works
        under ``jit``, ``vmap`` and inside ``lax.scan``; one call's figure is the difference
        around it (:mod:`functional_rb.generations`)."""
        self._check_state(state, "ReplayBuffer.dropped_updates")
        count = jnp.int32(0) if state.generations is None else state.generations.dropped
        if axis_name is not None:
            return jax.lax.psum(count, axis_name)
        return count

    def size(self, state: BufferState, *, axis_name: str | None = None) -> jax.Array:
        """int32 []: elements currently stored (``axis_name``: in all shards)."""
        self._check_state(state, "ReplayBuffer.size")
        if axis_name is not None:
            return _sharded_ops.size(self, state, axis_name)
        return self.context(state).size

    def can_sample(self, state: BufferState, *, axis_name: str | None = None) -> jax.Array:
        """bool []: whether ``sample`` with the default batch size can draw a batch, and the
        rate limiter (if any) allows it (``axis_name``: a global draw, global counts)."""
        self._check_state(state, "ReplayBuffer.can_sample")
        if axis_name is not None:
            return _sharded_ops.can_sample(self, state, axis_name)
        ctx = self.context(state)
        return jnp.asarray(
            self.sampler.can_sample(state.sampler, ctx, self.batch_size)
        ) & _rate_limiter.allows_sample(self.rate_limiter, state.limiter, ctx.size, self.batch_size)

    def can_insert(
        self, state: BufferState, num_items: int = 1, *, axis_name: str | None = None
    ) -> jax.Array:
        """bool []: whether the rate limiter allows adding ``num_items`` items (True without
        one); ``axis_name``: ``num_items`` per shard, global counts."""
        self._check_state(state, "ReplayBuffer.can_insert")
        if axis_name is not None:
            return _sharded_ops.can_insert(self, state, num_items, axis_name)
        return _rate_limiter.allows_insert(
            self.rate_limiter, state.limiter, self.context(state).size, num_items
        )

    def get(self, state: BufferState, indices: jax.Array) -> PyTree:
        """Items at flat storage ``indices`` (integers, any shape), leaves
        ``[*indices.shape, ...]``. An index outside ``[0, capacity)``: eagerly ``ValueError``,
        under ``jit`` clipped into range."""
        self._check_state(state, "ReplayBuffer.get")
        idx, _ = checked_indices(
            indices,
            self.capacity,
            where="ReplayBuffer.get",
            fallback="out-of-range indices are clipped into range",
            clip=True,
        )
        return self.storage.get(state.storage, idx, self.context(state))
