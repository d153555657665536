"""functional_rb.sb3 against Stable-Baselines3's own buffers: same draws for the same seed,
bit for bit, whatever the dtypes, envs, ring position or variant; pickles, SB3 pickles,
checkpoints and the JAX path."""

import copy
import pickle

import jax
import numpy as np
import pytest
import torch as th
from gymnasium import spaces

pytest.importorskip("stable_baselines3")
from stable_baselines3.common import buffers as S  # noqa: E402

import functional_rb as frb  # noqa: E402
import functional_rb.sb3 as F  # noqa: E402

BOX = spaces.Box(-5, 5, (3,), np.float32)


class StagedReplayBuffer(F.ReplayBuffer):
    """Rows in the core's device storage, steps staged on the host (the path of
    ``output="jax"`` and of prioritized buffers), with torch samples to compare."""

    def _host_rows(self):
        return False


OURS = [F.ReplayBuffer, StagedReplayBuffer]


def steps(obs_space, act_space, n_envs, count, seed=0, ends=0.2):
    """Random steps as SB3's add takes them; obs[t+1] == next_obs[t] unless t ended."""
    rng = np.random.default_rng(seed)
    obs_space.seed(seed)
    act_space.seed(seed)

    def obs():
        if isinstance(obs_space, spaces.Dict):
            draws = [obs_space.sample() for _ in range(n_envs)]
            return {k: np.stack([d[k] for d in draws]) for k in obs_space.spaces}
        return np.stack([obs_space.sample() for _ in range(n_envs)])

    def where(d, new, old):
        if isinstance(old, dict):
            return {k: where(d, new[k], old[k]) for k in old}
        return np.where(d.reshape(-1, *[1] * (old.ndim - 1)), new, old)

    o = obs()
    for _ in range(count):
        no = obs()
        a = np.stack([act_space.sample() for _ in range(n_envs)])
        r = rng.normal(size=n_envs).astype(np.float32)
        d = rng.random(n_envs) < ends
        infos = [{"TimeLimit.truncated": bool(rng.random() < 0.5)} for _ in range(n_envs)]
        yield o, no, a, r, d.astype(np.float32), infos
        o = where(d, obs(), no)


def assert_same_sample(a, b):
    assert type(a).__name__ == type(b).__name__
    for name, x, y in zip(a._fields, a, b):
        if x is None:
            assert y is None, name
        elif isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype and th.equal(x[k], y[k]), (name, k)
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype)
            assert th.equal(x, y), name


def fill(pair, obs_space, act_space, n_envs, count, **kw):
    for step in steps(obs_space, act_space, n_envs, count, **kw):
        for b in pair:
            b.add(*copy.deepcopy(step))  # SB3's DictReplayBuffer.add reshapes obs in place


def same_draws(pair, batch=64, seeds=(0, 1)):
    for seed in seeds:
        out = []
        for b in pair:
            np.random.seed(seed)
            out.append(b.sample(batch))
        assert_same_sample(*out)


@pytest.mark.parametrize("n_envs,count", [(1, 7), (1, 40), (2, 33), (4, 11)])
@pytest.mark.parametrize(
    "act", [spaces.Discrete(5), spaces.Box(-1, 1, (2,), np.float64)], ids=["discrete", "box64"]
)
@pytest.mark.parametrize("ours", OURS, ids=["host", "staged"])
def test_replay_buffer_equals_sb3s(n_envs, count, act, ours):
    pair = [cls(40, BOX, act, device="cpu", n_envs=n_envs) for cls in (S.ReplayBuffer, ours)]
    fill(pair, BOX, act, n_envs, count)
    same_draws(pair)
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        a, b = getattr(pair[0], name), getattr(pair[1], name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (pair[0].pos, pair[0].full, pair[0].size()) == (
        pair[1].pos,
        pair[1].full,
        pair[1].size(),
    )


@pytest.mark.parametrize("batch", [2, 700], ids=["few-staged-hits", "many-staged-hits"])
@pytest.mark.parametrize("ours", OURS, ids=["host", "staged"])
def test_samples_of_steps_still_staged_on_the_host_equal_sb3s(batch, ours):
    # 600 steps of 2 envs into 1000 slots: staged, the newest 88 wait on the host (the stage
    # holds 256), and a sample takes those from there, a step at a time or all at once
    act = spaces.Discrete(3)
    pair = [cls(2000, BOX, act, device="cpu", n_envs=2) for cls in (S.ReplayBuffer, ours)]
    fill(pair, BOX, act, 2, 600)
    same_draws(pair, batch=batch, seeds=range(6))
    np.random.seed(0)
    first = pair[1].sample(batch)
    np.random.seed(0)
    again = pair[1].sample(batch)
    first.observations.add_(1.0)  # each sample owns its arrays: nothing else changes
    assert not th.equal(first.observations, again.observations)
    np.random.seed(0)
    assert th.equal(pair[1].sample(batch).observations, again.observations)


@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int16, np.uint32, np.int64, np.uint64, np.float16, np.float64]
)
def test_every_dtype_comes_back(dtype):
    space = spaces.Dict({"x": spaces.Box(0, 100, (2,), dtype), "d": spaces.Discrete(7)})
    pair = [
        cls(16, space, spaces.Discrete(3), device="cpu", n_envs=2)
        for cls in (S.DictReplayBuffer, F.DictReplayBuffer)
    ]
    fill(pair, space, spaces.Discrete(3), 2, 20)
    same_draws(pair)
    assert pair[1].observations["x"].dtype == dtype


@pytest.mark.parametrize("n_steps,gamma", [(3, 0.99), (5, 0.9)])
def test_n_step_equals_sb3s(n_steps, gamma):
    pair = [
        cls(30, BOX, spaces.Discrete(2), device="cpu", n_envs=2, n_steps=n_steps, gamma=gamma)
        for cls in (S.NStepReplayBuffer, F.NStepReplayBuffer)
    ]
    fill(pair, BOX, spaces.Discrete(2), 2, 41)
    same_draws(pair)


@pytest.mark.parametrize("ours", OURS, ids=["host", "staged"])
def test_optimize_memory_usage_is_exact_where_sb3s_is_and_keeps_the_last_observation(ours):
    act = spaces.Discrete(2)
    plain = S.ReplayBuffer(30, BOX, act, device="cpu", handle_timeout_termination=False)
    theirs = S.ReplayBuffer(
        30, BOX, act, device="cpu", optimize_memory_usage=True, handle_timeout_termination=False
    )
    ours = ours(
        30, BOX, act, device="cpu", optimize_memory_usage=True, handle_timeout_termination=False
    )
    fill([plain, theirs, ours], BOX, act, 1, 47, ends=0.1)
    same_draws([theirs, ours], seeds=())  # the draw is SB3's (checked below per index)
    idx = np.arange(30)
    np.random.seed(0)
    want = plain._get_samples(idx)
    np.random.seed(0)
    got = ours._get_samples(idx)
    assert_same_sample(want, got)  # the exact next observation, episode ends included
    np.random.seed(5)
    a = theirs.sample(64)
    np.random.seed(5)
    b = ours.sample(64)
    assert th.equal(a.observations, b.observations) and th.equal(a.actions, b.actions)


@pytest.mark.parametrize("ours", OURS, ids=["host", "staged"])
def test_optimize_memory_usage_pickles_checkpoints_and_converts(tmp_path, ours):
    act = spaces.Discrete(2)
    kw = dict(device="cpu", n_envs=2, optimize_memory_usage=True, handle_timeout_termination=False)
    theirs = S.ReplayBuffer(20, BOX, act, **kw)
    rb = ours(20, BOX, act, **kw)
    fill([theirs, rb], BOX, act, 2, 33, ends=0.1)
    again = pickle.loads(pickle.dumps(rb))
    rb.save_checkpoint(tmp_path / "ck")
    loaded = ours(20, BOX, act, **kw)
    loaded.load_checkpoint(tmp_path / "ck")
    # SB3's arrays hold its own next observations (an episode end's is the next episode's
    # first): converted, ours samples exactly what SB3 samples
    converted = ours.from_sb3(theirs)
    same_draws([theirs, converted])
    # the copies of ours go on as it does (episode ends keep their true last observation)
    fill([rb, again, loaded], BOX, act, 2, 9, seed=3, ends=0.1)
    same_draws([rb, again])
    same_draws([rb, loaded])
    if rb._ring is not None:  # observations kept once on the host: shared, not rewritable
        nxt = rb.next_observations
        with pytest.raises(ValueError, match="built with optimize_memory_usage cannot be"):
            nxt[0] = 0


def test_pickles_and_sb3_pickles_load():
    pair = [
        S.ReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu", n_envs=2),
        F.ReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu", n_envs=2),
    ]
    fill(pair, BOX, spaces.Discrete(2), 2, 13)
    again = pickle.loads(pickle.dumps(pair[1]))
    converted = F.ReplayBuffer.from_sb3(pickle.loads(pickle.dumps(pair[0])))
    same_draws([pair[0], again])
    same_draws([pair[0], converted])
    fill([pair[0], again, converted], BOX, spaces.Discrete(2), 2, 5, seed=9)
    same_draws([pair[0], again, converted][:2])
    same_draws([pair[0], converted])


def test_checkpoint_round_trip(tmp_path):
    rb = F.PrioritizedReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu")
    fill([rb], BOX, spaces.Discrete(2), 1, 25)
    rb.update_priorities(np.arange(5), np.arange(5) + 1.0)
    fill([rb], BOX, spaces.Discrete(2), 1, 3, seed=4)  # staged on the host when saved
    rb.save_checkpoint(tmp_path / "ck")
    back = F.PrioritizedReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu")
    fill([back], BOX, spaces.Discrete(2), 1, 6, seed=5)  # staged, then replaced by the load
    back.load_checkpoint(tmp_path / "ck")
    same_draws([rb, back])
    assert (back.pos, back.full) == (rb.pos, rb.full)
    assert np.array_equal(back.observations, rb.observations)


@pytest.mark.parametrize("output", ["jax", "numpy"])
def test_output_array_types(output):
    pair = [
        F.ReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu"),
        F.ReplayBuffer(20, BOX, spaces.Discrete(2), device="cpu", output=output),
    ]
    fill(pair, BOX, spaces.Discrete(2), 1, 9)
    np.random.seed(0)
    a = pair[0].sample(8)
    np.random.seed(0)
    b = pair[1].sample(8)
    kind = jax.Array if output == "jax" else np.ndarray
    for x, y in zip(a[:5], b[:5]):
        assert isinstance(y, kind)
        assert np.array_equal(x.numpy(), np.asarray(y))


def test_errors_name_the_field_and_refuse_writes_and_empty_samples():
    rb = F.ReplayBuffer(10, BOX, spaces.Discrete(2), device="cpu", n_envs=2)
    with pytest.raises(ValueError, match="empty"):
        rb.sample(4)
    with pytest.raises(ValueError, match=r"\['observations'\] has shape \(3,\), expected \(2, 3\)"):
        rb.add(np.zeros(3), np.zeros((2, 3)), np.zeros(2), np.zeros(2), np.zeros(2), [{}, {}])
    for cls, message in (
        (F.ReplayBuffer, r"next_obs has shape \(2, 4\), expected \(2, 3\)"),
        (StagedReplayBuffer, r"\['next'\]\['observations'\] has shape \(2, 4\)"),
    ):  # observations stored once: on the host, and in the core's TEDStorage
        once = cls(10, BOX, spaces.Discrete(2), n_envs=2, optimize_memory_usage=True)
        with pytest.raises(ValueError, match=message):
            once.add(
                np.zeros((2, 3)), np.zeros((2, 4)), np.zeros(2), np.zeros(2), np.zeros(2), [{}, {}]
            )
        assert once.size() == 0 and once.pos == 0  # nothing of the refused step was kept
    with pytest.raises(ValueError, match="output must be one of"):
        F.ReplayBuffer(10, BOX, spaces.Discrete(2), output="tf")


@pytest.mark.parametrize("ours", OURS, ids=["host", "staged"])
@pytest.mark.parametrize("kw", [{}, dict(optimize_memory_usage=True)], ids=["plain", "once"])
def test_writes_into_attributes_reach_the_buffer(kw, ours):
    # SB3 writes into them itself: _setup_learn marks the newest step done
    pair = [
        cls(
            12,
            BOX,
            spaces.Discrete(2),
            device="cpu",
            n_envs=2,
            handle_timeout_termination=False,
            **kw,
        )
        for cls in (S.ReplayBuffer, ours)
    ]
    fill(pair, BOX, spaces.Discrete(2), 2, 9)
    for b in pair:
        b.dones[b.pos - 1] = True
        b.rewards[2:4, 1] = -7.0
        b.actions[0, 0] = 1
    for name in ("dones", "rewards", "actions"):
        assert np.array_equal(getattr(pair[0], name), getattr(pair[1], name)), name
    if not kw:  # (SB3's memory-optimized samples are wrong at episode ends; ours are not)
        np.random.seed(0)
        want = pair[0]._get_samples(np.arange(6))
        np.random.seed(0)
        assert_same_sample(want, pair[1]._get_samples(np.arange(6)))
    with pytest.raises(ValueError, match="view of a buffer attribute"):
        pair[1].dones[3][0] = 1.0  # a write into a view would be lost
    assert isinstance(pair[1].rewards * 2, np.ndarray)
    if kw:
        with pytest.raises(ValueError, match="stored once"):
            pair[1].observations[0] = 1.0
    else:
        pair[1].observations[0, 1] = 3.0
        assert (pair[1].observations[0, 1] == 3.0).all()


def test_extend_is_adds():
    pair = [F.ReplayBuffer(12, BOX, spaces.Discrete(2), device="cpu", n_envs=2) for _ in range(2)]
    data = list(steps(BOX, spaces.Discrete(2), 2, 17))
    for step in data:
        pair[0].add(*step)
    pair[1].extend(*[list(x) for x in zip(*data)])
    same_draws(pair)
    assert (pair[0].pos, pair[0].full) == (pair[1].pos, pair[1].full)


def test_the_default_buffer_keeps_numpy_rows_and_steps_make_no_jax_call():
    """Rows in the core's HostStorage: a loop of adds and samples writes and reads them with
    NumPy, so it moves nothing to or from a JAX device and replaces no core state; buffers
    that need the core per step keep its device storage."""
    act = spaces.Discrete(3)
    rb = F.ReplayBuffer(64, BOX, act, device="cpu", n_envs=2)
    assert isinstance(rb._grid.rb.storage, frb.HostStorage)
    fill([rb], BOX, act, 2, 5)
    rb.sample(8)
    state = rb._grid.state
    with jax.transfer_guard("disallow"):
        fill([rb], BOX, act, 2, 70, seed=1)  # wraps the ring
        for _ in range(5):
            rb.sample(8)
        rb.observations[3, 1] = 7.0  # a write into SB3's array: a NumPy write too
    assert rb._grid.state is state
    assert np.all(rb.observations[3, 1] == 7.0) and rb.full
    for ours in (
        F.ReplayBuffer(64, BOX, act, device="cpu", output="jax"),
        StagedReplayBuffer(64, BOX, act, device="cpu"),
        F.PrioritizedReplayBuffer(64, BOX, act, device="cpu"),
    ):
        assert not isinstance(ours._grid.rb.storage, frb.HostStorage)
