"""Huge pages for large host buffers (functional_rb/_internal/hugepages.py).

What the kernel records is read back from ``/proc/self/smaps``: ``MADV_HUGEPAGE`` puts ``hg``
in the ``VmFlags`` of the buffer's mapping. Those tests run where transparent huge pages are
in ``madvise`` or ``always`` mode and skip, saying why, elsewhere; the fallbacks (THP
``never``, a failing ``madvise``, traced and small arrays) are checked everywhere by faking
the kernel.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb._internal import hugepages, pages
from functional_rb.samplers import sum_tree
from functional_rb.storages import memmap_files

THP = hugepages.thp_mode()
needs_thp = pytest.mark.skipif(
    THP not in ("madvise", "always"),
    reason=f"transparent huge pages are {THP!r} here (need 'madvise' or 'always' to see the "
    "kernel record the advice)",
)

# 600,000 items of 64 bytes: a 38 MB slab, above the 32 MiB threshold
BIG = 600_000
ITEM = {"obs": jnp.zeros((16,), jnp.float32)}
# a sum tree whose leaves (float32) pass the threshold: 36 MB
BIG_TREE = 9_000_000


@pytest.fixture(autouse=True)
def _follow_environment(monkeypatch):
    """Each test starts with huge pages on, decided by an unset FRB_HUGEPAGES."""
    monkeypatch.delenv(hugepages.ENV, raising=False)
    previous = hugepages.set_enabled(None)
    yield
    hugepages.set_enabled(previous)


@pytest.fixture
def madvise_calls(monkeypatch):
    """Every madvise the module makes, as ``(start, length, advice)``; the calls still run."""
    calls = []
    real = pages._madvise

    def spy(start, length, advice):
        calls.append((start, length, advice))
        return real(start, length, advice)

    monkeypatch.setattr(pages, "_madvise", spy)
    return calls


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 16), np.float32)}


def _slab(state):
    return state.storage.slabs["float32"]


# ------------------------------------------------------------------ what the kernel records
@needs_thp
def test_large_packed_and_leaf_storages_are_advised():
    for storage in (frb.DeviceStorage(), frb.DeviceStorage(pack=False)):
        state = frb.ReplayBuffer(capacity=BIG, storage=storage).init(ITEM)
        leaf = jax.tree_util.tree_leaves(state.storage)[0]
        assert leaf.nbytes >= pages.MIN_BYTES
        assert hugepages.advised(leaf) is True, type(storage).__name__
        assert float(jnp.abs(leaf).sum()) == 0.0  # released zero pages read back as zeros


_OFF = """
import os, sys
import functional_rb as frb, jax.numpy as jnp
from functional_rb._internal import hugepages, pages
if sys.argv[1] == "switch":
    hugepages.set_enabled(False)
state = frb.ReplayBuffer(capacity={big}).init({{"obs": jnp.zeros(16, jnp.float32)}})
print(hugepages.advised(state.storage.slabs["float32"]), hugepages.report()["enabled"])
"""


@needs_thp
@pytest.mark.parametrize("how", ["environment", "switch"])
def test_flag_absent_with_the_environment_variable_or_the_switch(how):
    """Off, nothing is advised. Checked in a fresh process: in this one the allocator may hand
    back memory an earlier test advised, whose mapping keeps the flag."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if how == "environment":
        env[hugepages.ENV] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _OFF.format(big=BIG), how],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    rb = frb.ReplayBuffer(capacity=BIG)
    assert hugepages.advised(_slab(rb.init(ITEM))) is True  # and on again here


@needs_thp
def test_sum_tree_arrays_are_advised_and_hold_their_initial_values():
    tree = sum_tree.init(BIG_TREE)
    assert hugepages.advised(tree.values) is True
    assert float(tree.values.max()) == 0.0
    big_mins = hugepages.full((BIG_TREE,), jnp.inf, jnp.float32)  # the path mins takes when large
    assert hugepages.advised(big_mins) is True
    assert bool(jnp.all(big_mins == jnp.inf))
    # the inner levels (1/15 of the leaves) are below the threshold here: left alone
    assert tree.sums.nbytes < pages.MIN_BYTES
    assert bool(jnp.all(tree.mins == jnp.inf)) and float(tree.sums.max()) == 0.0


@needs_thp
def test_donated_add_and_sample_keep_the_advised_buffer():
    rb = frb.ReplayBuffer(capacity=BIG, batch_size=64)
    state = rb.init(ITEM)
    before = _slab(state).unsafe_buffer_pointer()
    add = jax.jit(rb.add, donate_argnums=0)
    sample = jax.jit(rb.sample, donate_argnums=0)
    for i in range(3):
        state = add(state, _batch(4096, seed=i))
        _, state = sample(state, jax.random.key(i))
    state = rb.add(state, _batch(100, seed=9))  # the eager call donates too
    jax.block_until_ready(state)
    assert _slab(state).unsafe_buffer_pointer() == before
    assert hugepages.advised(_slab(state)) is True
    assert hugepages.report()["anon_huge_pages_kib"] is not None


@needs_thp
def test_memmap_storage_maps_are_advised(tmp_path, monkeypatch):
    rb = frb.ReplayBuffer(capacity=BIG, storage=frb.MemmapStorage(str(tmp_path / "rb")))
    state = rb.init(ITEM)
    data = memmap_files.opened(state.storage.directory).data[0]
    if hugepages.advised(data) is not True:
        if not hugepages.advise(data):
            pytest.skip("the kernel refuses MADV_HUGEPAGE for file mappings on this file system")
        pytest.fail("MemmapStorage did not advise its map, though the kernel takes the advice")
    state = rb.add(state, _batch(1000))
    sample, state = rb.sample(state, jax.random.key(0), batch_size=8)
    assert sample.data["obs"].shape == (8, 16)
    memmap_files.close_directory(state.storage.directory)
    monkeypatch.setenv(hugepages.ENV, "0")
    state = rb.init(ITEM)  # opened again: mapped anew, now without the advice
    try:
        assert hugepages.advised(memmap_files.opened(state.storage.directory).data[0]) is False
    finally:
        memmap_files.close_directory(state.storage.directory)


@needs_thp
def test_collapse_keeps_the_contents():
    x = jnp.arange(BIG * 16, dtype=jnp.float32).reshape(BIG, 16)
    assert hugepages.advise(x, collapse=True) > 0
    assert hugepages.advised(x) is True
    np.testing.assert_array_equal(
        np.asarray(x[::997]), np.arange(BIG * 16, dtype=np.float32).reshape(BIG, 16)[::997]
    )


@needs_thp
def test_pages_are_released_only_from_private_anonymous_memory(tmp_path, madvise_calls):
    # a copy-on-write file map: released pages would read the file again, not the written data
    path = tmp_path / "x.bin"
    np.zeros(BIG * 16, np.float32).tofile(path)
    m = np.memmap(path, np.float32, mode="c", shape=(BIG * 16,))
    m[:] = 7.0
    assert hugepages.advise(m, zeroed=True) > 0  # a false promise, caught by the check
    assert [a for _, _, a in madvise_calls] == [pages._MADV_HUGEPAGE]
    assert float(m.min()) == 7.0
    del m


# ------------------------------------------------------------------ same results either way
@pytest.mark.parametrize(
    "sampler",
    [frb.RandomSampler(), frb.PrioritizedSampler(0.6, 0.4)],
    ids=["uniform", "prioritized"],
)
def test_samples_are_the_same_with_and_without_huge_pages(sampler, monkeypatch, madvise_calls):
    # a 1 MiB threshold advises the sum tree's leaves too, at a capacity that keeps this fast;
    # arrays that small live in the allocator's shared heap, where an earlier advice sticks to
    # the memory a later array reuses, so "off" is checked by the calls made, not the flags read
    monkeypatch.setattr(pages, "MIN_BYTES", 1 << 20)
    capacity = 300_000
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=128)
    add = jax.jit(rb.add, donate_argnums=0)  # compiled once for both runs
    sample = jax.jit(rb.sample, donate_argnums=0)

    def run(on):
        hugepages.set_enabled(on)
        madvise_calls.clear()
        state = rb.init(ITEM)
        out = []
        for i in range(3):
            state = add(state, _batch(2048, seed=i))
            s, state = sample(state, jax.random.key(i))
            state = rb.update(state, s.indices, jnp.abs(s.data["obs"][:, 0]))
            out.append(jax.tree_util.tree_map(np.asarray, s))
        s, state = rb.sample(state, jax.random.key(7))  # and eagerly
        out.append(jax.tree_util.tree_map(np.asarray, s))
        arrays = jax.tree_util.tree_leaves((state.storage, state.sampler))
        return out, [hugepages.advised(a) for a in arrays if a.nbytes >= 1 << 20]

    on, flag_on = run(True)
    calls_on = len(madvise_calls)
    off, _ = run(False)
    jax.tree_util.tree_map(np.testing.assert_array_equal, on, off)
    assert madvise_calls == []  # turned off: not one range advised or released
    if THP in ("madvise", "always"):  # the slab, and the sum tree's leaves when prioritized
        assert flag_on == [True] * (2 if isinstance(sampler, frb.PrioritizedSampler) else 1)
        assert calls_on > 0


# ------------------------------------------------------------------ TED, slices, loads
# 2**23 items: the int32 / float32 records of one per item are 32 MiB, the threshold (their
# pages are released or filled once, so this costs little); a lower threshold would advise
# arrays inside the allocator's shared heap, whose flag then sticks to later small arrays
RECORDS = 1 << 23
TED_ITEM = {
    "observation": jnp.float32(0),
    "next": {"observation": jnp.float32(0), "done": jnp.bool_(False)},
}


def _large_leaves(state):
    return {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_flatten_with_path((state.storage, state.sampler))[0]
        if x.nbytes >= pages.MIN_BYTES
    }


def test_ted_and_slice_records_are_advised_and_hold_the_same_values():
    """Huge pages change nothing but how ``init`` makes its arrays (released zero pages, fills
    into them); from equal initial states every later call computes the same, so equal
    initial states, leaf by leaf, are equal results. That a donated add keeps an advised
    buffer is checked above for the device storage."""
    buffers = (  # TED's rows (pointer, distance, ...) and the slice samplers' records
        frb.ReplayBuffer(
            capacity=RECORDS,
            storage=frb.TEDStorage(frame_stack=2),
            sampler=frb.PrioritizedSliceSampler(0.6, 0.4, slice_len=8, end_key=("next", "done")),
        ),
        frb.ReplayBuffer(
            capacity=RECORDS,
            sampler=frb.SliceSamplerWithoutReplacement(slice_len=8, end_key=("next", "done")),
        ),
    )

    def run(on):
        hugepages.set_enabled(on)
        states = [rb.init(TED_ITEM) for rb in buffers]
        flags = {
            f"{i}{k}": hugepages.advised(x)
            for i, state in enumerate(states)
            for k, x in _large_leaves(state).items()
        }
        return flags, states

    flags, on = run(True)
    _, off = run(False)
    same = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.array_equal, a, b))(on, off)
    assert all(jax.tree_util.tree_leaves(same)), same
    names = {k.rsplit(".", 1)[-1] for k in flags}
    assert {"rows", "rec_start", "prio", "values", "perm"} <= names, sorted(flags)
    assert bool(jnp.all(on[0].storage.ptr == -1))
    assert bool(jnp.all(on[0].storage.rows[:, 1:] == 0))
    assert bool(jnp.all(on[1].sampler.perm == jnp.arange(RECORDS, dtype=jnp.int32)))
    if THP in ("madvise", "always"):
        assert all(flags.values()), flags


@needs_thp
@pytest.mark.parametrize(
    "writer", [frb.RoundRobinWriter(), frb.ImmutableWriter()], ids=["round robin", "immutable"]
)
def test_init_from_data_writes_into_the_advised_buffer(writer):
    data = _batch(BIG, seed=3)
    rb = frb.ReplayBuffer(capacity=BIG, writer=writer)
    state = rb.init_from_data(data)
    assert hugepages.advised(_slab(state)) is True
    np.testing.assert_array_equal(np.asarray(_slab(state)), data["obs"])
    assert int(rb.size(state)) == BIG and int(state.writer.cursor) == 0
    if isinstance(writer, frb.ImmutableWriter):
        with pytest.raises(RuntimeError, match="init_from_data"):
            rb.add(state, _batch(1))


@needs_thp
def test_checkpoint_load_puts_large_leaves_on_huge_pages(tmp_path, madvise_calls):
    rb = frb.ReplayBuffer(capacity=BIG)
    state = rb.add(rb.init(ITEM), _batch(5000, seed=4))
    frb.checkpoint.save(tmp_path / "ck", state)
    del madvise_calls[:]
    for like in (None, rb.init(ITEM)):
        loaded = frb.checkpoint.load(tmp_path / "ck", like=like)
        assert hugepages.advised(_slab(loaded)) is True
        np.testing.assert_array_equal(np.asarray(_slab(loaded))[:5000], _batch(5000, seed=4)["obs"])
        assert float(jnp.abs(_slab(loaded)[5000:]).sum()) == 0.0
    # the pages the copy touched are collapsed into huge ones now, not left to khugepaged
    assert pages._MADV_COLLAPSE in [a for _, _, a in madvise_calls]


_RECORDS_OFF = """
import os, sys, tempfile
import numpy as np, jax, jax.numpy as jnp
import functional_rb as frb
from functional_rb._internal import hugepages, pages
pages.MIN_BYTES = 1 << 20
item = {"observation": jnp.zeros((2,), jnp.float32), "action": jnp.int32(0),
        "next": {"observation": jnp.zeros((2,), jnp.float32), "done": jnp.bool_(False)}}
flags = []
for rb in (frb.ReplayBuffer(capacity=300_000, storage=frb.TEDStorage(frame_stack=2),
                            sampler=frb.SliceSamplerWithoutReplacement(slice_len=8)),
           frb.ReplayBuffer(capacity=300_000, sampler=frb.PrioritizedSliceSampler(
               0.6, 0.4, slice_len=8, end_key=("next", "done")))):
    flags += [hugepages.advised(x) for x in jax.tree_util.tree_leaves(rb.init(item))
              if x.nbytes >= pages.MIN_BYTES]
rb = frb.ReplayBuffer(capacity=300_000, writer=frb.ImmutableWriter())
state = rb.init_from_data({"obs": np.ones((300_000, 4), np.float32)})
flags.append(hugepages.advised(state.storage.slabs["float32"]))
path = os.path.join(tempfile.mkdtemp(), "ck")
frb.checkpoint.save(path, state)
flags.append(hugepages.advised(frb.checkpoint.load(path).storage.slabs["float32"]))
print(len(flags), set(flags))
"""


@needs_thp
def test_ted_slices_init_from_data_and_load_are_unadvised_when_off():
    """In a fresh process: in this one a small array may reuse heap memory an earlier test
    advised (below 32 MiB the allocator keeps it), whose mapping keeps the flag."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", hugepages.ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", _RECORDS_OFF], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    count, flags = out.stdout.split(maxsplit=1)
    assert int(count) >= 9 and flags.strip() == "{False}", out.stdout


# ------------------------------------------------------------------ left alone, falling back
def test_small_arrays_are_left_alone(madvise_calls):
    state = frb.ReplayBuffer(capacity=1000, sampler=frb.PrioritizedSampler(0.6, 0.4)).init(ITEM)
    assert hugepages.advise(_slab(state)) == 0
    assert hugepages.advise(np.zeros(1000)) == 0
    assert madvise_calls == []
    if THP in ("madvise", "always"):
        assert hugepages.advised(_slab(state)) is False


def test_traced_values_are_left_alone(madvise_calls):
    @jax.jit
    def make():
        big = hugepages.zeros((BIG, 16), jnp.float32)
        assert hugepages.advise(big) == 0  # a tracer has no buffer
        return hugepages.full((3,), 2.5, jnp.float32), big[0]

    small, row = make()
    np.testing.assert_array_equal(small, np.full(3, 2.5, np.float32))
    np.testing.assert_array_equal(row, np.zeros(16, np.float32))
    assert madvise_calls == []
    assert jax.eval_shape(lambda: sum_tree.init(BIG_TREE)).values.shape[0] >= BIG_TREE


def test_thp_never_is_a_no_op(monkeypatch, madvise_calls):
    monkeypatch.setattr(pages, "thp_mode", lambda: "never")
    x = hugepages.zeros((BIG, 16), jnp.float32)
    assert hugepages.advise(x) == 0 and madvise_calls == []
    assert float(x.sum()) == 0.0


def test_a_failing_madvise_falls_back_silently(monkeypatch):
    monkeypatch.setattr(pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(pages, "_madvise_fn", lambda: lambda *a: -1)
    x = hugepages.full((BIG, 16), 3, jnp.int32)
    assert hugepages.advise(x) == 0
    assert bool(jnp.all(x == 3))
    state = frb.ReplayBuffer(capacity=BIG).init(ITEM)
    assert float(_slab(state).sum()) == 0.0


def test_set_enabled_checks_its_argument():
    with pytest.raises(
        TypeError,
        match=r"hugepages.set_enabled: flag must be True, False or "
        r"None, got 'no' \(str\)",
    ):
        hugepages.set_enabled("no")


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_environment_values_that_turn_it_off(monkeypatch, value):
    monkeypatch.setenv(hugepages.ENV, value)
    assert hugepages.enabled() is False
    monkeypatch.setenv(hugepages.ENV, "1")
    assert hugepages.enabled() is True


def test_report_reads_the_kernel():
    r = hugepages.report()
    assert r["thp"] == THP and r["enabled"] is True and r["min_bytes"] == 32 << 20
    if THP != "unavailable":
        assert isinstance(r["anon_huge_pages_kib"], int) and r["anon_huge_pages_kib"] >= 0
        assert isinstance(r["file_pmd_mapped_kib"], int)


# ------------------------------------------------------------------ the contents, any shape
_DTYPES = st.sampled_from([jnp.float32, jnp.int32, jnp.uint8, jnp.bool_])


@given(
    rows=st.integers(1, 3000),
    cols=st.integers(1, 9),
    dtype=_DTYPES,
    value=st.integers(0, 200),
    jit=st.booleans(),
)
def test_zeros_and_full_equal_jax_s_with_every_array_advised(rows, cols, dtype, value, jit):
    # threshold 0: every array, page-sized or not, in the heap or a mapping, goes through the
    # release-and-refill path; the contents must be those of jnp.zeros / jnp.full regardless
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pages, "MIN_BYTES", 0)
        fill = np.asarray(value).astype(dtype)

        def make():
            return (hugepages.zeros((rows, cols), dtype), hugepages.full((rows, cols), fill, dtype))

        z, f = jax.jit(make)() if jit else make()
    assert z.dtype == dtype and f.dtype == dtype and z.shape == (rows, cols)
    np.testing.assert_array_equal(z, np.zeros((rows, cols), dtype))
    np.testing.assert_array_equal(f, np.full((rows, cols), fill, dtype))
