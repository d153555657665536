"""Frame stacks stored once (``frame_stack=k``): samples bit-identical to SB3's buffer fed the
same ``VecFrameStack`` stream, channel-last and channel-first, through ring wrap-around, on
both paths: frames on the host (a FrameRing beside HostStorage rows: samples as torch or
NumPy) and in the core's TEDStorage (``output="jax"``, prioritized buffers)."""

import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces

pytest.importorskip("stable_baselines3")
from stable_baselines3.common import buffers as sb3_buffers  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecFrameStack,
    VecTransposeImage,
)

from functional_rb.sb3 import ReplayBuffer  # noqa: E402


class TEDReplayBuffer(ReplayBuffer):
    """Frames in the core's TEDStorage (the path of ``output="jax"`` and of prioritized
    buffers), with torch samples to compare."""

    def _host_rows(self):
        return False


OURS = pytest.mark.parametrize("ours", [ReplayBuffer, TEDReplayBuffer], ids=["host", "ted"])


class Frames(gym.Env):
    """Random 6x5 one-channel frames; episodes end at random (terminated or truncated)."""

    def __init__(self, seed):
        self.observation_space = spaces.Box(0, 255, (6, 5, 1), np.uint8)
        self.action_space = spaces.Discrete(3)
        self._rng = np.random.default_rng(seed)
        self._t = 0

    def _frame(self):
        return self._rng.integers(1, 256, (6, 5, 1), dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        self._t = 0
        return self._frame(), {}

    def step(self, action):
        self._t += 1
        terminated = bool(self._rng.random() < 0.08)
        return self._frame(), float(action), terminated, self._t >= 30, {}


def stream(first: bool, n_envs: int, steps: int):
    """SB3's off-policy collection: (obs, next_obs, action, reward, done, infos) per step,
    with the terminal observation as next_obs of a done step."""
    venv = VecFrameStack(DummyVecEnv([lambda i=i: Frames(i) for i in range(n_envs)]), 4)
    if first:
        venv = VecTransposeImage(venv)
    venv.seed(0)
    obs = venv.reset()
    rng = np.random.default_rng(1)
    for _ in range(steps):
        actions = rng.integers(0, 3, n_envs)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done:
                next_obs[i] = infos[i]["terminal_observation"]
        yield obs, next_obs, actions, rewards, dones, infos, venv
        obs = new_obs


def fed(first: bool, n_envs: int, steps: int, size: int, every: int = 0, ours=ReplayBuffer):
    """SB3's buffer and ``ours`` (``frame_stack=4``) of ``size`` steps per env, fed the same
    stream; every ``every`` steps (0: never) both sample 4 with the same seed, compared."""
    buffers = None
    for i, step in enumerate(stream(first, n_envs, steps)):
        *data, venv = step
        if buffers is None:
            args = (size * n_envs, venv.observation_space, venv.action_space)
            buffers = (
                sb3_buffers.ReplayBuffer(*args, device="cpu", n_envs=n_envs),
                ours(*args, device="cpu", n_envs=n_envs, frame_stack=4, min_episode_len=4),
            )
        for b in buffers:
            b.add(*data)
        if every and i % every == every - 1:
            assert_same_draw(*buffers, seed=i, batch=4)
    return buffers


def assert_same_draw(theirs, ours, seed: int, batch: int):
    np.random.seed(seed)
    a = theirs.sample(batch)
    np.random.seed(seed)
    b = ours.sample(batch)
    for name, x, y in zip(a._fields, a, b):
        if x is None:
            assert y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, (seed, name)
        assert th.equal(x, y), (seed, name)


@OURS
@pytest.mark.parametrize("first", [False, True], ids=["channels_last", "channels_first"])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_samples_equal_sb3s(first, n_envs, ours):
    theirs, ours = fed(first, n_envs, steps=150, size=60, ours=ours)
    assert ours.full and ours.pos == theirs.pos
    for seed in range(3):
        assert_same_draw(theirs, ours, seed, batch=256)
    assert np.array_equal(theirs.observations, ours.observations)
    assert np.array_equal(theirs.next_observations, ours.next_observations)


@OURS
@pytest.mark.parametrize("n_envs", [1, 2])
def test_samples_between_adds_equal_sb3s(n_envs, ours):
    # a training loop's pattern: a few adds, a small sample (the steps waiting on the host
    # written first), SB3's stacks every time, through the ring's wrap-around
    fed(False, n_envs, steps=170, size=50, every=3, ours=ours)


def test_host_path_is_taken_where_samples_leave_as_torch_or_numpy():
    space = spaces.Box(0, 255, (6, 5, 4), np.uint8)
    for output, host in (("torch", True), ("numpy", True), ("jax", False)):
        rb = ReplayBuffer(10, space, spaces.Discrete(2), frame_stack=4, output=output)
        assert (rb._ring is not None) == host, output


@OURS
@pytest.mark.parametrize("n_envs", [1, 2])
def test_pickle_checkpoint_and_sb3s_arrays_keep_the_stacks(tmp_path, n_envs, ours):
    theirs, rb = fed(True, n_envs, steps=130, size=40, ours=ours)
    args = (40 * n_envs, rb.observation_space, rb.action_space)
    kwargs = dict(device="cpu", n_envs=n_envs, frame_stack=4, min_episode_len=4)
    restored = pickle.loads(pickle.dumps(rb))
    rb.save_checkpoint(tmp_path / "ckpt")
    loaded = ours(*args, **kwargs)
    loaded.load_checkpoint(tmp_path / "ckpt")
    # SB3's arrays (what SB3 pickles) into ours: the oldest stored step is mid-episode, which
    # only the host path can rebuild (TED never saw the frames before it: it refuses)
    copies = [restored, loaded]
    assert np.any(theirs.observations[theirs.pos][..., :3, :, :])  # (channels first)
    if ours is TEDReplayBuffer:
        with pytest.raises(ValueError, match="middle of an episode"):
            ours.from_sb3(theirs, frame_stack=4, min_episode_len=4)
    else:
        copies.append(ours.from_sb3(theirs, frame_stack=4, min_episode_len=4))
    for other in copies:
        assert (other.pos, other.full) == (theirs.pos, theirs.full)
        assert_same_draw(theirs, other, seed=5, batch=64)
        assert np.array_equal(theirs.observations, other.observations)
        assert np.array_equal(theirs.next_observations, other.next_observations)
    # and the copies go on as the original does
    for i, step in enumerate(stream(True, n_envs, 160)):
        if i < 130:
            continue
        for b in (theirs, rb, *copies):
            b.add(*step[:-1])
    for other in (rb, *copies):
        assert_same_draw(theirs, other, seed=6, batch=64)


def test_a_checkpoint_of_the_other_layout_says_which_buffer_reads_it(tmp_path):
    space = spaces.Box(0, 255, (6, 5, 4), np.uint8)
    kwargs = dict(device="cpu", frame_stack=4, min_episode_len=4)
    host = ReplayBuffer(10, space, spaces.Discrete(2), **kwargs)
    ted = ReplayBuffer(10, space, spaces.Discrete(2), output="jax", **kwargs)
    frame = np.zeros((1, 6, 5, 4), np.uint8)
    frame[..., 3] = 7
    nxt = frame.copy()
    nxt[..., 2], nxt[..., 3] = 7, 9
    for rb in (host, ted):
        rb.add(frame, nxt, np.array([1]), np.array([0.5]), np.array([0.0]), [{}])
    host.save_checkpoint(tmp_path / "host")
    ted.save_checkpoint(tmp_path / "ted")
    with pytest.raises(ValueError, match=r"keeps its observations in TEDStorage.*output='jax'"):
        ReplayBuffer(10, space, spaces.Discrete(2), **kwargs).load_checkpoint(tmp_path / "ted")
    with pytest.raises(ValueError, match=r"in host frames.*output='torch' or 'numpy'"):
        ReplayBuffer(10, space, spaces.Discrete(2), output="jax", **kwargs).load_checkpoint(
            tmp_path / "host"
        )
    # a checkpoint that does not name its layout (written before checkpoints did)
    ted._grid.save(tmp_path / "unnamed", ted.pos, ted.full, {}, ted._frame_state())
    with pytest.raises(ValueError, match=r"another layout \(it does not name it: frame stacks"):
        ReplayBuffer(10, space, spaces.Discrete(2), **kwargs).load_checkpoint(tmp_path / "unnamed")
    again = ReplayBuffer(10, space, spaces.Discrete(2), output="jax", **kwargs)
    again.load_checkpoint(tmp_path / "ted")  # the buffer the message names reads it
    assert again.size() == 1 and np.array_equal(again.observations[0], frame)


def test_host_ring_refuses_more_episode_ends_than_it_holds():
    # one-step episodes (two frames a step) in a buffer of 16 steps sized for episodes of 8:
    # its ring holds 16 + (2 + 2) + 4 = 24 frames, which the oldest step's frames (3 before
    # it) and ten steps fill; the eleventh add would overwrite the oldest step's frames and
    # raises, adding nothing
    space = spaces.Box(0, 255, (3, 2, 4), np.uint8)
    rb = ReplayBuffer(16, space, spaces.Discrete(2), frame_stack=4, min_episode_len=8)
    rng = np.random.default_rng(0)
    zero = np.zeros((3, 2, 1), np.uint8)

    def one_step_episode():
        a, b = (rng.integers(1, 256, (3, 2, 1), dtype=np.uint8) for _ in range(2))
        obs = np.concatenate([zero, zero, zero, a], axis=-1)[None]
        nxt = np.concatenate([zero, zero, a, b], axis=-1)[None]
        return obs, nxt, np.zeros(1), np.zeros(1), np.ones(1), [{}]

    for _ in range(10):
        rb.add(*one_step_episode())
    held = (rb.pos, rb.full, rb.observations.copy())
    with pytest.raises(ValueError, match="min_episode_len") as raised:
        rb.add(*one_step_episode())
    assert "nothing was added" in str(raised.value)
    assert (rb.pos, rb.full) == held[:2]
    assert np.array_equal(rb.observations, held[2])
    # every stored stack is a one-step episode's: three zero frames, then its frame
    assert th.all(rb.sample(16).observations[..., :3] == 0)


def test_host_ring_refuses_to_rewrite_observations():
    _, rb = fed(False, 1, steps=20, size=10)
    obs = rb.observations
    with pytest.raises(ValueError, match="built with frame_stack= cannot be rewritten"):
        obs[0] = 0
    rewards = rb.rewards
    rewards[0] = 7.0  # the other fields are stored as they are
    assert rb.rewards[0, 0] == 7.0


@OURS
def test_stores_about_one_frame_per_step(ours):
    space = spaces.Box(0, 255, (84, 84, 4), np.uint8)
    rb = ours(10_000, space, spaces.Discrete(4), device="cpu", frame_stack=4)
    theirs_bytes = 2 * 10_000 * 84 * 84 * 4
    ours_bytes = rb._grid.nbytes() + (0 if rb._ring is None else rb._ring.nbytes)
    assert ours_bytes <= 1.1 * theirs_bytes / 8, (ours_bytes, theirs_bytes)


def test_refuses_observations_that_are_not_stacks():
    space = spaces.Box(0, 255, (6, 5, 4), np.uint8)
    rb = ReplayBuffer(10, space, spaces.Discrete(2), device="cpu", frame_stack=4)
    obs = np.random.default_rng(0).integers(0, 255, (1, 6, 5, 4), dtype=np.uint8)
    with pytest.raises(ValueError, match="zeros before the episode's first frame"):
        rb.add(obs, obs, np.zeros(1), np.zeros(1), np.zeros(1), [{}])
    with pytest.raises(ValueError, match="channel axis"):
        ReplayBuffer(
            10,
            spaces.Box(0, 255, (6, 5, 3), np.uint8),
            spaces.Discrete(2),
            frame_stack=4,
            channels_order="last",
        )
