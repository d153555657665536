"""TorchRL's replay-buffer options and components in the adapters, each run beside TorchRL
itself on the same data and seed (uniform draws are torch's in both, so seeded runs must
match exactly). Those with a home of their own are there: prefetching in test_prefetch.py,
``consume_after_n_samples`` in tests/adapters/samplers/test_consuming_sampler.py, the writers
in tests/adapters/writers/, memmap clean-up in tests/adapters/storages/test_memmap_cleanup.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from _side_by_side import both as _both  # noqa: E402
from _side_by_side import steps as _td  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402


def _eq(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_sequence_sample_unit_matches_torchrl(boundary):
    def run(L):
        unit = (T.Sequence if L is T else A.Sequence)(
            length=3, burn_in=1, bootstrap=1, episode_boundary=boundary
        )
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(20), batch_size=4, sample_unit=unit
        )
        rb.extend(_td(26))  # wraps the ring
        torch.manual_seed(5)
        return rb.sample()

    a, b = _both(run)
    for key in (
        "obs",
        "index",
        "anchor_index",
        "validity_mask",
        "learning_mask",
        "sequence_id",
        "step_in_sequence",
    ):
        assert torch.equal(a[key], b[key]), key


def test_delayed_init_and_transform_factory():
    for L in (T, A):
        made = []
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(8),
            batch_size=2,
            transform_factory=lambda made=made: made.append(1) or (lambda x: x * 2),
        )
        assert not rb.initialized and made == []
        rb.extend(torch.ones(3))
        assert rb.initialized and made == [1] and torch.equal(rb.sample(), torch.full((2,), 2.0))


def test_in_place_edits_and_stats_match_torchrl():
    def run(L):
        rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(8), batch_size=2)
        assert rb.stats()["initialized"] is True
        rb.extend(_td(5))
        all_ = rb.read_all_in_order()
        all_["r"] = all_["r"] + 100
        rb.write_all(all_)
        rb.set_at_("r", torch.zeros(2), torch.tensor([0, 1]))
        rb.set_("obs", torch.ones(5, 2))
        rb.update_(TensorDict({"r": torch.full((5,), 7.0)}, [5]))
        stats = rb.stats()
        return rb[:].exclude("index"), {
            k: stats[k] for k in ("size", "write_count", "capacity", "utilization")
        }

    (da, sa), (db, sb) = _both(run)
    assert _eq(da, db) and sa == sb


def test_compressed_and_lazy_stack_storages_match_torchrl(tmp_path):
    def run(L):
        rb = L.ReplayBuffer(storage=L.CompressedListStorage(10, compression_level=4), batch_size=3)
        rb.extend(
            TensorDict(
                {
                    "img": torch.arange(5 * 16, dtype=torch.uint8).reshape(5, 4, 4),
                    "r": torch.arange(5.0),
                },
                [5],
            )
        )
        rb.dumps(tmp_path / L.__name__)
        back = L.ReplayBuffer(storage=L.CompressedListStorage(10), batch_size=3)
        back.loads(tmp_path / L.__name__)
        lazy = L.ReplayBuffer(storage=L.LazyStackStorage(10), batch_size=3)
        lazy.extend([TensorDict({"a": torch.zeros(n)}, []) for n in (2, 3, 4)])
        return rb[:], back[:], lazy[:]

    (a0, a1, a2), (b0, b1, b2) = _both(run)
    assert _eq(a0, b0) and _eq(a1, b1) and _eq(b0, b1)
    assert [t["a"].shape for t in a2.unbind(0)] == [t["a"].shape for t in b2.unbind(0)]


@pytest.mark.parametrize("capacity", [6, 20])  # smaller and larger than the storage
def test_prioritized_max_capacity_other_than_the_storage(capacity):
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(10),
        batch_size=64,
        sampler=A.PrioritizedSampler(capacity, alpha=1.0, beta=0.5),
    )
    n = min(capacity, 10)
    rb.extend(_td(n))
    rb.update_priority(torch.arange(n), torch.arange(1.0, n + 1))
    s = rb.sample()
    assert s["index"].max() < n and torch.all(s["priority_weight"] > 0)
    counts = torch.bincount(s["index"], minlength=n).float()
    assert counts[-1] > counts[0]  # proportional to the priorities


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_setitem_over_env_and_time_matches_torchrl(storage):
    def run(L):
        rb = L.ReplayBuffer(storage=getattr(L, storage)(102, ndim=2))
        rb.extend(
            TensorDict(
                {
                    "a": torch.arange(50).expand(2, 50),
                    ("b", "c"): torch.arange(50).expand(2, 50) + 100,
                },
                [2, 50],
            )
        )
        zero = TensorDict({"a": torch.tensor([-1]), ("b", "c"): torch.tensor([-2])}, [1])
        rb[0, 3:4] = zero
        rb[1, 5:6] = zero
        rb[:, 7:8] = zero.expand(2, 1)
        rb[:, 10:20] = TensorDict({"a": -torch.arange(10), ("b", "c"): torch.full((10,), -3)}, [10])
        return rb[:], len(rb), rb.writer._cursor

    (da, na, ca), (db, nb, cb) = _both(run)
    assert _eq(da, db) and na == nb == 100 and ca == cb == 50


@pytest.mark.parametrize("steps", [1, 3])
def test_ndim2_tensordict_extend_sets_one_index_per_element(steps):
    """A [num_envs, steps] TensorDict extending an ndim=2 storage: each element's (t, env)
    pair goes under "index" of the buffer's copy (the caller's batch comes back untouched, as
    with TorchRL's TensorDictReplayBuffer). TorchRL 0.14 is no reference here (with one step it
    raises, expanding the [N, 2] index over [N, 1]; with more it pairs elements with other
    elements' positions, a TODO in its code), so this reads back the rows a sample's index
    names."""
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(20, ndim=2), batch_size=2)
    data = TensorDict({"a": torch.arange(2.0 * steps).reshape(2, steps)}, [2, steps])
    rb.extend(data)
    assert "index" not in data.keys()
    sample = rb.sample(8)
    t, env = sample["index"].reshape(-1, 2).unbind(-1)
    assert torch.equal(rb.storage[(t, env)]["a"], sample["a"].reshape(-1))


def test_compressed_storage_keeps_non_tensor_entries_across_dumps(tmp_path):
    """A TensorDict's strings survive compression and a dump (ours or TorchRL's, the same
    files), read back here."""
    from torchrl.data import CompressedListStorage as TCompressed

    td = TensorDict({"obs": torch.randn(5, 4), "meta": "some metadata string"}, [5])
    for src in (A.CompressedListStorage, TCompressed):
        s = src(max_size=10)
        s.set(0, td)
        path = tmp_path / src.__module__.split(".")[0]
        s.dumps(path)
        for dst in (A.CompressedListStorage,):  # TorchRL's get fails on a reloaded string
            back = dst(max_size=10)
            back.loads(path)
            got = back.get(0)
            assert got["meta"] == "some metadata string"
            assert torch.equal(got["obs"], td["obs"])
    # nested non-tensor entries cannot be saved (TorchRL cannot dump nested TensorDicts here)
    s = A.CompressedListStorage(max_size=10)
    s.set(0, TensorDict({"obs": torch.randn(5, 4), ("nested", "note"): "x"}, [5]))
    assert s.get(0)["nested", "note"] == "x"
    with pytest.raises(TypeError, match="top level"):
        s.dumps(tmp_path / "nested")
