"""Trace-time checks of ``ReplayBuffer`` arguments: ints, keys, items, states.

They read only static facts (types, shapes, dtypes, static fields), which are known when a
function is traced: a jitted call pays for them once, when it is traced, and nothing of them
reaches the compiled program. Eager calls pay a few microseconds each. The one exception is
:func:`int_range_error`, which reads concrete integer values (eager calls only), per the error
policy of :mod:`functional_rb._internal.errors`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import config_int, describe_structure, flag, is_traced, keystr

PyTree = Any

FOREIGN_STATE_HINT = (
    "The state was built by another buffer configuration; pass the state returned by this "
    "ReplayBuffer's init (capacity={capacity}, ndim={ndim}, {storage}, {writer}, {sampler}). "
    "If it is a population of states (built with jax.vmap(rb.init)), map this call over it "
    "too, e.g. jax.vmap(rb.{fn})."
)

_KEY_HELP = (
    "Pass one PRNG key: jax.random.key(seed) (a typed key, shape ()) or the legacy "
    "jax.random.PRNGKey(seed) (raw uint32{raw}), and split it for each call "
    "(key, k = jax.random.split(key))."
)


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``: :func:`~functional_rb._internal.errors.config_int`
    for ``ReplayBuffer``'s arguments."""
    return config_int("ReplayBuffer", name, value, minimum=minimum)


def _dtype_of(x) -> np.dtype:
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype)
    return np.asarray(x).dtype


@functools.cache
def _raw_key_shape(impl_name: str) -> tuple:
    """Shape of ``jax.random.PRNGKey(0)`` (uint32 key data) under the default PRNG impl."""
    del impl_name  # the cache key: the shape depends on jax_default_prng_impl
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


# NumPy's random state where a JAX key belongs (rb.sample(state, np.random.default_rng(0))): JAX
# draws from an explicit key
_NUMPY_RANDOM_FIX = (
    "JAX draws from an explicit key, not from NumPy's random state: pass jax.random.key(0) "
    "(any int seed, e.g. one drawn from the NumPy generator)."
)


def _type_name(x) -> str:
    """The type of ``x`` by the shortest module path that exports it (``numpy.random.Generator``,
    not ``numpy.random._generator.Generator``); ``int`` for a builtin."""
    t = type(x)
    if t.__module__ == "builtins":
        return t.__qualname__
    parts = t.__module__.split(".")
    for i in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None and getattr(module, t.__qualname__, None) is t:
            return f"{module.__name__}.{t.__qualname__}"
    return f"{t.__module__}.{t.__qualname__}"


def check_key(key, where: str) -> None:
    """One PRNG key: a typed key of shape ``()`` or raw ``uint32`` key data of the default
    implementation's shape (``[2]`` for threefry). Inside ``jax.vmap`` over keys each key is
    unbatched, so mapped calls pass."""
    raw = _raw_key_shape(str(jax.config.jax_default_prng_impl))  # type: ignore[attr-defined]  # set at run time
    help_ = _KEY_HELP.format(raw=list(raw))
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is None or shape is None:
        if isinstance(key, (np.random.Generator, np.random.RandomState, np.random.BitGenerator)):
            raise TypeError(
                f"{where}: key must be a JAX PRNG key, got a {_type_name(key)} ({key!r}). "
                f"{_NUMPY_RANDOM_FIX} {help_}"
            )
        raise TypeError(
            f"{where}: key must be a JAX PRNG key, got {key!r} ({_type_name(key)}). {help_}"
        )
    shape = tuple(shape)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape == ()) or (not typed and dtype == np.uint32 and shape == raw):
        return
    one = () if typed else raw
    batch = shape[: len(shape) - len(one)]
    if (typed or dtype == np.uint32) and batch and shape[len(batch) :] == one:
        raise ValueError(
            f"{where}: key has shape {shape}: a batch of {int(np.prod(batch))} "
            f"{'typed' if typed else 'raw'} keys (batch shape {batch}), but one key draws one "
            "batch. To draw one batch per key map over the keys, e.g. "
            "jax.vmap(rb.sample, in_axes=(None, 0))(state, keys); otherwise pass one of them "
            f"(keys[0]). {help_}"
        )
    what = (
        f"a typed key array of shape {shape}"
        if typed
        else f"an array of dtype {np.dtype(dtype).name} and shape {shape}"
    )
    raise TypeError(f"{where}: key must be a JAX PRNG key, got {what}. {help_}")


def int_range_error(x, dtype: np.dtype, target: np.dtype, path, where: str):
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
        "cast wraps like a C cast.)"
    )


def _numbers_list(x, scalars: bool = False) -> bool:
    """A non-empty (nested) Python list or tuple of numbers: JAX reads each number as a leaf.
    ``scalars``: 0-d arrays count as numbers (a list passed to a jitted call arrives as a list
    of 0-d tracers)."""
    return (
        isinstance(x, (list, tuple))
        and bool(x)
        and all(
            isinstance(e, (bool, int, float, complex, np.generic))
            or (scalars and isinstance(e, jax.Array) and e.ndim == 0)
            or _numbers_list(e, scalars)
            for e in x
        )
    )


def _numbers_lists(tree, kinds=(list, tuple), scalars: bool = False) -> list[tuple[Any, Any]]:
    """``[(path, node)]`` of the nodes of ``tree`` that are lists of numbers (``kinds``)."""

    def is_leaf(x):
        return isinstance(x, kinds) and _numbers_list(x, scalars)

    return [
        (p, x)
        for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
        if is_leaf(x)
    ]


def list_leaf_error(where: str, path, node, what: str) -> ValueError:
    """The error for a Python list of numbers given where ``what`` (an array) belongs."""
    shape, inner = [], node
    while isinstance(inner, (list, tuple)) and inner:
        shape.append(len(inner))
        inner = inner[0]
    return ValueError(
        f"{where}: {keystr(path)} is a Python {type(node).__name__} of numbers (an array of "
        f"shape {tuple(shape)}), "
        f"but {what} must be an array: JAX reads each element of a list as a separate leaf. "
        f"Convert it first, e.g. jnp.asarray(x) or np.asarray(x, np.float32) for that entry."
    )


def check_example(example) -> None:
    """``ReplayBuffer.init``: refuse an example with a Python list of numbers (meant as a
    vector: JAX would store each number as its own leaf). Tuples are left alone: a tuple of
    scalars is a legitimate item of several fields."""
    found = _numbers_lists(example, kinds=(list,))
    if found:
        raise list_leaf_error("ReplayBuffer.init", *found[0], "each leaf of the example")


def _no_batch_axis(spec, items, where: str):
    """The error for items shaped like the stored item itself (no batch axis), when every
    leaf of the stored item shares one leading dimension ``n > 1``: with several leaves, the
    example given to init was most likely a batch of ``n`` items; with one leaf whose shape the
    items repeat exactly, most likely one item was added without its batch axis. None
    otherwise (the per-leaf message applies)."""
    shapes = [tuple(s.shape) for s in jax.tree_util.tree_leaves(spec)]
    leads = {sh[0] for sh in shapes if sh}
    if len(leads) != 1 or any(not sh for sh in shapes) or next(iter(leads)) < 2:
        return None
    if any(np.ndim(x) != len(sh) for x, sh in zip(jax.tree_util.tree_leaves(items), shapes)):
        return None
    n = next(iter(leads))
    got = {keystr(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(items)[0]}
    if len(shapes) == 1 and tuple(got.values()) == tuple(shapes):
        # One leaf, shaped exactly like the stored item: nothing says init took a batch (one
        # leaf always "shares" its leading dimension), and the common slip is an add of one
        # item. Both readings, that one first.
        return ValueError(
            f"{where}: the items have no batch axis: their shapes {got} are exactly the shape "
            "of ONE stored item, and add takes a batch [B, ...]. To add one item, give it a "
            "batch axis: rb.add(state, jax.tree_util.tree_map(lambda x: x[None], item)). (If "
            f"instead init was given a batch of {n} items, pass it one item: "
            "rb.init(jax.tree_util.tree_map(lambda x: x[0], batch)).)"
        )
    return ValueError(
        f"{where}: the items have no batch axis: their shapes {got} have the rank of ONE stored "
        f"item. Every leaf of the example given to init has the leading dimension {n}, so init "
        f"was most likely given a batch of {n} items, and stores items of that whole shape. "
        "Pass one item to init, e.g. rb.init(jax.tree_util.tree_map(lambda x: x[0], batch)), "
        "then add batches [B, ...]. (If the example really was one item, give the items a "
        "batch axis: jax.tree_util.tree_map(lambda x: x[None], item).)"
    )


def _outside(x, target: np.dtype):
    """bool, the shape of the traced integer ``x``: values outside ``target``'s range (each
    bound compared in ``x``'s own dtype, where it is representable)."""
    src, dst = np.iinfo(x.dtype), np.iinfo(target)
    bad = jnp.zeros(jnp.shape(x), bool)
    if dst.min > src.min:
        bad = bad | (x < jnp.asarray(dst.min, x.dtype))
    if dst.max < src.max:
        bad = bad | (x > jnp.asarray(dst.max, x.dtype))
    return bad


def num_envs_of(example) -> int:
    """The shared leading axis of an ``ndim=2`` example (one vectorized step)."""
    sizes: dict[int, str] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(example)[0]:
        if np.ndim(x) < 1:
            raise ValueError(
                f"ReplayBuffer.init: with ndim=2 every leaf of the example is one "
                f"vectorized step [num_envs, ...], but leaf {keystr(path)} is a scalar "
                f"(shape {np.shape(x)}). Give it a leading num_envs axis."
            )
        sizes.setdefault(np.shape(x)[0], keystr(path))
    if len(sizes) > 1:
        raise ValueError(
            "ReplayBuffer.init: with ndim=2 all example leaves share the leading "
            f"num_envs axis, got {{size: first leaf}} = {sizes}."
        )
    return next(iter(sizes))


def _few(paths, limit: int = 8) -> str:
    paths = sorted(paths)
    more = len(paths) - limit
    return str(paths[:limit]) + (f" and {more} more" if more > 0 else "")


def check_structure(spec, items, where: str) -> None:
    """Raise unless ``items`` has the tree structure of the stored item ``spec``."""
    spec_def = jax.tree_util.tree_structure(spec)
    items_def = jax.tree_util.tree_structure(items)
    if spec_def == items_def:  # type: ignore[operator]  # jaxlib has no stubs
        return
    lists = _numbers_lists(items, scalars=True)
    if lists and not _numbers_lists(spec):
        raise list_leaf_error(where, *lists[0], "each leaf of the items")
    if (
        isinstance(items, (list, tuple))
        and items
        and all(jax.tree_util.tree_structure(x) == spec_def for x in items)  # type: ignore[operator]  # jaxlib has no stubs
    ):
        raise ValueError(
            f"{where}: the items are a Python {type(items).__name__} of {len(items)} items; "
            "pass one PyTree whose leaves are stacked along a new leading axis, e.g. "
            "jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *items)."
        )
    want = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(spec)[0]}
    got = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(items)[0]}
    raise ValueError(
        f"{where}: the items' tree structure differs from the stored items'. Missing "
        f"leaves: {_few(want - got)}; unexpected leaves: {_few(got - want)}. "
        f"Expected leaves {describe_structure(spec)}, got {describe_structure(items)}"
        + (
            ""
            if want != got
            else f" (same paths, different containers: expected {spec_def}, got {items_def})"
        )
        + "."
    )


def check_leaf(path, x, s, *, ndim: int, num_envs: int, where: str) -> tuple:
    """Check one added leaf ``x`` against its stored spec ``s``; returns its batch shape."""
    shape = tuple(np.shape(x))
    dtype = _dtype_of(x)
    if len(shape) != ndim + len(s.shape) or shape[ndim:] != tuple(s.shape):
        lead = "[B]" if ndim == 1 else "[num_envs, T]"
        raise ValueError(
            f"{where}: leaf {keystr(path)} has shape {shape}, expected {lead} + "
            f"{tuple(s.shape)} (a batch of items shaped like the example given to "
            f"init). Stack your items along a new leading axis"
            + (" (a single item needs [None])" if len(shape) == len(s.shape) else "")
            + "."
        )
    if ndim == 2 and shape[0] != num_envs:
        raise ValueError(
            f"{where}: leaf {keystr(path)} has {shape[0]} envs on axis 0, expected "
            f"num_envs={num_envs} (from the example given to init); items are "
            "[num_envs, T, ...]."
        )
    if not np.can_cast(dtype, s.dtype, casting="same_kind"):
        raise TypeError(
            f"{where}: leaf {keystr(path)} has dtype {dtype}, which does not cast "
            f"safely to the stored dtype {s.dtype}. Convert it explicitly "
            f"(x.astype({np.dtype(s.dtype).name})) if that is what you mean."
        )
    if (
        dtype.kind in "iu"
        and np.dtype(s.dtype).kind in "iu"
        and not np.can_cast(dtype, s.dtype, casting="safe")
    ):
        if is_traced(x):
            flag(_outside(x, np.dtype(s.dtype)))
        else:
            err = int_range_error(x, dtype, np.dtype(s.dtype), path, where)
            if err is not None:
                raise err
    return shape[:ndim]


def check_items(spec, items, *, ndim: int, num_envs: int, where: str) -> PyTree:
    """``items`` checked against the stored item ``spec`` and cast to its dtypes (jnp arrays).

    Raises at trace time, naming the leaf path, the expected and the received shape/dtype.
    """
    check_structure(spec, items, where)
    batch = None
    out = []
    for (path, x), s in zip(
        jax.tree_util.tree_flatten_with_path(items)[0], jax.tree_util.tree_leaves(spec)
    ):
        if ndim == 1 and np.ndim(x) == len(s.shape):
            err = _no_batch_axis(spec, items, where)
            if err is not None:
                raise err
        lead = check_leaf(path, x, s, ndim=ndim, num_envs=num_envs, where=where)
        if batch is None:
            batch = (lead, keystr(path))
        elif lead != batch[0]:
            raise ValueError(
                f"{where}: leaves disagree on the batch shape: {batch[1]} has "
                f"{batch[0]}, {keystr(path)} has {lead}."
            )
        out.append(jnp.asarray(x).astype(s.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(items), out)


def state_problem(rb, state) -> tuple | None:
    """``(message, exception type)`` when ``state`` is not laid out as ``rb.init`` builds it,
    else None. Static facts only: ``num_envs`` against ``ndim``/``capacity``, each component's
    declared state types, and its own ``check_state`` of array shapes. Under ``jax.vmap`` the
    mapped axis is invisible here, so a population of states passes when the call is mapped.
    """
    cap, n = rb.capacity, state.num_envs
    if rb.ndim == 1 and n != 1:
        return (
            f"state.num_envs is {n!r}, expected 1 for an ndim=1 buffer (the state is laid "
            "out as [num_envs, time]: it comes from an ndim=2 buffer)",
            ValueError,
        )
    if rb.ndim == 2 and (
        isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or cap % n
    ):
        return (
            f"state.num_envs is {n!r}, expected a positive divisor of capacity={cap} "
            "for an ndim=2 buffer",
            ValueError,
        )
    for name in ("storage", "writer", "sampler"):
        component, part = getattr(rb, name), getattr(state, name)
        expected = component.state_types
        if expected and not isinstance(part, expected):
            return (
                f"state.{name} is a {type(part).__name__}, expected "
                f"{' or '.join(t.__name__ for t in expected)} (the state of "
                f"{type(component).__name__})",
                TypeError,
            )
    problem = (
        rb.storage.check_state(state.storage, cap, n)
        or rb.writer.check_state(state.writer, cap)
        or _generations_problem(rb, state.generations)
    )
    return (problem, ValueError) if problem else None


def _generations_problem(rb, generations) -> str | None:
    """Why ``generations`` (``BufferState.generations``) is not what ``rb.init`` builds: a
    ``GenerationState`` with ``slots [capacity]`` when the sampler tracks generations, else
    None (static facts only)."""
    tracks = rb.sampler.tracks_generations
    name = type(rb.sampler).__name__
    if tracks and generations is None:
        return (
            f"state.generations is None, but the sampler {name} tracks write generations "
            "(a state built by a buffer whose sampler does not; a checkpoint of it loads "
            "with generations when loaded with like=rb.init(example))"
        )
    if not tracks and generations is not None:
        return (
            f"state.generations is set, but the sampler {name} keeps none (a state "
            "built by a buffer with a prioritized sampler)"
        )
    if tracks and tuple(generations.slots.shape) != (rb.capacity,):
        return (
            f"state.generations.slots has shape {tuple(generations.slots.shape)}, "
            f"expected ({rb.capacity},) (capacity={rb.capacity})"
        )
    return None
