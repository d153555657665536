"""functional_rb.adapters against the real TorchRL classes on the same data.

TorchRL's prioritized sampler needs its compiled extension (broken with this torch), so the
prioritized adapters are checked against their documented semantics instead (and their dump
format against TorchRL's own sampler code in
tests/adapters/checkpointers/test_torchrl_prioritized_dumps.py). The writers' comparisons are in
tests/adapters/writers/test_torchrl_writers.py.
"""

from __future__ import annotations

import json
import pickle
import warnings

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from tensordict import TensorDict, is_tensor_collection

import functional_rb.adapters as A

warnings.filterwarnings("ignore", module="torchrl")
T = pytest.importorskip("torchrl.data")


def make_td(n, start=0, obs_dim=3):
    ar = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": ar[:, None].float().expand(n, obs_dim).clone(),
            "action": ar % 4,
            ("next", "done"): (ar % 5 == 4)[:, None],
            ("next", "reward"): ar.double()[:, None],
            "h": ar.to(torch.bfloat16),
        },
        [n],
    )


def assert_td_equal(a, b, skip=()):
    ka = {k for k in a.keys(True, True) if (k if isinstance(k, str) else k[0]) not in skip}
    kb = {k for k in b.keys(True, True) if (k if isinstance(k, str) else k[0]) not in skip}
    assert ka == kb
    for k in ka:
        assert a.get(k).dtype == b.get(k).dtype, k
        assert a.get(k).shape == b.get(k).shape, k
        assert torch.equal(a.get(k), b.get(k)), k


STORAGES = {
    "lazy_tensor": (lambda n, d: A.LazyTensorStorage(n), lambda n, d: T.LazyTensorStorage(n)),
    "lazy_memmap": (
        lambda n, d: A.LazyMemmapStorage(n, scratch_dir=d / "ours"),
        lambda n, d: T.LazyMemmapStorage(n, scratch_dir=d / "theirs"),
    ),
}


# ---------------------------------------------------------------------- vs TorchRL
@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_td_buffer_matches_torchrl(storage, tmp_path):
    ours_s, theirs_s = STORAGES[storage]
    ours = A.TensorDictReplayBuffer(storage=ours_s(8, tmp_path), batch_size=5)
    theirs = T.TensorDictReplayBuffer(storage=theirs_s(8, tmp_path), batch_size=5)
    for start, n in ((0, 3), (3, 4), (7, 6), (13, 11)):  # the last two wrap, 11 > capacity
        i_ours, i_theirs = ours.extend(make_td(n, start)), theirs.extend(make_td(n, start))
        assert torch.equal(i_ours, i_theirs)
        assert i_ours.dtype == torch.int64
        assert len(ours) == len(theirs)
    assert ours.add(make_td(1, 50)[0]) == theirs.add(make_td(1, 50)[0])
    assert_td_equal(ours[:], theirs[:])
    assert_td_equal(ours[2], theirs[2])
    assert_td_equal(ours[[1, 5, 0]], theirs[[1, 5, 0]])
    assert torch.equal(ours["obs"], theirs["obs"])
    s_ours, s_theirs = ours.sample(), theirs.sample()
    assert s_ours.batch_size == s_theirs.batch_size
    assert set(s_ours.keys(True, True)) == set(s_theirs.keys(True, True))
    for k in s_theirs.keys(True, True):
        assert s_ours.get(k).dtype == s_theirs.get(k).dtype, k
        assert s_ours.get(k).shape == s_theirs.get(k).shape, k
    # each sampled row is the stored row at its index
    assert_td_equal(s_ours, ours[s_ours["index"]])  # the stored "index" equals the sampled one


def test_plain_buffer_tensor_and_pytree_match_torchrl():
    ours = A.ReplayBuffer(storage=A.LazyTensorStorage(6), batch_size=4)
    theirs = T.ReplayBuffer(storage=T.LazyTensorStorage(6), batch_size=4)
    x = torch.arange(10, dtype=torch.int64)
    assert torch.equal(ours.extend(x), theirs.extend(x))
    assert ours.add(torch.tensor(42)) == theirs.add(torch.tensor(42))
    assert torch.equal(ours[:], theirs[:])
    data, info = ours.sample(return_info=True)
    assert data.dtype == torch.int64 and data.shape == (4,)
    assert torch.equal(data, ours[info["index"]])
    # tuples of tensors (PyTrees)
    ours = A.ReplayBuffer(storage=A.LazyTensorStorage(5), batch_size=3)
    theirs = T.ReplayBuffer(storage=T.LazyTensorStorage(5), batch_size=3)
    tree = (torch.randn(7, 2), {"a": torch.arange(7)})
    assert torch.equal(ours.extend(tree), theirs.extend(tree))
    for a, b in zip(
        jax.tree_util.tree_leaves(ours[:], is_leaf=torch.is_tensor),
        jax.tree_util.tree_leaves(theirs[:], is_leaf=torch.is_tensor),
    ):
        assert torch.equal(a, b)


def test_list_storage_any_objects():
    ours = A.ReplayBuffer(storage=A.ListStorage(4), batch_size=3)
    theirs = T.ReplayBuffer(storage=T.ListStorage(4), batch_size=3)
    items = [1, "a", None, {"x": 2}, (3,)]
    assert torch.equal(ours.extend(items), theirs.extend(items))
    assert ours.add("z") == theirs.add("z")
    assert [ours[i] for i in range(4)] == [theirs[i] for i in range(4)]
    torch.manual_seed(0)  # the draw (the test's outcome must not depend on earlier tests)
    s, info = ours.sample(return_info=True)
    drawn = [ours[int(i)] for i in info["index"]]
    if all(isinstance(d, dict) for d in drawn):  # dicts only: collated, as TorchRL's collate
        assert torch.equal(s["x"], torch.tensor([d["x"] for d in drawn]))
    else:
        assert isinstance(s, list) and s == drawn
    tensors = A.ReplayBuffer(storage=A.ListStorage(4), batch_size=2)
    tensors.extend([torch.zeros(2), torch.ones(2)])
    assert tensors.sample().shape == (2, 2)  # stacked, as TorchRL's collate does


def test_tensor_storage_starts_full():
    data = make_td(6)
    ours = A.TensorDictReplayBuffer(storage=A.TensorStorage(data.clone()), batch_size=2)
    theirs = T.TensorDictReplayBuffer(storage=T.TensorStorage(data.clone()), batch_size=2)
    assert len(ours) == len(theirs) == 6
    assert_td_equal(ours[:], theirs[:])
    assert torch.equal(ours.extend(make_td(2, 100)), theirs.extend(make_td(2, 100)))
    # TorchRL adds its "index" entry to a pre-filled storage on the first extend; we don't
    assert_td_equal(ours[:], theirs[:], skip=("index",))


def test_ndim2_indices_match_torchrl():
    ours = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(12, ndim=2), batch_size=4)
    theirs = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(12, ndim=2), batch_size=4)
    td = TensorDict({"x": torch.arange(10).reshape(2, 5)}, [2, 5])  # [num_envs, T]
    assert torch.equal(ours.extend(td), theirs.extend(td))
    assert len(ours) == len(theirs)
    s = ours.sample(8)
    t, env = s["index"].unbind(-1)
    assert torch.equal(s["x"], env * 5 + t)  # index pairs are TorchRL's (t, env)


def test_without_replacement_iteration_matches_torchrl():
    for drop_last in (False, True):
        ours = A.TensorDictReplayBuffer(
            storage=A.LazyTensorStorage(20),
            batch_size=4,
            sampler=A.SamplerWithoutReplacement(drop_last=drop_last),
        )
        theirs = T.TensorDictReplayBuffer(
            storage=T.LazyTensorStorage(20),
            batch_size=4,
            sampler=T.SamplerWithoutReplacement(drop_last=drop_last),
        )
        ours.extend(make_td(10))
        theirs.extend(make_td(10))
        for _ in range(2):  # two epochs
            b_ours = [b["index"].tolist() for b in ours]
            b_theirs = [b["index"].tolist() for b in theirs]
            assert [len(b) for b in b_ours] == [len(b) for b in b_theirs]
            flat = sorted(i for b in b_ours for i in b)
            assert flat == (list(range(10)) if not drop_last else sorted(set(flat)))
            assert len(flat) == (10 if not drop_last else 8)


def test_random_sampler_is_uniform_and_seeded():
    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(8), batch_size=4000)
    rb.extend(torch.arange(8))
    torch.manual_seed(3)
    a = rb.sample()
    torch.manual_seed(3)
    assert torch.equal(a, rb.sample())  # torch's seed drives the JAX key
    counts = np.bincount(a.numpy(), minlength=8)
    assert stats.chisquare(counts).pvalue > 1e-3


# ---------------------------------------------------------------------- dtypes and errors
def test_dtypes_round_trip_and_int64_range():
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(4), batch_size=2)
    td = TensorDict(
        {
            "i64": torch.tensor([1, -(2**31)]),
            "f64": torch.tensor([0.5, 1.25], dtype=torch.float64),
            "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "u8": torch.tensor([255, 0], dtype=torch.uint8),
            "f16": torch.tensor([1.0, 2.0], dtype=torch.float16),
            "b": torch.tensor([True, False]),
        },
        [2],
    )
    rb.extend(td)
    assert_td_equal(rb[:2], td, skip=("index",))  # ("index": the buffer's, not the caller's)
    # the data stays in torch: int64 beyond int32 (and every dtype) round trips exactly
    wide = TensorDict({**td.to_dict(), "i64": torch.tensor([2**40, -(2**62)])}, [2])
    rb.extend(wide)
    assert_td_equal(rb[2:4], wide, skip=("index",))
    mm = A.TensorDictReplayBuffer(storage=A.LazyMemmapStorage(4), batch_size=2)
    big = TensorDict({"i64": torch.tensor([2**40, 3])}, [2])
    mm.extend(big)
    assert torch.equal(mm[:]["i64"], big["i64"])


def test_clear_errors():
    with pytest.raises(ValueError, match="max_size"):
        A.ListStorage(0)
    assert A.ListStorage().max_size > 2**62  # unbounded, as TorchRL's
    with pytest.raises(TypeError, match="TorchRL's own class: use functional_rb.adapters"):
        A.ReplayBuffer(storage=T.LazyTensorStorage(4))
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(4), batch_size=2)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    rb.extend(make_td(2))
    with pytest.raises(KeyError, match="missing"):
        rb.extend(make_td(2).exclude("obs"))
    with pytest.raises(RuntimeError, match="shape mismatch.*entry 'obs'"):  # TorchRL's type
        rb.extend(make_td(2, obs_dim=5))
    with pytest.raises(ValueError, match="TensorDictBase"):
        rb.extend(torch.zeros(3))


# ---------------------------------------------------------------------- transforms, hooks
def test_transforms_and_invert_match_torchrl():
    def plus_one(td):
        td = td.clone()
        td["obs"] = td["obs"] + 1
        return td

    def times_two(td):
        td = td.clone()
        td["obs"] = td["obs"] * 2
        return td

    ours = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(6), batch_size=3)
    theirs = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(6), batch_size=3)
    for rb in (ours, theirs):
        rb.append_transform(plus_one, invert=True)  # on extend
        rb.append_transform(times_two)  # on sample / getitem
    ours.insert_transform(0, times_two)  # TorchRL's insert_transform wants Transform objects
    theirs.append_transform(times_two)
    for rb in (ours, theirs):
        rb.extend(make_td(4))
    assert_td_equal(ours[:], theirs[:])
    s = ours.sample()
    assert torch.equal(s["obs"], ours[s["index"]]["obs"])
    assert torch.equal(ours[:]["obs"], (make_td(4)["obs"] + 1) * 4)
    raw = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(6), batch_size=3)
    raw.append_transform(plus_one, invert=True)
    raw.extend(make_td(4))
    assert torch.equal(raw[:]["obs"], make_td(4)["obs"] + 1)


def test_save_and_load_hooks_called(tmp_path):
    calls = []

    class Hook:
        shift = None
        is_full = None

        def __call__(self, data, path=None, out=None):
            calls.append((type(data).__name__, path, self.shift, self.is_full))
            return data

    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(5), batch_size=2)
    hook = Hook()
    rb.register_save_hook(hook)
    rb.extend(make_td(7))
    rb.dumps(tmp_path / "d")
    # a dump is staged beside its path and renamed into place: the hook saw the staged storage
    # directory, which became d/storage
    ((kind, path, shift, full),) = calls
    assert (kind, shift, full) == ("TensorDict", 2, True)
    assert path.name == "storage" and path.parent.parent == tmp_path
    assert path.parent.name.startswith(".d.") and (tmp_path / "d" / "storage").is_dir()
    rb2 = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(5), batch_size=2)
    rb2.register_load_hook(hook)
    rb2.loads(tmp_path / "d")
    assert len(calls) == 2 and calls[1][0] == "TensorDict"
    assert_td_equal(rb2[:], rb[:])


class _SaveHook:
    shift = None
    is_full = None

    def __init__(self):
        self.seen = []

    def __call__(self, data, path=None):
        self.seen.append((self.shift, self.is_full))
        return data


@pytest.mark.parametrize("storage", ["LazyMemmapStorage", "LazyTensorStorage"])
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_save_hooks_are_called_with_shift_and_is_full(L, storage, tmp_path):
    hook = _SaveHook()
    rb = L.ReplayBuffer(storage=getattr(L, storage)(10))
    rb.register_save_hook(hook)
    rb.extend(torch.arange(5))
    rb.dumps(tmp_path / "a")
    rb.extend(torch.arange(7))
    rb.dumps(tmp_path / "b")
    assert hook.seen == [(5, False), (2, True)]


# ---------------------------------------------------------------------- persistence
@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_dumps_loads_round_trip_and_torchrl_layout(storage, tmp_path):
    ours_s, theirs_s = STORAGES[storage]
    rb = A.TensorDictReplayBuffer(
        storage=ours_s(10, tmp_path / "a"), batch_size=3, sampler=A.SamplerWithoutReplacement()
    )
    rb.extend(make_td(13))
    rb.sample()
    rb.dumps(tmp_path / "ours")
    meta = json.loads((tmp_path / "ours" / "storage" / "storage_metadata.json").read_text())
    assert meta["len"] == 10 and meta["is_pytree"] is False
    assert json.loads((tmp_path / "ours" / "writer" / "metadata.json").read_text())["cursor"] == 3
    back = A.TensorDictReplayBuffer(
        storage=ours_s(10, tmp_path / "b"), batch_size=3, sampler=A.SamplerWithoutReplacement()
    )
    back.loads(tmp_path / "ours")
    assert_td_equal(back[:], rb[:])
    assert back.write_count == rb.write_count == 13
    # the sampler state came back: the rest of the epoch is identical
    torch.manual_seed(0)
    rest = [b["index"].tolist() for b in rb]
    torch.manual_seed(0)
    assert [b["index"].tolist() for b in back] == rest
    # TorchRL reads our dump, and we read TorchRL's
    theirs = T.TensorDictReplayBuffer(storage=theirs_s(10, tmp_path / "c"), batch_size=3)
    theirs.loads(tmp_path / "ours")
    assert_td_equal(theirs[:], rb[:])
    theirs.extend(make_td(2, 100))
    theirs.dumps(tmp_path / "theirs")
    mine = A.TensorDictReplayBuffer(storage=ours_s(10, tmp_path / "d"), batch_size=3)
    mine.loads(tmp_path / "theirs")
    assert_td_equal(mine[:], theirs[:])
    assert torch.equal(mine.extend(make_td(3)), theirs.extend(make_td(3)))


def test_state_dict_round_trip(tmp_path):
    for storage in (
        lambda: A.LazyTensorStorage(6),
        lambda: A.ListStorage(6),
        lambda: A.LazyMemmapStorage(6),
    ):
        is_list = isinstance(storage(), A.ListStorage)
        cls = A.ReplayBuffer if is_list else A.TensorDictReplayBuffer
        rb = cls(storage=storage(), batch_size=2)
        rb.extend(list(range(9)) if is_list else make_td(9))
        sd = rb.state_dict()
        other = cls(storage=storage(), batch_size=2)
        other.load_state_dict(sd)
        assert len(other) == len(rb) == 6
        if is_list:
            assert [other[i] for i in range(6)] == [rb[i] for i in range(6)]
        else:
            assert_td_equal(other[:], rb[:])
        assert torch.equal(
            other.extend([1] if is_list else make_td(1)), rb.extend([1] if is_list else make_td(1))
        )


def test_empty_resets():
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(4), batch_size=2)
    rb.extend(make_td(3))
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0
    assert torch.equal(rb.extend(make_td(2)), torch.tensor([0, 1]))


# ---------------------------------------------------------------------- prioritized
def test_prioritized_td_buffer():
    np.random.seed(0)  # the prioritized samplers draw from NumPy's generator, as TorchRL's
    torch.manual_seed(0)
    rb = A.TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=1.0, storage=A.LazyTensorStorage(4), batch_size=4000
    )
    td = make_td(4)
    td["td_error"] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    rb.extend(td)
    s = rb.sample()
    assert s["priority_weight"].dtype == torch.float32 and s["index"].dtype == torch.int64
    assert "_weight" not in s.keys()  # TorchRL 0.14 names it priority_weight only
    s["td_error"] = torch.where(s["index"] == 2, 5.0, 1.0)
    rb.update_tensordict_priority(s)
    counts = np.bincount(rb.sample()["index"].numpy(), minlength=4)
    expected = np.array([1, 1, 5, 1]) / 8 * 4000
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    w = rb.sample(64)
    high = w["priority_weight"][w["index"] == 2]
    assert high.numel() and torch.all(high < w["priority_weight"].max())  # IS correction


def test_prioritized_plain_buffer_update_priority():
    rb = A.PrioritizedReplayBuffer(
        alpha=1.0, beta=0.5, storage=A.LazyTensorStorage(3), batch_size=3000
    )
    rb.extend(torch.arange(3))
    rb.update_priority(torch.tensor([0, 1, 2]), torch.tensor([0.0, 0.0, 1.0]))
    data, info = rb.sample(return_info=True)
    assert "priority_weight" in info and torch.all(data == 2)


# ---------------------------------------------------------------------- ensemble, trainer
def test_ensemble_probabilities_and_keys():
    rbs = []
    for v in range(3):
        rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(5))
        rb.extend(TensorDict({"v": torch.full((5,), v)}, [5]))
        rbs.append(rb)
    ours = A.ReplayBufferEnsemble(*rbs, p=[0.2, 0.3, 0.5], batch_size=6)
    torch.manual_seed(0)
    ids = torch.cat([ours.sample()["index", "buffer_ids"][:, 0] for _ in range(400)])
    assert (
        stats.chisquare(
            np.bincount(ids.numpy(), minlength=3), np.array([0.2, 0.3, 0.5]) * ids.numel()
        ).pvalue
        > 1e-3
    )
    s = ours.sample()
    assert s.batch_size == (3, 2)
    assert torch.equal(s["v"], s["index", "buffer_ids"])
    trbs = []
    for v in range(3):
        rb = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(5))
        rb.extend(TensorDict({"v": torch.full((5,), v)}, [5]))
        trbs.append(rb)
    theirs = T.ReplayBufferEnsemble(*trbs, p=[0.2, 0.3, 0.5], batch_size=6).sample()
    assert set(theirs.keys(True, True)) == set(s.keys(True, True))
    assert theirs.batch_size == s.batch_size
    all_ = A.ReplayBufferEnsemble(*rbs, sample_from_all=True, batch_size=6).sample()
    assert torch.equal(all_["index", "buffer_ids"][:, 0], torch.arange(3))


def test_trainer_hooks():
    class StubTrainer:
        def __init__(self):
            self.ops, self.modules = {}, {}

        def register_op(self, dest, op):
            self.ops.setdefault(dest, []).append(op)

        def register_module(self, name, module):
            self.modules[name] = module

    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(20), batch_size=4)
    hook = A.ReplayBufferTrainer(rb, batch_size=4, flatten_tensordicts=True)
    trainer = StubTrainer()
    hook.register(trainer)
    assert set(trainer.ops) == {"batch_process", "process_optim_batch", "post_loss"}
    assert trainer.modules["replay_buffer"] is hook
    batch = TensorDict(
        {"obs": torch.randn(2, 3), ("next", "truncated"): torch.zeros(2, 3, 1, dtype=torch.bool)},
        [2, 3],
    )
    trainer.ops["batch_process"][0](batch)
    assert len(rb) == 6
    sample = trainer.ops["process_optim_batch"][0](None)
    assert sample.batch_size == (4,)
    trainer.ops["post_loss"][0](sample)  # non-prioritized: a no-op that must not raise
    other = A.ReplayBufferTrainer(A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(20)))
    other.load_state_dict(hook.state_dict())
    assert len(other.replay_buffer) == 6
    # prioritized: "post_loss" sets the priorities from the loss' td_error
    prb = A.TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=1.0, storage=A.LazyTensorStorage(6), batch_size=2000
    )
    phook, ptrainer = A.ReplayBufferTrainer(prb, batch_size=2000), StubTrainer()
    phook.register(ptrainer)
    ptrainer.ops["batch_process"][0](TensorDict({"obs": torch.arange(6.0)}, [6]))
    sample = ptrainer.ops["process_optim_batch"][0](None)
    sample["td_error"] = torch.where(sample["index"] == 4, 1.0, 1e-6)
    ptrainer.ops["post_loss"][0](sample)
    assert (prb.sample()["index"] == 4).float().mean() > 0.99
    with pytest.raises(ValueError, match="TensorDictReplayBuffer"):
        A.ReplayBufferTrainer(
            A.PrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=A.LazyTensorStorage(6))
        )


# ---------------------------------------------------------------------- properties
OPS = st.lists(
    st.one_of(
        # few distinct sizes: each is one compilation of the jitted add / sample
        st.tuples(st.just("extend"), st.sampled_from([1, 4, 9])),
        st.tuples(st.just("sample"), st.sampled_from([1, 3])),
        st.tuples(st.just("dumps"), st.just(0)),
        st.tuples(st.just("state_dict"), st.just(0)),
        st.tuples(st.just("update"), st.integers(0, 5)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=8)
@given(ops=OPS, memmap=st.booleans())
def test_random_op_sequences_keep_fifo_invariants(ops, memmap, tmp_path_factory):
    cap = 6
    d = tmp_path_factory.mktemp("rb")

    def storage(name):
        return (
            A.LazyMemmapStorage(cap, scratch_dir=d / name) if memmap else A.LazyTensorStorage(cap)
        )

    rb = A.TensorDictReplayBuffer(storage=storage("s0"), batch_size=2)
    model: list = [None] * cap  # FIFO model: value of "action" id at each slot
    total = 0
    for step, (op, n) in enumerate(ops):
        if op == "extend":
            idx = rb.extend(make_td(n, total))
            assert torch.equal(idx, torch.arange(total, total + n) % cap)
            for i in range(n):
                model[(total + i) % cap] = total + i
            total += n
        elif op == "sample" and total:
            s = rb.sample(n)
            assert s.batch_size == (n,)
            assert torch.all((s["index"] >= 0) & (s["index"] < min(total, cap)))
            assert torch.equal(
                s["obs"][:, 0].long(), torch.tensor([model[i] for i in s["index"].tolist()])
            )
        elif op == "dumps" and total:
            rb.dumps(d / f"dump{step}")
            rb = A.TensorDictReplayBuffer(storage=storage(f"s{step}"), batch_size=2)
            rb.loads(d / f"dump{step}")
        elif op == "update" and total:
            # priorities of a non-prioritized buffer: accepted, and nothing else changes
            idx = torch.tensor([n % min(total, cap)])
            rb.update_priority(idx, torch.tensor([float(n)]))
        elif op == "state_dict" and total:
            sd = rb.state_dict()
            rb = A.TensorDictReplayBuffer(storage=storage(f"t{step}"), batch_size=2)
            rb.load_state_dict(sd)
        assert len(rb) == min(total, cap)
        if total:
            assert rb[:]["obs"][:, 0].long().tolist() == model[: min(total, cap)]


def test_memmap_scratch_dir_is_a_tensordict_like_torchrl(tmp_path):
    ours = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(8, scratch_dir=tmp_path / "o"), batch_size=2
    )
    theirs = T.TensorDictReplayBuffer(
        storage=T.LazyMemmapStorage(8, scratch_dir=tmp_path / "t"), batch_size=2
    )
    ours.extend(make_td(5))
    theirs.extend(make_td(5))

    def files(root):
        return sorted(str(p.relative_to(root)) for p in root.rglob("*.memmap"))

    assert files(tmp_path / "o") == files(tmp_path / "t")  # "index" included, as TorchRL
    for name in files(tmp_path / "o"):  # same bytes on disk
        assert (tmp_path / "o" / name).read_bytes() == (tmp_path / "t" / name).read_bytes()
    live = TensorDict.load_memmap(tmp_path / "o")
    assert_td_equal(live[:5], ours[:])


def _ted(n_steps=10, start=0):
    t = torch.arange(start, start + n_steps)
    done = (t % 4 == 3)[:, None]
    return TensorDict(
        {
            "obs": t[:, None].float(),
            "done": torch.zeros(n_steps, 1, dtype=torch.bool),
            "terminated": torch.zeros(n_steps, 1, dtype=torch.bool),
            "truncated": torch.zeros(n_steps, 1, dtype=torch.bool),
            ("next", "obs"): (t + 1)[:, None].float(),
            ("next", "done"): done,
            ("next", "terminated"): done.clone(),
            ("next", "truncated"): torch.zeros_like(done),
            ("next", "reward"): torch.ones(n_steps, 1),
        },
        [n_steps],
    )


def test_ted2flat_hooks_with_adapter_dumps(tmp_path):
    from torchrl.data.replay_buffers.checkpointers import TED2Flat as TTED2Flat

    ours = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(12, scratch_dir=tmp_path / "o"), batch_size=2
    )
    theirs = T.TensorDictReplayBuffer(
        storage=T.LazyMemmapStorage(12, scratch_dir=tmp_path / "t"), batch_size=2
    )
    ours.register_save_hook(A.TED2Flat())
    theirs.register_save_hook(TTED2Flat())
    for rb in (ours, theirs):
        rb.extend(_ted(8))
        rb.extend(_ted(8, 8).exclude("index"))  # wraps: 16 steps into 12 slots
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")

    def files(root):
        return sorted(str(p.relative_to(root)) for p in (root / "storage").rglob("*.memmap"))

    assert files(tmp_path / "do") == files(tmp_path / "dt")
    for name in files(tmp_path / "do"):
        assert (tmp_path / "do" / name).read_bytes() == (tmp_path / "dt" / name).read_bytes(), name
    back = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(12, scratch_dir=tmp_path / "b"), batch_size=2
    )
    back.register_load_hook(A.Flat2TED())
    back.loads(tmp_path / "do")
    assert len(back) == len(ours)
    assert_td_equal(back[:], ours[:])


def _episodes():
    t = torch.arange(24)
    done = (t % 6 == 5)[:, None]
    return TensorDict(
        {
            "obs": t.float(),
            "ep": t // 6,
            ("next", "done"): done,
            ("next", "truncated"): torch.zeros_like(done),
        },
        [24],
    )


@pytest.mark.parametrize("memmap", [False, True])
def test_slice_sampler_adapter(memmap, tmp_path):
    storage = (
        A.LazyMemmapStorage(30, scratch_dir=tmp_path / "s") if memmap else A.LazyTensorStorage(30)
    )
    ours = A.TensorDictReplayBuffer(
        storage=storage, sampler=A.SliceSampler(num_slices=4), batch_size=12
    )
    theirs = T.TensorDictReplayBuffer(
        storage=T.LazyTensorStorage(30), sampler=T.SliceSampler(num_slices=4), batch_size=12
    )
    ours.extend(_episodes())
    theirs.extend(_episodes())
    s, t = ours.sample(), theirs.sample()
    assert s.batch_size == t.batch_size == (12,)  # flattened [num_slices * slice_len]
    ep, obs = s["ep"].reshape(4, 3), s["obs"].reshape(4, 3)
    assert torch.all(ep == ep[:, :1])  # never crosses an episode end
    assert torch.all(obs[:, 1:] - obs[:, :-1] == 1)
    assert torch.equal(s["obs"], ours[s["index"][:, 0]]["obs"])


@settings(max_examples=6)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("extend"), st.sampled_from([2, 7])),
            st.tuples(st.just("update"), st.lists(st.floats(0.0, 10.0), min_size=3, max_size=3)),
            st.tuples(st.just("roundtrip"), st.just(None)),
        ),
        min_size=1,
        max_size=6,
    ),
    memmap=st.booleans(),
)
def test_prioritized_op_sequences(ops, memmap, tmp_path_factory):
    """extend / update_priority / dumps+loads in any order: samples only ever return stored
    items (their data is the stored data) with finite positive weights <= 1, and a dumps +
    loads round trip keeps the priorities (the same seed draws the same batch)."""
    d = tmp_path_factory.mktemp("prb")

    def build(name):
        storage = A.LazyMemmapStorage(6, scratch_dir=d / name) if memmap else A.LazyTensorStorage(6)
        return A.TensorDictPrioritizedReplayBuffer(
            alpha=1.0, beta=0.6, storage=storage, batch_size=16
        )

    rb = build("s")
    total = 0
    for step, (op, arg) in enumerate(ops):
        if op == "extend":
            rb.extend(make_td(arg, total))
            total += arg
        elif op == "update" and total:
            n = min(len(arg), len(rb))
            rb.update_priority(torch.arange(n), torch.tensor(arg[:n]))
        elif op == "roundtrip" and total:
            rb.dumps(d / f"p{step}")
            back = build(f"b{step}")
            back.loads(d / f"p{step}")
            torch.manual_seed(step)
            np.random.seed(step)  # TorchRL's prioritized draws use NumPy's generator
            before = rb.sample()
            torch.manual_seed(step)
            np.random.seed(step)
            after = back.sample()
            assert_td_equal(before, after)
            rb = back
        if total:
            s = rb.sample()
            assert torch.all(s["index"] < len(rb))
            w = s["priority_weight"]
            assert torch.all(torch.isfinite(w) & (w > 0) & (w <= 1 + 1e-5))
            assert torch.equal(s["obs"], rb[s["index"]]["obs"])


# ---------------------------------------------------------------------- sample format
def _structure(x):
    """Keys, dtypes and shapes of a sample / info (tuples of index tensors kept as tuples)."""
    if isinstance(x, dict) or is_tensor_collection(x):
        keys = x.keys(True, True) if is_tensor_collection(x) else x.keys()
        return {str(k): _structure(x[k]) for k in keys}
    if isinstance(x, tuple):
        return tuple(_structure(v) for v in x)
    return (x.dtype, tuple(x.shape))


def _slice_episodes(ndim):
    t = torch.arange(24)
    done = (t % 6 == 5)[:, None]
    td = TensorDict(
        {
            "obs": t.float(),
            "ep": t // 6,
            ("next", "done"): done,
            ("next", "truncated"): torch.zeros_like(done),
        },
        [24],
    )
    return td.reshape(2, 12) if ndim == 2 else td


SAMPLERS = {
    "random": lambda L: L.RandomSampler(),
    "slice": lambda L: L.SliceSampler(slice_len=2),
    "slice_traj_loose": lambda L: L.SliceSampler(
        num_slices=4, traj_key="ep", truncated_key=None, strict_length=False
    ),
    "slice_wor": lambda L: L.SliceSamplerWithoutReplacement(num_slices=4),
}


@pytest.mark.parametrize(
    "ndim, sampler", [(n, k) for n in (1, 2) for k in sorted(SAMPLERS) if (n, k) != (1, "random")]
)  # (1, random): tests above
def test_sample_and_info_format_match_torchrl(sampler, ndim):
    """Same keys, dtypes and shapes in data and info as TorchRL, for TensorDict and plain
    buffers: "index" is a tuple of per-dim tensors in info where TorchRL's is; slice samplers
    report truncated/done/terminated markers in info (written into TensorDict samples), while a
    plain buffer's data is the stored data."""
    for cls in ("TensorDictReplayBuffer", "ReplayBuffer"):
        out = []
        for L in (A, T):
            rb = getattr(L, cls)(
                storage=L.LazyTensorStorage(24, ndim=ndim),
                sampler=SAMPLERS[sampler](L),
                batch_size=8,
            )
            rb.extend(_slice_episodes(ndim))
            out.append((rb, *rb.sample(return_info=True)))
        (ours, s, info), (_, ts, tinfo) = out
        assert _structure(s) == _structure(ts) and _structure(info) == _structure(tinfo), cls
        index = info["index"]
        if isinstance(index, tuple):
            assert torch.equal(s["obs"], ours.storage[index]["obs"])  # storage[(t, env)]
        if "slice" not in sampler or sampler == "slice_traj_loose":
            continue
        trunc = info[("next", "truncated")].reshape(-1, 2 if sampler == "slice" else 2)
        seq = s["obs"].reshape(trunc.shape[0], -1)
        ends = torch.zeros(seq.shape, dtype=torch.bool)
        ends[:, -1] = True  # strict slices: the last step of each slice is marked
        assert torch.equal(trunc.reshape(seq.shape), ends)
        stored = ours.storage[index]
        assert torch.equal(
            info[("next", "done")], stored["next", "done"] | info[("next", "truncated")]
        )
        assert not info[("next", "terminated")].any()  # not stored: False, as TorchRL
        if cls == "TensorDictReplayBuffer":
            assert torch.equal(s["next", "truncated"], info[("next", "truncated")])
        else:  # a plain buffer returns the stored values, as TorchRL
            assert torch.equal(s["next", "truncated"], stored["next", "truncated"])


@pytest.mark.parametrize("dim_extend", [None, 0])
def test_ndim2_getitem_matches_torchrl(dim_extend):
    td = TensorDict({"x": torch.arange(10).reshape(2, 5)}, [2, 5])  # [num_envs, T]
    rbs = []
    for L in (A, T):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(12, ndim=2), batch_size=4, dim_extend=dim_extend
        )
        rb.extend(td.clone() if dim_extend is None else td.transpose(0, 1).clone())
        rbs.append(rb)
    ours, theirs = rbs
    for index in (slice(None), slice(1, 3), torch.tensor([1, 0])):
        assert_td_equal(ours[index], theirs[index], skip=("index",))
    assert torch.equal(ours["x"], theirs["x"])
    s = ours.sample()
    pairs = tuple(s["index"].unbind(-1))  # (t, env)
    assert torch.equal(ours.storage[pairs]["x"], theirs.storage[pairs]["x"])
    assert torch.equal(ours.storage[pairs]["x"], s["x"])
    assert torch.equal(ours.storage[:]["x"], theirs.storage[:]["x"])  # [time, env]


# ---------------------------------------------------------------------- dumps both ways
DUMP_SAMPLERS = {k: SAMPLERS[k] for k in ("random", "slice")}
DUMP_SAMPLERS["wor"] = lambda L: L.SamplerWithoutReplacement()
DUMP_SAMPLERS["slice_wor"] = SAMPLERS["slice_wor"]


@pytest.mark.parametrize(
    "ndim, sampler",
    [(n, k) for n in (1, 2) for k in sorted(DUMP_SAMPLERS) if (n, k) != (1, "random")],
)  # (1, random): tests above
def test_dumps_load_both_ways_with_each_sampler(sampler, ndim, tmp_path):
    """Our dump loads in TorchRL built alike, and TorchRL's in ours: same stored data, and both
    buffers then sample and extend alike (same indices)."""

    def build(L, name):
        return L.TensorDictReplayBuffer(
            storage=L.LazyMemmapStorage(
                30 if ndim == 1 else 24, ndim=ndim, scratch_dir=tmp_path / name
            ),
            sampler=DUMP_SAMPLERS[sampler](L),
            batch_size=4,
        )

    for src, dst in ((A, T), (T, A)):
        rb = build(src, f"{src.__name__}-src")
        rb.extend(_slice_episodes(ndim))
        rb.sample()
        rb.dumps(tmp_path / src.__name__)
        back = build(dst, f"{src.__name__}-dst")
        back.loads(tmp_path / src.__name__)
        assert len(back) == len(rb) and back.write_count == rb.write_count
        assert_td_equal(back[:], rb[:])
        assert back.sample().batch_size == rb.sample().batch_size
        more = _slice_episodes(ndim)
        assert torch.equal(back.extend(more.clone()), rb.extend(more.clone()))
        assert_td_equal(back[:], rb[:])


def test_without_replacement_epoch_crosses_dumps(tmp_path):
    """Mid-epoch dumps: the other library draws exactly the items this epoch has left."""
    for src, dst in ((A, T), (T, A)):
        rb = src.TensorDictReplayBuffer(
            storage=src.LazyTensorStorage(20), batch_size=3, sampler=src.SamplerWithoutReplacement()
        )
        rb.extend(make_td(10))
        first = rb.sample()["index"].tolist()
        rb.dumps(tmp_path / src.__name__)
        back = dst.TensorDictReplayBuffer(
            storage=dst.LazyTensorStorage(20), batch_size=3, sampler=dst.SamplerWithoutReplacement()
        )
        back.loads(tmp_path / src.__name__)
        rest = [i for _ in range(3) for i in back.sample()["index"].tolist()][:7]
        assert sorted(first + rest) == list(range(10)), (src.__name__, first, rest)


def test_loads_ignores_scratch_rows_past_len(tmp_path):
    """Rows past ``len`` of a TorchRL LazyTensorStorage dump hold uninitialised memory (int64
    values far outside int32): they are not data, loading must not trip on them."""
    theirs = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(10), batch_size=2)
    theirs.extend(make_td(4))
    theirs.dumps(tmp_path / "d")
    path = tmp_path / "d" / "storage" / "action.memmap"
    raw = np.memmap(path, dtype=np.int64, mode="r+")
    raw[4:] = 2**40
    raw.flush()
    ours = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(10), batch_size=2)
    ours.loads(tmp_path / "d")
    assert_td_equal(ours[:], theirs[:])
    assert torch.equal(ours.extend(make_td(2)), theirs.extend(make_td(2)))


def test_pytree_dumps_both_ways(tmp_path):
    """Non-TensorDict data is dumped in TorchRL's PyTree layout (one file per leaf)."""
    data = (torch.arange(7.0)[:, None].expand(7, 2).clone(), {"a": torch.arange(7)})
    for src, dst in ((A, T), (T, A)):
        rb = src.ReplayBuffer(storage=src.LazyMemmapStorage(5), batch_size=2)
        rb.extend(data)
        rb.dumps(tmp_path / src.__name__)
        meta = json.loads(
            (tmp_path / src.__name__ / "storage" / "storage_metadata.json").read_text()
        )
        assert meta["is_pytree"] and set(meta["metadata"]) == {"0", "1.a"}
        back = dst.ReplayBuffer(storage=dst.LazyMemmapStorage(5), batch_size=2)
        back.extend(data)  # TorchRL (and we) need the structure before loading a pytree
        back.loads(tmp_path / src.__name__)
        for x, y in zip(
            jax.tree_util.tree_leaves(back[:], is_leaf=torch.is_tensor),
            jax.tree_util.tree_leaves(rb[:], is_leaf=torch.is_tensor),
        ):
            assert torch.equal(x, y)


def test_storage_level_dumps_and_hooks(tmp_path):
    """TorchRL's storage-level API: storage.dumps / storage.loads with hooks on the storage."""
    from torchrl.data.replay_buffers.checkpointers import Flat2TED as TFlat2TED

    ours = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(12, scratch_dir=tmp_path / "o"), batch_size=2
    )
    ours.storage.register_save_hook(A.TED2Flat())
    ours.extend(_ted(8))
    ours.extend(_ted(8, 8).exclude("index"))
    ours.storage.dumps(tmp_path / "s")
    theirs = T.LazyMemmapStorage(12)
    theirs.register_load_hook(TFlat2TED())
    theirs.loads(tmp_path / "s")
    assert len(theirs) == 12
    assert_td_equal(theirs.get(torch.arange(12)), ours.storage[:])
    back = A.TensorDictReplayBuffer(
        storage=A.LazyMemmapStorage(12, scratch_dir=tmp_path / "b"), batch_size=2
    )
    back.storage.register_load_hook(A.Flat2TED())
    back.storage.loads(tmp_path / "s")
    assert_td_equal(back[:], ours[:])
    # the writer is not part of a storage dump: both libraries write from slot 0 again
    theirs_rb = T.TensorDictReplayBuffer(storage=theirs, batch_size=2)
    assert torch.equal(
        back.extend(_ted(2).exclude("index")), theirs_rb.extend(_ted(2).exclude("index"))
    )
    assert_td_equal(back[:], theirs_rb[:])


def test_ted2flat_dumps_cross_load(tmp_path):
    """A TorchRL buffer dumped with TED2Flat loads here with Flat2TED and vice versa."""
    from torchrl.data.replay_buffers.checkpointers import Flat2TED as TFlat2TED
    from torchrl.data.replay_buffers.checkpointers import TED2Flat as TTED2Flat

    hooks = {A: (A.TED2Flat, A.Flat2TED), T: (TTED2Flat, TFlat2TED)}
    for src, dst in ((A, T), (T, A)):
        rb = src.TensorDictReplayBuffer(storage=src.LazyMemmapStorage(12), batch_size=2)
        rb.register_save_hook(hooks[src][0]())
        rb.extend(_ted(8))
        rb.extend(_ted(8, 8).exclude("index"))  # wraps
        rb.dumps(tmp_path / src.__name__)
        back = dst.TensorDictReplayBuffer(storage=dst.LazyMemmapStorage(12), batch_size=2)
        back.register_load_hook(hooks[dst][1]())
        back.loads(tmp_path / src.__name__)
        assert len(back) == len(rb) == 12
        assert_td_equal(back[:], rb[:])


# ---------------------------------------------------------------------- packaging
def test_core_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, functional_rb\n"
        "for m in pkgutil.iter_modules(functional_rb.__path__):\n"
        # functional_rb.sb3 is a drop-in over Stable-Baselines3, which is built on torch
        "    if m.name not in ('adapters', 'sb3'):\n"
        "        importlib.import_module('functional_rb.' + m.name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'tensordict', "
        "'torchrl'))\n"
        "assert not bad, bad\n"
        "print(len([k for k in sys.modules if k.startswith('functional_rb.')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 10  # the core modules were really imported


def test_samples_go_to_the_storage_device():
    """``device`` is where a tensor storage keeps its data and so where samples come from
    (TorchRL's semantics); "meta" stands in for an accelerator on this CPU-only machine. A
    LazyMemmapStorage lives on the host and refuses another device, as TorchRL's does."""
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(8, device="meta"), batch_size=3)
    rb.extend(make_td(5))
    s = rb.sample()
    assert s.device == torch.device("meta") and s["obs"].device == torch.device("meta")
    assert s["obs"].shape == (3, 3) and rb[:]["obs"].device == torch.device("meta")
    for L in (A, T):
        with pytest.raises(ValueError, match="device other than CPU"):
            L.LazyMemmapStorage(8, device="meta")


# ---------------------------------------------------------------------- callers' data, construction
@pytest.mark.parametrize("cls", ["TensorDictReplayBuffer", "ReplayBuffer"])
@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_extend_and_add_leave_the_callers_tensordict_untouched(L, cls):
    kw = {} if cls == "TensorDictReplayBuffer" else {"writer": L.TensorDictRoundRobinWriter()}
    rb = getattr(L, cls)(storage=L.LazyTensorStorage(10), **kw)
    batch = TensorDict({"a": torch.arange(4)}, [4])
    one = TensorDict({"a": torch.tensor(7)}, [])
    rb.extend(batch)
    rb.add(one)
    assert len(rb) == 5
    if L is T and cls == "ReplayBuffer":
        # TorchRL's plain buffer hands the caller's TensorDict itself to the writer, which
        # writes "index" into it; ours gives the writer a shallow copy, as TorchRL's
        # TensorDictReplayBuffer does
        assert "index" in batch.keys()
        return
    assert set(batch.keys()) == {"a"} and set(one.keys()) == {"a"}


def test_prioritized_extend_leaves_the_callers_tensordict_untouched():
    rb = A.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=A.LazyTensorStorage(10))
    batch = TensorDict({"a": torch.arange(4), "td_error": torch.rand(4)}, [4])
    rb.extend(batch)
    assert set(batch.keys()) == {"a", "td_error"}
    assert rb.sample(4)["index"].max() < 4  # the buffer's copy got its indices


def test_next_walks_epochs_like_torchrl_and_pickles():
    def epochs(L):
        torch.manual_seed(0)
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(10), batch_size=3, sampler=L.SamplerWithoutReplacement()
        )
        rb.extend(TensorDict(a=torch.arange(7), batch_size=[7]))
        out = [rb.next() for _ in range(6)]
        return rb, [None if o is None else (o["a"].tolist(), o.device) for o in out]

    (_, theirs), (ours_rb, ours) = epochs(T), epochs(A)
    assert ours == theirs and ours[3] is None and ours[0][1] is None
    pickle.loads(pickle.dumps(ours_rb))  # (TorchRL's holds a generator and cannot)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(storage_ndim=2, consume_after_n_samples=1), "only supports 1-dimensional storages"),
        (dict(sampler=A.SamplerWithoutReplacement(drop_last=True)), "predictable batch-size"),
    ],
)
def test_a_buffer_that_fails_to_build_leaves_its_storage_unattached(kwargs, error):
    # the storage is the caller's: a buffer whose components do not combine must not stay
    # registered on it (its mark_update would be called on every in-place write)
    kwargs = dict(kwargs)
    storage = A.LazyTensorStorage(10, ndim=kwargs.pop("storage_ndim", 1))
    with pytest.raises((ValueError, TypeError), match=error):
        A.ReplayBuffer(storage=storage, **kwargs)
    assert storage.attached == ()
    ok = A.ReplayBuffer(storage=storage, batch_size=2)
    assert storage.attached == (ok,)
