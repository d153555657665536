"""Staleness-aware sampling: fresher items are drawn more often, too-stale items never.

For asynchronous on-policy training (async PPO, off-policy-corrected actor-learner loops), where
the items in a buffer were collected by older versions of the policy. Every item carries the
version of the policy that collected it (an entry of the stored items, ``version_key``); the
learner's own version, the *consumer version*, lives in the sampler state. An item's staleness
is ``consumer_version - version``. TorchRL's ``StalenessAwareSampler`` with the same rules:

* **Hard gate.** With ``max_staleness >= 0`` an item whose staleness exceeds it is never drawn.
* **Freshness weights.** The other stored items are drawn with probability proportional to
  ``staleness_weight_fn(staleness)`` (default ``1 / (staleness + 1)``).
* **Batches of distinct items when possible.** When at least ``batch_size`` items can be drawn
  a batch holds each at most once, drawn one after the other, each with probability
  proportional to its weight among those not yet drawn (what ``torch.multinomial(...,
  replacement=False)`` does; here the exponential race, ``E_i / w_i`` smallest first with
  ``E_i`` independent standard exponentials, which has exactly that law). When
  fewer can be drawn the batch is drawn with replacement, each entry independently.

The consumer version is state, not configuration, so that a jitted training step advances it
without retracing::

    rb = frb.ReplayBuffer(capacity, sampler=frb.StalenessAwareSampler(max_staleness=4))
    state = rb.init({"obs": jnp.zeros(3), "policy_version": jnp.int32(0)})
    state = rb.add(state, batch)                        # batch["policy_version"]: [B]
    state = rb.sampler.set_consumer_version(state, step)   # pure: a new state
    sample, state = rb.sample(state, key)

Nothing is maintained incrementally: every ``sample`` recomputes the weights of all ``C``
positions from the stored versions (``O(C)``, as TorchRL does), so changing the consumer
version costs nothing.

Under ``jax.jit`` (the error policy of :mod:`functional_rb._internal.errors`): when no stored item is
within ``max_staleness`` (or none has a positive weight) ``can_sample`` is False, so an eager
``rb.sample`` raises ``ValueError`` and a jitted one returns ``mask`` all False and weights 0.
A weight that is NaN, infinite or negative (the default weight of an item *newer* than the
consumer version, staleness ``<= -1``: the consumer version was not advanced) raises
``ValueError`` eagerly, naming the item; under ``jit`` that item is not drawn.

Weights in :class:`~functional_rb.Sample` are 1 (0 where masked): freshness weighting is a
choice of which data to learn from, not a bias to correct (TorchRL returns none either).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import config_int, describe_structure, enforce
from functional_rb._internal.names import stable
from functional_rb._internal.random import bits32, uniform01
from functional_rb._internal.tree import Key, get_key, has_key, normalize_key
from functional_rb.protocol import BufferState, Context, Drawn, Layout, Sampler

__all__ = ("StalenessAwareSampler", "StalenessState", "default_staleness_weight")

_NAME = "StalenessAwareSampler"


def default_staleness_weight(staleness: jax.Array) -> jax.Array:
    """The default freshness weight: ``1 / (staleness + 1)`` (float32 ``[C]`` -> float32
    ``[C]``); 1 for the freshest items, 1/2 one version behind, and so on."""
    return 1.0 / (staleness + 1.0)


@stable("StalenessState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StalenessState:
    versions: jax.Array  # int32 or float32 [C]: the policy version of the item at each
    #                              flat position (0 where none is stored); int32 when the
    #                              stored version entry is an integer, else float32
    consumer_version: jax.Array  # same dtype, []: the learner's version (starts at 0)


@dataclasses.dataclass(frozen=True)
class StalenessAwareSampler(Sampler):
    """Draws items weighted by freshness and never items staler than ``max_staleness``
    (TorchRL's ``StalenessAwareSampler``; the rules are in :mod:`functional_rb.samplers.staleness`).

    Args:
      max_staleness: a Python int; items with ``staleness > max_staleness`` are never drawn.
        ``-1`` (default): no limit.
      staleness_weight_fn: ``float32 [C] -> float32 [C]``, elementwise and traceable with
        ``jax.numpy`` (it runs inside the compiled sample); default
        :func:`default_staleness_weight`, ``1 / (staleness + 1)``. It must be hashable (a
        function is): it is part of the buffer's configuration.
      version_key: where the stored items keep the collecting policy's version: a key of the
        items (nested dicts: a tuple of keys). One number per item (shape ``()`` or ``(1,)``),
        integer or floating. Default ``"policy_version"``.

    State: :class:`StalenessState`. The consumer version changes only through the pure
    :meth:`set_consumer_version` / :meth:`increment_consumer_version`; :meth:`staleness` gives
    the staleness of drawn items (TorchRL's ``info["staleness"]``).
    """

    max_staleness: int = -1
    staleness_weight_fn: Callable | None = None
    version_key: Key = "policy_version"

    state_types = (StalenessState,)

    def __post_init__(self):
        m = self.max_staleness
        object.__setattr__(
            self,
            "max_staleness",
            config_int(_NAME, "max_staleness", m, minimum=-1, fix="Pass -1 for no limit."),
        )
        fn = self.staleness_weight_fn
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{_NAME}: staleness_weight_fn must be a function of a float32 "
                f"staleness array (or None for 1 / (staleness + 1)), got {fn!r}."
            )
        object.__setattr__(self, "version_key", normalize_key(self.version_key))

    @property
    def weight_fn(self) -> Callable:
        """The freshness weight function in use."""
        fn = self.staleness_weight_fn
        return default_staleness_weight if fn is None else fn

    # ------------------------------------------------------------------ state
    def init(self, item_spec, layout: Layout) -> StalenessState:
        """An empty state; checks that the items carry one version number each."""
        key = self.version_key
        if not has_key(item_spec, key):
            raise KeyError(
                f"{_NAME}.init: version_key={key!r} is not in the stored items, whose leaves are "
                f"{describe_structure(item_spec)}. Store the collecting policy's version with "
                "each item (e.g. {'obs': ..., 'policy_version': jnp.int32(v)}) or pass the key "
                "under which it is stored as version_key=."
            )
        spec = get_key(item_spec, key, where=f"{_NAME}.init")
        if not hasattr(spec, "shape"):
            raise ValueError(
                f"{_NAME}.init: version_key={key!r} is a sub-tree "
                f"{describe_structure(spec)}, not an array leaf."
            )
        if int(np.prod(spec.shape)) != 1:
            raise ValueError(
                f"{_NAME}.init: the versions under version_key={key!r} must be "
                f"one number per item (shape () or (1,)), got shape "
                f"{tuple(spec.shape)}."
            )
        dtype = _version_dtype(spec.dtype, key)
        return StalenessState(
            versions=jnp.zeros((layout.capacity,), dtype), consumer_version=jnp.zeros((), dtype)
        )

    def on_add(self, state: StalenessState, record, items, ctx: Context) -> StalenessState:
        """Record the version of every written item at its position (masked items: none)."""
        v = jnp.asarray(get_key(items, self.version_key, where=f"{_NAME}.on_add"))
        v = v.reshape(v.shape[0]).astype(state.versions.dtype)
        cap = ctx.layout.capacity
        pos = jnp.where(record.mask, record.positions, cap)  # out of range: dropped
        versions = state.versions.at[pos].set(v, mode="drop", unique_indices=True)
        return StalenessState(versions=versions, consumer_version=state.consumer_version)

    # ------------------------------------------------------------------ the consumer version
    def set_consumer_version(self, state: BufferState, version) -> BufferState:
        """``state`` with the consumer version set to ``version`` (an integer scalar, or a
        float when the stored versions are floats; may be traced). Pure: returns a new state."""
        sp = _own_state(state, "set_consumer_version")
        dtype = sp.consumer_version.dtype
        v = jnp.asarray(version)
        if (
            v.shape != ()
            or v.dtype == jnp.bool_
            or not (jnp.issubdtype(v.dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
        ):
            raise TypeError(
                f"{_NAME}.set_consumer_version: version must be a scalar "
                f"{'integer' if jnp.issubdtype(dtype, jnp.integer) else 'number'} (the stored "
                f"versions are {dtype}), got {v.dtype}{list(v.shape)}."
            )
        return dataclasses.replace(
            state, sampler=StalenessState(versions=sp.versions, consumer_version=v.astype(dtype))
        )

    def increment_consumer_version(self, state: BufferState) -> BufferState:
        """``state`` with the consumer version advanced by one (pure)."""
        sp = _own_state(state, "increment_consumer_version")
        return self.set_consumer_version(state, sp.consumer_version + 1)

    def staleness(self, state: BufferState, indices: jax.Array) -> jax.Array:
        """float32 ``indices.shape``: ``consumer_version - version`` of the items at flat
        ``indices`` (e.g. ``sample.indices``)."""
        sp = _own_state(state, "staleness")
        idx = jnp.clip(jnp.asarray(indices, jnp.int32), 0, sp.versions.shape[0] - 1)
        return (sp.consumer_version - sp.versions[idx]).astype(jnp.float32)

    # ------------------------------------------------------------------ weights
    def freshness(self, state: StalenessState, ctx: Context):
        """``(weights float32 [C], drawable bool [C], bad bool [C])`` over flat positions:
        the freshness weight of each stored item within the gate, whether it can be drawn
        (stored, within the gate, weight finite and > 0), and whether its weight is invalid
        (stored, within the gate, weight NaN, infinite or negative)."""
        cap = ctx.layout.capacity
        _, t = ctx.layout.from_flat(jnp.arange(cap, dtype=jnp.int32))
        stored = t < ctx.filled
        delta = state.consumer_version - state.versions  # exact for integer versions
        inside = stored
        if self.max_staleness >= 0:
            inside = inside & (delta <= self.max_staleness)
        s = delta.astype(jnp.float32)
        w = jnp.asarray(self.weight_fn(s))
        if w.shape != s.shape or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(
                f"{_NAME}: staleness_weight_fn must map a float32 array of shape {s.shape} to "
                f"float weights of the same shape (elementwise), got {w.dtype}{list(w.shape)}."
            )
        w = w.astype(jnp.float32)
        valid = jnp.isfinite(w) & (w >= 0)
        drawable = inside & valid & (w > 0)
        return jnp.where(drawable, w, 0.0), drawable, inside & ~valid

    def can_sample(self, state: StalenessState, ctx: Context, batch_size: int):
        del batch_size
        return jnp.any(self.freshness(state, ctx)[1])

    # ------------------------------------------------------------------ sample
    def sample(self, state: StalenessState, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
        """Draw ``batch_size`` flat positions (see the module docstring for the law).
        Returns ``Drawn(indices int32 [B], weights float32 [B], mask bool [B])``."""
        w, drawable, bad = self.freshness(state, ctx)
        enforce(bad, lambda i, n: _bad_weight_message(state, i, n, self))
        n = jnp.sum(drawable, dtype=jnp.int32)
        distinct, repeated = _draws(batch_size)
        if batch_size > w.shape[0]:  # never n >= batch_size
            idx = repeated(key, w, drawable, n)
        else:
            idx = jax.lax.cond(n >= batch_size, distinct, repeated, key, w, drawable, n)
        ok = jnp.broadcast_to(n > 0, (batch_size,))
        return Drawn(idx, ok.astype(jnp.float32), ok), state


@functools.cache
def _draws(batch_size: int) -> tuple:
    """The two branches for ``batch_size`` (the same objects each call: an eager ``lax.cond``
    then reuses its compiled branches)."""
    return (
        functools.partial(_distinct_draws, batch_size),
        functools.partial(_repeated_draws, batch_size),
    )


def _distinct_draws(batch_size: int, key, w, drawable, n):
    """int32 ``[B]`` distinct positions, successively weighted (needs ``n >= B``): the ``B``
    smallest of ``E_i / w_i`` with ``E_i`` standard exponential, in increasing order (the
    exponential race, equivalently Gumbel-top-k; one logarithm per position)."""
    del n
    # E = -log1p(-v), v from 32 random bits: the small E that decide the batch are resolved
    # to ~2**-32 (a 23-bit uniform would tie items at the cut-off, about C * 2**-23 of them,
    # and top_k breaks ties by position)
    v = (bits32(key, w.shape).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-32)
    e = -jnp.log1p(-jnp.minimum(v, jnp.float32(1.0 - 2.0**-24)))
    score = -e / jnp.where(drawable, w, 1.0)  # larger is drawn first
    # a weight so small that the score overflows still beats every position not drawable
    score = jnp.where(drawable, jnp.maximum(score, jnp.finfo(jnp.float32).min), -jnp.inf)
    return jax.lax.top_k(score, batch_size)[1].astype(jnp.int32)


def _repeated_draws(batch_size: int, key, w, drawable, n):
    """int32 ``[B]``: independent draws proportional to ``w`` among the ``n < B`` drawable
    positions (0 when ``n == 0``): an inverse CDF over at most ``B`` candidates."""
    (cand,) = jnp.nonzero(drawable, size=batch_size, fill_value=0)
    wk = jnp.where(jnp.arange(batch_size) < n, w[cand], 0.0)
    cdf = jnp.cumsum(wk)
    target = uniform01(key, (batch_size,)) * cdf[-1]
    k = jnp.searchsorted(cdf, target, side="right")
    return cand[jnp.clip(k, 0, jnp.maximum(n - 1, 0))].astype(jnp.int32)


def _version_dtype(dtype, key) -> jnp.dtype:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.dtype(jnp.int32)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(jnp.float32)
    raise TypeError(
        f"{_NAME}.init: the versions under version_key={key!r} must be integers or "
        f"floats, got dtype {dtype}."
    )


def _own_state(state, where: str) -> StalenessState:
    if not isinstance(state, BufferState) or not isinstance(state.sampler, StalenessState):
        got = (
            f"a BufferState whose sampler state is {type(state.sampler).__name__}"
            if isinstance(state, BufferState)
            else type(state).__name__
        )
        raise TypeError(
            f"{_NAME}.{where}: expected the BufferState of a buffer built with "
            f"sampler=StalenessAwareSampler(...), got {got}. Call it as "
            f"rb.sampler.{where}(state, ...)."
        )
    return state.sampler


def _bad_weight_message(state: StalenessState, i: int, n: int, sampler) -> str:
    version = np.asarray(state.versions)[i]
    consumer = np.asarray(state.consumer_version)
    weight = sampler.weight_fn(jnp.asarray(consumer - version, jnp.float32))
    return (
        f"{_NAME}.sample: staleness_weight_fn gave weight {float(weight)!r} (expected a "
        f"finite number >= 0) to the item at flat position {i}, whose version is {version} "
        f"and staleness {consumer - version} (consumer_version={consumer}); {n} stored "
        "items have such weights. An item newer than the consumer version (staleness <= -1 "
        "with the default 1 / (staleness + 1)) means the consumer version was not advanced: "
        "call state = rb.sampler.set_consumer_version(state, latest_version). Otherwise "
        "make staleness_weight_fn finite and >= 0 for every staleness it can see. Under "
        "jax.jit such items are not drawn."
    )
