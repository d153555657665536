"""ShardedReplayBuffer as a JAX program: created sharded, jitted once, updated in place; the
per-shard calls inside one's own shard_map (shard_map's vma checks on) and pmap; errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shards import CAP, EXAMPLE, PRIO, UNIFORM, WOR, build, draws, mesh, unstack
from _users_hlo import users_hlo
from jax.sharding import PartitionSpec as P

import functional_rb as frb

N, B = 4, PRIO.batch_size


def _items(step, n=N, b=5):
    return {"id": np.arange(n * b, dtype=np.int32) + step * n * b}


def test_state_is_created_sharded_one_shard_per_device():
    srb = frb.ShardedReplayBuffer(PRIO, mesh(N))
    state = srb.init(EXAMPLE)
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.shape[0] == N
        assert leaf.sharding.spec[0] == "data"
        shards = leaf.addressable_shards
        assert len(shards) == N and {s.device for s in shards} == set(jax.devices()[:N])
        assert all(s.data.shape == (1,) + leaf.shape[1:] for s in shards)
    assert srb.capacity == N * CAP
    state = srb.add(state, _items(0))
    assert int(srb.size(state)) == N * 5 and bool(srb.can_sample(state))
    # device d wrote block d of the items into its own shard
    ids = np.asarray(state.shards.storage.slabs["int32"])[:, :5, 0]
    np.testing.assert_array_equal(ids, np.arange(N * 5).reshape(N, 5))


def test_jitted_steps_trace_once_and_update_in_place():
    srb = frb.ShardedReplayBuffer(PRIO, mesh(N))
    traces = {"add": 0, "sample": 0, "update": 0}

    def counted(name, fn):
        def wrapped(*args):
            traces[name] += 1
            return fn(*args)

        return jax.jit(wrapped, donate_argnums=0)

    add, sample = counted("add", srb.add), counted("sample", srb.sample)
    update = counted("update", srb.update)
    state = srb.init(EXAMPLE)
    for step in range(6):  # wraps around (6 * 5 > CAP); beta annealed as a traced value
        state = add(state, _items(step))
        smp, state = sample(state, jax.random.key(step))
        state = update(state, smp.indices, smp.data["id"].astype(jnp.float32) + 1.0)
    assert traces == {"add": 1, "sample": 1, "update": 1}
    # donated: XLA aliases the state's buffers to the outputs and copies no storage-sized array
    for fn, args in (
        (add, (state, _items(0))),
        (sample, (state, jax.random.key(0))),
        (update, (state, smp.indices, jnp.ones(N * B))),
    ):
        hlo = users_hlo(fn, *args)  # (the programs the loop ran)
        assert "input_output_alias" in hlo
        copies = [ln for ln in hlo.splitlines() if " copy(" in ln and f"[1,{CAP}" in ln]
        assert not copies, copies[:3]


@functools.cache
def _anakin(srb, check_vma):
    """A learner step written as in the Anakin pattern: one's own shard_map, the per-shard
    calls with axis_name."""
    rb = srb.buffer

    def step(block, items, key):
        local = rb.add(srb.local(block), items)
        smp, local = rb.sample(local, key, axis_name="data")
        local = rb.update(local, smp.indices, smp.data["id"] + 1.0, axis_name="data")
        size = rb.size(local, axis_name="data")
        ok = rb.can_sample(local, axis_name="data")
        return srb.block(local), smp, size, ok

    return jax.jit(
        jax.shard_map(
            step,
            mesh=srb.mesh,
            check_vma=check_vma,
            in_specs=(P("data"), P("data"), P()),
            out_specs=(P("data"), P("data"), P(), P()),
        )
    )


@pytest.mark.parametrize(
    "rb",
    [
        PRIO,
        WOR,
        pytest.param(
            frb.ReplayBuffer(
                CAP, sampler=frb.SliceSampler(slice_len=2, end_key="done"), batch_size=8
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["prioritized", "without-replacement", "slices"],
)
def test_per_shard_calls_in_a_checked_shard_map_match_the_sharded_buffer(rb):
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    slices = isinstance(rb.sampler, frb.SliceSampler)
    example = dict(EXAMPLE, done=np.bool_(False)) if slices else EXAMPLE
    items = dict(_items(0), done=np.arange(N * 5) % 3 == 2) if slices else _items(0)
    items = jax.device_put(items, srb.sharding)
    state = srb.init(example)
    # with shard_map's varying-axes checks on, as users write it
    block, smp, size, ok = _anakin(srb, True)(state, items, jax.random.key(3))
    assert int(size) == N * 5 and bool(ok)
    # the same draw as the ShardedReplayBuffer's (its shard_map runs the same calls)
    ref_state = srb.add(state, items)
    ref, _ = srb.sample(ref_state, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(smp.indices), np.asarray(ref.indices))
    np.testing.assert_array_equal(np.asarray(smp.data["id"]), np.asarray(ref.data["id"]))
    np.testing.assert_array_equal(
        np.asarray(smp.data["id"]),
        np.asarray(smp.indices) // CAP * 5 + np.asarray(smp.indices) % CAP,
    )


def test_pmap_over_state_shards():
    """With jax.pmap over ``state.shards``: a global draw (``axis_name=``) and a local one
    (``frb.sharded.sample``) are the ShardedReplayBuffer's."""
    srb = frb.ShardedReplayBuffer(PRIO, mesh(N))
    state = srb.add(srb.init(EXAMPLE), _items(0))
    keys = jnp.stack([jax.random.key_data(jax.random.key(5))] * N)

    def both(s, k):
        k = jax.random.wrap_key_data(k)
        glob, _ = PRIO.sample(s, k, axis_name="data")
        loc, _ = frb.sharded.sample(PRIO, s, k, axis_name="data", sampling="local")
        return glob, loc

    glob, loc = jax.pmap(both, axis_name="data", devices=jax.devices()[:N])(state.shards, keys)
    for got, mode in ((glob, "global"), (loc, "local")):
        ref, _ = frb.ShardedReplayBuffer(PRIO, mesh(N), sampling=mode).sample(
            state, jax.random.key(5)
        )
        np.testing.assert_array_equal(np.asarray(got.indices).reshape(-1), np.asarray(ref.indices))
        np.testing.assert_allclose(
            np.asarray(got.weights).reshape(-1), np.asarray(ref.weights), rtol=1e-6
        )
    # local: device d's rows are its own shard's
    np.testing.assert_array_equal(
        np.asarray(loc.indices) // CAP, np.repeat(np.arange(N)[:, None], B, 1)
    )


def test_skewed_shards_need_several_rounds_and_stay_exact():
    """One shard holds most of the items: the pairs with it exceed one round's capacity, so
    further all-to-all rounds run; every row is still the stored item of its index, uniform
    over all stored items."""
    from scipy import stats

    srb = frb.ShardedReplayBuffer(UNIFORM, mesh(8))  # (as in the distribution tests)
    state = build(srb, [np.arange(CAP), [CAP], [2 * CAP]] + [[]] * 5)
    out, _ = draws(srb, state, steps=20)
    np.testing.assert_array_equal(out.data["id"], out.indices)
    assert out.mask.all()
    ids, counts = np.unique(out.indices, return_counts=True)
    assert set(ids.tolist()) == set(range(CAP + 1)) | {2 * CAP}
    assert stats.chisquare(counts).pvalue > 1e-3


def test_errors_name_the_problem():
    srb = frb.ShardedReplayBuffer(PRIO, mesh(N))
    state = srb.init(EXAMPLE)
    with pytest.raises(ValueError, match="nothing can be sampled yet"):
        srb.sample(state, jax.random.key(0))
    smp, _ = jax.jit(srb.sample)(state, jax.random.key(0))  # under jit: masked, zero weights
    assert not np.asarray(smp.mask).any() and not np.asarray(smp.weights).any()
    with pytest.raises(ValueError, match=r"leaf \['id'\] has shape \(6,\).*multiple of the 4"):
        srb.add(state, {"id": np.zeros(6, np.int32)})
    state = srb.add(state, _items(0))
    with pytest.raises(ValueError, match=r"indices\[1\] = 64 is outside \[0, 64\)"):
        srb.update(state, np.array([0, 64, 1, 2] * N), np.ones(4 * N))
    with pytest.raises(ValueError, match="not a finite number"):
        srb.update(state, np.arange(4 * N), np.full(4 * N, np.nan))
    with pytest.raises(TypeError, match="ShardedState"):
        srb.size(state.shards)
    with pytest.raises(ValueError, match="4 shards along 'data'; this buffer has 2"):
        frb.ShardedReplayBuffer(PRIO, mesh(2)).size(state)
    local = jax.tree_util.tree_map(jnp.asarray, unstack(state)[0])
    with pytest.raises(NameError, match="axis_name='data' is not a bound mesh axis"):
        PRIO.sample(local, jax.random.key(0), axis_name="data")
    with pytest.raises(ValueError, match="MemmapStorage"):
        frb.ShardedReplayBuffer(frb.ReplayBuffer(8, storage=frb.MemmapStorage("/tmp/x")), mesh(N))
    with pytest.raises(ValueError, match="axes \\('data',\\), not axis_name='env'"):
        frb.ShardedReplayBuffer(PRIO, mesh(N), axis_name="env")

    class Mine(frb.RandomSampler):
        pass

    frb.ShardedReplayBuffer(frb.ReplayBuffer(8, sampler=Mine()), mesh(N))  # a subclass: fine

    class Other(frb.protocol.Sampler):
        def init(self, item_spec, layout):
            return ()

        def sample(self, state, key, batch_size, ctx):
            raise NotImplementedError

    with pytest.raises(TypeError, match="cannot draw over shards.*register"):
        frb.ShardedReplayBuffer(frb.ReplayBuffer(8, sampler=Other()), mesh(N))


def test_rate_limiter_counts_all_shards():
    limiter = frb.RateLimiter(samples_per_insert=2.0, min_size_to_sample=8, error_buffer=(-40, 20))
    b = 8
    rb = frb.ReplayBuffer(CAP, batch_size=b, rate_limiter=limiter)
    with pytest.raises(ValueError, match="narrower than one sample batch"):
        frb.ShardedReplayBuffer(rb, mesh(8))  # 8 devices x 8 rows do not fit the window
    srb = frb.ShardedReplayBuffer(rb, mesh(N))
    state = srb.init(EXAMPLE)
    assert bool(srb.can_insert(state, 2)) and not bool(srb.can_sample(state))
    state = srb.add(state, _items(0, b=2))  # 8 items in all: min_size_to_sample reached
    assert bool(srb.can_sample(state))  # error 8 * 2 - 32 = -16 >= -40
    _, state = srb.sample(state, jax.random.key(0))
    assert np.asarray(state.shards.limiter.samples).tolist() == [b] * N  # each its own batch
    assert np.asarray(state.shards.limiter.inserts).tolist() == [2] * N
    # another global batch of 32 would bring the error to -48 < -40
    assert not bool(srb.can_sample(state))
    # 4 more per shard: (8 + 16) * 2 - 32 = 16 <= 20; 5 more: 24 > 20
    assert bool(srb.can_insert(state, 4)) and not bool(srb.can_insert(state, 5))
