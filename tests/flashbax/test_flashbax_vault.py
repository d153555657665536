"""functional_rb.flashbax.vault.Vault against flashbax 0.1.3's Vault: the same module names and
signatures, the same results for the same calls (default intervals over a wrapping ring,
explicit intervals, ``dest_start``, reads of every kind), each reading the other's vaults, and
the errors flashbax leaves to tensorstore named by leaf here; and where they differ on purpose:
a full buffer whose ``current_index`` wrapped, whose newest steps flashbax 0.1.3 loses (its
issue #66), run by both."""

import inspect
import warnings
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


# ----------------------------------------------------------------------------- full buffers
# flashbax's issue #66 (upstream #67, after 0.1.3, only warns in some cases): ``write`` reads
# ``[last index, current_index)``, so a full buffer whose ``current_index`` wrapped gives the
# vault nothing (the index back at 0, or where the last write left it) or only the steps after
# index 0. Each case: (buffer, T, steps added between writes, write after every add?, the time
# steps flashbax 0.1.3's vault ends up holding, what its writes return).
WRAPPED = {
    "exactly full, one write": ("flat", 8, [8], False, [], [0]),
    "wrapped to 3, one write": ("flat", 8, [11], False, [8, 9, 10], [3]),
    "wrapped twice to 0, one write": ("flat", 8, [16], False, [], [0]),
    "a write every T adds": ("flat", 8, [8, 8, 8], True, [], [0, 0, 0]),
    "a write every add": ("flat", 8, [1] * 20, True, list(range(20)), [1] * 20),
    "trajectories of T, a write each": ("trajectory", 6, [6, 6, 6], True, [], [0, 0, 0]),
    "trajectories of 4, one write": ("trajectory", 6, [4, 4], False, [6, 7], [2]),
}


def make_buffer(lib, kind, time):
    """A buffer of ``lib`` (flashbax or ours) with ``ENVS`` rows of ``time`` steps."""
    if kind == "trajectory":
        return lib.make_trajectory_buffer(
            add_batch_size=ENVS,
            sample_batch_size=1,
            sample_sequence_length=1,
            period=1,
            min_length_time_axis=1,
            max_length_time_axis=time,
        )
    make = lib.make_prioritised_flat_buffer if kind == "prioritised flat" else lib.make_flat_buffer
    return make(max_length=ENVS * time, min_length=2, sample_batch_size=1, add_batch_size=ENVS)


def fill_and_write(lib, vault_cls, rel_dir, kind, time, adds, write_each):
    """Add time steps ``0, 1, ...`` (env ``e`` of step ``s`` holds ``10 * s + e``), ``adds[i]``
    of them at a time, writing to a new vault after each batch (``write_each``) or once at the
    end. Returns what the writes returned, the time steps the vault holds in its order, and the
    messages of the warnings raised."""
    buffer = make_buffer(lib, kind, time)
    state = buffer.init({"t": jnp.int32(0)})
    vault = vault_cls("run", state.experience, rel_dir=rel_dir, vault_uid="0")
    written, step, env = [], 0, np.arange(ENVS, dtype=np.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in adds:
            steps = 10 * np.arange(step, step + n, dtype=np.int32)
            if kind == "trajectory":
                state = buffer.add(state, {"t": jnp.asarray(steps[None] + env[:, None])})
            else:
                for s in steps:
                    state = buffer.add(state, {"t": jnp.asarray(s + env)})
            step += n
            if write_each:
                written.append(vault.write(state))
        if not write_each:
            written.append(vault.write(state))
    assert bool(state.is_full)
    held = np.asarray(vault.read().experience["t"]) if vault.vault_index else np.zeros((ENVS, 0))
    np.testing.assert_array_equal(held, held[:1] + env[:, None])  # every row in step
    return written, (held[0] // 10).astype(int).tolist(), [str(w.message) for w in caught]


def newest(time, adds, write_each):
    """The time steps a vault keeps when nothing the buffer still holds is lost."""
    total = sum(adds)
    if write_each and max(adds) <= time:
        return list(range(total))
    return list(range(max(0, total - time), total))


@pytest.mark.parametrize("case", WRAPPED)
def test_a_full_buffer_whose_index_wrapped_is_written_newest_steps_in_order(case, tmp_path, capsys):
    import functional_rb.flashbax as fbx

    kind, time, adds, write_each, _, _ = WRAPPED[case]
    written, held, caught = fill_and_write(fbx, Vault, str(tmp_path), kind, time, adds, write_each)
    assert held == newest(time, adds, write_each)
    assert sum(written) == len(held) and caught == []
    # the files are flashbax's: flashbax reads the same steps
    theirs = fbx_vault.Vault("run", rel_dir=str(tmp_path), vault_uid="0").read()
    assert (np.asarray(theirs.experience["t"])[0] // 10).tolist() == held
    capsys.readouterr()


@pytest.mark.parametrize("case", WRAPPED)
def test_flashbax_0_1_3_loses_the_steps_that_ours_keeps(case, tmp_path, capsys):
    """The same program run by flashbax itself: its vault holds only ``WRAPPED``'s steps."""
    import flashbax

    import functional_rb.flashbax as fbx

    kind, time, adds, write_each, fbx_held, fbx_written = WRAPPED[case]
    theirs = fill_and_write(
        flashbax, fbx_vault.Vault, str(tmp_path / "fbx"), kind, time, adds, write_each
    )
    mine = fill_and_write(fbx, Vault, str(tmp_path / "ours"), kind, time, adds, write_each)
    assert theirs[:2] == (fbx_written, fbx_held)
    assert mine[1] == newest(time, adds, write_each)
    lost = sorted(set(mine[1]) - set(theirs[1]))
    assert set(theirs[1]) <= set(mine[1])
    if case == "a write every add":  # one step per write: flashbax loses nothing either
        assert lost == []
    else:
        assert lost and not theirs[2]  # flashbax 0.1.3: silently, no warning
    capsys.readouterr()


@pytest.mark.parametrize("kind", ["flat", "prioritised flat"])
def test_more_steps_than_the_buffer_holds_warns_and_keeps_what_it_holds(kind, tmp_path, capsys):
    """5 steps, a write, 10 more (T = 8): 2 were overwritten before the second write. Ours
    writes the 8 the buffer holds and warns; flashbax 0.1.3 writes 2 of them, silently."""
    import flashbax

    import functional_rb.flashbax as fbx

    written, held, caught = fill_and_write(fbx, Vault, str(tmp_path / "o"), kind, 8, [5, 10], True)
    assert written == [5, 8] and held == [0, 1, 2, 3, 4, *range(7, 15)]
    assert len(caught) == 1 and caught[0].startswith("functional_rb.flashbax.vault.Vault.write:")
    assert "10 time steps were added" in caught[0] and "the oldest 2 were overwritten" in caught[0]
    assert "at vault index 5" in caught[0] and "at least once every 7 steps" in caught[0]
    with jax.numpy_rank_promotion("allow"):  # flashbax's prioritised add broadcasts ranks
        theirs = fill_and_write(
            flashbax, fbx_vault.Vault, str(tmp_path / "f"), kind, 8, [5, 10], True
        )
    assert theirs == ([5, 2], [0, 1, 2, 3, 4, 13, 14], [])
    capsys.readouterr()


def test_whole_laps_between_writes_are_counted_by_running_index_only(tmp_path, capsys):
    """Two full laps (16 steps, T = 8) between writes of a full buffer: a prioritised state's
    ``running_index`` counts them (a warning: 8 lost); a plain state shows only that the
    newest step changed, so its 8 newest are written without a warning. Write at least once
    every T - 1 steps to lose nothing with either."""
    import functional_rb.flashbax as fbx

    for kind, warned in (("prioritised flat", 1), ("flat", 0)):
        written, held, caught = fill_and_write(
            fbx, Vault, str(tmp_path / kind), kind, 8, [8, 16], True
        )
        assert written == [8, 8] and held == [*range(8), *range(16, 24)]
        assert len(caught) == warned
    capsys.readouterr()
