"""StreamingSliceSampler and the ensemble components (StorageEnsemble, SamplerEnsemble,
WriterEnsemble, StorageEnsembleCheckpointer, ReplayBufferEnsemble), each run beside TorchRL's
own classes on the same data and seed. Member ids and uniform draws are torch's on both sides,
so seeded runs must match exactly; a streaming sampler's queued windows are deterministic, so
they match exactly too (only its uniform fallback draws differ: TorchRL's slice sampler and the
core's draw in different orders)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import LazyStackedTensorDict, TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402


def _eq(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, LazyStackedTensorDict):  # members of different keys
        return (
            isinstance(b, LazyStackedTensorDict)
            and a.stack_dim == b.stack_dim
            and all(_eq(x, y) for x, y in zip(a.tensordicts, b.tensordicts, strict=True))
        )
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(_eq(a[k], b[k]) for k in keys)


def _state_eq(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)


def _stream(n, start=0, done_at=(), init_at=(), traj=None):
    t = torch.arange(start, start + n)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[list(done_at)] = True
    td = TensorDict(
        {
            "value": t,
            ("next", "done"): done,
            ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
        },
        [n],
    )
    if init_at:
        init = torch.zeros(n, 1, dtype=torch.bool)
        init[list(init_at)] = True
        td["is_init"] = init
    if traj is not None:
        td.set(traj[0], torch.as_tensor(traj[1]).reshape(n))
    return td


# A write schedule crossing every boundary kind: writes that end mid-window, a done flag
# inside a write, a done flag at a write's end, an is_init start, and a write longer than the
# ring (capacity 16) so that queued windows are overwritten.
_WRITES = [
    dict(n=5),
    dict(n=4),
    dict(n=6, done_at=(2,)),
    dict(n=3, done_at=(2,)),
    dict(n=7, init_at=(3,)),
    dict(n=2),
    dict(n=20),
    dict(n=4),
]


def _streaming_buffer(L, storage=None, **kw):
    return L.TensorDictReplayBuffer(
        storage=storage or L.LazyTensorStorage(16),
        sampler=L.StreamingSliceSampler(slice_len=3, **kw),
    )


def _queued(rb) -> int:
    return rb.sampler.state_dict()["queued_indices"].shape[0]


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_streaming_queues_the_windows_torchrl_queues(storage, tmp_path):
    def make(L, name):
        st = (
            L.LazyTensorStorage(16)
            if storage == "tensor"
            else L.LazyMemmapStorage(16, scratch_dir=tmp_path / name)
        )
        return _streaming_buffer(L, st)

    theirs, ours = make(T, "t"), make(A, "a")
    start = 0
    for w in _WRITES:
        theirs.extend(_stream(start=start, **w))
        ours.extend(_stream(start=start, **w))
        start += w["n"]
        # the memory-mapped storage notifies its sampler twice per write: counted once
        assert _state_eq(ours.sampler.state_dict(), theirs.sampler.state_dict())
        q = _queued(theirs)
        if q:  # every slice of this batch is a queued window: exactly TorchRL's
            a, ia = theirs.sampler.sample(theirs.storage, 3 * q)
            b, ib = ours.sampler.sample(ours.storage, 3 * q)
            assert torch.equal(a[0].reshape(-1), b[0]) and set(ia) == set(ib)
            assert all(torch.equal(ia[k], ib[k]) for k in ia)


@pytest.mark.parametrize(
    "traj", [("episode", "auto"), (("collector", "traj_ids"), "auto"), ("episode", "given")]
)
def test_streaming_trajectory_ids_cut_windows_as_torchrl(traj):
    key, how = traj
    kw = {"traj_key": key} if how == "given" else {}
    theirs, ours = _streaming_buffer(T, **kw), _streaming_buffer(A, **kw)
    ids = [[0, 0, 0, 0, 1], [1, 1, 1, 2], [2, 2, 2, 2, 2, 3]]
    for i, t in enumerate(ids):
        for rb in (theirs, ours):
            rb.extend(_stream(len(t), start=10 * i, traj=(key, t)))
        assert _state_eq(ours.sampler.state_dict(), theirs.sampler.state_dict())
    q = _queued(theirs)
    assert q == 4  # [0 0 0], [1 1 1] across writes, then [2 2 2] twice across writes
    s_t, s_a = theirs.sample(3 * q), ours.sample(3 * q)
    assert torch.equal(s_t["value"], s_a["value"])
    assert torch.equal(s_t["next", "truncated"], s_a["next", "truncated"])


def test_streaming_falls_back_to_uniform_slices_inside_trajectories():
    rb = _streaming_buffer(A)
    rb.extend(_stream(10, done_at=(4, 9)))  # trajectories [0..4] and [5..9]
    assert _queued(rb) == 2
    first = rb.sample(6)["value"].reshape(2, 3)
    assert first.tolist() == [[0, 1, 2], [5, 6, 7]]  # the queued windows, once
    torch.manual_seed(0)
    starts = set()
    for _ in range(20):
        s = rb.sample(6)["value"].reshape(2, 3)  # uniform slices from here on
        assert ((s[:, 1:] - s[:, :-1]) == 1).all()  # contiguous
        assert ((s // 5)[:, 0] == (s // 5)[:, -1]).all()  # never across an episode end
        starts.update(s[:, 0].tolist())
    assert starts == {0, 1, 2, 5, 6, 7}  # every valid start is drawn


def test_streaming_pads_short_fallback_slices_beside_whole_windows():
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(16),
        sampler=A.StreamingSliceSampler(slice_len=3, strict_length=False, pad_output=True),
    )
    rb.extend(_stream(5, done_at=(1, 4)))  # trajectories [0, 1] and [2, 3, 4]
    torch.manual_seed(0)
    s = rb.sample(9)
    assert s["value"][:3].tolist() == [2, 3, 4]  # the queued window, nothing padded
    mask = s["collector", "mask"]
    assert mask[:3].all() and mask.shape == (9,)
    rest = s["value"][3:].reshape(2, 3)
    short = ~mask[3:].reshape(2, 3)
    assert (rest[short] == 1).all()  # padding repeats the last step of [0, 1]


def test_streaming_drops_windows_whose_slots_were_overwritten():
    def run(L):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(6), sampler=L.StreamingSliceSampler(slice_len=3)
        )
        rb.extend(_stream(6))  # two windows queued
        rb.extend(_stream(4, start=6))  # overwrites slots 0..3: the first window is stale
        return rb, rb.sampler.sample(rb.storage, 3)

    (rt, (it, _)), (ra, (ia, _)) = run(T), run(A)
    assert torch.equal(it[0].reshape(-1), ia[0])
    values = ra.storage.get(ia[0])["value"].tolist()
    assert values == [6, 7, 8]  # the window written after, not the stale [0, 1, 2]
    assert _state_eq(ra.sampler.state_dict(), rt.sampler.state_dict())


def test_streaming_state_dict_dumps_and_loads_with_torchrl(tmp_path):
    theirs, ours = _streaming_buffer(T), _streaming_buffer(A)
    for rb in (theirs, ours):
        rb.extend(_stream(8))
        rb.extend(_stream(3, start=8, done_at=(1,)))
    ours.sampler.dumps(tmp_path / "ours")
    theirs.sampler.dumps(tmp_path / "theirs")
    a_from_t = A.StreamingSliceSampler(slice_len=3)
    a_from_t.loads(tmp_path / "theirs")
    t_from_a = T.StreamingSliceSampler(slice_len=3)
    t_from_a.loads(tmp_path / "ours")
    assert _state_eq(a_from_t.state_dict(), theirs.sampler.state_dict())
    assert _state_eq(t_from_a.state_dict(), ours.sampler.state_dict())
    restored = _streaming_buffer(A)
    restored.load_state_dict(ours.state_dict())
    restored.storage.load_state_dict(ours.storage.state_dict())
    assert torch.equal(restored.sample(9)["value"], theirs.sample(9)["value"])
    with pytest.raises(RuntimeError, match="slice_len=3 into a slice_len=4"):
        A.StreamingSliceSampler(slice_len=4).load_state_dict(ours.sampler.state_dict())
    with pytest.raises(FileNotFoundError, match="streaming_slice.pt"):
        A.StreamingSliceSampler(slice_len=3).loads(tmp_path / "nothing")


def test_streaming_refuses_what_torchrl_refuses():
    for bad, err in ((True, TypeError), (2.0, TypeError), (0, ValueError)):
        with pytest.raises(err, match="slice_len must be a positive integer"):
            A.StreamingSliceSampler(slice_len=bad)
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(8, ndim=2), sampler=A.StreamingSliceSampler(slice_len=2)
    )
    with pytest.raises(RuntimeError, match="one-dimensional storage"):
        rb.extend(_stream(8).reshape(4, 2))
    small = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(2), sampler=A.StreamingSliceSampler(slice_len=3)
    )
    with pytest.raises(ValueError, match="cannot hold one slice_len=3 window"):
        small.extend(_stream(2))
    ok = _streaming_buffer(A)
    ok.extend(_stream(6))
    with pytest.raises(RuntimeError, match="divisible by the slice length"):
        ok.sample(4)


# ---------------------------------------------------------------------- ensembles
def _data(kind, v, n=12):
    x = torch.arange(n) + 100 * v
    if kind == "tensor":
        return x
    return TensorDict(
        {"x": x, "nested": TensorDict({"y": x[:, None].expand(n, 2) * 2}, [n, 2])}, [n]
    )


def _members(L, kind, storage, sampler, tmp_path, name, batch=None):
    rbs = []
    for v in range(3):
        st = {
            "list": lambda: L.ListStorage(20),
            "tensor": lambda: L.LazyTensorStorage(20),
            "memmap": lambda v=v: L.LazyMemmapStorage(20, scratch_dir=tmp_path / f"{name}{v}"),
        }[storage]()
        sm = (
            L.SamplerWithoutReplacement(drop_last=True)
            if sampler == "without"
            else L.RandomSampler()
        )
        rb = L.ReplayBuffer(
            storage=st,
            sampler=sm,
            batch_size=batch,
            collate_fn=torch.stack if storage == "list" else None,
        )
        rb.extend(
            _data(kind, v)
            if storage != "list" or kind == "tensor"
            else list(_data(kind, v).unbind(0))
        )
        rbs.append(rb)
    return rbs


_CASES = [
    ("tensor", "list", "random", dict(p=[0.0, 0.9, 0.1])),
    ("td", "tensor", "random", dict(num_buffer_sampled=4)),
    ("td", "memmap", "random", dict(p="sampleable", num_buffer_sampled=6)),
    ("td", "tensor", "without", dict(num_buffer_sampled=3)),
    ("tensor", "tensor", "random", dict(sample_from_all=True)),
    ("td", "list", "random", dict()),
]


@pytest.mark.parametrize("kind,storage,sampler,kw", _CASES)
def test_ensemble_samples_what_torchrl_samples(kind, storage, sampler, kw, tmp_path):
    def run(L, name):
        rbs = _members(
            L, kind, storage, sampler, tmp_path, name, batch=4 if sampler == "without" else None
        )
        ens = L.ReplayBufferEnsemble(
            *rbs, batch_size=12, generator=torch.Generator().manual_seed(1), **kw
        )
        return [ens.sample(return_info=True) for _ in range(4)]

    for (st, it), (sa, ia) in zip(run(T, "t"), run(A, "a")):
        assert _eq(st, sa)
        assert _eq(it, ia)
    nb = kw.get("num_buffer_sampled", 3)
    assert sa.shape[:2] == (nb, 12 // nb)
    if kind == "td":
        assert _eq(sa["index", "buffer_ids"], ia["index", "buffer_ids"])
        assert sa["index", "buffer_ids"].shape == (nb, 12 // nb)
        expected = sa["index", "index"] + 100 * sa["index", "buffer_ids"]
        assert torch.equal(sa["x"], expected)  # each pick read from its own member


def _transform_pair(L):
    from torchrl.envs.transforms import RenameTransform

    rbs = []
    for v, key in ((0, ("some", "key")), (1, "another_key")):
        rb = L.TensorDictReplayBuffer(
            storage=L.LazyTensorStorage(10), transform=RenameTransform([key], ["renamed"])
        )
        rb.extend(TensorDict({"x": torch.arange(10) + 100 * v, key: torch.arange(10.0) + v}, [10]))
        rbs.append(rb)
    return rbs


def _explicit(L, rbs, p=(0.5, 0.5)):
    from torchrl.envs.transforms import RenameTransform

    st = L.StorageEnsemble(
        *(rb.storage for rb in rbs),
        transforms=[rb._transform if L is T else rb.transform for rb in rbs],
    )
    sm = L.SamplerEnsemble(*(rb.sampler for rb in rbs), p=list(p))
    wr = L.WriterEnsemble(*(rb.writer for rb in rbs))
    return L.ReplayBufferEnsemble(
        storages=st,
        samplers=sm,
        writers=wr,
        transform=RenameTransform(["x"], ["x2"], create_copy=True),
    )


@pytest.mark.parametrize("explicit", [False, True])
def test_ensemble_forms_transforms_and_indexing_match_torchrl(explicit):
    from torchrl.envs.transforms import RenameTransform

    def build(L):
        rbs = _transform_pair(L)
        if explicit:
            return _explicit(L, rbs), rbs
        return L.ReplayBufferEnsemble(
            *rbs, p=[0.5, 0.5], transform=RenameTransform(["x"], ["x2"], create_copy=True)
        ), rbs

    (et, _), (ea, ra) = build(T), build(A)
    if explicit:
        assert ea[0].storage is ra[0].storage and ea[1].writer is ra[1].writer
    else:
        assert ea[0] is ra[0] and ea[1] is ra[1]
    assert ea[:] is ea
    for index in (torch.tensor([0, 1]), slice(0, 2), [0, 1]):
        torch.manual_seed(0)
        ref = et.sample(6)
        torch.manual_seed(0)
        assert _eq(ea[index].sample(6), ref)
        assert set(ref.keys(True, True)) >= {"renamed", "x2", ("index", "buffer_ids")}
        assert _eq(ea[index, :3], et[index, :3])
    assert isinstance(ea.storage[[0, 1]], A.StorageEnsemble)
    assert isinstance(ea.sampler[:2], A.SamplerEnsemble)
    assert isinstance(ea.writer[torch.tensor([0, 1])], A.WriterEnsemble)
    assert isinstance(ea.storage[1], A.LazyTensorStorage)
    assert isinstance(ea.sampler[1], A.RandomSampler)
    assert isinstance(ea.writer[0], A.RoundRobinWriter)
    assert _eq(ea.storage[:, :3][0], et.storage[:, :3][0])
    with pytest.raises(IndexError, match="Tuple of length greater than 1"):
        ea.sampler[0, 1]
    with pytest.raises(TypeError, match="floating point index"):
        ea[torch.tensor([0.0])]
    assert len(ea) == len(et) == 2
    assert ea.stats()["size"] == et.stats()["size"] == 20


def test_ensemble_state_dict_dumps_and_loads_like_torchrl(tmp_path):
    def build(L):
        rbs = _transform_pair(L)
        return L.ReplayBufferEnsemble(*rbs, p=[0.3, 0.7], batch_size=4)

    theirs, ours = build(T), build(A)
    stored = [ours.storage[i][:].clone() for i in range(2)]
    sd_t, sd_a = theirs.state_dict(), ours.state_dict()
    for part in ("_storage", "_sampler", "_writer"):
        assert sd_t[part].keys() == sd_a[part].keys() == {"0", "1"}
    assert _state_eq(sd_a["_storage"]["1"]["_storage"], sd_t["_storage"]["1"]["_storage"])
    ours.dumps(tmp_path / "ours")
    theirs.dumps(tmp_path / "theirs")

    def files(root):  # TorchRL's layout; the manifest is ours, prefetch.pkl TorchRL's own
        return {str(f.relative_to(root)) for f in root.rglob("*")} - {
            "frb_manifest.json",
            "prefetch.pkl",
        }

    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
    assert {
        "storage/metadata.json",
        "storage/1_transform.pt",
        "writer/1/metadata.json",
        "storage/1/x.memmap",
    } <= files(tmp_path / "ours")
    for src in (tmp_path / "theirs", tmp_path / "ours"):
        fresh = A.ReplayBufferEnsemble(
            *(A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(10)) for _ in range(2)),
            p=[0.3, 0.7],
            batch_size=4,
        )
        fresh.loads(src)
        for i in range(2):
            assert _eq(fresh.storage[i][:], stored[i])
            assert fresh[i].write_count == 10
    # TorchRL loads our dump (members without transforms: TransformChain's state_dict is keyed
    # "0", "1", ..., which TorchRL's Compose does not read)
    plain = [A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(10)) for _ in range(2)]
    for v, rb in enumerate(plain):
        rb.extend(TensorDict({"x": torch.arange(7) + 10 * v}, [7]))
    A.ReplayBufferEnsemble(*plain).dumps(tmp_path / "plain")
    fresh = T.ReplayBufferEnsemble(
        *(T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(10)) for _ in range(2))
    )
    fresh.loads(tmp_path / "plain")
    for i in range(2):
        assert torch.equal(fresh[i][:]["x"], plain[i][:]["x"])
        assert fresh[i].write_count == 7
    restored = build(A)
    restored[0].empty()
    restored.load_state_dict(sd_a)
    torch.manual_seed(3)
    a = restored.sample()
    torch.manual_seed(3)
    assert _eq(a, theirs.sample())


def test_ensemble_with_an_empty_member_dumps_and_loads(tmp_path):
    rbs = [A.ReplayBuffer(storage=A.LazyTensorStorage(5)) for _ in range(2)]
    rbs[1].extend(torch.arange(5))
    A.ReplayBufferEnsemble(*rbs).dumps(tmp_path / "d")
    assert (tmp_path / "d/storage/metadata.json").read_text() == '{"empty_members": [0]}'
    other = [A.ReplayBuffer(storage=A.LazyTensorStorage(5)) for _ in range(2)]
    other[0].extend(torch.ones(3))
    other[1].extend(torch.zeros(2, dtype=torch.long))  # loads fill an allocation (TorchRL)
    A.ReplayBufferEnsemble(*other).loads(tmp_path / "d")
    assert len(other[0]) == 0 and torch.equal(other[1][:], torch.arange(5))


@pytest.mark.parametrize("route", ["key", "dim"])
def test_routed_writes_and_conditional_updates_match_torchrl(route):
    def build(L):
        rbs = [
            L.TensorDictReplayBuffer(
                storage=L.LazyTensorStorage(4),
                writer=L.TensorDictRoundRobinWriter(track_generations=True),
            )
            for _ in range(3)
        ]
        kw = {"routing_key": "member"} if route == "key" else {"routing_dim": 0}
        return L.ReplayBufferEnsemble(*rbs, **kw)

    theirs, ours = build(T), build(A)
    if route == "key":
        data = TensorDict(
            {"x": torch.arange(9.0), "member": torch.tensor([0, 1, 2, 1, 1, 1, 1, 1, 0])}, [9]
        )  # member 1 wraps its ring of 4
    else:
        data = TensorDict({"x": torch.arange(6.0).reshape(3, 2)}, [3, 2])
    mt, ma = theirs.extend(data), ours.extend(data)
    assert _eq(ma, mt)
    patch = {"x": -torch.ones(ma.shape[0])}
    rt = theirs.update_if_present(
        index=mt.exclude("index_generation"), generation=mt["index_generation"], patch=patch
    )
    ra = ours.update_if_present(
        index=ma.exclude("index_generation"), generation=ma["index_generation"], patch=patch
    )
    assert torch.equal(ra.updated, rt.updated) and ra.updated.all() != (route == "key")
    for i in range(3):
        assert _eq(ours[i][:], theirs[i][:])
    if route == "key":
        assert _eq(
            ours.add(TensorDict({"x": 5.0, "member": 2}, [])),
            theirs.add(TensorDict({"x": 5.0, "member": 2}, [])),
        )


def test_ensemble_priorities_reach_the_member_samplers():
    rbs = []
    for v in range(2):
        rb = A.TensorDictPrioritizedReplayBuffer(
            storage=A.LazyTensorStorage(8), alpha=1.0, beta=1.0
        )
        rb.extend(TensorDict({"x": torch.arange(8) + 100 * v}, [8]))
        rbs.append(rb)
    ens = A.ReplayBufferEnsemble(*rbs, batch_size=8, sample_from_all=True)
    # an index naming every item ("buffer_ids" [nb]): one item per member keeps a priority
    everything = TensorDict(
        {"index": torch.arange(8).expand(2, 8), "buffer_ids": torch.tensor([0, 1])}, [2]
    )
    priority = torch.zeros(2, 8)
    priority[0, 3] = priority[1, 5] = 1.0
    ens.update_priority(everything, priority)
    s = ens.sample()
    assert s["priority_weight"].shape == (2, 4)
    assert s["x"].tolist() == [[3] * 4, [105] * 4]
    # a sample's own index ("buffer_ids" expanded to [nb, sub]), priorities [nb * sub]
    ens.update_priority(s["index"], torch.full((8,), 4.0))
    for rb, item in zip(rbs, (3, 5)):
        values = rb.sampler.tree_values()
        assert values[item] == pytest.approx(4.0) and values.sum() == pytest.approx(4.0)


def test_ensemble_of_streams_serves_each_streams_fresh_windows_as_torchrl():
    def build(L):
        rbs = [_streaming_buffer(L) for _ in range(2)]
        for v, rb in enumerate(rbs):
            rb.extend(_stream(6, start=100 * v))
        return L.ReplayBufferEnsemble(
            *rbs, sample_from_all=True, batch_size=12, generator=torch.Generator().manual_seed(0)
        )

    theirs, ours = build(T), build(A)
    st, sa = theirs.sample(), ours.sample()
    assert torch.equal(sa["value"], st["value"])
    # slice samplers return a 1-tuple index, stacked to [nb, sub, 1] as TorchRL does
    assert sa.batch_size == (2, 6, 1)
    assert sa["value"].reshape(2, 6).tolist() == [
        [0, 1, 2, 3, 4, 5],
        [100, 101, 102, 103, 104, 105],
    ]
    assert _eq(sa["index"], st["index"])


def test_ensemble_refuses_what_cannot_work():
    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(4))
    with pytest.raises(TypeError, match="functional_rb.adapters.ReplayBuffer"):
        A.ReplayBufferEnsemble(rb, T.ReplayBuffer(storage=T.LazyTensorStorage(4)))
    with pytest.raises(RuntimeError, match="either member buffers or"):
        A.ReplayBufferEnsemble(rb, storages=A.StorageEnsemble(rb.storage))
    parts = dict(
        storages=A.StorageEnsemble(rb.storage),
        samplers=A.SamplerEnsemble(rb.sampler),
        writers=A.WriterEnsemble(rb.writer),
    )
    with pytest.raises(ValueError, match="pass them to SamplerEnsemble"):
        A.ReplayBufferEnsemble(p=[1.0], **parts)
    with pytest.raises(TypeError, match="TorchRL's class: use functional_rb.adapters.Random"):
        A.SamplerEnsemble(T.RandomSampler())
    with pytest.raises(ValueError, match="p must hold 2 finite non-negative"):
        A.SamplerEnsemble(A.RandomSampler(), A.RandomSampler(), p=[1.0, -1.0])
    with pytest.raises(RuntimeError, match="sample_from_all"):
        A.SamplerEnsemble(A.RandomSampler(), p=[1.0], sample_from_all=True)
    ens = A.ReplayBufferEnsemble(rb, rb)
    with pytest.raises(RuntimeError, match="writes are disabled"):
        ens.extend(TensorDict({"x": torch.ones(2)}, [2]))
    with pytest.raises(RuntimeError, match="does not write"):
        ens.storage.set(0, torch.ones(1))
    rb.extend(torch.arange(4))
    with pytest.raises(ValueError, match="divisible by num_buffer_sampled"):
        ens.sample(3)
    zero = A.ReplayBufferEnsemble(rb, rb, p=[1.0, 0.0], batch_size=4)[1:]
    with pytest.raises(RuntimeError, match="every member has weight 0"):
        zero.sample()


def test_end_streams_closes_each_stream_as_torchrl():
    def build(L):
        rbs = [
            L.TensorDictReplayBuffer(
                storage=L.LazyTensorStorage(8),
                sampler=sampler,
                writer=L.TensorDictRoundRobinWriter(track_generations=True),
            )
            for sampler in (L.StreamingSliceSampler(slice_len=2), L.SliceSampler(slice_len=2))
        ]
        rbs[0].extend(_stream(5))  # one window still open at the end
        rbs[1].extend(_stream(3, done_at=(0,)))
        return L.ReplayBufferEnsemble(*rbs), rbs

    (et, rt), (ea, ra) = build(T), build(A)
    et.end_streams()
    ea.end_streams()
    for a, t in zip(ra, rt):
        assert _eq(a[:], t[:])
        assert a.write_count == t.write_count
    assert ra[0][:]["next", "done"][4] and ra[0][:]["next", "truncated"][4]
    assert _state_eq(ra[0].sampler.state_dict(), rt[0].sampler.state_dict())
    for rb in (rt[0], ra[0]):
        rb.extend(_stream(3, start=5))  # a new trajectory: no window joins step 4 to step 5
    assert _state_eq(ra[0].sampler.state_dict(), rt[0].sampler.state_dict())
    plain = A.ReplayBufferEnsemble(A.ReplayBuffer(storage=A.LazyTensorStorage(4)))
    with pytest.raises(RuntimeError, match="end_streams requires one-dimensional"):
        plain.end_streams()
