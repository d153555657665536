"""The mixer: one batch drawn from several replay buffers in fixed proportions.

A :class:`Mixer` is a frozen, hashable configuration over buffers (core
:class:`~functional_rb.ReplayBuffer` objects, or anything with the same
``sample(state, key, batch_size=...) -> (Sample, state)`` protocol). Its methods are pure
functions of a sequence of states, one per buffer, so they work under ``jax.jit``, ``jax.vmap``
and inside ``lax.scan`` like the buffers' own. The typical use mixes online and offline data
(RLPD's half-and-half batches) or a small buffer of demonstrations into every batch::

    mixer = frb.Mixer((online_rb, demos_rb), proportions=(3, 1), batch_size=256)
    sample, source, states = mixer.sample(states, key)   # rows 0..191 online, 192..255 demos

The split of the batch into per-buffer sizes is static (Python ints fixed at construction, see
:func:`split_batch`), so every batch holds exactly ``sizes[k]`` rows of buffer ``k``, in buffer
order. :func:`split_batch` and :func:`concatenate` are also the logic of flashbax's mixer
(:mod:`functional_rb.flashbax.buffers.mixer`), which keeps flashbax's rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import checks as _checks
from functional_rb._internal import eager as _eager
from functional_rb._internal.errors import (
    check_not_consumed,
    config_int,
    config_number,
    keystr,
)
from functional_rb.buffer import ReplayBuffer
from functional_rb.protocol import Sample
from functional_rb.samplers import sum_tree
from functional_rb.samplers.prioritized import PrioritizedSampler
from functional_rb.samplers.prioritized_slices import PrioritizedSliceSampler
from functional_rb.samplers.sequences import PrioritizedSequenceSampler, SequenceSampler
from functional_rb.samplers.slices import (
    SliceSampler,
    SliceSamplerWithoutReplacement,
    SliceSpec,
)
from functional_rb.samplers.staleness import StalenessAwareSampler
from functional_rb.samplers.uniform import RandomSampler, SamplerWithoutReplacement

PyTree = Any

__all__ = ("ROUNDINGS", "Mixer", "concatenate", "split_batch")

ROUNDINGS = ("largest_remainder", "first")
_WEIGHTINGS = ("mixture", "member")
# built-in samplers whose weights are 1 on every drawn row: N_k P_k(i) = 1 in the mixture's terms
_UNIT_WEIGHT_SAMPLERS = (
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
    SequenceSampler,
)
# built-in samplers whose weights are (vmin / v) ** beta over the positive leaves of a sum tree
_PRIORITIZED_SAMPLERS = (PrioritizedSampler, PrioritizedSliceSampler, PrioritizedSequenceSampler)


# ------------------------------------------------------------------------------ the batch split
def split_batch(
    batch_size: int, proportions: Sequence[float], *, rounding: str = "largest_remainder"
) -> tuple[int, ...]:
    """The rows of a batch of ``batch_size`` that each buffer gets, for ``proportions`` (any
    non-negative numbers with a positive sum: ratios, not necessarily summing to 1).

    ``rounding``:

      * ``"largest_remainder"`` (the :class:`Mixer`'s default): each buffer gets
        ``floor(batch_size * p_k / sum(p))`` rows, then the rows left over go one each to the
        buffers with the largest fractional parts (ties: the earlier buffer). Computed exactly
        (rationals of the given numbers, no float rounding), so every size is within one row of
        ``batch_size * p_k / sum(p)``.
      * ``"first"``: flashbax's rule: ``int(p_k / sum(p) * batch_size)`` in floating point, and
        the whole remainder to buffer 0 (so buffer 0 may get several rows more than its share,
        and float error may move a row: ``0.29 / 1.0 * 100`` is ``28.999...``, i.e. 28).

    The sizes always sum to ``batch_size``.

    >>> split_batch(10, (1, 1, 1))
    (4, 3, 3)
    >>> split_batch(10, (0.35, 0.35, 0.3))
    (4, 3, 3)
    >>> split_batch(10, (0.35, 0.35, 0.3), rounding="first")
    (4, 3, 3)
    >>> split_batch(100, (0.29, 0.71), rounding="first")
    (29, 71)
    >>> split_batch(7, (1, 1, 1, 1), rounding="first")
    (4, 1, 1, 1)
    """
    where = "split_batch"
    batch_size = config_int(where, "batch_size", batch_size, minimum=1)
    if rounding not in ROUNDINGS:
        raise ValueError(f"{where}: rounding must be one of {ROUNDINGS}, got {rounding!r}.")
    if isinstance(proportions, np.ndarray) and proportions.ndim == 1:
        proportions = proportions.tolist()
    if isinstance(proportions, (str, bytes)) or not isinstance(proportions, Sequence):
        raise TypeError(
            f"{where}: proportions must be a sequence of numbers, one per buffer, "
            f"got {proportions!r}; e.g. proportions=(0.5, 0.5)."
        )
    props = [
        config_number(where, f"proportions[{k}]", p, minimum=0.0) for k, p in enumerate(proportions)
    ]
    if not props or sum(props) <= 0:
        raise ValueError(
            f"{where}: proportions must hold at least one positive number, got "
            f"{list(proportions)}; e.g. proportions=(0.5, 0.5)."
        )
    if rounding == "first":
        total = sum(props)
        sizes = [int(p / total * batch_size) for p in props]
        sizes[0] += batch_size - sum(sizes)
        return tuple(sizes)
    exact = [fractions.Fraction(p) for p in props]
    shares = [batch_size * p / sum(exact) for p in exact]
    sizes = [int(s) for s in shares]  # floor: the shares are non-negative
    by_remainder = sorted(range(len(shares)), key=lambda k: (-(shares[k] - sizes[k]), k))
    for k in by_remainder[: batch_size - sum(sizes)]:
        sizes[k] += 1
    return tuple(sizes)


# ------------------------------------------------------------------------------ concatenation
def concatenate(
    batches: Sequence[PyTree], *, where: str = "concatenate", names: Sequence[str] | None = None
) -> PyTree:
    """One PyTree whose leaves are the leaves of ``batches`` concatenated along axis 0, in order.

    Every batch must have the same tree structure, and each leaf the same trailing shape and
    dtype (the leading axis may differ); otherwise ``ValueError`` naming the batch, the leaf
    path, both shapes/dtypes and the fix (nothing is promoted or broadcast silently). ``names``
    label the batches in messages (default ``batches[k]``); ``where`` names the caller.

    >>> import jax.numpy as jnp
    >>> concatenate([{"obs": jnp.zeros((2, 3))}, {"obs": jnp.ones((1, 3))}])["obs"].shape
    (3, 3)
    """
    batches = list(batches)
    if not batches:
        raise ValueError(f"{where}: nothing to concatenate (no batches).")
    names = list(names) if names is not None else [f"batches[{k}]" for k in range(len(batches))]
    first, treedef = jax.tree_util.tree_flatten_with_path(batches[0])
    fix = (
        "every buffer must store items of one structure, with the same shapes and dtypes "
        "(a batch is their concatenation): build them from one example, or cast the data "
        "before adding it"
    )
    for k in range(1, len(batches)):
        leaves, other = jax.tree_util.tree_flatten_with_path(batches[k])
        if other != treedef:  # type: ignore[operator]  # jaxlib has no stubs
            raise ValueError(
                f"{where}: {names[k]} has another tree structure than {names[0]}: "
                f"{_paths(leaves)} vs {_paths(first)}; {fix}."
            )
        for (path, x), (_, x0) in zip(leaves, first):
            s, s0 = np.shape(x), np.shape(x0)
            if (len(s), s[1:], _dtype(x)) != (len(s0), s0[1:], _dtype(x0)):
                raise ValueError(
                    f"{where}: leaf {keystr(path)} of {names[k]} has shape {s} and dtype "
                    f"{_dtype(x)}, but {names[0]} has shape {s0} and dtype {_dtype(x0)}: only "
                    f"the leading (batch) axis may differ; {fix}."
                )
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *batches)


def _paths(leaves) -> str:
    return "[" + ", ".join(keystr(p) for p, _ in leaves) + "]"


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


@contextlib.contextmanager
def _in_buffer(where: str, k: int):
    """Errors a buffer raises name the mixer's call and which buffer raised them."""
    try:
        yield
    except (ValueError, TypeError) as e:
        try:
            new = type(e)(f"{where}: buffers[{k}]: {e}")
        except Exception:  # noqa: BLE001 - another constructor: keep the error as it is
            raise e from None
        raise new from e


# ------------------------------------------------------------------------------ the mixer
@dataclasses.dataclass(frozen=True)
class Mixer:
    """Draws one batch from several buffers in fixed proportions.

    Args:
      buffers: the buffers, in order: :class:`~functional_rb.ReplayBuffer` objects or anything
        frozen and hashable with ``sample(state, key, batch_size=n) -> (Sample, state)`` and
        ``can_sample(state) -> bool []`` (``update(state, indices, priorities)`` too, to take
        priorities).
      proportions: one positive number per buffer, as ratios (``(3, 1)`` is ``(0.75, 0.25)``).
      batch_size: rows in every batch (a Python int); ``sizes[k]`` of them come from buffer
        ``k`` (:func:`split_batch`), and each buffer must get at least one.
      weights: ``"mixture"`` (default) or ``"member"``, see below.
      rounding: how the batch is split, ``"largest_remainder"`` (default) or flashbax's
        ``"first"`` (:func:`split_batch`).

    **The distribution.** Rows ``offsets[k]`` to ``offsets[k] + sizes[k]`` of a batch are one
    call of buffer ``k``'s own sampler with ``batch_size=sizes[k]`` (each buffer with its own
    key, split from ``key``), so buffer ``k``'s rows follow its sampler: ``P_k(i)`` (uniform:
    ``1 / N_k`` over its ``N_k`` stored items; prioritized: ``v_i / sum_j v_j``). A row picked
    at random from the batch is item ``i`` of buffer ``k`` with probability
    ``pi_k * P_k(i)``, ``pi_k = sizes[k] / batch_size``: the mixture. The proportions are a
    choice of what to learn from, not a bias: the weights do not undo them.

    **The weights** (``Sample.weights``) correct the prioritized buffers' bias within each
    buffer, towards the target ``pi_k / N_k`` (the proportions kept, uniform within each
    buffer), with one normalization for the whole batch. With ``weights="mixture"``, the row of
    item ``i`` of buffer ``k`` weighs ::

        w = (N_k P_k(i)) ** -beta_k / max over buffers k' and items j of (N_k' P_k'(j)) ** -beta_k'

    (the importance ratio ``(target / sampled) ** beta``). Uniform buffers have
    ``N_k P_k(i) = 1``; ``N_k`` counts the stored items (``PrioritizedSampler``), the valid
    slice starts (``PrioritizedSliceSampler``) or the drawable sequences
    (``PrioritizedSequenceSampler``). So the weights of rows of different buffers are
    on one scale: mixing a uniform buffer with a prioritized one whose largest weight is ``M``
    gives the uniform rows ``1 / M``; a batch of uniform buffers only has weights 1. Each row's
    weight is its buffer's own weight times ``M_k / max_k' M_k'``, where ``M_k`` is the largest
    weight of buffer ``k`` before its own normalization; the mixer computes it for the built-in
    samplers. A buffer of your own (not a ``ReplayBuffer``) gives it by defining
    ``weight_scale(state, **options) -> float32 []``; without one, or for a ``ReplayBuffer``
    whose sampler is not a built-in one, ``weights="mixture"`` raises ``TypeError`` at
    construction. With ``weights="member"`` each buffer's weights are kept as it returns them
    (each normalized by its own maximum). Masked rows weigh 0.

    **Methods** (pure; ``states`` is a list or tuple of the buffers' states, in order; the new
    states come back in the same container): :meth:`sample`, :meth:`can_sample`,
    :meth:`update`, :meth:`split`. Static facts: ``sizes``, ``offsets``, ``rows`` (leading rows
    per buffer: ``sizes[k]``, or its number of slices or sequences for slice and sequence
    samplers, whose ``batch_size`` counts steps) and ``source``.

    Called outside ``jax.jit``, ``sample`` and ``update`` run as one compiled call, consuming
    the states they change as the buffers' own eager calls do (keep the returned states); when
    a buffer cannot be sampled they raise ``ValueError`` naming it before any state is
    consumed. Under ``jit`` such a buffer's rows come back with ``mask`` False and weight 0.

    >>> import jax, jax.numpy as jnp
    >>> import functional_rb as frb
    >>> online = frb.ReplayBuffer(capacity=100, batch_size=8)
    >>> demos = frb.ReplayBuffer(capacity=10, batch_size=8)
    >>> mixer = frb.Mixer((online, demos), proportions=(3, 1), batch_size=8)
    >>> mixer.sizes
    (6, 2)
    >>> states = [online.init({"obs": jnp.zeros(2)}), demos.init({"obs": jnp.zeros(2)})]
    >>> states = [online.add(states[0], {"obs": jnp.zeros((5, 2))}),
    ...           demos.add(states[1], {"obs": jnp.ones((3, 2))})]
    >>> bool(mixer.can_sample(states))
    True
    >>> sample, source, states = mixer.sample(states, jax.random.key(0))
    >>> sample.data["obs"][:, 0].tolist()
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    >>> source.tolist()
    [0, 0, 0, 0, 0, 0, 1, 1]
    """

    buffers: tuple
    proportions: tuple
    batch_size: int
    weights: str = dataclasses.field(default="mixture", kw_only=True)
    rounding: str = dataclasses.field(default="largest_remainder", kw_only=True)
    sizes: tuple = dataclasses.field(init=False, repr=False)
    rows: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        where = "Mixer"
        if isinstance(self.proportions, np.ndarray) and self.proportions.ndim == 1:
            object.__setattr__(self, "proportions", self.proportions.tolist())
        for name in ("buffers", "proportions"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(
                    f"{where}: {name} must be a list or tuple, one entry per buffer, got {value!r}."
                )
            object.__setattr__(self, name, tuple(value))
        if not self.buffers:
            raise ValueError(
                f"{where}: buffers is empty; pass at least one buffer, e.g. "
                "Mixer((online_rb, offline_rb), proportions=(0.5, 0.5), "
                "batch_size=256)."
            )
        if len(self.proportions) != len(self.buffers):
            raise ValueError(
                f"{where}: {len(self.buffers)} buffers but {len(self.proportions)} proportions "
                f"{list(self.proportions)}; pass one proportion per buffer, in the same order."
            )
        config_int(where, "batch_size", self.batch_size, minimum=1)
        for k, p in enumerate(self.proportions):
            config_number(
                where,
                f"proportions[{k}]",
                p,
                minimum=0.0,
                strict=True,
                fix="Each buffer's proportion must be positive; leave a buffer "
                "out of the mixer rather than giving it 0.",
            )
        for name, value, allowed in (
            ("weights", self.weights, _WEIGHTINGS),
            ("rounding", self.rounding, ROUNDINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{where}: {name} must be one of {allowed}, got {value!r}.")
        for k, rb in enumerate(self.buffers):
            _check_buffer(rb, k, self.weights)
        sizes = split_batch(self.batch_size, self.proportions, rounding=self.rounding)
        assert sum(sizes) == self.batch_size, (sizes, self.batch_size)  # split_batch's promise
        for k, n in enumerate(sizes):
            if n < 1:
                need = int(np.ceil(sum(self.proportions) / self.proportions[k]))
                raise ValueError(
                    f"{where}: buffers[{k}] gets {n} of the batch_size={self.batch_size} rows "
                    f"(proportion {self.proportions[k]} of {sum(self.proportions)}, "
                    f"rounding={self.rounding!r}, sizes {sizes}); every buffer needs at least "
                    f"one row: raise batch_size (to at least {need}) or that proportion."
                )
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(
            self,
            "rows",
            tuple(_rows(rb, n, k) for k, (rb, n) in enumerate(zip(self.buffers, sizes))),
        )

    # ------------------------------------------------------------------ static facts
    @property
    def offsets(self) -> tuple[int, ...]:
        """The first row of each buffer's part of a batch (its leading axis).

        >>> import functional_rb as frb
        >>> frb.Mixer((frb.ReplayBuffer(8),) * 3, proportions=(1, 1, 2), batch_size=8).offsets
        (0, 2, 4)
        """
        return tuple(int(o) for o in np.cumsum((0,) + self.rows[:-1]))

    @property
    def source(self) -> np.ndarray:
        """int32 ``[sum(rows)]``: which buffer each row of a batch comes from (static).

        >>> import functional_rb as frb
        >>> frb.Mixer((frb.ReplayBuffer(8),) * 2, proportions=(1, 3), batch_size=4).source
        array([0, 1, 1, 1], dtype=int32)
        """
        return np.repeat(np.arange(len(self.buffers), dtype=np.int32), self.rows)

    def split(self, tree: PyTree) -> tuple:
        """``tree`` (leaves with the batch's leading rows axis: a :class:`Sample`, its
        ``indices``, TD errors...) cut into one part per buffer, in buffer order.

        >>> import functional_rb as frb, jax.numpy as jnp
        >>> rb = frb.ReplayBuffer(capacity=10)
        >>> mixer = frb.Mixer((rb, rb), proportions=(1, 3), batch_size=4)
        >>> [part.tolist() for part in mixer.split(jnp.arange(4))]
        [[0], [1, 2, 3]]
        """
        total = sum(self.rows)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if np.ndim(x) == 0 or np.shape(x)[0] != total:
                raise ValueError(
                    f"Mixer.split: leaf {keystr(path)} has shape {np.shape(x)}, expected a "
                    f"leading axis of {total} rows (the mixer's batch: rows {self.rows}); pass "
                    "a batch drawn by this mixer, or arrays of its shape."
                )
        return tuple(
            jax.tree_util.tree_map(lambda x, o=o, r=r: x[o : o + r], tree)
            for o, r in zip(self.offsets, self.rows)
        )

    # ------------------------------------------------------------------ can_sample / sample
    def can_sample(self, states: Sequence[PyTree]) -> jax.Array:
        """bool ``[]``: True only when every buffer's own ``can_sample`` is (its default batch
        size and rate limiter)."""
        states = self._check_states(states, "Mixer.can_sample")
        oks = []
        for k, (rb, state) in enumerate(zip(self.buffers, states)):
            with _in_buffer("Mixer.can_sample", k):
                oks.append(jnp.asarray(rb.can_sample(state), bool).reshape(()))
        return jnp.all(jnp.stack(oks))

    def sample(
        self, states: Sequence[PyTree], key: jax.Array, **options
    ) -> tuple[Sample, jax.Array, Sequence[PyTree]]:
        """Draw one batch: ``(sample, source, new_states)``.

        ``sample``: a :class:`~functional_rb.Sample` whose ``data``, ``indices``, ``weights``
        and ``mask`` are the buffers' batches concatenated in buffer order (leading axis
        ``sum(rows)``); ``indices[r]`` is a position in buffer ``source[r]``'s storage;
        ``weights`` as the class docstring says; ``generations`` concatenated (-1 on rows of
        buffers that keep none), or None when no buffer keeps them. ``source``: int32, which
        buffer each row comes from (the static :attr:`source`). ``new_states``: the buffers'
        new states, in the container ``states`` came in.

        ``key``: one PRNG key, split into one key per buffer. ``options`` (e.g. ``beta=``) go
        to every buffer whose sampler takes them (an option no buffer takes raises
        ``TypeError``). The buffers' items must share one structure, shapes and dtypes
        (checked at trace time, naming the leaf).
        """
        where = "Mixer.sample"
        if _eager.top_level():
            container: Any = type(states)  # the caller's sequence type
            self._check_states(states, where)
            sample, source, packed = _eager.call(
                self, "_sample_packed", _States(tuple(states)), key, **options
            )
            return sample, source, container(packed.states)
        container = type(states)
        states = self._check_states(states, where)
        _checks.check_key(key, where)
        per_buffer = self._options(options, where)
        keys = jax.random.split(key, len(self.buffers))
        samples, new_states, scales = [], [], []
        for k, (rb, state, opts) in enumerate(zip(self.buffers, states, per_buffer)):
            with _in_buffer(where, k):
                s, new = rb.sample(state, keys[k], batch_size=self.sizes[k], **opts)
                if self.weights == "mixture":  # of the state drawn from (sample checked it)
                    scales.append(_log_weight_scale(rb, state, opts))
            if np.shape(s.indices)[:1] != (self.rows[k],):
                raise ValueError(
                    f"{where}: buffers[{k}] returned indices of shape {np.shape(s.indices)} for "
                    f"batch_size={self.sizes[k]}, expected {self.rows[k]} leading rows; a "
                    "buffer's sample must return batch_size rows (slice samplers: "
                    "batch_size // slice_len slices)."
                )
            samples.append(s)
            new_states.append(new)
        return (self._mix(samples, scales, where), jnp.asarray(self.source), container(new_states))

    def _mix(self, samples: list, scales: list, where: str) -> Sample:
        names = [f"buffers[{k}]" for k in range(len(samples))]
        data = concatenate([s.data for s in samples], where=where, names=names)
        fields = {
            f: concatenate([getattr(s, f) for s in samples], where=f"{where} ({f})", names=names)
            for f in ("indices", "mask")
        }
        weights = [jnp.asarray(s.weights, jnp.float32) for s in samples]
        if scales:
            log_m = jnp.stack(scales)
            factor = jnp.exp(log_m - jnp.max(log_m))  # M_k / max M, in [0, 1]
            weights = [w * factor[k] for k, w in enumerate(weights)]
        gens = [getattr(s, "generations", None) for s in samples]
        generations = None
        if any(g is not None for g in gens):
            generations = jnp.concatenate(
                [
                    jnp.full(np.shape(s.indices), -1, jnp.int32)
                    if g is None
                    else jnp.asarray(g, jnp.int32)
                    for s, g in zip(samples, gens)
                ],
                axis=0,
            )
        return Sample(
            data,
            fields["indices"].astype(jnp.int32),
            jnp.concatenate(weights, axis=0),
            fields["mask"],
            generations,
        )

    # ------------------------------------------------------------------ update
    def update(
        self, states: Sequence[PyTree], indices, priorities, *, generations: jax.Array | None = None
    ) -> Sequence[PyTree]:
        """New priorities for the rows of a mixed batch; returns the new states.

        ``indices``: the mixed :class:`~functional_rb.Sample` itself (its generations then
        drop the entries whose slot was rewritten since the draw, as
        ``ReplayBuffer.update(state, sample, priorities)`` does) or its ``indices``;
        ``priorities``: real, the shape of the indices. Each buffer's rows go to its own
        ``update``; a buffer without ``update`` (or without priorities) keeps its state.
        Errors of a buffer's ``update`` (NaN priorities, out-of-range indices) name the buffer.

        >>> import jax, jax.numpy as jnp, functional_rb as frb
        >>> per = frb.ReplayBuffer(capacity=8, sampler=frb.PrioritizedSampler(alpha=1, beta=1))
        >>> uni = frb.ReplayBuffer(capacity=8)
        >>> mixer = frb.Mixer((per, uni), proportions=(1, 1), batch_size=4)
        >>> states = [rb.add(rb.init(jnp.float32(0)), jnp.arange(4.0)) for rb in (per, uni)]
        >>> sample, source, states = mixer.sample(states, jax.random.key(0))
        >>> states = mixer.update(states, sample, jnp.full(4, 2.0))
        """
        where = "Mixer.update"
        if isinstance(indices, Sample):
            if generations is None:
                generations = indices.generations
            indices = indices.indices
        if _eager.top_level():
            container: Any = type(states)  # the caller's sequence type
            self._check_states(states, where)
            extra = {} if generations is None else {"generations": generations}
            packed = _eager.call(
                self, "_update_packed", _States(tuple(states)), indices, priorities, **extra
            )
            return container(packed.states)
        container = type(states)
        states = self._check_states(states, where)
        total = sum(self.rows)
        if np.ndim(indices) == 0 or np.shape(indices)[0] != total:
            raise ValueError(
                f"{where}: indices have shape {np.shape(indices)}, expected a "
                f"leading axis of {total} rows (rows {self.rows}); pass the sample "
                "this mixer drew, or its indices."
            )
        if np.ndim(priorities) == 0:
            priorities = jnp.broadcast_to(jnp.asarray(priorities), np.shape(indices))
        elif np.shape(priorities) != np.shape(indices):
            raise ValueError(
                f"{where}: priorities have shape {np.shape(priorities)}, expected "
                f"the shape of indices {np.shape(indices)} (or a scalar)."
            )
        parts = self.split(
            {"i": indices, "p": priorities, **({} if generations is None else {"g": generations})}
        )
        new_states = []
        for k, (rb, state, part) in enumerate(zip(self.buffers, states, parts)):
            if not callable(getattr(rb, "update", None)):
                new_states.append(state)
                continue
            extra = {"generations": part["g"]} if "g" in part and _tracks_generations(rb) else {}
            with _in_buffer(where, k):
                new_states.append(rb.update(state, part["i"], part["p"], **extra))
        return container(new_states)

    # ------------------------------------------------------------------ eager calls
    # Outside jit, sample and update run as one compiled call of these through the buffers'
    # eager machinery (functional_rb._internal.eager), which follows a state by weak reference:
    # the states travel in a _States, as a list or tuple cannot be referenced weakly.
    def _sample_packed(self, packed: _States, key, **options):
        sample, source, states = self.sample(list(packed.states), key, **options)
        return sample, source, _States(tuple(states))

    def _update_packed(self, packed: _States, indices, priorities, **kw):
        return _States(tuple(self.update(list(packed.states), indices, priorities, **kw)))

    # ------------------------------------------------------------------ checks
    def _check_states(self, states, where: str) -> list:
        n = len(self.buffers)
        if not isinstance(states, (list, tuple)) or hasattr(states, "_fields"):
            raise TypeError(
                f"{where}: states must be a list or tuple of {n} buffer states, one per buffer "
                f"in the mixer's order, got {type(states).__name__}; e.g. "
                "states = [rb.init(example) for rb in mixer.buffers]."
            )
        if len(states) != n:
            raise ValueError(
                f"{where}: got {len(states)} states for {n} buffers; pass one state per "
                "buffer, in the mixer's order (states = [rb.init(example) for rb in "
                "mixer.buffers])."
            )
        check_not_consumed(list(states), where)
        return list(states)

    def _options(self, options: dict, where: str) -> list[dict]:
        """Each buffer's share of ``options``: those its sampler takes."""
        accepted = [
            set(getattr(getattr(rb, "sampler", None), "options", ()))
            if isinstance(rb, ReplayBuffer)
            else set()
            for rb in self.buffers
        ]
        unknown = sorted(set(options) - set().union(*accepted))
        if unknown:
            raise TypeError(
                f"{where}: no buffer takes the option(s) {unknown}; the buffers' samplers take "
                f"{[sorted(a) for a in accepted]} (e.g. beta= for prioritized samplers)."
            )
        return [{k: v for k, v in options.items() if k in a} for a in accepted]


# ------------------------------------------------------------------------------ helpers
@dataclasses.dataclass(frozen=True)
class _States:
    """The buffers' states as one PyTree that can be referenced weakly (see the eager calls)."""

    states: tuple


jax.tree_util.register_dataclass(_States, data_fields=["states"], meta_fields=[])


def _check_buffer(rb, k: int, weights: str) -> None:
    where = "Mixer"
    missing = [m for m in ("sample", "can_sample") if not callable(getattr(rb, m, None))]
    if missing:
        raise TypeError(
            f"{where}: buffers[{k}] = {rb!r} is not a buffer (it lacks {missing}); pass "
            "frb.ReplayBuffer objects, or objects with sample(state, key, batch_size=n) -> "
            "(Sample, state) and can_sample(state)."
        )
    try:
        hash(rb)
    except TypeError as e:
        raise TypeError(
            f"{where}: buffers[{k}] = {rb!r} must be hashable (a frozen config "
            "object) so that jit can cache on the mixer."
        ) from e
    if weights != "mixture" or callable(getattr(rb, "weight_scale", None)):
        return
    sampler = rb.sampler if isinstance(rb, ReplayBuffer) else None
    if not isinstance(sampler, _UNIT_WEIGHT_SAMPLERS + _PRIORITIZED_SAMPLERS):
        what = (
            f"its sampler {type(sampler).__name__} is not a built-in one"
            if sampler is not None
            else f"it is a {type(rb).__name__}, not a ReplayBuffer"
        )
        raise TypeError(
            f"{where}: buffers[{k}]: weights='mixture' puts every buffer's weights on one "
            f"scale, which needs each buffer's largest weight, but {what}. Pass "
            "weights='member' to keep each buffer's weights as it returns them, or give the "
            "buffer a weight_scale(state, **options) method returning it."
        )


def _rows(rb, n: int, k: int) -> int:
    """Leading rows of buffer ``rb``'s batch of ``n`` (slice samplers: slices), after checking
    that its sampler can draw batches of ``n`` (so a bad split fails at construction)."""
    if not isinstance(rb, ReplayBuffer):
        return n
    sampler = rb.sampler
    with _in_buffer("Mixer", k):
        sampler.validate(capacity=rb.capacity, batch_size=n, ndim=rb.ndim)
        if isinstance(sampler, SliceSpec):
            return sampler.shape(n)[0]
    if isinstance(sampler, (SequenceSampler, PrioritizedSequenceSampler)):
        return n // sampler.sequence_length
    return n


def _tracks_generations(rb) -> bool:
    return bool(getattr(getattr(rb, "sampler", None), "tracks_generations", False))


def _log_weight_scale(rb, state, options: dict) -> jax.Array:
    """float32 ``[]``: ``log M_k``, the log of the largest weight ``(N_k P_k(j)) ** -beta`` of
    any drawable element of buffer ``rb`` before its own normalization (0 for uniform
    samplers, and for a buffer that cannot be sampled: it then has no rows to weigh)."""
    if callable(getattr(rb, "weight_scale", None)):
        return jnp.log(jnp.asarray(rb.weight_scale(state, **options), jnp.float32)).reshape(())
    sampler = rb.sampler
    if not isinstance(sampler, _PRIORITIZED_SAMPLERS):
        return jnp.float32(0.0)
    tree = state.sampler.tree
    if isinstance(sampler, PrioritizedSampler):
        n = rb.size(state)  # N: the stored items, as PrioritizedSampler's weights define it
    else:
        n = jnp.sum(tree.values > 0)  # N: the drawable slice starts / sequences (O(capacity))
    beta = sampler.prioritization.beta_for(options.get("beta"), where="Mixer.sample")
    total, vmin = sum_tree.total(tree), sum_tree.min(tree)
    ok = (n > 0) & (total > 0) & jnp.isfinite(vmin)
    # max_j (N P(j)) ** -beta = (N vmin / total) ** -beta, in logs (no overflow); >= 0 up to
    # rounding since N vmin <= total
    log_ratio = (
        jnp.log(jnp.where(ok, n, 1).astype(jnp.float32))
        + jnp.log(jnp.where(ok, vmin, 1.0))
        - jnp.log(jnp.where(ok, total, 1.0))
    )
    return jnp.where(ok, jnp.maximum(-beta * log_ratio, 0.0), 0.0).astype(jnp.float32)
