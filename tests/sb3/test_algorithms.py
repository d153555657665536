"""The classes as ``replay_buffer_class=`` of SB3's and sb3-contrib's off-policy algorithms,
with no other change; the model's own save/load of the buffer."""

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
from stable_baselines3 import DDPG, DQN, SAC, TD3  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.envs import SimpleMultiObsEnv  # noqa: E402

from functional_rb.sb3 import DictReplayBuffer, NStepReplayBuffer, ReplayBuffer  # noqa: E402

contrib = pytest.importorskip("sb3_contrib")


def small(**kw):
    """Small settings, fresh each time (SB3 writes into the policy_kwargs it is given)."""
    return dict(
        learning_starts=30,
        buffer_size=300,
        batch_size=16,
        policy_kwargs=dict(net_arch=[16]),
        seed=0,
        **kw,
    )


@pytest.mark.parametrize(
    "algo,env",
    [
        (DQN, "CartPole-v1"),
        (SAC, "Pendulum-v1"),
        (TD3, "Pendulum-v1"),
        (DDPG, "Pendulum-v1"),
        (contrib.QRDQN, "CartPole-v1"),
        (contrib.TQC, "Pendulum-v1"),
        (contrib.CrossQ, "Pendulum-v1"),
    ],
)
def test_algorithms_learn_with_ours(algo, env):
    kwargs = small()
    if algo is contrib.CrossQ:
        kwargs["policy_kwargs"] = dict(net_arch=dict(pi=[16], qf=[16]))
    model = algo("MlpPolicy", env, replay_buffer_class=ReplayBuffer, **kwargs)
    model.learn(80)
    assert type(model.replay_buffer) is ReplayBuffer
    assert model.replay_buffer.size() == 80


def test_n_steps_and_dict_observations():
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=NStepReplayBuffer,
        replay_buffer_kwargs=dict(n_steps=3, gamma=0.9),
        **small(),
    )
    model.learn(60)
    assert model.replay_buffer.sample(8).discounts is not None
    model = DQN(
        "MultiInputPolicy",
        SimpleMultiObsEnv(random_start=False),
        replay_buffer_class=DictReplayBuffer,
        **small(),
    )
    model.learn(60)
    assert model.replay_buffer.size() == 60


def test_model_saves_and_loads_our_buffer(tmp_path):
    model = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer, **small())
    model.learn(50)
    model.save_replay_buffer(tmp_path / "rb.pkl")
    other = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer, **small())
    other.load_replay_buffer(tmp_path / "rb.pkl")
    assert type(other.replay_buffer) is ReplayBuffer
    for name in ("observations", "actions", "rewards", "dones"):
        assert np.array_equal(
            getattr(model.replay_buffer, name), getattr(other.replay_buffer, name)
        )


def test_a_buffer_sb3_saved_converts(tmp_path):
    model = DQN("MlpPolicy", "CartPole-v1", **small())
    model.learn(50)
    model.save_replay_buffer(tmp_path / "sb3.pkl")
    other = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer, **small())
    other.load_replay_buffer(tmp_path / "sb3.pkl")
    assert type(other.replay_buffer) is SB3ReplayBuffer  # SB3's pickle names SB3's class
    other.replay_buffer = ReplayBuffer.from_sb3(other.replay_buffer)
    assert np.array_equal(other.replay_buffer.observations, model.replay_buffer.observations)
    other.learn(20, reset_num_timesteps=False)
