"""Checkpoints and dumps written before the package was rehoused load with today's code.

``fixtures/checkpoints_v0`` was written by ``fixtures/make_v0.py`` with the code of commit
199348c, whose manifests named classes by module path (``functional_rb.slices:SliceState``);
today's manifests name them by stable name, and ``functional_rb._internal.names.ALIASES`` maps the
old paths. Each checkpoint must load bit for bit equal to the same recipe run now.
"""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_rb as frb
from functional_rb._internal import names

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OLD = FIXTURES / "checkpoints_v0"
sys.path.insert(0, str(FIXTURES))
import checkpoint_recipes as recipes  # noqa: E402


def _assert_same(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _class_names(path):
    text = (path / "frb_manifest.json").read_text()
    return sorted(
        set(json.loads(text)["meta"] and [w.split('"')[0] for w in text.split('"cls": "')[1:]])
    )


def _generations_from_scratch(state):
    """``state`` as a file written before write generations loads: every slot at generation
    0, the clock at 0, nothing dropped (functional_rb.checkpoint.legacy)."""
    if getattr(state, "generations", None) is None:
        return state
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.generations)
    return dataclasses.replace(state, generations=zeros)


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_old_checkpoint_loads(name):
    assert all(":" in c for c in _class_names(OLD / name))  # written with module paths
    _assert_same(
        frb.checkpoint.load(OLD / name), _generations_from_scratch(recipes.RECIPES[name]())
    )


def test_old_checkpoint_loads_against_a_template(tmp_path):
    state = recipes.prioritized()
    _assert_same(
        frb.checkpoint.load(OLD / "prioritized", like=state), _generations_from_scratch(state)
    )


@pytest.mark.parametrize("name", ["prioritized", "prioritized_slices"])
def test_old_prioritized_checkpoints_get_sound_generations(name):
    """A file from before write generations loads with them (all 0), and they work at once:
    an update from a sample drawn after the load drops the entries a later add rewrote."""
    sampler = (
        frb.PrioritizedSampler(alpha=0.7, beta=0.5)
        if name == "prioritized"
        else frb.PrioritizedSliceSampler(alpha=0.6, beta=0.4, slice_len=2)
    )
    rb = frb.ReplayBuffer(
        capacity=8 if name == "prioritized" else 16, batch_size=4, sampler=sampler
    )  # as the recipes build them
    state = frb.checkpoint.load(OLD / name)
    assert int(rb.dropped_updates(state)) == 0
    sample, state = rb.sample(state, jax.random.key(0))
    assert (np.asarray(sample.generations)[np.asarray(sample.mask)] == 0).all()
    state = rb.add(state, recipes._batch(100, rb.capacity))  # rewrites every slot
    state = rb.update(state, sample, jnp.ones(sample.indices.shape))
    assert int(rb.dropped_updates(state)) == int(np.asarray(sample.mask).sum()) > 0


def test_old_memmap_checkpoint_restores_into_a_new_storage(tmp_path):
    rb, want_rb = recipes.memmap_buffer(tmp_path / "a"), recipes.memmap_buffer(tmp_path / "b")
    got = frb.checkpoint.load(OLD / "memmap", like=rb.init(recipes._item(0)))
    want = recipes._filled(want_rb)
    _assert_same(got.writer, want.writer)
    idx = jnp.arange(8, dtype=jnp.int32)
    _assert_same(rb.get(got, idx), want_rb.get(want, idx))


def test_old_sharded_checkpoint_loads():
    state = frb.checkpoint.load(OLD / "sharded")
    assert isinstance(state, frb.ShardedState)
    x = np.asarray(state.shards.storage.slabs["float32"])
    assert x.shape[-1] == 2 and x[..., :5, :].ravel().tolist() == list(range(10))


def test_new_checkpoints_name_classes_by_stable_name(tmp_path):
    frb.checkpoint.save(tmp_path / "c", recipes.slices())
    found = _class_names(tmp_path / "c")
    assert found and all(":" not in c for c in found)
    assert set(found) <= set(names.ALIASES.values())


def test_every_alias_names_a_registered_class():
    for old, stable in names.ALIASES.items():
        assert names.lookup(old, "test").__name__ == stable.split(".")[-1]


def test_unknown_class_names_are_refused(tmp_path):
    shutil.copytree(OLD / "uniform", tmp_path / "u")
    manifest = tmp_path / "u" / "frb_manifest.json"
    text = manifest.read_text().replace("functional_rb.writers:RoundRobinState", "os:PathLike")
    manifest.write_text(text)
    with pytest.raises(frb.checkpoint.CheckpointError):
        frb.checkpoint.load(tmp_path / "u")  # the manifest's checksum no longer matches


@pytest.mark.parametrize("name", sorted(recipes.ADAPTER_RECIPES))
def test_old_adapter_dumps_load(name, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("tensordict")
    want = recipes.ADAPTER_RECIPES[name]()
    rb = type(want)(
        storage=type(want.storage)(16),
        batch_size=4,
        sampler=type(want.sampler)(
            **(
                {"max_capacity": 16, "alpha": 0.7, "beta": 0.5}
                if "prioritized" in name
                else {"slice_len": 2, "traj_key": "traj"}
            )
        ),
    )
    shutil.copytree(OLD / name, tmp_path / name)
    rb.loads(tmp_path / name)
    assert len(rb) == len(want) == 12
    for key in ("obs", "traj"):
        assert torch.equal(rb[:][key], want[:][key])
    got, expected = rb.sampler.state_dict(), want.sampler.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        a, b = got[key], expected[key]
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, key
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    np.random.seed(0)  # TorchRL's prioritized draws (and the adapters') use NumPy's generator
    a = rb.sample()["index"]
    torch.manual_seed(0)
    np.random.seed(0)
    assert torch.equal(a, want.sample()["index"])


def test_a_users_own_state_class_checkpoints_once_registered(tmp_path):
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Unregistered:
        count: jax.Array

    with pytest.raises(TypeError, match="stable_name"):
        frb.checkpoint.save(tmp_path / "a", {"s": Unregistered(jnp.int32(3))})

    @frb.checkpoint.stable_name("tests.CounterState")
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class CounterState:
        count: jax.Array

    frb.checkpoint.save(tmp_path / "b", {"s": CounterState(jnp.int32(3))})
    back = frb.checkpoint.load(tmp_path / "b")
    assert type(back["s"]) is CounterState and int(back["s"].count) == 3
    with pytest.raises(ValueError, match="already the stable name"):
        frb.checkpoint.stable_name("tests.CounterState")(Unregistered)
