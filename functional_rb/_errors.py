"""Error helpers: every message names the function, the leaf path, what was expected and what
was received, and how to fix it (in the manner of chex/equinox)."""
from __future__ import annotations

from typing import Any

import jax
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
