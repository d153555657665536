"""Faults caused on purpose: a process saving checkpoints is killed (SIGKILL) at random moments,
and the files of a checkpoint are damaged (emptied, truncated, extended, byte flipped, deleted)
one at a time. ``load`` must give the previous or the new checkpoint exactly, never a mix, or
raise a ``CheckpointError`` naming the damaged file; a failed load writes nothing anywhere.

The saving processes start from a forkserver that imported functional_rb (no JAX backend yet),
so each trial costs a fork, not an interpreter start. The long versions (``FRB_SLOW=1``) run 50
kills per rename strategy and flip every byte of the small files; print their outcome counts
with ``-s``.
"""

import os
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kill_trials import forkserver, kill_at_random
from _trees import bits

import functional_rb as frb
from functional_rb.checkpoint import CheckpointError, NoManifestError

# ------------------------------------------------------------------ killed while saving
_RB = frb.ReplayBuffer(2048, sampler=frb.PrioritizedSampler(alpha=0.6, beta=0.4), batch_size=4)
_EXAMPLE = {"obs": jnp.zeros(64, jnp.float32), "a": jnp.int32(0), "done": jnp.bool_(False)}


def _state(k):
    """The k-th state a saving process writes: a prioritized buffer's state (about 0.6 MB in 8
    leaves) whose every leaf holds k, so a mix of two saves cannot pass for one."""
    shapes = jax.eval_shape(lambda: _RB.init(_EXAMPLE))
    return jax.tree_util.tree_map(
        lambda s: np.full(s.shape, k % 2 if s.dtype == bool else k, s.dtype), shapes
    )


def _saving_child(path, fallback, conn):
    if fallback:  # a filesystem without renameat2(RENAME_EXCHANGE): two renames
        from functional_rb.checkpoint import atomic as _atomic

        _atomic._RENAMEAT2 = None
    _state(1)  # traced once before the clock starts
    conn.send("ready")
    k = 1
    while True:
        frb.checkpoint.save(path, _state(k))
        conn.send(k)
        k += 1


def _kill_one_save(directory, rng, fallback):
    """One trial: a child saves states 1, 2, ... over a checkpoint of state 0 and is killed
    after a random delay. Returns "old" (the last save it reported) or "new" (the save it was
    in, completed but not reported); anything else fails."""
    path = os.path.join(directory, "ck")
    frb.checkpoint.save(path, _state(0))
    ready, last = kill_at_random(
        forkserver("functional_rb"),
        _saving_child,
        (path, fallback),
        rng.uniform(0.0, 0.6),
        ready_s=120,
    )
    assert ready, "the saving child did not start"
    aside = not os.path.exists(path)  # killed between the two renames of the fallback
    loaded = frb.checkpoint.load(path)
    k = int(
        next(
            np.asarray(x).reshape(-1)[0]
            for x in jax.tree_util.tree_leaves(loaded)
            if x.dtype != bool
        )
    )
    assert bits(loaded) == bits(_state(k)), f"the loaded checkpoint mixes saves (first leaf: {k})"
    assert k in (last, last + 1), f"loaded save {k}, the child reported {last} as its last"
    leftovers = [n for n in os.listdir(directory) if n != "ck"]
    frb.checkpoint.save(path, _state(0))  # the next save removes what the killed one left
    assert os.listdir(directory) == ["ck"], os.listdir(directory)
    return ("old" if k == last else "new"), bool(leftovers), aside


def _kill_trials(tmp_path, trials, fallback, seed):
    rng = random.Random(seed)
    counts = {"old": 0, "new": 0, "left files": 0, "aside": 0}
    start = time.perf_counter()
    for i in range(trials):
        d = tmp_path / f"t{i}"
        d.mkdir()
        outcome, left, aside = _kill_one_save(str(d), rng, fallback)
        counts[outcome] += 1
        counts["left files"] += left
        counts["aside"] += aside
    print(
        f"\nsave killed ({'two renames' if fallback else 'exchange'}): {trials} trials, "
        f"{counts['old']} old, {counts['new']} new, 0 errors, 0 mixed; "
        f"{counts['left files']} left staging files for the next save to remove, "
        f"{counts['aside']} between the two renames (read from the -old name) "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return counts


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two_renames"])
def test_a_save_killed_at_a_random_moment_leaves_the_old_or_the_new_checkpoint(tmp_path, fallback):
    _kill_trials(tmp_path, 2, fallback, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two_renames"])
def test_a_save_killed_at_a_random_moment_long(tmp_path, fallback):
    counts = _kill_trials(tmp_path, 50, fallback, seed=2)
    assert counts["old"] and counts["new"], counts  # the kills landed before and after renames


# ------------------------------------------------------------------ damaged files
def _damages(size, every_byte=False):
    """``(what, bytes -> bytes or None to delete)`` for a file of ``size`` bytes. The long
    version flips every byte of a file up to 64 KiB (a manifest) and 512 of a larger one."""
    out = [("deleted", None), ("one byte appended", lambda b: b + b"\0")]
    if size:
        out += [
            ("emptied", lambda b: b""),
            ("truncated by one byte", lambda b: b[:-1]),
            ("truncated to half", lambda b: b[: len(b) // 2]),
        ]
        positions = sorted({0, size // 2, size - 1})
        if every_byte:
            positions = (
                range(size)
                if size <= 1 << 16
                else sorted(random.Random(size).sample(range(size), 512))
            )
        for pos in positions:
            out.append(
                (f"byte {pos} flipped", lambda b, p=pos: b[:p] + bytes([b[p] ^ 0xFF]) + b[p + 1 :])
            )
    return out


def _files(path):
    return sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names)


def _damage_every_file(path, load, check_intact, every_byte=False):
    """Damage each file of the checkpoint ``path`` in every way; ``load()`` must raise a
    CheckpointError naming that file; ``check_intact()`` that nothing was written."""
    tried = 0
    for full in _files(path):
        with open(full, "rb") as f:
            original = f.read()
        for what, damage in _damages(len(original), every_byte):
            if damage is None:
                os.remove(full)
            else:
                with open(full, "wb") as f:
                    f.write(damage(original))
            try:
                load()
            except CheckpointError as e:
                assert e.file == full, f"{what} {full}: the error names {e.file}: {e}"
                assert full in str(e), f"{what} {full}: the message does not name it: {e}"
                if os.path.basename(full) == frb.checkpoint.MANIFEST and damage is None:
                    assert isinstance(e, NoManifestError)
                else:
                    assert not isinstance(e, NoManifestError), (what, full, e)
            else:
                raise AssertionError(f"{what} {full}: loaded without an error")
            finally:
                with open(full, "wb") as f:
                    f.write(original)
            check_intact()
            tried += 1
    return tried


def _device_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    state = _RB.add(
        _RB.init(_EXAMPLE),
        {
            "obs": rng.normal(size=(40, 64)).astype(np.float32),
            "a": np.arange(40, dtype=np.int32),
            "done": rng.random(40) < 0.5,
        },
    )
    state = _RB.update(state, jnp.arange(10), jnp.arange(10, dtype=jnp.float32) + 1)
    tree = {"rb": state, "key": jax.random.key(3)}
    frb.checkpoint.save(tmp_path / "ck", tree)
    return tree


@pytest.mark.parametrize(
    "every_byte",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["some_bytes", "every_byte"],
)
def test_every_damaged_file_of_a_checkpoint_is_named(tmp_path, every_byte):
    tree = _device_checkpoint(tmp_path)
    like = {"rb": _RB.init(_EXAMPLE), "key": jax.random.key(0)}
    n = _damage_every_file(
        tmp_path / "ck",
        lambda: frb.checkpoint.load(tmp_path / "ck", like=like),
        lambda: None,
        every_byte,
    )
    assert n >= 8 * len(_files(tmp_path / "ck"))
    print(f"\n{n} damaged checkpoints, each refused with a CheckpointError naming the file")
    back = frb.checkpoint.load(tmp_path / "ck")  # every file restored: loads as saved
    assert bits(back) == bits(tree)


def _memmap_buffer(path):
    return frb.ReplayBuffer(
        16, storage=frb.MemmapStorage(path), sampler=frb.SamplerWithoutReplacement(), batch_size=4
    )


def _ids(i, n):
    ids = np.arange(i, i + n, dtype=np.int32)
    return {"id": ids, "obs": np.repeat(ids[:, None], 3, 1).astype(np.float32)}


MM_ITEM = {"id": jnp.int32(0), "obs": jnp.zeros(3, jnp.float32)}


def test_damaged_checkpoints_of_memmap_states_write_nothing(tmp_path):
    """A memmap state's checkpoint (items copied) and its storage's own commit (``state/``):
    each damaged file is named, and the storage the load would write into keeps its items."""
    rb = _memmap_buffer(tmp_path / "src")
    s = rb.add(rb.init(MM_ITEM), _ids(0, 10))
    _, s = rb.sample(s, jax.random.key(0))
    frb.checkpoint.save(tmp_path / "ck", s)
    target = _memmap_buffer(tmp_path / "dst")
    t = target.add(target.init(MM_ITEM), _ids(100, 16))
    target.storage.checkpoint(t)

    def intact():
        np.testing.assert_array_equal(target.get(t, jnp.arange(16))["id"], np.arange(100, 116))

    n = _damage_every_file(
        tmp_path / "ck", lambda: frb.checkpoint.load(tmp_path / "ck", like=t), intact
    )
    assert n > 0
    n = _damage_every_file(
        tmp_path / "dst" / "state", lambda: target.storage.restore(target.init(MM_ITEM)), intact
    )
    assert n > 0
    loaded = frb.checkpoint.load(tmp_path / "ck", like=t)
    np.testing.assert_array_equal(target.get(loaded, jnp.arange(10))["id"], np.arange(10))
    np.testing.assert_array_equal(loaded.sampler.perm, s.sampler.perm)
