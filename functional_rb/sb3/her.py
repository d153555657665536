"""SB3's ``HerReplayBuffer`` (hindsight experience replay) on a core buffer.

A drop-in for ``stable_baselines3.HerReplayBuffer``: SB3's constructor, attributes, methods
and warnings; it subclasses SB3's class, so ``replay_buffer_class=`` gets the ``env`` that SB3's
off-policy algorithms hand a HER buffer, and ``load_replay_buffer`` calls ``set_env`` and
``truncate_last_trajectory`` on it. Seeded runs draw the same transitions and goals as SB3's
buffer, bit for bit: NumPy's global generator is called as SB3 calls it (the transitions with
``np.random.choice`` over the sampleable steps, then the goals with ``np.random.randint``), and
the goal arithmetic is SB3's NumPy formula. (:mod:`functional_rb.hindsight` does not fit it:
it draws with a JAX key and TorchRL's ``floor(u * span)``, and it samples unfinished episodes,
ending them at the write head, where SB3 samples finished episodes only.)

Where the episode bookkeeping lives, and why:

- ``ep_start`` and ``ep_length`` (SB3: two host ``int64 [buffer_size, n_envs]`` arrays) are two
  ``int32`` fields of the core item, beside the transition: one storage, one pickle, one
  checkpoint, and what is sampled is decided on the device. ``ep_start`` is written with its
  step. ``ep_length`` is rewritten in past steps (an episode's end gives all its steps their
  length; overwriting an episode's first step zeroes the rest of it), and
  ``truncate_last_trajectory`` also sets the newest ``dones`` and ``timeouts``: those writes go
  through :meth:`functional_rb.sb3._grid.Grid.write`, a jitted scatter into the core state (one
  per ``add`` that ends or overwrites an episode). ``add`` must know the bookkeeping of the
  step it overwrites: it reads it from the core 256 steps ahead at once and keeps that window
  in step with its own writes (a cache, not a second copy of the buffer). The other price,
  against host arrays: a pass over ``ep_length`` on the device per ``sample`` (SB3 makes one
  on the host), by blocks, so that only the count of sampleable steps crosses to the host for
  ``np.random.choice``.
- ``infos`` (Python dicts, stored when ``copy_info_dict``) and ``_current_ep_start`` stay host
  NumPy arrays, as in SB3. ``ep_start``, ``ep_length`` and SB3's array attributes are read-only
  copies in SB3's layout and dtypes.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.common.vec_env import VecEnv, VecNormalize
from stable_baselines3.her import her_replay_buffer as _sb3_her
from stable_baselines3.her.goal_selection_strategy import (
    KEY_TO_GOAL_STRATEGY,
    GoalSelectionStrategy,
)

from functional_rb.sb3.buffers import DictReplayBuffer

__all__ = ["HerReplayBuffer"]

_STEP_FIELDS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
_EPISODE_FIELDS = ("ep_start", "ep_length")


# The sampleable steps are counted by blocks of SB3's order: a cumulative sum over the whole
# buffer is slow on XLA's CPU (5 ms at 10**6 steps, against 0.5 ms for the block sums); the
# blocks holding the draws are read again, 128 steps per draw.
_BLOCK = 128


def _valid(rb, n_envs: int, state, i: jax.Array) -> jax.Array:
    """Whether SB3's flat indices ``i = t * n_envs + env`` are sampleable (``ep_length > 0``;
    False past the end)."""
    size = rb.capacity
    flat = (i % n_envs) * (size // n_envs) + i // n_envs  # the core's env-major position
    return (rb.get(state, jnp.minimum(flat, size - 1))["ep_length"] > 0) & (i < size)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block_counts(rb, n_envs: int, state) -> tuple[jax.Array, jax.Array]:
    """The running count of sampleable steps at each block's end, in SB3's order (int32
    ``[blocks]``), and their number."""
    blocks = -(-rb.capacity // _BLOCK)
    i = jnp.arange(blocks * _BLOCK, dtype=jnp.int32).reshape(blocks, _BLOCK)
    block_end = jnp.cumsum(_valid(rb, n_envs, state, i).sum(axis=1, dtype=jnp.int32))
    return block_end, block_end[-1]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _kth_valid(rb, n_envs: int, state, block_end: jax.Array, k: jax.Array) -> jax.Array:
    """SB3's ``np.flatnonzero(ep_length > 0)[k]`` (int32 ``[B]``), from the block counts."""
    block = jnp.searchsorted(block_end, k + 1, side="left").astype(jnp.int32)
    i = block[:, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)[None, :]
    rows = _valid(rb, n_envs, state, i)  # [B, _BLOCK]
    before = block_end[block] - rows.sum(axis=1, dtype=jnp.int32)
    within = jnp.cumsum(rows, axis=1, dtype=jnp.int32)
    column = jnp.argmax(within >= (k - before + 1)[:, None], axis=1).astype(jnp.int32)
    return block * _BLOCK + column


# ignore[override] below: read-only arrays (see DictReplayBuffer)
class HerReplayBuffer(DictReplayBuffer, _sb3_her.HerReplayBuffer):  # type: ignore[override]
    """SB3's ``HerReplayBuffer`` on a core buffer: SB3's arguments, plus ``output=``
    (``"torch"``, ``"jax"`` or ``"numpy"``, see :class:`functional_rb.sb3.ReplayBuffer`).

    Pass it as ``replay_buffer_class`` of SB3's off-policy algorithms, as SB3's own.

    >>> import numpy as np
    >>> from stable_baselines3.common.env_util import make_vec_env
    >>> from stable_baselines3.common.envs import BitFlippingEnv
    >>> from functional_rb.sb3 import HerReplayBuffer
    >>> venv = make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True), 1, seed=0)
    >>> rb = HerReplayBuffer(100, venv.observation_space, venv.action_space, venv,
    ...                      device="cpu", goal_selection_strategy="final")
    >>> obs = venv.reset()
    >>> for _ in range(4):  # one episode: BitFlippingEnv ends after n_bits steps
    ...     action = np.ones((1, 4), np.float32)
    ...     next_obs, reward, done, info = venv.step(action)
    ...     rb.add(obs, next_obs, action, reward, done, info)
    ...     obs = next_obs
    >>> rb.ep_length[:4, 0].tolist(), rb.ep_start[:4, 0].tolist()
    ([4, 4, 4, 4], [0, 0, 0, 0])
    >>> batch = rb.sample(8)  # 6 of 8 relabelled (n_sampled_goal=4)
    >>> tuple(batch.rewards.shape), sorted(batch.observations)
    ((8, 1), ['achieved_goal', 'desired_goal', 'observation'])
    """

    env: VecEnv | None
    _window = 256  # steps of episode bookkeeping read ahead at once (_old_episodes)

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        env: VecEnv,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        n_sampled_goal: int = 4,
        goal_selection_strategy: GoalSelectionStrategy | str = "future",
        copy_info_dict: bool = False,
        *,
        output: str = "torch",
    ):
        # SB3's HerReplayBuffer.__init__ would allocate SB3's arrays: not called
        DictReplayBuffer.__init__(
            self,
            buffer_size,
            observation_space,
            action_space,
            device=device,
            n_envs=n_envs,
            optimize_memory_usage=optimize_memory_usage,
            handle_timeout_termination=handle_timeout_termination,
            output=output,
        )
        self.env = env
        self.copy_info_dict = copy_info_dict
        if isinstance(goal_selection_strategy, str):
            self.goal_selection_strategy = KEY_TO_GOAL_STRATEGY[goal_selection_strategy.lower()]
        else:
            self.goal_selection_strategy = goal_selection_strategy
        assert isinstance(self.goal_selection_strategy, GoalSelectionStrategy), (
            f"Invalid goal selection strategy, please use one of {list(GoalSelectionStrategy)}"
        )
        self.n_sampled_goal = n_sampled_goal
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        self.infos = np.array([[{} for _ in range(self.n_envs)] for _ in range(self.buffer_size)])
        self._current_ep_start = np.zeros(self.n_envs, dtype=np.int64)
        # (first t, ep_start and ep_length int64 [window, n_envs]): see _old_episodes
        self._ahead: tuple | None = None

    def _example(self) -> dict:
        step = super()._example()
        step["ep_start"] = np.zeros(self.n_envs, np.int32)
        step["ep_length"] = np.zeros(self.n_envs, np.int32)
        return step

    # ------------------------------------------------------------------ SB3's arrays
    @property
    def ep_start(self) -> np.ndarray:  # type: ignore[override]  # read-only: the core's rows
        return self._episode_column("ep_start")

    @property
    def ep_length(self) -> np.ndarray:  # type: ignore[override]  # read-only: the core's rows
        return self._episode_column("ep_length")

    def _episode_column(self, name: str) -> np.ndarray:
        x = np.array(self._column(name), dtype=np.int64)  # SB3's dtype, a plain copy
        x.flags.writeable = False
        return x

    # ------------------------------------------------------------------ adding
    def add(  # type: ignore[override]
        self,
        obs: dict[str, np.ndarray],
        next_obs: dict[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        # SB3's order: zero the rest of an old episode whose first step is overwritten, store
        # the step (ep_start: the current episode's), then give a finished episode its length
        step = self._step(obs, next_obs, action, reward, done, infos)
        old_start, old_length = self._old_episodes()
        lengths: list = []  # (t, env, ep_length) writes, later ones win
        for old_env in np.flatnonzero(old_length > 0):
            episode_end = old_start[old_env] + old_length[old_env]
            lengths.append((np.arange(self.pos, episode_end) % self.buffer_size, old_env, 0))
        if self.copy_info_dict:
            self.infos[self.pos] = infos
        zeroed = (old_length > 0) & (old_start + old_length > self.pos)
        step["ep_start"] = self._current_ep_start.astype(np.int32)
        step["ep_length"] = np.where(zeroed, 0, old_length).astype(np.int32)
        self._note(self.pos, np.arange(self.n_envs), step["ep_start"], step["ep_length"])
        self.pos, self.full = self._grid.stage(self._leaves(step), self.pos, self.full)
        for env_idx in range(self.n_envs):
            if done[env_idx]:
                self._compute_episode_length(env_idx, lengths)
        self._write_lengths(lengths)

    def _old_episodes(self) -> tuple[np.ndarray, np.ndarray]:
        """``ep_start`` and ``ep_length`` (int64 ``[n_envs]``) of the steps at ``pos``, about
        to be overwritten. Read from the core for a window of steps from ``pos`` on at once
        (one call per window, not per ``add``), which this buffer's writes keep up to date."""
        ahead = self._ahead
        if ahead is None or (self.pos - ahead[0]) % self.buffer_size >= len(ahead[1]):
            t = (self.pos + np.arange(min(self._window, self.buffer_size))) % self.buffer_size
            data = self._read(t[:, None], np.arange(self.n_envs)[None, :], _EPISODE_FIELDS)
            ahead = (self.pos, data["ep_start"].astype(np.int64))
            ahead = self._ahead = (*ahead, data["ep_length"].astype(np.int64))
        i = (self.pos - ahead[0]) % self.buffer_size
        return ahead[1][i], ahead[2][i]

    def _note(self, t, env, start=None, length=None) -> None:
        """Keep the window of :meth:`_old_episodes` equal to the core after a write."""
        if self._ahead is None:
            return
        first, starts, lengths = self._ahead
        t, env = np.broadcast_arrays(np.asarray(t), np.asarray(env))
        i = (t - first) % self.buffer_size
        inside = i < len(starts)
        for values, column in ((start, starts), (length, lengths)):
            if values is not None:
                column[i[inside], env[inside]] = np.broadcast_to(values, i.shape)[inside]

    def extend(self, *args, **kwargs) -> None:
        """Add steps one at a time (SB3's ``extend``: each goes through :meth:`add`)."""
        for data in zip(*args, strict=True):
            self.add(*data)

    def _compute_episode_length(self, env_idx: int, pending: list | None = None) -> None:
        """SB3's: the episode of env ``env_idx`` that ends at ``pos`` gets its length in each
        of its steps, and the next one starts at ``pos``. ``pending``: queue the write there
        rather than writing now."""
        episode_start = self._current_ep_start[env_idx]
        episode_end = self.pos
        if episode_end < episode_start:
            # the storage resumed at the beginning of the buffer within the episode
            episode_end += self.buffer_size
        episode_indices = np.arange(episode_start, episode_end) % self.buffer_size
        write = (episode_indices, env_idx, episode_end - episode_start)
        self._current_ep_start[env_idx] = self.pos
        if pending is None:
            self._write_lengths([write])
        else:
            pending.append(write)

    def _write_lengths(self, writes: list) -> None:
        """Write ``(t, env, ep_length)`` triples (``t`` an array) in one scatter; where two
        write the same step, the later wins (SB3's sequential assignments)."""
        if not writes:
            return
        t = np.concatenate([np.asarray(w[0], np.int64).reshape(-1) for w in writes])
        env = np.concatenate([np.full(np.size(w[0]), w[1]) for w in writes])
        value = np.concatenate([np.full(np.size(w[0]), w[2]) for w in writes])
        key = t * self.n_envs + env
        _, first_of_reversed = np.unique(key[::-1], return_index=True)
        last = len(key) - 1 - first_of_reversed
        self._grid.write(t[last], env[last], {"ep_length": value[last]})
        self._note(t[last], env[last], length=value[last])

    def truncate_last_trajectory(self) -> None:
        """SB3's: end the unfinished episode of each env at the newest step (``done``; with
        ``handle_timeout_termination`` also ``timeout``, so it bootstraps), so it can be
        sampled. Call it when the next step added does not continue that episode."""
        unfinished = np.where(self._current_ep_start != self.pos)[0]
        if len(unfinished) == 0:
            return
        warnings.warn(
            "The last trajectory in the replay buffer will be truncated.\n"
            "If you are in the same episode as when the replay buffer was saved,\n"
            "you should use `truncate_last_trajectory=False` to avoid that issue.",
            stacklevel=2,
        )
        last = np.full(len(unfinished), (self.pos - 1) % self.buffer_size)
        flags = np.ones(len(unfinished), np.float32)
        self._grid.write(last, unfinished, {"dones": flags})
        lengths: list = []
        for env_idx in unfinished:
            self._compute_episode_length(int(env_idx), lengths)
        self._write_lengths(lengths)
        if self.handle_timeout_termination:
            # not an actual timeout, but it allows bootstrapping
            self._grid.write(last, unfinished, {"timeouts": flags})

    def _host_rows(self) -> bool:
        return False  # episode lengths and goals are found by compiled reads of every row

    # ------------------------------------------------------------------ sampling
    def sample(  # type: ignore[override]
        self, batch_size: int, env: VecNormalize | None = None
    ) -> DictReplayBufferSamples:
        """SB3's: ``batch_size`` steps of finished episodes, uniformly with replacement; the
        first ``int(her_ratio * batch_size)`` get a new goal and its reward (virtual), the
        others are as stored (real). Returned real first, then virtual."""
        self._grid.sync(self.pos, self.full)
        self._grid.flush()  # the staged steps, into the state read here
        rb, state = self._grid.rb, self._grid.state
        block_end, count = _block_counts(rb, self.n_envs, state)
        if int(count) == 0:
            raise RuntimeError(
                "Unable to sample before the end of the first episode. We recommend choosing a "
                "value for learning_starts that is greater than the maximum number of timesteps "
                "in the environment."
            )
        # SB3: np.random.choice(np.flatnonzero(is_valid), batch_size); the same draw
        k = np.random.choice(int(count), size=batch_size, replace=True)
        sampled_indices = np.asarray(
            _kth_valid(rb, self.n_envs, state, block_end, k.astype(np.int32))
        )
        batch_indices, env_indices = np.unravel_index(
            sampled_indices, (self.buffer_size, self.n_envs)
        )
        nb_virtual = int(self.her_ratio * batch_size)
        virtual_batch_indices, real_batch_indices = np.split(batch_indices, [nb_virtual])
        virtual_env_indices, real_env_indices = np.split(env_indices, [nb_virtual])
        real = self._real(real_batch_indices, real_env_indices, env)
        virtual = self._virtual(virtual_batch_indices, virtual_env_indices, env)
        both = jax.tree_util.tree_map(lambda a, b: np.concatenate((a, b)), real, virtual)
        return self._pack(**both)

    def _get_real_samples(
        self, batch_indices: np.ndarray, env_indices: np.ndarray, env: VecNormalize | None = None
    ) -> DictReplayBufferSamples:
        """The stored transitions at ``(batch_indices, env_indices)``."""
        return self._pack(**self._real(batch_indices, env_indices, env))

    def _get_virtual_samples(
        self, batch_indices: np.ndarray, env_indices: np.ndarray, env: VecNormalize | None = None
    ) -> DictReplayBufferSamples:
        """The transitions at ``(batch_indices, env_indices)`` with new goals and rewards."""
        return self._pack(**self._virtual(batch_indices, env_indices, env))

    def _real(self, batch_indices, env_indices, env=None) -> dict:
        return self._transitions(self._read(batch_indices, env_indices, _STEP_FIELDS), env)

    def _virtual(self, batch_indices, env_indices, env=None) -> dict:
        data = self._read(batch_indices, env_indices, _STEP_FIELDS + _EPISODE_FIELDS)
        obs, next_obs = dict(data["observations"]), dict(data["next_observations"])
        if self.copy_info_dict:
            infos = copy.deepcopy(self.infos[batch_indices, env_indices])  # may be slow
        else:
            infos = [{} for _ in range(len(batch_indices))]
        new_goals = self._sample_goals(batch_indices, env_indices, episodes=data)
        obs["desired_goal"] = new_goals
        # the desired goal of the next observation is the same
        next_obs["desired_goal"] = new_goals
        assert self.env is not None, (
            "You must initialize HerReplayBuffer with a VecEnv so it can compute rewards for "
            "virtual transitions"
        )
        # r_t = reward(next achieved goal, new desired goal), with the first env's method
        rewards = self.env.env_method(
            "compute_reward", next_obs["achieved_goal"], obs["desired_goal"], infos, indices=[0]
        )
        data.update(
            observations=obs, next_observations=next_obs, rewards=rewards[0].astype(np.float32)
        )
        return self._transitions(data, env)

    def _sample_goals(
        self, batch_indices: np.ndarray, env_indices: np.ndarray, episodes: dict | None = None
    ) -> np.ndarray:
        """SB3's goals: the next achieved goal of a step of the same episode (``final``: its
        last; ``future``: one from the step on; ``episode``: any). ``episodes``: the steps'
        ``ep_start`` and ``ep_length`` if already read."""
        if episodes is None:
            episodes = self._read(batch_indices, env_indices, _EPISODE_FIELDS)
        batch_ep_start = episodes["ep_start"].astype(np.int64)
        batch_ep_length = episodes["ep_length"].astype(np.int64)
        if self.goal_selection_strategy == GoalSelectionStrategy.FINAL:
            transition_indices_in_episode = batch_ep_length - 1
        elif self.goal_selection_strategy == GoalSelectionStrategy.FUTURE:
            # inclusive: the current transition can be drawn
            current_indices_in_episode = (batch_indices - batch_ep_start) % self.buffer_size
            transition_indices_in_episode = np.random.randint(
                current_indices_in_episode, batch_ep_length
            )
        elif self.goal_selection_strategy == GoalSelectionStrategy.EPISODE:
            transition_indices_in_episode = np.random.randint(0, batch_ep_length)
        else:
            raise ValueError(
                f"Strategy {self.goal_selection_strategy} for sampling goals not supported!"
            )
        transition_indices = (transition_indices_in_episode + batch_ep_start) % self.buffer_size
        goals = self._read(transition_indices, env_indices, ("next_observations",))
        return goals["next_observations"]["achieved_goal"]

    # ------------------------------------------------------------------ persistence
    def __getstate__(self) -> dict[str, Any]:
        """The core state (see :class:`functional_rb.sb3.ReplayBuffer`); without ``env``, as
        SB3 (call ``set_env`` after unpickling)."""
        state = super().__getstate__()
        del state["env"]
        state["_ahead"] = None  # a cache of the core's contents
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        assert "env" not in state
        super().__setstate__(state)
        self.env = None

    @classmethod
    def from_sb3(  # type: ignore[override]  # takes SB3's HerReplayBuffer (and its env)
        cls, buffer: _sb3_her.HerReplayBuffer, env: VecEnv | None = None, **kwargs
    ):
        """This class holding the contents of SB3's HER ``buffer`` (e.g. one SB3 pickled);
        ``env``: the VecEnv (default: ``buffer.env``, None after unpickling)."""
        n = buffer.n_envs
        new = cls(
            buffer.buffer_size * n,
            buffer.observation_space,
            buffer.action_space,
            env if env is not None else buffer.env,  # type: ignore[arg-type]  # None: unpickled
            device=buffer.device,
            n_envs=n,
            handle_timeout_termination=buffer.handle_timeout_termination,
            n_sampled_goal=buffer.n_sampled_goal,
            goal_selection_strategy=buffer.goal_selection_strategy,
            copy_info_dict=buffer.copy_info_dict,
            **kwargs,
        )
        columns = {k: buffer.__dict__[k] for k in _STEP_FIELDS}
        columns["actions"] = columns["actions"].reshape(buffer.buffer_size, n, new.action_dim)
        for k in _EPISODE_FIELDS:
            columns[k] = buffer.__dict__[k].astype(np.int32)
        new._grid.load_columns(columns, buffer.pos, buffer.full)
        new.pos, new.full = buffer.pos, buffer.full
        new.infos = buffer.infos.copy()
        new._current_ep_start = np.array(buffer._current_ep_start, np.int64)
        return new

    def save_checkpoint(self, path) -> None:
        """:meth:`functional_rb.sb3.ReplayBuffer.save_checkpoint`, with ``_current_ep_start``.
        ``infos`` are Python objects: with ``copy_info_dict`` pickle the buffer instead."""
        if self.copy_info_dict:
            raise ValueError(
                "functional_rb.sb3 HerReplayBuffer.save_checkpoint: copy_info_dict=True stores "
                "Python dicts (infos), which a checkpoint does not hold; use "
                "model.save_replay_buffer (pickle) instead."
            )
        super().save_checkpoint(path)

    def _checkpoint_meta(self) -> dict:
        return {"current_ep_start": [int(x) for x in self._current_ep_start]}

    def load_checkpoint(self, path) -> dict:
        meta = super().load_checkpoint(path)
        self._ahead = None
        self._current_ep_start = np.asarray(meta["current_ep_start"], np.int64)
        return meta
