"""functional_rb.adapters' HERReplayBuffer, OfflineToOnlineReplayBuffer, prefill_replay_buffer
and StoreStorage, each run beside TorchRL's class of the same name on the same data and seed
(the same batches, indices and relabelled goals), plus HER's invariants where TorchRL and the
adapters differ on purpose (an episode that wraps around the end of a full storage)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, tensorclass

import functional_rb.adapters as A

T = pytest.importorskip("torchrl.data")


# ============================================================================ HER
def goal_data(done_at, n, goal_dim=3):
    """``n`` steps; step ``s`` achieves goal ``(s, s, ...)``; episodes end at ``done_at``."""
    g = torch.Generator().manual_seed(0)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[list(done_at)] = True
    achieved = torch.arange(n, dtype=torch.float32)[:, None].expand(n, goal_dim).clone()
    return TensorDict(
        {
            "observation": torch.randn(n, 4, generator=g),
            "desired_goal": torch.randn(n, goal_dim, generator=g),
            "achieved_goal": achieved,
            "action": torch.randn(n, 2, generator=g),
            "next": {
                "observation": torch.randn(n, 4, generator=g),
                "desired_goal": torch.randn(n, goal_dim, generator=g),
                "achieved_goal": achieved + 0.5,
                "reward": torch.full((n, 1), -99.0),
                "done": done,
                "terminated": done.clone(),
            },
        },
        batch_size=[n],
    )


def reward_fn(td):
    return -(td["achieved_goal"] - td["desired_goal"]).norm(dim=-1, keepdim=True)


def her_pair(storage, **kw):
    """TorchRL's buffer and ours, built alike; ``storage(module)`` makes each one's storage."""
    return [
        M.HERReplayBuffer(reward_fn=reward_fn, storage=storage(M), batch_size=16, **kw)
        for M in (T, A)
    ]


def assert_same_batches(rbs, seed, n=4):
    got = []
    for rb in rbs:
        torch.manual_seed(seed)
        got.append([rb.sample(return_info=True) for _ in range(n)])
    for (a, ia), (b, ib) in zip(*got):
        torch.testing.assert_close(ia["index"], ib["index"])
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=str(key))


STORAGES = {
    "tensor": lambda M: M.LazyTensorStorage(40),
    "memmap": lambda M: M.LazyMemmapStorage(40),
}


@pytest.mark.parametrize("strategy", ["future", "final", "episode", "random"])
@pytest.mark.parametrize("kind", sorted(STORAGES))
def test_her_same_batches_as_torchrl(strategy, kind):
    """Not full, exactly full, and wrapped (no episode crosses the end of the storage). Once
    the storage is full, items are added one at a time: TorchRL's HER compares its cache key
    (which holds the last cursor, a tensor after extend) with ``!=`` and raises when a full
    storage was extended twice."""
    rbs = her_pair(STORAGES[kind], strategy=strategy, her_ratio=0.75)
    data = goal_data([4, 11, 17, 29, 39, 44, 47], 60)
    for rb in rbs:
        rb.extend(data[:25])
    assert_same_batches(rbs, seed=1)
    for rb in rbs:
        rb.extend(data[25:39])
        rb.add(data[39])  # exactly full: the write head is slot 39
    assert_same_batches(rbs, seed=2)
    for rb in rbs:
        for i in range(40, 48):  # wrapped: slot 39 still ends an episode
            rb.add(data[i])
    assert_same_batches(rbs, seed=3)


def test_her_same_batches_as_torchrl_with_a_prioritized_sampler():
    rbs = [
        M.HERReplayBuffer(
            reward_fn=reward_fn,
            storage=M.LazyTensorStorage(64),
            batch_size=8,
            sampler=M.SamplerWithoutReplacement(),
            her_ratio=0.5,
        )
        for M in (T, A)
    ]
    for rb in rbs:
        rb.extend(goal_data([9, 20, 31], 40))
    assert_same_batches(rbs, seed=5, n=6)


def test_her_nested_goal_keys_custom_reward_key_and_reward_shapes():
    """Nested goal keys and a custom reward key as TorchRL; a reward_fn returning ``[n]``
    (documented by TorchRL, whose in-place write then fails) fills the ``[n, 1]`` entry."""
    n = 12
    data = TensorDict(
        {
            "obs": {
                "desired_goal": torch.zeros(n, 3),
                "achieved_goal": torch.arange(n * 3.0).reshape(n, 3),
            },
            "shaped_reward": torch.full((n, 1), -99.0),
            "next": {"done": torch.arange(n)[:, None] % 5 == 4},
        },
        [n],
    )

    def make(M, keepdim):
        return M.HERReplayBuffer(
            reward_fn=lambda td: td["obs", "desired_goal"].sum(-1, keepdim=keepdim),
            storage=M.LazyTensorStorage(20),
            batch_size=n,
            her_ratio=1.0,
            goal_key=("obs", "desired_goal"),
            reward_key="shaped_reward",
            achieved_goal_key=("obs", "achieved_goal"),
        )

    rbs = [make(T, True), make(A, True), make(A, False)]
    for rb in rbs:
        rb.extend(data.clone())
    assert_same_batches(rbs[:2], seed=0, n=2)
    assert_same_batches(rbs[1:], seed=0, n=2)


@given(
    ends=st.lists(st.booleans(), min_size=30, max_size=30),
    writes=st.integers(5, 30),
    strategy=st.sampled_from(["future", "final", "episode", "random"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15)
def test_her_goals_stay_in_the_sampled_steps_episode(ends, writes, strategy, seed):
    """Capacity 12, 30 steps in chunks: episodes wrap around the end of the storage; every
    relabelled goal is an achieved goal of the same (stored) episode, later for "future", the
    newest stored step of it for "final"."""
    n = 30
    data = goal_data([i for i, e in enumerate(ends) if e], n)
    episode = torch.cumsum(torch.tensor([0] + ends[:-1]), 0)
    rb = A.HERReplayBuffer(
        reward_fn=reward_fn,
        storage=A.LazyTensorStorage(12),
        batch_size=10,
        strategy=strategy,
        her_ratio=1.0,
        generator=torch.Generator().manual_seed(seed),
    )
    for start in range(0, n, writes):
        rb.extend(data[start : start + writes])
    stored = rb[:]["achieved_goal"][:, 0].long()  # the steps still stored
    batch = rb.sample()
    step = batch["achieved_goal"][:, 0].long()
    goal = batch["desired_goal"][:, 0].long()
    assert torch.isin(goal, stored).all()
    torch.testing.assert_close(batch["next", "desired_goal"], batch["desired_goal"])
    torch.testing.assert_close(batch["next", "reward"], reward_fn(batch))
    if strategy == "random":
        return
    assert (episode[goal] == episode[step]).all()
    if strategy == "future":
        assert (goal >= step).all()
    if strategy == "final":
        newest = {
            int(e): int(s) for s, e in zip(stored.sort().values, episode[stored.sort().values])
        }
        assert goal.tolist() == [newest[int(e)] for e in episode[step]]


def test_her_episode_across_the_end_of_a_full_storage_stays_whole():
    """Capacity 10, steps 0..13, episodes end at 5 and 13: steps 6..13 are one episode in
    slots 6..9 and 0..3; its "final" goal is step 13 for all of them (TorchRL cuts it at the
    last end flag in storage order and gives slots 6..9 the goal of the episode before)."""
    rb = A.HERReplayBuffer(
        reward_fn=reward_fn,
        storage=A.LazyTensorStorage(10),
        batch_size=8,
        strategy="final",
        her_ratio=1.0,
    )
    rb.extend(goal_data([5, 13], 14))
    batch = rb.sample()
    step = batch["achieved_goal"][:, 0]
    want = torch.where(step >= 6, 13.0, 5.0)
    torch.testing.assert_close(batch["desired_goal"][:, 0], want)


def test_her_cache_follows_every_write():
    """In a full ring, a write that ends where the last one did leaves TorchRL's cache key
    unchanged; the episodes are read again after every write here."""
    rb = A.HERReplayBuffer(
        reward_fn=reward_fn,
        storage=A.LazyTensorStorage(8),
        batch_size=8,
        strategy="final",
        her_ratio=1.0,
    )
    rb.extend(goal_data([3, 7], 8))
    rb.sample()
    key = rb._last_cache_key
    assert key == (8, 7, True)
    rb.extend(goal_data([1, 7], 8))  # same length, cursor and fullness
    assert rb._last_cache_key == key
    batch = rb.sample()
    step = batch["achieved_goal"][:, 0]
    torch.testing.assert_close(batch["desired_goal"][:, 0], torch.where(step <= 1, 1.0, 7.0))
    torch.testing.assert_close(rb._episode_ends_cache, torch.tensor([1, 7]))


def test_her_state_dict_empty_and_repr():
    (rb,) = her_pair(STORAGES["tensor"])[1:]
    rb.extend(goal_data([4, 9], 10))
    rb.sample()
    sd = rb.state_dict()
    assert sd["_her"]["strategy"] == "future"
    torch.testing.assert_close(sd["_her"]["episode_ends_cache"], torch.tensor([4, 9]))
    rb2 = A.HERReplayBuffer(reward_fn=reward_fn, storage=A.LazyTensorStorage(40), batch_size=16)
    rb2.load_state_dict(sd)
    assert "_her" in sd  # the caller's dict is left whole
    assert rb2._last_cache_key == rb._last_cache_key and len(rb2) == 10
    torch.manual_seed(0)
    a = rb.sample()
    torch.manual_seed(0)
    torch.testing.assert_close(rb2.sample()["desired_goal"], a["desired_goal"])
    rb2.empty()
    assert len(rb2) == 0 and rb2._last_cache_key == (-1, None, False)
    r = repr(rb)
    assert "HERReplayBuffer(strategy='future'" in r and "desired_goal" in r


def test_her_list_storage():
    """A ListStorage (TorchRL's HER cannot read its end flags) relabels as a tensor one."""
    data = goal_data([4, 9], 10)
    rbs = [
        A.HERReplayBuffer(
            reward_fn=reward_fn, storage=s, batch_size=6, strategy="final", her_ratio=1.0
        )
        for s in (A.ListStorage(20), A.LazyTensorStorage(20))
    ]
    for rb in rbs:
        rb.extend(data)
    assert_same_batches(rbs, seed=4, n=2)


def test_her_errors_name_the_argument_and_fix():
    with pytest.raises(ValueError, match=r"her_ratio must be in \[0, 1\].*got 1.5"):
        A.HERReplayBuffer(reward_fn=reward_fn, her_ratio=1.5)
    with pytest.raises(ValueError, match="strategy must be one of"):
        A.HERReplayBuffer(reward_fn=reward_fn, strategy="past")
    assert (
        A.HERReplayBuffer(reward_fn=reward_fn, strategy=T.HindsightStrategy.FINAL).strategy
        is A.HindsightStrategy.FINAL
    )
    rb = A.HERReplayBuffer(reward_fn=reward_fn, storage=A.LazyTensorStorage(10), batch_size=4)
    rb.extend(goal_data([3], 5).exclude(("next", "done"), ("next", "terminated")))
    with pytest.raises(KeyError, match="neither .* episodes cannot be found"):
        rb.sample()
    rb = A.HERReplayBuffer(
        reward_fn=lambda td: torch.zeros(3),
        storage=A.LazyTensorStorage(10),
        batch_size=4,
        her_ratio=1.0,
    )
    rb.extend(goal_data([3], 5))
    with pytest.raises(ValueError, match=r"reward_fn returned shape \(3,\)"):
        rb.sample()
    rb = A.HERReplayBuffer(
        reward_fn=reward_fn, storage=A.LazyTensorStorage(10), batch_size=4, reward_key="bonus"
    )
    rb.extend(goal_data([3], 5))
    with pytest.raises(KeyError, match="reward_key='bonus'"):
        rb.sample()
    rb = A.HERReplayBuffer(
        reward_fn=reward_fn, storage=A.LazyTensorStorage(10, ndim=2), batch_size=4
    )
    rb.extend(torch.stack([goal_data([3], 5), goal_data([3], 5)], 1))
    with pytest.raises(NotImplementedError, match="only supports 1D storages"):
        rb.sample()


# ============================================================================ offline to online
def offline_pair(n=100):
    out = []
    for M in (T, A):
        rb = M.ReplayBuffer(storage=M.LazyTensorStorage(n))
        rb.extend(
            TensorDict({"obs": torch.arange(n * 2.0).reshape(n, 2), "src": torch.zeros(n, 1)}, [n])
        )
        out.append(rb)
    return out


def online(k, start=1000):
    return TensorDict(
        {"obs": torch.arange(start, start + k * 2.0).reshape(k, 2), "src": torch.ones(k, 1)}, [k]
    )


def test_offline_to_online_same_batches_as_torchrl():
    rbs = [
        M.OfflineToOnlineReplayBuffer(off, online_capacity=50, offline_fraction=0.3, batch_size=10)
        for M, off in zip((T, A), offline_pair())
    ]
    outs = [[], []]
    for i, rb in enumerate(rbs):
        torch.manual_seed(0)
        outs[i].append(rb.sample())  # online empty: offline only
        idx = rb.extend(online(20))
        assert torch.equal(torch.as_tensor(idx), torch.arange(20))
        outs[i] += [rb.sample() for _ in range(3)]
        outs[i].append(rb.sample(7))  # round(0.3 * 7) = 2 offline rows
        rb.anneal(3, 4)
        outs[i].append(rb.sample())  # fraction 0.075: 1 offline row
        rb.anneal(5, 4)
        outs[i].append(rb.sample())  # fraction 0: online only
        assert rb.offline_fraction == 0 and len(rb) == 120
    for a, b in zip(*outs):
        assert (a == b).all()
    assert [int((b["src"] == 0).sum()) for b in outs[1]] == [10, 3, 3, 3, 2, 1, 0]
    assert repr(rbs[1]).startswith(
        "OfflineToOnlineReplayBuffer(offline=ReplayBuffer, offline_fraction=0.000, online_size=20"
    )


def test_offline_to_online_storage_transform_and_index_entries():
    off = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(30))
    off.extend(TensorDict({"obs": torch.zeros(30, 2), "src": torch.zeros(30, 1)}, [30]))
    rb = A.OfflineToOnlineReplayBuffer(
        off,
        online_storage=A.LazyMemmapStorage(16),
        batch_size=8,
        transform=lambda td: td.set("seen", td["src"]),
    )
    rb.extend(online(4))
    batch = rb.sample()
    # the dataset's "index" (its own positions) is dropped from a mixed batch
    assert "index" not in batch.keys() and torch.equal(batch["seen"], batch["src"])
    assert batch["src"].squeeze(-1).tolist() == [0] * 4 + [1] * 4
    assert isinstance(rb.online_buffer.storage, A.LazyMemmapStorage) and rb.offline_buffer is off
    # TorchRL raises on the same data
    t_off = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(30))
    t_off.extend(TensorDict({"obs": torch.zeros(30, 2), "src": torch.zeros(30, 1)}, [30]))
    t_rb = T.OfflineToOnlineReplayBuffer(t_off, online_capacity=16, batch_size=8)
    t_rb.extend(online(4))
    with pytest.raises(KeyError):
        t_rb.sample()
    other = A.OfflineToOnlineReplayBuffer(off, online_capacity=16, batch_size=8)
    other.extend(TensorDict({"obs": torch.zeros(4, 2)}, [4]))
    with pytest.raises(ValueError, match=r"only offline: \['src'\]"):
        other.sample()


def test_offline_to_online_argument_errors():
    off = offline_pair()[1]
    with pytest.raises(ValueError, match="OR online_capacity"):
        A.OfflineToOnlineReplayBuffer(off, online_storage=A.LazyTensorStorage(4), online_capacity=4)
    with pytest.raises(ValueError, match="one of online_storage"):
        A.OfflineToOnlineReplayBuffer(off)
    with pytest.raises(ValueError, match=r"offline_fraction must be in \(0, 1\), got 1"):
        A.OfflineToOnlineReplayBuffer(off, online_capacity=4, offline_fraction=1)
    with pytest.raises(ValueError, match="only forwarded when offline_dataset is a string"):
        A.OfflineToOnlineReplayBuffer(off, online_capacity=4, root="/tmp")
    with pytest.raises(ValueError, match="batch_size must be provided"):
        A.OfflineToOnlineReplayBuffer("d4rl:hopper-medium-v2", online_capacity=4)
    with pytest.raises(ValueError, match="with a prefix among"):
        A.OfflineToOnlineReplayBuffer("lerobot:x", online_capacity=4, batch_size=2)
    with pytest.raises(TypeError, match="TorchRL's own class"):
        A.OfflineToOnlineReplayBuffer(off, online_storage=T.LazyTensorStorage(4))
    rb = A.OfflineToOnlineReplayBuffer(off, online_capacity=4)
    with pytest.raises(ValueError, match="batch_size must be provided"):
        rb.sample()
    with pytest.raises(ValueError, match="total_steps must be > 0"):
        rb.anneal(1, 0)


def test_offline_dataset_by_id_from_a_local_server(tmp_path, monkeypatch):
    """ "d4rl:<name>" builds the adapters' D4RL loader (files served locally)."""
    pytest.importorskip("h5py")
    import _dataset_server as S
    from _dataset_server import d4rl_file

    from functional_rb.adapters.datasets._d4rl_files import D4RL_FILES

    server = S.DatasetServer()
    try:
        data, (obs, *_) = d4rl_file(tmp_path)
        server.files["/" + D4RL_FILES["hopper-medium-v2"]] = data
        kw = dict(root=tmp_path / "root", base_url=server.url)
        rb = A.OfflineToOnlineReplayBuffer(
            "d4rl:hopper-medium-v2", online_capacity=8, batch_size=4, **kw
        )
        assert isinstance(rb.offline_buffer, A.datasets.D4RLExperienceReplay)
        assert len(rb) == 6 and rb.sample()["observation"].shape == (4, 3)
        target = A.ReplayBuffer(storage=A.LazyTensorStorage(10))
        # prefill_replay_buffer forwards no loader arguments (TorchRL's signature): the
        # loader's environment variables point it at the local server
        monkeypatch.setenv("FRB_DATASETS_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("FRB_D4RL_BASE_URL", server.url)
        A.prefill_replay_buffer(target, "d4rl:hopper-medium-v2", n_samples=5, chunk_size=2)
        assert len(target) == 5
        rows = target[:]["observation"]
        assert all((torch.as_tensor(obs[:6]) == r).all(-1).any() for r in rows)
    finally:
        server.close()


def test_prefill_same_rows_as_torchrl():
    outs = []
    for M, off in zip((T, A), offline_pair(50)):
        target = M.ReplayBuffer(storage=M.LazyTensorStorage(100))
        torch.manual_seed(7)
        assert M.prefill_replay_buffer(target, off, n_samples=23, chunk_size=10) is target
        outs.append(target[:])
        assert len(target) == 23
        target2 = M.ReplayBuffer(storage=M.LazyTensorStorage(100))
        M.prefill_replay_buffer(target2, off)
        assert len(target2) == 50
    assert (outs[0] == outs[1]).all()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        A.prefill_replay_buffer(A.ReplayBuffer(), offline_pair()[1], chunk_size=0)


# ============================================================================ StoreStorage
@pytest.fixture
def client():
    """A fresh in-process Redis server; each call returns an asyncio client of it (fakeredis
    and lupa are in the test extra; TensorDictStore writes with Lua scripts)."""
    fakeredis = pytest.importorskip("fakeredis")
    pytest.importorskip("lupa")
    from fakeredis import aioredis

    server = fakeredis.FakeServer()
    return lambda: aioredis.FakeRedis(server=server)


def transitions(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 4, generator=g),
            "action": torch.randint(0, 5, (n,), generator=g),
            "next": {"done": torch.rand(n, 1, generator=g) > 0.7},
        },
        [n],
    )


def test_store_storage_same_batches_as_torchrl(client):
    data = transitions(27)
    outs = []
    for M in (T, A):
        rb = M.ReplayBuffer(storage=M.StoreStorage(20, client=client()), batch_size=6)
        rb.extend(data[:12])
        rb.add(data[12])
        rb.extend(data[13:])  # wraps: 27 writes into 20 slots
        torch.manual_seed(3)
        outs.append((rb.sample(), rb[:], len(rb)))
    assert outs[0][2] == outs[1][2] == 20
    assert (outs[0][0] == outs[1][0]).all() and (outs[0][1] == outs[1][1]).all()
    ring = torch.cat([data[20:], data[7:20]])  # slot i holds the newest write to it
    assert (outs[1][1] == torch.cat([data[20:27], data[7:20]])).all() and ring.shape == (20,)


def test_store_storage_tensors_tensorclasses_and_long_batches(client):
    s = A.StoreStorage(5, client=client())
    rb = A.ReplayBuffer(storage=s, batch_size=3)
    rb.extend(torch.arange(16.0).reshape(8, 2))  # longer than the ring: the last 5 stay
    assert len(rb) == 5 and s.contains(4) and not s.contains(5)
    assert sorted(rb[:][:, 0].tolist()) == [6, 8, 10, 12, 14]
    assert rb.sample().shape == (3, 2)

    @tensorclass
    class Step:
        x: torch.Tensor

    s = A.StoreStorage(6, client=client())
    rb = A.ReplayBuffer(storage=s, batch_size=2)
    rb.extend(Step(x=torch.arange(4.0), batch_size=[4]))
    rb.add(Step(x=torch.tensor(9.0), batch_size=[]))
    assert isinstance(rb[1:3], Step) and rb[:].x.tolist() == [0, 1, 2, 3, 9]
    with pytest.raises(TypeError, match="cannot store a str"):
        A.StoreStorage(3, client=client()).set(0, "text")


def test_store_storage_state_dict_reconnects(client):
    s = A.StoreStorage(10, client=client())
    rb = A.ReplayBuffer(storage=s, batch_size=4)
    rb.extend(transitions(7))
    sd = s.state_dict()
    assert sd["_td_id"] == s.td_id and sd["_len"] == 7 and "client" not in sd["_store_kwargs"]
    other = A.StoreStorage(10, client=client())  # another process would pass host/port
    other.load_state_dict(sd)
    assert len(other) == 7 and (other.get(torch.arange(7)) == transitions(7)).all()
    rb.empty()
    assert len(rb) == 0 and "len=0" in repr(s)
    with pytest.raises(ValueError, match="names no store"):
        A.StoreStorage(3, client=client()).load_state_dict({**sd, "_td_id": None})
    for st_ in (s, other):
        st_.close()


def test_her_over_a_store_storage(client):
    """HER reads end flags and goals through the storage: a StoreStorage relabels as a
    LazyTensorStorage does."""
    rbs = [
        A.HERReplayBuffer(reward_fn=reward_fn, storage=storage, batch_size=8, her_ratio=0.5)
        for storage in (A.StoreStorage(16, client=client()), A.LazyTensorStorage(16))
    ]
    for rb in rbs:
        rb.extend(goal_data([3, 9, 14], 20))
    assert_same_batches(rbs, seed=2, n=3)
