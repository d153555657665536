"""functional_rb.sb3.HerReplayBuffer against Stable-Baselines3's own: same episode bookkeeping
and, for the same seed, the same transitions, goals and rewards, bit for bit (every strategy,
one and two envs, a full buffer overwriting episodes, truncated trajectories); pickles, SB3
conversions, checkpoints and a short HER+SAC run."""

import copy
import doctest
import pickle
import warnings

import numpy as np
import pytest
import torch as th

pytest.importorskip("stable_baselines3")
from stable_baselines3 import SAC  # noqa: E402
from stable_baselines3 import HerReplayBuffer as SB3Her  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.vec_env import VecNormalize  # noqa: E402

from functional_rb.sb3 import HerReplayBuffer  # noqa: E402

ARRAYS = ("ep_start", "ep_length", "dones", "timeouts", "rewards", "actions")


def venv(n_envs):
    return make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True), n_envs)


def pair(env, per_env=9, **kwargs):
    """SB3's buffer and ours, alike; ``per_env`` steps of each env fit. Ours reads its
    episode bookkeeping 4 steps ahead (not 256), so the window moves and wraps."""
    n = env.num_envs
    args = (per_env * n, env.observation_space, env.action_space, env)
    kwargs = dict(device="cpu", n_envs=n, **kwargs)
    ours = HerReplayBuffer(*args, **kwargs)
    ours._window = 4
    return SB3Her(*args, **kwargs), ours


def steps(env, count, seed=0, p_end=0.25):
    """Random steps of ``env``'s spaces, episodes of random lengths (some longer than the
    buffer), obs[t+1] == next_obs[t] within an episode; infos that copy_info_dict keeps."""
    rng = np.random.default_rng(seed)
    space, act = env.observation_space, env.action_space
    space.seed(seed)
    act.seed(seed)
    n = env.num_envs

    def obs():
        draws = [space.sample() for _ in range(n)]
        return {k: np.stack([d[k] for d in draws]) for k in space.spaces}

    o = obs()
    for _ in range(count):
        no = obs()
        a = np.stack([act.sample() for _ in range(n)])
        r = rng.normal(size=n).astype(np.float32)
        d = rng.random(n) < p_end
        infos = [
            {"TimeLimit.truncated": bool(rng.random() < 0.5), "i": int(rng.integers(9))}
            for _ in range(n)
        ]
        yield o, no, a, r, d, infos
        fresh = obs()
        o = {k: np.where(d[:, None], fresh[k], no[k]) for k in o}


def add(buffers, step):
    for rb in buffers:
        rb.add(*copy.deepcopy(step))


def assert_same_state(sb3, ours):
    for name in ARRAYS:
        a, b = getattr(sb3, name), getattr(ours, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for key in sb3.observations:
        assert np.array_equal(sb3.observations[key], ours.observations[key]), key
        assert np.array_equal(sb3.next_observations[key], ours.next_observations[key]), key
    assert np.array_equal(sb3._current_ep_start, ours._current_ep_start)
    assert (sb3.pos, sb3.full) == (ours.pos, ours.full)


def assert_same_sample(a, b):
    assert type(a) is type(b)
    for name, x, y in zip(a._fields, a, b):
        if x is None:
            assert y is None, name
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), name
            for k in x:
                assert x[k].dtype == y[k].dtype and th.equal(x[k], y[k]), (name, k)
        else:
            assert x.dtype == y.dtype and th.equal(x, y), name


def assert_same_draws(sb3, ours, seed, batch_size=16, env=None):
    """Same seed, same sample, and NumPy's generator left in the same state."""
    np.random.seed(seed)
    a, after_a = sb3.sample(batch_size, env=env), np.random.rand()
    np.random.seed(seed)
    b, after_b = ours.sample(batch_size, env=env), np.random.rand()
    assert_same_sample(a, b)
    assert after_a == after_b


# ---------------------------------------------------------------------------- SB3's classes
def test_docstring_example():
    import functional_rb.sb3.her as module

    assert doctest.testmod(module).failed == 0


def test_is_sb3s_her_buffer_without_sb3s_arrays():
    from stable_baselines3.common.buffers import DictReplayBuffer

    assert issubclass(HerReplayBuffer, SB3Her)  # SB3's algorithms then pass it env
    rb = HerReplayBuffer(100, venv(1).observation_space, venv(1).action_space, None, device="cpu")
    assert isinstance(rb, DictReplayBuffer)
    assert not {"observations", "ep_start", "ep_length"} & set(vars(rb))  # no SB3 arrays
    assert rb.her_ratio == 0.8 and rb.goal_selection_strategy.name == "FUTURE"
    with pytest.raises(ValueError, match="read-only"):
        rb.ep_length[0, 0] = 1


# ---------------------------------------------------------------------------- same draws
@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("n_envs", [1, 2])
def test_same_bookkeeping_and_draws_as_sb3_through_wraparound(strategy, n_envs):
    env = venv(n_envs)
    sb3, ours = pair(env, goal_selection_strategy=strategy, n_sampled_goal=3, copy_info_dict=True)
    normalized = VecNormalize(env, norm_obs=False, norm_reward=True)
    normalized.ret_rms.var[...] = 4.0  # rewards halved
    for i, step in enumerate(steps(env, 40, seed=n_envs)):
        add((sb3, ours), step)
        if i % 4 == 3 or i > 30:
            assert_same_state(sb3, ours)
            if (sb3.ep_length > 0).any():
                assert_same_draws(sb3, ours, seed=i, env=normalized if i % 2 else None)
    assert sb3.full  # episodes were overwritten


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("handle_timeout_termination", [False, True])
def test_truncate_last_trajectory_as_sb3(n_envs, handle_timeout_termination):
    env = venv(n_envs)
    sb3, ours = pair(env, per_env=7, handle_timeout_termination=handle_timeout_termination)
    for i, step in enumerate(steps(env, 24, seed=3, p_end=0.1)):
        add((sb3, ours), step)
        if i % 5 == 2:
            with warnings.catch_warnings(record=True) as theirs:
                warnings.simplefilter("always")
                sb3.truncate_last_trajectory()
            with warnings.catch_warnings(record=True) as mine:
                warnings.simplefilter("always")
                ours.truncate_last_trajectory()
            assert [str(w.message) for w in theirs] == [str(w.message) for w in mine]
            assert_same_state(sb3, ours)
            assert_same_draws(sb3, ours, seed=i, batch_size=10)


def test_sampling_before_an_episode_ends_raises_sb3s_error():
    env = venv(1)
    sb3, ours = pair(env)
    add((sb3, ours), next(steps(env, 1, p_end=0.0)))
    for rb in (sb3, ours):
        with pytest.raises(RuntimeError, match="before the end of the first episode"):
            rb.sample(4)


def test_extend_goes_through_add():
    env = venv(2)
    sb3, ours = pair(env)
    for step in steps(env, 12, seed=5):
        sb3.add(*copy.deepcopy(step))
        ours.extend(*[[x] for x in copy.deepcopy(step)])
    assert_same_state(sb3, ours)


def test_grid_write_rewrites_only_the_given_fields_of_the_given_steps():
    env = venv(2)
    sb3, ours = pair(env)
    for step in steps(env, 6, seed=9):
        add((sb3, ours), step)
    ours._grid.write(np.array([1, 4]), np.array([1, 0]), {"dones": np.array([1.0, 1.0])})
    dones = sb3.dones.copy()
    dones[[1, 4], [1, 0]] = 1.0
    assert np.array_equal(ours.dones, dones)
    sb3.dones[...] = dones
    assert_same_state(sb3, ours)
    with pytest.raises(ValueError, match="distinct"):
        ours._grid.write(np.array([1, 1]), np.array([0, 0]), {"dones": np.ones(2)})


# ---------------------------------------------------------------------------- persistence
def test_pickle_drops_env_and_keeps_everything_else():
    env = venv(2)
    _, ours = pair(env, copy_info_dict=True)
    for step in steps(env, 20, seed=7):
        ours.add(*step)
    for copied in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)):
        assert copied.env is None
        copied.set_env(env)
        with pytest.raises(ValueError, match="already initialized"):
            copied.set_env(env)
        assert_same_state(ours, copied)
        assert [dict(x) for x in copied.infos.ravel()] == [dict(x) for x in ours.infos.ravel()]
        assert_same_draws(ours, copied, seed=1)


def test_from_sb3():
    env = venv(2)
    sb3, _ = pair(env)
    for step in steps(env, 23, seed=11):
        sb3.add(*step)
    ours = HerReplayBuffer.from_sb3(pickle.loads(pickle.dumps(sb3)), env=env)
    assert_same_state(sb3, ours)
    assert_same_draws(sb3, ours, seed=2)
    as_numpy = HerReplayBuffer.from_sb3(sb3, output="numpy")
    np.random.seed(4)
    a = sb3.sample(8)
    np.random.seed(4)
    b = as_numpy.sample(8)
    assert isinstance(b.rewards, np.ndarray) and np.array_equal(a.rewards.numpy(), b.rewards)


def test_checkpoint_round_trip(tmp_path):
    env = venv(2)
    sb3, ours = pair(env, per_env=30)
    for step in steps(env, 12, seed=11):
        add((sb3, ours), step)
    for step in steps(env, 3, seed=12, p_end=0.0):  # no episode ends: still staged on the host
        add((sb3, ours), step)
    ours.save_checkpoint(tmp_path / "her")
    loaded = pair(env, per_env=30)[1]
    for step in steps(env, 2, seed=13, p_end=0.0):  # staged steps the load replaces
        loaded.add(*step)
    loaded.load_checkpoint(tmp_path / "her")
    assert_same_state(sb3, loaded)
    assert_same_draws(sb3, loaded, seed=3)
    with pytest.raises(ValueError, match="copy_info_dict"):
        pair(env, copy_info_dict=True)[1].save_checkpoint(tmp_path / "infos")


# ---------------------------------------------------------------------------- with SB3's SAC
def sac(buffer_class, **kwargs):
    return SAC(
        "MultiInputPolicy",
        BitFlippingEnv(n_bits=4, continuous=True),
        replay_buffer_class=buffer_class,
        replay_buffer_kwargs=dict(n_sampled_goal=2, goal_selection_strategy="future"),
        learning_starts=100,
        train_freq=4,
        batch_size=64,
        buffer_size=2000,
        policy_kwargs=dict(net_arch=[32]),
        seed=0,
        device="cpu",
        **kwargs,
    )


@pytest.fixture
def one_torch_thread():
    """Tiny networks: torch's thread pool only fights JAX's for the cores (6 s against 0.1 s
    for SB3's own SAC run here, on a busy 2-core machine)."""
    threads = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(threads)


def test_seeded_sac_learns_as_with_sb3s_buffer_saves_and_reloads_it(tmp_path, one_torch_thread):
    theirs, model = sac(SB3Her).learn(200), sac(HerReplayBuffer).learn(200)
    a, b = theirs.policy.state_dict(), model.policy.state_dict()
    assert all(th.equal(a[k], b[k]) for k in a)  # the same draws, so the same updates
    ep_length = model.replay_buffer.ep_length
    assert np.array_equal(theirs.replay_buffer.ep_length, ep_length)
    model.save_replay_buffer(tmp_path / "rb.pkl")
    with pytest.warns(UserWarning, match="last trajectory in the replay buffer will be truncated"):
        model.load_replay_buffer(tmp_path / "rb.pkl", truncate_last_traj=True)
    assert isinstance(model.replay_buffer, HerReplayBuffer) and model.replay_buffer.pos == 200
    assert model.replay_buffer.env is model.env
    assert (model.replay_buffer.ep_length[199] > 0).all()  # the last episode was ended
    assert np.array_equal(model.replay_buffer.ep_length[:190], ep_length[:190])
    model.learn(50, reset_num_timesteps=False)
