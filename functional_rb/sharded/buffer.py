"""Sharded replay buffers: one buffer over the devices of a mesh axis, with exact global sampling.

::

    mesh = jax.make_mesh((8,), ("data",))
    srb = frb.ShardedReplayBuffer(rb, mesh, axis_name="data", sampling="global")
    state = srb.init(example)                # every leaf [8, ...], sharded along "data"
    state = srb.add(state, items)            # items [8 * b, ...]: device d adds rows [d b, (d+1) b)
    sample, state = srb.sample(state, key)   # rb.batch_size rows per device: leading axis [8 * B]
    state = srb.update(state, sample, priorities)   # drops entries whose slot was rewritten

Each device of the axis holds one shard: an ordinary ``rb`` state of ``rb.capacity`` items (so
the capacity grows with the device count), created on its device and never gathered on one.
The state is a :class:`ShardedState` whose ``shards`` is that ``BufferState`` with a leading
axis of one entry per shard. ``ShardedReplayBuffer`` runs ``rb``'s own per-shard calls inside
``jax.shard_map`` (:mod:`functional_rb.collectives.ops` says what each one communicates); to run
them inside a ``shard_map`` of your own (the Anakin pattern), turn a block of the state into
this device's local state with :meth:`ShardedReplayBuffer.local` and back with
:meth:`ShardedReplayBuffer.block`, and pass ``axis_name=`` to ``rb``'s methods. With
``jax.pmap``, map over ``state.shards`` directly.

Every method is a pure function; jit them as ``jax.jit(srb.add, donate_argnums=0)`` and
``jax.jit(srb.sample, donate_argnums=0)`` to update the shards in place. Several processes
(``jax.distributed``) run the same program, each holding its devices' shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from functional_rb import generations as _generations
from functional_rb._internal import errors as _errors
from functional_rb._internal.errors import config_number
from functional_rb._internal.names import stable
from functional_rb.buffer import ReplayBuffer
from functional_rb.collectives import draws as sharded_draws
from functional_rb.collectives import exchange as sharded_exchange
from functional_rb.collectives import ops as sharded_ops
from functional_rb.protocol import BufferState, Sample
from functional_rb.storages.memmap import MemmapStorage

PyTree = Any

__all__ = ("ShardedReplayBuffer", "ShardedState", "sample")


@stable("ShardedState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedState:
    """The state of a :class:`ShardedReplayBuffer`.

    shards: a ``BufferState`` whose every leaf has a leading axis of ``num_shards``: entry
      ``s`` is the local state of the shard on device ``s`` of the axis (sharded along it).
    axis_name, num_shards: the mesh axis and its size (static).
    """

    shards: BufferState
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    num_shards: int = dataclasses.field(metadata=dict(static=True))


def _is_traced(tree) -> bool:
    return any(_errors.is_traced(x) for x in jax.tree_util.tree_leaves(tree))


def _readable(tree) -> bool:
    """Every leaf is concrete and held by this process whole (values can be checked)."""
    return all(
        not _errors.is_traced(x) and (not isinstance(x, jax.Array) or x.is_fully_addressable)
        for x in jax.tree_util.tree_leaves(tree)
    )


@dataclasses.dataclass(frozen=True)
class ShardedReplayBuffer:
    """``buffer`` sharded over the devices of ``mesh`` along ``axis_name`` (one shard each).

    Args:
      buffer: the :class:`~functional_rb.ReplayBuffer` of one shard (its ``capacity`` and
        ``batch_size`` are per device).
      mesh: a ``jax.sharding.Mesh`` with an axis ``axis_name``; other axes hold replicas.
      axis_name: the mesh axis the shards are laid along (default ``"data"``).
      sampling: ``"global"`` (default): each device's rows are drawn from the union of the
        shards as a single buffer holding them would draw them (uniform over all stored
        items even when shards are unequally full, prioritized with the global priorities,
        slices over all eligible trajectories; importance weights with the global ``N`` and
        minimum; without replacement, global epochs). ``"local"``: each device samples its
        own shard and no rows move; the weights are correct for that distribution
        (:func:`functional_rb.collectives.ops.sample`).
      counts: global mode, how many rows each device takes from each shard:
        ``"stratified"`` (default: exact marginals, balanced traffic) or ``"multinomial"``
        (independent rows, exactly as one buffer; more traffic); see
        :mod:`functional_rb.collectives.exchange`.
      capacity_factor: global mode, rows one exchange round moves between two devices, as a
        multiple of the even share ``batch_size / n`` (default 1.25 stratified, 1.5
        multinomial); more rounds run when needed, so any value is exact.

    Indices in a sample are global: ``shard * buffer.capacity + position``.
    """

    buffer: ReplayBuffer
    mesh: Mesh
    axis_name: str = "data"
    sampling: str = "global"
    counts: str = "stratified"
    capacity_factor: float | None = None

    def __post_init__(self):
        where = "ShardedReplayBuffer"
        if not isinstance(self.buffer, ReplayBuffer):
            raise TypeError(
                f"{where}: buffer must be a frb.ReplayBuffer, got {type(self.buffer).__name__}."
            )
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"{where}: mesh must be a jax.sharding.Mesh (jax.make_mesh((n,), "
                f"('data',))), got {type(self.mesh).__name__}."
            )
        if self.axis_name not in self.mesh.shape:
            raise ValueError(
                f"{where}: the mesh has axes {tuple(self.mesh.shape)}, not "
                f"axis_name={self.axis_name!r}."
            )
        if self.sampling not in sharded_ops.SAMPLING:
            raise ValueError(
                f"{where}: sampling must be one of {sharded_ops.SAMPLING}, got {self.sampling!r}."
            )
        if self.counts not in sharded_exchange.COUNTS:
            raise ValueError(
                f"{where}: counts must be one of {sharded_exchange.COUNTS}, got {self.counts!r}."
            )
        cf = self.capacity_factor
        if cf is None:  # one round almost always (see sharded_exchange)
            cf = sharded_ops.DEFAULT_CAPACITY_FACTOR[self.counts]
            object.__setattr__(self, "capacity_factor", cf)
        config_number(where, "capacity_factor", cf, minimum=0, strict=True)
        if isinstance(self.buffer.storage, MemmapStorage):
            raise ValueError(
                f"{where}: MemmapStorage keeps items in host files, which cannot "
                "be sharded over devices; use DeviceStorage or TEDStorage."
            )
        sharded_draws.for_sampler(self.buffer.sampler, where)
        if self.buffer.rate_limiter is not None:
            self.buffer.rate_limiter.validate(
                batch_size=self.num_shards * self.buffer.batch_size, where=where
            )

    # ------------------------------------------------------------------ static facts
    @property
    def num_shards(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    @property
    def capacity(self) -> int:
        """Items all shards hold together (``num_shards * buffer.capacity``)."""
        return self.num_shards * self.buffer.capacity

    @property
    def sharding(self) -> NamedSharding:
        """How every leaf of the state (and the items, and the samples) is laid out."""
        return NamedSharding(self.mesh, PartitionSpec(self.axis_name))

    # ------------------------------------------------------------------ local views
    def local(self, block: ShardedState) -> BufferState:
        """Inside ``shard_map`` (the state passed with ``in_specs=P(axis_name)``): this
        device's local state, for ``buffer``'s methods with ``axis_name=``."""
        return jax.tree_util.tree_map(lambda x: x[0], block.shards)

    def block(self, local: BufferState) -> ShardedState:
        """Inside ``shard_map``: this device's block of a :class:`ShardedState` (return it with
        ``out_specs=P(axis_name)``)."""
        return ShardedState(
            shards=jax.tree_util.tree_map(lambda x: x[None], local),
            axis_name=self.axis_name,
            num_shards=self.num_shards,
        )

    def _check_state(self, state, where: str) -> None:
        if not isinstance(state, ShardedState):
            raise TypeError(
                f"{where}: the state must be the ShardedState returned by "
                f"srb.init(...), got {type(state).__name__}."
            )
        if state.num_shards != self.num_shards or state.axis_name != self.axis_name:
            raise ValueError(
                f"{where}: the state has {state.num_shards} shards along "
                f"{state.axis_name!r}; this buffer has {self.num_shards} along "
                f"{self.axis_name!r} (mesh {dict(self.mesh.shape)}). Use the state of a "
                "buffer over the same mesh shape."
            )

    def _smap(self, fn, in_specs, out_specs):
        """``shard_map`` of ``fn`` whose array arguments are first laid out as ``in_specs``
        says (inputs may come from anywhere: NumPy, one device, another layout)."""
        # check_vma=False: the local draws of some core samplers (lax.cond over epochs) mix
        # per-device and replicated values, which vma typing rejects though the program is
        # right; the global draws are vma-clean (tested under a user's checked shard_map)
        smap = jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
        explicit = types[self.axis_name] == AxisType.Explicit

        def placed(*args):
            return smap(
                *(
                    jax.tree_util.tree_map(lambda x, spec=spec: self._place(x, spec, explicit), a)
                    for a, spec in zip(args, in_specs)
                )
            )

        return placed

    def _place(self, x, spec, explicit: bool):
        sharding = NamedSharding(self.mesh, spec)
        if explicit:  # sharding in types: move the value (a no-op when already there)
            return jax.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    # ------------------------------------------------------------------ init / add
    def init(self, example: PyTree) -> ShardedState:
        """An empty state: each device builds its own shard, ``buffer.init(example)`` (one
        item, no batch axis; ``ndim=2``: one vectorized step ``[num_envs, ...]`` per shard)."""
        jax.eval_shape(self.buffer.init, example)  # argument errors here, not in shard_map
        example = jax.tree_util.tree_map(jnp.asarray, example)
        return self._program("init")(example)

    def init_from_data(self, data: PyTree) -> ShardedState:
        """A state holding ``data`` (leaves ``[n * N, ...]``, ``ndim=2``: ``[n * num_envs, T,
        ...]``): shard ``d`` gets the ``d``-th block, as ``buffer.init_from_data`` would."""
        self._check_batch(data, "ShardedReplayBuffer.init_from_data")
        return self._program("init_from_data")(data)

    def add(self, state: ShardedState, items: PyTree) -> ShardedState:
        """Add items (leaves ``[n * b, ...]``; ``ndim=2``: ``[n * num_envs, T, ...]``), sharded
        along the axis: device ``d`` writes its block into its shard, with no communication."""
        self._check_state(state, "ShardedReplayBuffer.add")
        self._check_batch(items, "ShardedReplayBuffer.add")
        return self._program("add")(state, items)

    def _check_batch(self, items, where: str) -> None:
        n = self.num_shards
        for path, x in jax.tree_util.tree_flatten_with_path(items)[0]:
            shape = np.shape(x)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"{where}: leaf {_errors.keystr(path)} has shape {tuple(shape)}; its "
                    f"leading axis must be a multiple of the {n} shards along "
                    f"{self.axis_name!r} (device d takes block d of it), e.g. "
                    f"[{n} * b, ...]."
                )

    # ------------------------------------------------------------------ sample / update
    def sample(
        self, state: ShardedState, key: jax.Array, batch_size: int | None = None, **options
    ) -> tuple[Sample, ShardedState]:
        """``buffer.batch_size`` (or ``batch_size``) rows per device: ``Sample`` leaves ``[n *
        B, ...]`` (slices ``[n * num_slices, slice_len, ...]``) sharded along the axis, with
        global indices; and the new state. ``key``: one PRNG key, the same for all devices.
        Nothing to sample: eagerly ``ValueError``; under jit ``mask`` False, ``weights`` 0."""
        self._check_state(state, "ShardedReplayBuffer.sample")
        bs = self.buffer.batch_size if batch_size is None else batch_size
        names = tuple(sorted(options))
        smp, new, ok = self._program("sample", bs, names)(
            state, key, tuple(options[k] for k in names)
        )
        # eagerly (the state was not donated, so it is intact), raise as a single buffer does
        if not _is_traced((state, key, options)) and not bool(ok):
            raise ValueError(
                f"ShardedReplayBuffer.sample: nothing can be sampled yet "
                f"({int(self.size(state))} items stored in {self.num_shards} shards, "
                f"batch_size={bs} per device, sampling={self.sampling!r}"
                + ("; local sampling needs every shard to draw" if self.sampling == "local" else "")
                + "). Add items first or check srb.can_sample(state); under jit "
                "the sample has mask=False, weights=0."
            )
        return smp, new

    def update(self, state: ShardedState, indices, priorities, *, generations=None) -> ShardedState:
        """Set priorities of global ``indices`` (``Sample.indices``, ``[n * B]`` or ``[n *
        num_slices, slice_len]``); each reaches the shard that owns it; duplicates: the last
        occurrence in the global order wins. Bad values follow the core's error policy
        (eagerly ``ValueError``, under jit ignored); with several processes values are not
        inspected (raising in one process would leave the others waiting).

        Pass the sample itself (``srb.update(state, sample, priorities)``) or
        ``generations=sample.generations`` and the owner of each entry drops it when its slot
        was rewritten since the draw, counting it (:meth:`dropped_updates`); bare indices
        cannot be checked (:mod:`functional_rb.generations`)."""
        where = "ShardedReplayBuffer.update"
        self._check_state(state, where)
        indices, generations = _generations.from_sample(indices, generations, where)
        if not sharded_draws.for_sampler(self.buffer.sampler).prioritized:
            return state
        indices = indices if isinstance(indices, jax.Array) else np.asarray(indices)
        if not np.issubdtype(indices.dtype, np.integer):
            raise TypeError(
                f"{where}: indices must be integers, got {indices.dtype}; pass sample.indices."
            )
        shape = tuple(np.shape(priorities))
        if shape not in ((), tuple(indices.shape)):
            raise ValueError(
                f"{where}: priorities have shape {shape}, "
                f"expected the shape of indices {tuple(indices.shape)} (or a "
                "scalar)."
            )
        if generations is not None:
            generations = _generations.as_generations(generations, indices.shape, where)
            if state.shards.generations is None:
                raise ValueError(
                    f"{where}: generations were given, but this buffer's "
                    f"sampler {type(self.buffer.sampler).__name__} keeps none."
                )
        if _readable((indices, priorities, generations)):
            keep = None if generations is None else np.asarray(generations) >= 0
            self._check_update_values(np.asarray(indices), np.asarray(priorities), keep)
        self._check_batch(indices, where)
        if not shape:
            priorities = jnp.broadcast_to(jnp.asarray(priorities), indices.shape)
        if generations is None:
            return self._program("update", False)(state, indices, priorities)
        gens32 = (
            np.where(generations <= 0x7FFFFFFF, generations, -2).astype(np.int32)
            if isinstance(generations, np.ndarray)
            else generations.astype(jnp.int32)
        )
        return self._program("update", True)(state, indices, priorities, gens32)

    def dropped_updates(self, state: ShardedState) -> jax.Array:
        """int32 ``[]``: update entries all shards dropped so far because their slot was
        rewritten since the draw (0 for samplers without generations)."""
        self._check_state(state, "ShardedReplayBuffer.dropped_updates")
        gens = state.shards.generations
        return jnp.int32(0) if gens is None else jnp.sum(gens.dropped, dtype=jnp.int32)

    def _check_update_values(
        self, indices: np.ndarray, priorities: np.ndarray, items: np.ndarray | None = None
    ) -> None:
        """Eager checks of an update's values; ``items``: bool, entries that are items (a
        sample's generation is not -1): the others' priorities are not checked."""
        where = "ShardedReplayBuffer.update"
        _errors.checked_indices(
            indices, self.capacity, where=where, fallback="out-of-range indices are ignored"
        )
        keep = np.asarray(sharded_ops._padding_kept(jnp.asarray(indices)))
        if items is not None:
            keep = keep & items
        p = np.broadcast_to(priorities, indices.shape)
        good = np.isfinite(p) & (p >= 0) if p.dtype.kind == "f" else p >= 0
        _errors.enforce(
            keep & ~good,
            lambda i, n: (
                f"{where}: priorities[{i}] = {p.reshape(-1)[i]!r} is not a finite number >= 0 ({n} "
                f"bad of {p.size}). Priorities must be finite and >= 0, e.g. jnp.abs(td_error); "
                "under jax.jit a bad priority is ignored (the item keeps its priority)."
            ),
        )

    # ------------------------------------------------------------------ figures
    def size(self, state: ShardedState) -> jax.Array:
        """int32 ``[]``: items stored in all shards."""
        self._check_state(state, "ShardedReplayBuffer.size")
        return self._program("size")(state)

    def can_sample(self, state: ShardedState) -> jax.Array:
        """bool ``[]``: ``sample`` can draw every device's batch (global mode: from the union;
        local: from each shard), and the rate limiter, over all shards' counts, allows it."""
        self._check_state(state, "ShardedReplayBuffer.can_sample")
        return self._program("can_sample", self.buffer.batch_size, True)(state)

    def can_insert(self, state: ShardedState, num_items: int = 1) -> jax.Array:
        """bool ``[]``: the rate limiter (global counts) allows each shard to add ``num_items``
        (``n * num_items`` in all); True without a limiter."""
        self._check_state(state, "ShardedReplayBuffer.can_insert")
        return self._program("can_insert")(state, jnp.int32(num_items))

    # ------------------------------------------------------------------ compiled programs
    @functools.cache  # noqa: B019 - the buffer is frozen and hashable
    def _program(self, op: str, *static):
        """The jitted ``shard_map`` of one operation (cached per buffer and static args)."""
        rb, ax = self.buffer, self.axis_name
        spec, rep = PartitionSpec(ax), PartitionSpec()

        if op == "init":
            fn = self._smap(lambda ex: self.block(rb.init(ex)), (rep,), spec)
        elif op == "init_from_data":
            fn = self._smap(lambda data: self.block(rb.init_from_data(data)), (spec,), spec)
        elif op == "add":
            fn = self._smap(
                lambda b, items: self.block(rb.add(self.local(b), items)), (spec, spec), spec
            )
        elif op == "sample":
            bs, names = static

            def body(b, key, values):
                opts = dict(zip(names, values))
                smp, local, ok = sharded_ops.sample_and_ok(
                    rb,
                    self.local(b),
                    key,
                    bs,
                    ax,
                    opts,
                    sampling=self.sampling,
                    counts=self.counts,
                    capacity_factor=self.capacity_factor,
                )
                return smp, self.block(local), ok

            fn = self._smap(body, (spec, rep, rep), (spec, spec, rep))
        elif op == "update" and static == (False,):
            fn = self._smap(
                lambda b, i, p: self.block(sharded_ops.update(rb, self.local(b), i, p, ax)),
                (spec, spec, spec),
                spec,
            )
        elif op == "update":
            fn = self._smap(
                lambda b, i, p, g: self.block(
                    sharded_ops.update(rb, self.local(b), i, p, ax, generations=g)
                ),
                (spec, spec, spec, spec),
                spec,
            )
        elif op == "size":
            fn = self._smap(lambda b: sharded_ops.size(rb, self.local(b), ax), (spec,), rep)
        elif op == "can_sample":
            bs, limiter = static
            fn = self._smap(
                lambda b: sharded_ops.can_sample(
                    rb, self.local(b), ax, self.sampling, batch_size=bs, limiter=limiter
                ),
                (spec,),
                rep,
            )
        elif op == "can_insert":
            fn = self._smap(
                lambda b, num: sharded_ops.can_insert(rb, self.local(b), num, ax), (spec, rep), rep
            )
        else:  # pragma: no cover
            raise AssertionError(op)
        return jax.jit(fn)


def sample(
    buffer: ReplayBuffer,
    state: BufferState,
    key: jax.Array,
    *,
    axis_name: str,
    batch_size: int | None = None,
    sampling: str = "global",
    counts: str = "stratified",
    capacity_factor: float | None = None,
    **options,
) -> tuple[Sample, BufferState]:
    """Per shard, inside ``shard_map``/``pmap``: ``buffer.sample(state, key, axis_name=...)``
    with the choices of :class:`ShardedReplayBuffer` (``sampling="local"``, ``counts``,
    ``capacity_factor``). ``state`` is this device's shard; returns this device's batch (global
    indices) and its new local state."""
    sharded_ops.require_axis(axis_name, "functional_rb.sharded.sample")
    # the buffer's own argument checks (state, key, batch_size, options), at trace time
    jax.eval_shape(lambda s, k: buffer.sample(s, k, batch_size, **options), state, key)
    bs = buffer.batch_size if batch_size is None else batch_size
    return sharded_ops.sample(
        buffer,
        state,
        key,
        bs,
        axis_name,
        options,
        sampling=sampling,
        counts=counts,
        capacity_factor=capacity_factor,
    )
