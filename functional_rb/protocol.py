"""The component protocols: what a storage, a writer and a sampler are.

A :class:`~functional_rb.ReplayBuffer` is a frozen composition of three components, each a
frozen, hashable config object whose methods are pure functions of an explicit state (a PyTree).
This module writes their contracts down as :class:`typing.Protocol` classes, together with the
records they hand each other. The built-in components subclass these protocols, so optional
capabilities are declared attributes with defaults (never probed); a component of your own
should subclass them too, to inherit those defaults (``ReplayBuffer`` refuses an object that
lacks a member, naming it).

Shapes below: ``C`` is the capacity, ``E`` the number of env rows (1 when ``ndim=1``), ``R`` the
time steps per row (``C = E * R``), ``B`` the items in one ``add`` (``ndim=2``: ``E * T`` flat
items, env-major) and ``item`` one item's own shape. Positions and indices are flat storage
positions (:class:`Layout`), int32.

Storages keep every leaf flat, ``[C, ...]``: with ``ndim=2`` the buffer is an ``[E, R]`` grid
whose element ``(env, t)`` lives at flat position ``env * R + t`` (TorchRL's
``ravel_multi_index`` over a ``[num_envs, time]`` storage). Writers fill each row along time from
``t = 0``, so the stored elements are exactly ``t < filled`` in every row: this prefix property
lets samplers draw valid positions in O(1). :class:`Layout` is the grid, :class:`Context` what a
component knows of the buffer when it is called.

This module is the protocol's one address; ``functional_rb.base`` and ``functional_rb.layout``,
the paths of earlier releases, import as this same module.

One ``add`` (``ReplayBuffer.add``), in order::

    record, writer_state = writer.write(writer_state, items, layout)    # where the items go
    storage_state = storage.set(storage_state, record, flat_items, ctx)  # ctx: before the write
    sampler_state = sampler.on_add(sampler_state, record, flat_items, ctx_after)

One ``sample``::

    drawn, sampler_state = sampler.sample(sampler_state, key, batch_size, ctx, **options)
    data = sampler.finalize(storage.get(storage_state, drawn.indices, ctx), drawn, ctx)

Errors follow one policy (:mod:`functional_rb._internal.errors`): a bad value is a ``ValueError`` or
``TypeError`` when it can be seen (eager calls, trace-time shapes and dtypes) and, under
``jax.jit``, a documented fallback that leaves the state consistent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import CONSUMED_FIX, consumed_leaf, shape_mismatch
from functional_rb._internal.names import stable

PyTree = Any

__all__ = (
    "Context",
    "Drawn",
    "Layout",
    "Sampler",
    "Storage",
    "WriteRecord",
    "Writer",
    "missing_members",
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of the storage grid (hashable; lives in closures, never in the state)."""

    capacity: int  # total elements = num_envs * row_capacity
    num_envs: int  # 1 when ndim == 1
    row_capacity: int  # time steps per row; == capacity when ndim == 1
    ndim: int  # 1 or 2

    def to_flat(self, env, t):
        """int32 flat positions for ``(env, t)`` pairs (any broadcastable shapes)."""
        return jnp.asarray(env, jnp.int32) * jnp.int32(self.row_capacity) + jnp.asarray(
            t, jnp.int32
        )

    def from_flat(self, pos):
        """``(env, t)`` int32 arrays for flat positions ``pos``."""
        pos = jnp.asarray(pos, jnp.int32)
        if self.ndim == 1:
            return jnp.zeros_like(pos), pos
        return pos // jnp.int32(self.row_capacity), pos % jnp.int32(self.row_capacity)

    def rank_to_flat(self, u, filled):
        """Map ranks ``u`` in ``[0, num_envs * filled)`` to flat positions of stored elements.

        Rank ``u`` is element ``t = u % filled`` of row ``env = u // filled``. ``filled`` is an
        int32 scalar (> 0 for a meaningful result; callers mask otherwise).
        """
        u = jnp.asarray(u, jnp.int32)
        if self.ndim == 1:
            return u
        f = jnp.maximum(jnp.asarray(filled, jnp.int32), 1)
        return (u // f) * jnp.int32(self.row_capacity) + u % f


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What every component may know about the buffer when it is called.

    Built inside ``ReplayBuffer`` methods from the writer state; never stored. A PyTree whose
    ``layout`` is static, so a component method compiled with ``jax.jit`` takes it as is.
    """

    layout: Layout = dataclasses.field(metadata=dict(static=True))
    filled: jax.Array  # int32 []: time steps stored per row (ndim=1: items stored)
    cursor: jax.Array  # int32 []: next time index a ring writer will write (per row)

    @property
    def size(self):
        """int32 []: elements currently stored."""
        return self.filled * jnp.int32(self.layout.num_envs)


class WriteRecord(NamedTuple):
    """What one ``writer.write`` did, handed to ``storage.set`` and ``sampler.on_add``.

    positions: int32 ``[B]``: flat storage position of each item (items flattened env-major
      with ``ndim=2``). Unique where ``mask`` is True.
    mask: bool ``[B]``: True where the item is written; False for items superseded within the
      same call (more than ``R`` steps per row) or rejected (``MaxValueWriter``). Storages never
      touch the positions of masked items.
    run_start: int32 ``[]`` or None. Not None promises ``positions == (run_start + arange(B)) %
      C`` (a ring writer with ``ndim=1``), so a sampler may update per-position structures by
      ranges (``sum_tree.set_run``) instead of by scattered indices.
    """

    positions: jax.Array
    mask: jax.Array
    run_start: jax.Array | None = None


class Drawn(NamedTuple):
    """What a sampler draws; all three of one leading shape ``S``: ``[batch_size]``, or
    ``[num_slices, slice_len]`` for slice samplers.

    indices: int32 ``S``: flat positions, always in ``[0, C)`` (valid even where masked).
    weights: float32 ``S``: importance weights (1 unless prioritized; 0 where masked).
    mask: bool ``S``: False marks padding or entries that could not be drawn.
    """

    indices: jax.Array
    weights: jax.Array
    mask: jax.Array


@runtime_checkable
class Storage(Protocol):
    """Where items live. Items are stored flat, ``[C, *item]`` per leaf (or packed).

    Declared capabilities (class attributes):
      requires_fifo: the storage follows time through the ring (a trajectory is a run of
        consecutive slots), so ``ReplayBuffer`` refuses a writer that is not ``time_ordered``.
      state_types: the state classes ``init`` builds; ``ReplayBuffer`` refuses another state
        type (empty: not checked).
      host_io: ``set`` / ``get`` read and write host memory themselves (NumPy code with
        concrete arrays, host callbacks under ``jit``); eager buffer calls then compile the
        rest and call them with concrete arrays (:mod:`functional_rb._internal.host_calls`).
        Any storage may also define ``read_host(state, indices) -> items as NumPy arrays``
        (rows gathered on the host, for callers outside ``jit``; writeable ones are new,
        the caller's to keep or write); a ``host_io`` storage's is used there instead of
        ``get``.
    """

    requires_fifo: bool = False
    state_types: tuple = ()
    host_io: bool = False

    def init(self, item: PyTree, layout: Layout) -> PyTree:
        """An empty state for items shaped like ``item`` (ONE item, no batch axis)."""
        ...

    def item_spec(self, state: PyTree) -> PyTree:
        """One item's tree of ``jax.ShapeDtypeStruct(item_shape, dtype)`` (static)."""
        ...

    def set(self, state: PyTree, record: WriteRecord, items: PyTree, ctx: Context) -> PyTree:
        """Write ``items`` (leaves ``[B, *item]``, the stored dtypes) at ``record.positions``
        where ``record.mask``. ``ctx``: the buffer before this write."""
        ...

    def get(self, state: PyTree, indices: jax.Array, ctx: Context) -> PyTree:
        """Items at int32 ``indices`` (any shape ``S``, values in ``[0, C)``): leaves
        ``[*S, *item]``."""
        ...

    def check_state(self, state: PyTree, capacity: int, num_envs: int) -> str | None:
        """Why ``state`` cannot be this storage's state for ``capacity`` items in ``num_envs``
        rows (a sentence naming the leaf), or None. Reads static shapes only."""
        del state, capacity, num_envs
        return None


@runtime_checkable
class Writer(Protocol):
    """Where the next items go.

    Every writer state has int32 ``[]`` fields ``cursor`` (next time index a ring writes, per
    row) and ``filled`` (time steps stored per row): ``ReplayBuffer`` builds its
    :class:`Context` from them.

    Declared capabilities:
      time_ordered: positions follow time in each row (a FIFO ring), which ``requires_fifo``
        samplers and storages need.
      state_types: the state classes ``init`` builds (empty: not checked).
    """

    time_ordered: bool = False
    state_types: tuple = ()

    def init(self, layout: Layout) -> PyTree:
        """An empty writer state."""
        ...

    def write(self, state: PyTree, items: PyTree, layout: Layout) -> tuple[WriteRecord, PyTree]:
        """Choose positions for ``items`` (leaves ``[B, *item]``, ``ndim=2``: ``[E, T, *item]``).
        Returns ``(record, new_state)``; the record's arrays are flat ``[B]`` (``[E * T]``)."""
        ...

    def check_item_spec(self, item_spec: PyTree) -> None:
        """Raise when the items (one item's tree of ``ShapeDtypeStruct``) cannot be written by
        this writer; ``ReplayBuffer.init`` calls it before building any state."""
        del item_spec

    def check_state(self, state: PyTree, capacity: int) -> str | None:
        """Why ``state`` cannot be this writer's state (a sentence), or None: by default the
        ``cursor`` and ``filled`` counters are scalars."""
        del capacity
        return shape_mismatch(
            [
                (
                    f"state.writer.{name}",
                    getattr(state, name),
                    (),
                    True,
                    " (one counter per buffer)",
                )
                for name in ("cursor", "filled")
            ]
        )


@runtime_checkable
class Sampler(Protocol):
    """Which items come out.

    Declared capabilities:
      requires_fifo: the sampler follows time through the ring (needs a ``time_ordered``
        writer).
      options: names of the extra keyword options ``sample`` takes (e.g. ``("beta",)``);
        ``ReplayBuffer.sample`` rejects any other by name.
      state_types: the state classes ``init`` builds (empty: not checked).
      tracks_generations: ``update`` changes the state (priorities), so the buffer keeps a
        write generation per slot (:mod:`functional_rb.generations`): samples carry the
        generations of their items, and an update made from a sample drops the entries whose
        slot was rewritten since the draw, through ``update``'s ``keep=``. A sampler that
        declares it must accept ``keep=``; one that does not (the default) costs nothing.
      depletes: ``sample`` spends what it draws, so a sample can leave nothing drawable
        (:class:`~functional_rb.SampleOnceSampler`). An eager ``rb.sample`` then checks at
        every call whether anything can be drawn (and raises at the first call that cannot),
        instead of once per lineage of states (:mod:`functional_rb._internal.eager`).
      draw_reports_ok: a draw's ``mask`` is False everywhere exactly when ``can_sample`` is
        False (the slice samplers', whose draw finds out anyway): ``ReplayBuffer.sample``
        then reads whether it could sample from the mask instead of asking ``can_sample``
        first, one computation less per sample.
    """

    requires_fifo: bool = False
    options: tuple = ()
    state_types: tuple = ()
    tracks_generations: bool = False
    depletes: bool = False
    draw_reports_ok: bool = False

    def bind(self, *, batch_size: int) -> Sampler:
        """This sampler for a buffer whose default batch size is ``batch_size`` (a Python int):
        ``ReplayBuffer`` calls it when it is built and keeps the result. A sampler whose state
        depends on it (``PrioritizedSliceSampler(num_slices=n)``) resolves it here."""
        del batch_size
        return self

    def validate(self, *, capacity: int, batch_size: int, ndim: int) -> None:
        """Raise ``ValueError`` when no batch of ``batch_size`` could ever be drawn from this
        configuration; called when the buffer is built and for each overriding batch size."""
        del capacity, batch_size, ndim

    def init(self, item_spec: PyTree, layout: Layout) -> PyTree:
        """An empty state; ``item_spec``: one item's tree of ``ShapeDtypeStruct``."""
        ...

    def on_add(self, state: PyTree, record: WriteRecord, items: PyTree, ctx: Context) -> PyTree:
        """Bookkeeping for one write; ``items`` leaves ``[B, *item]`` (the stored dtypes),
        ``ctx``: the buffer after the write. Default: the state unchanged."""
        del record, items, ctx
        return state

    def can_sample(self, state: PyTree, ctx: Context, batch_size: int) -> jax.Array:
        """bool ``[]``: whether ``sample`` can draw a batch now. Default: something is stored."""
        del state, batch_size
        return ctx.size > 0

    def sample(
        self, state: PyTree, key: jax.Array, batch_size: int, ctx: Context, **options
    ) -> tuple[Drawn, PyTree]:
        """Draw ``batch_size`` items with ONE PRNG key; never an index outside ``[0, C)``."""
        ...

    def update(
        self,
        state: PyTree,
        indices: jax.Array,
        priorities: jax.Array,
        ctx: Context,
        *,
        keep: jax.Array | None = None,
    ) -> PyTree:
        """Set priorities: int ``indices`` (any integer dtype, any shape ``S``, as given by the
        user: range checks are the sampler's), float ``priorities`` ``S``. Default: a no-op.

        ``keep``: bool ``S`` or None. Given (only to samplers that declare
        ``tracks_generations``) when the update comes with the generations of a sample: False
        marks entries whose slot was rewritten since the draw, or that were no item (padding).
        The sampler applies none of them and checks none of their priorities (an index out of
        ``[0, C)`` is still an error)."""
        del indices, priorities, ctx, keep
        return state

    def finalize(self, data: PyTree, drawn: Drawn, ctx: Context) -> PyTree:
        """Post-process gathered data (leaves ``[*S, *item]``). Default: unchanged."""
        del drawn, ctx
        return data


def missing_members(obj: Any, protocol: type) -> list:
    """Names of ``protocol``'s members that ``obj`` lacks (sorted)."""
    names = set()
    for klass in protocol.__mro__:
        if klass in (Protocol, object, Any) or not getattr(klass, "_is_protocol", False):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return sorted(n for n in names if not hasattr(obj, n))


# ------------------------------------------------------------- what a buffer hands over
class _SampleFields(NamedTuple):
    data: PyTree
    indices: jax.Array
    weights: jax.Array
    mask: jax.Array


class Sample(_SampleFields):
    """One sampled batch: a NamedTuple ``(data, indices, weights, mask)``, plus the write
    generations of the drawn items as an attribute.

    data:    the sampled items, leaves ``[B, ...]`` (slice samplers: ``[num_slices, slice_len, ...]``).
    indices: int32 flat storage positions, ``[B]`` (or ``[num_slices, slice_len]``); pass them
             to ``ReplayBuffer.update``.
    weights: float32 importance weights, same shape as ``indices`` (1 unless prioritized, 0
             where ``mask`` is False).
    mask:    bool, same shape; False marks padding or entries that could not be drawn.
    generations: int32, same shape, or None: the write generation of each drawn item's slot
             when it was drawn (-1 where ``mask`` is False), for samplers that keep them
             (``tracks_generations``: the prioritized ones); None for the others. Not a tuple
             element, so ``data, indices, weights, mask = sample`` keeps working: pass the
             sample itself to ``rb.update(state, sample, priorities)`` (or
             ``generations=sample.generations``) and entries whose slot was rewritten since the
             draw are dropped (:mod:`functional_rb.generations`).

    A registered PyTree with five children (``generations`` last), so it crosses ``jax.jit``,
    ``vmap`` and ``scan`` whole; ``_replace`` keeps the generations (``generations=`` replaces
    them).
    """

    generations: jax.Array | None  # (for type checkers: set by __new__, in the instance dict)

    def __new__(cls, data, indices, weights, mask, generations=None):
        self = super().__new__(cls, data, indices, weights, mask)
        # a tuple subclass cannot have slots: the attribute lives in the instance dict
        self.__dict__["generations"] = generations
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Sample is immutable: use sample._replace({name}=...).")

    def _replace(self, **kwargs) -> Sample:
        generations = kwargs.pop("generations", self.generations)
        fields = {f: kwargs.pop(f, getattr(self, f)) for f in self._fields}
        if kwargs:
            raise ValueError(
                f"Sample._replace: unknown fields {sorted(kwargs)}; a Sample has "
                f"{list(self._fields) + ['generations']}."
            )
        return Sample(**fields, generations=generations)

    def __repr__(self) -> str:
        return (
            f"Sample(data={self.data!r}, indices={self.indices!r}, weights={self.weights!r}, "
            f"mask={self.mask!r}, generations={self.generations!r})"
        )


_SAMPLE_KEYS = tuple(
    jax.tree_util.GetAttrKey(n) for n in ("data", "indices", "weights", "mask", "generations")
)
jax.tree_util.register_pytree_with_keys(
    Sample,
    lambda s: (tuple(zip(_SAMPLE_KEYS, (*s, s.generations))), None),
    lambda _, children: Sample(*children),
    flatten_func=lambda s: ((*s, s.generations), None),
)


@stable("BufferState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BufferState:
    """The whole dynamic state of a buffer: a PyTree, so it can be jitted, vmapped, scanned,
    donated and checkpointed. ``num_envs`` is static (1 for ``ndim=1``). ``limiter``: the
    rate limiter's counters (:class:`~functional_rb.rate_limiter.RateLimiterState`), None
    when the buffer has none. ``generations``: the write generation of every slot and the
    count of dropped updates (:class:`~functional_rb.generations.GenerationState`), None when
    the sampler has no update (``tracks_generations`` False)."""

    storage: PyTree
    writer: PyTree
    sampler: PyTree
    num_envs: int = dataclasses.field(default=1, metadata=dict(static=True))
    limiter: PyTree = None
    generations: PyTree = None

    def __repr__(self) -> str:
        # A consumed state's arrays are deleted: the dataclass repr would fail on the first
        # one with JAX's bare "Array has been deleted". Say what happened instead.
        path = consumed_leaf(self)
        if path is not None:
            return (
                f"BufferState(<consumed: its leaf state{path} was donated to an earlier "
                f"call and deleted; {CONSUMED_FIX}>)"
            )
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"BufferState({fields})"
