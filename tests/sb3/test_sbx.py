"""SBX (Stable-Baselines3 in JAX) takes functional_rb.sb3's buffers as ``replay_buffer_class``
with no other change."""

import jax
import pytest

pytest.importorskip("stable_baselines3")
sbx = pytest.importorskip("sbx")

from functional_rb.sb3 import ReplayBuffer  # noqa: E402


def test_sbx_sac_learns_with_ours():
    # SBX's own code broadcasts ranks, which the suite's conftest makes an error
    model = sbx.SAC(
        "MlpPolicy",
        "Pendulum-v1",
        learning_starts=50,
        buffer_size=500,
        batch_size=32,
        replay_buffer_class=ReplayBuffer,
        seed=0,
        policy_kwargs=dict(net_arch=[16]),
    )
    with jax.numpy_rank_promotion("allow"):
        model.learn(100)
    assert type(model.replay_buffer) is ReplayBuffer
    assert model.replay_buffer.size() == 100
