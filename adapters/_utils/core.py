"""The adapters' one door to the functional core: its components' pure functions, jitted once
per (component config, layout) and cached, and the conversions between torch and the core's
arrays.

The adapters use the core for what it does best: the prioritized sum tree, slice records,
max-value ranks, n-step sums, hindsight goals. The adapters' torch-facing modules bind this one
with ``lazy_module`` (it imports JAX), so only the paths that use the core pay for JAX. Every call goes through this module, so the core's component protocol
(``init`` / ``write`` / ``on_add`` / ``sample`` / ``update`` / ``can_sample`` over a
:class:`functional_rb.protocol.Context`) is named in one place.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

import functional_rb as frb
from functional_rb import hindsight
from functional_rb import protocol as P
from functional_rb.ted import n_step_returns
from functional_rb.ted.flat import flat_to_ted_lines, ted_to_flat_lines

__all__ = ["Layout", "make_layout", "context", "init_writer", "init_sampler", "write",
           "on_add", "sample", "update", "can_sample", "to_numpy",
           "with_slice_len", "tree_values", "set_tree_values", "n_step_sums",
           "episode_limits", "goal_ages", "flat_to_ted_lines", "ted_to_flat_lines"]

Layout = P.Layout


def make_layout(capacity: int, num_envs: int = 1) -> Layout:
    """The core layout of ``capacity`` elements over ``num_envs`` rows of time."""
    return Layout(capacity=int(capacity), num_envs=int(num_envs),
                  row_capacity=int(capacity) // int(num_envs), ndim=1 if num_envs == 1 else 2)


def context(layout: Layout, filled, cursor) -> P.Context:
    return P.Context(layout=layout, filled=jnp.int32(filled), cursor=jnp.int32(cursor))


def to_numpy(x, dtype=None) -> np.ndarray:
    """Host numpy data for the core (torch tensors without a copy where possible)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    x = np.asarray(x)
    return x if dtype is None else x.astype(dtype, copy=False)


# ------------------------------------------------------------------ writers
def init_writer(core_writer, layout: Layout):
    return core_writer.init(layout)


@functools.lru_cache(maxsize=None)
def _jit_write(core_writer, layout: Layout):
    def f(state, items):
        record, new_state = core_writer.write(state, items, layout)
        return record.positions, record.mask, new_state
    return jax.jit(f)


def write(core_writer, layout: Layout, state, items):
    """``(positions int32 [B], mask bool [B], new state)`` of the core writer."""
    return _jit_write(core_writer, layout)(state, items)


def max_value_state(cursor: int, filled: int, ranks: np.ndarray):
    """A core max-value writer state holding ``ranks`` (float32 ``[capacity]``)."""
    return frb.MaxValueState(cursor=jnp.int32(cursor), filled=jnp.int32(filled),
                             ranks=jnp.asarray(ranks, jnp.float32))


# ------------------------------------------------------------------ samplers
def init_sampler(core_sampler, item_spec, layout: Layout, **kwargs):
    return core_sampler.init(item_spec, layout, **kwargs)


@functools.lru_cache(maxsize=None)
def _jit_on_add(core_sampler, layout: Layout, ring: bool):
    def f(state, positions, mask, items, filled, cursor, run_start):
        record = P.WriteRecord(positions=positions, mask=mask,
                               run_start=run_start if ring else None)
        return core_sampler.on_add(state, record, items, context(layout, filled, cursor))
    return jax.jit(f)


def on_add(core_sampler, layout: Layout, state, positions, mask, items, *, filled, cursor,
           run_start=None):
    """The sampler state after items were written at flat ``positions`` (where ``mask``);
    ``filled`` / ``cursor``: the ring after the write; ``run_start``: the first position
    when the positions are the ring run ``(run_start + arange(B)) % capacity``."""
    f = _jit_on_add(core_sampler, layout, run_start is not None)
    return f(state, np.asarray(positions, np.int32), np.asarray(mask, bool), items,
             np.int32(filled), np.int32(cursor), np.int32(0 if run_start is None else run_start))


@functools.lru_cache(maxsize=None)
def _jit_sample(core_sampler, layout: Layout, batch_size: int, options: tuple):
    def f(state, key, filled, cursor, *values):
        ctx = context(layout, filled, cursor)
        kw = dict(zip(options, values))
        ok = core_sampler.can_sample(state, ctx, batch_size)
        drawn, new_state = core_sampler.sample(state, key, batch_size, ctx, **kw)
        return drawn.indices, drawn.weights, drawn.mask & ok, new_state
    return jax.jit(f)


def sample(core_sampler, layout: Layout, state, key, batch_size: int, *, filled, cursor,
           **options):
    """``(indices, weights, mask)`` as numpy and the new sampler state."""
    names = tuple(sorted(options))
    f = _jit_sample(core_sampler, layout, int(batch_size), names)
    idx, w, m, new_state = f(state, key, np.int32(filled), np.int32(cursor),
                             *(options[n] for n in names))
    idx, w, m = jax.device_get((idx, w, m))
    return np.asarray(idx), np.asarray(w), np.asarray(m), new_state


@functools.lru_cache(maxsize=None)
def _jit_update(core_sampler, layout: Layout):
    def f(state, indices, priorities, filled, cursor):
        return core_sampler.update(state, indices, priorities, context(layout, filled, cursor))
    return jax.jit(f)


def update(core_sampler, layout: Layout, state, indices, priorities, *, filled, cursor):
    return _jit_update(core_sampler, layout)(
        state, np.asarray(indices, np.int32), np.asarray(priorities, np.float32),
        np.int32(filled), np.int32(cursor))


@functools.lru_cache(maxsize=None)
def _jit_can_sample(core_sampler, layout: Layout, batch_size: int):
    def f(state, filled, cursor):
        return core_sampler.can_sample(state, context(layout, filled, cursor), batch_size)
    return jax.jit(f)


def can_sample(core_sampler, layout: Layout, state, batch_size: int, *, filled, cursor) -> bool:
    return bool(_jit_can_sample(core_sampler, layout, int(batch_size))(
        state, np.int32(filled), np.int32(cursor)))


@functools.lru_cache(maxsize=None)
def _jit_with_slice_len(core_sampler, layout: Layout, slice_len: int):
    def f(state, filled, cursor):
        return core_sampler.with_slice_len(state, context(layout, filled, cursor), slice_len)
    return jax.jit(f)


def with_slice_len(core_sampler, layout: Layout, state, slice_len: int, *, filled, cursor):
    """A prioritized slice sampler's state converted to another slice length."""
    return _jit_with_slice_len(core_sampler, layout, int(slice_len))(
        state, np.int32(filled), np.int32(cursor))


# ------------------------------------------------------------------ sum trees
def tree_values(state, n: int) -> np.ndarray:
    """float32 ``[n]``: the leaves of a prioritized sampler state's sum tree."""
    return np.asarray(frb.sum_tree.get(state.tree, np.arange(n, dtype=np.int32)))


def set_tree_values(state, index, values):
    """The state with leaves ``index`` of its sum tree set to ``values`` (already
    ``(p + eps) ** alpha``)."""
    tree = frb.sum_tree.set(state.tree, np.asarray(index, np.int32),
                            np.asarray(values, np.float32))
    return dataclasses.replace(state, tree=tree)


# ------------------------------------------------------------------ slice samplers
def bind(core_sampler, batch_size: int):
    """The sampler resolved for a default batch size (``num_slices`` -> ``slice_len``)."""
    return core_sampler.bind(batch_size=int(batch_size))


# ------------------------------------------------------------------ hindsight (HER)
@jax.jit
def _limits(ends, filled):
    return hindsight.episode_limits(ends, filled)


_goal_ages = jax.jit(hindsight.goal_ages, static_argnames="strategy")


def episode_limits(ends: np.ndarray, n: int) -> tuple:
    """``(first, last)`` int arrays ``[n]``: each step's episode bounds by age, from the end
    flags ``ends`` (bool ``[rows]``, padded past ``n``)."""
    first, last = _limits(jnp.asarray(ends), jnp.int32(n))
    return np.asarray(first)[:n], np.asarray(last)[:n]


def goal_ages(u: np.ndarray, age: np.ndarray, first: np.ndarray, last: np.ndarray,
              strategy: str) -> np.ndarray:
    """The ages of the goals relabelling steps of ``age`` (uniform draws ``u``)."""
    return np.asarray(_goal_ages(jnp.asarray(u), jnp.asarray(age, jnp.int32),
                                 jnp.asarray(first), jnp.asarray(last), strategy=strategy))


# ------------------------------------------------------------------ n-step returns (MultiStep)
def n_step_sums(reward: torch.Tensor, done: torch.Tensor, n: int, gamma: float) -> tuple:
    """``(summed reward like reward, steps int64 like done)`` of each step of ``[*B, T]``
    (``reward`` may have trailing dims), from the core's ``n_step_returns`` over a buffer of
    ``[prod(B), T]`` rows."""
    *batch, steps = done.shape
    envs = math.prod(batch)
    if envs * steps == 0:
        raise ValueError(f"MultiStep: the batch {tuple(done.shape)} holds no step; pass a "
                         "batch [*B, T] with T >= 1.")
    if tuple(reward.shape[:done.ndim]) != tuple(done.shape):
        raise RuntimeError(f"MultiStep: the reward (shape {tuple(reward.shape)}) must start "
                           f"with the done's shape {tuple(done.shape)}.")
    trailing = tuple(reward.shape[done.ndim:])
    r = reward.detach().to("cpu", torch.float32).reshape(envs, steps, *trailing).numpy()
    d = done.detach().to("cpu").reshape(envs, steps).numpy() != 0
    items = {"next": {"reward": r, "done": d}}
    rb = frb.ReplayBuffer(capacity=envs * steps, ndim=2)
    state = _add(rb, rb.init({"next": {"reward": r[:, 0], "done": d[:, 0]}}), items)
    flat = np.arange(envs * steps, dtype=np.int32).reshape(envs, steps)
    out = n_step_returns(rb, state, flat, n=n, gamma=gamma, data=items,
                         reward_key=("next", "reward"), end_keys=(("next", "done"),))
    summed = torch.from_numpy(np.array(out["next"]["reward"])).reshape(reward.shape)
    count = torch.from_numpy(np.array(out["steps_to_next_obs"], np.int64)).reshape(done.shape)
    return summed.to(reward.device, reward.dtype), count.to(done.device)


@functools.partial(jax.jit, static_argnums=0)
def _add(rb, state, items):
    # compiled once per batch shape (the buffer is hashable); an eager add re-validates
    return rb.add(state, items)
