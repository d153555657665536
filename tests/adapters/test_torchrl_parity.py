"""The adapters against TorchRL itself, behaviour by behaviour: the same code, run with
``torchrl.data`` and with ``functional_rb.adapters``, gives the same results (same data, same
indices, same draws under the same seed, same errors). Each test runs both libraries.

TorchRL's compiled extension does not load with this torch, so its prioritized sampler is not
compared here (see tests/adapters/checkpointers/test_torchrl_prioritized_dumps.py for the
prioritized formats).
"""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
T = pytest.importorskip("torchrl.data")
from tensordict import LazyStackedTensorDict, TensorDict, tensorclass  # noqa: E402

import functional_rb.adapters as A  # noqa: E402

LIBS = pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])


def _td(n, start=0):
    t = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": t.float()[:, None].expand(n, 3).clone(),
            "a": t,
            ("next", "done"): (t % 5 == 4)[:, None],
        },
        [n],
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if tensordict.is_tensor_collection(a):
        keys = set(a.keys(True, True))
        return keys == set(b.keys(True, True)) and all(
            torch.equal(a.get(k), b.get(k)) for k in keys
        )
    fa, sa = torch.utils._pytree.tree_flatten(a)
    fb, sb = torch.utils._pytree.tree_flatten(b)
    return sa == sb and all(_same(x, y) for x, y in zip(fa, fb))


def _both(fn):
    return fn(T), fn(A)


# ---------------------------------------------------------------------- data
def test_pytree_with_non_string_keys():
    def run(L):
        rb = L.ReplayBuffer(storage=L.LazyTensorStorage(8), batch_size=4)
        data = {"a": torch.arange(6), 30: torch.ones(6, 2), "b": (torch.zeros(6, 1),)}
        index = rb.extend(data)
        torch.manual_seed(0)
        return index, rb[:], rb.sample()

    (i0, all0, s0), (i1, all1, s1) = _both(run)
    assert _same(i0, i1) and _same(all0, all1) and _same(s0, s1)
    assert list(all1.keys()) == ["a", 30, "b"]  # insertion order kept, int key kept


def test_lists_of_tensordicts_and_lazy_stacks():
    def run(L):
        rb = L.ReplayBuffer(storage=L.LazyTensorStorage(10), batch_size=3)
        rb.extend([_td(1)[0], _td(1, 1)[0]])  # a list of items
        het = LazyStackedTensorDict.lazy_stack([_td(1, 2)[0], _td(1, 3)[0]])
        rb.extend(het)
        return rb[:]

    a, b = _both(run)
    assert _same(a, b) and len(a) == 4


def test_tensorclass_data_comes_back_as_the_tensorclass():
    @tensorclass
    class Step:
        obs: torch.Tensor
        reward: torch.Tensor

    def run(L):
        rb = L.ReplayBuffer(storage=L.LazyTensorStorage(8), batch_size=3)
        rb.extend(Step(obs=torch.randn(5, 2), reward=torch.arange(5.0), batch_size=[5]))
        torch.manual_seed(1)
        return rb.sample()

    a, b = _both(run)
    assert type(b) is type(a) is Step and torch.equal(a.reward, b.reward)


def test_add_keeps_a_batched_tensordicts_inner_dims():
    def run(L):
        rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(4), batch_size=2)
        item = TensorDict({"x": torch.arange(6).reshape(3, 2)}, [3])  # one item, batch [3]
        rb.add(item)
        return rb[0]

    a, b = _both(run)
    assert b.batch_size == a.batch_size == (3,) and torch.equal(a["x"], b["x"])


def test_list_storage_extends_with_any_iterable():
    a, b = _both(lambda L: L.ReplayBuffer(storage=L.ListStorage(3000), batch_size=5))
    for rb in (a, b):
        rb.extend(range(2000))
    assert len(a) == len(b) == 2000
    assert [a[i] for i in range(10)] == [b[i] for i in range(10)] == list(range(10))


def test_tensor_storage_over_preallocated_data():
    def run(L):
        td = TensorDict({"x": torch.zeros(6, 2)}, [6])
        tree = {"x": torch.arange(6.0), "y": torch.zeros(6, 1)}
        rbs = [
            L.TensorDictReplayBuffer(storage=L.TensorStorage(td), batch_size=2),
            L.ReplayBuffer(storage=L.TensorStorage(tree), batch_size=2),
        ]
        rbs[1].extend({"x": torch.tensor([7.0]), "y": torch.ones(1, 1)})
        return [len(r) for r in rbs], rbs[1][:]

    (la, da), (lb, db) = _both(run)
    assert la == lb == [6, 6] and _same(da, db)


def test_in_place_writes_through_indexing():
    def run(L):
        rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(6), batch_size=2)
        rb.extend(_td(6))
        rb[2] = _td(1, 40)[0]
        rb[torch.tensor([0, 1])] = _td(2, 50)
        return rb[:].exclude("index")

    a, b = _both(run)
    assert _same(a, b) and b["a"][:3].tolist() == [50, 51, 40]


# ---------------------------------------------------------------------- samplers
def _episodes(key):
    n = 20
    td = TensorDict(
        {
            "obs": torch.arange(n),
            ("next", "done"): (torch.arange(n) % 5 == 4)[:, None],
            "is_init": (torch.arange(n) % 5 == 0)[:, None],
        },
        [n],
    )
    if key is not None:
        td.set(key, torch.arange(n) // 5)
    return td


@pytest.mark.parametrize("key", [None, "episode", ("collector", "traj_ids")])
def test_slice_sampler_finds_the_trajectory_key_and_marks_starts(key):
    def run(L):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(20), batch_size=12, sampler=L.SliceSampler(slice_len=3)
        )
        data = _episodes(key)
        if key is not None:
            data["next", "done"] = torch.zeros(20, 1, dtype=torch.bool)  # only the ids tell
        rb.extend(data)
        s = rb.sample().reshape(4, 3)
        return rb.sampler.traj_key, s

    (ka, sa), (kb, sb) = _both(run)
    assert (kb if kb is None or isinstance(kb, str) else tuple(kb)) == (
        ka if ka is None or isinstance(ka, str) else tuple(ka)
    )
    for s in (sa, sb):
        obs = s["obs"]
        assert torch.all(obs // 5 == obs[:, :1] // 5)  # never crosses an episode
        assert torch.all(s["is_init"][:, 0])  # every slice starts fresh
        assert torch.all(s["next", "truncated"][:, -1])


def test_drop_last_without_batch_size_raises_like_torchrl():
    for L in (T, A):
        with pytest.raises(ValueError, match="drop_last"):
            L.ReplayBuffer(
                storage=L.LazyTensorStorage(10), sampler=L.SamplerWithoutReplacement(drop_last=True)
            )


def test_ndim2_capacity_rounded_up_to_whole_rows():
    def run(L):
        st = L.LazyTensorStorage(10, ndim=2)
        rb = L.TensorDictReplayBuffer(storage=st, batch_size=4)
        rb.extend(TensorDict({"x": torch.arange(9).reshape(3, 3)}, [3, 3]))
        return st.max_size, len(rb), rb[:]["x"]

    a, b = _both(run)
    assert a[0] == b[0] == 12 and a[1] == b[1] and torch.equal(a[2], b[2])


def test_errors_torchrl_checks():
    for L in (T, A):
        rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(4), batch_size=2)
        with pytest.raises(RuntimeError, match="empty"):
            rb.sample()
        mv = L.ReplayBuffer(
            storage=L.LazyTensorStorage(4),
            writer=L.TensorDictMaxValueWriter(rank_key="r"),
            batch_size=2,
        )
        with pytest.raises(RuntimeError, match="expects data to be a tensor collection"):
            mv.extend(torch.zeros(3))


# ---------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("sampler", ["random", "wor", "wor_noshuffle"])
@pytest.mark.parametrize("seeding", ["manual_seed", "generator"])
def test_same_seed_same_draws_as_torchrl(sampler, seeding):
    def run(L):
        kw = {"generator": torch.Generator().manual_seed(7)} if seeding == "generator" else {}
        smp = {
            "random": lambda: L.RandomSampler(),
            "wor": lambda: L.SamplerWithoutReplacement(),
            "wor_noshuffle": lambda: L.SamplerWithoutReplacement(shuffle=False),
        }[sampler]()
        rb = L.ReplayBuffer(storage=L.LazyTensorStorage(30), sampler=smp, batch_size=7, **kw)
        rb.extend(torch.arange(25))
        torch.manual_seed(3)
        return torch.cat([rb.sample() for _ in range(8)])  # an epoch's last batch is short

    a, b = _both(run)
    assert torch.equal(a, b)


def test_ndim2_uniform_draws_match():
    def run(L):
        rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(24, ndim=2), batch_size=6)
        rb.extend(TensorDict({"x": torch.arange(24).reshape(3, 8)}, [3, 8]))
        torch.manual_seed(11)
        return rb.sample()["x"]

    a, b = _both(run)
    assert torch.equal(a, b)


def test_dumps_loads_restores_the_sampling_rng(tmp_path):
    for L in (T, A):
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(20),
            batch_size=4,
            generator=torch.Generator().manual_seed(5),
        )
        rb.extend(torch.arange(20))
        rb.sample()
        rb.dumps(tmp_path / L.__name__)
        expected = [rb.sample() for _ in range(3)]
        back = L.ReplayBuffer(
            storage=L.LazyTensorStorage(20), batch_size=4, generator=torch.Generator()
        )
        back.extend(torch.zeros(1, dtype=torch.int64))  # a PyTree storage loads into its own
        back.loads(tmp_path / L.__name__)
        assert all(torch.equal(x, back.sample()) for x in expected), L.__name__


# ---------------------------------------------------------------------- persistence
def test_load_state_dict_across_storage_types():
    def run(L):
        src = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(8), batch_size=2)
        src.extend(_td(6))
        dst = L.TensorDictReplayBuffer(storage=L.LazyMemmapStorage(8), batch_size=2)
        dst.load_state_dict(src.state_dict())
        return len(dst), dst[:].exclude("index")

    (na, da), (nb, db) = _both(run)
    assert na == nb == 6 and _same(da, db)


def test_checkpointer_is_honoured_or_refused(tmp_path):
    # a checkpointer of ours writes TorchRL's flat TED layout, which TorchRL reads
    data = TensorDict(
        {
            "obs": torch.arange(8.0),
            ("next", "obs"): torch.arange(1.0, 9.0),
            ("next", "done"): torch.zeros(8, 1, dtype=torch.bool),
            ("next", "reward"): torch.ones(8, 1),
        },
        [8],
    )
    ours = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(8), checkpointer=A.FlatStorageCheckpointer(), batch_size=2
    )
    ours.extend(data.clone())
    ours.dumps(tmp_path / "o")
    assert (tmp_path / "o" / "storage" / "storage_metadata.json").exists()
    theirs = T.TensorDictReplayBuffer(
        storage=T.LazyTensorStorage(8), checkpointer=T.FlatStorageCheckpointer(), batch_size=2
    )
    theirs.loads(tmp_path / "o")
    assert torch.equal(theirs[:]["next", "obs"], data["next", "obs"])
    with pytest.raises(TypeError, match="adapters' classes of the same names"):
        A.ReplayBuffer(storage=A.LazyTensorStorage(8), checkpointer=T.FlatStorageCheckpointer())


# ---------------------------------------------------------------------- interop
def test_torchrl_components_are_refused_naming_the_adapter():
    for name, obj in (
        ("storage", T.LazyTensorStorage(4)),
        ("sampler", T.RandomSampler()),
        ("writer", T.RoundRobinWriter()),
    ):
        with pytest.raises(TypeError, match=f"use functional_rb.adapters.{type(obj).__name__}"):
            A.ReplayBuffer(**{name: obj})


def test_unshareable_buffers_fail_when_pickled_for_a_worker():
    import multiprocessing.context as mpc

    # (a LazyTensorStorage is shared: tests/adapters/storages/test_shared_tensor_storage.py)
    rb = A.ReplayBuffer(storage=A.ListStorage(4))
    rb.extend(torch.zeros(2))
    old = mpc.get_spawning_popen
    mpc.get_spawning_popen = lambda: object()  # as multiprocessing does while spawning
    try:
        with pytest.raises(RuntimeError, match="LazyMemmapStorage"):
            pickle.dumps(rb)
    finally:
        mpc.get_spawning_popen = old


def test_lazy_tensor_storage_does_not_commit_its_capacity():
    """100,000 frames of 84x84x4 (2.8 GB) allocated at the first write, as TorchRL does
    (torch.empty): resident memory grows by the written frames only."""

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(100_000), batch_size=4)
    before = rss_mb()
    rb.extend(torch.zeros(16, 84, 84, 4, dtype=torch.uint8))
    assert rb.storage.data.shape == (100_000, 84, 84, 4)
    assert rss_mb() - before < 200, "the whole capacity was committed at the first write"


def test_torch_compile_of_a_step_that_samples():
    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(64), batch_size=8)
    rb.extend(torch.randn(64, 3))
    w = torch.randn(3, 1)

    @torch.compile(backend="eager")
    def step(w):
        batch = rb.sample()  # a graph break at the buffer is fine; a crash is not
        return (batch @ w).pow(2).mean()

    assert torch.isfinite(step(w)) and torch.isfinite(step(w))
