"""Trajectory queries (``functional_rb.adapters.query``, ``ReplayBuffer.query``) beside TorchRL's.

The same writes through ``torchrl.data`` and ``functional_rb.adapters`` give the same
trajectories in the same order with the same values (through ring wraparound, ``ndim=2``,
ids or end flags, transforms), the same errors and the same warnings. Properties state what a
query returns on any write sequence: the trajectories partition the stored steps, come oldest
first, hold one id each and end only at their last step; the slice sampler never draws across
their boundaries.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict, lazy_stack  # noqa: E402
from torchrl.envs.transforms import Transform  # noqa: E402

import functional_rb.adapters as A  # noqa: E402

LIBS = pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])


# ---------------------------------------------------------------------- data
def _stream(lengths, envs=None, ids=True, done=True, first_id=0):
    """Episodes of ``lengths`` back to back: ``step`` (write time), ``ids``, reward ``id + 1``,
    ``("next", "done")`` at each episode's last step. ``envs``: ``[envs, T]``, each env its own
    stream (ids offset by ``100 * env``)."""
    if envs is not None:
        out = [_stream(lengths, None, ids, done, first_id + 100 * e) for e in range(envs)]
        for e, td in enumerate(out):
            td["env"] = torch.full((td.shape[0],), e)
        return torch.stack(out)
    n = sum(lengths)
    traj_ids = torch.cat([torch.full((k,), first_id + i) for i, k in enumerate(lengths)])
    ends = torch.zeros(n, 1, dtype=torch.bool)
    ends[torch.tensor(lengths).cumsum(0) - 1] = True
    td = TensorDict(
        {
            "step": torch.arange(n),
            "observation": torch.randn(n, 2),
            ("next", "reward"): (traj_ids.float() + 1)[:, None],
        },
        [n],
    )
    if ids:
        td["collector", "traj_ids"] = traj_ids
    if done:
        td["next", "done"] = ends
    return td


def _buffer(L, capacity, ndim=1, **kw):
    """A buffer over ``LazyTensorStorage(capacity, ndim)``. ``ndim=2``: a plain ReplayBuffer
    (TorchRL's TensorDictReplayBuffer fails to write its "index" entry back into a [1, 1]
    extend there, a TorchRL bug unrelated to queries)."""
    cls = L.TensorDictReplayBuffer if ndim == 1 else L.ReplayBuffer
    return cls(storage=L.LazyTensorStorage(capacity, ndim=ndim), batch_size=2, **kw)


def _pieces(n, cuts, most):
    """``[a, b)`` time ranges covering ``range(n)``, cut at ``cuts`` and at most ``most`` long
    (TorchRL leaves the winner of an extend longer than the ring unspecified)."""
    edges = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    return [(s, min(b, s + most)) for a, b in zip(edges, edges[1:]) for s in range(a, b, most)]


def _query(rb, *args, **kw):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = rb.query(*args, **kw)
    return out, sorted({str(w.message)[:40] for w in seen if w.category is UserWarning})


def _same_trajectories(a, b):
    assert [t.length for t in a] == [t.length for t in b]
    for x, y in zip(a, b):
        keys = set(x.data.keys(True, True))
        assert keys == set(y.data.keys(True, True))
        for k in keys:
            assert torch.equal(x.data.get(k), y.data.get(k)), k


episode_lengths = st.lists(st.integers(1, 7), min_size=1, max_size=12)


# ---------------------------------------------------------------------- beside TorchRL
@given(
    lengths=episode_lengths,
    capacity=st.integers(2, 20),
    signal=st.sampled_from(["ids", "done"]),
    cuts=st.lists(st.integers(0, 84), max_size=5),
    unfinished=st.booleans(),
)
def test_query_matches_torchrl_through_wraparound(lengths, capacity, signal, cuts, unfinished):
    data = _stream(lengths, ids=signal == "ids", done=signal == "done" or unfinished)
    if unfinished and signal == "done":
        data["next", "done"][-1] = False  # the newest episode is still running
    out = {}
    for L in (T, A):
        rb = _buffer(L, capacity)
        for a, b in _pieces(data.shape[0], cuts, capacity):
            rb.extend(data[a:b])
        out[L] = _query(rb)
    _same_trajectories(out[T][0], out[A][0])
    assert out[T][1] == out[A][1]  # the end-flag warning, or none


@given(
    lengths=episode_lengths,
    envs=st.integers(1, 3),
    rows=st.integers(2, 9),
    t_write=st.integers(1, 5),
    signal=st.sampled_from(["ids", "done"]),
)
def test_query_matches_torchrl_on_ndim2_storages(lengths, envs, rows, t_write, signal):
    data = _stream(lengths, envs=envs, ids=signal == "ids", done=signal == "done")
    out = {}
    for L in (T, A):
        rb = _buffer(L, rows * envs, ndim=2)
        for a, b in _pieces(data.shape[1], [], min(t_write, rows)):
            rb.extend(data[:, a:b])
        out[L] = _query(rb)
    _same_trajectories(out[T][0], out[A][0])
    assert out[T][1] == out[A][1]


PREDICATES = [
    lambda q: q.reward.sum() > 6.0,
    lambda q: (q.length >= 3) & (q.reward.mean() > 1.5),
    lambda q: (q.length < 3) | ~(q.reward.max() <= 2.0),
    lambda q: (q.reward > 2.5).any(),
    lambda q: (q.reward >= 2.0).all(),
    lambda q: q.reward.first() == 2.0,
    lambda q: q.reward.last() < 3,
    lambda q: (q[("collector", "traj_ids")] == 1).all(),
    lambda q: q.total_reward > 5.0,
    lambda q: q.step.min() >= 4,
]


@pytest.mark.parametrize("make", PREDICATES)
def test_predicates_keep_the_same_trajectories_and_read_the_same_keys(make):
    data = _stream([5, 3, 7, 2])
    kept = {}
    for L in (T, A):
        kept[L] = L.filter_trajectories(data, make(L.traj))
        assert make(L.traj).required_keys() == make(T.traj).required_keys()
    _same_trajectories(kept[T], kept[A])
    rbs = {L: _buffer(L, 12) for L in (T, A)}
    for rb in rbs.values():
        rb.extend(data)
    _same_trajectories(rbs[T].query(make(T.traj)), rbs[A].query(make(A.traj)))


class _Counting(Transform):
    """Scales ``key`` by 2 and counts its calls."""

    def __init__(self, key):
        super().__init__(in_keys=[key], out_keys=[key])
        self.key, self.calls = key, 0

    def forward(self, td):
        self.calls += 1
        td[self.key] = td[self.key] * 2
        return td


@pytest.mark.parametrize(
    "make",
    [
        lambda q: q.reward.sum() > 12.0,  # the reward transform only
        lambda q: q.length >= 5,  # no transform, no key
        lambda q: (q.observation > -100).all(),  # the observation transform only
        lambda q: lambda t: bool(t.reward.sum() > 12),  # opaque: everything, once
    ],
    ids=["reward", "length", "observation", "opaque"],
)
def test_transforms_run_as_in_torchrl(make):
    data = _stream([5, 3, 7])
    out = {}
    for L in (T, A):
        obs, rew = _Counting("observation"), _Counting(("next", "reward"))
        rb = _buffer(L, 15)
        rb.append_transform(obs)
        rb.append_transform(rew)
        rb.extend(data)
        out[L] = (rb.query(make(L.traj)), obs.calls, rew.calls)
    _same_trajectories(out[T][0], out[A][0])
    assert out[T][1:] == out[A][1:]
    assert out[A][0]
    for t in out[A][0]:  # what a sample gives: every transform applied
        assert torch.equal(t.reward, 2 * data["next", "reward"][t.step])
        assert torch.equal(t.observation, 2 * data["observation"][t.step])


def test_a_transform_without_out_keys_runs_with_everything_before_it():
    data = _stream([5, 3, 7])
    out = {}
    for L in (T, A):
        rew = _Counting(("next", "reward"))
        rb = _buffer(L, 15)
        rb.append_transform(rew)
        rb.append_transform(lambda td: td.set("extra", td["step"] * 0))  # no out_keys
        rb.extend(data)
        out[L] = (rb.query(L.traj.step.sum() >= 0), rew.calls)
    _same_trajectories(out[T][0], out[A][0])
    assert out[T][1] == out[A][1] == 1
    assert "extra" in out[A][0][0].keys()


def test_list_storages_before_the_ring_wraps():
    data = _stream([4, 3, 2])
    out = {L: L.ReplayBuffer(storage=L.ListStorage(20), batch_size=2) for L in (T, A)}
    for rb in out.values():
        rb.extend(list(data.unbind(0)))
    _same_trajectories(out[T].query(), out[A].query())
    _same_trajectories(out[T].query(T.traj.reward.sum() > 5), out[A].query(A.traj.reward.sum() > 5))


def test_list_storage_after_the_ring_wraps_is_in_time_order():
    """TorchRL's ListStorage keeps no write cursor, so after wrapping it lists trajectories
    in slot order; the adapters give the time order TorchRL gives for tensor storages."""
    data = _stream([4, 3, 5, 1])
    ring = A.ReplayBuffer(storage=A.ListStorage(10), batch_size=2)
    ring.extend(list(data[:7].unbind(0)))
    ring.extend(list(data[7:12].unbind(0)))
    ring.add(data[12])
    tensors = T.ReplayBuffer(storage=T.LazyTensorStorage(10), batch_size=2)
    tensors.extend(data[:7])
    tensors.extend(data[7:12])
    tensors.add(data[12])
    got, want = ring.query(), tensors.query()
    assert [t.step.tolist() for t in got] == [[3], [4, 5, 6], [7, 8, 9, 10, 11], [12]]
    _same_trajectories(got, want)


def test_the_empty_buffer_gives_no_trajectories():
    for L in (T, A):
        assert _buffer(L, 10).query() == []
        assert L.ReplayBuffer(storage=L.ListStorage(5)).query(L.traj.length > 0) == []
        rb = _buffer(L, 10)
        rb.extend(_stream([3]))
        rb.empty()
        assert rb.query() == []
        assert list(L.iter_trajectories(_stream([3])[:0])) == []


def _query_list_of_ints(L):
    rb = L.ReplayBuffer(storage=L.ListStorage(5))
    rb.extend([1, 2])
    rb.query()


def _query_batched_list_items(L):
    rb = L.ReplayBuffer(storage=L.ListStorage(5))
    rb.extend([_stream([2]), _stream([3])])
    rb.query()


ERRORS = {
    "list-of-ints": _query_list_of_ints,
    "list-of-batches": _query_batched_list_items,
    "tensor": lambda L: list(L.iter_trajectories(torch.zeros(4, 2))),
    "2d": lambda L: list(L.iter_trajectories(_stream([2, 2]).reshape(2, 2))),
    "bad-key": lambda L: list(L.iter_trajectories(_stream([3]), trajectory_key="nope")),
    "no-signal": lambda L: list(L.iter_trajectories(_stream([3], ids=False, done=False))),
    "unreduced": lambda L: L.filter_trajectories(_stream([3]), L.traj.reward > 1),
    "trajectory-2d": lambda L: L.Trajectory(_stream([4]).reshape(2, 2)),
    "no-entry": lambda L: L.Trajectory(_stream([4])).pixels,
    "missing-field": lambda L: L.filter_trajectories(_stream([3]), L.traj.pixels.sum() > 0),
    "scalar-reduced": lambda L: L.traj.length.max(),
}


def _error(L, case):
    try:
        case(L)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)
    return None


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_are_torchrls(name):
    expected = _error(T, ERRORS[name])
    assert expected is not None
    assert _error(A, ERRORS[name]) is expected


def test_errors_name_the_call_and_the_fix():
    rb = A.ReplayBuffer(storage=A.ListStorage(5))
    rb.extend([1, 2])
    with pytest.raises(TypeError, match=r"ReplayBuffer.query requires a tensordict-backed.*int"):
        rb.query()
    with pytest.raises(KeyError, match=r"iter_trajectories: trajectory_key .*nope.* Name the"):
        list(A.iter_trajectories(_stream([3]), trajectory_key="nope"))
    with pytest.raises(TypeError, match=r"ReplayBuffer.query: \(traj.reward > 1\).*any\(\)"):
        full = _buffer(A, 5)
        full.extend(_stream([3]))
        full.query(A.traj.reward > 1)
    with pytest.raises(AttributeError, match=r"traj.length.sum\(\): .* already one value"):
        A.traj.length.sum()
    with pytest.raises(ValueError, match=r"one trajectory id per step.*\(3,\)"):
        bad = _stream([3])
        bad["episode"] = torch.zeros(3, 2)
        list(A.iter_trajectories(bad, trajectory_key="episode"))


def test_trajectories_behave_as_torchrls():
    data = _stream([5])
    t, a = T.Trajectory(data), A.Trajectory(data)
    for name in ("observation", "reward", "done", "step"):
        assert torch.equal(getattr(t, name), getattr(a, name))
    assert a.length == len(a) == 5 and torch.equal(a.total_reward, t.total_reward)
    assert torch.equal(a["next", "done"], t["next", "done"])
    assert isinstance(a[1:3], A.Trajectory) and a[1:3].length == 2
    assert isinstance(a[0], A.Trajectory) and a.get("nope", 7) == 7
    assert sorted(map(str, a.keys())) == sorted(map(str, t.keys()))
    assert repr(a) == repr(t)
    stacked = lazy_stack([a, A.Trajectory(_stream([3]))])
    assert isinstance(stacked, A.Trajectory) and stacked.batch_size == torch.Size([2, -1])
    assert isinstance(a.clone(), A.Trajectory) and a.clone().length == 5


def test_ids_are_compared_exactly_whatever_their_size():
    data = _stream([2, 2, 2])
    data["collector", "traj_ids"] = torch.tensor([0, 0, 2**32, 2**32, 0, 0])
    for L in (T, A):
        assert [t.length for t in L.iter_trajectories(data)] == [2, 2, 2]


def test_long_buffers_beside_torchrl():
    data = _stream([7, 300, 1, 900, 45, 2000, 13])
    out = {}
    for L in (T, A):
        rb = _buffer(L, 2500)
        for s in range(0, data.shape[0], 700):
            rb.extend(data[s : s + 700])
        out[L] = rb.query(L.traj.length > 10)
    _same_trajectories(out[T], out[A])
    assert [t.step[0].item() for t in out[A]] == [766, 1208, 1253, 3253]


# ---------------------------------------------------------------------- properties
@given(
    lengths=episode_lengths,
    envs=st.integers(1, 3),
    rows=st.integers(2, 12),
    t_write=st.integers(1, 6),
    by_id=st.booleans(),
)
def test_trajectories_partition_the_stored_steps_in_time_order(lengths, envs, rows, t_write, by_id):
    data = _stream(lengths, envs=envs, ids=by_id, done=not by_id)
    rb = _buffer(A, rows * envs, ndim=2)
    for a, b in _pieces(data.shape[1], [], min(t_write, rows)):
        rb.extend(data[:, a:b])
    trajs, _ = _query(rb)
    stored = rb.storage[:]  # [rows, envs], time first
    got = sorted((int(e), int(s)) for t in trajs for e, s in zip(t.env, t.step))
    assert got == sorted(
        zip(stored["env"].reshape(-1).tolist(), stored["step"].reshape(-1).tolist())
    )
    columns = [int(t.env[0]) for t in trajs]
    assert columns == sorted(columns)  # grouped by env column
    for i, t in enumerate(trajs):
        assert (t.env == t.env[0]).all()
        assert torch.equal(t.step, torch.arange(t.step[0], t.step[0] + t.length))  # in time
        newest = i + 1 == len(trajs) or columns[i + 1] != columns[i]
        if by_id:  # one id; the next trajectory of the column has another
            ids = t["collector", "traj_ids"]
            assert (ids == ids[0]).all()
            assert newest or trajs[i + 1]["collector", "traj_ids"][0] != ids[0]
        else:  # an end flag at the last step only (the newest may still be running)
            assert not t.done[:-1].any() and (newest or t.done[-1].all())
        if not newest:  # oldest first: the next one starts where this one stops
            assert int(trajs[i + 1].step[0]) == int(t.step[-1]) + 1


@given(lengths=episode_lengths, capacity=st.sampled_from([7, 16]), seed=st.integers(0, 2**16))
def test_slice_samples_never_cross_query_boundaries(lengths, capacity, seed):
    # a full ring, written 4 steps at a time: the sampler compiles once per capacity
    pad = max(16 - sum(lengths), -sum(lengths) % 4)
    pad += -(sum(lengths) + pad) % 4
    data = _stream(lengths + ([pad] if pad else []))
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(capacity),
        batch_size=8,
        sampler=A.SliceSampler(
            slice_len=2, traj_key=("collector", "traj_ids"), strict_length=False
        ),
    )
    for s in range(0, data.shape[0], 4):
        rb.extend(data[s : s + 4])
    trajs = rb.query()
    owner = {int(s): i for i, t in enumerate(trajs) for s in t.step}
    assert len(owner) == sum(t.length for t in trajs) == len(rb)
    torch.manual_seed(seed)
    sample = rb.sample()
    steps = sample["step"].reshape(-1).tolist()
    ends = sample["next", "truncated"].reshape(-1).tolist()
    for i in range(len(steps) - 1):
        if not ends[i]:  # within a slice: the same query trajectory, the next step
            assert owner[steps[i + 1]] == owner[steps[i]] and steps[i + 1] == steps[i] + 1
    assert set(owner) == set(rb.storage[:]["step"].tolist())
