"""The adapters' JAX programs: the four places the TorchRL adapters use the functional core.

Everything else in the adapters runs on torch and NumPy. These paths are better served by the
core, so they call it, each program jitted once and cached:

- ``TensorDictMaxValueWriter``: the core's ``MaxValueWriter`` ranks (:func:`write`);
- ``HERReplayBuffer``: episode limits and goal ages (:func:`episode_limits`, :func:`goal_ages`);
- ``MultiStep``: n-step sums through ``functional_rb.ted.n_step_returns`` (:func:`n_step_sums`);
- ``TED2Flat`` / ``Flat2TED``: the core's flat <-> TED conversion (:func:`ted_to_flat_lines`,
  :func:`flat_to_ted_lines`).

The modules that use it bind it with ``lazy_module``, so a program that never reaches them
never imports JAX.
"""

from __future__ import annotations

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

__all__ = [
    "make_layout",
    "init_writer",
    "write",
    "max_value_state",
    "n_step_sums",
    "episode_limits",
    "goal_ages",
    "flat_to_ted_lines",
    "ted_to_flat_lines",
]


def make_layout(capacity: int, num_envs: int = 1) -> P.Layout:
    """The core layout of ``capacity`` elements over ``num_envs`` rows of time."""
    return P.Layout(
        capacity=int(capacity),
        num_envs=int(num_envs),
        row_capacity=int(capacity) // int(num_envs),
        ndim=1 if num_envs == 1 else 2,
    )


# ------------------------------------------------------------------ writers
def init_writer(core_writer, layout: P.Layout):
    return core_writer.init(layout)


@functools.cache
def _jit_write(core_writer, layout: P.Layout):
    def f(state, items):
        record, new_state = core_writer.write(state, items, layout)
        return record.positions, record.mask, new_state

    return jax.jit(f)


def write(core_writer, layout: P.Layout, state, items):
    """``(positions int32 [B], mask bool [B], new state)`` of the core writer."""
    return _jit_write(core_writer, layout)(state, items)


def max_value_state(cursor: int, filled: int, ranks: np.ndarray):
    """A core max-value writer state holding ``ranks`` (float32 ``[capacity]``)."""
    return frb.MaxValueState(
        cursor=jnp.int32(cursor), filled=jnp.int32(filled), ranks=jnp.asarray(ranks, jnp.float32)
    )


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


def goal_ages(
    u: np.ndarray, age: np.ndarray, first: np.ndarray, last: np.ndarray, strategy: str
) -> np.ndarray:
    """The ages of the goals relabelling steps of ``age`` (uniform draws ``u``)."""
    return np.asarray(
        _goal_ages(
            jnp.asarray(u),
            jnp.asarray(age, jnp.int32),
            jnp.asarray(first),
            jnp.asarray(last),
            strategy=strategy,
        )
    )


# ------------------------------------------------------------------ n-step returns (MultiStep)
def n_step_sums(reward: torch.Tensor, done: torch.Tensor, n: int, gamma: float) -> tuple:
    """``(summed reward like reward, steps int64 like done)`` of each step of ``[*B, T]``
    (``reward`` may have trailing dims), from the core's ``n_step_returns`` over a buffer of
    ``[prod(B), T]`` rows."""
    *batch, steps = done.shape
    envs = math.prod(batch)
    if envs * steps == 0:
        raise ValueError(
            f"MultiStep: the batch {tuple(done.shape)} holds no step; pass a "
            "batch [*B, T] with T >= 1."
        )
    if tuple(reward.shape[: done.ndim]) != tuple(done.shape):
        raise RuntimeError(
            f"MultiStep: the reward (shape {tuple(reward.shape)}) must start "
            f"with the done's shape {tuple(done.shape)}."
        )
    trailing = tuple(reward.shape[done.ndim :])
    r = reward.detach().to("cpu", torch.float32).reshape(envs, steps, *trailing).numpy()
    d = done.detach().to("cpu").reshape(envs, steps).numpy() != 0
    items = {"next": {"reward": r, "done": d}}
    rb = frb.ReplayBuffer(capacity=envs * steps, ndim=2)
    state = _add(rb, rb.init({"next": {"reward": r[:, 0], "done": d[:, 0]}}), items)
    flat = np.arange(envs * steps, dtype=np.int32).reshape(envs, steps)
    out = n_step_returns(
        rb,
        state,
        flat,
        n=n,
        gamma=gamma,
        data=items,
        reward_key=("next", "reward"),
        end_keys=(("next", "done"),),
    )
    summed = torch.from_numpy(np.array(out["next"]["reward"])).reshape(reward.shape)
    count = torch.from_numpy(np.array(out["steps_to_next_obs"], np.int64)).reshape(done.shape)
    return summed.to(reward.device, reward.dtype), count.to(done.device)


@functools.partial(jax.jit, static_argnums=0)
def _add(rb, state, items):
    # compiled once per batch shape (the buffer is hashable); an eager add re-validates
    return rb.add(state, items)
