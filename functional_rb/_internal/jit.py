"""One decorator for component methods that run as one compiled function, the cheapest copy
of host arrays to the device, and a boundary XLA does not fuse across."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp


def compiled(*static_argnames: str):
    """Compile a component method with ``jax.jit``: the component (``self``, frozen and
    hashable) and the named Python arguments are static, everything else (states, keys, a
    :class:`~functional_rb.protocol.Context`, whose layout is static) is traced.

    Why: used eagerly, a method made of ``lax.cond`` / ``fori_loop`` bodies and many small ops
    would be re-traced or dispatched op by op on every call; compiled it costs one dispatch.
    Under a caller's ``jit``/``scan`` it simply inlines. Checks that must see concrete values
    (the error policy's eager ``ValueError``s) belong in the caller, outside the compiled
    method: inside it every value is traced.
    """

    def wrap(method):
        # jit infers positions from names only when given names alone: name them all
        params = list(inspect.signature(method).parameters)
        jitted = jax.jit(method, static_argnames=(params[0],) + tuple(static_argnames))

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            return jitted(self, *args, **kwargs)

        return call

    return wrap


@jax.jit
def _identity(*xs):
    return xs


def to_device(*xs) -> tuple:
    """Host arrays as device arrays, in one call: a jitted identity costs ~7 us for a small
    array on CPU, ``jnp.asarray`` ~16 us and ``jax.device_put`` ~31 us each (JAX 0.10)."""
    return _identity(*xs)


def settled(tree, pred):
    """``tree`` where ``pred`` holds, zeros elsewhere, computed once before anything reads it.

    Why: on the CPU, XLA copies an elementwise producer into the loop of each consumer that
    reads it. Drawn indices read by a storage's gathers (one per leaf) are then recomputed,
    hash and modulo included, inside every gather loop, between its loads: the loop body
    grows from a few instructions to dozens, so the processor keeps far fewer cache misses in
    flight, and a read of 256 random rows from 10^8 costs several times what it costs from
    indices held in an array (TED's read of 256 transitions from 10^8 in
    ``benchmarks/w5_breakdown.py``: 177 us a call against 58). The result of a ``lax.cond``
    is held in a buffer of its own (``lax.optimization_barrier`` does not survive XLA's CPU
    pipeline). Off the CPU it is a ``jnp.where`` (the same values): there a conditional waits
    for its predicate on the host. Under ``vmap`` with a batched ``pred`` the cond becomes a
    select, which fuses again (the values are the same).

    >>> import jax.numpy as jnp
    >>> settled(jnp.arange(3), jnp.bool_(True)).tolist(), settled(jnp.arange(3), False).tolist()
    ([0, 1, 2], [0, 0, 0])
    """
    if jax.default_backend() != "cpu":
        return jax.tree_util.tree_map(lambda x: jnp.where(pred, x, jnp.zeros_like(x)), tree)
    return jax.lax.cond(
        pred, lambda t: t, lambda t: jax.tree_util.tree_map(jnp.zeros_like, t), tree
    )
