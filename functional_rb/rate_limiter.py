"""Rate limiting for actor/learner setups: Reverb's samples-per-insert ratio as pure functions.

An actor adds items while a learner samples them. Left alone the two drift apart: a fast
learner replays each item hundreds of times (overfitting), a fast actor fills the buffer with
items that are never replayed. Reverb's ``SampleToInsertRatio`` keeps the two in step with the
*error*::

    error = inserts * samples_per_insert - samples

(items inserted and items sampled so far). With ``ReplayBuffer(..., rate_limiter=limiter)``
the counters live in the buffer state (``state.limiter``, a :class:`RateLimiterState`) and are
advanced by ``add`` (the items passed) and ``sample`` (the batch size, when a batch could be
drawn); ``rb.can_sample(state)`` and ``rb.can_insert(state, num_items)`` then answer Reverb's
questions, as bool scalars, jittable:

* ``can_insert(n)``: True while the buffer holds at most ``min_size_to_sample`` items after
  the insert (stage 1: filling up); afterwards, when ``error + n * samples_per_insert <=
  max_diff``.
* ``can_sample(n)``: False while fewer than ``min_size_to_sample`` items are stored;
  afterwards, when ``error - n >= min_diff``.

``error_buffer`` sets ``(min_diff, max_diff)``: a number ``e`` means ``min_size_to_sample *
samples_per_insert -/+ e`` (centred on where sampling begins, as in Reverb), a pair is used
as is. Nothing blocks: ``add`` and ``sample`` always run and count; the caller asks first and
waits, skips or does other work (``lax.cond(rb.can_sample(state), learn, skip)`` inside a
jitted loop, a condition variable between threads in ``examples/actor_learner.py``). A
sharded buffer answers for the union of its shards (global counts).

Exactness. Counters are int32 and wrap after 2**31 items, but only the error is used, and it
is computed exactly in wrapping int32 arithmetic as ``inserts * p - samples * q`` with
``samples_per_insert = p / q`` (a ratio of integers, ``q <= 1000``): exact as long as
``|error| < 2**31 / q``, which holds whenever the limiter is honoured (the error stays in
``[min_diff - batch, max_diff + add]``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import config_int, config_number
from functional_rb._internal.names import stable

_MAX_DENOMINATOR = 1000

__all__ = ("RateLimiter", "RateLimiterState")


@stable("RateLimiterState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RateLimiterState:
    """The counters of a :class:`RateLimiter` (in ``BufferState.limiter``)."""

    inserts: jax.Array  # int32 []: items inserted so far (wraps modulo 2**32)
    samples: jax.Array  # int32 []: items sampled so far (wraps modulo 2**32)


def _real(name: str, value) -> float:
    return config_number("RateLimiter", name, value, finite=False)


@dataclasses.dataclass(frozen=True)
class RateLimiter:
    """Keep ``samples / inserts`` near ``samples_per_insert`` (Reverb's ``SampleToInsertRatio``).

    Args:
      samples_per_insert: how many times each item is sampled on average over its life
        (> 0; a ratio ``p / q`` of integers with ``q <= 1000``, e.g. ``0.25``, ``8``, ``1/3``).
      min_size_to_sample: items that must be stored before anything is sampled (>= 1).
      error_buffer: how far the error may stray: a number ``e`` (the window ``min_size_to_sample
        * samples_per_insert -/+ e``) or a pair ``(min_diff, max_diff)``. The window must be
        at least ``2 * max(1, samples_per_insert)`` wide and must not start above
        ``min_size_to_sample * samples_per_insert`` (both would block forever, as in Reverb);
        a buffer also requires it to hold one sample batch (see :meth:`validate`).

    Frozen and hashable; its methods are pure functions of a :class:`RateLimiterState`.
    """

    samples_per_insert: float
    min_size_to_sample: int
    error_buffer: float | tuple

    def __post_init__(self):
        spi = _real("samples_per_insert", self.samples_per_insert)
        if not (math.isfinite(spi) and spi > 0):
            raise ValueError(
                f"RateLimiter: samples_per_insert must be finite and > 0, got "
                f"{self.samples_per_insert!r}."
            )
        ratio = Fraction(spi).limit_denominator(_MAX_DENOMINATOR)
        if abs(float(ratio) - spi) > 1e-9 * max(1.0, spi):
            raise ValueError(
                f"RateLimiter: samples_per_insert={spi!r} is not a ratio p/q of integers with "
                f"q <= {_MAX_DENOMINATOR} (the error is kept exactly in integers); the nearest "
                f"is {ratio.numerator}/{ratio.denominator} = {float(ratio)!r}: pass that."
            )
        m = self.min_size_to_sample
        config_int("RateLimiter", "min_size_to_sample", m)
        eb = self.error_buffer
        if isinstance(eb, (tuple, list)):
            if len(eb) != 2:
                raise ValueError(
                    f"RateLimiter: error_buffer must be a number or a pair "
                    f"(min_diff, max_diff), got {eb!r}."
                )
            lo, hi = _real("error_buffer[0]", eb[0]), _real("error_buffer[1]", eb[1])
            eb = (lo, hi)
        else:
            e = _real("error_buffer", eb)
            if e < 0:
                raise ValueError(f"RateLimiter: error_buffer must be >= 0, got {e!r}.")
            lo, hi = m * spi - e, m * spi + e
            eb = e
        if hi - lo < 2 * max(1.0, spi):
            raise ValueError(
                f"RateLimiter: the error window [{lo}, {hi}] is narrower than 2 * max(1, "
                f"samples_per_insert) = {2 * max(1.0, spi)}: inserts and samples could both be "
                "blocked forever. Use a larger error_buffer."
            )
        if lo > m * spi:
            raise ValueError(
                f"RateLimiter: the error window starts at min_diff={lo}, above "
                f"min_size_to_sample * samples_per_insert = {m * spi}: sampling would be "
                "blocked forever once min_size_to_sample items are stored. Lower min_diff."
            )
        object.__setattr__(self, "samples_per_insert", spi)
        object.__setattr__(self, "min_size_to_sample", int(m))
        object.__setattr__(self, "error_buffer", eb)

    # ------------------------------------------------------------------ static facts
    @property
    def ratio(self) -> tuple[int, int]:
        """``(p, q)``: ``samples_per_insert == p / q`` in lowest terms."""
        r = Fraction(self.samples_per_insert).limit_denominator(_MAX_DENOMINATOR)
        return r.numerator, r.denominator

    @property
    def min_diff(self) -> float:
        eb = self.error_buffer
        return (
            eb[0]
            if isinstance(eb, tuple)
            else (self.min_size_to_sample * self.samples_per_insert - eb)
        )

    @property
    def max_diff(self) -> float:
        eb = self.error_buffer
        return (
            eb[1]
            if isinstance(eb, tuple)
            else (self.min_size_to_sample * self.samples_per_insert + eb)
        )

    def validate(self, *, batch_size: int, where: str = "ReplayBuffer") -> None:
        """Raise ``ValueError`` when a batch of ``batch_size`` items (a Python int) cannot fit
        in the error window together with one inserted item: a loop that asks ``can_sample``
        and ``can_insert`` could then find both False forever."""
        need = batch_size + self.samples_per_insert
        if self.max_diff - self.min_diff < need:
            raise ValueError(
                f"{where}: the rate limiter's error window [{self.min_diff}, {self.max_diff}] "
                f"is narrower than one sample batch plus one insert ({batch_size} + "
                f"{self.samples_per_insert} = {need}), so sampling and inserting could both be "
                f"blocked forever. Use error_buffer >= {need / 2} (or a window of at least "
                f"batch_size + samples_per_insert * items per add)."
            )

    # ------------------------------------------------------------------ state
    def init(self) -> RateLimiterState:
        """Counters at zero."""
        return RateLimiterState(inserts=jnp.int32(0), samples=jnp.int32(0))

    def on_insert(self, state: RateLimiterState, count) -> RateLimiterState:
        """``state`` after ``count`` items (int, may be traced) were inserted."""
        return dataclasses.replace(state, inserts=state.inserts + jnp.asarray(count, jnp.int32))

    def on_sample(self, state: RateLimiterState, count) -> RateLimiterState:
        """``state`` after ``count`` items (int, may be traced) were sampled."""
        return dataclasses.replace(state, samples=state.samples + jnp.asarray(count, jnp.int32))

    # ------------------------------------------------------------------ questions
    def _error_q(self, state: RateLimiterState) -> jax.Array:
        """int32 ``[]``: ``q * error`` (exact while it fits in int32: see the module)."""
        p, q = self.ratio
        return state.inserts * jnp.int32(p) - state.samples * jnp.int32(q)

    def error(self, state: RateLimiterState) -> jax.Array:
        """float32 ``[]``: ``inserts * samples_per_insert - samples``."""
        return self._error_q(state).astype(jnp.float32) / jnp.float32(self.ratio[1])

    def can_sample(self, state: RateLimiterState, size, num_samples) -> jax.Array:
        """bool ``[]``: whether ``num_samples`` items may be sampled from a buffer holding
        ``size`` items (int32 ``[]``)."""
        q = self.ratio[1]
        after = self._error_q(state) - jnp.asarray(num_samples, jnp.int32) * jnp.int32(q)
        return (jnp.asarray(size, jnp.int32) >= self.min_size_to_sample) & (
            after.astype(jnp.float32) >= jnp.float32(self.min_diff * q)
        )

    def can_insert(self, state: RateLimiterState, size, num_items) -> jax.Array:
        """bool ``[]``: whether ``num_items`` items may be inserted into a buffer holding
        ``size`` items (int32 ``[]``)."""
        p, q = self.ratio
        n = jnp.asarray(num_items, jnp.int32)
        after = self._error_q(state) + n * jnp.int32(p)
        filling = jnp.asarray(size, jnp.int32) + n <= self.min_size_to_sample
        return filling | (after.astype(jnp.float32) <= jnp.float32(self.max_diff * q))


def check_state(limiter, state, where: str) -> None:
    """Raise ``TypeError`` unless ``state`` (``BufferState.limiter``) belongs to ``limiter``
    (a :class:`RateLimiter` or None): static facts only, free under jit."""
    if limiter is None:
        return
    if not isinstance(state, RateLimiterState):
        raise TypeError(
            f"{where}: this buffer has a rate limiter but state.limiter is "
            f"{type(state).__name__}: the state was built by a buffer without one. Build the "
            "state with this buffer's init (rb.init(example))."
        )


# ---------------------------------------------------------------------------------------------
# What ReplayBuffer calls: one line each there; ``limiter`` None means no rate limiter.
def check_buffer(limiter, *, batch_size: int) -> None:
    """Raise unless ``limiter`` (a ``ReplayBuffer``'s ``rate_limiter``) is None or a
    :class:`RateLimiter` whose window holds a batch of ``batch_size``."""
    if limiter is None:
        return
    if not isinstance(limiter, RateLimiter):
        raise TypeError(
            f"ReplayBuffer: rate_limiter must be a frb.RateLimiter or None, got "
            f"{limiter!r}; e.g. frb.RateLimiter(samples_per_insert=4.0, "
            "min_size_to_sample=1000, error_buffer=2000)."
        )
    limiter.validate(batch_size=batch_size)


def init(limiter):
    """The counters of a new state (None without a limiter)."""
    return None if limiter is None else limiter.init()


def inserted(limiter, state, count):
    """``state`` (``BufferState.limiter``) after ``count`` items were added."""
    return state if limiter is None else limiter.on_insert(state, count)


def sampled(limiter, state, count):
    """``state`` after ``count`` items (int32, may be traced) were sampled."""
    return state if limiter is None else limiter.on_sample(state, count)


def allows_sample(limiter, state, size, num_samples) -> jax.Array:
    """bool ``[]``: the limiter lets ``num_samples`` items be sampled (True without one)."""
    return jnp.bool_(True) if limiter is None else limiter.can_sample(state, size, num_samples)


def allows_insert(limiter, state, size, num_items) -> jax.Array:
    """bool ``[]``: the limiter lets ``num_items`` items be inserted (True without one)."""
    return jnp.bool_(True) if limiter is None else limiter.can_insert(state, size, num_items)
