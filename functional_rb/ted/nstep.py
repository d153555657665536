"""n-step returns read from a buffer (TorchRL's ``MultiStep`` targets): any storage."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functional_rb._internal.errors import config_int
from functional_rb._internal.tree import Key, get_key, has_key, normalize_key, set_key

PyTree = Any

_END_KEYS = (("next", "done"), ("next", "truncated"))


def _mod(x, m: int):
    return jnp.mod(x, jnp.int32(m))


def n_step_returns(
    rb,
    state,
    indices,
    *,
    n: int,
    gamma,
    data: PyTree = None,
    reward_key: Key = ("next", "reward"),
    end_keys: Sequence[Key] = _END_KEYS,
) -> PyTree:
    """TorchRL's MultiStep targets for sampled steps, read from the buffer (jittable).

    For each sampled step ``t`` (flat ``indices``, int32 ``[...]``, e.g. ``Sample.indices``)
    let ``m`` be the number of steps summed: the steps ``t, t+1, ..., t+m-1`` of the same env
    row, at most ``n``, stopping after the first episode end (any of ``end_keys`` True) and at
    the newest stored step. Returns the items at ``indices`` (``data`` if given, e.g.
    ``Sample.data``; else ``rb.get``) with:

    - ``reward_key``: ``sum_{i<m} gamma**i * r_{t+i}`` (shape of the reward leaf);
    - ``("next", "original_reward")``: the one-step reward (TorchRL's name);
    - every other ``"next"`` leaf (next observation or its frame stack, done, terminated,
      truncated) taken from step ``t+m-1``: the n-step successor and its flags;
    - ``"steps_to_next_obs"``: int32 ``[...]``, ``m``;
    - ``"gamma"``: float32 ``[...]``, ``gamma ** m``: bootstrap with
      ``r_n + gamma_n * (1 - terminated) * V(next)``.

    Same sums, ``steps_to_next_obs`` and next observations as TorchRL's ``MultiStepTransform``
    (``n_steps=n``); where TorchRL leaves the done flags of step ``t`` untouched, here they are
    those of step ``t+m-1``, which is what the bootstrap needs. TorchRL delays writing a step
    until ``n`` successors exist; here the newest steps use the ones stored so far
    (``steps_to_next_obs`` < n) and their real next observation, so the target stays valid.
    Works with any storage (the TED storage rebuilds the next observations) and ``ndim=2``.
    ``n`` is a Python int; ``gamma`` may be traced.
    """
    config_int("n_step_returns", "n", n)
    idx = jnp.asarray(indices, jnp.int32)
    if data is None:
        data = rb.get(state, idx)
    return _n_step(
        rb,
        n,
        normalize_key(reward_key),
        tuple(normalize_key(k) for k in end_keys),
        state,
        idx,
        data,
        jnp.asarray(gamma, jnp.float32),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _n_step(rb, n, reward_key, end_keys, state, idx, data, gamma):
    ctx = rb.context(state)
    lay = ctx.layout
    r_cap = lay.row_capacity
    env, t = lay.from_flat(idx)
    age = _mod(t - (ctx.cursor - ctx.filled), r_cap)
    i = jnp.arange(n, dtype=jnp.int32).reshape((1,) * idx.ndim + (n,))
    steps = lay.to_flat(env[..., None], _mod(t[..., None] + i, r_cap))  # [..., n]
    window = rb.get(state, steps)
    reward = jnp.asarray(get_key(window, reward_key, where="n_step_returns"))
    end = jnp.zeros(steps.shape, bool)
    for key in end_keys:
        if has_key(window, key):
            x = jnp.asarray(get_key(window, key, where="n_step_returns"))
            end = end | jnp.any(x.reshape(steps.shape + (-1,)) != 0, axis=-1)
    stored = (age[..., None] + i) < ctx.filled
    ended_before = jnp.concatenate(
        [
            jnp.zeros(end.shape[:-1] + (1,), bool),
            jax.lax.cummax(end.astype(jnp.int32), axis=end.ndim - 1)[..., :-1] > 0,
        ],
        axis=-1,
    )
    cont = stored & ~ended_before
    cont = cont.at[..., 0].set(True)  # the sampled step itself always counts
    m = jnp.sum(cont, axis=-1, dtype=jnp.int32)
    disc = jnp.where(cont, gamma ** i.astype(jnp.float32), 0.0)
    disc = disc.reshape(disc.shape + (1,) * (reward.ndim - disc.ndim))
    summed = jnp.sum(disc * reward.astype(jnp.float32), axis=idx.ndim).astype(reward.dtype)
    last = jnp.take_along_axis(steps, (m - 1)[..., None], axis=-1)[..., 0]
    later = rb.get(state, last)
    out = dict(data)
    out["next"] = dict(later["next"])
    out = set_key(
        out, ("next", "original_reward"), get_key(data, reward_key, where="n_step_returns")
    )
    out = set_key(out, reward_key, summed)
    out["steps_to_next_obs"] = m
    out["gamma"] = gamma ** m.astype(jnp.float32)
    return out
