"""NestedStorageCheckpointer / H5StorageCheckpointer and their hooks, beside TorchRL 0.14's:
dumps of either library load in the other with the same data back."""

import numpy as np
import pytest
import torch

pytest.importorskip("torchrl")
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage as TLazyMemmapStorage  # noqa: E402
from torchrl.data import LazyTensorStorage as TLazyTensorStorage  # noqa: E402
from torchrl.data import TensorDictReplayBuffer as TTensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers import checkpointers as tckpt  # noqa: E402

import functional_rb.adapters as A  # noqa: E402

CKPT = {
    "nested": (A.NestedStorageCheckpointer, tckpt.NestedStorageCheckpointer),
    "h5": (A.H5StorageCheckpointer, tckpt.H5StorageCheckpointer),
}
STORAGES = {
    "tensor": (A.LazyTensorStorage, TLazyTensorStorage),
    "memmap": (A.LazyMemmapStorage, TLazyMemmapStorage),
}
TED_KEYS = {
    "obs",
    "action",
    "done",
    "terminated",
    "truncated",
    ("collector", "traj_ids"),
    ("next", "obs"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
}


def _stream(n_envs: int, n_steps: int, seed: int) -> TensorDict:
    """TED steps ``[n_envs, n_steps]`` (TorchRL's collector layout): trajectories of 1 to 3
    steps, ``("next", "obs")`` equal to the next step's ``obs`` within a trajectory, resets
    elsewhere; ends either terminated or truncated."""
    rng = np.random.default_rng(seed)
    obs = np.zeros((n_envs, n_steps, 3), np.float32)
    nxt = np.zeros_like(obs)
    end = np.zeros((n_envs, n_steps, 1), bool)
    term = np.zeros_like(end)
    traj = np.zeros((n_envs, n_steps), np.int64)
    for e in range(n_envs):
        cur, left, tid = rng.normal(size=3), rng.integers(1, 4), 100 * e
        for t in range(n_steps):
            obs[e, t], traj[e, t] = cur, tid
            nxt[e, t] = rng.normal(size=3)
            left -= 1
            if left == 0:
                end[e, t], term[e, t] = True, rng.random() < 0.5
                cur, left, tid = rng.normal(size=3), rng.integers(1, 4), tid + 1
            else:
                cur = nxt[e, t]
    zeros = torch.zeros(n_envs, n_steps, 1, dtype=torch.bool)
    end_t, term_t = torch.from_numpy(end), torch.from_numpy(term)
    action = rng.normal(size=(n_envs, n_steps, 2)).astype(np.float32)
    reward = rng.normal(size=(n_envs, n_steps, 1)).astype(np.float32)
    return TensorDict(
        {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "done": zeros,
            "terminated": zeros.clone(),
            "truncated": zeros.clone(),
            ("collector", "traj_ids"): torch.from_numpy(traj),
            ("next", "obs"): torch.from_numpy(nxt),
            ("next", "reward"): torch.from_numpy(reward),
            ("next", "done"): end_t,
            ("next", "terminated"): term_t,
            ("next", "truncated"): end_t & ~term_t,
        },
        [n_envs, n_steps],
    )


def _batches(ndim: int, wrapped: bool) -> list:
    """Extends for a buffer of capacity 24: 34 steps (a ring that wrapped) or 17."""
    if ndim == 1:
        data = _stream(1, 34 if wrapped else 17, seed=1)[0]
        return [data[:13], data[13:26], data[26:]] if wrapped else [data[:9], data[9:]]
    data = _stream(2, 17 if wrapped else 10, seed=2)  # [envs, time]; the storage is [12, 2]
    return [data[:, :7], data[:, 7:]]


def _buffer(lib: int, kind: str, storage: str, tmp_path, name: str, ndim: int = 1, **kw):
    ckpt_cls = CKPT[kind][lib]
    stor_cls = STORAGES[storage][lib]
    skw = {"scratch_dir": tmp_path / f"scratch_{name}"} if storage == "memmap" else {}
    rb_cls = A.TensorDictReplayBuffer if lib == 0 else TTensorDictReplayBuffer
    rb = rb_cls(storage=stor_cls(24, ndim=ndim, **skw), batch_size=4)
    rb.storage.checkpointer = ckpt_cls(**kw)
    return rb


def _fill(rb, ndim=1, wrapped=True):
    for batch in _batches(ndim, wrapped):
        rb.extend(batch.clone())
    return rb


def _assert_same(got, want):
    """Same stored steps: every TED entry (and TorchRL's "index" where both hold it) equal."""
    a, b = got[:], want[:]
    assert a.batch_size == b.batch_size
    keys = {k for k in a.keys(True, True)} & {k for k in b.keys(True, True)}
    assert keys >= TED_KEYS, TED_KEYS - keys
    for key in keys:
        assert torch.equal(a.get(key), b.get(key)), key


def _assert_samples(rb):
    batch = rb.sample()
    assert batch.batch_size[0] == 4
    stored = rb[:].reshape(-1)
    rows = {tuple(r.tolist()) for r in stored["obs"]}
    assert all(tuple(r.tolist()) in rows for r in batch["obs"].reshape(-1, 3))


def _needs(kind):
    if kind == "h5":
        pytest.importorskip("h5py")


# ---------------------------------------------------------------------- across libraries
@pytest.mark.parametrize("storage", ["tensor", "memmap"])
@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_torchrl_dump_loads_in_ours(tmp_path, kind, storage):
    _needs(kind)
    theirs = _fill(_buffer(1, kind, storage, tmp_path, "t"))
    assert theirs.storage._is_full
    theirs.dumps(tmp_path / "d")
    ours = _buffer(0, kind, storage, tmp_path, "o")
    ours.loads(tmp_path / "d")
    assert len(ours) == len(theirs) == 24
    _assert_same(ours, theirs)
    _assert_samples(ours)
    # and into a storage that already holds data (written in place)
    again = _fill(_buffer(0, kind, storage, tmp_path, "a"), wrapped=False)
    again.loads(tmp_path / "d")
    assert len(again) == 24
    _assert_same(again, theirs)


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_our_dump_loads_in_torchrl(tmp_path, kind, storage):
    _needs(kind)
    ours = _buffer(0, kind, storage, tmp_path, "o")
    first, *rest = _batches(1, True)
    ours.extend(first.clone())
    ours.dumps(tmp_path / "d")  # then overwritten by a dump with other trajectories
    for batch in rest:
        ours.extend(batch.clone())
    assert ours.storage.is_full
    ours.dumps(tmp_path / "d")
    theirs = _buffer(1, kind, storage, tmp_path, "t")
    theirs.loads(tmp_path / "d")
    assert len(theirs) == len(ours) == 24
    _assert_same(theirs, ours)
    _assert_samples(theirs)
    back = _buffer(0, kind, storage, tmp_path, "b")  # ours round trip
    back.loads(tmp_path / "d")
    assert len(back) == 24
    _assert_same(back, ours)
    _assert_samples(back)


@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_not_full_storage_both_ways(tmp_path, kind):
    _needs(kind)
    ours = _fill(_buffer(0, kind, "memmap", tmp_path, "o"), wrapped=False)
    theirs = _fill(_buffer(1, kind, "memmap", tmp_path, "t"), wrapped=False)
    assert len(ours) == len(theirs) == 17
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")
    a, b = _buffer(1, kind, "memmap", tmp_path, "a"), _buffer(0, kind, "memmap", tmp_path, "b")
    a.loads(tmp_path / "do")
    b.loads(tmp_path / "dt")
    for rb in (a, b):
        assert len(rb) == 17
        _assert_same(rb, ours)


def test_nested_files_are_torchrls(tmp_path):
    """The same data gives the same files: every .memmap byte for byte (the flat rows and
    each trajectory's shape) and the same entries in meta.json."""
    import json

    ours = _fill(_buffer(0, "nested", "memmap", tmp_path, "o"))
    theirs = _fill(_buffer(1, "nested", "memmap", tmp_path, "t"))
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")
    root_o, root_t = tmp_path / "do" / "storage", tmp_path / "dt" / "storage"

    def files(root, pattern):
        return sorted(str(p.relative_to(root)) for p in root.rglob(pattern))

    assert files(root_o, "*.memmap") == files(root_t, "*.memmap")
    assert any(name.endswith(".shape.memmap") for name in files(root_o, "*.memmap"))
    for name in files(root_o, "*.memmap"):
        assert (root_o / name).read_bytes() == (root_t / name).read_bytes(), name
    assert files(root_o, "meta.json") == files(root_t, "meta.json")
    for name in files(root_o, "meta.json"):
        assert json.loads((root_o / name).read_text()) == json.loads((root_t / name).read_text())
    assert json.loads((root_o / "storage_metadata.json").read_text()) == json.loads(
        (root_t / "storage_metadata.json").read_text()
    )


def test_h5_files_hold_torchrls_datasets(tmp_path):
    h5py = pytest.importorskip("h5py")
    ours = _fill(_buffer(0, "h5", "tensor", tmp_path, "o"))
    theirs = _fill(_buffer(1, "h5", "tensor", tmp_path, "t"))
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")

    def read(file):
        out = {}
        with h5py.File(file, "r") as f:
            f.visititems(
                lambda name, obj: (
                    out.__setitem__(name, (obj[()], obj.dtype))
                    if isinstance(obj, h5py.Dataset)
                    else None
                )
            )
        return out

    got = read(tmp_path / "do" / "storage" / "checkpoint.h5")
    want = read(tmp_path / "dt" / "storage" / "checkpoint.h5")
    assert sorted(got) == sorted(want)
    assert len({n.split("/")[0] for n in got if n.startswith("traj_")}) > 10  # 2-digit names
    for name, (value, dtype) in want.items():
        assert got[name][1] == dtype, name
        assert np.array_equal(got[name][0], value), name


# ---------------------------------------------------------------------- ndim=2
@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_ndim2_not_full_both_ways(tmp_path, kind):
    _needs(kind)
    ours = _fill(_buffer(0, kind, "memmap", tmp_path, "o", ndim=2), ndim=2, wrapped=False)
    theirs = _fill(_buffer(1, kind, "memmap", tmp_path, "t", ndim=2), ndim=2, wrapped=False)
    assert len(ours) == len(theirs) == 20
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")
    a = _buffer(1, kind, "memmap", tmp_path, "a", ndim=2)
    a.loads(tmp_path / "do")
    b = _buffer(0, kind, "memmap", tmp_path, "b", ndim=2)
    b.loads(tmp_path / "dt")
    for rb in (a, b):
        assert len(rb) == 20
        _assert_same(rb, ours)
    _assert_samples(b)


@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_ndim2_wrapped_ring(tmp_path, kind):
    """TorchRL 0.14 does not reload its own dumps of a wrapped ndim=2 ring; ours reloads both
    its dumps and ours."""
    _needs(kind)
    ours = _fill(_buffer(0, kind, "tensor", tmp_path, "o", ndim=2), ndim=2)
    theirs = _fill(_buffer(1, kind, "tensor", tmp_path, "t", ndim=2), ndim=2)
    assert len(ours) == len(theirs) == 24
    _assert_same(ours, theirs)
    ours.dumps(tmp_path / "do")
    theirs.dumps(tmp_path / "dt")
    for d in ("do", "dt"):
        back = _buffer(0, kind, "tensor", tmp_path, "b" + d, ndim=2)
        back.loads(tmp_path / d)
        assert len(back) == 24
        _assert_same(back, ours)
        _assert_samples(back)


# ---------------------------------------------------------------------- H5 options
def test_h5_checkpoint_file_and_h5_path(tmp_path):
    pytest.importorskip("h5py")
    ours = _fill(_buffer(0, "h5", "tensor", tmp_path, "o", checkpoint_file="data.h5"))
    ours.storage.dumps(tmp_path / "dir")
    assert (tmp_path / "dir" / "data.h5").is_file()
    theirs = _buffer(1, "h5", "tensor", tmp_path, "t", checkpoint_file="data.h5")
    theirs.storage.loads(tmp_path / "dir")
    _assert_same(theirs, ours)
    # a path ending in .h5 is the file itself; checkpoint_file is then ignored
    ours.storage.dumps(tmp_path / "sub" / "buf.h5")
    assert (tmp_path / "sub" / "buf.h5").is_file() and not (tmp_path / "sub" / "data.h5").exists()
    back = _buffer(0, "h5", "tensor", tmp_path, "b")
    back.storage.loads(tmp_path / "sub" / "buf.h5")
    assert len(back) == 24
    _assert_same(back, ours)
    with pytest.raises(FileNotFoundError, match="checkpoint.h5"):
        _buffer(0, "h5", "tensor", tmp_path, "c").storage.loads(tmp_path / "dir")


def test_h5_kwargs_reach_h5py(tmp_path):
    h5py = pytest.importorskip("h5py")
    ours = _fill(
        _buffer(
            0,
            "h5",
            "tensor",
            tmp_path,
            "o",
            h5_kwargs={"compression": "gzip", "compression_opts": 4},
        )
    )
    ours.dumps(tmp_path / "d")
    with h5py.File(tmp_path / "d" / "storage" / "checkpoint.h5", "r") as f:
        group = f[sorted(k for k in f.keys() if k.startswith("traj_"))[0]]
        assert group["obs"].compression == "gzip"
        assert group["obs"].compression_opts == 4
        assert f["_len"].compression is None  # h5py refuses filters on scalars
    theirs = _buffer(1, "h5", "tensor", tmp_path, "t")
    theirs.loads(tmp_path / "d")
    _assert_same(theirs, ours)


def test_hooks_are_torchrls_names():
    from functional_rb.adapters import ted_hooks

    for name in ("TED2Nested", "Nested2TED", "H5Split", "H5Combine"):
        assert getattr(A, name) is getattr(ted_hooks, name)
    assert A.checkpointers.H5StorageCheckpointer is A.H5StorageCheckpointer
    assert issubclass(A.H5StorageCheckpointer, A.NestedStorageCheckpointer)
    assert issubclass(A.NestedStorageCheckpointer, A.FlatStorageCheckpointer)


def test_our_hooks_in_torchrl_checkpointer(tmp_path):
    """Our TED2Nested / Nested2TED plugged into TorchRL's TensorStorageCheckpointer."""
    theirs = _fill(_buffer(1, "nested", "tensor", tmp_path, "t"))
    theirs.storage.checkpointer = tckpt.TensorStorageCheckpointer()
    theirs.storage.checkpointer.register_save_hook(A.TED2Nested())
    theirs.dumps(tmp_path / "d")
    back = _buffer(1, "nested", "tensor", tmp_path, "b")
    back.storage.checkpointer = tckpt.TensorStorageCheckpointer()
    back.storage.checkpointer.register_load_hook(A.Nested2TED())
    back.loads(tmp_path / "d")
    _assert_same(back, theirs)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("kind", ["nested", "h5"])
def test_errors_name_the_class_and_the_fix(tmp_path, kind):
    _needs(kind)
    name = CKPT[kind][0].__name__
    empty = _buffer(0, kind, "tensor", tmp_path, "e")
    with pytest.raises(RuntimeError, match=f"{name}.dumps.*non-initialized.*extend the buffer"):
        empty.storage.dumps(tmp_path / "x")
    tensors = A.ReplayBuffer(storage=A.LazyTensorStorage(8))
    tensors.extend(torch.zeros(4, 3))
    tensors.storage.checkpointer = CKPT[kind][0]()
    with pytest.raises(ValueError, match=f"{name}.dumps.*TensorDict.*TensorStorageCheckpointer"):
        tensors.storage.dumps(tmp_path / "y")
    lists = A.ReplayBuffer(storage=A.ListStorage(8))
    lists.extend([1, 2])
    lists.storage.checkpointer = CKPT[kind][0]()
    with pytest.raises(ValueError, match=f"{name}.dumps.*ListStorage"):
        lists.storage.dumps(tmp_path / "z")
    # a storage dump loads only into a storage of the same shape (the buffer's loads checks
    # its configuration before)
    ours = _fill(_buffer(0, kind, "tensor", tmp_path, "o"))
    ours.dumps(tmp_path / "d")
    small = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(12), batch_size=4)
    small.storage.checkpointer = CKPT[kind][0]()
    small.extend(_batches(1, False)[0].clone())
    with pytest.raises(RuntimeError, match=r"shape \[24\].*shape \[12\].*built like"):
        small.storage.loads(tmp_path / "d" / "storage")
