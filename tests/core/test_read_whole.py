"""Small reads of large arrays run whole on the CPU (``functional_rb._internal.jit.read_whole``):
the values of a plain read whichever branch runs, and no split gather on the path a buffer's
calls take."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _users_hlo import users_hlo
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb._internal.jit import SPLIT_BYTES, read_whole

ROWS = 2 * SPLIT_BYTES // 16  # a [ROWS, 4] float32 source is twice XLA's split threshold
SOURCE = jnp.arange(ROWS * 4, dtype=jnp.float32).reshape(ROWS, 4)


def _read(x, i):
    return read_whole(lambda: x[jnp.clip(i, 0, x.shape[0] - 1)], x, i)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-5, ROWS + 5), min_size=1, max_size=40))
def test_the_values_are_those_of_the_plain_read_for_any_index(raw):
    """Negative first indices take the cond's other branch: the same values."""
    i = jnp.asarray(raw, jnp.int32)
    want = np.asarray(SOURCE)[np.clip(raw, 0, ROWS - 1)]
    assert np.array_equal(_read(SOURCE, i), want)
    assert np.array_equal(jax.jit(_read)(SOURCE, i), want)


def test_under_vmap_with_a_batched_index():
    i = jnp.array([[3, 7], [-1, ROWS - 1], [ROWS + 9, 0]], jnp.int32)
    out = jax.vmap(_read, in_axes=(None, 0))(SOURCE, i)
    assert np.array_equal(out, np.asarray(SOURCE)[np.clip(np.asarray(i), 0, ROWS - 1)])


def _split_reads(hlo: str) -> list[str]:
    """Names of the split kernels that read with a gather or a dynamic slice, outside the
    false branch of a conditional (read_whole's plain fallback, the samplers' exact ones)."""
    bodies = dict(re.findall(r"\n%(\S+) \([^\n]*\{\n(.*?)\n\}", hlo, re.S))
    out = []
    for line in hlo.splitlines():
        if "outer_dimension_partitions" not in line:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        name = op.group(1) if op else line.strip()[:80]
        called = re.search(r"calls=%([\w.-]+)", line)
        body = bodies.get(called.group(1), "") if called else ""
        if "branch_0_fun" not in name and re.search(r" (gather|dynamic-slice)\(", body):
            out.append(name)
    return out


def test_a_plain_gather_of_a_large_array_is_split_where_there_are_two_cpus():
    """What the tests below guard against, seen on this machine (skipped where XLA splits
    nothing: one CPU)."""
    if jax.default_backend() != "cpu" or _cpus() < 2:
        pytest.skip("XLA's CPU backend splits kernels only with two or more CPUs")
    i = jnp.zeros((256,), jnp.int32)
    plain = users_hlo(jax.jit(lambda x, i: x[jnp.clip(i, 0, ROWS - 1)]), SOURCE, i)
    assert _split_reads(plain), "the premise: XLA splits a plain gather of a large array"
    assert not _split_reads(users_hlo(jax.jit(_read), SOURCE, i))


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


CAPACITY = 200_000  # every buffer array here is over the split threshold
SMALL = {"obs": jnp.zeros((4,)), "action": jnp.float32(0), "reward": jnp.float32(0)}
TED_ITEM = {
    "obs": jnp.zeros((4,)),
    "action": jnp.float32(0),
    "next": {"obs": jnp.zeros((4,)), "reward": jnp.float32(0), "done": jnp.bool_(False)},
}
SLICE_ITEM = {"obs": jnp.zeros((8,), jnp.uint8), "next": {"done": jnp.bool_(False)}}


def _buffers():
    yield "uniform", frb.ReplayBuffer(capacity=CAPACITY, batch_size=256), SMALL
    yield (
        "prioritized",
        frb.ReplayBuffer(capacity=CAPACITY, batch_size=256, sampler=frb.PrioritizedSampler()),
        SMALL,
    )
    yield (
        "slices",
        frb.ReplayBuffer(
            capacity=CAPACITY, batch_size=32 * 64, sampler=frb.SliceSampler(slice_len=64)
        ),
        SLICE_ITEM,
    )
    yield (
        "ted",
        frb.ReplayBuffer(capacity=CAPACITY, batch_size=256, storage=frb.TEDStorage()),
        TED_ITEM,
    )


@pytest.mark.parametrize("name,rb,item", [pytest.param(*b, id=b[0]) for b in _buffers()])
def test_no_read_on_a_buffers_path_is_split(name, rb, item):
    """The add, sample and (prioritized) update of each sampler's buffer, compiled as users
    compile them: every gather of a large array is a whole kernel (scatters are left as XLA
    makes them: splitting them measured cheap)."""
    if jax.default_backend() != "cpu":
        pytest.skip("read_whole is the CPU's")
    state = rb.init(item)
    batch = jax.tree_util.tree_map(lambda x: jnp.zeros((256,) + x.shape, x.dtype), item)
    key = jax.random.key(0)
    calls = {
        "add": users_hlo(jax.jit(rb.add, donate_argnums=0), state, batch),
        "sample": users_hlo(jax.jit(rb.sample, donate_argnums=0), state, key),
    }
    if name == "prioritized":
        s, _ = jax.eval_shape(rb.sample, state, key)
        idx = jnp.zeros(s.indices.shape, jnp.int32)
        prio = jnp.ones(s.indices.shape, jnp.float32)
        calls["update"] = users_hlo(jax.jit(rb.update, donate_argnums=0), state, idx, prio)
    assert {call: _split_reads(hlo) for call, hlo in calls.items()} == dict.fromkeys(calls, [])
