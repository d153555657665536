"""Property tests: after any sequence of adds (some shards only, so fills are unequal, and
wrapping around), updates (duplicates, empty slots) and samples, a sharded prioritized buffer is
the single buffer holding the union of its shards: the same items, the same priorities (the last
occurrence of an index in the global order wins; new items get the global maximum), samples
whose rows are stored items with the single buffer's weights. Run eagerly and under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _shards import CAP, PRIO, mesh, unstack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import functional_rb as frb

N, PER_ADD = 4, 5
RB = PRIO  # (the configuration other tests compile too)
B, BETA = RB.batch_size, RB.sampler.beta
PRIORITIES = (0.0, 0.25, 1.0, 2.0, 5.0)  # (1.0: max_priority_init)
# the stored value of each priority, by the sampler's own rule (computed once)
_VALUES = dict(
    zip(
        PRIORITIES,
        np.asarray(RB.sampler.prioritization.value(np.array(PRIORITIES, np.float32), CAP)).tolist(),
    )
)


def VALUE(p):
    return _VALUES[float(p)]


@functools.cache
def _add_some(srb):
    """Shards ``< k`` (k traced) add their block of items; the others add nothing: an add of
    the per-shard API inside one's own shard_map (actors that did not act this step)."""

    def body(block, items, k):
        local = srb.local(block)
        me = jax.lax.axis_index(srb.axis_name)
        new = jax.lax.cond(me < k, lambda s: RB.add(s, items), lambda s: s, local)
        return srb.block(new)

    return jax.jit(
        jax.shard_map(
            body, mesh=srb.mesh, in_specs=(P("data"), P("data"), P()), out_specs=P("data")
        )
    )


class Reference:
    """One buffer holding the union: per-shard rings of ids, one priority per global index."""

    def __init__(self):
        self.ids = np.full((N, CAP), -1)
        self.cursor = np.zeros(N, int)
        self.filled = np.zeros(N, int)
        self.prio = {}
        self.max_p = 1.0

    def add(self, k, ids):
        for s in range(k):
            for i in ids[s]:
                pos = self.cursor[s]
                self.ids[s, pos] = i
                self.prio[s * CAP + pos] = self.max_p
                self.cursor[s] = (pos + 1) % CAP
                self.filled[s] = min(self.filled[s] + 1, CAP)

    def update(self, indices, priorities):
        for g, p in zip(indices, priorities):
            s, pos = divmod(int(g), CAP)
            if pos < self.filled[s]:
                self.prio[g] = float(p)
                self.max_p = max(self.max_p, float(p))

    def stored(self):
        return [s * CAP + p for s in range(N) for p in range(self.filled[s])]


def _check(srb, state, ref):
    assert int(srb.size(state)) == sum(ref.filled)
    for s, local in enumerate(unstack(state)):
        f = ref.filled[s]
        assert int(local.writer.filled) == f
        ids = np.asarray(local.storage.slabs["int32"])[:, 0]  # the packed "id" column
        np.testing.assert_array_equal(ids[:f], ref.ids[s, :f])
        want = np.zeros(CAP, np.float32)
        for p in range(f):
            want[p] = VALUE(ref.prio[s * CAP + p])
        np.testing.assert_allclose(np.asarray(local.sampler.tree.values)[:CAP], want, rtol=1e-6)
        np.testing.assert_allclose(float(local.sampler.max_priority), ref.max_p, rtol=1e-6)


def _check_sample(smp, ref):
    smp = jax.tree_util.tree_map(np.asarray, smp)
    stored = set(ref.stored())
    assert smp.indices.shape == (N * B,)
    if not stored:
        assert not smp.mask.any() and not smp.weights.any()
        return
    assert smp.mask.all()
    assert set(smp.indices.tolist()) <= stored
    np.testing.assert_array_equal(smp.data["id"], [ref.ids[g // CAP, g % CAP] for g in smp.indices])
    vmin = min(VALUE(ref.prio[g]) for g in stored)
    np.testing.assert_allclose(
        smp.weights, [(vmin / VALUE(ref.prio[g])) ** BETA for g in smp.indices], rtol=1e-5
    )


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, N)),
        st.tuples(
            st.just("update"),
            st.lists(st.integers(0, N * CAP - 1), min_size=N * B, max_size=N * B),
            st.lists(st.sampled_from(PRIORITIES), min_size=N * B, max_size=N * B),
        ),
        st.tuples(st.just("sample"), st.integers(0, 2**16)),
    ),
    min_size=1,
    max_size=6,
)


@functools.cache
def _calls(jitted: bool):
    """``(srb, sample, update)``, made once per mode: a new ``jax.jit`` of a bound method for
    every hypothesis example would compile again each time."""
    srb = frb.ShardedReplayBuffer(RB, mesh(N))
    if not jitted:
        return srb, srb.sample, srb.update
    return srb, jax.jit(srb.sample, donate_argnums=0), jax.jit(srb.update, donate_argnums=0)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # maybe_jit is stateless
@given(ops=OPS)
def test_sharded_prioritized_buffer_is_one_buffer(maybe_jit, ops):
    srb, sample, update = _calls(maybe_jit is jax.jit)
    state = srb.init({"id": jnp.int32(0)})
    ref = Reference()
    next_id = 0
    for op in ops:
        if op[0] == "add":
            k = op[1]
            ids = np.arange(next_id, next_id + N * PER_ADD).reshape(N, PER_ADD)
            next_id += N * PER_ADD
            items = jax.device_put({"id": ids.reshape(-1).astype(np.int32)}, srb.sharding)
            state = _add_some(srb)(state, items, k)
            ref.add(k, ids)
        elif op[0] == "update":
            idx, pri = np.array(op[1], np.int32), np.array(op[2], np.float32)
            state = update(state, idx, pri)
            ref.update(idx, pri)
        elif sum(ref.filled):
            smp, state = sample(state, jax.random.key(op[1]))
            _check_sample(smp, ref)
        _check(srb, state, ref)
    if not sum(ref.filled):
        smp, _ = _calls(True)[1](state, jax.random.key(0))  # under jit: masked, never raises
        _check_sample(smp, ref)
