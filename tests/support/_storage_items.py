"""One small item and batches of it, every leaf distinct, for tests that run one buffer over
several storages and compare what they return."""

import jax.numpy as jnp

EXAMPLE = {
    "obs": jnp.zeros((3,), jnp.float32),
    "act": jnp.int32(0),
    "next": {"done": jnp.zeros((), bool), "reward": jnp.float32(0)},
}


def items(i, n=5):
    """Batch ``i`` of ``n`` items: values that differ between batches and within one."""
    base = jnp.arange(n, dtype=jnp.float32) + 10.0 * i
    return {
        "obs": jnp.stack([base, base + 1, base + 2], axis=1),
        "act": jnp.arange(n, dtype=jnp.int32) + 100 * i,
        "next": {"done": (jnp.arange(n) + i) % 4 == 3, "reward": base / 7.0},
    }
