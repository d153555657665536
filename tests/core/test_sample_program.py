"""The compiled ``sample``: the drawn indices are computed once and held in a buffer, not
recomputed inside each leaf's read (``functional_rb._internal.jit.settled``)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _users_hlo import users_hlo

import functional_rb as frb
from functional_rb._internal.jit import settled

ITEM = {
    "a": jnp.zeros((3,), jnp.float32),
    "b": jnp.int8(0),
    "c": jnp.bool_(False),
    "d": jnp.zeros((2,), jnp.int32),
}
TED_ITEM = {
    "obs": jnp.zeros((4,)),
    "action": jnp.int32(0),
    "next": {"obs": jnp.zeros((4,)), "reward": jnp.float32(0), "done": jnp.bool_(False)},
}


def _key_users(rb, item) -> int:
    """Instructions of the compiled sample's entry computation that read the (raw) key."""
    state = rb.init(item)
    batch = jax.tree_util.tree_map(lambda x: jnp.zeros((300,) + x.shape, x.dtype), item)
    state = rb.add(state, batch)
    sample = jax.jit(lambda s, k: rb.sample(s, k)[0].data)
    hlo = users_hlo(sample, state, jax.random.PRNGKey(0))
    entry = hlo[hlo.index("\nENTRY") :]
    lines = entry[: entry.index("\n}")].splitlines()[1:]
    (name,) = [
        m.group(1) for line in lines if (m := re.search(r"%(\S+) = u32\[2\]\{0\} parameter", line))
    ]
    pattern = re.compile("%" + re.escape(name) + r"[,)]")
    return sum(1 for line in lines if "parameter(" not in line and pattern.search(line))


@pytest.mark.parametrize(
    "storage,item",
    [(frb.DeviceStorage(), ITEM), (frb.TEDStorage(), TED_ITEM)],
    ids=["DeviceStorage", "TEDStorage"],
)
def test_the_draw_is_computed_once_not_in_every_leaf_read(storage, item):
    """Without the boundary XLA copied the draw (hash, modulo) into the gather of each leaf:
    4 readers of the key for these four leaves, 6 for TED's; their loops then kept far fewer
    cache misses in flight (TED's read of 256 rows of 10^8: 130 us a call against 51)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the boundary is the CPU's (a conditional elsewhere waits on the host)")
    rb = frb.ReplayBuffer(
        capacity=1000, sampler=frb.RandomSampler(), batch_size=64, storage=storage
    )
    assert _key_users(rb, item) == 1


def test_settled_keeps_values_and_zeroes_where_false():
    tree = {"i": jnp.arange(4, dtype=jnp.int32), "f": jnp.ones((2, 2))}
    for fn in (settled, jax.jit(settled)):
        kept = fn(tree, jnp.bool_(True))
        zero = fn(tree, jnp.bool_(False))
        assert np.array_equal(kept["i"], tree["i"]) and np.array_equal(kept["f"], tree["f"])
        assert not np.asarray(zero["i"]).any() and not np.asarray(zero["f"]).any()
    # under vmap with a batched predicate (the cond becomes a select)
    out = jax.vmap(settled)(jnp.arange(6).reshape(2, 3), jnp.array([True, False]))
    assert out.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_sample_under_jit_when_nothing_can_be_sampled_reads_slot_0():
    """The documented result under jit for a buffer that cannot sample: mask False, weights
    0, indices 0."""
    rb = frb.ReplayBuffer(capacity=8, sampler=frb.RandomSampler(), batch_size=4)
    state = rb.init({"x": jnp.float32(0)})
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert not np.asarray(s.mask).any() and not np.asarray(s.weights).any()
    assert np.asarray(s.indices).tolist() == [0, 0, 0, 0]
