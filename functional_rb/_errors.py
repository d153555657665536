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

========================================  ==========================  ===========================
value                                     eagerly                     under ``jit``
========================================  ==========================  ===========================
``key`` not one PRNG key; items, states   ``TypeError`` /             the same, at trace time
or arguments of the wrong structure,      ``ValueError``
shape or dtype
``update`` index outside ``[0, C)``       ``ValueError``              entry ignored (checked in
(any integer dtype: checked before the                                its own dtype, so 2**32+3
int32 cast, so it never aliases)                                      never becomes item 3)
``update`` index of an empty slot         ignored                     ignored
``update`` priority NaN, inf or < 0       ``ValueError``              entry ignored (the item
                                                                      keeps its priority)
priority whose ``(p + eps) ** alpha``     clamped to                  clamped (the same)
exceeds ``priorities.value_max(C)``       ``value_max(C)``
``beta`` not a finite number >= 0         ``ValueError``              the sampler's ``beta``
``get`` index outside ``[0, C)``          ``ValueError``              clipped into ``[0, C)``
``add``: integer values outside the       ``OverflowError``           wraps like a C cast (that
stored dtype's range                                                  value only)
``sample`` when nothing can be drawn      ``ValueError``              ``mask`` False, weights 0
``TEDStorage`` side table overflow        ``ValueError``              ``state.storage.lost``
                                                                      counts it (see TEDStorage)
========================================  ==========================  ===========================

:func:`enforce` is the one implementation of the "eagerly raise, under jit fall back" rule:
a caller computes the boolean mask of bad entries, calls ``enforce`` (which raises when the
mask is concrete and any entry is bad) and then applies its fallback with that same mask, so
the eager and the jitted call run the same code.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def enforce(bad: Any, message) -> None:
    """Raise ``ValueError(message(i, n))`` when the bool array ``bad`` is concrete and has a
    True entry (``i``: the first one, flat; ``n``: how many); do nothing when it is traced or
    all False. The caller then applies its documented fallback to the entries ``bad`` marks.
    ``message`` is only called to raise, so building it costs nothing otherwise."""
    b = concrete_or_none(bad)
    if b is None or not b.any():
        return
    flat = b.reshape(-1)
    raise ValueError(message(int(np.argmax(flat)), int(flat.sum())))


def checked_indices(indices: Any, capacity: int, *, where: str, fallback: str,
                    clip: bool = False):
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
        raise TypeError(f"{where}: indices must be integers, got dtype {indices.dtype}; pass "
                        "the indices of a Sample (sample.indices).")
    in_range = (indices >= 0) & (indices < capacity)
    enforce(~in_range, lambda i, n: (
        f"{where}: indices[{i}] = {int(np.asarray(indices).reshape(-1)[i])} is outside "
        f"[0, {capacity}) ({n} of {np.size(indices)}). Pass the indices of a Sample "
        f"(sample.indices); under jax.jit {fallback}."))
    xp = np if isinstance(indices, np.ndarray) else jnp
    out = xp.clip(indices, 0, capacity - 1) if clip else xp.where(in_range, indices, 0)
    return jnp.asarray(out.astype(np.int32)), jnp.asarray(in_range)


def describe_structure(tree: Any) -> str:
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return "[" + ", ".join(paths) + "]"


def shape_mismatch(rows) -> str | None:
    """The first row whose array does not have its expected shape, as a sentence (None if all
    do). ``rows``: ``(path, array, expected shape, whole shape (True) or leading dimensions
    only (False), why)``; ``why`` ends the sentence (e.g. ``" (capacity=8)"``)."""
    for path, x, want, whole, why in rows:
        shape = tuple(np.shape(x))
        if (shape != want) if whole else (shape[:len(want)] != want):
            what = f"shape {want}" if whole else f"leading dimension {want[0]}"
            return f"{path} has shape {shape}, expected {what}{why}"
    return None
