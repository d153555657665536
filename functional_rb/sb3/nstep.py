"""SB3's ``NStepReplayBuffer`` (``n_steps=`` of SB3's off-policy algorithms) on a core buffer.

The n-step return of a sampled step sums the discounted rewards of the next ``n_steps`` steps
of the same env, up to and including the first done or timeout, and stops at the newest
stored step (SB3 treats it as truncated); the sample's next observation and done flag are those
of the last step summed, and ``discounts`` is ``gamma ** steps summed``. The windows are read
from the core buffer (only the reward, done and timeout fields); the arithmetic is SB3's, in
the same float32 order, so the figures are SB3's bit for bit.
"""

from __future__ import annotations

import numpy as np
from stable_baselines3.common import buffers as _sb3

from functional_rb.sb3.buffers import ReplayBuffer


class NStepReplayBuffer(ReplayBuffer, _sb3.NStepReplayBuffer):
    """SB3's ``NStepReplayBuffer``: SB3's arguments (``n_steps``, ``gamma``) plus those of
    :class:`functional_rb.sb3.ReplayBuffer`.

    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from functional_rb.sb3 import NStepReplayBuffer
    >>> rb = NStepReplayBuffer(10, spaces.Box(0, 1, (2,)), spaces.Box(0, 1, (1,)),
    ...                        device="cpu", n_steps=3, gamma=0.5)
    >>> for i in range(5):
    ...     o = np.full((1, 2), i, np.float32)
    ...     rb.add(o, o + 1, np.zeros((1, 1)), np.ones(1), np.zeros(1), [{}])
    >>> batch = rb._get_samples(np.array([0]))
    >>> batch.rewards.item(), batch.discounts.item()
    (1.75, 0.125)
    """

    def __init__(self, *args, n_steps: int = 3, gamma: float = 0.99, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_steps = n_steps
        self.gamma = gamma
        if self.optimize_memory_usage:
            raise NotImplementedError(
                "NStepReplayBuffer doesn't support optimize_memory_usage=True"
            )
        if self._frames is not None:
            raise NotImplementedError(
                "functional_rb.sb3 NStepReplayBuffer: frame_stack is not supported (the n-step "
                "windows read whole steps); use ReplayBuffer(frame_stack=...) for 1-step targets."
            )

    def _get_samples(self, batch_inds: np.ndarray, env=None):
        batch_inds = np.asarray(batch_inds)
        env_indices = np.random.randint(0, self.n_envs, size=batch_inds.shape)
        steps = np.arange(self.n_steps).reshape(1, -1)
        indices = (batch_inds[:, None] + steps) % self.buffer_size  # [batch, n_steps]
        window = self._read(indices, env_indices[:, None], ("rewards", "dones", "timeouts"))
        rewards = self._normalize_reward(window["rewards"], env)
        dones, timeouts = window["dones"], window["timeouts"]
        # the newest step ends every window that reaches it, unless it is a done already
        newest = indices == (self.pos - 1) % self.buffer_size
        cut = np.logical_or(timeouts, newest & np.logical_not(dones))

        done_or_truncated = np.logical_or(dones, cut)
        done_idx = done_or_truncated.argmax(axis=1)
        done_idx = np.where(done_or_truncated.any(axis=1), done_idx, self.n_steps - 1)
        mask = steps <= done_idx[:, None]
        target_q_discounts = self.gamma ** mask.sum(axis=1, keepdims=True).astype(np.float32)
        discounts = self.gamma ** np.arange(self.n_steps, dtype=np.float32).reshape(1, -1)
        n_step_returns = (rewards * discounts * mask).sum(axis=1, keepdims=True)

        last = (batch_inds + done_idx) % self.buffer_size
        rows = np.arange(len(batch_inds))
        final_dones = (dones[rows, done_idx] * (1.0 - cut[rows, done_idx]))[:, None]
        first = self._read(batch_inds, env_indices)
        later = self._read(last, env_indices)
        return self._pack(
            observations=self._normalize_obs(first["observations"], env),
            actions=first["actions"],
            next_observations=self._normalize_obs(later["next_observations"], env),
            dones=final_dones.astype(np.float32),
            rewards=n_step_returns,
            discounts=target_q_discounts,
        )
