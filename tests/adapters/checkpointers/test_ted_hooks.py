"""TED2Flat / Flat2TED against TorchRL 0.14.1's own hooks on random storages.

Storages are built without TorchRL from per-env step streams (random episode ends, ring wrap,
``ndim`` 1 or 2) the way a round-robin storage of ``T`` slots holds them; both projects' hooks
get the same ``shift``/``is_full`` their checkpointers would set. File-level byte comparisons
are in tests/adapters/checkpointers/test_serialization.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
trl = pytest.importorskip("torchrl.data")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402
from functional_rb.adapters import ted_hooks  # noqa: E402
from functional_rb.adapters.serialization import dump_storage, load_storage  # noqa: E402


def _streams(steps, envs, seed, p_end):
    """TED steps ``[steps, envs]``: next observation = following observation unless the step
    ends an episode (then the following observation is a fresh reset)."""
    g = torch.Generator().manual_seed(seed)
    terminated = torch.rand(steps, envs, 1, generator=g) < p_end
    truncated = (torch.rand(steps, envs, 1, generator=g) < p_end / 2) & ~terminated
    ends = (terminated | truncated)[..., 0]
    obs = torch.randn(steps + 1, envs, 2, generator=g)
    nxt = obs[1:].clone()
    fresh = torch.randn(steps, envs, 2, generator=g)
    obs[1:][ends] = fresh[ends]  # the step after an end starts from a reset observation
    pos = torch.randint(-99, 99, (steps + 1, envs), generator=g).to(torch.int16)
    next_pos = pos[1:].clone()
    pos[1:][ends] = 7
    zeros = torch.zeros(steps, envs, 1, dtype=torch.bool)
    return TensorDict(
        {
            "observation": obs[:-1],
            "agent": {"pos": pos[:-1]},
            "action": torch.randint(0, 5, (steps, envs), generator=g),
            "collector": {"traj_ids": torch.cumsum(ends.long(), 0)},
            "done": zeros,
            "terminated": zeros.clone(),
            "truncated": zeros.clone(),
            "next": {
                "observation": nxt,
                "agent": {"pos": next_pos},
                "reward": torch.randn(steps, envs, 1, generator=g),
                "done": terminated | truncated,
                "terminated": terminated,
                "truncated": truncated,
            },
        },
        batch_size=[steps, envs],
    )


def _storage(slots, envs, written, seed, p_end):
    """A ``[slots]`` (``envs == 0``) or ``[slots, envs]`` ring after ``written`` steps, and the
    ``shift`` / ``is_full`` a checkpointer gives the hooks (shift = slot written last + 1)."""
    steps = _streams(written, max(envs, 1), seed, p_end)
    storage = steps[:1].clone().zero_().expand(slots, max(envs, 1)).clone()
    kept = torch.arange(max(0, written - slots), written)
    storage[kept % slots] = steps[kept]
    if envs == 0:
        storage = storage[:, 0]
    return storage, (written - 1) % slots + 1, written >= slots


def _run(hook, storage, shift, is_full):
    hook.shift, hook.is_full = shift, is_full
    return hook(storage.clone())


def _assert_tds_equal(got, want, rows=slice(None)):
    keys = {k for k, v in want.items(True, True) if isinstance(v, torch.Tensor)}
    assert {k for k, v in got.items(True, True) if isinstance(v, torch.Tensor)} == keys
    for key in keys:
        a, b = got.get(key)[rows], want.get(key)[rows]
        assert a.dtype == b.dtype and torch.equal(a, b), key


storages = st.tuples(
    st.integers(1, 6),
    st.sampled_from([0, 1, 3]),
    st.integers(1, 14),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.3, 0.9]),
)


@given(storages)
def test_flat_layout_matches_torchrl(args):
    slots, envs, written, seed, p_end = args
    storage, shift, is_full = _storage(slots, envs, written, seed, p_end)
    ours = _run(ted_hooks.TED2Flat(), storage, shift, is_full)
    theirs = _run(trl.TED2Flat(), storage, shift, is_full)
    assert ours.batch_size == theirs.batch_size == torch.Size([])
    _assert_tds_equal(ours, theirs)
    for key in ("shift", "is_full", "_storage_shape"):
        a, b = (ted_hooks._plain(td.get(key)) for td in (ours, theirs))
        assert a == b and type(a) is type(b), key
    if envs == 0:  # one observation row per step, one more per trajectory end
        ends = storage["next", "done"][:, 0].clone()
        ends[shift - 1] = True  # the step written last ends a (possibly unfinished) trajectory
        assert ours["observation"].shape[0] == slots + int(ends.sum())


@given(storages)
def test_round_trip_restores_every_row(args):
    slots, envs, written, seed, p_end = args
    storage, shift, is_full = _storage(slots, envs, written, seed, p_end)
    flat = _run(ted_hooks.TED2Flat(), storage, shift, is_full)
    back = ted_hooks.Flat2TED()(flat)
    assert back.batch_size == storage.batch_size
    _assert_tds_equal(back, storage)


@given(storages.filter(lambda a: a[1] == 0))
def test_torchrl_flat_loads_here_and_ours_loads_in_torchrl(args):
    slots, envs, written, seed, p_end = args
    storage, shift, is_full = _storage(slots, envs, written, seed, p_end)
    length = min(written, slots)
    theirs = _run(trl.TED2Flat(), storage, shift, is_full)
    _assert_tds_equal(ted_hooks.Flat2TED()(theirs.clone()), storage)
    ours = _run(ted_hooks.TED2Flat(), storage, shift, is_full)
    # TorchRL's Flat2TED is exact on the rows that hold data (rows past len are scratch there)
    _assert_tds_equal(trl.Flat2TED()(ours), storage, rows=slice(0, length))


@pytest.mark.parametrize("written", [5, 11], ids=["partial", "wrapped"])
def test_hooks_work_inside_torchrl(tmp_path, written):
    """Registered on TorchRL's own buffers: same dump as TorchRL's hook, and it loads back."""
    steps = _streams(written, 1, seed=4, p_end=0.3)[:, 0]
    for name, hook in (("trl", trl.TED2Flat()), ("ours", ted_hooks.TED2Flat())):
        rb = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(8))
        rb.register_save_hook(hook)
        rb.extend(steps)
        rb.dumps(tmp_path / name)
    for rel in ("observation.memmap", "agent/pos.memmap", "done.memmap", "reward.memmap"):
        assert (tmp_path / "ours" / "storage" / rel).read_bytes() == (
            tmp_path / "trl" / "storage" / rel
        ).read_bytes(), rel
    loaded = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(8))
    loaded.register_load_hook(ted_hooks.Flat2TED())
    loaded.loads(tmp_path / "ours")
    _assert_tds_equal(loaded[:], rb[:])


def test_out_is_written_in_place(tmp_path):
    storage, shift, is_full = _storage(6, 0, 9, seed=5, p_end=0.3)
    dump_storage(storage, tmp_path / "d", last_cursor=shift - 1, save_hooks=[ted_hooks.TED2Flat()])
    out = storage.clone().zero_()
    out["extra"] = torch.ones(6)
    loaded = load_storage(tmp_path / "d", load_hooks=[ted_hooks.Flat2TED()], out=out)
    assert loaded.data is out and torch.equal(out["extra"], torch.ones(6))
    _assert_tds_equal(out.exclude("extra"), storage)


def test_ndim2_full_dump_reloads(tmp_path):
    """TorchRL's Flat2TED scrambles full ndim=2 dumps; ours gives the storage back."""
    storage, shift, is_full = _storage(4, 3, 10, seed=6, p_end=0.3)
    assert is_full and shift == 2
    dump_storage(
        storage, tmp_path / "d", last_cursor=np.array([1, 1, 1]), save_hooks=[ted_hooks.TED2Flat()]
    )
    loaded = load_storage(tmp_path / "d", load_hooks=[ted_hooks.Flat2TED()])
    _assert_tds_equal(loaded.data, storage)


def test_errors_name_the_key():
    storage, shift, is_full = _storage(4, 0, 3, seed=7, p_end=0.3)
    odd = storage.clone()
    odd["next", "info"] = torch.zeros(4)
    with pytest.raises(KeyError, match=r"\('next', 'info'\) has no root counterpart"):
        _run(ted_hooks.TED2Flat(), odd, shift, is_full)
    odd = storage.exclude(("next", "terminated"))
    with pytest.raises(KeyError, match=r"root done key\(s\) \[\('terminated',\)\]"):
        _run(ted_hooks.TED2Flat(), odd, shift, is_full)
    with pytest.raises(KeyError, match="no 'next' entry"):
        _run(ted_hooks.TED2Flat(), storage.exclude("next"), shift, is_full)
    with pytest.raises(RuntimeError, match="hook.shift and hook.is_full are unset"):
        ted_hooks.TED2Flat()(storage)
    with pytest.raises(KeyError, match="not written by TED2Flat"):
        ted_hooks.Flat2TED()(storage)
    flat = _run(ted_hooks.TED2Flat(), storage, shift, is_full)
    rows = flat["observation"].shape[0]
    flat["observation"] = torch.cat([flat["observation"], flat["observation"][:1]])
    with pytest.raises(ValueError, match=rf"\('observation',\) has {rows + 1} rows; expected 4"):
        ted_hooks.Flat2TED()(flat)


def test_ted2flat_keys_are_torchrl_sets():
    for name in ("TED2Flat", "Flat2TED"):
        ours, theirs = getattr(A, name)(), getattr(trl, name)()
        assert ours.done_keys == theirs.done_keys and isinstance(ours.done_keys, set)
        assert ours.reward_keys == theirs.reward_keys
    custom = dict(done_keys=[("done",), ("next", "stop")], reward_keys=["r"])
    assert A.TED2Flat(**custom).done_keys == trl.TED2Flat(**custom).done_keys
    with pytest.raises(TypeError, match=r"pass \('done',\)"):
        A.TED2Flat(done_keys="done")
