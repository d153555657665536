"""The error policy, and the helpers that implement it.

Every message names the function, the leaf path (``jax.tree_util.keystr``), what was expected,
what was received, and how to fix it (in the manner of chex/equinox).

One policy for bad values
-------------------------
What can be seen is checked: static facts (tree structures, shapes, dtypes, Python arguments)
at trace time, so a wrong call raises under ``jax.jit`` too; array *values* when they are
concrete (eager calls). A bad value raises ``ValueError`` (``TypeError`` for a wrong type,
``OverflowError`` for a narrowing cast) naming the first bad entry and the fix. Under ``jit``
values cannot be seen; each rule has a fallback, documented here and at the function, that
keeps the state consistent: the bad entries are left out, never written somewhere else.

Each bad value, what an eager call does, and what a call under ``jit`` does:

- ``key`` not one PRNG key; items, states or arguments of the wrong structure, shape or
  dtype. Eagerly: ``TypeError`` / ``ValueError``. Under ``jit``: the same, at trace time.
- ``update`` index outside ``[0, C)``. Eagerly: ``ValueError``; the index array is checked in
  its own dtype before any cast, so an int64 2**32+3 is refused, never taken for item 3. Under
  ``jit``: an entry outside ``[0, C)`` as the traced function receives it is ignored. What no
  library code can catch: with ``jax_enable_x64`` off (JAX's default), ``jax.jit`` converts
  64-bit integer arguments to int32 at its call boundary, silently, so inside your own
  ``jit`` an index of 2**32+3 arrives as 3 and updates item 3. Pass int32
  indices (``sample.indices`` always are), or enable x64 to have them checked in int64.
- ``update`` index of an empty slot. Eagerly and under ``jit``: ignored.
- ``update`` priority NaN, inf or < 0. Eagerly: ``ValueError``. Under ``jit``: the entry is
  ignored (the item keeps its priority).
- A priority whose ``(p + eps) ** alpha`` exceeds ``priorities.value_max(C)``. Eagerly and
  under ``jit``: clamped to ``value_max(C)``.
- ``beta`` not a finite number >= 0. Eagerly: ``ValueError``. Under ``jit``: the sampler's
  ``beta`` is used.
- ``get`` index outside ``[0, C)``. Eagerly: ``ValueError``. Under ``jit``: clipped into
  ``[0, C)``.
- ``add``: integer values outside the stored dtype's range. Eagerly: ``OverflowError``. Under
  ``jit``: the value wraps like a C cast (that value only).
- ``sample`` when nothing can be drawn. Eagerly: ``ValueError``. Under ``jit``: ``mask``
  False, weights 0.
- ``sample`` of a ``SampleOnceSampler`` with fewer undrawn items than ``batch_size``. Eagerly
  and under ``jit``: the undrawn items, then padding (``mask`` False, weights 0); with
  ``drop_last=True``, as when nothing can be drawn (above), and no item is spent.
- ``TEDStorage`` side table overflow. Eagerly: ``ValueError``. Under ``jit``:
  ``state.storage.lost`` counts it (see TEDStorage).

:func:`enforce` is the one implementation of the "eagerly raise, under jit fall back" rule:
a caller computes the boolean mask of bad entries, calls ``enforce`` (which raises when the
mask is concrete and any entry is bad) and then applies its fallback with that same mask, so
the eager and the jitted call run the same code. Traced, inside :func:`collect_flags` (the eager
fast path's check, :mod:`functional_rb._internal.eager`), ``enforce`` records whether any entry is bad.

One rule for configuration
--------------------------
Arguments that configure a component (a capacity, a slice length, a ratio) are Python values
checked when the component is built, eagerly and under ``jit`` alike: :func:`config_int` and
:func:`config_number` are the one implementation. A wrong type raises
:class:`ArgumentTypeError` (a ``TypeError`` that is also a ``ValueError``, so code written
against either keeps working); a value out of range raises ``ValueError``. Both name the
function, the argument, the allowed range, what was received and, where one is given, the fix.

A state whose arrays were donated (by an eager ``add`` / ``sample`` / ``update``, or by a
``jax.jit(..., donate_argnums=0)`` of one's own) raises :class:`ConsumedStateError` when it is
passed to a buffer method again, naming the deleted leaf (:func:`check_not_consumed`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np

# the public exceptions (functional_rb.errors), also importable from here as before
from functional_rb.errors import ArgumentTypeError, ConsumedStateError


def keystr(path: Any) -> str:
    s = jax.tree_util.keystr(tuple(path))
    return s if s else "<root>"


def is_traced(x: Any) -> bool:
    """True when ``x`` is an abstract value (inside jit/vmap/scan) and cannot be inspected."""
    return isinstance(x, jax.core.Tracer)


def concrete_or_none(x: Any):
    """Return ``x`` as a NumPy value when it is concrete, else None (traced)."""
    if is_traced(x):
        return None
    try:
        return np.asarray(x)
    except Exception:  # pragma: no cover - defensive: abstract values that are not Tracers
        return None


_local = threading.local()


@contextlib.contextmanager
def collect_flags():
    """Within the block, :func:`enforce` and :func:`flag` record each traced check as a bool
    ``[]`` (True: a bad entry) in the list this yields, instead of ignoring it. The eager fast
    path traces a method inside it to learn, in one compiled call, whether the eager code would
    raise (see :mod:`functional_rb._internal.eager`)."""
    stack = _local.__dict__.setdefault("flags", [])
    flags: list = []
    stack.append(flags)
    try:
        yield flags
    finally:
        stack.pop()


def flag(bad: Any) -> None:
    """Record the traced bool array ``bad`` (any entry True: the eager code would raise) for an
    enclosing :func:`collect_flags`; nothing otherwise."""
    stack = _local.__dict__.get("flags")
    if stack:
        stack[-1].append(jnp.any(jnp.asarray(bad)))


def enforce(bad: Any, message, error: type = ValueError) -> None:
    """Raise ``error(message(i, n))`` when the bool array ``bad`` is concrete and has a
    True entry (``i``: the first one, flat; ``n``: how many); do nothing when it is traced
    (but :func:`flag` it) or all False. The caller then applies its documented fallback to
    the entries ``bad`` marks. ``message`` is only called to raise, so building it costs
    nothing otherwise."""
    b = concrete_or_none(bad)
    if b is None:
        flag(bad)
        return
    if not b.any():
        return
    flat = b.reshape(-1)
    raise error(message(int(np.argmax(flat)), int(flat.sum())))


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not is_traced(x) and x.is_deleted()


def consumed_leaf(tree: Any) -> str | None:
    """The path of the first concrete leaf of ``tree`` that was deleted (donated to an earlier
    call), or None. Traced leaves are never deleted."""
    if not any(_deleted(x) for x in jax.tree_util.tree_leaves(tree)):
        return None
    return next(keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _deleted(x))


CONSUMED_FIX = (
    "rb.add, rb.sample and rb.update called outside jax.jit update the state in "
    "place and consume the state they are given, as a function jitted with "
    "donate_argnums does: use the state that call returned"
)


def check_not_consumed(tree: Any, where: str) -> None:
    """Raise :class:`ConsumedStateError` when a concrete leaf of the state ``tree`` was deleted
    (donated to an earlier call). Traced leaves are not checked (they cannot be deleted)."""
    path = consumed_leaf(tree)
    if path is None:
        return
    raise ConsumedStateError(
        f"{where}: this state was consumed by an earlier call (its leaf state{path} was donated "
        f"and deleted). {CONSUMED_FIX}, e.g. `state = rb.add(state, items)` and `sample, state = rb.sample(state, key)`. To keep "
        "an older state as well, copy it before the call: "
        "`saved = jax.tree_util.tree_map(jnp.copy, state)`."
    )


def checked_indices(indices: Any, capacity: int, *, where: str, fallback: str, clip: bool = False):
    """``(int32 indices, in_range bool)``, both the shape of ``indices``, after the policy for
    flat indices: integer dtype (``TypeError``), in ``[0, capacity)`` (``ValueError`` when
    concrete). The range is checked in the indices' own dtype, before the int32 cast: NumPy
    and Python inputs are read as given (an int64 ``2**32 + 3`` is out of range, not item 3),
    so are traced int64 indices under ``jax_enable_x64``. Out-of-range entries come back as 0
    (``clip``: clipped into ``[0, capacity)``) with ``in_range`` False; ``fallback`` says what
    the caller does with them under jit.
    """
    if not isinstance(indices, jax.Array):
        indices = np.asarray(indices)
    if not np.issubdtype(indices.dtype, np.integer):
        raise TypeError(
            f"{where}: indices must be integers, got dtype {indices.dtype}; pass "
            "the indices of a Sample (sample.indices)."
        )
    in_range = (indices >= 0) & (indices < capacity)
    enforce(
        ~in_range,
        lambda i, n: (
            f"{where}: indices[{i}] = {int(np.asarray(indices).reshape(-1)[i])} is outside "
            f"[0, {capacity}) ({n} of {np.size(indices)}). Pass the indices of a Sample "
            f"(sample.indices); under jax.jit {fallback}."
        ),
    )
    xp = np if isinstance(indices, np.ndarray) else jnp
    out = xp.clip(indices, 0, capacity - 1) if clip else xp.where(in_range, indices, 0)
    return jnp.asarray(out.astype(np.int32)), jnp.asarray(in_range)


def describe_structure(tree: Any, limit: int = 12) -> str:
    """The leaf paths of ``tree``, as a list; at most ``limit`` of them, then how many more."""
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    more = len(paths) - limit
    return "[" + ", ".join(paths[:limit]) + (f", ... {more} more" if more > 0 else "") + "]"


def shape_mismatch(rows) -> str | None:
    """The first row whose array does not have its expected shape, as a sentence (None if all
    do). ``rows``: ``(path, array, expected shape, whole shape (True) or leading dimensions
    only (False), why)``; ``why`` ends the sentence (e.g. ``" (capacity=8)"``)."""
    for path, x, want, whole, why in rows:
        shape = tuple(np.shape(x))
        if (shape != want) if whole else (shape[: len(want)] != want):
            what = f"shape {want}" if whole else f"leading dimension {want[0]}"
            return f"{path} has shape {shape}, expected {what}{why}"
    return None


# ------------------------------------------------------------------------------ configuration


def _wanted(kind: str, minimum, maximum, none_ok: bool, strict: bool) -> str:
    rel = ">" if strict else ">="
    if minimum is not None and maximum is not None:
        what = f"{kind} in [{minimum}, {maximum}]"
    elif minimum is not None:
        what = f"{kind} {rel} {minimum}"
    elif maximum is not None:
        what = f"{kind} <= {maximum}"
    else:
        what = kind
    return what + (" or None" if none_ok else "")


# for type checkers: an int unless none_ok=True
@overload
def config_int(
    where: str,
    name: str,
    value: Any,
    *,
    minimum: int | None = 1,
    maximum: int | None = None,
    none_ok: Literal[False] = False,
    fix: str = "",
) -> int: ...
@overload
def config_int(
    where: str,
    name: str,
    value: Any,
    *,
    minimum: int | None = 1,
    maximum: int | None = None,
    none_ok: bool,
    fix: str = "",
) -> int | None: ...


def config_int(
    where: str,
    name: str,
    value: Any,
    *,
    minimum: int | None = 1,
    maximum: int | None = None,
    none_ok: bool = False,
    fix: str = "",
) -> int | None:
    """``value`` as a Python int in ``[minimum, maximum]`` (or None when ``none_ok``).

    Raises :class:`ArgumentTypeError` for a non-integer (bools included; a traced value gets
    the hint to mark it static) and ``ValueError`` out of range, both naming ``where`` and
    ``name``; ``fix`` is appended to either message."""
    if value is None and none_ok:
        return None
    wanted = _wanted("a Python int", minimum, maximum, none_ok, False)
    tail = f" {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if is_traced(value):
            tail += (
                f" Under jax.jit pass it as a static argument, e.g. "
                f"jax.jit(f, static_argnames={name!r})."
            )
        raise ArgumentTypeError(
            f"{where}: {name} must be {wanted}, got {value!r} ({type(value).__name__}).{tail}"
        )
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{where}: {name} must be {wanted}, got {value}.{tail}")
    return int(value)


def config_number(
    where: str,
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict: bool = False,
    finite: bool = True,
    fix: str = "",
) -> float:
    """``value`` as a Python float in ``[minimum, maximum]`` (``(minimum, ...`` when
    ``strict``); NaN is always refused, infinities unless ``finite=False``. Errors as
    :func:`config_int`."""
    kind = "a finite Python number" if finite else "a Python number"
    wanted = _wanted(kind, minimum, maximum, False, strict)
    tail = f" {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(
            f"{where}: {name} must be {wanted}, got {value!r} ({type(value).__name__}).{tail}"
        )
    value = float(value)
    bad = (
        value != value
        or (finite and value in (float("inf"), float("-inf")))
        or (minimum is not None and (value < minimum or (strict and value == minimum)))
        or (maximum is not None and value > maximum)
    )
    if bad:
        raise ValueError(f"{where}: {name} must be {wanted}, got {value!r}.{tail}")
    return value
