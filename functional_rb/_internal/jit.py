"""One decorator for component methods that run as one compiled function, the cheapest copy
of host arrays to the device, a boundary XLA does not fuse across, and small reads of large
arrays that XLA's CPU backend runs on one thread, and which of a traced function's outputs
are its inputs, passed through."""

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


# XLA's CPU compiler splits a kernel across its intra-op threads once the bytes its cost model
# says the kernel touches reach two tasks' worth (256 KiB each).
SPLIT_BYTES = 512 << 10


def read_whole(read, source: jax.Array, indices: jax.Array) -> jax.Array:
    """``read()``, a small read of the large array ``source``, as kernels XLA runs whole.

    ``read``: a function of no arguments returning one array (a gather of some rows of
    ``source``, and what is computed from them); ``indices``: integer indices it reads, any
    shape and values (before clipping: their first is a value XLA cannot foresee).

    Why: XLA's CPU compiler splits a kernel across threads by the bytes its cost model says
    the kernel touches, and for a gather that is the whole array it reads from: a read of 256
    rows from a buffer of 10^8 items runs as two tasks, one handed to another thread. That
    hand-over costs more than the rows (on a 2-CPU machine 10-20 us a kernel against a few
    for the read; ``benchmarks/NOTES.md``, "Reads that XLA split"). XLA never splits a
    fusion whose root writes a window (``dynamic_update_slice``), and a ``lax.cond``'s
    result is not fused into what reads it. So the read is written into row 0 of a buffer of
    two (at ``min(i, 0)``, which the write clamps to 0, for the first index ``i``), inside a
    cond on ``i >= 0`` whose other branch reads plainly: both give ``read()``'s values, whichever
    runs. Off the CPU, for a ``source`` XLA would not split anyway, or a read that moves
    enough bytes to gain from two threads, it is ``read()``.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(400_000, dtype=jnp.float32).reshape(-1, 4)
    >>> i = jnp.array([3, 99_999])
    >>> read_whole(lambda: x[i], x, i).tolist() == x[i].tolist()
    True
    """
    indices = jnp.asarray(indices)
    if (
        jax.default_backend() != "cpu"
        or source.size * source.dtype.itemsize < SPLIT_BYTES
        or not indices.size
    ):
        return read()
    out = jax.eval_shape(read)  # traced for its shape only where it may be kept whole
    if 2 * out.size * out.dtype.itemsize >= SPLIT_BYTES:
        return read()
    index = indices.reshape(-1)[0].astype(jnp.int32)
    rows = (2,) + tuple(out.shape)

    def whole():
        return jax.lax.dynamic_update_index_in_dim(
            jnp.zeros(rows, out.dtype), read(), jnp.minimum(index, 0), 0
        )

    def plain():
        return jnp.stack([read(), jnp.zeros(out.shape, out.dtype)])

    return jax.lax.cond(index >= 0, whole, plain)[0]


def passed_through(closed) -> list:
    """For each output of the traced function ``closed`` (a ``jax.make_jaxpr`` result), the
    position of the input it returns unchanged, or None: an output computed in any way, or
    routed through a conditional or a loop, is None. Calls of inner ``jit``-compiled functions
    (the component methods of :func:`compiled`) are followed.

    >>> closed = jax.make_jaxpr(lambda a, b: (b, a + 1, jax.jit(lambda x: x)(a)))(1.0, 2.0)
    >>> passed_through(closed)
    [1, None, 0]
    """
    return _forwarded(closed.jaxpr)


def _forwarded(jaxpr) -> list:
    source = {id(v): i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
        if inner is None:
            continue
        for out, k in zip(eqn.outvars, _forwarded(getattr(inner, "jaxpr", inner))):
            if k is not None and id(eqn.invars[k]) in source:
                source[id(out)] = source[id(eqn.invars[k])]
    return [source.get(id(v)) for v in jaxpr.outvars]
