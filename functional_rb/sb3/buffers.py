"""Stable-Baselines3's replay buffers over the core: ``ReplayBuffer`` and ``DictReplayBuffer``.

Each class is a subclass of SB3's own (SB3 and sb3-contrib check ``isinstance`` against them)
with SB3's constructor, attributes, methods and sample types; the data lives in a core buffer
(:mod:`functional_rb.sb3._grid`), not in SB3's arrays. What differs, and why:

- **Draws.** ``sample`` draws its indices with NumPy's global generator exactly as SB3 does
  (SB3's ``set_random_seed`` seeds it), so a seeded run samples the same transitions as with
  SB3's buffer.
- **Attributes** ``observations``, ``next_observations``, ``actions``, ``rewards``, ``dones``
  and ``timeouts`` are copies in SB3's layout ``[buffer_size, n_envs, ...]`` whose item
  assignments are written through to the core (:mod:`functional_rb.sb3._columns`). ``pos`` and
  ``full`` are plain attributes, as in SB3.
- **optimize_memory_usage=True** keeps each observation once in the core's TED storage, which
  also keeps the true last observation of an episode (SB3's variant returns the next episode's
  first one), so it works with ``handle_timeout_termination`` too.
- **Beyond SB3**, each a keyword argument: ``frame_stack=k`` stores each frame of
  ``VecFrameStack`` observations once (:mod:`functional_rb.sb3._frames`; on the host,
  :mod:`functional_rb.sb3._frame_ring`); ``output="jax"``
  returns samples as ``jax.Array`` on JAX's default device with no torch in between
  (``"numpy"``: NumPy arrays).
- **Pickling** (``model.save_replay_buffer``) stores the core state exactly; a buffer pickled by
  SB3 converts with :meth:`ReplayBuffer.from_sb3`; :meth:`ReplayBuffer.save_checkpoint` writes
  a crash-safe :mod:`functional_rb.checkpoint`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common import buffers as _sb3
from stable_baselines3.common.preprocessing import get_obs_shape, is_image_space_channels_first
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples

import functional_rb as frb
from functional_rb.sb3._columns import Column
from functional_rb.sb3._frame_ring import FrameRing
from functional_rb.sb3._frames import END, Frames, Whole
from functional_rb.sb3._grid import Grid
from functional_rb.storages.device import PackedStorage
from functional_rb.storages.host import HostStorage

_OUTPUTS = ("torch", "jax", "numpy")
_FIELDS = ("observations", "actions", "rewards", "dones", "timeouts")


class ReplayBuffer(_sb3.ReplayBuffer):
    """SB3's ``ReplayBuffer`` on a core buffer. SB3's arguments, plus, keyword-only:

    Args:
      frame_stack: ``k`` of a ``VecFrameStack(n_stack=k)``: each frame stored once, stacks
        rebuilt on sample (bit-identical to SB3's). Image observations only.
      channels_order: ``"first"`` / ``"last"``: the stacking axis (default: SB3's guess from
        the observation space, as ``VecFrameStack`` and ``VecTransposeImage`` make it).
      min_episode_len: with ``frame_stack`` or ``optimize_memory_usage``, each episode end
        keeps one more frame (or observation), and room for them is sized for episodes at
        least this long on average over the buffer (default 16 with ``frame_stack``, else 4);
        more episode ends raise when written, naming this argument (``min_episode_len=1`` is
        exact for any data).
      output: ``"torch"`` (SB3's), ``"jax"`` or ``"numpy"``: the array type of samples.

    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from functional_rb.sb3 import ReplayBuffer
    >>> rb = ReplayBuffer(100, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), device="cpu")
    >>> obs = np.zeros((1, 3), np.float32)
    >>> rb.add(obs, obs + 1, np.array([1]), np.array([0.5]), np.array([0.0]), [{}])
    >>> batch = rb.sample(4)
    >>> tuple(batch.observations.shape), batch.actions.dtype, rb.size()
    ((4, 3), torch.int64, 1)
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        frame_stack: int | None = None,
        channels_order: str | None = None,
        min_episode_len: int | None = None,
        output: str = "torch",
    ):
        _sb3.BaseBuffer.__init__(
            self, buffer_size, observation_space, action_space, device, n_envs=n_envs
        )
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        if output not in _OUTPUTS:
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}: output must be one of {_OUTPUTS}, "
                f"got {output!r}."
            )
        self.output = output
        self._frames = self._frame_stack(frame_stack, channels_order)
        # observations stored once (frame_stack=, optimize_memory_usage=True) are kept on the
        # host (the rows' HostStorage and a FrameRing) where samples leave as NumPy or torch;
        # else in the core's TEDStorage
        once = self._frames is not None or optimize_memory_usage
        self._host_frames = once and self._host_rows()
        self._stream: Frames | Whole | None = None
        if self._host_frames:
            self._stream = self._frames or Whole(
                self.obs_shape, n_envs, self.observation_space.dtype
            )
        self._ted = once and not self._host_frames
        self._grid = Grid(
            self._example(),
            self.buffer_size,
            n_envs,
            storage=self._storage(min_episode_len),
            sampler=self._sampler(),
        )
        self._ring = self._frame_ring() if self._host_frames else None
        self._warn_memory()

    # ------------------------------------------------------------------ construction
    def _frame_stack(self, k, channels_order):
        if k is None:
            return None
        if not isinstance(self.observation_space, spaces.Box):
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}: frame_stack needs a Box image "
                f"observation space, got {self.observation_space}."
            )
        if channels_order is None:
            first = is_image_space_channels_first(self.observation_space)
        elif channels_order in ("first", "last"):
            first = channels_order == "first"
        else:
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}: channels_order must be 'first', "
                f"'last' or None, got {channels_order!r}."
            )
        return Frames(self.obs_shape, int(k), first, self.n_envs, self.observation_space.dtype)

    def _obs_example(self):
        space = self.observation_space
        if isinstance(self.obs_shape, dict):
            return {
                key: np.zeros((self.n_envs, *shape), space[key].dtype)
                for key, shape in self.obs_shape.items()
            }
        shape = self.obs_shape
        if self._frames is not None:
            shape = self._frames.newest(np.zeros((1, *shape), np.uint8)).shape[1:]
        return np.zeros((self.n_envs, *shape), space.dtype)

    def _frame_ring(self) -> FrameRing:
        frame = self._obs_example()[0]
        return FrameRing(
            frame.shape,
            frame.dtype,
            self.n_envs,
            self.buffer_size,
            cast(Frames | Whole, self._stream).k,
            self._min_episode_len,
        )

    def _example(self) -> dict:
        obs = self._obs_example()
        if self._host_frames:  # each step's place in the frame ring (FrameRing)
            obs = {
                "frame": np.zeros(self.n_envs, np.int64),
                "dist": np.zeros(self.n_envs, np.uint8),
            }
        step = {
            "observations": obs,
            "actions": np.zeros(
                (self.n_envs, self.action_dim), self._maybe_cast_dtype(self.action_space.dtype)
            ),
            "rewards": np.zeros(self.n_envs, np.float32),
            "dones": np.zeros(self.n_envs, np.float32),
            "timeouts": np.zeros(self.n_envs, np.float32),
        }
        if self._ted:
            step["next"] = {"observations": obs}
        elif not self._host_frames:  # (the ring's place gives both stacks)
            step["next_observations"] = obs
        return step

    def _storage(self, min_episode_len: int | None):
        if min_episode_len is None:
            min_episode_len = 16 if self._frames is not None else 4
        self._min_episode_len = min_episode_len
        if self._frames is not None and not self._host_frames:
            return self._frames.storage(min_episode_len)
        if self._ted:
            return frb.TEDStorage(
                pairs=((("next", "observations"), "observations"),),
                end_keys=(END,),
                min_episode_len=min_episode_len,
            )
        if self._host_rows():
            return HostStorage()
        return PackedStorage()  # what DeviceStorage() builds (mypy takes it as abstract)

    def _host_rows(self) -> bool:
        """Whether the rows live in host NumPy arrays (the core's HostStorage): samples leave
        as NumPy or torch (``output="jax"`` keeps them on the JAX device), and they are drawn
        with NumPy's generator, so no compiled call is on the way of a step (SB3's arrays
        are host arrays too)."""
        return self.output != "jax"

    def _sampler(self):
        return frb.RandomSampler()

    def _warn_memory(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        need = self._grid.nbytes() + (0 if self._ring is None else self._ring.nbytes)
        have = psutil.virtual_memory().available
        if need > have:
            warnings.warn(
                "This system does not have apparently enough memory to store the complete "
                f"replay buffer {need / 1e9:.2f}GB > {have / 1e9:.2f}GB",
                stacklevel=3,  # the caller of __init__
            )

    # ------------------------------------------------------------------ adding
    def _step(self, obs, next_obs, action, reward, done, infos) -> dict:
        """One vectorized step as the core item's fields (``[n_envs, ...]``), SB3's reshapes;
        :meth:`_leaves` checks and orders them."""
        obs, next_obs = self._shape_obs(obs), self._shape_obs(next_obs)
        n = self.n_envs
        timeouts = self._timeouts(infos)
        done = np.asarray(done)
        if self._frames is not None:
            self._frames.check(obs, next_obs, done.reshape(n))
            obs, next_obs = self._frames.newest(obs), self._frames.newest(next_obs)
        step = {
            "observations": obs,
            "actions": np.asarray(action).reshape(n, self.action_dim),
            "rewards": np.asarray(reward).reshape(n),
            "dones": done.reshape(n),
            "timeouts": timeouts.reshape(n),
        }
        if self._ted:
            step["next"] = {"observations": next_obs}
        else:
            step["next_observations"] = next_obs
        return step

    def _timeouts(self, infos) -> np.ndarray:
        """SB3's timeouts of a step: ``TimeLimit.truncated`` of each env's info, with
        ``handle_timeout_termination``; else zeros."""
        if self.handle_timeout_termination:
            return np.array([info.get("TimeLimit.truncated", False) for info in infos])
        return self._no_timeouts

    @functools.cached_property
    def _no_timeouts(self) -> np.ndarray:
        zeros = np.zeros(self.n_envs, np.float32)
        zeros.flags.writeable = False  # shared by every step (the stage copies it)
        return zeros

    @functools.cached_property
    def _discrete_obs(self) -> bool:
        return isinstance(self.observation_space, spaces.Discrete)

    def _shape_obs(self, obs):
        if self._discrete_obs:
            return np.asarray(obs).reshape((self.n_envs, *self.obs_shape))
        return np.asarray(obs)

    @functools.cached_property
    def _plan(self) -> list:
        """``(path, its name, shape)`` of every leaf of the core item, in the grid's order."""
        flat = jax.tree_util.tree_flatten_with_path(self._grid.dtypes)[0]
        return [
            (tuple(p.key for p in path), jax.tree_util.keystr(path), shape)
            for (path, _), shape in zip(flat, self._grid.leaf_shapes)
        ]

    def _leaves(self, step: dict) -> list:
        """The core item's leaves (the grid's order) from a step's fields, each checked
        against its stored shape (an error names the field); the stage casts them."""
        out = []
        for keys, name, want in self._plan:
            x: Any = step
            for k in keys:
                x = x[k]
            shape = x.shape if type(x) is np.ndarray else np.shape(x)
            if shape != want:
                raise ValueError(
                    f"functional_rb.sb3 {type(self).__name__}.add: {name} has shape "
                    f"{shape}, expected {want} ([n_envs, ...] with n_envs={self.n_envs}); "
                    "pass one step of every env."
                )
            out.append(x)
        return out

    @functools.cached_property
    def _one_array_obs(self) -> bool:
        """Whether the item's leaves are SB3's fields in the order :meth:`_array_leaves`
        lists them (one array per observation, no frame stack)."""
        names = [keys for keys, _, _ in self._plan]
        next_obs = ("next", "observations") if self._ted else ("next_observations",)
        order = [("actions",), ("dones",), next_obs, ("observations",), ("rewards",), ("timeouts",)]
        return self._frames is None and names == order

    def _array_leaves(self, obs, next_obs, action, reward, done, infos) -> list:
        """:meth:`_leaves` of :meth:`_step` for one-array observations, without the dict: the
        per-step cost SB3 users compare against is a few microseconds."""
        n = self.n_envs
        timeouts = self._timeouts(infos)
        obs, next_obs = self._shape_obs(obs), self._shape_obs(next_obs)
        want = self._grid.leaf_shapes[3]  # (the reshapes below check the other leaves)
        if obs.shape != want or next_obs.shape != want:
            self._leaves(self._step(obs, next_obs, action, reward, done, infos))  # names it
        return [
            np.asarray(action).reshape(n, self.action_dim),
            np.asarray(done).reshape(n),
            next_obs,
            obs,
            np.asarray(reward).reshape(n),
            timeouts.reshape(n),
        ]

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        if self._ring is not None:
            return self._add_frames(obs, next_obs, action, reward, done, infos)
        if self._one_array_obs:
            leaves = self._array_leaves(obs, next_obs, action, reward, done, infos)
        else:
            leaves = self._leaves(self._step(obs, next_obs, action, reward, done, infos))
        self.pos, self.full = self._grid.stage(leaves, self.pos, self.full)

    def _add_frames(self, obs, next_obs, action, reward, done, infos) -> None:
        """:meth:`add` with observations stored once on the host: everything is checked
        (shapes, stacks, room in the ring) before the ring and the rows are written."""
        where = f"functional_rb.sb3 {type(self).__name__}.add"
        obs, next_obs = self._shape_obs(obs), self._shape_obs(next_obs)
        want = (self.n_envs, *self.obs_shape)
        for name, x in (("obs", obs), ("next_obs", next_obs)):
            if x.shape != want:
                raise ValueError(
                    f"{where}: {name} has shape {x.shape}, expected {want} ([n_envs, ...] "
                    f"with n_envs={self.n_envs}); pass one step of every env."
                )
        ring, frames = cast(FrameRing, self._ring), cast(Frames | Whole, self._stream)
        starts = frames.starts(obs)
        f, dist = ring.place(starts)
        ring.check_room(f, self._oldest_kept(), where)
        n = self.n_envs
        timeouts = self._timeouts(infos)
        done = np.asarray(done).reshape(n)
        step = {
            "observations": {"frame": f + 1, "dist": dist},
            "actions": np.asarray(action).reshape(n, self.action_dim),
            "rewards": np.asarray(reward).reshape(n),
            "dones": done,
            "timeouts": timeouts.reshape(n),
        }
        leaves = self._leaves(step)
        frames.check(obs, next_obs, done)
        ring.write(f, dist, starts, frames.newest(obs), frames.newest(next_obs))
        self.pos, self.full = self._grid.stage(leaves, self.pos, self.full)
        return None

    def _oldest_kept(self) -> np.ndarray:
        """The ``frame`` value (``f + 1``, 0: none) of each env's oldest step stored after the
        next add (:meth:`FrameRing.check_room`)."""
        if not self.full and self.pos == 0:  # the next add's step is the oldest
            return np.zeros(self.n_envs, np.int64)
        row = (self.pos + 1) % self.buffer_size if self.full else 0
        return np.array(self._grid.host_field("observations")["frame"][:, row])

    def extend(self, *args, **kwargs) -> None:
        """Add a batch of steps (each argument's leading axis) in one write."""
        if kwargs or self._frames is not None or self._ring is not None:
            return super().extend(*args, **kwargs)
        rows = [self._leaves(self._step(*data)) for data in zip(*args, strict=True)]
        if not rows:
            return None
        steps = [
            np.stack(xs, axis=1).astype(dtype, copy=False)
            for xs, dtype in zip(zip(*rows), self._grid.leaf_dtypes)
        ]
        self.pos, self.full = self._grid.add(self._grid.unflatten(steps), self.pos, self.full)
        return None

    def reset(self) -> None:
        super().reset()
        self._grid.reset()

    # ------------------------------------------------------------------ SB3's arrays
    def _column(self, name: str):
        """One of SB3's arrays, read from the core (only that field)."""
        self._grid.sync(self.pos, self.full)
        core = "next" if name == "next_observations" and self._ted else name
        if self._ring is not None and name == "next_observations":
            core = "observations"  # both stacks come from the rows' places in the ring
        data = self._grid.column((core,))
        env = np.arange(self.n_envs)[None, :]
        out = self._fields(data, flat_shape=(self.buffer_size, self.n_envs), env=env)[name]
        if isinstance(out, dict):
            return {k: Column(x, self._sink(name, k)) for k, x in out.items()}
        return Column(out, self._sink(name))

    def _sink(self, name: str, key: str | None = None):
        """Where a write into SB3's array ``name`` (``[key]`` of a dict) goes: the core."""

        def write(t, env, rows):
            if self._ring is not None and name in ("observations", "next_observations"):
                built = "frame_stack=" if self._frames is not None else "optimize_memory_usage"
                raise ValueError(
                    f"functional_rb.sb3: {name} of a buffer built with {built} cannot be "
                    "rewritten: each frame (observation) is stored once and shared by two "
                    f"steps or more. Build the buffer without {built} to edit stored "
                    "observations."
                )
            if key is not None:  # the other keys of those steps are kept as stored
                stored = self._read(t, env, (name,))[name]
                rows = {**stored, key: rows}
            self._grid.write(t, env, {name: rows})

        return write

    @property
    def observations(self):
        return self._column("observations")

    @property
    def next_observations(self):
        return self._column("next_observations")

    @property
    def actions(self):
        return self._column("actions")

    @property
    def rewards(self):
        return self._column("rewards")

    @property
    def dones(self):
        return self._column("dones")

    @property
    def timeouts(self):
        return self._column("timeouts")

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int, env=None):
        self._check_can_sample()
        return super().sample(batch_size, env=env)

    def _check_can_sample(self) -> None:
        if self.size() == 0:
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}.sample: the buffer is empty; add "
                "transitions first (SB3's buffer would return zeros that look like data)."
            )

    def _get_samples(self, batch_inds: np.ndarray, env=None):
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        return self._samples_at(np.asarray(batch_inds), env_indices, env)

    def _read(self, t, env_indices, fields: tuple | None = None, *, on_device=False) -> dict:
        """SB3's fields at ``(t, env)``, unnormalized (``fields``: core fields only): NumPy,
        or JAX arrays that never leave the device (``on_device``)."""
        self._grid.sync(self.pos, self.full)
        data = self._grid.read(t, env_indices, fields, on_device=on_device)
        if fields is not None:
            return data
        return self._fields(data, flat_shape=np.shape(t), env=env_indices)

    def _on_device(self, env) -> bool:
        """Whether a sample is built on the JAX device: ``output="jax"``, no VecNormalize
        (which works on NumPy arrays), and a buffer whose rows are not read on the host
        (where they are, the host read and one transfer cost less than compiled calls)."""
        return self.output == "jax" and env is None and not self._grid.host_reads

    def _fields(self, data: dict, flat_shape, env=None) -> dict:
        """The core item's leaves under SB3's names (stacks rebuilt to SB3's shape); ``env``:
        the rows' envs, broadcastable to ``flat_shape`` (for frames on the host)."""
        if self._ring is not None and "observations" in data:
            data = dict(data)
            place = data.pop("observations")
            stacks = self._ring.stacks(
                place["frame"],
                place["dist"],
                np.broadcast_to(env, flat_shape),
                f"functional_rb.sb3 {type(self).__name__}",
            )
            frames = cast(Frames | Whole, self._stream)
            for key, x in zip(("observations", "next_observations"), stacks):
                x = frames.stacked(x.reshape(-1, *x.shape[len(flat_shape) :]))
                data[key] = x.reshape(*flat_shape, *self.obs_shape)
            return data
        if "next" in data:
            data = dict(data)
            data["next_observations"] = data.pop("next")["observations"]
        if self._frames is not None:
            for key in ("observations", "next_observations"):
                if key not in data:
                    continue
                x = data[key].reshape(-1, *data[key].shape[len(flat_shape) :])
                data[key] = self._frames.stacked(x).reshape(*flat_shape, *self.obs_shape)
        return data

    def _samples_at(self, t, env_indices, env=None):
        data = self._read(t, env_indices, on_device=self._on_device(env))
        return self._pack(**self._transitions(data, env))

    def _transitions(self, d: dict, env=None) -> dict:
        """SB3's sample fields (NumPy) from stored steps: done only if not a timeout."""
        return dict(
            observations=self._normalize_obs(d["observations"], env),
            actions=d["actions"],
            next_observations=self._normalize_obs(d["next_observations"], env),
            dones=(d["dones"] * (1 - d["timeouts"])).reshape(-1, 1),
            rewards=self._normalize_reward(d["rewards"].reshape(-1, 1), env),
        )

    def _pack(self, cls=None, **fields):
        """SB3's sample tuple from NumPy fields (arrays new to this sample, or read-only ones),
        in the buffer's ``output`` array type."""
        if cls is None:
            dict_obs = isinstance(self.obs_shape, dict)
            cls = DictReplayBufferSamples if dict_obs else ReplayBufferSamples
        convert = self._convert
        return cls(
            **{
                k: {key: convert(x) for key, x in v.items()} if isinstance(v, dict) else convert(v)
                for k, v in fields.items()
            }
        )

    def _convert(self, x: np.ndarray):
        if self.output == "torch":
            if x.flags.writeable and self.device.type == "cpu":
                # the sample's own array: SB3's copy (to_torch) would copy it once more
                return th.from_numpy(np.ascontiguousarray(x))
            return self.to_torch(x)
        if self.output == "jax":  # (one jnp.asarray per array: ~10 us each on CPU, less
            return jnp.asarray(x)  # than one jax.device_put of them all)
        return np.array(x)

    # ------------------------------------------------------------------ persistence
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for derived in (
            "_plan",
            "_no_timeouts",
            "_discrete_obs",
            "_one_array_obs",
        ):  # cached, rebuilt on use
            state.pop(derived, None)
        grid = state.pop("_grid")
        state["_saved_grid"] = grid.export()
        state["_grid_args"] = (grid.buffer_size, grid.n_envs)
        return state

    def __setstate__(self, state: dict) -> None:
        saved = state.pop("_saved_grid")
        state.pop("_grid_args")
        # (a buffer pickled before frames could live on the host keeps them in its TEDStorage)
        state.setdefault("_host_frames", False)
        state.setdefault("_ring", None)
        state.setdefault("_stream", None)
        self.__dict__.update(state)
        self._grid = Grid(
            self._example(),
            self.buffer_size,
            self.n_envs,
            storage=self._storage(self._min_episode_len),
            sampler=self._sampler(),
        )
        self._grid.restore(saved)

    @classmethod
    def from_sb3(cls, buffer: _sb3.ReplayBuffer, **kwargs) -> ReplayBuffer:
        """This class holding the contents of SB3's ``buffer`` (e.g. one SB3 pickled)."""
        n = buffer.n_envs
        new = cls(
            buffer.buffer_size * n,
            buffer.observation_space,
            buffer.action_space,
            device=buffer.device,
            n_envs=n,
            **_sb3_flags(buffer),
            **kwargs,
        )
        if new._ring is not None:
            new._replay(buffer)
            return new
        columns = {k: _sb3_array(buffer, k) for k in _FIELDS}
        if new._frames is not None and (buffer.full or buffer.pos):
            new._refuse_mid_episode(columns["observations"][buffer.pos if buffer.full else 0])
        if new._ted:
            columns["next"] = {"observations": _next_obs(buffer)}
            if new._frames is not None:
                columns["observations"] = new._frames.newest(columns["observations"])
                nxt = columns["next"]["observations"]
                columns["next"]["observations"] = new._frames.newest(nxt)
        else:
            columns["next_observations"] = _next_obs(buffer)
        columns["actions"] = columns["actions"].reshape(buffer.buffer_size, n, new.action_dim)
        new._grid.load_columns(columns, buffer.pos, buffer.full)
        new.pos, new.full = buffer.pos, buffer.full
        return new

    def _refuse_mid_episode(self, oldest: np.ndarray) -> None:
        """With frames in the core's TEDStorage, SB3's oldest stored stacks must start their
        episodes: TED rebuilds a stack from the frames it stored, and the frames before the
        oldest step were never given to it."""
        frames = cast(Frames, self._frames)
        if np.any(frames.split(oldest)[:, :-1]):
            raise ValueError(
                f"functional_rb.sb3 {type(self).__name__}.from_sb3: SB3's oldest stored step is "
                "in the middle of an episode (its stack holds earlier frames), which frame_stack= "
                "in the core's TEDStorage (output='jax', prioritized buffers) cannot rebuild. "
                "Convert into a ReplayBuffer with output='torch' or 'numpy' (frames on the "
                "host), or without frame_stack."
            )

    def _replay(self, buffer: _sb3.ReplayBuffer) -> None:
        """Add SB3's stored steps in time order, oldest first (frames on the host): each env's
        oldest stack goes into the ring first, so its episode may have begun before it."""
        order = (
            np.arange(buffer.pos, buffer.pos + buffer.buffer_size) % buffer.buffer_size
            if buffer.full
            else np.arange(buffer.pos)
        )
        if not len(order):
            return
        obs, nxt = _sb3_array(buffer, "observations"), _next_obs(buffer)
        actions, rewards = _sb3_array(buffer, "actions"), _sb3_array(buffer, "rewards")
        dones, timeouts = _sb3_array(buffer, "dones"), _sb3_array(buffer, "timeouts")
        frames, ring = cast(Frames | Whole, self._stream), cast(FrameRing, self._ring)
        first = obs[order[0]]
        for env, stack in enumerate(frames.split(first)):
            ring.seed(env, stack, frames.k - 1)
        frames.resume(first)
        self.pos, self.full = (buffer.pos if buffer.full else 0), False
        for t in order:
            infos = [{"TimeLimit.truncated": bool(x)} for x in timeouts[t]]
            self.add(obs[t], nxt[t], actions[t], rewards[t], dones[t], infos)

    def save_checkpoint(self, path) -> None:
        """Write the buffer to ``path`` with :func:`functional_rb.checkpoint.save`: atomic and
        checked (a crash leaves the previous or the new checkpoint, never a mix)."""
        meta = {**self._checkpoint_meta(), "observations_kept": self._kept()}
        self._grid.save(path, self.pos, self.full, meta, self._frame_state())

    def _checkpoint_meta(self) -> dict:
        """What a subclass keeps beside the core state in a checkpoint (JSON)."""
        return {}

    def _kept(self) -> str:
        """Where observations are kept, which a checkpoint's layout follows."""
        return "host frames" if self._host_frames else "TEDStorage" if self._ted else "rows"

    def load_checkpoint(self, path) -> dict:
        """Read a checkpoint written by :meth:`save_checkpoint` of a buffer built alike; its
        metadata."""
        kept = frb.checkpoint.verify(path, data=False).meta["user"].get("observations_kept")
        if kept is not None and kept != self._kept():
            raise ValueError(self._kept_error(kept))
        try:
            meta, saved = self._grid.load(path, self._frame_state())
        except ValueError as e:  # a checkpoint that does not name its layout (older ones)
            if kept is None and "storage is a" in str(e):
                raise ValueError(self._kept_error(None)) from e
            raise
        if saved is not None:
            saved = jax.tree_util.tree_map(np.asarray, saved)
            cast(Frames | Whole, self._stream or self._frames).restore(saved["check"])
            if self._ring is not None:
                self._ring.restore(saved["ring"])
        self.pos, self.full = int(meta["pos"]), bool(meta["full"])
        return meta

    def _kept_error(self, saved: str | None) -> str:
        how = {
            "host frames": "frame_stack= or optimize_memory_usage=True, output='torch' or "
            "'numpy' (a ReplayBuffer)",
            "TEDStorage": "frame_stack= or optimize_memory_usage=True with output='jax', or a "
            "prioritized buffer with either",
            "rows": "neither frame_stack= nor optimize_memory_usage=True",
        }
        what = (
            f"keeps its observations in {saved}"
            if saved
            else "keeps its observations in another layout (it does not name it: frame stacks "
            "saved by earlier versions are in TEDStorage)"
        )
        built = how.get(saved or "", "the arguments of the buffer that saved it")
        return (
            f"functional_rb.sb3 {type(self).__name__}.load_checkpoint: the checkpoint {what}, "
            f"this buffer in {self._kept()} (built with {how[self._kept()]}). Load it into a "
            f"buffer built like the one that saved it: {built}; everything else the same."
        )

    def _frame_state(self) -> dict | None:
        """With frame stacks, what a checkpoint keeps beside the rows: the ring's frames (on
        the host) and the last step's observations, which the next add must continue."""
        stream = self._stream or self._frames
        if stream is None:
            return None
        state = {"check": stream.export()}
        if self._ring is not None:
            state["ring"] = self._ring.export()
        return state


def _set(tree: dict, keys: tuple, value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _sb3_flags(buffer) -> dict[str, Any]:
    return {
        "optimize_memory_usage": buffer.optimize_memory_usage,
        "handle_timeout_termination": buffer.handle_timeout_termination,
    }


def _sb3_array(buffer, name: str):
    return buffer.__dict__[name]


def _next_obs(buffer):
    if buffer.optimize_memory_usage:
        return np.roll(buffer.__dict__["observations"], -1, axis=0)
    return buffer.__dict__["next_observations"]


# ignore[override] below: SB3's arrays are read-only views of the core buffer's rows here
class DictReplayBuffer(ReplayBuffer, _sb3.DictReplayBuffer):  # type: ignore[override]
    """SB3's ``DictReplayBuffer`` (``Dict`` observation spaces) on a core buffer; SB3's
    arguments plus ``output=`` (see :class:`ReplayBuffer`).

    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from functional_rb.sb3 import DictReplayBuffer
    >>> space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "goal": spaces.Box(-1, 1, (2,))})
    >>> rb = DictReplayBuffer(10, space, spaces.Box(-1, 1, (1,)), device="cpu")
    >>> obs = {k: np.zeros((1, 2), np.float32) for k in space.spaces}
    >>> rb.add(obs, obs, np.zeros((1, 1)), np.ones(1), np.zeros(1), [{}])
    >>> sorted(rb.sample(3).observations), rb.size()
    (['goal', 'pos'], 1)
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        output: str = "torch",
    ):
        obs_shape = get_obs_shape(observation_space)
        assert isinstance(obs_shape, dict), "DictReplayBuffer must be used with Dict obs space only"
        assert not optimize_memory_usage, "DictReplayBuffer does not support optimize_memory_usage"
        super().__init__(
            buffer_size,
            observation_space,
            action_space,
            device,
            n_envs,
            optimize_memory_usage,
            handle_timeout_termination,
            output=output,
        )

    def _shape_obs(self, obs):
        out = {}
        for key, x in obs.items():
            if isinstance(self.observation_space.spaces[key], spaces.Discrete):
                x = np.asarray(x).reshape((self.n_envs, *self.obs_shape[key]))
            out[key] = np.asarray(x)
        return out
