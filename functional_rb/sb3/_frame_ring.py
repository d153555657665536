"""Frame stacks on the host: each frame of a ``VecFrameStack`` stream kept once, in NumPy.

``frame_stack=k`` and ``optimize_memory_usage=True`` (whole observations: ``k = 1``) with
samples leaving as NumPy or torch (the default) keep their frames here, beside the core's
:class:`~functional_rb.storages.HostStorage` rows: no compiled call is on the way of an
``add`` or a ``sample``, as for SB3's own arrays.

Per env the frames form one stream with absolute indices. A step's newest frame sits at ``f``:
within an episode it is the previous step's next frame, already there; a step that starts an
episode writes it at the previous next frame's index + 1. Its next observation's newest frame
goes to ``f + 1``. A step's row keeps ``f`` and ``dist``, its steps since its episode's first
(at most ``k - 1``). Its stack is frames ``f-k+1 .. f``, its next stack ``f-k+2 .. f+1``, a
zero frame in place of each frame before the episode's first (``VecFrameStack`` pads with
zeros): two gathers per sample.

The ring holds ``size`` frames per env: a stored step needs one frame, an episode end one more
(the next episode's first frame), the oldest step's stack ``k - 1`` before it, and the newest
step its next frame. ``size = buffer_size + min(buffer_size, ceil(buffer_size /
min_episode_len) + 2) + k``: with episodes at least ``min_episode_len`` steps long on average
over the buffer, a stored step's frames are never overwritten. :meth:`FrameRing.check_room` refuses an ``add`` that would
overwrite them, before anything is written, naming ``min_episode_len``.

A row stores ``f + 1`` (0: no step written there yet), so a ring of any age tells a written
row from an empty one.
"""

from __future__ import annotations

import numpy as np


class FrameRing:
    """The frames of ``n_envs`` streams, ``size`` a stream, and one zero frame (padding)."""

    def __init__(
        self,
        frame_shape: tuple,
        dtype,
        n_envs: int,
        buffer_size: int,
        k: int,
        min_episode_len: int,
    ):
        self.k, self.n_envs, self.min_episode_len = k, n_envs, min_episode_len
        # (as TEDStorage sizes its side table: two ends to spare, and never more ends than
        # steps, which is exact for any episodes)
        ends = min(buffer_size, -(-buffer_size // min_episode_len) + 2)
        self.size = buffer_size + ends + k
        self.frames = np.zeros((n_envs * self.size + 1, *frame_shape), dtype)
        self.zero = n_envs * self.size  # the padding frame's row
        self.base = np.arange(n_envs, dtype=np.int64) * self.size
        self.newest = np.full(n_envs, -1, np.int64)  # index of each stream's newest frame
        self.dist = np.zeros(n_envs, np.int64)  # dist of each env's newest step

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes

    # ------------------------------------------------------------------ adding
    def place(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f, dist)`` of the next step of every env; ``starts``: bool ``[n_envs]``, the
        step starts an episode."""
        f = self.newest + starts
        dist = np.where(starts, 0, np.minimum(self.dist + 1, self.k - 1))
        return f, dist

    def check_room(self, f: np.ndarray, oldest: np.ndarray, where: str) -> None:
        """Raise unless writing frames up to ``f + 1`` keeps the frames of the oldest step
        stored after this add (its row's value ``oldest``: ``f + 1``, or 0 for none)."""
        kept = oldest > 0
        first = oldest - 1 - (self.k - 1)  # that step's oldest frame
        over = kept & (f + 1 - first >= self.size)
        if over.any():
            env = int(np.argmax(over))
            what = "observations" if self.k == 1 else "frames"
            raise ValueError(
                f"{where}: the buffer keeps {self.size} {what} per env (one a step, one more "
                f"per episode end, sized for episodes of min_episode_len={self.min_episode_len} "
                f"steps on average), but env {env} ended more episodes than that while its "
                "oldest step is stored; nothing was added. Build the buffer with a smaller "
                "min_episode_len (1 is exact for any episodes)."
            )

    def write(self, f, dist, starts, newest_obs, newest_next) -> None:
        """Write a step of every env: its observation's newest frame where it starts an
        episode, its next observation's newest frame at ``f + 1``."""
        if starts.any():
            self.frames[self.base[starts] + f[starts] % self.size] = newest_obs[starts]
        self.frames[self.base + (f + 1) % self.size] = newest_next
        self.newest = f + 1
        self.dist = dist

    def seed(self, env: int, frames: np.ndarray, dist: int) -> None:
        """Put ``frames`` (``[k, *frame]``, oldest first: a stack) into env's stream, as if
        its last frame were the next frame of a step ``dist - 1`` steps into its episode: the
        next step, which continues it, stacks them (a buffer filled from the middle of an
        episode, e.g. SB3's arrays read back)."""
        at = self.newest[env] + 1 + np.arange(len(frames))
        self.frames[self.base[env] + at % self.size] = frames
        self.newest[env] = at[-1]
        self.dist[env] = dist - 1

    # ------------------------------------------------------------------ reading
    def stacks(self, stored, dist, env, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The stacks and next stacks (``[..., k, *frame]``, oldest frame first) of the steps
        whose rows hold ``stored`` (``f + 1``) and ``dist``, in streams ``env`` (arrays of one
        shape). A row never written gives zeros, as SB3's arrays hold there."""
        stored = np.asarray(stored, np.int64)
        env = np.broadcast_to(np.asarray(env, np.int64), stored.shape)
        j = np.arange(self.k + 1)
        at = (stored - 1)[..., None] - (self.k - 1) + j  # [..., k + 1]
        pad = (j < (self.k - 1) - np.asarray(dist, np.int64)[..., None]) | (stored == 0)[..., None]
        gone = ~pad & (at <= self.newest[env][..., None] - self.size)
        if gone.any():
            raise ValueError(
                f"{where}: a sampled step's frames were overwritten (its row is older than the "
                "frame ring); pos or full were set to values the adds did not produce. Sample "
                "steps the buffer's adds wrote."
            )
        idx = np.where(pad, self.zero, self.base[env][..., None] + at % self.size)
        return self.frames.take(idx[..., :-1], axis=0), self.frames.take(idx[..., 1:], axis=0)

    # ------------------------------------------------------------------ persistence
    def export(self) -> dict:
        """The arrays that hold the streams (for a checkpoint)."""
        return {"frames": self.frames, "newest": self.newest, "dist": self.dist}

    def restore(self, saved: dict) -> None:
        """The inverse of :meth:`export` (arrays of this ring's shapes)."""
        for name, x in saved.items():
            mine = getattr(self, name)
            if np.shape(x) != mine.shape:
                raise ValueError(
                    f"functional_rb.sb3 load_checkpoint: the frame ring's {name} has shape "
                    f"{np.shape(x)}, this buffer's {mine.shape}; load into a buffer built with "
                    "the same buffer_size, n_envs, frame_stack and min_episode_len."
                )
            mine[...] = x
