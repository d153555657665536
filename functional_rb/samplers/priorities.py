"""Priorities, as both prioritized samplers use them (Schaul et al., 2016).

One component, :class:`Prioritization`, holds the rules that :class:`~functional_rb.
PrioritizedSampler` (items) and :class:`~functional_rb.PrioritizedSliceSampler` (slice starts)
share:

* the stored value of a priority ``p``: ``v = min((p + eps) ** alpha, value_max(C))``;
* new items get the value of the largest priority seen so far (``max_priority``, starting at
  ``max_priority_init``);
* ``update`` follows the library's error policy (:mod:`functional_rb._internal.errors`): an index
  outside ``[0, C)`` (checked in the index's own dtype, before any int32 cast) or a priority
  that is NaN, infinite or negative raises ``ValueError`` eagerly and is ignored under ``jit``
  (the item keeps its priority); indices of slots that hold no item are ignored;
* importance weights ``w_i = (N P(i)) ** -beta / max_j (N P(j)) ** -beta``, which is
  ``(min_j v_j / v_i) ** beta`` over the drawable elements.

The clamp: a sum tree over ``C`` leaves holds their float32 sum, so each value is clamped to
``value_max(C) = finfo(float32).max / (2 C)``: the total stays finite whatever the priorities
(3e38 at ``alpha=1`` included), so sampling stays proportional among the other items and new
items keep a finite value. Priorities whose values reach the clamp are drawn equally often.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import checked_indices, concrete_or_none, config_number, enforce
from functional_rb.protocol import Layout

_F32_MAX = float(np.finfo(np.float32).max)


def value_max(capacity: int) -> float:
    """The largest value a priority is stored as in a tree over ``capacity`` leaves:
    ``finfo(float32).max / (2 * capacity)``, so any sum of stored values is finite."""
    return _F32_MAX / (2.0 * capacity)


def _number(owner: str, name: str, value, *, minimum: float, strict: bool = False) -> float:
    return config_number(owner, name, value, minimum=minimum, strict=strict)


class Updates(NamedTuple):
    """An ``update`` batch after the policy: flat, deduplicated where asked.

    indices: int32 ``[N]``: the positions to set, ``C`` (out of range) for ignored entries.
    values: float32 ``[N]``: the stored values ``min((p + eps) ** alpha, value_max(C))``.
    accepted: bool ``[N]``: the entry is applied (valid index of a stored item, valid
      priority).
    max_priority: float32 ``[]``: the new running maximum of raw priorities.
    """

    indices: jax.Array
    values: jax.Array
    accepted: jax.Array
    max_priority: jax.Array


@dataclasses.dataclass(frozen=True)
class Prioritization:
    """The priority rules of a prioritized sampler (see the module docstring).

    ``owner`` names the sampler in error messages. Validation: ``alpha``, ``beta``, ``eps``
    finite and >= 0, ``max_priority_init`` finite and > 0.
    """

    owner: str
    alpha: float
    beta: float
    eps: float
    max_priority_init: float

    def __post_init__(self):
        for name, strict in (
            ("alpha", False),
            ("beta", False),
            ("eps", False),
            ("max_priority_init", True),
        ):
            object.__setattr__(
                self,
                name,
                _number(self.owner, name, getattr(self, name), minimum=0.0, strict=strict),
            )

    @classmethod
    def settle(cls, sampler, owner: str) -> Prioritization:
        """The rules of ``sampler`` (a frozen dataclass with ``alpha``, ``beta``, ``eps`` and
        ``max_priority_init``), checked; the checked numbers are written back into it (what
        every prioritized sampler's ``__post_init__`` does).

        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class S:
        ...     alpha: float = 1
        ...     beta: float = 0.5
        ...     eps: float = 0
        ...     max_priority_init: float = 1
        >>> s = S()
        >>> Prioritization.settle(s, "S").alpha, type(s.alpha).__name__
        (1.0, 'float')
        """
        prio = cls(owner, sampler.alpha, sampler.beta, sampler.eps, sampler.max_priority_init)
        for name in ("alpha", "beta", "eps", "max_priority_init"):
            object.__setattr__(sampler, name, getattr(prio, name))
        return prio

    # ------------------------------------------------------------------ values
    def value(self, p: jax.Array, capacity: int) -> jax.Array:
        """float32: the stored value of raw priorities ``p`` (finite, >= 0)."""
        v = (jnp.asarray(p, jnp.float32) + jnp.float32(self.eps)) ** jnp.float32(self.alpha)
        return jnp.minimum(v, jnp.float32(value_max(capacity)))

    def initial_max(self) -> jax.Array:
        """float32 ``[]``: the running maximum a new state starts with."""
        return jnp.float32(self.max_priority_init)

    def new_value(self, max_priority: jax.Array, capacity: int) -> jax.Array:
        """float32 ``[]``: the value new items get."""
        return self.value(max_priority, capacity)

    # ------------------------------------------------------------------ update
    def updates(
        self,
        indices,
        priorities,
        layout: Layout,
        filled: jax.Array,
        max_priority: jax.Array,
        *,
        where: str,
        keep=None,
    ) -> Updates:
        """Apply the update policy to ``indices`` (any integer dtype, any shape) and
        ``priorities`` (real, the shape of ``indices`` or a scalar).

        ``keep``: bool, the shape of ``indices``: entries to drop silently before the checks
        (a slice's padding). Duplicates are resolved by the caller (``sum_tree.set``: the last
        occurrence wins). Raises eagerly per the error policy; under jit bad entries come back
        with ``accepted`` False.
        """
        cap = layout.capacity
        pos, in_range = checked_indices(
            indices, cap, where=where, fallback="out-of-range indices are ignored"
        )
        if not isinstance(priorities, jax.Array):
            priorities = np.asarray(priorities)
            if priorities.dtype.kind == "f":  # finite float64 beyond float32 stays finite
                with np.errstate(invalid="ignore"):
                    priorities = np.where(
                        np.isfinite(priorities), np.minimum(priorities, _F32_MAX), priorities
                    )
        priorities = jnp.asarray(priorities)
        if not (
            jnp.issubdtype(priorities.dtype, jnp.floating)
            or jnp.issubdtype(priorities.dtype, jnp.integer)
        ):
            raise TypeError(
                f"{where}: priorities must be real numbers, got dtype {priorities.dtype}."
            )
        if priorities.shape != pos.shape:
            if priorities.ndim:
                raise ValueError(
                    f"{where}: priorities have shape {priorities.shape}, expected the shape "
                    f"of indices {pos.shape} (or a scalar): one priority per index."
                )
            priorities = jnp.broadcast_to(priorities, pos.shape)
        pos, in_range, p = pos.reshape(-1), in_range.reshape(-1), priorities.reshape(-1)
        keep = jnp.ones(pos.shape, bool) if keep is None else jnp.asarray(keep).reshape(-1)
        finite = (
            jnp.isfinite(p) if jnp.issubdtype(p.dtype, jnp.floating) else jnp.ones(p.shape, bool)
        )
        good = finite & (p >= 0)
        enforce(
            keep & ~good,
            lambda i, n: (
                f"{where}: priorities[{i}]"
                + (
                    f" (storage index {int(np.asarray(pos)[i])})"
                    if concrete_or_none(pos) is not None
                    else ""
                )
                + f" = {float(np.asarray(p)[i])!r} is not a finite number >= 0 ({n} bad of "
                f"{p.shape[0]}). Priorities must be finite and >= 0, e.g. jnp.abs(td_error); under "
                "jax.jit a bad priority is ignored (the item keeps its priority)."
            ),
        )
        _, t = layout.from_flat(pos)
        accepted = keep & in_range & good & (t < filled)
        # huge finite priorities (also float64 ones beyond float32) stay finite before the cast
        p32 = jnp.where(good, jnp.minimum(p, _F32_MAX), 0).astype(jnp.float32)
        seen = jnp.max(jnp.where(accepted, p32, 0.0), initial=0.0)
        return Updates(
            indices=jnp.where(accepted, pos, jnp.int32(cap)),
            values=self.value(p32, cap),
            accepted=accepted,
            max_priority=jnp.maximum(max_priority, seen),
        )

    # ------------------------------------------------------------------ sampling
    def beta_for(self, beta, *, where: str) -> jax.Array:
        """float32 ``[]``: ``beta`` for one call (None: the configured one). Not a finite
        number >= 0: eagerly ``ValueError``, under jit the configured beta."""
        if beta is None:
            return jnp.float32(self.beta)
        b = jnp.asarray(beta, jnp.float32)
        if b.ndim:
            raise ValueError(f"{where}: beta must be a scalar, got shape {b.shape}.")
        bad = ~jnp.isfinite(b) | (b < 0)
        enforce(
            bad,
            lambda i, n: (
                f"{where}: beta must be a finite scalar >= 0, got {beta!r}; "
                "under jax.jit the sampler's beta is used instead."
            ),
        )
        return jnp.where(bad, jnp.float32(self.beta), b)

    @staticmethod
    def weights(v: jax.Array, vmin: jax.Array, beta: jax.Array, ok: jax.Array) -> jax.Array:
        """float32: importance weights ``(vmin / v) ** beta`` of drawn values ``v`` (0 where
        not ``ok``); ``vmin``: the smallest positive value among the drawable elements."""
        ratio = jnp.where(ok, vmin / jnp.where(ok, v, 1.0), 0.0)
        return jnp.where(ok, ratio**beta, 0.0).astype(jnp.float32)
