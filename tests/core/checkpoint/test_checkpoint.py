"""checkpoint.save / load: bit-exact round trips (NaN payloads, wrap-around, static num_envs),
exact resume of every state the library builds (device, per-leaf, memmap, TED, every
sampler), load-time configuration checks, the envelope API, and Orbax interop."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trees import bits
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.checkpoint import CheckpointError, NoManifestError

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])

CONFIGS = {
    "random": dict(ndim=1),
    "without_replacement": dict(ndim=1, sampler=frb.SamplerWithoutReplacement()),
    "max_value": dict(ndim=1, writer=frb.MaxValueWriter("r")),
    "ndim2": dict(ndim=2),
}


@functools.cache
def buffer(name, jit):
    rb = frb.ReplayBuffer(capacity=6, batch_size=4, **CONFIGS[name])
    if jit:
        return rb, jax.jit(rb.add), jax.jit(rb.sample)
    return rb, rb.add, rb.sample


def nan_payload_floats(rng, shape):
    raw = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    raw[..., 0] = 0x7FC00000 | (raw[..., 0] & 0x003FFFFF)  # quiet NaNs with random payloads
    return raw.view(np.float32)


def items_for(name, rng, n):
    if name == "ndim2":
        return {
            "obs": nan_payload_floats(rng, (2, n, 3)),
            "r": rng.standard_normal((2, n), np.float32),
            "id": rng.integers(0, 100, (2, n)).astype(np.int32),
        }
    return {
        "obs": nan_payload_floats(rng, (n, 3)),
        "r": rng.standard_normal(n, np.float32),
        "id": rng.integers(0, 100, n).astype(np.int32),
    }


def example(name):
    lead = (2,) if name == "ndim2" else ()
    return {
        "obs": jnp.zeros(lead + (3,), jnp.float32),
        "r": jnp.zeros(lead, jnp.float32),
        "id": jnp.zeros(lead, jnp.int32),
    }


@JIT
@settings(max_examples=max(3, settings().max_examples // 6))
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    adds=st.lists(st.sampled_from([1, 4, 7]), min_size=0, max_size=3),
    seed=st.integers(0, 2**16),
    with_template=st.booleans(),
)
def test_round_trip_is_bit_exact_and_behaves_identically(
    tmp_path_factory, jit, name, adds, seed, with_template
):
    rb, add, jitted_sample = buffer(name, jit)

    def sample(s, k):  # eagerly, without replacement draws at most the items stored
        n = int(rb.size(s))
        if jit or name != "without_replacement" or n >= rb.batch_size:
            return jitted_sample(s, k)
        return rb.sample(s, k, batch_size=n)

    rng = np.random.default_rng(seed)
    state = rb.init(example(name))
    key = jax.random.key(seed)
    for n in adds:  # 7 > capacity // num_envs: wraps around
        state = add(state, items_for(name, rng, n))
        if int(rb.size(state)) and name == "without_replacement":
            key, k = jax.random.split(key)
            _, state = sample(state, k)  # mid-epoch sampler state must survive too
    path = tmp_path_factory.mktemp("rt") / "rb"
    frb.checkpoint.save(path, state)
    loaded = frb.checkpoint.load(path, like=rb.init(example(name)) if with_template else None)
    assert type(loaded) is type(state) and loaded.num_envs == state.num_envs
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
    assert bits(loaded) == bits(state)
    if int(rb.size(state)) == 0:
        return
    # same key -> same next samples; and the same after one more add
    more = items_for(name, rng, 4)
    outs = []
    for s in (state, loaded):
        a, s = sample(s, key)
        s = add(s, more)
        b, s = sample(s, jax.random.fold_in(key, 1))
        outs.append((bits(a), bits(b), bits(s)))
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ exact resume, every kind
def _ted_items(rng, t, e=None):
    lead = (t,) if e is None else (e, t)
    obs = rng.integers(0, 4, lead + (2,)).astype(np.uint8)
    done = rng.random(lead + (1,)) < 0.3
    return {
        "observation": obs,
        "action": rng.integers(0, 3, lead).astype(np.int32),
        "next": {
            "observation": rng.integers(0, 4, lead + (2,)).astype(np.uint8),
            "reward": rng.normal(size=lead + (1,)).astype(np.float32),
            "done": done,
            "truncated": np.zeros_like(done),
        },
    }


def _plain_items(rng, t, e=None):
    lead = (t,) if e is None else (e, t)
    return {
        "obs": rng.normal(size=lead + (3,)).astype(np.float32),
        "r": rng.normal(size=lead).astype(np.float32),
        "next": {"done": rng.random(lead) < 0.25},
    }


KINDS = {  # name: (buffer kwargs, items(rng, t), prioritized); together every state class
    "prioritized_leaf_storage": (
        dict(
            sampler=frb.PrioritizedSampler(alpha=0.7, beta=0.5),
            storage=frb.DeviceStorage(pack=False),
        ),
        _plain_items,
        True,
    ),
    "max_value_without_replacement": (
        dict(writer=frb.MaxValueWriter("r"), sampler=frb.SamplerWithoutReplacement()),
        _plain_items,
        False,
    ),
    "slice_without_replacement_ndim2": (
        dict(ndim=2, sampler=frb.SliceSamplerWithoutReplacement(slice_len=2)),
        lambda rng, t: _plain_items(rng, t, e=2),
        False,
    ),
    "ted_prioritized_slice": (
        dict(
            storage=frb.TEDStorage(frame_stack=2, min_episode_len=1),
            sampler=frb.PrioritizedSliceSampler(alpha=0.7, beta=0.5, slice_len=2),
        ),
        _ted_items,
        True,
    ),
    "memmap": (dict(sampler=frb.PrioritizedSampler(alpha=0.7, beta=0.5)), _plain_items, True),
}


def _resume_buffer(kind, tmp_path):
    kw, items, prioritized = KINDS[kind]
    if kind == "memmap":
        kw = dict(kw, storage=frb.MemmapStorage(tmp_path / "mm"))
    rb = frb.ReplayBuffer(capacity=12, batch_size=4, **kw)

    def step(state, batch, key):
        state = rb.add(state, batch)
        s, state = rb.sample(state, key)
        if prioritized:
            state = rb.update(state, s.indices, jnp.abs(s.weights) + s.indices.astype(jnp.float32))
        return state, s

    first = jax.tree_util.tree_map(
        lambda x: x[0] if rb.ndim == 1 else x[:, 0], items(np.random.default_rng(0), 1)
    )
    return rb, jax.jit(step), items, first


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_resumed_run_samples_exactly_what_the_uninterrupted_run_would(tmp_path, kind):
    """Save mid-run (after the ring wrapped, mid-epoch, with updated priorities), carry on,
    then load (into a fresh template) and carry on again: the same samples and final state."""
    rb, step, items, first = _resume_buffer(kind, tmp_path)
    rng = np.random.default_rng(1)
    batches = [items(rng, 5) for _ in range(6)]
    keys = jax.random.split(jax.random.key(2), 6)
    state = rb.init(first)
    for i in range(3):
        state, _ = step(state, batches[i], keys[i])
    frb.checkpoint.save(tmp_path / "ckpt", state)
    after, tail = state, []
    for i in range(3, 6):
        after, s = step(after, batches[i], keys[i])
        tail.append(bits(s))
    resumed = frb.checkpoint.load(tmp_path / "ckpt", like=rb.init(first))
    again = []
    for i in range(3, 6):
        resumed, s = step(resumed, batches[i], keys[i])
        again.append(bits(s))
    assert again == tail
    if kind != "memmap":  # (a memmap state's only leaf counts the directory's writes)
        assert bits(resumed) == bits(after)


def test_memmap_state_checkpoint_is_self_contained(tmp_path):
    """A memmap-backed state's items are copied into the checkpoint: loading writes them back
    into the template's directory (or, without one, the recorded one, recreated if gone)."""
    rb = frb.ReplayBuffer(8, storage=frb.MemmapStorage(tmp_path / "a"), batch_size=3)
    ex = {"x": jnp.zeros(2, jnp.float32), "i": jnp.int32(0)}
    s = rb.add(rb.init(ex), {"x": jnp.ones((5, 2)), "i": jnp.arange(5, dtype=jnp.int32)})
    frb.checkpoint.save(tmp_path / "ck", s)
    stale = jax.tree_util.tree_map(jnp.copy, s)  # the add below consumes s
    newer = rb.add(s, {"x": jnp.zeros((6, 2)), "i": -jnp.ones(6, jnp.int32)})  # overwrites
    with pytest.raises(ValueError, match="not the newest state of these files"):
        frb.checkpoint.save(tmp_path / "stale", stale)
    assert not os.path.exists(tmp_path / "stale")
    del newer
    back = frb.checkpoint.load(tmp_path / "ck")  # into the recorded directory, tmp_path / "a"
    assert back.storage.directory == str(tmp_path / "a")
    np.testing.assert_array_equal(rb.get(back, jnp.arange(5))["i"], np.arange(5))
    other = frb.ReplayBuffer(8, storage=frb.MemmapStorage(tmp_path / "b"), batch_size=3)
    into_b = frb.checkpoint.load(tmp_path / "ck", like=other.init(ex))
    assert into_b.storage.directory == str(tmp_path / "b")
    np.testing.assert_array_equal(other.get(into_b, jnp.arange(5))["x"], np.ones((5, 2)))
    frb.MemmapStorage(tmp_path / "a").close()
    shutil.rmtree(tmp_path / "a")
    again = frb.checkpoint.load(tmp_path / "ck")  # the directory is recreated
    np.testing.assert_array_equal(rb.get(again, jnp.arange(5))["i"], np.arange(5))
    small = frb.ReplayBuffer(4, storage=frb.MemmapStorage(tmp_path / "c"), batch_size=3)
    small_state = small.init(ex)
    with pytest.raises(ValueError, match=r"state.storage.capacity is 8 in the checkpoint, 4"):
        frb.checkpoint.load(tmp_path / "ck", like=small_state)
    np.testing.assert_array_equal(small.get(small_state, jnp.arange(4))["i"], 0)  # untouched


# ------------------------------------------------------------------ configuration checks
def test_template_mismatch_names_the_difference(tmp_path):
    packed = frb.ReplayBuffer(capacity=4, batch_size=2)
    path = tmp_path / "packed"
    frb.checkpoint.save(path, packed.init({"obs": jnp.zeros(3)}))
    with pytest.raises(ValueError, match=r"item\['obs'\] is float32\[3\].*expected float32\[2\]"):
        frb.checkpoint.load(path, like=packed.init({"obs": jnp.zeros(2)}))
    with pytest.raises(
        ValueError, match=r"leaves .*'obs'.* in the checkpoint, .*'x'.* in the template"
    ):
        frb.checkpoint.load(path, like=packed.init({"x": jnp.zeros(3)}))
    with pytest.raises(
        ValueError,
        match=r"slabs\['float32'\] is float32\[4, 3\] in the "
        r"checkpoint, expected float32\[8, 3\].*capacity",
    ):
        frb.checkpoint.load(path, like=frb.ReplayBuffer(8).init({"obs": jnp.zeros(3)}))
    with pytest.raises(
        ValueError,
        match=r"state.sampler is a EmptySamplerState in the checkpoint, "
        r"a PrioritizedState in the template",
    ):
        frb.checkpoint.load(
            path,
            like=frb.ReplayBuffer(4, sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0)).init(
                {"obs": jnp.zeros(3)}
            ),
        )
    with pytest.raises(
        ValueError,
        match=r"state.storage is a PackedStorageState in the "
        r"checkpoint, a DeviceStorageState",
    ):
        frb.checkpoint.load(
            path,
            like=frb.ReplayBuffer(4, storage=frb.DeviceStorage(pack=False)).init(
                {"obs": jnp.zeros(3)}
            ),
        )
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, storage=frb.DeviceStorage(pack=False))
    path = tmp_path / "rb"
    frb.checkpoint.save(path, rb.init({"obs": jnp.zeros(3)}))
    with pytest.raises(ValueError, match=r"\['obs'\].*float32\[4, 3\].*float32\[4, 2\]"):
        frb.checkpoint.load(path, like=rb.init({"obs": jnp.zeros(2)}))
    with pytest.raises(ValueError, match=r"keys only in the checkpoint: \['obs'\]"):
        frb.checkpoint.load(path, like=rb.init({"x": jnp.zeros(3)}))
    rb2 = frb.ReplayBuffer(capacity=4, batch_size=2, ndim=2)
    frb.checkpoint.save(path, rb2.init({"obs": jnp.zeros((2, 3))}))
    with pytest.raises(
        ValueError,
        match=r"state.num_envs is 2 in the checkpoint, 4 in the "
        r"template",
    ):
        frb.checkpoint.load(path, like=rb2.init({"obs": jnp.zeros((4, 3))}))
    with pytest.raises(ValueError, match=r"num_envs is 2 in the checkpoint, 1"):
        frb.checkpoint.load(path, like=packed.init({"obs": jnp.zeros(3)}))
    # an abstract template works as well as a concrete one
    like = jax.eval_shape(lambda: rb2.init({"obs": jnp.zeros((2, 3))}))
    assert bits(frb.checkpoint.load(path, like=like)) == bits(rb2.init({"obs": jnp.zeros((2, 3))}))


def test_checkpoint_is_not_pickle_and_rejects_foreign_classes(tmp_path):
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    path = tmp_path / "rb"
    frb.checkpoint.save(path, rb.init({"obs": jnp.zeros(3)}))
    manifest = json.loads((path / frb.checkpoint.MANIFEST).read_text())  # plain JSON
    assert manifest["meta"]["format"] == frb.checkpoint.FORMAT
    assert sorted(os.listdir(path)) == sorted([frb.checkpoint.MANIFEST, frb.checkpoint.DATA])
    assert list(manifest["files"]) == [frb.checkpoint.DATA]
    with pytest.raises(TypeError, match="cannot store"):
        frb.checkpoint.save(tmp_path / "x", {"f": object()})
    assert not os.path.exists(tmp_path / "x")
    key_state = {"key": jax.random.key(7), "x": jnp.arange(3)}
    frb.checkpoint.save(tmp_path / "k", key_state)
    back = frb.checkpoint.load(tmp_path / "k")
    np.testing.assert_array_equal(
        jax.random.key_data(back["key"]), jax.random.key_data(key_state["key"])
    )
    manifest = json.loads((tmp_path / "k" / frb.checkpoint.MANIFEST).read_text())
    body = manifest["meta"]
    body["tree"]["c"][0] = {"t": "dataclass", "cls": "os:PathLike", "data": [], "static": {}}
    frb.checkpoint.save(tmp_path / "forged", {"a": jnp.zeros(1)})
    with frb.checkpoint.staged(tmp_path / "forged") as stage:  # a well-formed, forged manifest
        stage.meta.update(body)
        shutil.copy(tmp_path / "k" / frb.checkpoint.DATA, stage.directory)
    with pytest.raises(ValueError, match="refusing to rebuild class 'os:PathLike'"):
        frb.checkpoint.load(tmp_path / "forged")
    assert frb.checkpoint is __import__("functional_rb.checkpoint").checkpoint


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    rng = np.random.default_rng(0)
    raw16 = rng.integers(0, 2**16, 64, dtype=np.uint16)
    raw16[:8] = 0x7FC0 | (raw16[:8] & 0x3F)  # NaNs with payloads
    tree = {
        "bf16": jnp.asarray(raw16.view(jnp.bfloat16)),
        "f16": jnp.asarray(raw16.view(np.float16)),
        "c64": jnp.asarray(rng.normal(size=(3, 2)) + 1j, jnp.complex64),
        "i8": jnp.asarray(rng.integers(-128, 128, 5), jnp.int8),
        "b": jnp.asarray([True, False]),
        "u32": jnp.uint32(2**32 - 1),
        "zero_size": jnp.zeros((0, 3)),
        "neg0": jnp.float32(-0.0),
        "python": [1, 2.5, True],
        "none": None,
        "tuple": (jnp.arange(3),),
    }
    frb.checkpoint.save(tmp_path / "d", tree)
    back = frb.checkpoint.load(tmp_path / "d")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    want = jax.tree_util.tree_map(jnp.asarray, tree)
    assert bits(back) == bits(want)
    assert bits(frb.checkpoint.load(tmp_path / "d", like=tree)) == bits(want)


def test_packed_item_of_nested_containers_round_trips(tmp_path):
    """A packed storage keeps its item's structure in the manifest: lists, tuples, None and
    nested dicts come back as the same tree and the loaded state samples identically."""
    item = {
        "x": [jnp.ones(2), None, (jnp.int32(3), jnp.ones((), jnp.bool_))],
        "y": {"z": jnp.zeros((2, 2), jnp.uint8)},
    }
    rb = frb.ReplayBuffer(capacity=8, batch_size=4)
    rng = np.random.default_rng(0)
    batch = {
        "x": [
            rng.normal(size=(5, 2)).astype(np.float32),
            None,
            (rng.integers(0, 9, 5).astype(np.int32), rng.random(5) < 0.5),
        ],
        "y": {"z": rng.integers(0, 255, (5, 2, 2)).astype(np.uint8)},
    }
    state = rb.add(rb.init(item), batch)
    path = tmp_path / "nested"
    frb.checkpoint.save(path, state)
    for loaded in (frb.checkpoint.load(path), frb.checkpoint.load(path, like=rb.init(item))):
        assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
        a, _ = rb.sample(loaded, jax.random.key(3))
        b, _ = rb.sample(state, jax.random.key(3))
        assert bits(a) == bits(b)


def test_packed_item_with_a_namedtuple_is_refused_by_name(tmp_path):
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    rb = frb.ReplayBuffer(capacity=4, batch_size=2)
    state = rb.init({"p": Pair(jnp.zeros(2), jnp.int32(0))})
    with pytest.raises(TypeError, match=r"item\.treedef\['p'\] of type Pair"):
        frb.checkpoint.save(tmp_path / "nt", state)
    assert not os.path.exists(tmp_path / "nt")
    assert not [n for n in os.listdir(tmp_path) if "frb-tmp" in n]


# ------------------------------------------------------------------ the envelope
def test_envelope_stages_any_files_and_verifies_them(tmp_path):
    path = tmp_path / "dump"
    with frb.checkpoint.staged(path) as stage:
        assert os.listdir(stage.directory) == [] and not path.exists()
        os.makedirs(os.path.join(stage.directory, "storage", "next"))
        np.arange(10, dtype=np.int64).tofile(
            os.path.join(stage.directory, "storage", "next", "a.memmap")
        )
        stage.write("meta.json", b'{"shape": [10]}')
        stage.meta["layout"] = "torchrl"
    m = frb.checkpoint.verify(path)
    assert m.directory == str(path) and m.meta == {"layout": "torchrl"}
    assert sorted(m.files) == ["meta.json", "storage/next/a.memmap"]
    assert m.files["storage/next/a.memmap"]["size"] == 80
    assert m.read("meta.json") == b'{"shape": [10]}'
    # an exception inside the block leaves the previous directory as it was
    with pytest.raises(RuntimeError, match="boom"), frb.checkpoint.staged(path) as stage:
        stage.write("meta.json", b"{}")
        raise RuntimeError("boom")
    assert frb.checkpoint.verify(path).read("meta.json") == b'{"shape": [10]}'
    assert sorted(os.listdir(tmp_path)) == ["dump"]
    # a second save replaces the first as a whole: no file of the first survives
    with frb.checkpoint.staged(path) as stage:
        stage.write("other.bin", b"x")
    assert sorted(os.listdir(path)) == sorted([frb.checkpoint.MANIFEST, "other.bin"])


def test_envelope_tells_no_manifest_from_damage_and_guards_foreign_paths(tmp_path):
    foreign = tmp_path / "torchrl_dump"
    (foreign / "storage").mkdir(parents=True)
    (foreign / "storage" / "x.memmap").write_bytes(b"\0" * 8)
    with pytest.raises(
        NoManifestError, match=r"torchrl_dump/frb_manifest.json: does not exist"
    ) as e:
        frb.checkpoint.verify(foreign)
    assert e.value.file == str(foreign / frb.checkpoint.MANIFEST)
    with pytest.raises(NoManifestError):
        frb.checkpoint.load(foreign)
    with (
        pytest.raises(FileExistsError, match="not a checkpoint"),
        frb.checkpoint.staged(foreign) as stage,
    ):
        stage.write("a", b"1")
    assert (foreign / "storage" / "x.memmap").exists()
    with frb.checkpoint.staged(foreign, replace_foreign=True) as stage:
        stage.write("a", b"1")
    assert sorted(os.listdir(foreign)) == sorted(["a", frb.checkpoint.MANIFEST])
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a directory"):
        frb.checkpoint.save(tmp_path / "file", {"a": jnp.zeros(1)})
    with pytest.raises(FileNotFoundError):
        frb.checkpoint.load(tmp_path / "missing")
    (foreign / "a").write_bytes(b"2")  # same size, other content: damage, not "no manifest"
    with pytest.raises(CheckpointError, match=r"torchrl_dump/a: its content does not match") as e:
        frb.checkpoint.verify(foreign)
    assert not isinstance(e.value, NoManifestError)
    frb.checkpoint.verify(foreign, data=False)  # sizes only


def test_leftovers_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """Siblings named like a staging directory of a process that no longer exists are deleted;
    a previous checkpoint moved aside by a killed fallback save is put back first."""
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = tmp_path / "ck"
    frb.checkpoint.save(path, {"a": jnp.arange(3)})
    os.rename(path, tmp_path / f".ck.frb-old-{dead}-abc123")  # killed between the renames
    (tmp_path / f".ck.frb-tmp-{dead}-def456").mkdir()
    (tmp_path / f".ck.frb-tmp-{dead}-def456" / "data.bin").write_bytes(b"\0" * 1000)
    np.testing.assert_array_equal(frb.checkpoint.load(path)["a"], np.arange(3))  # read aside
    frb.checkpoint.save(path, {"a": jnp.arange(4)})
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    np.testing.assert_array_equal(frb.checkpoint.load(path)["a"], np.arange(4))


def test_fallback_without_atomic_exchange_gives_the_same_results(tmp_path, monkeypatch):
    from functional_rb.checkpoint import atomic as _atomic

    monkeypatch.setattr(_atomic, "_RENAMEAT2", None)
    path = tmp_path / "ck"
    for n in (3, 4, 5):
        frb.checkpoint.save(path, {"a": jnp.arange(n)})
        np.testing.assert_array_equal(frb.checkpoint.load(path)["a"], np.arange(n))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ------------------------------------------------------------------ orbax
@pytest.mark.parametrize("kind", ["prioritized", "ted"])
def test_buffer_state_round_trips_through_orbax(tmp_path, kind):
    """A state is a plain PyTree for Orbax, saved beside other entries (a TED state's static
    layout of its rows included); the zero-element leaves Orbax refuses (a sum tree no larger
    than its fan-out) go through without_empty_leaves / with_empty_leaves."""
    ocp = pytest.importorskip("orbax.checkpoint")
    rng = np.random.default_rng(0)
    if kind == "prioritized":
        rb = frb.ReplayBuffer(16, sampler=frb.PrioritizedSampler(alpha=0.6, beta=0.4), batch_size=4)
        example, batch = {"obs": jnp.zeros(3)}, {"obs": rng.normal(size=(20, 3)).astype(np.float32)}
    else:
        rb = frb.ReplayBuffer(16, storage=frb.TEDStorage(min_episode_len=1), batch_size=4)
        batch = _ted_items(rng, 20)
        example = jax.tree_util.tree_map(lambda x: x[0], batch)
    state = rb.add(rb.init(example), batch)
    s, state = rb.sample(state, jax.random.key(0))
    state = rb.update(state, s.indices, jnp.arange(4, dtype=jnp.float32) + 0.5)
    empty = any(x.size == 0 for x in jax.tree_util.tree_leaves(state))
    assert empty == (kind == "prioritized")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(
            tmp_path / "orbax",
            {"step": jnp.int32(7), "rb": frb.checkpoint.without_empty_leaves(state)},
        )
        ckptr.wait_until_finished()
        tree = ckptr.restore(
            tmp_path / "orbax",
            {
                "step": jax.ShapeDtypeStruct((), jnp.int32),
                "rb": frb.checkpoint.without_empty_leaves(jax.eval_shape(lambda: state)),
            },
        )
    restored = frb.checkpoint.with_empty_leaves(tree["rb"], like=rb.init(example))
    assert int(tree["step"]) == 7
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    assert bits(restored) == bits(state)
    assert bits(rb.sample(restored, jax.random.key(1))) == bits(rb.sample(state, jax.random.key(1)))


def test_buffer_state_without_empty_leaves_needs_no_helpers_with_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    rb = frb.ReplayBuffer(64, sampler=frb.SamplerWithoutReplacement(), batch_size=4)
    state = rb.add(rb.init({"obs": jnp.zeros(3)}), {"obs": jnp.ones((10, 3))})
    _, state = rb.sample(state, jax.random.key(0))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", state)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "orbax", jax.eval_shape(lambda: state))
    assert type(restored) is type(state) and bits(restored) == bits(state)


def test_docs_persistence_snippets_run_as_printed(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "persistence.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 4
    for code in blocks:
        exec(compile(code, "docs/persistence.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "checkpoint.load: leaf state.storage.slabs['float32'] is "
        "float32[1024, 5] in the checkpoint, expected float32[2048, 5]"
    )
    assert out[1] == "[0 1 2 3 4 5]"
    assert out[2] == "{'layout': 'mine'} ['data.txt']"
    assert out[3] == "10 10"


TED_ITEM = {
    "observation": jnp.zeros(3),
    "action": jnp.int32(0),
    "next": {
        "observation": jnp.zeros(3),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
    },
}


def test_a_fresh_process_loads_a_file_naming_classes_it_never_imported(tmp_path):
    # functional_rb imports its modules on first use: the loader must find the classes itself
    import subprocess
    import sys

    rb = frb.ReplayBuffer(
        capacity=6,
        batch_size=2,
        sampler=frb.PrioritizedSliceSampler(alpha=0.6, beta=0.4, slice_len=2),
        storage=frb.TEDStorage(frame_stack=2),
    )
    state = rb.init(TED_ITEM)
    frb.checkpoint.save(tmp_path / "c", state)
    code = (
        "import functional_rb.checkpoint as c, sys; s = c.load(sys.argv[1]); "
        "print(type(s.storage).__name__, type(s.sampler).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [type(state.storage).__name__, type(state.sampler).__name__]
