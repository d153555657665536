"""A hypothesis state machine over a MemmapStorage buffer's life, against a NumPy model of the
ring: add, sample, update, commit (``rb.storage.checkpoint``), save / load
(``frb.checkpoint``), and kill-and-reopen: a forked child writes a batch through the storage's
host write (what ``set`` and its ``io_callback`` run) and is killed (SIGKILL) by a timer at a
random moment, then the directory is reopened and restored.

Invariants after every step: the stored items are exactly the model's (every field of an item
from one add), sampled data is what the model holds at the sampled indices; after a load the
state is bit for bit the saved one, after a kill the last committed one (priorities included).
Run eagerly and under ``jax.jit``; the long version (``FRB_SLOW=1``) runs 200 sequences of
40 steps (``--hypothesis-show-statistics`` counts where the kills landed).
"""

import collections
import os
import shutil
import signal
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trees import bits
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import functional_rb as frb
from functional_rb.storages import memmap as mm
from functional_rb.storages import memmap_files

CAP = 8
ITEM = {"id": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32)}
_ROOT = tempfile.mkdtemp(prefix="frb_machine_")
RB = frb.ReplayBuffer(
    CAP,
    storage=frb.MemmapStorage(os.path.join(_ROOT, "rb")),
    batch_size=3,
    sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0),
)
CKPT = os.path.join(_ROOT, "ckpt")
JITTED = (jax.jit(RB.add), jax.jit(RB.sample), jax.jit(RB.update))
EAGER = (RB.add, RB.sample, RB.update)
KILLS: collections.Counter = collections.Counter()  # where the kills landed


def _batch(start, n):
    ids = np.arange(start, start + n, dtype=np.int32)
    return {"id": ids, "obs": np.stack([ids, -ids], 1).astype(np.float32)}


def _dynamic(state):
    """Every leaf but the memmap storage's write counter, as NumPy copies."""
    tree = jax.tree_util.tree_map(
        lambda x: None if isinstance(x, mm.MemmapStorageState) else x,
        state,
        is_leaf=lambda x: isinstance(x, mm.MemmapStorageState),
    )
    return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


class Model:
    def __init__(self):
        self.ids = np.full(CAP, -1, np.int64)
        self.cursor = 0
        self.filled = 0

    def add(self, ids):
        for i in ids:
            self.ids[self.cursor] = i
            self.cursor = (self.cursor + 1) % CAP
            self.filled = min(self.filled + 1, CAP)

    def copy(self):
        m = Model()
        m.ids, m.cursor, m.filled = self.ids.copy(), self.cursor, self.filled
        return m


def _write_and_die(directory, version, positions, items, delay):
    """In a forked child: the storage's host write of ``items`` at ``positions``, cut short
    by SIGKILL from a timer after ``delay`` seconds (or complete, then exit)."""
    pid = os.fork()
    if pid == 0:  # the child runs NumPy only, never JAX
        try:
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            signal.setitimer(signal.ITIMER_REAL, delay)
            memmap_files.host_set(
                directory,
                version,
                positions,
                np.ones(len(positions), bool),
                items["id"],
                items["obs"],
            )
        finally:
            os._exit(0)
    for _ in range(1000):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFSIGNALED(status)
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


class PersistenceMachine(RuleBasedStateMachine):
    fns = EAGER

    def __init__(self):
        super().__init__()
        RB.storage.close()
        shutil.rmtree(_ROOT, ignore_errors=True)
        os.makedirs(_ROOT)
        self.state = RB.init(ITEM)
        self.model = Model()
        self.next_id = 0
        self.committed = None  # (model, dynamic leaves) at the last rb.storage.checkpoint
        self.saved = None  # (model, dynamic leaves) at the last frb.checkpoint.save

    @rule(n=st.integers(1, 5))
    def add(self, n):
        ids = _batch(self.next_id, n)
        self.next_id += n
        self.state = self.fns[0](self.state, ids)
        self.model.add(ids["id"])

    @precondition(lambda self: self.model.filled > 0)
    @rule(seed=st.integers(0, 2**16))
    def sample(self, seed):
        s, self.state = self.fns[1](self.state, jax.random.key(seed))
        idx = np.asarray(s.indices)
        assert np.asarray(s.mask).all() and (np.asarray(s.weights) > 0).all()
        assert (self.model.ids[idx] >= 0).all(), "sampled an empty slot"
        np.testing.assert_array_equal(np.asarray(s.data["id"]), self.model.ids[idx])
        np.testing.assert_array_equal(np.asarray(s.data["obs"])[:, 0], self.model.ids[idx])

    @precondition(lambda self: self.model.filled > 0)
    @rule(data=st.data())
    def update(self, data):
        slots = np.flatnonzero(self.model.ids >= 0)
        idx = data.draw(st.lists(st.sampled_from(list(slots)), min_size=1, max_size=3))
        prio = data.draw(st.lists(st.floats(0.1, 10.0), min_size=len(idx), max_size=len(idx)))
        self.state = self.fns[2](
            self.state, jnp.asarray(idx, jnp.int32), jnp.asarray(prio, jnp.float32)
        )

    @rule()
    def commit(self):
        RB.storage.checkpoint(self.state)
        self.committed = (self.model.copy(), _dynamic(self.state))

    @rule()
    def save(self):
        frb.checkpoint.save(CKPT, self.state)
        self.saved = (self.model.copy(), _dynamic(self.state))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def load(self):
        self.state = frb.checkpoint.load(CKPT, like=RB.init(ITEM))
        self.model = self.saved[0].copy()
        assert bits(_dynamic(self.state)) == bits(self.saved[1])

    @rule(n=st.integers(1, 5), delay=st.floats(1e-6, 2e-3))
    def kill_and_reopen(self, n, delay):
        """A process dies in the middle of (or around) a write; the next one reopens."""
        ids = _batch(self.next_id, n)
        self.next_id += n
        positions = (self.model.cursor + np.arange(n)) % CAP
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # os.fork() with JAX loaded
            killed = _write_and_die(
                RB.storage.directory,
                np.asarray(self.state.storage.version),
                positions.astype(np.int32),
                ids,
                delay,
            )
        got = RB.get(self.state, jnp.asarray(positions, jnp.int32))  # the files as left
        new = [
            int((np.asarray(got[k]).reshape(n, -1) == ids[k].reshape(n, -1)).all(1).sum())
            for k in ("id", "obs")
        ]
        moment = (
            "write not started"
            if new == [0, 0]
            else "write complete"
            if new == [n, n]
            else "write torn"
        ) + (", child killed" if killed else ", child exited")
        event("kill: " + moment)
        KILLS[moment] += 1
        RB.storage.close()  # this process dies too: nothing of it survives but the files
        template = RB.init(ITEM)
        if self.committed is None:
            assert not os.path.exists(os.path.join(RB.storage.directory, mm.STATE_DIR))
            self.state, self.model = template, Model()
            return
        self.state = RB.storage.restore(template)
        self.model = self.committed[0].copy()
        assert bits(_dynamic(self.state)) == bits(self.committed[1])

    @invariant()
    def files_hold_the_models_items(self):
        assert int(self.state.writer.filled) == self.model.filled
        assert int(self.state.writer.cursor) == self.model.cursor % CAP
        slots = np.flatnonzero(self.model.ids >= 0)
        got = RB.get(self.state, jnp.asarray(slots, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got["id"]), self.model.ids[slots])
        np.testing.assert_array_equal(
            np.asarray(got["obs"]), np.stack([self.model.ids[slots], -self.model.ids[slots]], 1)
        )

    def teardown(self):
        RB.storage.close()


class JittedPersistenceMachine(PersistenceMachine):
    fns = JITTED


TestPersistenceEager = PersistenceMachine.TestCase
TestPersistenceJit = JittedPersistenceMachine.TestCase
for _case in (TestPersistenceEager, TestPersistenceJit):
    _case.settings = settings(
        max_examples=max(4, settings().max_examples // 4), stateful_step_count=15
    )
del _case


@pytest.mark.slow
def test_persistence_machine_long():
    KILLS.clear()
    run_state_machine_as_test(
        JittedPersistenceMachine, settings=settings(max_examples=200, stateful_step_count=40)
    )
    print(f"\n{sum(KILLS.values())} kills, then reopened and restored exactly: {dict(KILLS)}")
