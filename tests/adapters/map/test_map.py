"""``functional_rb.adapters.map`` beside ``torchrl.data.map`` on the same inputs: the hash
modules give TorchRL's values (keys that users store), ``QueryModule`` numbers rows as
TorchRL's does, and a ``TensorDictMap`` filled with the same pairs returns the same values and
membership; then what ours adds: an overwrite keeps the count, unknown keys and a full map
raise before anything changes, ``clear`` works, hash tables survive ``state_dict``."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict
from torchrl.data import map as TM

import functional_rb.adapters as A
from functional_rb.adapters import map as M

LIBS = pytest.mark.parametrize("L", [(T, TM), (A, M)], ids=["torchrl", "frb"])
STORAGES = pytest.mark.parametrize("storage", ["LazyTensorStorage", "ListStorage"])


# ---------------------------------------------------------------------- hashes
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
@pytest.mark.parametrize("shape", [(7,), (7, 3), (7, 2, 5)])
@pytest.mark.parametrize("as_tensor", [True, False])
def test_siphash_values_are_torchrls(dtype, shape, as_tensor):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=g) * 10 + 1).to(dtype)
    x[1], x[2] = x[0], 0  # equal rows hash equally, a different row differently
    ours, theirs = M.SipHash(as_tensor)(x), TM.SipHash(as_tensor)(x)
    if as_tensor:
        assert ours.dtype == torch.int64 and ours.shape == (7,)
        assert torch.equal(ours, theirs) and ours[0] == ours[1] and ours[0] != ours[2]
    else:
        assert ours == theirs and len(ours) == 7


@pytest.mark.parametrize("n_components", [None, 5])
@pytest.mark.parametrize("dtype_cast", [torch.bfloat16, torch.float32])
def test_random_projection_values_are_torchrls(n_components, dtype_cast):
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
    out = []
    for mod in (M, TM):
        torch.manual_seed(3)  # the projection is drawn from torch's global generator
        h = mod.RandomProjectionHash(n_components=n_components, dtype_cast=dtype_cast)
        out.append((h(x), h(x[:8]), h.n_components))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][2] == out[1][2] == (n_components or 16)
    assert out[0][0].unique().numel() == 64


def test_random_projection_reloads_a_saved_projection():
    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(2))
    theirs = TM.RandomProjectionHash()
    expected = theirs(x)
    ours = M.RandomProjectionHash()
    ours.load_state_dict(theirs.state_dict())  # TorchRL's cannot load into an unfitted one
    assert torch.equal(ours(x), expected)
    with pytest.raises(RuntimeError, match="built for rows of 20 features, got rows of 3"):
        ours(torch.randn(4, 3))
    with pytest.raises(TypeError):
        M.RandomProjectionHash(n_componentz=3)  # TorchRL's swallows unknown keywords


@pytest.mark.parametrize("num_bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("convert", [True, False])
def test_binary_to_decimal_values_are_torchrls(num_bits, dtype, convert):
    g = torch.Generator().manual_seed(num_bits)
    x = torch.randint(0, 2, (5, 16), generator=g).float()
    if convert:
        x = x * torch.randn(5, 16, generator=g).abs() * 10 - (x == 0).float()
    args = {"num_bits": num_bits, "device": "cpu", "dtype": dtype, "convert_to_binary": convert}
    ours, theirs = M.BinaryToDecimal(**args)(x), TM.BinaryToDecimal(**args)(x)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)  # int32 sums to int64
    doc = M.BinaryToDecimal(4, "cpu", torch.int32, True)(
        torch.tensor([[0.0, 0, 1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 10, 0]])
    )
    assert doc.tolist() == [3, 2]


@LIBS
def test_binary_to_decimal_errors(L):
    _, mod = L
    b = mod.BinaryToDecimal(num_bits=4, device="cpu", dtype=torch.int64)
    with pytest.raises(ValueError, match=r"num_features=3 is less than self.num_bits=4"):
        b(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"num_features=6 is not divisible by self.num_bits=4"):
        b(torch.zeros(2, 6))


# ---------------------------------------------------------------------- queries
def test_hash_to_int_numbers_as_torchrls_and_saves_its_table():
    ours, theirs = M.HashToInt(), TM.HashToInt()
    calls = [([5, 9, 5], True), ([9, 7], False), ([7, 1, 9], True), ([2, 7], False)]
    for keys, extend in calls:
        k = torch.tensor(keys)
        assert torch.equal(ours(k, extend=extend), theirs(k, extend=extend))
    q = M.QueryModule(["a"], hash_to_int=ours)
    fresh = M.QueryModule(["a"])
    fresh.load_state_dict(q.state_dict())  # nested: saved under hash_to_int.keys / .values
    assert torch.equal(
        fresh.hash_to_int(torch.tensor([1, 7, 9, 5, 3])), torch.tensor([3, 2, 1, 0, 4])
    )
    assert len(fresh.hash_to_int) == 4


def _keys_td():
    return TensorDict(
        {
            "key1": torch.tensor([[1.0], [1], [1], [2], [3]]),
            ("n", "key2"): torch.tensor([[3.0], [3], [2], [3], [3]]),
            "wide": torch.arange(100.0).reshape(5, 20),
        },
        [5],
    )


@pytest.mark.parametrize(
    "in_keys", [["key1"], ["key1", ("n", "key2")], [(("key1",),), (("n",), "key2"), "wide"]]
)
@pytest.mark.parametrize("hash_module", ["default", "single", "list"])
@pytest.mark.parametrize("clone", [True, False])
def test_query_module_matches_torchrls(in_keys, hash_module, clone):
    outs = []
    for mod in (M, TM):
        hm = {"default": None, "single": mod.SipHash(), "list": [mod.SipHash() for _ in in_keys]}[
            hash_module
        ]
        q = mod.QueryModule(in_keys, index_key=("out", ("idx",)), hash_module=hm, clone=clone)
        td = _keys_td()
        res = q(td)
        assert (res is td) != clone
        outs.append(
            (
                q.in_keys,
                q.index_key,
                res["out", "idx"],
                res["_hash"],
                q(_keys_td(), extend=False)["out", "idx"],
                type(q.aggregator).__name__,
            )
        )
    assert outs[0][:2] == outs[1][:2] and outs[0][5] == outs[1][5]
    for a, b in zip(outs[0][2:5], outs[1][2:5]):
        assert torch.equal(a, b)


@LIBS
def test_query_module_errors(L):
    _, mod = L
    with pytest.raises(ValueError, match="`in_keys` cannot be empty."):
        mod.QueryModule([])
    with pytest.raises(
        ValueError,
        match="The number of hash_modules must match the number of "
        "in_keys. Got 1 hash modules but 2 in_keys.",
    ):
        mod.QueryModule(["a", "b"], hash_module=[mod.SipHash()])


def test_query_module_says_an_aggregator_is_unused():
    with pytest.warns(UserWarning, match="only one in-key"):
        M.QueryModule(["a"], aggregator=M.SipHash())


# ---------------------------------------------------------------------- maps
def _map(lib, mod, storage, **kw):
    q = mod.QueryModule(in_keys=["key1", "key2"], index_key="index", hash_module=mod.SipHash())
    return mod.TensorDictMap(query_module=q, storage=getattr(lib, storage)(20), **kw)


def _pairs(keys, values):
    k = torch.tensor(keys, dtype=torch.float32)
    return (
        TensorDict({"key1": k[:, :1], "key2": k[:, 1:]}, [len(keys)]),
        TensorDict(
            {
                "v": torch.tensor(values, dtype=torch.float32),
                ("n", "w"): torch.tensor(values).mul(2).unsqueeze(-1),
            },
            [len(keys)],
        ),
    )


WRITES = [
    ([[0, 1], [1, 1], [2, 0]], [1, 2, 3]),
    ([[1, 1], [5, 5]], [20, 50]),  # an overwrite and a new key
    ([[6, 6], [6, 6], [0, 1]], [60, 61, 10]),  # a key twice in one write: the last wins
    ([[2, 0]], [30]),
]
KNOWN = [[0, 1], [1, 1], [2, 0], [5, 5], [6, 6]]


@STORAGES
@pytest.mark.parametrize("write_fn", [None, "accumulate"])
def test_map_returns_torchrls_values(storage, write_fn):
    def accumulate(new, old=None):
        return new if old is None else new + old

    # the reference is TorchRL's map on its ListStorage: its LazyTensorStorage counts every
    # write, so after an overwrite its map takes a new key for a stored one and hands write_fn
    # uninitialised memory as the previous value (the sum then depends on the process)
    maps = [
        _map(T, TM, "ListStorage", write_fn=write_fn and accumulate),
        _map(A, M, storage, write_fn=write_fn and accumulate),
    ]
    for keys, values in WRITES:
        for m in maps:
            item, value = _pairs(keys, values)
            m[item] = value
            assert "index" in item and "_hash" in item  # as TorchRL's, in place
    query, _ = _pairs(KNOWN, [0] * len(KNOWN))
    theirs, ours = maps[0][query], maps[1][query]
    assert (theirs == ours).all() and set(ours.keys(True, True)) == {"v", ("n", "w")}
    expected = [11, 22, 33, 50, 121] if write_fn else [10, 20, 30, 50, 61]
    assert ours["v"].tolist() == expected
    assert maps[1].contains(query).all()
    assert len(maps[1]) == len(maps[1].query_module.hash_to_int) == 5  # overwrites kept out
    one, _ = _pairs([[5, 5]], [0])
    assert (maps[0][one[0]] == maps[1][one[0]]).all() and maps[1][one[0]].batch_size == ()
    assert bool(maps[1].contains(one[0])) and one[0] in maps[1]
    unknown, _ = _pairs([[1, 1], [9, 9], [1, 0]], [0, 0, 0])
    assert maps[1].contains(unknown).tolist() == [True, False, False]
    assert maps[1].max_size == maps[0].max_size == 20


def test_an_overwrite_keeps_the_count():
    # TorchRL 0.14's map on its LazyTensorStorage counts 5 here, and then finds [9, 9]
    m = _map(A, M, "LazyTensorStorage")
    for keys, values in WRITES[:2]:
        m[_pairs(keys, values)[0]] = _pairs(keys, values)[1]
    assert len(m) == 4 and not m.contains(_pairs([[9, 9]], [0])[0]).any()


def test_map_out_keys_as_torchrls():
    for storage, lazy in (("LazyTensorStorage", True), ("ListStorage", False)):
        for lib, mod in ((T, TM), (A, M)):
            m = _map(lib, mod, storage)
            assert not hasattr(m, "out_keys") and m._has_lazy_out_keys()
            m[_pairs([[0, 0]], [1])[0]] = _pairs([[0, 0]], [1])[1]
            assert hasattr(m, "out_keys") == lazy and m._has_lazy_out_keys()
            if lazy:
                assert sorted(map(str, m.out_keys)) == ["('n', 'w')", "v"]
    for lib, mod in ((T, TM), (A, M)):
        m = _map(lib, mod, "ListStorage", out_keys=["v"])
        item, value = _pairs([[0, 0], [1, 0]], [1, 2])
        m[item] = value
        assert not m._has_lazy_out_keys() and list(m[item].keys()) == ["v"]


def test_from_tensordict_pair_as_torchrls():
    g = torch.Generator().manual_seed(0)
    source = TensorDict(
        {
            "obs": torch.randn(10, 30, generator=g),
            "action": torch.randn(10, 2, generator=g),
            "step": torch.arange(10),
        },
        [10],
    )
    dest = TensorDict({"obs": torch.randn(10, 30, generator=g), "r": torch.randn(10)}, [10])
    out = []
    for mod in (TM, M):
        torch.manual_seed(0)
        m = mod.TensorDictMap.from_tensordict_pair(
            source.clone(), dest, in_keys=["obs", "action", "step"]
        )
        kinds = [type(m.query_module.hash_module[k]).__name__ for k in ["obs", "action", "step"]]
        src = source.clone()
        m[src] = dest
        out.append(
            (
                kinds,
                m.max_size,
                src["_index"],
                m[source.clone()],
                m.contains(torch.cat([source, source + 1])),
            )
        )
    assert out[0][0] == out[1][0] == ["RandomProjectionHash", "SipHash", "SipHash"]
    assert out[0][1] == out[1][1] == 1000 and torch.equal(out[0][2], out[1][2])
    assert (out[0][3] == out[1][3]).all() and torch.equal(out[0][4], out[1][4])
    m = M.TensorDictMap.from_tensordict_pair(
        source,
        dest,
        in_keys=["step"],
        out_keys=["r"],
        storage_constructor=functools.partial(A.ListStorage, 7),
    )
    assert m.max_size == 7 and isinstance(m.storage, A.ListStorage)
    with pytest.raises(ValueError, match="max_size=5 is used only by the default storage"):
        M.TensorDictMap.from_tensordict_pair(
            source, dest, in_keys=["step"], max_size=5, storage_constructor=A.ListStorage
        )


@STORAGES
def test_map_faults_leave_it_unchanged(storage):
    m = _map(A, M, storage)
    item, value = _pairs([[i, 0] for i in range(18)], list(range(18)))
    m[item] = value
    with pytest.raises(IndexError, match="2 of the 3 queried keys are not in the map"):
        m[_pairs([[0, 0], [40, 0], [41, 0]], [0, 0, 0])[0]]
    big, big_value = _pairs([[i, 0] for i in range(15, 22)], list(range(7)))
    with pytest.raises(IndexError, match="4 new keys do not fit: the map holds 18 of max_size=20"):
        m[big] = big_value
    assert len(m) == 18 and len(m.query_module.hash_to_int) == 18
    fits, fits_value = _pairs([[i, 0] for i in range(16, 20)], [7, 8, 9, 10])
    m[fits] = fits_value  # two overwrites and two new keys: exactly full
    assert len(m) == 20 and m[fits]["v"].tolist() == [7, 8, 9, 10]
    m.clear()
    assert len(m) == 0 and not m.contains(item).any()
    m[fits] = fits_value
    assert len(m) == 4 and m[fits]["v"].tolist() == [7, 8, 9, 10]


def test_map_needs_a_collate_for_foreign_storages():
    q = M.QueryModule(["key1"])
    with pytest.raises(
        NotImplementedError, match="Could not find a default collate_fn for storage"
    ):
        M.TensorDictMap(query_module=q, storage=T.ListStorage(4))
    m = M.TensorDictMap(query_module=q, storage=T.ListStorage(4), collate_fn=torch.stack)
    item, value = _pairs([[0, 0], [1, 0]], [1, 2])
    m[item] = value
    assert m[item]["v"].tolist() == [1, 2]
    assert isinstance(m, M.TensorMap) and issubclass(M.TensorDictMap, torch.nn.Module)


# ---------------------------------------------------------- TorchRL's map over our storages
def _query_module():
    from torchrl.data.map import QueryModule, SipHash

    return QueryModule(in_keys=["key1", "key2"], index_key="index", hash_module=SipHash())


@pytest.mark.parametrize("storage", ["ListStorage", "LazyTensorStorage", "LazyMemmapStorage"])
def test_torchrl_tensordict_map_over_our_storages(storage):
    from torchrl.data.map import TensorDictMap

    keys = TensorDict(
        {
            "key1": torch.tensor([[-1.0], [1.0], [3.0], [-3.0]]),
            "key2": torch.tensor([[0.0], [2.0], [4.0], [-4.0]]),
        },
        [4],
    )
    values = TensorDict({"v": torch.tensor([[10.0], [20.0], [30.0], [40.0]])}, [4])
    got = []
    for L in (T, A):
        st = getattr(L, storage)(100)
        kw = {} if L is T else {"collate_fn": st.default_collate}  # (see the module docs)
        tdm = TensorDictMap(query_module=_query_module(), storage=st, **kw)
        tdm[keys] = values
        assert tdm.contains(keys).all() and len(tdm) == 4
        assert not tdm.contains(keys + 100).any()
        got.append(tdm[keys]["v"])
    assert torch.equal(*got)


def test_torchrl_mcts_forest_over_our_storage():
    from torchrl.data.map import MCTSForest, TensorDictMap

    def rollout(states, actions):
        s, n = torch.tensor(states), len(actions)
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[-1] = True
        return TensorDict(
            {
                "observation": s[:-1],
                "action": torch.tensor(actions),
                "done": torch.zeros(n, 1, dtype=torch.bool),
                "next": {"observation": s[1:], "done": done, "reward": torch.ones(n, 1)},
            },
            [n],
        )

    rollouts = [
        rollout([0, 1, 2, 3, 4], [0, 0, 0, 0]),
        rollout([0, 1, 2, 6, 7], [0, 0, 1, 1]),
        rollout([0, 9, 10], [1, 1]),
    ]

    def tree(storage):
        forest = MCTSForest()
        if storage is not None:
            st = storage(1000)
            r0 = rollouts[0]
            forest.data_map = TensorDictMap.from_tensordict_pair(
                r0.exclude("next"),
                r0.get("next"),
                in_keys=[*forest.observation_keys, *forest.action_keys],
                storage_constructor=lambda: st,
                collate_fn=st.default_collate,
            )
        for r in rollouts:
            forest.extend(r)
        t = forest.get_tree(rollouts[0][0])
        return t.num_vertices(), [
            t.rollout_from_path(p)["action"].tolist() for p in ((0, 0), (0, 1), (1,))
        ]

    assert tree(A.LazyTensorStorage) == tree(None) == tree(A.LazyMemmapStorage)
