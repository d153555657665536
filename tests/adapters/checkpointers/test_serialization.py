"""TorchRL on-disk compatibility: dump_storage/load_storage and the TED2Flat/Flat2TED hooks.

Every comparison is against TorchRL 0.14.1's own ``ReplayBuffer(storage=LazyMemmapStorage(n))
.dumps(path)`` of the same data: same file set, byte-identical ``.memmap`` files, JSON files
equal once parsed (key order may differ; see adapters/serialization.py).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
trl = pytest.importorskip("torchrl.data")

from tensordict import TensorDict  # noqa: E402

from functional_rb.adapters import ted_hooks  # noqa: E402
from functional_rb.adapters.serialization import dump_storage, load_storage  # noqa: E402

CAP = 8


def _ted(n, seed=0, traj_len=4):
    """Collector-like TED data: trajectories of traj_len steps, next obs = following obs."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n)
    obs = torch.randn(n + 1, 3, generator=g)
    done = (t % traj_len == traj_len - 1)[:, None]
    next_obs = obs[1:].clone()
    obs = obs[:-1].clone()
    obs[1:][done[:-1, 0]] = torch.randn(int(done[:-1].sum()), 3, generator=g)  # resets
    return TensorDict(
        {
            "observation": obs,
            "action": torch.randint(0, 4, (n, 2), generator=g),
            "collector": {"traj_ids": t // traj_len},
            "done": torch.zeros(n, 1, dtype=torch.bool),
            "terminated": torch.zeros(n, 1, dtype=torch.bool),
            "truncated": torch.zeros(n, 1, dtype=torch.bool),
            "next": {
                "observation": next_obs,
                "reward": torch.randn(n, 1, generator=g),
                "done": done.clone(),
                "terminated": done.clone(),
                "truncated": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        batch_size=[n],
    )


def _ring_storage(td, cap):
    """What a round-robin storage of size cap holds after extending with td (and the index
    written last), built without TorchRL."""
    storage = td[:1].expand(cap).clone().zero_()
    idx = torch.arange(td.shape[0]) % cap
    keep = torch.arange(td.shape[0]) >= td.shape[0] - cap
    storage[idx[keep]] = td[keep]
    return storage, min(td.shape[0], cap), idx[-1].item()


def _files(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = p
    return out


def _assert_same_dump(a, b):
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for rel in fa:
        ba, bb = Path(fa[rel]).read_bytes(), Path(fb[rel]).read_bytes()
        if rel.endswith(".json"):
            assert json.loads(ba) == json.loads(bb), rel
        else:
            assert ba == bb, rel


def _torchrl_dump(td, path, cap, hook=None, data=None):
    rb = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(cap))
    if hook is not None:
        rb.register_save_hook(hook)
    rb.extend(td if data is None else data)
    rb.dumps(path)
    return rb


@pytest.mark.parametrize("n", [5, 11], ids=["partial", "wrapped"])
@pytest.mark.parametrize("flat", [False, True], ids=["ted", "ted2flat"])
def test_dump_matches_torchrl_bytes(tmp_path, n, flat):
    td = _ted(n)
    _torchrl_dump(td, tmp_path / "trl", CAP, hook=trl.TED2Flat() if flat else None)
    storage, length, last = _ring_storage(td, CAP)
    dump_storage(
        storage,
        tmp_path / "ours",
        length=length,
        last_cursor=last,
        save_hooks=[ted_hooks.TED2Flat()] if flat else (),
    )
    _assert_same_dump(tmp_path / "trl" / "storage", tmp_path / "ours")
    if flat:  # the flat layout really is smaller: one observation row per step (+1 per end)
        meta = json.loads((tmp_path / "ours" / "meta.json").read_text())
        assert "next" not in meta and meta["observation"]["shape"][0] < 2 * CAP


@pytest.mark.parametrize("n", [5, 11], ids=["partial", "wrapped"])
def test_torchrl_ted2flat_dump_loads_here(tmp_path, n):
    td = _ted(n, seed=1)
    rb = _torchrl_dump(td, tmp_path / "trl", CAP, hook=trl.TED2Flat())
    loaded = load_storage(tmp_path / "trl" / "storage", load_hooks=[ted_hooks.Flat2TED()])
    assert loaded.length == min(n, CAP) and not loaded.is_pytree
    want = rb[:]
    got = loaded.data[: loaded.length]
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got[key], want[key]), key


def test_our_ted2flat_dump_loads_in_torchrl(tmp_path):
    td = _ted(11, seed=2)
    storage, length, last = _ring_storage(td, CAP)
    dump_storage(
        storage,
        tmp_path / "ours",
        length=length,
        last_cursor=last,
        save_hooks=[ted_hooks.TED2Flat()],
    )
    trl_storage = trl.LazyMemmapStorage(CAP)
    trl_storage.register_load_hook(trl.Flat2TED())
    trl_storage.loads(tmp_path / "ours")
    assert len(trl_storage) == CAP
    got = trl_storage.get(torch.arange(CAP))
    for key in storage.keys(True, True):
        assert torch.equal(got[key], storage[key]), key


def test_pytree_layout_matches_torchrl(tmp_path):
    g = torch.Generator().manual_seed(3)
    data = {"obs": torch.randn(6, 2, generator=g), "nested": {"r": torch.arange(6.0)}}
    _torchrl_dump(None, tmp_path / "trl", CAP, data=data)
    storage = {"obs": np.zeros((CAP, 2), np.float32), "nested": {"r": np.zeros(CAP, np.float32)}}
    storage["obs"][:6] = data["obs"].numpy()
    storage["nested"]["r"][:6] = data["nested"]["r"].numpy()
    dump_storage(storage, tmp_path / "ours", length=6)
    _assert_same_dump(tmp_path / "trl" / "storage", tmp_path / "ours")
    loaded = load_storage(tmp_path / "trl" / "storage")
    assert loaded.is_pytree and loaded.length == 6
    np.testing.assert_array_equal(loaded.data["obs"].numpy(), storage["obs"])
    np.testing.assert_array_equal(loaded.data["nested"]["r"].numpy(), storage["nested"]["r"])


def test_jax_leaves_and_errors(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    dump_storage({"x": jnp.arange(4, dtype=jnp.int32)}, tmp_path / "j", length=2)
    loaded = load_storage(tmp_path / "j")
    np.testing.assert_array_equal(loaded.data["x"].numpy(), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="length=9"):
        dump_storage({"x": np.zeros(4)}, tmp_path / "k", length=9)
    with pytest.raises(FileNotFoundError, match="storage directory"):
        load_storage(tmp_path / "nothing")
    with pytest.raises(RuntimeError, match="not compatible with PyTree"):
        load_storage(tmp_path / "j", load_hooks=[ted_hooks.Flat2TED()])


@pytest.mark.parametrize("extends", [1, 2], ids=["partial", "full"])
def test_ted2flat_ndim2_dump_matches_torchrl_bytes(tmp_path, extends):
    """[batch, time] storages (TorchRL keeps them as [time, batch] with ndim=2).

    Only the dump is compared here: TorchRL's own Flat2TED does not give a full ndim=2 flat
    dump back; ours does
    (tests/adapters/checkpointers/test_ted_hooks.py::test_ndim2_full_dump_reloads).
    """
    td = torch.stack([_ted(6, seed=0), _ted(6, seed=1)], 0)  # [2 envs, 6 steps]
    rb = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(24, ndim=2))
    rb.register_save_hook(trl.TED2Flat())
    for _ in range(extends):
        rb.extend(td)
    rb.dumps(tmp_path / "trl")
    st = rb._storage
    assert st._storage.shape == (12, 2) and len(st) == 12 * extends
    # the storage contents rebuilt without TorchRL: step t of env e at [t, e] (ring over t)
    storage = st._storage[:1].clone().zero_().expand(12, 2).clone()
    storage[6 * (extends - 1) : 6 * extends] = td.transpose(0, 1)
    if extends == 2:
        storage[:6] = td.transpose(0, 1)
    last = torch.arange(6) + 6 * (extends - 1)
    dump_storage(
        storage,
        tmp_path / "ours",
        length=len(st),
        last_cursor=last,
        save_hooks=[ted_hooks.TED2Flat()],
    )
    _assert_same_dump(tmp_path / "trl" / "storage", tmp_path / "ours")
