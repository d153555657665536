"""PyTrees compared exactly: the same structure and, leaf by leaf, the same dtype, shape and
values (``assert_trees_equal``), or the same raw bytes (``bits``: NaN payloads, -0.0 and typed
PRNG keys compare exactly)."""

import jax
import jax.numpy as jnp
import numpy as np


def assert_trees_equal(a, b, where=""):
    """Fails naming the leaf (``jax.tree_util.keystr``) whose dtype, shape or values differ;
    ``where`` starts every message."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"{where}: tree structures differ: {ta} != {tb}"
    for (path, x), (_, y) in zip(la, lb):
        leaf = f"{where}: leaf {jax.tree_util.keystr(path)}"
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{leaf}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
        )
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=leaf)


def bits(tree):
    """Every leaf as (dtype name, shape, raw bytes); a typed PRNG key as its key data."""

    def raw(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return (str(x.dtype), tuple(x.shape), np.asarray(jax.random.key_data(x)).tobytes())
        return (np.dtype(x.dtype).name, tuple(x.shape), np.asarray(x).tobytes())

    return [raw(x) for x in jax.tree_util.tree_leaves(tree)]
