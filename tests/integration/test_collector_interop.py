"""Data shaped like TorchRL collectors' output works with slice sampling (core and adapters).

As in TorchRL's "Collectors and Replay Buffers" guide: a collector over several envs yields
``[num_envs, T]`` batches with ``("collector", "traj_ids")`` (a unique id per episode, per env),
stored flat (``data.reshape(-1)``) or as ``[batch, time]``; ``SliceSampler(traj_key=
("collector", "traj_ids"))`` draws contiguous sub-trajectories. Both the core sampler and
TorchRL's must draw only slices inside one trajectory, and the same set of slices must be
possible (every start of a window of ``slice_len`` steps inside a trajectory; none in
trajectories shorter than ``slice_len`` with ``strict_length=True``). The adapters' buffers
are used exactly as the guide uses TorchRL's (including its ``strict_length=False``,
``truncated_key=None`` variant) and compared with TorchRL's on the same data.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
trl = pytest.importorskip("torchrl.data")

from functional_rb.adapters.dlpack import tensordict_to_pytree  # noqa: E402

NUM_ENVS, T, SLICE_LEN = 3, 12, 3
TRAJ_KEY = ("collector", "traj_ids")
# episode lengths per env (the last one is cut by the end of the batch, as in a collector)
EPISODES = [[5, 2, 5], [4, 8], [12]]


def _collector_batch():
    """A [num_envs, T] TensorDict like a multi-env collector's output."""
    traj_ids = np.zeros((NUM_ENVS, T), np.int64)
    done = np.zeros((NUM_ENVS, T, 1), bool)
    next_id = 0
    for env, lengths in enumerate(EPISODES):
        t0 = 0
        for length in lengths:
            traj_ids[env, t0 : t0 + length] = next_id
            if t0 + length < T or length == T:
                done[env, t0 + length - 1] = t0 + length < T  # the last one is truncated
            next_id += 1
            t0 += length
        assert t0 == T
    env = np.broadcast_to(np.arange(NUM_ENVS)[:, None], (NUM_ENVS, T))
    step = np.broadcast_to(np.arange(T)[None, :], (NUM_ENVS, T))
    return tensordict.TensorDict(
        {
            "observation": torch.as_tensor(env * 100.0 + step, dtype=torch.float32)[..., None],
            "env": torch.as_tensor(env.copy(), dtype=torch.int32),
            "step": torch.as_tensor(step.copy(), dtype=torch.int32),
            "collector": {"traj_ids": torch.as_tensor(traj_ids)},
            "next": {
                "done": torch.as_tensor(done),
                "truncated": torch.zeros(NUM_ENVS, T, 1, dtype=torch.bool),
            },
        },
        batch_size=[NUM_ENVS, T],
    )


def _possible_starts():
    """{(env, step)} where a window of SLICE_LEN steps fits inside one trajectory."""
    starts = set()
    for env, lengths in enumerate(EPISODES):
        t0 = 0
        for length in lengths:
            starts |= {(env, t0 + s) for s in range(length - SLICE_LEN + 1)}
            t0 += length
    return starts


def _check_slices(env, step, traj):
    """env/step/traj: [num_slices, SLICE_LEN] -> set of (env, start); asserts each slice is
    contiguous and inside one trajectory."""
    env, step, traj = (np.asarray(x) for x in (env, step, traj))
    assert (env == env[:, :1]).all(), "a slice crosses environments"
    assert (traj == traj[:, :1]).all(), "a slice crosses a trajectory boundary"
    np.testing.assert_array_equal(np.diff(step, axis=1), 1)
    return {(int(e), int(s)) for e, s in zip(env[:, 0], step[:, 0])}


@pytest.mark.parametrize("ndim", [1, 2], ids=["flat", "batch_time"])
def test_torchrl_slice_sampler_reference(ndim):
    """The reference: TorchRL's SliceSampler on the same data draws exactly the possible slices."""
    data = _collector_batch()
    torch.manual_seed(0)
    storage = trl.LazyTensorStorage(NUM_ENVS * T, ndim=ndim)
    rb = trl.TensorDictReplayBuffer(
        storage=storage,
        sampler=trl.SliceSampler(slice_len=SLICE_LEN, traj_key=TRAJ_KEY),
        batch_size=SLICE_LEN * 400,
    )
    rb.extend(data.reshape(-1) if ndim == 1 else data)
    s = rb.sample().reshape(-1, SLICE_LEN)
    starts = _check_slices(s["env"], s["step"], s[TRAJ_KEY])
    assert starts == _possible_starts()


def _core_sampler():
    return frb.SliceSampler(slice_len=SLICE_LEN, traj_key=TRAJ_KEY)


@pytest.mark.parametrize("ndim", [1, 2], ids=["flat", "batch_time"])
def test_core_slice_sampler_on_collector_data(ndim):
    sampler = _core_sampler()
    data = _collector_batch()
    tree = tensordict_to_pytree(data.reshape(-1) if ndim == 1 else data)  # DLPack, no copy
    rb = frb.ReplayBuffer(
        capacity=NUM_ENVS * T, sampler=sampler, ndim=ndim, batch_size=SLICE_LEN * 400
    )
    example = jax.tree_util.tree_map(lambda x: x[0] if ndim == 1 else x[:, 0], tree)
    state = rb.add(rb.init(example), tree)
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert sample.mask.shape == (400, SLICE_LEN) and bool(sample.mask.all())
    d = sample.data
    assert d["step"].shape == (400, SLICE_LEN)
    starts = _check_slices(d["env"], d["step"], d["collector"]["traj_ids"])
    assert starts == _possible_starts()  # the same slices TorchRL can draw; nothing else
    # the stored copy is the collector's data: indices point at the sampled rows
    flat = np.asarray(sample.indices)
    got_obs = np.asarray(d["observation"])[..., 0]
    np.testing.assert_array_equal(got_obs, np.asarray(d["env"]) * 100.0 + np.asarray(d["step"]))
    assert flat.shape == (400, SLICE_LEN)


def test_core_slice_sampler_on_collector_stream():
    """Collector batches arriving one after another (ring of 2 batches, flat storage)."""
    sampler = _core_sampler()
    data = _collector_batch()
    rb = frb.ReplayBuffer(capacity=2 * NUM_ENVS * T, sampler=sampler, batch_size=SLICE_LEN * 200)
    tree = tensordict_to_pytree(data.reshape(-1))
    state = rb.init(jax.tree_util.tree_map(lambda x: x[0], tree))
    add = jax.jit(rb.add)
    for i in range(3):  # the third batch overwrites the first; traj ids keep growing
        batch = jax.tree_util.tree_map(lambda x: x, tree)
        batch["collector"]["traj_ids"] = tree["collector"]["traj_ids"] + jnp.int32(100 * i)
        state = add(state, batch)
    sample, _ = jax.jit(rb.sample)(state, jax.random.key(1))
    d = sample.data
    assert bool(sample.mask.all())
    _check_slices(d["env"], d["step"], d["collector"]["traj_ids"])
    assert set(np.unique(np.asarray(d["collector"]["traj_ids"]) // 100)) <= {1, 2}


# ---------------------------------------------------------------------- through the adapters
# What a TorchRL user writes (the guide's code with functional_rb.adapters in place of
# torchrl.data): extend with the collector's TensorDict, flat or [batch, time] in an ndim=2
# storage, and sample slices by ("collector", "traj_ids").


@pytest.mark.parametrize("ndim", [1, 2], ids=["flat", "batch_time"])
def test_adapter_slice_sampler_on_collector_data(ndim):
    A = pytest.importorskip("functional_rb.adapters")
    data = _collector_batch()
    torch.manual_seed(0)
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(NUM_ENVS * T, ndim=ndim),
        sampler=A.SliceSampler(slice_len=SLICE_LEN, traj_key=TRAJ_KEY),
        batch_size=SLICE_LEN * 400,
    )
    index = rb.extend(data.reshape(-1) if ndim == 1 else data)
    assert index.shape == ((NUM_ENVS * T,) if ndim == 1 else (NUM_ENVS * T, 2))
    s = rb.sample().reshape(-1, SLICE_LEN)
    starts = _check_slices(s["env"], s["step"], s[TRAJ_KEY])
    assert starts == _possible_starts()  # the same slices TorchRL's sampler draws
    assert bool(s["next", "truncated"][:, -1].all()) and not s["next", "truncated"][:, :-1].any()
    # the guide's loose variant (truncated_key=None, strict_length=False): runs like TorchRL's
    for truncated_key in (None, ("next", "truncated")):
        bufs = [
            lib.TensorDictReplayBuffer(
                storage=lib.LazyTensorStorage(NUM_ENVS * T, ndim=ndim),
                sampler=lib.SliceSampler(
                    num_slices=8,
                    traj_key=TRAJ_KEY,
                    truncated_key=truncated_key,
                    strict_length=False,
                ),
                batch_size=64,
            )
            for lib in (A, trl)
        ]
        for b in bufs:
            b.extend(data.reshape(-1) if ndim == 1 else data)
        ours, theirs = (b.sample() for b in bufs)
        assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
        assert ours["index"].shape[1:] == theirs["index"].shape[1:]
        assert ours.batch_size[0] <= 64
        env, step = ours["env"].long(), ours["step"].long()
        flat = data.reshape(-1)  # every returned row is the stored step it claims to be
        assert torch.equal(ours[TRAJ_KEY], flat[TRAJ_KEY][env * T + step])
        if truncated_key is None:
            continue
        # slices end where "truncated" is set: each is contiguous inside one trajectory, at
        # most slice_len long, and trajectories shorter than slice_len are drawn too
        ends = torch.nonzero(ours["next", "truncated"].reshape(-1)).reshape(-1) + 1
        pieces = torch.tensor_split(torch.arange(ours.batch_size[0]), ends[:-1])
        assert int(ends[-1]) == ours.batch_size[0] and len(pieces) == 8
        for piece in pieces:
            assert 1 <= len(piece) <= 8
            _check_slices(env[piece][None], step[piece][None], ours[TRAJ_KEY][piece][None])
        lengths = {len(p) for p in pieces}
        assert lengths != {8}, "strict_length=False should also draw short trajectories"
