"""Conformance checks for components you write: ``check_sampler``, ``check_writer``,
``check_storage``.

Each builds small buffers around the component (``ndim=1`` and ``ndim=2``), drives it through
adds that cross the capacity and wrap the ring, samples and updates, and checks the contract
of its protocol (:mod:`functional_rb.protocol`): method names, shapes and dtypes, purity (the same
inputs give the same outputs), jittability (jit gives what eager gives), no retracing across
calls of the same shapes, ``jax.vmap`` over states, stable state structure, and the rules
specific to the component (indices valid, masks and weights consistent, positions unique,
items read back bit for bit). A failure raises :class:`ConformanceError` (an
``AssertionError``) whose message names the rule and how to fix it.

``example`` is ONE item (no batch or env axis; default: a small TED item with
``("next", "done")`` flags, trajectory ids and a paired observation, which every built-in
component accepts). ``capacity`` is the number of time steps per env row.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.testing import reference as ref
from functional_rb.testing._conformance import (
    JIT_FIX,
    PURE_FIX,
    ConformanceError,
    add_sizes,
    call_jitted,
    check_arrays,
    check_config,
    check_no_retrace,
    check_same,
    check_stable,
    component_example,
    counted,
    make_buffer,
    member_of,
)
from functional_rb.testing._data import StepStream

__all__ = ("ConformanceError", "check_sampler")


# ------------------------------------------------------------------ samplers
def _check_drawn(drawn, batch_size: int, rb, state, can: bool, where: str) -> None:
    fields = [getattr(drawn, f, None) for f in ("indices", "weights", "mask")]
    if any(f is None for f in fields):
        raise ConformanceError(
            where,
            "sample returns (Drawn, state)",
            f"got {type(drawn)}",
            "Return functional_rb.protocol.Drawn(indices, weights, mask).",
        )
    idx, w, m = (np.asarray(x) for x in fields)
    shape = idx.shape
    if (
        idx.dtype != np.int32
        or w.dtype != np.float32
        or m.dtype != bool
        or w.shape != shape
        or m.shape != shape
        or int(np.prod(shape)) != batch_size
        or len(shape) not in (1, 2)
    ):
        raise ConformanceError(
            where,
            "Drawn shapes and dtypes",
            f"indices {idx.dtype}{list(shape)}, weights "
            f"{w.dtype}{list(w.shape)}, mask {m.dtype}{list(m.shape)} for batch_size="
            f"{batch_size}",
            "indices int32, weights float32, mask bool, all of shape "
            "[batch_size] (or [num_slices, slice_len] with product batch_size).",
        )
    cap = rb.capacity
    if idx.size and (idx.min() < 0 or idx.max() >= cap):
        raise ConformanceError(
            where,
            "indices in range",
            f"indices span [{idx.min()}, {idx.max()}] for capacity {cap}",
            "Every index, masked ones too, must be a valid flat position in [0, capacity).",
        )
    stored = ref.stored_mask(rb, state)
    if np.any(m & ~stored[idx]):
        bad = idx[m & ~stored[idx]]
        raise ConformanceError(
            where,
            "drawn items are stored",
            f"mask is True at indices "
            f"{sorted(set(bad.tolist()))} that hold no item (filled="
            f"{int(state.writer.filled)} per row)",
            "Draw only positions "
            "t < ctx.filled of each row (ctx.layout.rank_to_flat maps ranks "
            "to them).",
        )
    if not np.all(np.isfinite(w)) or np.any(w < 0) or np.any(w[~m] != 0) or np.any(w[m] <= 0):
        raise ConformanceError(
            where,
            "weights consistent with mask",
            f"weights {w.tolist()} for mask {m.tolist()}",
            "Weights are finite, > 0 where mask "
            "is True and exactly 0 where it is False (never NaN).",
        )
    if can and not m.any():
        raise ConformanceError(
            where,
            "can_sample agrees with sample",
            "can_sample is True but the sample's mask is all False",
            "can_sample must be True only when sample can draw something.",
        )


def check_sampler(
    sampler,
    example=None,
    *,
    capacity: int = 8,
    batch_size: int = 4,
    ndims=(1, 2),
    num_envs: int = 2,
    seed: int = 0,
    vmap: bool = True,
) -> None:
    """Check a sampler against the ``Sampler`` protocol; raise :class:`ConformanceError`.

    The sampler runs in ``ReplayBuffer(capacity * envs, sampler=sampler, batch_size=...)`` with
    a ring writer and device storage, for each ``ndim`` in ``ndims``. ``vmap=False`` skips the
    ``jax.vmap`` rule.
    """
    where = f"check_sampler({type(sampler).__name__})"
    check_config(sampler, "Sampler", where)
    for ndim in ndims:
        envs = num_envs if ndim == 2 else 1
        rb = make_buffer(
            where, capacity=capacity * envs, sampler=sampler, batch_size=batch_size, ndim=ndim
        )
        here = f"{where} [ndim={ndim}]"
        ex = component_example(example, ndim, num_envs)
        stream = StepStream(ex, ndim=ndim, seed=seed)
        state = rb.init(ex)
        check_arrays(state.sampler, here, "init's state")
        if bool(rb.can_sample(state)):
            raise ConformanceError(
                here,
                "empty buffer cannot be sampled",
                "can_sample is True on an empty buffer",
                "Return ctx.size > 0 (or stricter).",
            )
        key = jax.random.key(seed)
        counts: collections.Counter = collections.Counter()
        jadd, jsample = counted(counts, "add", rb.add), counted(counts, "sample", rb.sample)
        jupdate = counted(counts, "update", rb.update)
        jraw = counted(
            counts,
            "sampler.sample",
            lambda st, k, c, rb=rb: rb.sampler.sample(st, k, batch_size, c),
        )
        empty, _ = call_jitted(jraw, state.sampler, key, rb.context(state), where=here)
        _check_drawn(empty, batch_size, rb, state, False, here + " (empty, under jit)")
        sizes = add_sizes(capacity)
        for step, n in enumerate(sizes):
            items = stream.take(n, seed=n)
            new = call_jitted(jadd, state, items, where=here)
            check_stable(state, new, here, f"add of {n} steps")
            if step == 1:  # the add that wraps the ring: eagerly too
                check_same(
                    rb.add(state, items),
                    new,
                    here,
                    "jit equals eager",
                    "rb.add eagerly and under jax.jit",
                    JIT_FIX,
                )
            state, ctx = new, rb.context(new)
            key, k = jax.random.split(key)
            can = bool(rb.can_sample(state))
            drawn = call_jitted(jraw, state.sampler, k, ctx, where=here)
            _check_drawn(drawn[0], batch_size, rb, state, can, here + f" (after {n} steps)")
            check_stable(state.sampler, drawn[1], here, "sampler.sample")
            if step == 1:  # a full ring: eagerly too, twice
                once = sampler_sample(rb, state, k, batch_size, ctx)
                check_same(
                    once,
                    sampler_sample(rb, state, k, batch_size, ctx),
                    here,
                    "pure",
                    "two eager calls with the same key and state",
                    PURE_FIX,
                )
                check_same(
                    once,
                    drawn,
                    here,
                    "jit equals eager",
                    "sampler.sample eagerly and under jax.jit",
                    JIT_FIX,
                )
            if not can:
                continue
            smp, new = call_jitted(jsample, state, k, where=here)
            check_stable(state, new, here, "sample")
            if any(
                leaf.shape[: smp.indices.ndim] != smp.indices.shape
                for leaf in jax.tree_util.tree_leaves(smp.data)
            ):
                raise ConformanceError(
                    here,
                    "finalize keeps the batch shape",
                    "data leaves "
                    f"{[x.shape for x in jax.tree_util.tree_leaves(smp.data)]}"
                    f" for indices {smp.indices.shape}",
                    "finalize may add or mark leaves but keeps their leading sample shape.",
                )
            prio = jnp.arange(1, smp.indices.size + 1, dtype=jnp.float32).reshape(smp.indices.shape)
            upd = call_jitted(jupdate, new, smp.indices, prio, where=here)
            check_stable(new, upd, here, "update")
            if step == 1:  # a full ring: sample and update eagerly too
                check_same(
                    (smp, upd),
                    (lambda s: (s[0], rb.update(s[1], s[0].indices, prio)))(rb.sample(state, k)),
                    here,
                    "jit equals eager",
                    "rb.sample and rb.update eagerly and under jax.jit",
                    JIT_FIX,
                )
            state = upd
        check_no_retrace(counts, here, {"add": len(set(sizes))})
        if vmap:
            _check_vmap_sample(rb, state, here)


def sampler_sample(rb, state, key, batch_size, ctx):
    """``sampler.sample`` called as the buffer calls it (the protocol's own signature)."""
    return rb.sampler.sample(state.sampler, key, batch_size, ctx)


def _check_vmap_sample(rb, state, where: str) -> None:
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    keys = jax.random.split(jax.random.key(7), 2)
    try:
        out, _ = jax.jit(jax.vmap(rb.sample))(states, keys)
    except Exception as e:  # noqa: BLE001 - any failure breaks the rule; the cause is chained
        raise ConformanceError(
            where,
            "vmappable",
            f"jax.vmap(rb.sample) raised {e!r}",
            "Use batchable operations (no host callbacks, no Python ints "
            "from traced values); pass vmap=False to skip.",
        ) from e
    for i in range(2):
        one, _ = jax.jit(rb.sample)(state, keys[i])  # an eager sample would consume `state`
        check_same(
            one,
            member_of(out, i),
            where,
            "vmappable",
            f"member {i} of a vmapped sample and the unbatched sample",
            "Do not mix batch members.",
        )
