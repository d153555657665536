"""TorchRL's transforms that users attach to replay buffers, on our buffers beside TorchRL's:
``MultiStepTransform`` (n-step returns written at ``extend``), ``PolicyAgeFilter`` (stale data
dropped at ``extend`` and at ``sample``) and ``CatFrames`` (frame stacks built at ``sample``,
added with ``append_transform``), and TorchRL's ``MultiStep`` postproc pattern (after
``split_trajectories``, with each library's own ``MultiStep``).

Each scenario runs the same writes and the same seeded samples through ``torchrl.data`` and
``functional_rb.adapters``: the stored data, the transforms' own state and every sample must
be the same.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict  # noqa: E402
from torchrl.collectors.utils import split_trajectories  # noqa: E402
from torchrl.envs.transforms import (
    CatFrames,  # noqa: E402
    MultiStepTransform,  # noqa: E402
    PolicyAgeFilter,  # noqa: E402
)

import functional_rb.adapters as A  # noqa: E402

LIBS = {"torchrl": T, "frb": A}
# CatFrames (TorchRL's) warns about unnamed time dims on every flat sample, on both buffers
pytestmark = pytest.mark.filterwarnings(
    "ignore:The last dimension of the tensordict should be marked as 'time'"
)


def _same(a, b, what=""):
    assert set(a.keys(True, True)) == set(b.keys(True, True)), what
    assert a.batch_size == b.batch_size, what
    for key in b.keys(True, True):
        torch.testing.assert_close(
            a.get(key), b.get(key), rtol=0, atol=0, msg=lambda m, k=key: f"{what} {k}: {m}"
        )


def _episodes(lengths, obs_dim=2, start=0):
    """Episodes back to back: ``obs`` = step number, ``("next", "obs")`` = step + 1, reward
    = step, done / terminated at each episode's last step."""
    n = sum(lengths)
    step = torch.arange(start, start + n)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[torch.tensor(lengths).cumsum(0) - 1] = True
    return TensorDict(
        {
            "obs": step[:, None].expand(n, obs_dim).float(),
            "steps": step,
            "episode": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
            "next": {
                "obs": (step + 1)[:, None].expand(n, obs_dim).float(),
                "steps": step + 1,
                "reward": step[:, None].float(),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros_like(done),
            },
        },
        [n],
    )


# ---------------------------------------------------------------------- MultiStepTransform
@pytest.mark.parametrize("chunk", [7, 10, 25])
def test_multistep_transform_extend_and_sample(chunk):
    """Chunks extended through MultiStepTransform(3, 0.9): the same n-step items are stored
    (the transform holds the last steps back until their successors arrive), and the same
    seeded samples come out."""
    data = _episodes([6, 11, 4, 9, 15])
    rbs = {}
    for name, lib in LIBS.items():
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(100),
            batch_size=8,
            transform=MultiStepTransform(n_steps=3, gamma=0.9),
        )
        for piece in data.split(chunk):
            rb.extend(piece)
        rbs[name] = rb
    ours, theirs = rbs["frb"], rbs["torchrl"]
    assert len(ours) == len(theirs) == data.shape[0] - 3
    _same(ours[:], theirs[:], "stored")
    _same(ours.transform[0]._buffer, theirs.transform[0]._buffer, "held back")
    for seed in range(3):
        samples = []
        for rb in (ours, theirs):
            torch.manual_seed(seed)
            samples.append(rb.sample())
        _same(*samples, f"sample {seed}")
    stored = ours[:]
    assert (stored["steps_to_next_obs"] <= 3).all()
    assert (stored["next", "original_reward"] == stored["next", "reward"]).sum() < len(ours)


def test_multistep_transform_changing_n_steps():
    """TorchRL's test_multistep_transform_changes on both buffers: n_steps grows after each
    extend; the stored steps stay contiguous and the transform's buffer holds the last
    step."""
    data = _episodes([100])
    data["next", "done"][:] = False
    data["next", "terminated"][:] = False
    stored = {}
    for name, lib in LIBS.items():
        t = MultiStepTransform(3, 0.98)
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(100), transform=t)
        for piece in data.split(10):
            rb.extend(piece)
            t.n_steps = t.n_steps + 1
            assert (rb[:]["steps"] == torch.arange(len(rb))).all()
            assert rb[:]["next", "steps"][-1] == piece["steps"][-1]
            assert t._buffer["steps"][-1] == piece["steps"][-1]
        stored[name] = rb[:]
    _same(stored["frb"], stored["torchrl"])


@pytest.mark.parametrize("how", ["add", "extend"])
def test_multistep_transform_single_items(how):
    """TorchRL's test_multisteptransform_single_item: transitions written one at a time."""
    stored = {}
    for name, lib in LIBS.items():
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(1000),
            sampler=lib.RandomSampler(),
            transform=MultiStepTransform(n_steps=3, gamma=0.99),
        )
        for i in range(10):
            item = TensorDict(
                {
                    "obs": TensorDict({"observation": torch.full((4,), i)}, []),
                    "action": torch.full((2,), i),
                    "next": TensorDict(
                        {
                            "obs": TensorDict({"observation": torch.full((4,), i)}, []),
                            "done": torch.tensor(False),
                            "reward": torch.tensor(float(i)),
                        },
                        [],
                    ),
                },
                [],
            )
            rb.add(item) if how == "add" else rb.extend(item.unsqueeze(0))
        content = rb[:]
        assert content.shape == (7,)
        assert (content["steps_to_next_obs"] == 3).all()
        assert (content["next", "original_reward"] == torch.arange(7)).all()
        stored[name] = content
    _same(stored["frb"], stored["torchrl"])


# ---------------------------------------------------------------------- PolicyAgeFilter
def _versioned(n, versions):
    return TensorDict(
        {
            "obs": torch.arange(n, dtype=torch.float32)[:, None],
            "policy_version": torch.as_tensor(versions),
        },
        [n],
    )


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyStackStorage"])
def test_policy_age_filter_on_extend_and_sample(storage):
    """Stale data never enters; data that becomes stale after insertion is dropped from
    samples (a smaller batch); the same seed gives the same kept items."""
    version = {"now": 3}
    results = {}
    for name, lib in LIBS.items():
        rb = lib.ReplayBuffer(
            storage=getattr(lib, storage)(100),
            batch_size=6,
            transform=PolicyAgeFilter(lambda: version["now"], max_policy_lag=1),
        )
        version["now"] = 3
        rb.extend(_versioned(6, [0, 2, 2, 3, 1, 3]))
        out = {"len": len(rb)}
        torch.manual_seed(0)
        out["fresh"] = rb.sample()
        version["now"] = 4  # version-2 items are now too old
        torch.manual_seed(1)
        out["aged"] = rb.sample()
        results[name] = out
    ours, theirs = results["frb"], results["torchrl"]
    assert ours["len"] == theirs["len"] == 4
    _same(ours["fresh"], theirs["fresh"], "fresh")
    _same(ours["aged"], theirs["aged"], "aged")
    assert (ours["aged"]["policy_version"] >= 3).all()
    assert ours["aged"].shape[0] < 6


def test_policy_age_filter_rows_and_nested_key():
    """A row is as old as its oldest element; the version may sit under a nested key."""
    results = {}
    for name, lib in LIBS.items():
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(10),
            batch_size=3,
            transform=PolicyAgeFilter(5, max_policy_lag=2, policy_version_key=("meta", "v")),
        )
        data = TensorDict(
            {
                "obs": torch.arange(4.0)[:, None].expand(4, 3),
                ("meta", "v"): torch.tensor([[5, 5, 5], [5, 2, 5], [4, 3, 3], [1, 5, 5]]),
            },
            [4],
        )
        rb.extend(data)
        results[name] = rb[:]
    _same(results["frb"], results["torchrl"])
    assert results["frb"]["obs"][:, 0].tolist() == [0.0, 2.0]


# ---------------------------------------------------------------------- CatFrames
@pytest.mark.parametrize("done_key", [None, "truncated"])
@pytest.mark.parametrize("sampler", ["SliceSampler", "SliceSamplerWithoutReplacement"])
def test_catframes_appended_to_slice_buffers(sampler, done_key):
    """CatFrames(N=3) appended with append_transform: the same slices (seeded) with the same
    stacked frames, with or without done_key="truncated" (read under "next"; the slice
    samplers mark slice ends truncated), an epoch's short last batch included."""
    data = _episodes([10, 12, 8, 14, 6])
    samples = {}
    for name, lib in LIBS.items():
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(100),
            sampler=getattr(lib, sampler)(slice_len=5),
            batch_size=20,
        )
        rb.append_transform(
            CatFrames(N=3, dim=-1, in_keys=["obs", ("next", "obs")], done_key=done_key)
        )
        rb.extend(data)
        torch.manual_seed(0)
        samples[name] = [rb.sample() for _ in range(3)]
    for i, (ours, theirs) in enumerate(zip(samples["frb"], samples["torchrl"])):
        _same(ours.exclude("index"), theirs.exclude("index"), f"sample {i}")
    first = samples["frb"][0]
    assert first["obs"].shape == (20, 6)
    # within a slice the newest frame of each stack is the step's own observation
    assert (first["obs"][:, 4] == first["steps"].float()).all()


def test_catframes_random_sampler_and_inverse_path():
    """CatFrames on a uniform buffer (stacks mix neighbours, as TorchRL's do) and as an
    inverse transform (stacks built at extend, so the stored items hold them)."""
    data = _episodes([9, 7, 8])
    results = {}
    for name, lib in LIBS.items():
        rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(50), batch_size=10)
        rb.append_transform(CatFrames(N=2, dim=-1, in_keys=["obs"]))
        rb.extend(data)
        torch.manual_seed(3)
        forward = rb.sample()
        inv = lib.ReplayBuffer(storage=lib.LazyTensorStorage(50))
        inv.append_transform(
            CatFrames(
                N=3, dim=-1, in_keys=["obs"], out_keys=["stack"], as_inverse=True, done_key="done"
            )
        )
        inv.extend(data.unsqueeze(0))
        results[name] = (forward, inv[:])
    _same(results["frb"][0].exclude("index"), results["torchrl"][0].exclude("index"), "fwd")
    _same(results["frb"][1], results["torchrl"][1], "inverse")


# ---------------------------------------------------------------------- MultiStep
def _two_env_rollout(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(2, steps, 1, generator=g) < 0.2
    ids = torch.cumsum(done.squeeze(-1).long(), 1) + 10 * torch.arange(2)[:, None]
    return TensorDict(
        {
            "obs": torch.randn(2, steps, 3, generator=g),
            ("collector", "traj_ids"): ids,
            "next": {
                "obs": torch.randn(2, steps, 3, generator=g),
                "reward": torch.randn(2, steps, 1, generator=g),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros_like(done),
            },
        },
        [2, steps],
    )


def test_multistep_postproc_appended_after_split_trajectories():
    """TorchRL's test_rb_multidim_collector pattern: ``split_trajectories`` then ``MultiStep``
    appended to a slice-sampled ``ndim=2`` buffer, each library with its own MultiStep: the
    same seeded [slices, steps] samples; a TensorDictReplayBuffer cannot write its metadata
    into the reshaped sample and says so with TorchRL's error."""
    samples = {}
    for name, lib in LIBS.items():
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(40, ndim=2),
            sampler=lib.SliceSampler(num_slices=2),
            batch_size=8,
        )
        rb.append_transform(split_trajectories)
        rb.append_transform(lib.MultiStep(gamma=0.9, n_steps=3))
        rb.extend(_two_env_rollout(10))
        torch.manual_seed(0)
        samples[name] = [rb.sample() for _ in range(3)]
        td_rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(40, ndim=2),
            sampler=lib.SliceSampler(num_slices=2),
            batch_size=8,
        )
        td_rb.append_transform(split_trajectories)
        td_rb.append_transform(lib.MultiStep(gamma=0.9, n_steps=3))
        td_rb.extend(_two_env_rollout(10))
        with pytest.raises(RuntimeError, match="Failed to set the metadata"):
            td_rb.sample()
    for i, (ours, theirs) in enumerate(zip(samples["frb"], samples["torchrl"])):
        assert ours.ndim == 2
        assert set(ours.keys(True, True)) == set(theirs.keys(True, True)), i
        for key in theirs.keys(True, True):
            torch.testing.assert_close(ours.get(key), theirs.get(key), msg=str(key))
