"""MemmapStorage: same results as DeviceStorage, eagerly and under jit; files on disk; commits
(``checkpoint``) and roll back of uncommitted writes on reopen and restore."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trees import assert_trees_equal

import functional_rb as frb
from functional_rb.storages import memmap as mm
from functional_rb.storages import memmap_files

EXAMPLE = {
    "obs": jnp.zeros((3,), jnp.float32),
    "act": jnp.int32(0),
    "next": {"done": jnp.zeros((1,), bool)},
}


def _items(i, n=3):
    base = jnp.arange(n, dtype=jnp.float32) + 10.0 * i
    return {
        "obs": jnp.stack([base, base + 1, base + 2], axis=1),
        "act": jnp.arange(n, dtype=jnp.int32) + 100 * i,
        "next": {"done": (jnp.arange(n) % 2 == 0)[:, None]},
    }


@pytest.mark.parametrize(
    "sampler",
    [frb.RandomSampler(), frb.SamplerWithoutReplacement()],
    ids=["random", "without_replacement"],
)
def test_same_samples_as_device_storage(tmp_path, maybe_jit, sampler):
    rb_m = frb.ReplayBuffer(
        8, sampler=sampler, storage=frb.MemmapStorage(tmp_path / "rb"), batch_size=3
    )
    rb_d = frb.ReplayBuffer(8, sampler=sampler, batch_size=3)
    sm, sd = rb_m.init(EXAMPLE), rb_d.init(EXAMPLE)
    add_m, add_d = maybe_jit(rb_m.add, donate_argnums=0), maybe_jit(rb_d.add, donate_argnums=0)
    sample_m, sample_d = maybe_jit(rb_m.sample), maybe_jit(rb_d.sample)
    key = jax.random.key(0)
    for i in range(3):  # 9 items into capacity 8: the ring wraps
        sm, sd = add_m(sm, _items(i)), add_d(sd, _items(i))
        key, k = jax.random.split(key)
        a, sm = sample_m(sm, k)
        b, sd = sample_d(sd, k)
        assert_trees_equal(a, b)
    assert int(sm.storage.version) == 3
    assert_trees_equal(rb_m.get(sm, jnp.arange(8)), rb_d.get(sd, jnp.arange(8)))


def test_ring_wrap_and_ndim2(tmp_path, maybe_jit):
    rb = frb.ReplayBuffer(4, storage=frb.MemmapStorage(tmp_path / "a"), batch_size=2)
    s = rb.init({"x": jnp.float32(0)})
    add = maybe_jit(rb.add)
    s = add(s, {"x": jnp.arange(6, dtype=jnp.float32)})  # keeps 2, 3, 4, 5 at 2, 3, 0, 1
    s = add(s, {"x": jnp.array([6.0], jnp.float32)})  # overwrites slot 2
    np.testing.assert_array_equal(rb.get(s, jnp.arange(4))["x"], [4.0, 5.0, 6.0, 3.0])

    rb2 = frb.ReplayBuffer(6, storage=frb.MemmapStorage(tmp_path / "b"), ndim=2, batch_size=2)
    s2 = rb2.init({"x": jnp.zeros((2,), jnp.int32)})
    s2 = maybe_jit(rb2.add)(s2, {"x": jnp.arange(8, dtype=jnp.int32).reshape(2, 4)})
    # rows of 3: env 0 keeps t=1,2,3 (ring slots 1,2,0), env 1 likewise
    np.testing.assert_array_equal(rb2.get(s2, jnp.arange(6))["x"], [3, 1, 2, 7, 5, 6])


def test_read_and_write_order_inside_one_jit(tmp_path):
    rb = frb.ReplayBuffer(
        4,
        sampler=frb.SamplerWithoutReplacement(shuffle=False),
        storage=frb.MemmapStorage(tmp_path / "o"),
        batch_size=4,
    )
    s = rb.add(rb.init({"x": jnp.float32(0)}), {"x": jnp.arange(4, dtype=jnp.float32)})

    def step(s, key):
        before, s = rb.sample(s, key)
        s = rb.add(s, {"x": jnp.arange(4, dtype=jnp.float32) + 100})
        after, s = rb.sample(s, key)
        return before.data["x"], after.data["x"], s

    before, after, s = jax.jit(step)(s, jax.random.key(0))
    np.testing.assert_array_equal(before, [0, 1, 2, 3])
    np.testing.assert_array_equal(after, [100, 101, 102, 103])

    def scan_body(carry, key):  # writes and reads inside lax.scan
        s, acc = carry
        s = rb.add(s, {"x": jnp.ones((4,), jnp.float32)})
        smp, s = rb.sample(s, key)
        return (s, acc + smp.data["x"].sum()), None

    (s, acc), _ = jax.jit(
        lambda s, k: jax.lax.scan(scan_body, (s, jnp.float32(0)), jax.random.split(k, 3))
    )(s, jax.random.key(1))
    assert float(acc) == 12.0


def test_files_on_disk_and_reopen(tmp_path):
    path = tmp_path / "persist"
    rb = frb.ReplayBuffer(5, storage=frb.MemmapStorage(path), batch_size=2)
    s = rb.init(EXAMPLE)
    s = jax.jit(rb.add)(s, _items(1, n=4))
    rb.storage.checkpoint(s)
    manifest = json.loads((path / mm.MANIFEST).read_text())
    assert manifest["capacity"] == 5
    assert [l["path"] for l in manifest["leaves"]] == ["['act']", "['next']['done']", "['obs']"]
    obs_file = [l["file"] for l in manifest["leaves"] if l["path"] == "['obs']"][0]
    on_disk = np.load(path / obs_file)  # a plain .npy: readable without this library
    assert on_disk.shape == (5, 3) and on_disk.dtype == np.float32
    np.testing.assert_array_equal(on_disk[:4], np.asarray(_items(1, n=4)["obs"]))

    rb.storage.close()  # as in a new process: nothing mapped yet
    rb2 = frb.ReplayBuffer(5, storage=frb.MemmapStorage(str(path)), batch_size=2)
    s2 = rb2.storage.restore(rb2.init(EXAMPLE))
    assert int(rb2.size(s2)) == 4 and int(s2.writer.cursor) == 4
    assert_trees_equal(rb2.get(s2, jnp.arange(4)), rb.get(s, jnp.arange(4)))
    s2 = rb2.add(s2, _items(2, n=2))  # continues at slot 4, then wraps to 0
    np.testing.assert_array_equal(rb2.get(s2, jnp.arange(5))["act"], [201, 101, 102, 103, 200])


def test_clear_errors(tmp_path):
    path = tmp_path / "e"
    rb = frb.ReplayBuffer(4, storage=frb.MemmapStorage(path))
    s = rb.init({"x": jnp.zeros((2,), jnp.float32)})
    with pytest.raises(ValueError, match="different layout"):
        frb.ReplayBuffer(4, storage=frb.MemmapStorage(path)).init({"x": jnp.zeros(3)})
    with pytest.raises(ValueError, match="different layout"):
        frb.ReplayBuffer(8, storage=frb.MemmapStorage(path)).init({"x": jnp.zeros(2)})
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        rb.storage.restore(s)
    batched = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), s)
    with pytest.raises(TypeError, match="does not support jax.vmap"):
        jax.vmap(rb.add)(batched, {"x": jnp.ones((2, 1, 2), jnp.float32)})
    with pytest.raises(TypeError, match="must be a str"):
        frb.MemmapStorage(3)
    with pytest.raises(ValueError, match=r"leaf \['x'\] has shape \(1, 3\)"):
        rb.add(s, {"x": jnp.ones((1, 3), jnp.float32)})
    other = frb.ReplayBuffer(
        4, sampler=frb.SamplerWithoutReplacement(), storage=frb.MemmapStorage(path)
    )
    rb.storage.checkpoint(s)
    with pytest.raises(
        ValueError,
        match=r"MemmapStorage.restore: the state saved in .*state "
        r"does not fit.*state.sampler is a EmptySamplerState in "
        r"the checkpoint, a WithoutReplacementState",
    ):
        other.storage.restore(other.init({"x": jnp.zeros((2,), jnp.float32)}))
    assert os.path.exists(path / mm.STATE_DIR / frb.checkpoint.MANIFEST)
    stale = s
    s = rb.add(s, {"x": jnp.ones((1, 2), jnp.float32)})
    with pytest.raises(ValueError, match="not the newest state of these files"):
        rb.storage.checkpoint(stale)


# ---------------------------------------------------------------------- commits and roll back
def _ids(rb, state):
    """The stored items' ids, oldest first, per the state's writer (ndim=1 ring)."""
    n, cursor = int(state.writer.filled), int(state.writer.cursor)
    slots = (cursor - n + np.arange(n)) % rb.capacity
    got = rb.get(state, jnp.asarray(slots, jnp.int32))
    np.testing.assert_array_equal(
        got["obs"], np.repeat(np.asarray(got["id"])[:, None], 3, 1).astype(np.float32)
    )  # every item whole
    return list(np.asarray(got["id"]))


def _batch(start, n):
    ids = np.arange(start, start + n, dtype=np.int32)
    return {"id": ids, "obs": np.repeat(ids[:, None], 3, 1).astype(np.float32)}


ITEM = {"id": jnp.int32(0), "obs": jnp.zeros(3, jnp.float32)}


def test_writes_after_the_last_checkpoint_are_rolled_back_on_reopen(tmp_path):
    path = tmp_path / "rb"
    rb = frb.ReplayBuffer(
        6,
        storage=frb.MemmapStorage(path),
        sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0),
        batch_size=2,
    )
    add = jax.jit(rb.add)
    s = add(rb.init(ITEM), _batch(0, 4))
    s = rb.update(s, jnp.array([1, 2]), jnp.array([5.0, 7.0]))
    rb.storage.checkpoint(s)
    committed = s
    for start in (4, 9):  # wraps: overwrites every committed item
        s = add(s, _batch(start, 5))
    assert _ids(rb, s) == [8, 9, 10, 11, 12, 13]
    rb.storage.close()  # the process "dies" here
    rb2 = frb.ReplayBuffer(
        6,
        storage=frb.MemmapStorage(path),
        sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0),
        batch_size=2,
    )
    back = rb2.storage.restore(rb2.init(ITEM))
    assert _ids(rb2, back) == [0, 1, 2, 3]
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(committed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # priorities included
    np.testing.assert_array_equal(  # the files themselves, as np.load reads them
        np.load(path / memmap_files.manifest_for(back.storage.item, 6)["leaves"][0]["file"])[:4],
        [0, 1, 2, 3],
    )
    back = rb2.add(back, _batch(20, 2))  # and it goes on from there
    assert _ids(rb2, back) == [0, 1, 2, 3, 20, 21]


def test_restore_in_the_writing_process_rolls_back_its_own_writes(tmp_path):
    rb = frb.ReplayBuffer(4, storage=frb.MemmapStorage(tmp_path / "rb"), batch_size=2)
    s = rb.add(rb.init(ITEM), _batch(0, 3))
    rb.storage.checkpoint(s)
    s = rb.add(s, _batch(3, 3))
    rb.storage.checkpoint(s)  # a second commit: [2, 3, 4, 5]
    s = rb.add(s, _batch(6, 2))
    assert _ids(rb, s) == [4, 5, 6, 7]
    back = rb.storage.restore(rb.init(ITEM))
    assert _ids(rb, back) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not the newest state"):
        rb.storage.checkpoint(s)  # the rolled back state is gone for good
    # with another process holding the directory open, rolling back is refused
    s = rb.add(back, _batch(8, 1))
    import fcntl

    fd = os.open(tmp_path / "rb" / mm.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        with pytest.raises(RuntimeError, match="other processes have it open"):
            rb.storage.restore(rb.init(ITEM))
    finally:
        os.close(fd)
    assert _ids(rb, rb.storage.restore(rb.init(ITEM))) == [2, 3, 4, 5]


def test_damaged_commit_record_and_old_layouts_are_named(tmp_path):
    path = tmp_path / "rb"
    rb = frb.ReplayBuffer(4, storage=frb.MemmapStorage(path), batch_size=2)
    rb.storage.checkpoint(rb.add(rb.init(ITEM), _batch(0, 2)))
    rb.storage.close()
    journal = path / "journal.npy"
    raw = bytearray(journal.read_bytes())
    journal.write_bytes(bytes(raw[:-8]))
    with pytest.raises(frb.checkpoint.CheckpointError, match=r"rb/journal.npy: "):
        rb.init(ITEM)
    journal.write_bytes(bytes(raw))
    manifest = json.loads((path / mm.MANIFEST).read_text())
    (path / mm.MANIFEST).write_text(json.dumps(dict(manifest, format_version=1)))
    with pytest.raises(ValueError, match="format version 1; this functional_rb reads version 2"):
        rb.init(ITEM)
    (path / mm.MANIFEST).write_text("{not json")
    with pytest.raises(frb.checkpoint.CheckpointError, match=r"rb/manifest.json: is not"):
        rb.init(ITEM)
