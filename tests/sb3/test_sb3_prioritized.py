"""Prioritized replay for SB3: the draw follows priorities ** alpha (chi-square), the weights
follow the formula, and use_priorities makes DQN, SAC and TD3 weight their critic losses and
report their TD errors."""

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from scipy import stats

pytest.importorskip("stable_baselines3")
from stable_baselines3 import DQN, SAC, TD3  # noqa: E402

from functional_rb.sb3 import (  # noqa: E402
    DictPrioritizedReplayBuffer,
    PrioritizedReplayBuffer,
    use_priorities,
)
from functional_rb.sb3.prioritized import _WeightedLosses  # noqa: E402

BOX = spaces.Box(-1, 1, (2,), np.float32)


def filled(n=8, **kw):
    rb = PrioritizedReplayBuffer(n, BOX, spaces.Discrete(2), device="cpu", **kw)
    for i in range(n):
        o = np.full((1, 2), i, np.float32)
        rb.add(o, o, np.array([i % 2]), np.ones(1), np.zeros(1), [{}])
    return rb


def test_draws_follow_priorities_to_the_alpha():
    alpha, n = 0.7, 8
    rb = filled(n, alpha=alpha, beta=0.5)
    priorities = np.arange(1, n + 1, dtype=np.float64)
    rb.update_priorities(np.arange(n), priorities - rb.eps)
    np.random.seed(0)
    counts = np.zeros(n)
    for _ in range(10):
        counts += np.bincount(rb.sample(2000).indices, minlength=n)
    expected = priorities**alpha / np.sum(priorities**alpha) * counts.sum()
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_weights_follow_the_formula():
    alpha, beta, n = 0.6, 0.4, 8
    rb = filled(n, alpha=alpha, beta=beta)
    priorities = np.linspace(0.5, 4.0, n)
    rb.update_priorities(np.arange(n), priorities - rb.eps)
    batch = rb.sample(64)
    scaled = priorities**alpha
    want = (scaled.min() / scaled[batch.indices]) ** beta
    np.testing.assert_allclose(batch.weights.numpy()[:, 0], want, rtol=1e-5)
    rb.beta = 1.0
    batch = rb.sample(64)
    np.testing.assert_allclose(
        batch.weights.numpy()[:, 0], scaled.min() / scaled[batch.indices], rtol=1e-5
    )


def test_an_empty_update_changes_nothing():
    rb = filled(4, alpha=1.0, beta=1.0)
    rb.update_priorities(np.arange(4), np.ones(4) - rb.eps)
    rb.update_priorities(np.array([], np.int64), np.array([]))
    np.random.seed(0)
    counts = np.bincount(rb.sample(4000).indices, minlength=4)
    assert stats.chisquare(counts).pvalue > 1e-3  # still uniform: no item lost its priority


def test_dict_buffer_and_update_errors():
    space = spaces.Dict({"a": BOX, "b": spaces.Discrete(3)})
    rb = DictPrioritizedReplayBuffer(8, space, spaces.Discrete(2), device="cpu")
    obs = {"a": np.zeros((1, 2), np.float32), "b": np.array([1])}
    rb.add(obs, obs, np.array([0]), np.ones(1), np.zeros(1), [{}])
    batch = rb.sample(4)
    assert sorted(batch.observations) == ["a", "b"] and batch.weights.shape == (4, 1)
    with pytest.raises(ValueError, match="one priority per sampled index"):
        rb.update_priorities(batch.indices, np.ones(3))
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 8\)"):
        rb.update_priorities(np.array([0, 8]), np.ones(2))
    with pytest.raises(ValueError, match=r"priorities\[1\] = nan is not a finite number"):
        rb.update_priorities(np.array([0, 0]), np.array([1.0, np.nan]))


def test_the_loss_stand_in_weights_items_and_reports_td_errors():
    rb = filled(4)
    batch = rb.sample(5)
    weights = {"w": th.tensor([1.0, 2.0, 0.0, 1.0, 0.5])}
    stand_in = _WeightedLosses(th.nn.functional, rb, weights)
    q, target = th.arange(5.0).reshape(5, 1), th.zeros(5, 1)
    loss = stand_in.mse_loss(q, target)
    assert th.isclose(loss, (weights["w"] * th.arange(5.0) ** 2).mean())
    assert stand_in.relu is th.nn.functional.relu
    rb.flush_priorities()  # the reported |TD| become the sampled items' priorities
    b = rb.sample(256)
    sampled = set(batch.indices[1:].tolist())  # index 0 got |TD| 0: only eps remains
    if batch.indices[0] not in sampled:
        assert np.mean(b.indices == batch.indices[0]) < 0.01


@pytest.mark.parametrize(
    "algo,env", [(DQN, "CartPole-v1"), (SAC, "Pendulum-v1"), (TD3, "Pendulum-v1")]
)
def test_use_priorities_trains_and_updates(algo, env):
    model = algo(
        "MlpPolicy",
        env,
        learning_starts=50,
        buffer_size=500,
        batch_size=32,
        replay_buffer_class=PrioritizedReplayBuffer,
        seed=0,
        policy_kwargs=dict(net_arch=[16]),
        replay_buffer_kwargs=dict(alpha=0.6, beta=0.4, beta_schedule=lambda p: 1.0 - 0.6 * p),
    )
    use_priorities(model)
    model.learn(120)
    rb = model.replay_buffer
    assert 0.4 < rb.beta <= 1.0  # the schedule ran
    batch = rb.sample(256)
    assert np.ptp(batch.weights.numpy()) > 0  # priorities are no longer all equal


def test_use_priorities_refuses_a_plain_buffer():
    with pytest.raises(TypeError, match="PrioritizedReplayBuffer"):
        use_priorities(DQN("MlpPolicy", "CartPole-v1"))
