"""functional_rb.vault: round trips (nested structures, many dtypes, several appends, ring
intervals; hypothesis against a NumPy model), core buffer states in and out (states built
eagerly and under jit), files exchanged with flashbax 0.1.3 both ways (data, metadata.json,
zarr specs), flashbax's first metadata format, and the errors: wrong data, wrong templates,
damaged or truncated files, tensorstore missing."""

import itertools
import json
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.vault import VaultError

pytest.importorskip("tensorstore")


class Obs(NamedTuple):
    x: jax.Array
    y: jax.Array


DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int32", "uint32", "bool", "complex64")


def nested(envs=2, time=6, dtypes=DTYPES):
    """A nested template: a dict holding a NamedTuple, a one-leaf list and a leaf per dtype."""
    leaves = {d: jax.ShapeDtypeStruct((envs, time, 2), jnp.dtype(d)) for d in dtypes}
    return {
        "obs": Obs(
            jax.ShapeDtypeStruct((envs, time, 3), jnp.float32),
            jax.ShapeDtypeStruct((envs, time), jnp.int32),
        ),
        "extra": [jax.ShapeDtypeStruct((envs, time, 1, 2), jnp.uint8)],
        "by_dtype": leaves,
    }


def values(like, time, seed):
    """NumPy data shaped like ``like`` with ``time`` steps, distinct per seed."""
    rng = np.random.default_rng(seed)

    def one(s):
        shape = (s.shape[0], time, *s.shape[2:])
        raw = rng.integers(0, 100, shape)
        if np.dtype(s.dtype) == np.bool_:
            return raw % 2 == 0
        return raw.astype(s.dtype)

    return jax.tree_util.tree_map(one, like)


def concat(parts):
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, axis=1), *parts)


def assert_exact(got, want):
    """Same tree, dtypes and bits."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)
    ):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (path, g.dtype, w.dtype, g.shape)
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------ round trips
def test_round_trip_of_several_appends_every_dtype_and_nested_structure(tmp_path):
    like = nested()
    store = frb.vault.create(tmp_path / "v", like, metadata={"seed": 3, "arr": np.int64(5)})
    parts = [values(like, t, seed) for seed, t in enumerate((6, 1, 4))]
    assert [frb.vault.append(store, p) for p in parts] == [6, 1, 4]
    assert frb.vault.length(store) == 11
    full = concat(parts)
    assert_exact(frb.vault.read(store, as_numpy=True), full)
    # a fresh open, with the template: the same tree, NamedTuples included
    reopened = frb.vault.open(tmp_path / "v", like=like)
    assert reopened.metadata == {"arr": "5", "seed": 3}
    assert_exact(frb.vault.read(reopened, as_numpy=True), full)
    assert_exact(
        frb.vault.read(reopened, timesteps=4, as_numpy=True),
        jax.tree_util.tree_map(lambda x: x[:, -4:], full),
    )
    for lo, hi in ((0, 50), (10, 90), (33, 34), (0, 100)):
        a, b = int(11 * (lo / 100)), int(11 * (hi / 100))
        assert_exact(
            frb.vault.read(reopened, percentiles=(lo, hi), as_numpy=True),
            jax.tree_util.tree_map(lambda x, a=a, b=b: x[:, a:b], full),
        )
    # without a template: nested dicts and lists, the NamedTuple's fields as keys
    plain = frb.vault.read(frb.vault.open(tmp_path / "v"))
    assert set(plain) == {"obs", "extra", "by_dtype"} and set(plain["obs"]) == {"x", "y"}
    np.testing.assert_array_equal(np.asarray(plain["obs"]["y"]), full["obs"].y)
    np.testing.assert_array_equal(np.asarray(plain["extra"][0]), full["extra"][0])


def test_write_at_a_position_and_ring_intervals_leave_the_length_alone(tmp_path):
    store = frb.vault.create(tmp_path / "v", {"t": np.zeros((1, 5), np.int32)})
    ring = {"t": np.array([[5, 6, 2, 3, 4]], np.int32)}  # oldest at 2, head at 2
    assert frb.vault.write(store, ring, dest_start=0, source=(2, 2)) == 0
    assert frb.vault.write(store, ring, dest_start=0, source=(2, 5)) == 3
    assert frb.vault.write(store, ring, dest_start=3, source=(0, 2)) == 2
    assert frb.vault.length(store) == 0
    frb.vault.set_length(store, 5)
    assert frb.vault.read(store)["t"].tolist() == [[2, 3, 4, 5, 6]]
    assert frb.vault.append(store, ring, source=(4, 1)) == 2
    assert frb.vault.read(store)["t"].tolist() == [[2, 3, 4, 5, 6, 4, 5]]


def test_data_is_matched_by_leaf_names_and_cast_within_its_kind(tmp_path):
    like = {"obs": Obs(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int8))}
    store = frb.vault.create(tmp_path / "v", like)
    # a dict with the NamedTuple's field names; float64 and int64 of the same kind are cast
    data = {"obs": {"x": np.full((2, 2, 4), 1.5), "y": np.full((2, 2), -3, np.int64)}}
    assert frb.vault.append(store, data) == 2
    got = frb.vault.read(store, as_numpy=True)
    assert got["obs"].x.dtype == np.float32 and got["obs"].y.dtype == np.int8
    assert got["obs"].x.tolist() == np.full((2, 2, 4), 1.5).tolist()
    assert got["obs"].y.tolist() == [[-3, -3], [-3, -3]]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(1, 5), st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4
    )
)
def test_appended_rings_read_back_as_a_numpy_model_says(tmp_path, ops):
    path = tmp_path / f"v{next(_COUNTER)}"
    store = frb.vault.create(path, {"t": np.zeros((2, 5), np.int32)})
    model = np.zeros((2, 0), np.int32)
    for i, (t, a, b) in enumerate(ops):
        a, b = min(a, t), min(b, t)
        data = (100 * i + np.arange(2 * t, dtype=np.int32)).reshape(2, t)
        runs = [(a, b)] if a < b else ([(a, t), (0, b)] if a > b else [])
        assert frb.vault.append(store, {"t": data}, source=(a, b)) == sum(e - s for s, e in runs)
        model = np.concatenate([model] + [data[:, s:e] for s, e in runs], axis=1)
    assert frb.vault.length(store) == model.shape[1]
    np.testing.assert_array_equal(frb.vault.read(store, as_numpy=True)["t"], model)


_COUNTER = itertools.count()


# ------------------------------------------------------------------------------ core buffers
def _adds(sizes, envs=2):
    """``[num_envs, T]`` batches whose values count up from 0 (step i of env e: 1000e + i)."""
    out, start = [], 0
    for t in sizes:
        steps = start + np.arange(t)
        v = (1000 * np.arange(envs)[:, None] + steps[None, :]).astype(np.int32)
        out.append({"t": v, "obs": np.repeat(v[..., None], 3, -1).astype(np.float32)})
        start += t
    return out


RING = frb.ReplayBuffer(capacity=8, ndim=2)
RING_ADD = jax.jit(RING.add, donate_argnums=0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@settings(max_examples=8)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), steps=st.integers(0, 4))
def test_buffer_items_are_the_newest_steps_oldest_first(jit, sizes, steps):
    rb = RING
    add = RING_ADD if jit else rb.add
    state = rb.init({"t": jnp.zeros(2, jnp.int32), "obs": jnp.zeros((2, 3))})
    batches = _adds(sizes)
    for b in batches:
        state = add(state, jax.tree_util.tree_map(jnp.asarray, b))
    everything = concat(batches)
    held = min(everything["t"].shape[1], 4)
    steps = min(steps, held)
    got = frb.vault.buffer_items(rb, state, steps)
    want = jax.tree_util.tree_map(lambda x: x[:, x.shape[1] - steps :], everything)
    assert_exact({k: got[k] for k in want}, want)
    assert frb.vault.buffer_items(rb, state)["t"].shape == (2, held)


def test_append_buffer_keeps_every_step_across_wraps_and_read_buffer_restores(tmp_path):
    rb = frb.ReplayBuffer(capacity=8, ndim=2, batch_size=4)
    state = rb.init({"t": jnp.zeros(2, jnp.int32), "obs": jnp.zeros((2, 3))})
    store = frb.vault.create(tmp_path / "v", frb.vault.structure(rb, state))
    assert frb.vault.structure(rb, state)["obs"].shape == (2, 4, 3)
    batches = _adds([3, 4, 1, 2, 4])
    add = jax.jit(rb.add, donate_argnums=0)
    for b in batches:
        state = add(state, jax.tree_util.tree_map(jnp.asarray, b))
        assert frb.vault.append_buffer(store, rb, state, steps=b["t"].shape[1]) == b["t"].shape[1]
    everything = concat(batches)
    assert_exact(frb.vault.read(store, as_numpy=True), everything)
    # into a buffer that holds all of it; into one whose rows keep the newest 3 of the 7
    # steps percentiles (0, 50) select
    big = frb.ReplayBuffer(capacity=40, ndim=2, batch_size=4)
    restored = frb.vault.read_buffer(store, big)
    assert int(big.size(restored)) == 28
    assert_exact(frb.vault.buffer_items(big, restored), everything)
    small = frb.ReplayBuffer(capacity=6, ndim=2, batch_size=2)
    part = frb.vault.read_buffer(store, small, percentiles=(0, 50))
    assert_exact(
        frb.vault.buffer_items(small, part), jax.tree_util.tree_map(lambda x: x[:, 4:7], everything)
    )
    sample, _ = big.sample(restored, jax.random.key(0))
    assert bool(sample.mask.all())


# ------------------------------------------------------------------------------ flashbax
def _flashbax():
    vault = pytest.importorskip("flashbax.vault.vault")
    from flashbax.buffers.trajectory_buffer import TrajectoryBufferState

    return vault.Vault, TrajectoryBufferState


def _fbx_like():
    like = nested(
        envs=2, time=4, dtypes=("float32", "bfloat16", "int8", "uint8", "bool", "int32", "float16")
    )
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), like)


def test_a_vault_written_by_flashbax_loads_exactly(tmp_path, capsys):
    Vault, State = _flashbax()
    like = _fbx_like()
    v = Vault("fbx", like, rel_dir=str(tmp_path), vault_uid="0", metadata={"env": "x"})
    ring = [values(like, 4, seed) for seed in range(3)]
    written = []
    # the ring: a full first pass, then two wrapped writes from the last received index
    for i, (data, head) in enumerate(zip(ring, (0, 3, 1))):
        state = State(
            experience=jax.tree_util.tree_map(jnp.asarray, data),
            current_index=jnp.int32(head),
            is_full=jnp.bool_(True),
        )
        written.append(v.write(state, source_interval=(0, 4)) if i == 0 else v.write(state))
    assert written == [4, 3, 2]
    want = jax.tree_util.tree_map(np.asarray, v.read().experience)
    capsys.readouterr()
    store = frb.vault.open(tmp_path / "fbx" / "0", like=like)
    assert frb.vault.length(store) == v.vault_index == 9 and store.metadata == {"env": "x"}
    assert_exact(frb.vault.read(store, as_numpy=True), want)
    # 4 steps, then [0, 3) of the second ring, then [3, 4) and [0, 1) of the third
    model = concat(
        [
            ring[0],
            jax.tree_util.tree_map(lambda x: x[:, 0:3], ring[1]),
            jax.tree_util.tree_map(lambda x: np.concatenate([x[:, 3:], x[:, :1]], 1), ring[2]),
        ]
    )
    assert_exact(frb.vault.read(store, as_numpy=True), model)
    for kwargs in ({"timesteps": 5}, {"percentiles": (10, 60)}):
        assert_exact(
            frb.vault.read(store, as_numpy=True, **kwargs),
            jax.tree_util.tree_map(np.asarray, v.read(**kwargs).experience),
        )
    no_like = frb.vault.read(frb.vault.open(tmp_path / "fbx" / "0"), as_numpy=True)
    flashbax_no_like = Vault("fbx", rel_dir=str(tmp_path), vault_uid="0").read().experience
    assert_exact(no_like, jax.tree_util.tree_map(np.asarray, flashbax_no_like))


def test_a_vault_we_write_loads_exactly_in_flashbax_and_both_append(tmp_path, capsys):
    Vault, State = _flashbax()
    like = _fbx_like()
    store = frb.vault.create(tmp_path / "ours" / "0", like, metadata={"seed": 1})
    parts = [values(like, t, seed) for seed, t in enumerate((4, 2, 3))]
    for p in parts:
        frb.vault.append(store, p)
    v = Vault("ours", like, rel_dir=str(tmp_path), vault_uid="0")
    assert v.vault_index == 9
    assert_exact(jax.tree_util.tree_map(np.asarray, v.read().experience), concat(parts))
    # flashbax appends to our vault; we read its steps after ours
    more = values(like, 4, 7)
    v.write(
        State(
            experience=jax.tree_util.tree_map(jnp.asarray, more),
            current_index=jnp.int32(2),
            is_full=jnp.bool_(False),
        )
    )
    capsys.readouterr()
    assert frb.vault.length(store) == 11
    assert_exact(
        frb.vault.read(store, as_numpy=True),
        concat(parts + [jax.tree_util.tree_map(lambda x: x[:, :2], more)]),
    )


def test_files_are_flashbaxs_metadata_and_zarr_specs(tmp_path, capsys):
    Vault, _ = _flashbax()
    like = _fbx_like()
    meta = {"seed": 1, "gamma": np.float32(0.5), "tags": ["a", 2]}
    for compression in (None, {"id": "zstd", "level": 3}):
        uid = "z" if compression else "g"
        Vault(
            "fbx",
            like,
            rel_dir=str(tmp_path),
            vault_uid=uid,
            metadata=meta,
            compression=compression,
        )
        ours = frb.vault.create(
            tmp_path / "ours" / uid, like, metadata=meta, compression=compression
        )
        theirs = frb.vault.open(tmp_path / "fbx" / uid, like=like)
        read = [
            json.loads((p / "metadata.json").read_text())
            for p in (tmp_path / "fbx" / uid, tmp_path / "ours" / uid)
        ]
        assert read[0] == read[1]
        for a, b in zip(ours._arrays + (ours._index,), theirs._arrays + (theirs._index,)):
            assert a.spec().to_json()["metadata"] == b.spec().to_json()["metadata"]
        assert theirs._arrays[0].spec().to_json()["metadata"]["compressor"] == (
            compression or frb.vault.DEFAULT_COMPRESSION
        )
    capsys.readouterr()


def test_a_bare_array_is_a_vault_both_ways(tmp_path, capsys):
    Vault, State = _flashbax()
    store = frb.vault.create(tmp_path / "a" / "ours", np.zeros((1, 5), np.float32))
    frb.vault.append(store, np.arange(5, dtype=np.float32)[None])
    exact = Vault("a", rel_dir=str(tmp_path), vault_uid="ours").read().experience
    assert np.asarray(exact).tolist() == [[0, 1, 2, 3, 4]]
    v = Vault("a", jnp.zeros((1, 5)), rel_dir=str(tmp_path), vault_uid="fbx")
    v.write(
        State(
            experience=jnp.arange(5.0)[None], current_index=jnp.int32(3), is_full=jnp.bool_(False)
        )
    )
    assert frb.vault.read(frb.vault.open(tmp_path / "a" / "fbx")).tolist() == [[0, 1, 2]]
    capsys.readouterr()


def test_flashbaxs_first_metadata_format_opens(tmp_path):
    like = {"obs": Obs(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int8))}
    store = frb.vault.create(tmp_path / "v", like)
    data = values(like, 3, 0)
    frb.vault.append(store, data)
    file = tmp_path / "v" / "metadata.json"
    meta = json.loads(file.read_text())
    old = jax.tree_util.tree_map(
        lambda s, d: [s, d], meta.pop("structure_shape"), meta.pop("structure_dtype")
    )
    file.write_text(json.dumps({"version": 1.0, "structure": old}))
    assert_exact(frb.vault.read(frb.vault.open(tmp_path / "v", like=like), as_numpy=True), data)


# ------------------------------------------------------------------------------ errors
def test_missing_existing_and_unstorable_vaults_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vault at .*nowhere.*frb.vault.create"):
        frb.vault.open(tmp_path / "nowhere")
    frb.vault.create(tmp_path / "v", {"a": np.zeros((1, 2))})
    with pytest.raises(FileExistsError, match="already exists.*frb.vault.open"):
        frb.vault.create(tmp_path / "v", {"a": np.zeros((1, 2))})
    with pytest.raises(
        ValueError,
        match=r"\['obs'\]\[0\] and \['obs'\]\[1\] would share the "
        r"datastore 'obs\.\.'.*NamedTuple",
    ):
        frb.vault.create(tmp_path / "t", {"obs": (np.zeros((1, 2)), np.zeros((1, 2)))})
    with pytest.raises(ValueError, match=r"leaf \['r'\] has shape \(4,\).*\[num_envs, time"):
        frb.vault.create(tmp_path / "t", {"r": np.zeros(4)})
    with pytest.raises(ValueError, match="do not share one num_envs"):
        frb.vault.create(tmp_path / "t", {"a": np.zeros((1, 2)), "b": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="reserved.*version"):
        frb.vault.create(tmp_path / "t", {"a": np.zeros((1, 2))}, metadata={"version": 3})
    with pytest.raises(ValueError, match="compression=.*zarr v2 compressor"):
        frb.vault.create(tmp_path / "t", {"a": np.zeros((1, 2))}, compression={"id": "nope"})
    # a failed creation leaves nothing behind, not even its staging directory
    assert sorted(os.listdir(tmp_path)) == ["v"]


def test_a_template_that_differs_names_the_leaf(tmp_path):
    like = {"obs": np.zeros((2, 3, 4), np.float32), "act": np.zeros((2, 3), np.int32)}
    frb.vault.create(tmp_path / "v", like)
    frb.vault.open(tmp_path / "v", like={**like, "obs": np.zeros((2, 9, 4), np.float32)})
    with pytest.raises(TypeError, match=r"leaf \['act'\] has dtype int8, expected int32"):
        frb.vault.open(tmp_path / "v", like={**like, "act": np.zeros((2, 3), np.int8)})
    with pytest.raises(
        ValueError,
        match=r"leaf \['obs'\] has shape \(2, 3, 5\), expected "
        r"\(2, T, 4\)",
    ):
        frb.vault.open(tmp_path / "v", like={**like, "obs": np.zeros((2, 3, 5), np.float32)})
    with pytest.raises(ValueError, match=r"holds leaves \['act\.'\] that the template lacks"):
        frb.vault.open(tmp_path / "v", like={"obs": like["obs"]})
    with pytest.raises(ValueError, match=r"leaf \['rew'\] \(datastore 'rew\.'\) is not in"):
        frb.vault.open(tmp_path / "v", like={**like, "rew": np.zeros((2, 3))})


def test_data_that_differs_names_the_leaf(tmp_path):
    like = {"obs": np.zeros((2, 3, 4), np.float32), "act": np.zeros((2, 3), np.int8)}
    store = frb.vault.create(tmp_path / "v", like)
    with pytest.raises(
        TypeError,
        match=r"leaf \['act'\] has dtype float32, expected int8 "
        r"\(the vault's, or a dtype of the same kind",
    ):
        frb.vault.append(store, {**like, "act": np.zeros((2, 3), np.float32)})
    with pytest.raises(
        ValueError,
        match=r"leaf \['obs'\] has shape \(3, 3, 4\), expected "
        r"\(2, T, 4\)",
    ):
        frb.vault.append(store, {**like, "obs": np.zeros((3, 3, 4), np.float32)})
    with pytest.raises(ValueError, match=r"lacks \['act\.'\] and has \['rew\.'\]"):
        frb.vault.append(store, {"obs": like["obs"], "rew": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="different time lengths"):
        frb.vault.append(store, {**like, "act": np.zeros((2, 2), np.int8)})
    with pytest.raises(OverflowError, match=r"leaf \['act'\] has values in \[0, 300\]"):
        frb.vault.append(store, {**like, "act": np.array([[0, 300, 1]] * 2)})
    with pytest.raises(ValueError, match=r"source\[1\] must be a Python int in \[0, 3\], got 4"):
        frb.vault.append(store, like, source=(0, 4))
    with pytest.raises(TypeError, match=r"leaf \['act'\] is traced .* outside jit"):
        jax.jit(lambda d: frb.vault.append(store, d))(like)
    assert frb.vault.length(store) == 0  # nothing was written by the failed calls
    frb.vault.append(store, like)
    with pytest.raises(ValueError, match="timesteps or percentiles, not both"):
        frb.vault.read(store, timesteps=1, percentiles=(0, 10))
    with pytest.raises(
        ValueError, match=r"timesteps must be a Python int in \[0, 3\].*holds 3 steps"
    ):
        frb.vault.read(store, timesteps=4)
    with pytest.raises(ValueError, match="percentiles must be ascending"):
        frb.vault.read(store, percentiles=(50, 10))


def test_buffer_functions_refuse_other_buffers_and_lost_steps(tmp_path):
    flat = frb.ReplayBuffer(capacity=8)
    state = flat.init({"t": jnp.zeros((), jnp.int32)})
    with pytest.raises(ValueError, match="ndim=2.*got ndim=1.*reshape"):
        frb.vault.buffer_items(flat, state)
    rb = frb.ReplayBuffer(capacity=8, ndim=2)
    state = rb.add(rb.init({"t": jnp.zeros(2, jnp.int32)}), {"t": jnp.zeros((2, 3), jnp.int32)})
    with pytest.raises(
        ValueError, match=r"steps must be a Python int in \[0, 3\].*at least once every 4 steps"
    ):
        frb.vault.buffer_items(rb, state, steps=4)
    store = frb.vault.create(tmp_path / "v", frb.vault.structure(rb, state))
    with pytest.raises(ValueError, match="nothing to read"):
        frb.vault.read_buffer(store, rb)


def _damaged(tmp_path, name="v"):
    like = {"obs": np.zeros((2, 3, 4), np.float32), "act": np.zeros((2, 3), np.int8)}
    store = frb.vault.create(tmp_path / name, like)
    frb.vault.append(store, values(like, 3, 0))
    return tmp_path / name, like


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "missing", "no fields", "version", "bad shape", "dtype disagrees"],
)
def test_damaged_metadata_raises_a_vault_error_naming_it(tmp_path, damage):
    path, _ = _damaged(tmp_path)
    file = path / "metadata.json"
    text = file.read_text()
    meta = json.loads(text)
    edits = {
        "truncated": lambda: file.write_text(text[: len(text) // 2]),
        "not json": lambda: file.write_bytes(b"\xff\xfe\x00garbage"),
        "missing": lambda: file.unlink(),
        "no fields": lambda: file.write_text(json.dumps({"version": 1.2})),
        "version": lambda: file.write_text(json.dumps({**meta, "version": 2.0})),
        "bad shape": lambda: file.write_text(
            json.dumps(
                {**meta, "structure_shape": {**meta["structure_shape"], "act": "__import__('os')"}}
            )
        ),
        "dtype disagrees": lambda: file.write_text(
            json.dumps({**meta, "structure_dtype": {**meta["structure_dtype"], "act": "int16"}})
        ),
    }
    edits[damage]()
    expected = {
        "missing": "holds no metadata.json",
        "version": "format version 2.0",
        "bad shape": "records the shape of leaf 'act.' as \"__import__",
        "dtype disagrees": "datastore 'act.' .* holds int8.*records int16",
    }
    with pytest.raises(VaultError, match=expected.get(damage, "metadata.json")):
        frb.vault.open(path)


@pytest.mark.parametrize("target", ["data", "manifest"])
def test_truncated_data_files_raise_a_vault_error(tmp_path, target):
    path, like = _damaged(tmp_path)
    files = (
        [path / "manifest.ocdbt"]
        if target == "manifest"
        else [path / "d" / f for f in os.listdir(path / "d")]
    )
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(VaultError, match=f"vault at {path}.*damaged"):
        frb.vault.read(frb.vault.open(path, like=like))


def test_without_tensorstore_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ImportError, match=r'pip install "functional-rb\[vault\]"'):
        frb.vault.create(tmp_path / "v", {"a": np.zeros((1, 2))})
    with pytest.raises(ImportError, match=r"functional_rb.vault.open: .*tensorstore"):
        frb.vault.open(tmp_path / "v")
