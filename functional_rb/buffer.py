"""The replay buffer: a frozen composition of storage x writer x sampler, and its state."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._errors import describe_structure, is_traced, keystr
from functional_rb.layout import Context, Layout
from functional_rb.samplers import RandomSampler
from functional_rb.storages import DeviceStorage
from functional_rb.writers import ImmutableWriter, RoundRobinWriter

PyTree = Any


class Sample(NamedTuple):
    """One sampled batch.

    data:    the sampled items, leaves ``[B, ...]`` (slice samplers: ``[num_slices, slice_len, ...]``).
    indices: int32 flat storage positions, ``[B]`` (or ``[num_slices, slice_len]``); pass them
             to ``ReplayBuffer.update``.
    weights: float32 importance weights, same shape as ``indices`` (1 unless prioritized, 0
             where ``mask`` is False).
    mask:    bool, same shape; False marks padding or entries that could not be drawn.
    """

    data: PyTree
    indices: jax.Array
    weights: jax.Array
    mask: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BufferState:
    """The whole dynamic state of a buffer: a PyTree, so it can be jitted, vmapped, scanned,
    donated and checkpointed. ``num_envs`` is static (1 for ``ndim=1``)."""

    storage: PyTree
    writer: PyTree
    sampler: PyTree
    num_envs: int = dataclasses.field(default=1, metadata=dict(static=True))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        hint = (" Under jax.jit mark it static, e.g. jax.jit(rb.sample, "
                "static_argnames='batch_size')." if is_traced(value) else "")
        raise TypeError(f"ReplayBuffer: {name} must be a Python int, got {value!r} "
                        f"({type(value).__name__}).{hint}")
    if value < minimum:
        raise ValueError(f"ReplayBuffer: {name} must be >= {minimum}, got {value}.")
    return int(value)


def _dtype_of(x) -> np.dtype:
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype)
    return np.asarray(x).dtype


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

    ``ReplayBuffer`` is frozen and hashable; ``jax.jit(rb.add, donate_argnums=0)``,
    ``jax.jit(rb.sample)``, ``jax.vmap`` over states and ``lax.scan`` all work.
    """

    capacity: int
    sampler: Any = dataclasses.field(default_factory=RandomSampler)
    writer: Any = dataclasses.field(default_factory=RoundRobinWriter)
    storage: Any = dataclasses.field(default_factory=DeviceStorage)
    batch_size: int = 256
    ndim: int = 1

    def __post_init__(self):
        _check_int("capacity", self.capacity, 1)
        _check_int("batch_size", self.batch_size, 1)
        if self.ndim not in (1, 2):
            raise ValueError(f"ReplayBuffer: ndim must be 1 or 2, got {self.ndim!r}.")
        for name, obj, needs, example in (
                ("sampler", self.sampler, ("sample", "on_add", "init"), "RandomSampler"),
                ("writer", self.writer, ("write", "init"), "RoundRobinWriter"),
                ("storage", self.storage, ("get", "set", "init"), "DeviceStorage")):
            missing = [m for m in needs if not hasattr(obj, m)]
            if missing:
                raise TypeError(f"ReplayBuffer: {name}={obj!r} is not a {name} (it lacks "
                                f"{missing}); pass e.g. frb.{example}().")
            try:
                hash(obj)
            except TypeError as e:
                raise TypeError(f"ReplayBuffer: {name}={obj!r} must be hashable (a frozen "
                                "config object) so that jit can cache on it.") from e
        validate = getattr(self.sampler, "validate", None)
        if validate is not None:
            validate(capacity=self.capacity, batch_size=self.batch_size, ndim=self.ndim)

    # ------------------------------------------------------------------ layout and context
    def layout(self, state_or_num_envs) -> Layout:
        """The static :class:`Layout` of a state (or of a number of envs)."""
        n = (state_or_num_envs.num_envs if isinstance(state_or_num_envs, BufferState)
             else int(state_or_num_envs))
        return Layout(capacity=self.capacity, num_envs=n, row_capacity=self.capacity // n,
                      ndim=self.ndim)

    def context(self, state: BufferState) -> Context:
        return Context(layout=self.layout(state), filled=state.writer.filled,
                       cursor=state.writer.cursor)

    # ------------------------------------------------------------------ init
    def init(self, example: PyTree) -> BufferState:
        """A fresh, empty state for items shaped like ``example``.

        ``example`` is ONE item (no batch axis), any PyTree of arrays; with ``ndim=2`` it is one
        vectorized step, leaves ``[num_envs, ...]``.
        """
        leaves = jax.tree_util.tree_flatten_with_path(example)[0]
        if not leaves:
            raise ValueError("ReplayBuffer.init: the example has no array leaves; pass one item, "
                             "e.g. {'obs': jnp.zeros(4), 'reward': jnp.float32(0)}.")
        example = jax.tree_util.tree_map(jnp.asarray, example)
        num_envs = 1
        if self.ndim == 2:
            num_envs = self._num_envs_of(example)
            if self.capacity % num_envs:
                raise ValueError(
                    f"ReplayBuffer.init: with ndim=2 capacity ({self.capacity}) must be a "
                    f"multiple of num_envs ({num_envs}, the example's leading axis); e.g. "
                    f"capacity={self.capacity // num_envs * num_envs or num_envs}.")
            item = jax.tree_util.tree_map(lambda x: x[0], example)
        else:
            item = example
        layout = self.layout(num_envs)
        storage_state = self.storage.init(item, layout)
        spec = self.storage.item_spec(storage_state)
        # a sampler whose state depends on the default batch size asks for it (e.g.
        # PrioritizedSliceSampler(num_slices=n) keeps slice starts for batch_size // n steps)
        kw = ({"batch_size": self.batch_size}
              if getattr(self.sampler, "init_takes_batch_size", False) else {})
        return BufferState(storage=storage_state, writer=self.writer.init(layout),
                           sampler=self.sampler.init(spec, layout, **kw), num_envs=num_envs)

    def _num_envs_of(self, example) -> int:
        sizes = {}
        for path, x in jax.tree_util.tree_flatten_with_path(example)[0]:
            if np.ndim(x) < 1:
                raise ValueError(
                    f"ReplayBuffer.init: with ndim=2 every leaf of the example is one "
                    f"vectorized step [num_envs, ...], but leaf {keystr(path)} is a scalar "
                    f"(shape {np.shape(x)}). Give it a leading num_envs axis.")
            sizes.setdefault(np.shape(x)[0], keystr(path))
        if len(sizes) > 1:
            raise ValueError("ReplayBuffer.init: with ndim=2 all example leaves share the leading "
                             f"num_envs axis, got {{size: first leaf}} = {sizes}.")
        return next(iter(sizes))

    def init_from_data(self, data: PyTree) -> BufferState:
        """A state holding ``data`` (leaves ``[N, ...]``, ``ndim=2``: ``[num_envs, T, ...]``).

        Works with every writer, ``ImmutableWriter`` included (this is how datasets are built):
        the items are written as a round-robin writer would, then the writer takes over.
        """
        first = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[0] if self.ndim == 1
                                       else jnp.asarray(x)[:, 0], data)
        state = self.init(first)
        writer = RoundRobinWriter() if isinstance(self.writer, ImmutableWriter) else self.writer
        return self._add(state, data, writer)

    # ------------------------------------------------------------------ add
    def add(self, state: BufferState, items: PyTree) -> BufferState:
        """Add a batch: leaves ``[B, ...]`` (``ndim=2``: ``[num_envs, T, ...]``).

        If ``B`` exceeds the capacity only the last ``capacity`` items are kept, in order.
        Shapes and dtypes are checked at trace time against the stored items; values are cast
        to the stored dtype when the cast is of the same kind (float64 -> float32 is fine,
        float -> int raises).
        """
        return self._add(state, items, self.writer)

    def _add(self, state: BufferState, items: PyTree, writer) -> BufferState:
        items = self.check_items(state, items, where="ReplayBuffer.add")
        ctx = self.context(state)
        positions, mask, writer_state = writer.write(state.writer, items, ctx.layout)
        flat_items = items
        if self.ndim == 2:
            flat_items = jax.tree_util.tree_map(
                lambda x: x.reshape((-1,) + x.shape[2:]), items)
        positions = positions.reshape(-1)
        mask = mask.reshape(-1)
        new_ctx = Context(layout=ctx.layout, filled=writer_state.filled,
                          cursor=writer_state.cursor)
        storage_state = self.storage.set(state.storage, positions, flat_items, mask, ctx)
        sampler_state = self.sampler.on_add(state.sampler, positions, mask, flat_items, new_ctx)
        return BufferState(storage=storage_state, writer=writer_state, sampler=sampler_state,
                           num_envs=state.num_envs)

    def check_items(self, state: BufferState, items: PyTree, *, where: str) -> PyTree:
        """Check a batch against the stored item spec and cast it; returns jnp arrays.

        Raises at trace time, naming the leaf path, the expected and the received shape/dtype.
        """
        if not isinstance(state, BufferState):
            raise TypeError(f"{where}: the first argument must be the BufferState returned by "
                            f"rb.init(...), got {type(state).__name__}.")
        spec = self.storage.item_spec(state.storage)
        spec_def = jax.tree_util.tree_structure(spec)
        items_def = jax.tree_util.tree_structure(items)
        if spec_def != items_def:
            want = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(spec)[0]}
            got = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(items)[0]}
            raise ValueError(
                f"{where}: the items' tree structure differs from the stored items'. Missing "
                f"leaves: {sorted(want - got)}; unexpected leaves: {sorted(got - want)}. "
                f"Expected leaves {describe_structure(spec)}, got {describe_structure(items)}"
                + ("" if want != got else f" (same paths, different containers: expected "
                   f"{spec_def}, got {items_def})") + ".")
        spec_leaves = jax.tree_util.tree_leaves(spec)
        paths_leaves = jax.tree_util.tree_flatten_with_path(items)[0]
        nb = self.ndim
        batch_shape = None
        out = []
        for (path, x), s in zip(paths_leaves, spec_leaves):
            shape = tuple(np.shape(x))
            dtype = _dtype_of(x)
            if len(shape) != nb + len(s.shape) or shape[nb:] != tuple(s.shape):
                lead = "[B]" if nb == 1 else "[num_envs, T]"
                raise ValueError(
                    f"{where}: leaf {keystr(path)} has shape {shape}, expected {lead} + "
                    f"{tuple(s.shape)} (a batch of items shaped like the example given to "
                    f"init). Stack your items along a new leading axis"
                    + (" (a single item needs [None])" if len(shape) == len(s.shape) else "")
                    + ".")
            if batch_shape is None:
                batch_shape = (shape[:nb], keystr(path))
            elif shape[:nb] != batch_shape[0]:
                raise ValueError(
                    f"{where}: leaves disagree on the batch shape: {batch_shape[1]} has "
                    f"{batch_shape[0]}, {keystr(path)} has {shape[:nb]}.")
            if nb == 2 and shape[0] != state.num_envs:
                raise ValueError(
                    f"{where}: leaf {keystr(path)} has {shape[0]} envs on axis 0, expected "
                    f"num_envs={state.num_envs} (from the example given to init); items are "
                    "[num_envs, T, ...].")
            if not np.can_cast(dtype, s.dtype, casting="same_kind"):
                raise TypeError(
                    f"{where}: leaf {keystr(path)} has dtype {dtype}, which does not cast "
                    f"safely to the stored dtype {s.dtype}. Convert it explicitly "
                    f"(x.astype({np.dtype(s.dtype).name})) if that is what you mean.")
            out.append(jnp.asarray(x).astype(s.dtype))
        return jax.tree_util.tree_unflatten(items_def, out)

    # ------------------------------------------------------------------ sample / update
    def sample(self, state: BufferState, key: jax.Array, batch_size: int | None = None,
               **options) -> tuple[Sample, BufferState]:
        """Draw a batch. Returns ``(Sample, new_state)``.

        ``batch_size`` (a Python int) overrides the default. ``options`` go to the sampler
        (e.g. ``beta=`` for prioritized samplers). When nothing can be sampled: eagerly a
        ``ValueError``; under jit/vmap a sample with ``mask`` all False and ``weights`` 0 (its
        indices are valid, its data is whatever those slots hold).

        Performance: a top-level ``jax.jit`` copies every input it returns unchanged, and the
        returned state holds the storage. Jit it as ``jax.jit(rb.sample, donate_argnums=0)``
        (the returned state then aliases the input's buffers: no copy) and keep the returned
        state, or jit a function that returns only what you need (the sample), or sample
        inside a larger jitted step.
        """
        bs = self.batch_size if batch_size is None else _check_int("batch_size", batch_size, 1)
        if not isinstance(state, BufferState):
            raise TypeError("ReplayBuffer.sample: the first argument must be the BufferState "
                            f"returned by rb.init(...), got {type(state).__name__}.")
        validate = getattr(self.sampler, "validate", None)
        if batch_size is not None and validate is not None:
            validate(capacity=self.capacity, batch_size=bs, ndim=self.ndim)
        ctx = self.context(state)
        ok = jnp.asarray(self.sampler.can_sample(state.sampler, ctx, bs))
        if not is_traced(ok) and not bool(ok):
            raise ValueError(
                f"ReplayBuffer.sample: nothing can be sampled yet ({int(ctx.size)} items stored"
                f", batch_size={bs}, sampler {type(self.sampler).__name__}). Add items first or "
                "check rb.can_sample(state); under jit an empty buffer returns mask=False, "
                "weights=0.")
        drawn, sampler_state = self.sampler.sample(state.sampler, key, bs, ctx, **options)
        data = self.storage.get(state.storage, drawn.indices, ctx)
        data = self.sampler.finalize(data, drawn, ctx)
        mask = drawn.mask & ok
        weights = jnp.where(mask, drawn.weights, 0.0).astype(jnp.float32)
        new_state = dataclasses.replace(state, sampler=sampler_state)
        return Sample(data, drawn.indices.astype(jnp.int32), weights, mask), new_state

    def update(self, state: BufferState, indices: jax.Array, priorities: jax.Array
               ) -> BufferState:
        """Set priorities of ``indices`` (from ``Sample.indices``). A no-op for samplers
        without priorities (the state is returned unchanged)."""
        indices = jnp.asarray(indices)
        priorities = jnp.asarray(priorities)
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"ReplayBuffer.update: indices must be integers, got {indices.dtype}.")
        if priorities.shape != indices.shape and priorities.ndim != 0:
            raise ValueError(f"ReplayBuffer.update: priorities have shape {priorities.shape}, "
                             f"expected the shape of indices {indices.shape} (or a scalar).")
        ctx = self.context(state)
        sampler_state = self.sampler.update(state.sampler, indices.astype(jnp.int32),
                                            jnp.broadcast_to(priorities, indices.shape), ctx)
        return dataclasses.replace(state, sampler=sampler_state)

    def size(self, state: BufferState) -> jax.Array:
        """int32 []: elements currently stored."""
        return self.context(state).size

    def can_sample(self, state: BufferState) -> jax.Array:
        """bool []: whether ``sample`` with the default batch size can draw a batch."""
        return jnp.asarray(self.sampler.can_sample(state.sampler, self.context(state),
                                                   self.batch_size))

    def get(self, state: BufferState, indices: jax.Array) -> PyTree:
        """Items at flat storage ``indices`` (int32, any shape), leaves ``[*indices.shape, ...]``."""
        return self.storage.get(state.storage, jnp.asarray(indices, jnp.int32),
                                self.context(state))
