"""Cheap counter-based random words for drawing indices, keyed by an explicit JAX PRNG key.

Why not ``jax.random.bits`` directly: on CPU, XLA runs JAX's threefry as a rolled loop whose
fixed cost (~13 us for 256 words, measured in a ``lax.scan``) is a third of a whole W1 step
(add 256 + sample 256 at 1M items). Here the key is consumed once, as data: word ``i`` of a draw
is a keyed hash of the counter ``i`` (MurmurHash3's 32-bit finalizer, one round per key word
plus one), ~2.5 us for 256 words. The finalizer is a bijection with full avalanche, so for a
fixed key the words are distinct and uniform, and keys that differ in any bit (JAX's
``split``/``fold_in`` outputs) give unrelated streams. It is a statistical generator for
sampling, not a cryptographic one; chi-square tests cover marginals, pairs and keys
(``tests/core/test_random.py``).

Same key, same words, under ``jit``, ``vmap`` and eagerly. Typed keys of every JAX PRNG
implementation and raw ``uint32`` keys are accepted.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _key_words(key: jax.Array) -> jax.Array:
    """uint32 ``[W]``: the key's data (``W`` = 2 for threefry, 4 for rbg)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.dtype != jnp.uint32:
        raise TypeError(
            f"expected a JAX PRNG key (jax.random.key) or raw uint32 key data, got "
            f"dtype {key.dtype}."
        )
    return key.reshape(-1)


def bits32(key: jax.Array, shape: tuple) -> jax.Array:
    """uint32 ``shape``: random words, a pure function of ``key`` (one key, no batch axis)."""
    n = math.prod(shape)
    h = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    words = _key_words(key)
    for j in range(words.shape[0]):
        h = _fmix32(h ^ words[j])
    return _fmix32(h + jnp.uint32(0x6A09E667)).reshape(shape)


def uniform01(key: jax.Array, shape: tuple) -> jax.Array:
    """float32 ``shape`` in ``[0, 1)``: the top 23 bits of :func:`bits32` as a mantissa."""
    one_to_two = (bits32(key, shape) >> 9) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(one_to_two, jnp.float32) - jnp.float32(1.0)
