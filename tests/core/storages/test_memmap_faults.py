"""MemmapStorage killed at random moments: a child adds large batches (under ``jax.jit``, or
eagerly: a compiled plan and a NumPy write) to a prioritized buffer and commits with ``rb.storage.checkpoint`` every few adds; it is killed
(SIGKILL) after a random delay, in the middle of an add, of a checkpoint or between them.
Reopening must give exactly the state of a checkpoint the child made (the last it reported, or
the one it was finishing), bit for bit against the same run on a DeviceStorage, with every
stored item whole (no fields of two adds) and the files agreeing with the state. The long
version (``FRB_SLOW=1``) runs 50 kills; print the outcome counts with ``-s``.
"""

import functools
import os
import random
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kill_trials import forkserver, kill_at_random

import functional_rb as frb

C, B, WIDTH, EVERY = 4096, 1024, 512, 6  # capacity, items per add, floats per item, adds/commit
EXAMPLE = {"id": jnp.int32(0), "obs": jnp.zeros(WIDTH, jnp.float32), "tag": jnp.zeros(4, jnp.int16)}


def _batch(k):
    """Add k (1-based): ids (k-1)*B ... k*B-1; every field of an item is derived from its id."""
    ids = np.arange((k - 1) * B, k * B, dtype=np.int32)
    return {
        "id": ids,
        "obs": np.repeat(ids[:, None].astype(np.float32), WIDTH, 1),
        "tag": np.repeat((ids % 30000)[:, None].astype(np.int16), 4, 1),
    }


def _buffer(storage):
    return frb.ReplayBuffer(
        C, storage=storage, batch_size=64, sampler=frb.PrioritizedSampler(alpha=0.8, beta=0.5)
    )


def _adding_child(path, eager, conn):
    rb = _buffer(frb.MemmapStorage(path))
    state = rb.init(EXAMPLE)
    k = 0
    if eager:  # rb.add outside jit: compiled plan, NumPy write (host_calls)
        add = rb.add
        k, state = 1, add(state, _batch(1))  # the first call compiles, before the clock starts
    else:
        add = jax.jit(rb.add)
        add.lower(state, _batch(1)).compile()  # compiled before the clock starts
    conn.send("ready")
    while True:
        k += 1
        state = add(state, _batch(k))
        if k % EVERY == 0:
            rb.storage.checkpoint(state)
            conn.send(k)


@functools.cache
def _reference():
    """The same run on a DeviceStorage: states after 0, 1, 2, ... adds (grown on demand)."""
    rb = _buffer(frb.DeviceStorage(pack=False))
    return rb, jax.jit(rb.add), [rb.init(EXAMPLE)]


def _reference_state(k):
    rb, add, states = _reference()
    while len(states) <= k:
        states.append(add(states[-1], _batch(len(states))))
    return rb, states[k]


def _stored_slots(state):
    n, cursor = int(state.writer.filled), int(state.writer.cursor)
    return np.asarray((cursor - n + np.arange(n)) % C, np.int32)


def _check_reopened(path, last):
    """Reopen after the kill; returns (adds in the restored state, "old" or "new")."""
    rb = _buffer(frb.MemmapStorage(path))
    template = rb.init(EXAMPLE)  # this process has the directory alone: rolls back
    try:
        restored = rb.storage.restore(template)
    except FileNotFoundError:  # killed before its first checkpoint completed
        assert last == 0
        rb.storage.close()
        return 0, "old"
    slots = _stored_slots(restored)
    items = jax.tree_util.tree_map(np.asarray, rb.get(restored, jnp.asarray(slots)))
    ids = items["id"]
    np.testing.assert_array_equal(
        items["obs"], np.repeat(ids[:, None].astype(np.float32), WIDTH, 1), err_msg="torn item"
    )
    np.testing.assert_array_equal(
        items["tag"], np.repeat((ids % 30000)[:, None], 4, 1).astype(np.int16), err_msg="torn item"
    )
    k = (int(ids.max()) + 1) // B
    assert k in (last, last + EVERY), f"restored the state after add {k}, last commit {last}"
    ref_rb, ref = _reference_state(k)
    same = jax.tree_util.tree_structure
    assert same(restored.sampler) == same(ref.sampler)
    for a, b in zip(
        jax.tree_util.tree_leaves((restored.writer, restored.sampler)),
        jax.tree_util.tree_leaves((ref.writer, ref.sampler)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the sum tree included
    want = jax.tree_util.tree_map(np.asarray, ref_rb.get(ref, jnp.asarray(slots)))
    for name in want:  # the files hold exactly the items the state says
        np.testing.assert_array_equal(items[name], want[name])
    rb.storage.close()
    return k, ("old" if k == last else "new")


def _moment(path):
    """Where the kill landed, read from the files before anything reopens them: ("torn", n)
    when the add in flight had written some of its rows or fields and not others, else
    ("between", n); n: completed adds after the last commit (rolled back on reopen)."""
    import json

    journal = np.load(os.path.join(path, "journal.npy"), mmap_mode="r")
    committed, current = int(journal[2]), int(journal[3])
    with open(os.path.join(path, "manifest.json")) as f:
        leaves = json.load(f)["leaves"]
    data = {l["path"]: np.load(os.path.join(path, l["file"]), mmap_mode="r") for l in leaves}
    nxt = _batch(current + 1)
    slots = (current * B + np.arange(B)) % C
    new = [
        np.all(data[f"['{name}']"][slots].reshape(B, -1) == nxt[name].reshape(B, -1), axis=1)
        for name in ("id", "obs", "tag")
    ]
    torn = any(0 < n.sum() < B for n in new) or len({int(n.sum()) for n in new}) > 1
    return ("torn" if torn else "between"), current - committed


def _kill_trials(tmp_path, trials, seed, eager=False):
    rng = random.Random(seed)
    ctx = forkserver("functional_rb")
    counts = {"old": 0, "new": 0}
    start = time.perf_counter()
    for i in range(trials):
        path = str(tmp_path / f"rb{i}")
        ready, last = kill_at_random(
            ctx, _adding_child, (path, eager), rng.uniform(0.0, 0.8), ready_s=180
        )
        assert ready, "the adding child did not start"
        moment, rolled = (
            _moment(path)
            if os.path.exists(os.path.join(path, "manifest.json"))
            else ("before init", 0)
        )
        counts[moment] = counts.get(moment, 0) + 1
        counts["adds rolled back"] = counts.get("adds rolled back", 0) + rolled
        _, outcome = _check_reopened(path, last)
        counts[outcome] += 1
        shutil.rmtree(path)
    print(
        f"\nMemmapStorage {'eager' if eager else 'jitted'} add/checkpoint killed: {trials} "
        f"trials, {counts['old']} old, "
        f"{counts['new']} new, 0 errors, 0 torn or mixed after reopening; at the kill: "
        f"{counts.get('torn', 0)} adds torn in flight, "
        f"{counts.get('adds rolled back', 0)} completed uncommitted adds in all (both rolled "
        f"back) ({time.perf_counter() - start:.1f} s)"
    )
    return counts


@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_an_adding_process_killed_at_a_random_moment_reopens_at_a_checkpoint(tmp_path, eager):
    _kill_trials(tmp_path, 2, seed=1, eager=eager)


@pytest.mark.slow
@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_an_adding_process_killed_at_a_random_moment_long(tmp_path, eager):
    _kill_trials(tmp_path, 50, seed=2, eager=eager)
