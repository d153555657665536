"""Helpers of the sharded tests: meshes over the first n devices, and sharded states built from
per-shard states (so shards can be filled unequally, as a single buffer would never be)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import functional_rb as frb


def mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def stack(srb, locals_):
    """A ShardedState whose shard ``s`` is ``locals_[s]`` (local states of ``srb.buffer``)."""
    shards = jax.tree_util.tree_map(
        lambda *xs: jax.device_put(np.stack([np.asarray(x) for x in xs]), srb.sharding), *locals_
    )
    return frb.ShardedState(shards=shards, axis_name=srb.axis_name, num_shards=srb.num_shards)


def unstack(state):
    """The per-shard local states of a ShardedState, as NumPy trees."""
    return [
        jax.tree_util.tree_map(lambda x, s=s: np.asarray(x)[s], state.shards)
        for s in range(state.num_shards)
    ]


def draws(srb, state, steps, seed=0, **options):
    """``steps`` global samples (eager calls: their compiled programs are cached per buffer
    configuration and shared by every test using it); returns the concatenated NumPy samples
    and the final state."""
    out = []
    for k in range(steps):
        smp, state = srb.sample(state, jax.random.key(seed * 1000 + k), **options)
        out.append(jax.tree_util.tree_map(np.asarray, smp))
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *out), state


@functools.cache
def _builder(rb, width: int):
    """A jitted ``(example, items [width, ...], fill, priorities [capacity]) -> local state``:
    the first ``fill`` items added one at a time (``fill`` traced: one compilation serves
    every shard, however unequally filled), then priorities set (prioritized samplers; empty
    slots are ignored by ``update``)."""

    def build(example, items, fill, priorities):
        state = rb.init(example)

        def body(st, i):
            new = rb.add(
                st, jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), items)
            )
            return jax.tree_util.tree_map(lambda a, b: jnp.where(i < fill, a, b), new, st), None

        state, _ = jax.lax.scan(body, state, jnp.arange(width))
        if priorities is not None:
            state = rb.update(state, jnp.arange(rb.capacity, dtype=jnp.int32), priorities)
        return state

    return jax.jit(build)


def build(srb, shards, priorities=None):
    """A ShardedState whose shard ``s`` holds ``shards[s]`` (a dict of leaves ``[N_s, ...]``, or
    the ``"id"`` ints alone), added in order (more than the capacity wraps around), with
    ``priorities[s]`` (``[capacity]`` floats) for prioritized samplers."""
    rb = srb.buffer
    trees = [sh if isinstance(sh, dict) else {"id": np.asarray(sh, np.int32)} for sh in shards]
    trees = [jax.tree_util.tree_map(np.asarray, t) for t in trees]
    width = max(8, max(len(jax.tree_util.tree_leaves(t)[0]) for t in trees))
    example = jax.tree_util.tree_map(lambda x: np.zeros(x.shape[1:], x.dtype), trees[0])
    fn = _builder(rb, width)
    locals_ = []
    for s, t in enumerate(trees):
        fill = len(jax.tree_util.tree_leaves(t)[0])
        padded = jax.tree_util.tree_map(
            lambda x, fill=fill: np.concatenate(
                [x, np.zeros((width - fill,) + x.shape[1:], x.dtype)]
            ),
            t,
        )
        p = None if priorities is None else np.asarray(priorities[s], np.float32)
        locals_.append(fn(example, padded, fill, p))
    return stack(srb, locals_)


# The buffer configurations the tests share: a compiled program is cached per configuration
# (and mesh), and compiling dominates these tests, so the tests reuse a few.
CAP = 16
EXAMPLE = {"id": np.int32(0)}
UNIFORM = frb.ReplayBuffer(CAP, batch_size=64)
PRIO = frb.ReplayBuffer(CAP, sampler=frb.PrioritizedSampler(alpha=0.7, beta=0.5), batch_size=64)
WOR = frb.ReplayBuffer(CAP, sampler=frb.SamplerWithoutReplacement(), batch_size=4)
