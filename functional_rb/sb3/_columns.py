"""SB3's array attributes (``rb.dones``, ``rb.observations``, ...) over the core buffer.

SB3 users, its tests and SB3 itself write into these arrays (``_setup_learn`` marks the newest
step done: ``replay_buffer.dones[pos] = True``). Here the data lives in the core buffer, so an
attribute is a copy in SB3's layout ``[buffer_size, n_envs, ...]`` whose item assignments are
written through to the core: the rows a ``column[key] = value`` touches are sent back whole.
Views of it (``rb.dones[3]``) are read-only, since a write into one would be lost; NumPy
operations on it give plain arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class Column(np.ndarray):
    """A copy of one stored field; ``column[key] = value`` also calls
    ``sink(t, env, rows)`` with the touched ``(t, env)`` pairs and their new values."""

    _sink: Callable | None
    _derived: bool  # a view or slice of a column: a write into it would be lost

    def __new__(cls, data: np.ndarray, sink: Callable) -> Column:
        obj = np.array(data).view(cls)
        obj._sink, obj._derived = sink, False
        return obj

    def __array_finalize__(self, obj) -> None:
        # (NumPy's own assignment into a column goes through such views in C: they must
        # stay writeable, so a user's write into one is refused in __setitem__ instead)
        self._sink, self._derived = None, isinstance(obj, Column)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = tuple(x.view(np.ndarray) if isinstance(x, Column) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, Column) else x for x in kwargs["out"]
            )
        return getattr(ufunc, method)(*plain, **kwargs)

    def __setitem__(self, key, value) -> None:
        if self._derived:
            raise ValueError(
                "functional_rb.sb3: this array is a view of a buffer attribute, and a write "
                "into it would not reach the buffer; index the attribute itself "
                "(rb.dones[t, env] = x, not rb.dones[t][env] = x)."
            )
        super().__setitem__(key, value)
        if self._sink is None:
            return
        touched = np.zeros(self.shape, bool)
        touched[key] = True
        t, env = np.nonzero(touched.reshape(*self.shape[:2], -1).any(axis=-1))
        self._sink(t, env, self.view(np.ndarray)[t, env])

    def __reduce__(self):  # pickles (and copies) as the plain array it holds
        return np.array, (self.view(np.ndarray),)
