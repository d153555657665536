"""functional_rb.flashbax.vault.Vault against flashbax 0.1.3's Vault: the same module names and
signatures, the same results for the same calls (default intervals over a wrapping ring,
explicit intervals, ``dest_start``, reads of every kind), each reading the other's vaults, and
the errors flashbax leaves to tensorstore named by leaf here."""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferState
from functional_rb.flashbax.vault import Vault
from functional_rb.flashbax.vault import vault as ours

pytest.importorskip("tensorstore")
fbx_vault = pytest.importorskip("flashbax.vault.vault")
FbxState = pytest.importorskip("flashbax.buffers.trajectory_buffer").TrajectoryBufferState

LENGTH, ENVS = 6, 2


class Obs(NamedTuple):
    x: jax.Array
    y: jax.Array


def experience(fill=0):
    """A buffer's experience, leaves ``[ENVS, LENGTH, ...]`` of several dtypes."""
    t = np.full((ENVS, LENGTH), fill)
    return {
        "obs": Obs(
            jnp.asarray(np.repeat(t[..., None], 3, -1), jnp.float32), jnp.asarray(t, jnp.int8)
        ),
        "reward": jnp.asarray(t, jnp.bfloat16),
        "done": jnp.asarray(t % 2 == 1),
        "action": jnp.asarray(t, jnp.int32),
    }


def exact(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def scenario(vault_cls, state_cls, rel_dir):
    """One program's calls on a Vault; returns everything it observed."""
    v = vault_cls("run", experience(), rel_dir=rel_dir, vault_uid="0", metadata={"algo": 1})
    ring, index, full, step, seen = np.zeros((ENVS, LENGTH), np.int64), 0, False, 0, []

    def state():
        return state_cls(
            experience=experience(ring), current_index=jnp.int32(index), is_full=jnp.bool_(full)
        )

    def add(steps):
        nonlocal index, step, full
        for _ in range(steps):
            ring[:, index] = 10 * step + np.arange(ENVS)
            index, step = (index + 1) % LENGTH, step + 1
            full = full or index == 0

    for steps in (2, 3, 5, 1, 4, 3):  # the ring wraps three times
        add(steps)
        seen.append(v.write(state()))
    seen.append(v.write(state()))  # nothing new
    seen.append(v.write(state(), source_interval=(1, 3)))  # explicit
    seen.append(v.write(state(), source_interval=(4, 2), dest_start=2))  # wraps; overwrites
    add(2)
    seen.append(v.write(state(), source_interval=(3, 3)))  # empty: the last index stays
    seen.append(v.write(state()))  # so these 2 steps are written
    seen.append(v.vault_index)
    reads = [
        v.read(),
        v.read(timesteps=5),
        v.read(percentiles=(25, 75)),
        v.read(timesteps=3, percentiles=(0, 10)),
    ]
    return seen, reads


def test_the_same_calls_give_flashbaxs_results_and_files(tmp_path, capsys):
    mine = scenario(Vault, TrajectoryBufferState, str(tmp_path / "ours"))
    theirs = scenario(fbx_vault.Vault, FbxState, str(tmp_path / "fbx"))
    assert mine[0] == theirs[0] == [2, 3, 5, 1, 4, 3, 0, 2, 4, 0, 2, 26]
    for a, b in zip(mine[1], theirs[1]):
        assert isinstance(a, TrajectoryBufferState)
        exact(a.experience, b.experience)
        exact(a.current_index, b.current_index)
        exact(a.is_full, b.is_full)
    out = capsys.readouterr().out
    assert out.count("New vault created at") == 2 and "at least every 5 timesteps" in out
    # each opens the other's vault, with and without the structure, and reads the same
    for cls, where in ((Vault, "fbx"), (fbx_vault.Vault, "ours")):
        for like in (experience(), None):
            other = cls("run", like, rel_dir=str(tmp_path / where), vault_uid="0")
            assert other.vault_index == 26
            exact(
                other.read().experience,
                Vault("run", like, rel_dir=str(tmp_path / where), vault_uid="0").read().experience,
            )
            exact(
                other.read().experience,
                fbx_vault.Vault("run", like, rel_dir=str(tmp_path / where), vault_uid="0")
                .read()
                .experience,
            )
    assert "Loading vault found at" in capsys.readouterr().out


def test_names_signatures_and_defaults_are_flashbaxs():
    for name in (
        "DRIVER",
        "METADATA_FILE",
        "TIME_AXIS_MAX_LENGTH",
        "COMPRESSION_DEFAULT",
        "VERSION",
    ):
        assert getattr(ours, name) == getattr(fbx_vault, name), name
    for method in ("__init__", "write", "read"):
        mine = inspect.signature(getattr(Vault, method)).parameters
        theirs = inspect.signature(getattr(fbx_vault.Vault, method)).parameters
        assert [(p.name, p.default, p.kind) for p in mine.values()] == [
            (p.name, p.default, p.kind) for p in theirs.values()
        ], method
    import functional_rb.flashbax as fbx

    assert fbx.vault.Vault is Vault and ours.Vault is Vault


def test_flashbaxs_own_state_class_and_a_relative_rel_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    v = Vault("run", experience(), vault_uid="x")  # rel_dir "vaults" under the cwd
    assert v._base_path == str(tmp_path / "vaults" / "run" / "x")
    state = FbxState(experience=experience(7), current_index=jnp.int32(4), is_full=jnp.bool_(False))
    assert v.write(state) == 4
    exact(v.read().experience, jax.tree_util.tree_map(lambda x: x[:, :4], experience(7)))
    Vault("run", vault_uid="x", compression={"id": "zstd", "level": 1})
    assert "compression settings will be ignored" in capsys.readouterr().out


def test_errors_name_the_leaf_where_flashbax_fails_late(tmp_path, capsys):
    with pytest.raises(ValueError, match="Vault does not exist and no experience_structure"):
        Vault("none", rel_dir=str(tmp_path))
    v = Vault("run", experience(), rel_dir=str(tmp_path), vault_uid="0")
    wrong = {**experience(), "action": jnp.zeros((ENVS, LENGTH), jnp.float32)}
    with pytest.raises(TypeError, match=r"leaf \['action'\] has dtype float32, expected int32"):
        v.write(
            TrajectoryBufferState(
                experience=wrong, current_index=jnp.int32(2), is_full=jnp.bool_(False)
            )
        )
    assert v.vault_index == 0
    with pytest.raises(TypeError, match=r"leaf \['action'\] has dtype float32, expected int32"):
        Vault("run", wrong, rel_dir=str(tmp_path), vault_uid="0")
    with pytest.raises(ValueError, match=r"would share the datastore 'pair\.\.'"):
        Vault("tuple", {"pair": (jnp.zeros((1, 4)), jnp.zeros((1, 4)))}, rel_dir=str(tmp_path))
    assert not (tmp_path / "tuple").exists()
    with pytest.raises(ValueError, match="timesteps must be .*holds 0 steps"):
        v.read(timesteps=3)
    capsys.readouterr()
