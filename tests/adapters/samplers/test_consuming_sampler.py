"""``consume_after_n_samples`` (the adapters' ``ConsumingSampler``) beside TorchRL's: the same
draws, lengths and slot reuse, and a state dict that round-trips."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
import functional_rb.adapters as A  # noqa: E402


def _both(fn):
    return fn(T), fn(A)


def test_consume_after_n_samples_matches_torchrl():
    def run(L):
        rb = L.ReplayBuffer(
            storage=L.LazyTensorStorage(10),
            batch_size=3,
            consume_after_n_samples=2,
            generator=torch.Generator().manual_seed(0),
        )
        rb.extend(torch.arange(8))
        out = [rb.sample() for _ in range(4)]
        lengths = [len(rb)]
        rb.extend(torch.arange(100, 104))  # reuses consumed slots first
        lengths.append(len(rb))
        return out, lengths, rb.storage[:].clone()

    (sa, la, da), (sb, lb, db) = _both(run)
    assert all(torch.equal(x, y) for x, y in zip(sa, sb)) and la == lb and torch.equal(da, db)


@pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
def test_consuming_list_storage_state_dict_round_trip(L):
    torch.manual_seed(0)
    make = functools.partial(
        L.ReplayBuffer, storage=L.ListStorage(5), batch_size=5, consume_after_n_samples=2
    )
    rb = make()
    rb.extend([torch.tensor(i) for i in range(5)])
    assert set(rb.sample().tolist()) == set(range(5))
    state = rb.state_dict()
    rb2 = make()
    rb2.load_state_dict(state)
    for v in state["_sampler"].values():  # the loaded sampler shares nothing with the dict
        if isinstance(v, torch.Tensor):
            v.fill_(0)
    assert len(rb2) == 5
    assert set(rb2.sample().tolist()) == set(range(5))
    assert len(rb2) == 0
