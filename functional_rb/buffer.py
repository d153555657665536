"""The replay buffer: a frozen composition of storage x writer x sampler, and its state."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._errors import describe_structure, is_traced, keystr, shape_mismatch
from functional_rb.layout import Context, Layout
from functional_rb.samplers import RandomSampler
from functional_rb.storages import DeviceStorage
from functional_rb.writers import ImmutableWriter, MaxValueState, RoundRobinWriter

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


# ---------------------------------------------------------------------- trace-time checks
# The checks below read only static facts (types, shapes, dtypes, static fields), which are
# known when a function is traced: a jitted call pays for them once, when it is traced, and
# nothing of them reaches the compiled program. Eager calls pay a few microseconds each.

_FOREIGN_STATE_HINT = (
    "The state was built by another buffer configuration; pass the state returned by this "
    "ReplayBuffer's init (capacity={capacity}, ndim={ndim}, {storage}, {writer}, {sampler}). "
    "If it is a population of states (built with jax.vmap(rb.init)), map this call over it "
    "too, e.g. jax.vmap(rb.{fn}).")

_KEY_HELP = (
    "Pass one PRNG key: jax.random.key(seed) (a typed key, shape ()) or the legacy "
    "jax.random.PRNGKey(seed) (raw uint32{raw}), and split it for each call "
    "(key, k = jax.random.split(key)).")


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl_name: str) -> tuple:
    """Shape of ``jax.random.PRNGKey(0)`` (uint32 key data) under the default PRNG impl."""
    del impl_name  # the cache key: the shape depends on jax_default_prng_impl
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def _check_key(key, where: str) -> None:
    """One PRNG key: a typed key of shape ``()`` or raw ``uint32`` key data of the default
    implementation's shape (``[2]`` for threefry). Inside ``jax.vmap`` over keys each key is
    unbatched, so mapped calls pass."""
    raw = _raw_key_shape(str(jax.config.jax_default_prng_impl))
    help_ = _KEY_HELP.format(raw=list(raw))
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(f"{where}: key must be a JAX PRNG key, got {key!r} "
                        f"({type(key).__name__}). {help_}")
    shape = tuple(shape)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape == ()) or (not typed and dtype == np.uint32 and shape == raw):
        return
    one = () if typed else raw
    batch = shape[:len(shape) - len(one)]
    if (typed or dtype == np.uint32) and batch and shape[len(batch):] == one:
        raise ValueError(
            f"{where}: key has shape {shape}: a batch of {int(np.prod(batch))} "
            f"{'typed' if typed else 'raw'} keys (batch shape {batch}), but one key draws one "
            "batch. To draw one batch per key map over the keys, e.g. "
            "jax.vmap(rb.sample, in_axes=(None, 0))(state, keys); otherwise pass one of them "
            f"(keys[0]). {help_}")
    what = (f"a typed key array of shape {shape}" if typed
            else f"an array of dtype {np.dtype(dtype).name} and shape {shape}")
    raise TypeError(f"{where}: key must be a JAX PRNG key, got {what}. {help_}")


@functools.lru_cache(maxsize=None)
def _sampler_options(sampler) -> tuple:
    """``(names, any)``: the keyword options ``sampler.sample`` takes after the protocol's
    ``(state, key, batch_size, ctx)``, and whether it takes ``**kwargs``."""
    params = list(inspect.signature(sampler.sample).parameters.values())
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:4]
    names = tuple(p.name for p in params if p not in positional
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


@functools.lru_cache(maxsize=256)
def _component_state_type(component, layout: Layout, spec_def=None, spec_leaves=None,
                          batch_size=None):
    """The type of the state ``component.init`` builds (a writer when ``spec_def`` is None,
    else a sampler), from an abstract evaluation; None when it cannot be built."""
    try:
        if spec_def is None:
            out = jax.eval_shape(lambda: component.init(layout))
        else:
            spec = jax.tree_util.tree_unflatten(spec_def, list(spec_leaves))
            kw = {} if batch_size is None else {"batch_size": batch_size}
            out = jax.eval_shape(lambda: component.init(spec, layout, **kw))
    except Exception:  # the real call will raise its own, more specific error
        return None
    return type(out)


def _int_range_error(x, dtype: np.dtype, target: np.dtype, path, where: str):
    """An OverflowError when concrete integer values ``x`` do not fit ``target``, else None.

    Called only for integer casts that may lose values (not safe), and only reads values that
    are concrete: under jit the cast is not checked (it wraps, see ``ReplayBuffer.add``).
    """
    if is_traced(x):
        return None
    if isinstance(x, jax.Array):
        if x.size == 0:
            return None
        lo, hi = jax.device_get((jnp.min(x), jnp.max(x)))
    else:
        a = np.asarray(x)
        if a.size == 0:
            return None
        lo, hi = a.min(), a.max()
    lo, hi = int(lo), int(hi)
    info = np.iinfo(target)
    if lo >= int(info.min) and hi <= int(info.max):
        return None
    return OverflowError(
        f"{where}: leaf {keystr(path)} has values in [{lo}, {hi}] (dtype {dtype}), outside "
        f"the range [{info.min}, {info.max}] of the stored dtype {target}: the cast would wrap "
        f"around (e.g. 300 becomes 44 in int8). Clip the values, or give init an example whose "
        f"leaf {keystr(path)} has a wider dtype. (Under jax.jit values are not inspected: the "
        "cast wraps like a C cast.)")


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
        # Slice samplers and TEDStorage follow time through the ring (a trajectory is a run of
        # consecutive slots); a writer that puts items elsewhere (MaxValueWriter: into the
        # lowest-ranked item's slot) would make them return silently wrong data.
        fifo = isinstance(self.writer, (RoundRobinWriter, ImmutableWriter))
        for name, obj in (("sampler", self.sampler), ("storage", self.storage)):
            if getattr(obj, "requires_fifo", False) and not fifo:
                raise ValueError(
                    f"ReplayBuffer: {name}={type(obj).__name__} needs a FIFO writer "
                    "(RoundRobinWriter, or ImmutableWriter with the state built by "
                    "rb.init_from_data): it reads trajectories as consecutive slots of the "
                    f"ring, got writer={self.writer!r}, which does not write in time order. "
                    "Use writer=frb.RoundRobinWriter(), or a sampler/storage that does not "
                    "follow trajectories (e.g. RandomSampler, DeviceStorage).")

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
        # a writer that reads the items (MaxValueWriter's rank_key) checks them now rather
        # than at the first add, and before the storage creates anything (MemmapStorage files)
        check_spec = getattr(self.writer, "check_item_spec", None)
        if check_spec is not None:
            check_spec(jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), item))
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
        float -> int raises ``TypeError``).

        Narrowing integer casts (e.g. int64 or int32 items into an int8 leaf): with concrete
        inputs (eager calls, NumPy arrays) a value outside the stored dtype's range raises
        ``OverflowError`` naming the leaf. Under ``jax.jit`` values are not inspected: an
        out-of-range integer wraps modulo ``2**bits`` like a C cast (300 is stored as 44 in an
        int8 leaf); only that value is affected, the rest of the state stays consistent.

        ``state`` must come from this buffer's ``init`` (same capacity, ndim, storage, writer
        and sampler); another one raises at trace time.
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
        run_start = ctx.cursor if self.ndim == 1 and getattr(writer, "writes_runs", False) \
            else None
        new_ctx = Context(layout=ctx.layout, filled=writer_state.filled,
                          cursor=writer_state.cursor, run_start=run_start)
        storage_state = self.storage.set(state.storage, positions, flat_items, mask, ctx)
        sampler_state = self.sampler.on_add(state.sampler, positions, mask, flat_items, new_ctx)
        return BufferState(storage=storage_state, writer=writer_state, sampler=sampler_state,
                           num_envs=state.num_envs)

    def check_items(self, state: BufferState, items: PyTree, *, where: str) -> PyTree:
        """Check a batch against the stored item spec and cast it; returns jnp arrays.

        Raises at trace time, naming the leaf path, the expected and the received shape/dtype.
        """
        self._check_state(state, where)
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
            if (dtype.kind in "iu" and np.dtype(s.dtype).kind in "iu"
                    and not np.can_cast(dtype, s.dtype, casting="safe")):
                err = _int_range_error(x, dtype, np.dtype(s.dtype), path, where)
                if err is not None:
                    raise err
            out.append(jnp.asarray(x).astype(s.dtype))
        return jax.tree_util.tree_unflatten(items_def, out)

    def _check_state(self, state, where: str) -> None:
        """Raise unless ``state`` is laid out as this buffer's ``init`` builds it.

        Checks static facts only (so it costs nothing in a compiled call): ``num_envs`` against
        ``ndim``/``capacity``, the storage's leading (capacity) dimensions, the writer's
        counters, and the writer/sampler state types. Under ``jax.vmap`` the mapped axis is
        invisible here, so a population of states passes when the call is mapped.
        """
        if not isinstance(state, BufferState):
            raise TypeError(f"{where}: the first argument must be the BufferState returned by "
                            f"rb.init(...), got {type(state).__name__}.")
        fn = where.rsplit(".", 1)[-1] if where.startswith("ReplayBuffer.") else "add"

        def fail(what: str, exc=ValueError):
            raise exc(f"{where}: {what}. " + _FOREIGN_STATE_HINT.format(
                capacity=self.capacity, ndim=self.ndim, storage=type(self.storage).__name__,
                writer=type(self.writer).__name__, sampler=type(self.sampler).__name__, fn=fn))

        cap, n = self.capacity, state.num_envs
        if self.ndim == 1 and n != 1:
            fail(f"state.num_envs is {n!r}, expected 1 for an ndim=1 buffer (the state is laid "
                 "out as [num_envs, time]: it comes from an ndim=2 buffer)")
        if self.ndim == 2 and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                               or n < 1 or cap % n):
            fail(f"state.num_envs is {n!r}, expected a positive divisor of capacity={cap} "
                 "for an ndim=2 buffer")
        # -- storage: the state type its init builds, then its arrays' shapes
        st, storage = state.storage, self.storage
        expected = getattr(storage, "state_types", ())
        if expected and not isinstance(st, expected):
            fail(f"state.storage is a {type(st).__name__}, expected "
                 f"{' or '.join(t.__name__ for t in expected)} (the state of "
                 f"{type(storage).__name__})", TypeError)
        check = getattr(storage, "check_state", None)
        problem = check(st, cap, n) if check is not None else None
        if problem:
            fail(problem)
        # -- writer: scalar counters; MaxValueWriter's ranks are [capacity]
        ws = state.writer
        rows = []  # (path, leaf, expected shape, whole shape or leading dims only, why)
        for name in ("cursor", "filled"):
            x = getattr(ws, name, None)
            if x is not None and hasattr(x, "shape"):
                rows.append((f"state.writer.{name}", x, (), True, " (one counter per buffer)"))
        if isinstance(ws, MaxValueState):
            rows.append(("state.writer.ranks", ws.ranks, (cap,), True, f" (capacity={cap})"))
        problem = shape_mismatch(rows)
        if problem:
            fail(problem)
        layout = self.layout(n)
        want_w = _component_state_type(self.writer, layout)
        if want_w is not None and type(ws) is not want_w:
            fail(f"state.writer is a {type(ws).__name__}, expected {want_w.__name__} (the state "
                 f"of {type(self.writer).__name__})", TypeError)
        # -- sampler: the type its init builds for these items
        spec = self.storage.item_spec(st)
        spec_leaves, spec_def = jax.tree_util.tree_flatten(spec)
        bs = self.batch_size if getattr(self.sampler, "init_takes_batch_size", False) else None
        want_s = _component_state_type(self.sampler, layout, spec_def, tuple(spec_leaves), bs)
        if want_s is not None and type(state.sampler) is not want_s:
            fail(f"state.sampler is a {type(state.sampler).__name__}, expected "
                 f"{want_s.__name__} (the state of {type(self.sampler).__name__})", TypeError)

    # ------------------------------------------------------------------ sample / update
    def sample(self, state: BufferState, key: jax.Array, batch_size: int | None = None,
               **options) -> tuple[Sample, BufferState]:
        """Draw a batch. Returns ``(Sample, new_state)``.

        ``key``: one PRNG key, ``jax.random.key(seed)`` (typed, shape ``()``) or
        ``jax.random.PRNGKey(seed)`` (raw ``uint32[2]``); a batch of keys raises (map over keys
        with ``jax.vmap(rb.sample, in_axes=(None, 0))`` to draw one batch per key).
        ``batch_size`` (a Python int) overrides the default. ``options`` go to the sampler
        (e.g. ``beta=`` for prioritized samplers); an option the sampler does not take raises
        ``TypeError`` listing those it does. When nothing can be sampled: eagerly a
        ``ValueError``; under jit/vmap a sample with ``mask`` all False and ``weights`` 0 (its
        indices are valid, its data is whatever those slots hold).

        Performance: a top-level ``jax.jit`` copies every input it returns unchanged, and the
        returned state holds the storage. Jit it as ``jax.jit(rb.sample, donate_argnums=0)``
        (the returned state then aliases the input's buffers: no copy) and keep the returned
        state, or jit a function that returns only what you need (the sample), or sample
        inside a larger jitted step.
        """
        bs = self.batch_size if batch_size is None else _check_int("batch_size", batch_size, 1)
        self._check_state(state, "ReplayBuffer.sample")
        _check_key(key, "ReplayBuffer.sample")
        if options:
            names, any_option = _sampler_options(self.sampler)
            unknown = sorted(set(options) - set(names))
            if unknown and not any_option:
                accepts = (f"accepts only {', '.join(f'{k}=' for k in names)}" if names
                           else "accepts no options")
                raise TypeError(
                    f"ReplayBuffer.sample: unknown option(s) {unknown} for the sampler "
                    f"{type(self.sampler).__name__}, which {accepts}. Options are passed to the "
                    "sampler's sample (e.g. beta= for PrioritizedSampler and "
                    "PrioritizedSliceSampler).")
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
        self._check_state(state, "ReplayBuffer.update")
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
        self._check_state(state, "ReplayBuffer.size")
        return self.context(state).size

    def can_sample(self, state: BufferState) -> jax.Array:
        """bool []: whether ``sample`` with the default batch size can draw a batch."""
        self._check_state(state, "ReplayBuffer.can_sample")
        return jnp.asarray(self.sampler.can_sample(state.sampler, self.context(state),
                                                   self.batch_size))

    def get(self, state: BufferState, indices: jax.Array) -> PyTree:
        """Items at flat storage ``indices`` (int32, any shape), leaves ``[*indices.shape, ...]``."""
        self._check_state(state, "ReplayBuffer.get")
        return self.storage.get(state.storage, jnp.asarray(indices, jnp.int32),
                                self.context(state))
