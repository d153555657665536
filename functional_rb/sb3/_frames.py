"""Frame stacks stored once: SB3's ``VecFrameStack`` observations as single frames.

``VecFrameStack(n_stack=k)`` concatenates the last ``k`` frames of an episode along the
channel axis (the last axis, or the first after ``VecTransposeImage``), with zeros before the
episode's first frame. A buffer that stores ``obs`` and ``next_obs`` keeps ``2k`` frames per
step; here one frame per step is kept (plus one per episode end) and both stacks are rebuilt
at sample time, bit for bit what SB3's buffer returns: in a
:class:`~functional_rb.sb3._frame_ring.FrameRing` of NumPy frames where samples leave as
torch or NumPy, else in the core's :class:`functional_rb.TEDStorage` (:meth:`Frames.storage`).

A stack is only rebuilt right if the observations are such stacks; :meth:`Frames.check` tests
every added step against the previous one and raises otherwise, so nothing is silently mixed.
"""

from __future__ import annotations

from typing import cast

import numpy as np

import functional_rb as frb

#: The storage's end flag: SB3's raw ``done`` (termination or truncation), where the
#: frame stacker resets.
END = ("dones",)


class Frames:
    """How a ``k``-frame stack of shape ``obs_shape`` splits into frames and comes back."""

    def __init__(self, obs_shape: tuple, k: int, channels_first: bool, n_envs: int, dtype=np.uint8):
        axis = 0 if channels_first else len(obs_shape) - 1
        if k < 2 or obs_shape[axis] % k:
            raise ValueError(
                f"functional_rb.sb3: frame_stack={k} needs observations whose channel axis "
                f"({'first' if channels_first else 'last'}, size {obs_shape[axis]}) is k "
                f"stacked frames, got observation shape {obs_shape}; pass the n_stack of your "
                "VecFrameStack (and channels_order='first' after VecTransposeImage)."
            )
        self.k, self.axis, self.shape = k, axis, tuple(obs_shape)
        self.channels = obs_shape[axis] // k
        self.channels_first = channels_first
        self.dtype = np.dtype(dtype)
        self._prev_next: np.ndarray | None = None  # [n_envs, *obs_shape]
        self._prev_done = np.ones(n_envs, bool)

    def storage(self, min_episode_len: int) -> frb.TEDStorage:
        return frb.TEDStorage(
            pairs=((("next", "observations"), "observations"),),
            end_keys=(END,),
            frame_stack=self.k,
            stack_pad="zeros",
            min_episode_len=min_episode_len,
        )

    def newest(self, stacks: np.ndarray) -> np.ndarray:
        """The newest frame of each stack: ``[..., *obs_shape]`` -> ``[..., *frame]``."""
        ax = stacks.ndim - len(self.shape) + self.axis
        return np.take(
            stacks, np.arange(stacks.shape[ax] - self.channels, stacks.shape[ax]), axis=ax
        )

    def split(self, stacks: np.ndarray) -> np.ndarray:
        """``[B, *obs_shape]`` (SB3's stacks) -> ``[B, k, *frame]``, oldest frame first: the
        inverse of :meth:`stacked`."""
        ax = 1 + self.axis
        shape = stacks.shape[:ax] + (self.k, self.channels) + stacks.shape[ax + 1 :]
        return np.moveaxis(stacks.reshape(shape), ax, 1)

    def starts(self, obs: np.ndarray) -> np.ndarray:
        """Which env's step (observations ``obs``) starts an episode: the previous one was
        done, or there was none (bool ``[n_envs]``; :meth:`check` tests the frames)."""
        del obs
        return self._prev_done.copy()

    def resume(self, obs: np.ndarray) -> None:
        """The next step of every env continues the episode of its observation in ``obs``
        (``[n_envs, *obs_shape]``): a buffer filled from the middle of episodes."""
        self._prev_next = np.array(obs)
        self._prev_done = np.zeros(len(obs), bool)

    def export(self) -> dict:
        """What :meth:`check` remembers of the last step (for a checkpoint)."""
        prev = self._prev_next
        if prev is None:
            prev = np.zeros((len(self._prev_done), *self.shape), self.dtype)
        return {"prev_next": prev, "prev_done": self._prev_done}

    def restore(self, saved: dict) -> None:
        """The inverse of :meth:`export`."""
        self._prev_next = np.array(saved["prev_next"])
        self._prev_done = np.array(saved["prev_done"], bool)

    def stacked(self, frames):
        """``[B, k, *frame]`` (the core's stacks) -> ``[B, *obs_shape]`` (SB3's)."""
        if self.channels_first:  # [B, k, c, H, W] -> [B, k*c, H, W]
            return frames.reshape(frames.shape[0], *self.shape)
        # [B, k, H, W, c] -> [B, H, W, k, c] -> [B, H, W, k*c]
        order = (0, *range(2, frames.ndim - 1), 1, frames.ndim - 1)
        return frames.transpose(order).reshape(frames.shape[0], *self.shape)

    def check(self, obs: np.ndarray, next_obs: np.ndarray, done: np.ndarray) -> None:
        """Raise unless ``obs`` continues the previous step and ``next_obs`` continues ``obs``."""
        older = self._older(obs)
        for env in range(obs.shape[0]):
            if self._prev_done[env]:
                ok = not np.any(older[env])
                want = "zeros before the episode's first frame"
            else:
                # set after the first step, when no env is done before it
                ok = np.array_equal(obs[env], cast(np.ndarray, self._prev_next)[env])
                want = "the previous step's next_obs"
            if not ok:
                self._refuse(env, f"obs is not {want}")
        shifted = np.take(next_obs, self._older_index(), axis=self.axis + 1)
        if not np.array_equal(shifted, np.take(obs, self._newer_index(), axis=self.axis + 1)):
            self._refuse(None, "next_obs is not obs shifted by one frame")
        self._prev_next = np.array(next_obs)
        self._prev_done = np.asarray(done).reshape(-1).astype(bool)

    def _older_index(self):
        return np.arange(0, self.shape[self.axis] - self.channels)

    def _newer_index(self):
        return np.arange(self.channels, self.shape[self.axis])

    def _older(self, obs):
        return np.take(obs, self._older_index(), axis=self.axis + 1)

    def _refuse(self, env, what: str):
        where = "" if env is None else f" (env {env})"
        raise ValueError(
            f"functional_rb.sb3 ReplayBuffer.add: frame_stack={self.k} stores each frame once "
            f"and rebuilds the stacks, but {what}{where}. Observations must come from "
            f"VecFrameStack(n_stack={self.k}) with the same channel order; construct the "
            "buffer without frame_stack to store whole observations."
        )


class Whole:
    """:class:`Frames`' interface for whole observations (``optimize_memory_usage=True``
    with frames on the host): a "stack" of one, and a step starts an episode when its
    observation is not, bit for bit, the previous step's next observation (so the true last
    observation of an episode is kept, whatever the done flags say)."""

    k = 1

    def __init__(self, obs_shape: tuple, n_envs: int, dtype):
        self.shape = tuple(obs_shape)
        self.dtype = np.dtype(dtype)
        self._prev_next: np.ndarray | None = None  # [n_envs, *obs_shape]
        self._n_envs = n_envs

    def starts(self, obs: np.ndarray) -> np.ndarray:
        if self._prev_next is None:
            return np.ones(self._n_envs, bool)
        return ~np.all(_bytes(obs) == _bytes(self._prev_next), axis=1)

    def check(self, obs: np.ndarray, next_obs: np.ndarray, done: np.ndarray) -> None:
        del obs, done  # any observations are whole ones
        self._prev_next = np.array(next_obs)

    def newest(self, x: np.ndarray) -> np.ndarray:
        return x

    def stacked(self, frames: np.ndarray) -> np.ndarray:
        return frames[:, 0]

    def split(self, stacks: np.ndarray) -> np.ndarray:
        return stacks[:, None]

    def resume(self, obs: np.ndarray) -> None:
        self._prev_next = np.array(obs)

    def export(self) -> dict:
        prev = self._prev_next
        started = prev is not None
        if prev is None:
            prev = np.zeros((self._n_envs, *self.shape), self.dtype)
        return {"prev_next": prev, "started": np.array(started)}

    def restore(self, saved: dict) -> None:
        self._prev_next = np.array(saved["prev_next"]) if bool(saved["started"]) else None


def _bytes(x: np.ndarray) -> np.ndarray:
    """``[n, *shape]`` as ``[n, bytes]`` (bitwise comparison: NaN == NaN, -0.0 != 0.0)."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(len(x), -1)
