"""The ``span`` argument of the slice samplers, checked without JAX (the adapters' NumPy slice
samplers share it with the core's)."""

from __future__ import annotations

import numpy as np

__all__ = ("normalize_span",)


def normalize_span(name: str, span) -> tuple:
    """``span`` as a ``(left, right)`` pair of bools / non-negative ints."""
    pair = tuple(span) if isinstance(span, (tuple, list)) else (span, span)
    ok = len(pair) == 2 and all(
        isinstance(v, (bool, int, np.integer)) and (isinstance(v, bool) or v >= 0) for v in pair
    )
    if not ok:
        raise TypeError(
            f"{name}: span must be a bool, a non-negative int or a (left, right) "
            f"pair of those, got span={span!r}."
        )
    return tuple(v if isinstance(v, bool) else int(v) for v in pair)
