"""The adapters' writers beside TorchRL's, on the same data: ``RoundRobinWriter``'s generations
(``track_generations``, ``generations_of``, ``update_if_present``; kept through dumps and state
dicts, bumped by every writer of a shared storage), ``TensorDictMaxValueWriter``'s top items
(reductions, dumps read both ways) and ``ImmutableDatasetWriter``'s refusal."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from _side_by_side import both as _both  # noqa: E402
from _side_by_side import steps as _td  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402


# ---------------------------------------------------------------------- generations
def test_generations_and_update_if_present_match_torchrl():
    def run(L):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(6),
            batch_size=3,
            writer=L.TensorDictRoundRobinWriter(track_generations=True),
        )
        index = rb.extend(_td(6))
        gen = rb.writer.generations_of(index)
        rb.extend(_td(2, 10))  # slots 0 and 1 are reused
        res = rb.update_if_present(index=index, generation=gen, patch={"r": torch.full((6,), -1.0)})
        res2 = rb.update_if_present(
            index=index,
            generation=rb.writer.generations_of(index),
            patch={"r": torch.full((6,), -2.0)},
            version_key="step",
            version=torch.full((6,), 3),
            require_newer=True,
        )
        with pytest.raises(ValueError, match="per-record scalar"):
            rb.update_if_present(
                index=index,
                generation=gen,
                patch={"r": torch.zeros(6)},
                version_key="obs",
                version=torch.zeros(6, 2),
            )
        return gen, res.updated, res2.updated, res2.version_rejected, rb[:]["r"]

    a, b = _both(run)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_writer_without_generations_still_bumps_the_shared_ones():
    def run(L):
        storage = L.LazyTensorStorage(4)
        tracking = L.ReplayBuffer(
            storage=storage, writer=L.RoundRobinWriter(track_generations=True)
        )
        plain = L.ReplayBuffer(storage=storage)
        index = tracking.extend(torch.arange(4))
        before = tracking.writer.generations_of(index)
        plain.extend(torch.arange(10, 12))
        return tracking.writer.generations_of(index) != before

    a, b = _both(run)
    assert torch.equal(a, b) and a.tolist() == [True, True, False, False]


@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_generations_survive_writer_dumps_loads_without_a_storage(L, tmp_path):
    rb = L.ReplayBuffer(
        storage=L.LazyTensorStorage(4), writer=L.RoundRobinWriter(track_generations=True)
    )
    rb.extend(torch.arange(6))  # slots 0, 1 written twice
    rb.writer.dumps(tmp_path)
    fresh = L.RoundRobinWriter(track_generations=True)
    fresh.loads(tmp_path)  # no storage yet
    expected = rb.writer.generations_of(torch.arange(4))
    assert fresh.generations_of(torch.arange(4)).tolist() == expected.tolist()
    if L is A:  # and the buffer it joins uses them
        rb2 = A.ReplayBuffer(storage=A.LazyTensorStorage(4), writer=fresh)
        assert rb2.writer.generations_of(torch.arange(4)).tolist() == expected.tolist()


def test_generations_state_dict_of_a_writer_without_a_storage():
    rb = A.ReplayBuffer(
        storage=A.LazyTensorStorage(4), writer=A.RoundRobinWriter(track_generations=True)
    )
    rb.extend(torch.arange(5))
    fresh = A.RoundRobinWriter(track_generations=True)
    fresh.load_state_dict(rb.writer.state_dict())
    assert fresh.generations_of(torch.arange(4)).tolist() == [1, 0, 0, 0]


# ---------------------------------------------------------------------- max value, immutable
def test_max_value_writer_keeps_top_items():
    ours = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(3),
        batch_size=2,
        writer=A.TensorDictMaxValueWriter(rank_key="r"),
    )
    theirs = T.TensorDictReplayBuffer(
        storage=T.LazyTensorStorage(3),
        batch_size=2,
        writer=T.TensorDictMaxValueWriter(rank_key="r"),
    )
    for r in ([1.0, 5.0, 3.0, 0.5, 7.0], [0.1, 9.0]):
        td = TensorDict({"r": torch.tensor(r)}, [len(r)])
        i_ours, i_theirs = ours.extend(td.clone()), theirs.extend(td.clone())
        assert torch.equal(i_ours < 0, i_theirs < 0)  # same items rejected (-1)
    assert sorted(ours[:]["r"].tolist()) == sorted(theirs[:]["r"].tolist()) == [5.0, 7.0, 9.0]


def test_max_value_writer_median_matches_torchrl():
    def run(L):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(4),
            batch_size=2,
            writer=L.TensorDictMaxValueWriter(rank_key="k", reduction="median"),
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            rb.extend(
                TensorDict(
                    {"k": torch.rand(5, 3, generator=g), "x": torch.randn(5, generator=g)}, [5]
                )
            )
        return rb[:]

    a, b = _both(run)
    assert sorted(a["x"].tolist()) == sorted(b["x"].tolist())


def test_max_value_writer_dumps_both_ways(tmp_path):
    """TorchRL's TensorDictMaxValueWriter reads our dump (its heap of top values) and we read
    TorchRL's: afterwards both keep the same top items."""

    def build(L):
        return L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(4),
            batch_size=2,
            writer=L.TensorDictMaxValueWriter(rank_key="r"),
        )

    def td(r):
        return TensorDict({"r": torch.tensor(r)}, [len(r)])

    for src, dst in ((A, T), (T, A)):
        rb = build(src)
        rb.extend(td([3.0, 1.0, 4.0, 1.5, 5.0, 0.5]))
        rb.dumps(tmp_path / src.__name__)
        back = build(dst)
        back.loads(tmp_path / src.__name__)
        assert sorted(back[:]["r"].tolist()) == [1.5, 3.0, 4.0, 5.0]
        for rbx in (rb, back):
            rbx.extend(td([2.0, 9.0, 0.1]))
        assert sorted(back[:]["r"].tolist()) == sorted(rb[:]["r"].tolist()) == [3.0, 4.0, 5.0, 9.0]


def test_immutable_writer_raises():
    rb = A.TensorDictReplayBuffer(
        storage=A.TensorStorage(_td(4)), writer=A.ImmutableDatasetWriter(), batch_size=2
    )
    assert len(rb) == 4 and rb.sample().batch_size == (2,)
    with pytest.raises(RuntimeError, match="read-only"):
        rb.extend(_td(2))
