"""One decorator for component methods that run as one compiled function, and the cheapest
copy of host arrays to the device."""

from __future__ import annotations

import functools
import inspect

import jax


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
