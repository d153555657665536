"""``ReplayBufferMachine``: a hypothesis state machine that drives a buffer against a
pure-Python reference model (needs the ``test`` extra).

Subclass it and set ``buffer`` (a ``ReplayBuffer``) and ``example`` (one item; ``ndim=2``: one
vectorized step)::

    class MyMachine(ReplayBufferMachine):
        buffer = frb.ReplayBuffer(capacity=8, batch_size=4, sampler=MySampler())
        example = {"obs": jnp.zeros(3)}

    TestMyBuffer = MyMachine.TestCase   # collected by pytest / unittest

Rules: ``add`` (batches of 1, ``R - 1``, ``R``, ``R + 1`` and ``2R + 1`` steps: crossing the
capacity, wrapping the ring within one call), ``sample``, ``update`` (priorities of the last
sample's indices, by bare indices or from the sample itself, possibly after adds that
rewrote some of its slots) and ``checkpoint`` (save, load, continue with the loaded state). After every
rule it checks :func:`~functional_rb.testing.assert_invariants` and the reference model:

* the writer: a FIFO ring (``RoundRobinWriter``, ``ImmutableWriter`` and any writer declaring
  ``time_ordered``): every item added and not yet overwritten is stored, in its slot, bit for
  bit, and the ``cursor`` / ``filled`` counters agree; ``MaxValueWriter``: the top-capacity
  ranks of everything added; any other writer: every stored item is one that was added;
* the sampler's draws: indices in range and stored, data equal to the stored items, weights
  finite and 0 where masked; for the built-in samplers their documented semantics (uniform
  weights, each item once per epoch, prioritized weights from the reference priorities,
  slices contiguous inside one trajectory with TorchRL's lengths, padding and end markers,
  ``can_sample`` as the reference predicts);
* priorities (``PrioritizedSampler``, ``PrioritizedSliceSampler``): the stored values equal
  the reference's, new items at the running maximum, the update policy applied;
* write generations: an update from a sample leaves the priorities of slots written since
  the draw alone, and ``rb.dropped_updates`` counts exactly those entries.

Class attributes: ``mode`` is ``"eager"``, ``"jit"`` (default) or ``"vmap"`` (a population of
``population`` buffers in one jitted ``jax.vmap``, each with its own stream and reference);
``reference`` forces the writer model (``"fifo"``, ``"top_k"``, ``"added"``); ``add_sizes``
restricts the add sizes to a subset of ``SIZES`` (fewer compilations under jit);
``checkpoints = False`` drops the checkpoint rule (it drops itself for states that
``frb.checkpoint`` cannot save: those of components with state classes of their own).

A failure is an ``AssertionError`` naming the broken rule, followed by the operations of that
run; hypothesis then shrinks it to a minimal failing sequence and prints it. In eager mode a
``ValueError`` from ``sample`` is accepted where ``jit`` returns masked entries (the library's
error policy), and the state it leaves is kept.
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.testing._hypothesis import require

require()
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_rb as frb
from functional_rb.testing import reference as ref
from functional_rb.testing._data import StepStream, item_key, key_of
from functional_rb.testing.invariants import assert_invariants
from functional_rb.testing.sample_checks import SampleChecker

SIZES = ("one", "almost_full", "full", "wrap", "overflow")
# an add size among the running machine's `add_sizes` (st.runner() is the machine)
_SIZE = st.runner().flatmap(lambda machine: st.sampled_from(type(machine).add_sizes))
_PRIORITIES = np.array([0.0, 0.5, 1.0, 2.5, 7.0, 1e3], np.float32)


def size_of(name: str, row: int) -> int:
    """Steps per row for an add size name: 1, R - 1, R, R + 1, 2R + 1."""
    return {
        "one": 1,
        "almost_full": max(row - 1, 1),
        "full": row,
        "wrap": row + 1,
        "overflow": 2 * row + 1,
    }[name]


@functools.lru_cache(maxsize=64)
def _functions(rb, mode: str):
    """``(init, init_from_data, add, sample, update)`` for a mode, cached per buffer so that
    every hypothesis example reuses one compilation per shape."""
    if mode == "eager":
        return rb.init, rb.init_from_data, rb.add, rb.sample, rb.update
    if mode == "jit":
        return (rb.init, rb.init_from_data, jax.jit(rb.add), jax.jit(rb.sample), jax.jit(rb.update))
    if mode == "vmap":
        return (
            jax.vmap(rb.init),
            jax.vmap(rb.init_from_data),
            jax.jit(jax.vmap(rb.add)),
            jax.jit(jax.vmap(rb.sample)),
            jax.jit(jax.vmap(rb.update)),
        )
    raise ValueError(f"ReplayBufferMachine: mode must be 'eager', 'jit' or 'vmap', got {mode!r}.")


@functools.lru_cache(maxsize=64)
def _writer_functions(rb, layout):
    """The writer's ``write`` (to learn where a non-FIFO writer puts items) and, for a
    ``MaxValueWriter``, ``item_ranks``: jitted once per buffer."""
    ranks = getattr(rb.writer, "item_ranks", None)
    return (
        jax.jit(lambda ws, items: rb.writer.write(ws, items, layout)),
        None if ranks is None else jax.jit(ranks),
    )


_FACTS: dict = {}


def _facts(cls, rb):
    """Static facts about a machine class's buffer, computed once per class: its layout, a
    zero example of the stored dtypes, the item's leaf paths, whether ``get`` returns items as
    stored, whether ``frb.checkpoint`` can save its states."""
    if cls not in _FACTS:
        one = rb.init(jax.tree_util.tree_map(jnp.asarray, cls.example))
        spec = rb.storage.item_spec(one.storage)
        lead = (one.num_envs,) if rb.ndim == 2 else ()
        spec_ex = jax.tree_util.tree_map(lambda s: np.zeros(lead + tuple(s.shape), s.dtype), spec)
        paths = [key_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(spec)[0]]
        probe = jax.eval_shape(rb.get, one, jnp.zeros((1,), jnp.int32))
        exact = all(
            tuple(a.shape[1:]) == tuple(b.shape)
            for a, b in zip(jax.tree_util.tree_leaves(probe), jax.tree_util.tree_leaves(spec))
        )
        _FACTS[cls] = (rb.layout(one), spec_ex, paths, exact, _checkpointable(one))
    return _FACTS[cls]


# checkpoints are written to memory when the system offers it (a checkpoint fsyncs its files)
_SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _checkpointable(state) -> bool:
    """Whether ``frb.checkpoint`` can save ``state`` (it rebuilds only the library's own
    state classes, so a component of yours with its own state class cannot be saved)."""
    with tempfile.TemporaryDirectory(dir=_SCRATCH) as tmp:
        try:
            frb.checkpoint.save(os.path.join(tmp, "probe.npz"), state)
        except TypeError:
            return False
    return True


def _member_of(state, i: int, n: int):
    return state if n == 1 else jax.tree_util.tree_map(lambda x: x[i], ref.host(state))


def _bits_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(  # type: ignore[operator]  # jaxlib has no stubs
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb)
    )


def _stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


class _Member:
    """One buffer of the population: its item stream and reference models."""

    def __init__(self, rb, spec_example, kind: str, seed: int, layout):
        self.stream = StepStream(spec_example, ndim=rb.ndim, seed=seed)
        self.kind = kind
        self.writer = {
            "fifo": lambda: ref.RingModel(layout.num_envs, layout.row_capacity),
            "top_k": lambda: ref.TopKModel(layout.capacity),
            "added": ref.AddedModel,
        }[kind]()
        self.priority = ref.PriorityModel.for_sampler(rb.sampler, layout.capacity)
        self.checker = SampleChecker(rb, layout)
        # writes per slot so far, and their copy when the last sample was drawn: an update
        # from that sample must skip the slots written since (functional_rb.generations)
        self.writes = np.zeros(layout.capacity, np.int64)
        self.writes_at_sample = self.writes.copy()
        self.dropped = 0


class ReplayBufferMachine(RuleBasedStateMachine):
    """See the module docstring. Subclasses set ``buffer`` and ``example``."""

    buffer = None
    example = None
    mode = "jit"
    population = 2
    reference: str | None = None
    checkpoints = True
    add_sizes = SIZES

    def __init__(self):
        super().__init__()
        cls = type(self)
        if cls.buffer is None or cls.example is None:
            raise TypeError(
                f"{cls.__name__}: set the class attributes `buffer` (a "
                "ReplayBuffer) and `example` (one item) in a subclass of "
                "ReplayBufferMachine."
            )
        self.rb = cls.buffer
        self.fns = _functions(self.rb, cls.mode)
        self.n = cls.population if cls.mode == "vmap" else 1
        self.state, self.last, self.log = None, None, []

    # ------------------------------------------------------------------ helpers
    def _writer_kind(self) -> str:
        reference = type(self).reference
        if reference is not None:
            return reference
        w = self.rb.writer
        if isinstance(w, frb.MaxValueWriter):
            return "top_k"
        if isinstance(w, (frb.RoundRobinWriter, frb.ImmutableWriter)) or getattr(
            w, "time_ordered", False
        ):
            return "fifo"
        return "added"

    def _fail(self, message: str):
        raise AssertionError(
            f"{message}\nReplayBufferMachine ({self.rb}, mode="
            f"{type(self).mode!r}) after: " + "; ".join(self.log)
        )

    def member(self, i: int):
        return _member_of(self.state, i, self.n)

    def _batched(self, trees):
        return trees[0] if self.n == 1 else _stack(trees)

    def _rows(self, items):
        """A member's batch as per-row lists of per-item leaves (for the models)."""
        lay = self.layout
        flat = jax.tree_util.tree_map(
            lambda x: np.asarray(x).reshape((lay.num_envs, -1) + np.shape(x)[self.rb.ndim :]), items
        )
        return [
            ref.leaf_rows(jax.tree_util.tree_map(lambda x, e=e: x[e], flat))
            for e in range(lay.num_envs)
        ]

    def _record(self, m: int, items, rows):
        """Feed member ``m``'s models with a write of ``items`` (before it happens)."""
        mem = self.members[m]
        if mem.kind == "fifo":
            written = mem.writer.add(rows)
        else:
            write, ranks_of = _writer_functions(self.rb, self.layout)
            record, _ = write(self.member(m).writer, items)
            written = np.asarray(record.positions)[np.asarray(record.mask)]
            if mem.kind == "top_k":
                mem.writer.add(rows, np.asarray(ranks_of(items), np.float32))
            else:
                mem.writer.add(rows)
        np.add.at(mem.writes, np.asarray(written, np.int64), 1)
        if mem.priority is not None:
            mem.priority.on_add(written)

    # ------------------------------------------------------------------ rules
    @initialize(seed=st.integers(0, 2**16 - 1), steps=_SIZE)
    def init_buffer(self, seed, steps):
        rb, ex = self.rb, jax.tree_util.tree_map(jnp.asarray, type(self).example)
        init, init_from_data = self.fns[0], self.fns[1]
        facts = _facts(type(self), rb)
        self.layout, spec_ex, self.paths, self.exact_items = facts[:4]
        self.can_checkpoint = type(self).checkpoints and facts[4]
        kind = self._writer_kind()
        self.members = [
            _Member(rb, spec_ex, kind, seed + 7919 * i, self.layout) for i in range(self.n)
        ]
        if isinstance(rb.writer, frb.ImmutableWriter):
            n = size_of(steps, self.layout.row_capacity)
            data = [mem.stream.take(n, seed) for mem in self.members]
            self.state = init_from_data(self._batched(data))
            for m, d in enumerate(data):
                self._record_fifo_init(m, d)
            self.log.append(f"init_from_data({n} steps)")
        else:
            self.state = init(self._batched([ex] * self.n))
            self.log.append("init")

    def _record_fifo_init(self, m, data):
        mem = self.members[m]
        written = mem.writer.add(self._rows(data))
        np.add.at(mem.writes, written, 1)
        if mem.priority is not None:
            mem.priority.on_add(written)

    @rule(steps=_SIZE, seed=st.integers(0, 2**16 - 1))
    def add(self, steps, seed):
        n = size_of(steps, self.layout.row_capacity)
        batch = [mem.stream.take(n, seed) for mem in self.members]
        self.log.append(f"add({n} steps)")
        if isinstance(self.rb.writer, frb.ImmutableWriter):
            try:
                self.fns[2](self.state, self._batched(batch))
            except RuntimeError:
                return
            self._fail('rule "ImmutableWriter refuses add" is broken: add did not raise')
        for m, items in enumerate(batch):
            self._record(m, items, self._rows(items))
        self.state = self.fns[2](self.state, self._batched(batch))

    @rule(seed=st.integers(0, 2**16 - 1))
    def sample(self, seed):
        self.log.append(f"sample(key {seed})")
        keys = jax.random.split(jax.random.key(seed), self.n)
        cans = [bool(self.rb.can_sample(self.member(m))) for m in range(self.n)]
        for m, can in enumerate(cans):
            want = self.members[m].checker.expected_can_sample(
                self.member(m), self.members[m], self.paths
            )
            if want is not None and want != can:
                self._fail(
                    f'rule "can_sample matches the reference" is broken: member {m}: '
                    f"rb.can_sample is {can}, the reference says {want}"
                )
        if type(self).mode == "eager":
            copy = ref.host(self.state)
            try:
                s, self.state = self.rb.sample(self.state, keys[0])
            except ValueError as e:
                # the error policy: eagerly a ValueError exactly where jit returns masked
                # entries (nothing can be drawn, or a batch that needs padding); the state is
                # left as it was
                masked, _ = jax.jit(self.rb.sample)(copy, keys[0])
                if bool(np.asarray(masked.mask).all()):
                    self._fail(
                        'rule "eager errors only where jit masks" is broken: eager '
                        f"rb.sample raised {e!r}, but under jit every entry is valid"
                    )
                self.last = None
                return
            if not cans[0]:
                self._fail(
                    'rule "sampling an empty buffer raises eagerly" is broken: '
                    "rb.sample did not raise although rb.can_sample is False"
                )
            self._check_sample(s, [copy], cans)
            return
        # host copies: the checks read the state as it was before the call
        before = [ref.host(self.member(m)) for m in range(self.n)]
        s, self.state = self.fns[3](self.state, keys[0] if self.n == 1 else keys)
        self._check_sample(s, before, cans)

    def _check_sample(self, s, before, cans):
        for m in range(self.n):
            one = s if self.n == 1 else jax.tree_util.tree_map(lambda x, m=m: x[m], s)
            try:
                self.members[m].checker.check(
                    one,
                    before[m],
                    self.member(m),
                    self.members[m],
                    cans[m],
                    self.paths,
                    self.exact_items,
                )
            except AssertionError as e:
                self._fail(f"member {m}: {e}")
        self.last = s if any(cans) else None
        for mem in self.members:
            mem.writes_at_sample = mem.writes.copy()

    @precondition(lambda self: self.last is not None)
    @rule(seed=st.integers(0, 2**16 - 1))
    def update(self, seed):
        """Priorities of the last sample's indices: by bare indices (applied to whatever the
        slots hold now) or, for odd seeds, from the sample itself (entries whose slot was
        written since the draw are dropped and counted)."""
        from_sample = bool(seed & 1)
        idx = np.asarray(self.last.indices)
        prio = np.random.default_rng(seed).choice(_PRIORITIES, idx.shape).astype(np.float32)
        checked = from_sample and self.last.generations is not None
        self.log.append(
            f"update({'from the sample, ' if checked else ''}priorities "
            f"{prio.reshape(-1).tolist()})"
        )
        before = ref.host(self.state)  # an eager update consumes the state it is given
        mask = np.asarray(self.last.mask)
        for m in range(self.n):
            mem = self.members[m]
            i_m, p_m, k_m = (idx, prio, mask) if self.n == 1 else (idx[m], prio[m], mask[m])
            keep = None
            if checked:
                fresh = mem.writes[i_m] == mem.writes_at_sample[i_m]
                keep = fresh & k_m
                mem.dropped += int((~fresh & k_m).sum())
            if mem.priority is not None:
                mem.priority.update(i_m, p_m, ref.stored_mask(self.rb, self.member(m)), keep)
        if checked:
            self.state = self.fns[4](self.state, self.last, jnp.asarray(prio))
        else:
            self.state = self.fns[4](self.state, jnp.asarray(idx), jnp.asarray(prio))
        if type(self.rb.sampler) in (
            frb.RandomSampler,
            frb.SamplerWithoutReplacement,
            frb.SliceSampler,
            frb.SliceSamplerWithoutReplacement,
        ):
            same = jax.tree_util.tree_all(
                jax.tree_util.tree_map(
                    lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                    before,
                    self.state,
                )
            )
            if not same:
                self._fail('rule "update is a no-op without priorities" is broken')

    @precondition(lambda self: self.can_checkpoint)
    @rule()
    def checkpoint(self):
        self.log.append("checkpoint")
        with tempfile.TemporaryDirectory(dir=_SCRATCH) as tmp:
            path = os.path.join(tmp, "state.npz")
            frb.checkpoint.save(path, self.state)
            loaded = frb.checkpoint.load(path, like=self.state)
        # the writer and sampler states bit for bit; the storage by what it returns (saving a
        # MemmapStorage state flushes its files, which advances its version counter)
        everything = np.arange(self.layout.capacity, dtype=np.int32)
        for m in range(self.n):
            before, after = self.member(m), _member_of(loaded, m, self.n)
            same = [
                _bits_equal(before.writer, after.writer),
                _bits_equal(before.sampler, after.sampler),
                _bits_equal(
                    ref.read(self.rb, before, everything), ref.read(self.rb, after, everything)
                ),
                _bits_equal(before.generations, after.generations),
            ]
            if not all(same):
                part = ("writer", "sampler", "storage", "generations")[same.index(False)]
                self._fail(
                    f'rule "checkpoints round-trip bit-exactly" is broken: member {m}: '
                    f"the loaded state's {part} differs from the saved one"
                )
        self.state = loaded

    # ------------------------------------------------------------------ invariants
    @invariant()
    def state_matches_reference(self):
        if self.state is None:
            return
        for m in range(self.n):
            state = self.member(m)
            try:
                assert_invariants(self.rb, state)
                self._check_writer(m, state)
                self._check_priorities(m, state)
                self._check_dropped(m, state)
            except AssertionError as e:
                self._fail(f"member {m}: {e}")

    def _check_writer(self, m: int, state) -> None:
        mem, rb = self.members[m], self.rb
        cursor, filled = ref.counters(rb, state)
        model = mem.writer
        if mem.kind == "fifo":
            if (cursor, filled) != (model.cursor, model.filled):
                raise AssertionError(
                    f'rule "ring counters follow the reference" is broken: state.writer has '
                    f"cursor={cursor}, filled={filled}; after {model.added} steps per row a "
                    f"FIFO ring of {model.row_capacity} slots has cursor={model.cursor}, "
                    f"filled={model.filled}"
                )
            if self.exact_items:
                stored = model.stored()
                pos = np.array(sorted(stored), np.int32)
                got = ref.leaf_rows(ref.read(rb, state, pos))
                bad = [int(p) for p, g in zip(pos, got) if item_key(g) != stored[int(p)][0]]
                if bad:
                    raise AssertionError(
                        f'rule "stored items follow the reference" is broken: positions {bad} '
                        f"do not hold the items a FIFO ring puts there (item j of a row in slot "
                        f"j % {model.row_capacity})"
                    )
            return
        items = ref.leaf_rows(ref.read(rb, state, ref.prefix_positions(rb, state)))
        if mem.kind == "top_k":
            ranks = np.asarray(state.writer.ranks)[:filled].tolist()
            if filled != model.filled or sorted(ranks) != model.top():
                raise AssertionError(
                    f'rule "MaxValueWriter keeps the top ranks" is broken: stored ranks '
                    f"{sorted(ranks)}, the top {model.capacity} of everything added are "
                    f"{model.top()}"
                )
            table = model.keys
        else:
            table = model.keys
        if self.exact_items and any(item_key(r) not in table for r in items):
            raise AssertionError(
                'rule "stored items were added" is broken: a stored slot '
                "holds an item that was never added"
            )

    def _check_dropped(self, m: int, state) -> None:
        got, want = int(self.rb.dropped_updates(state)), self.members[m].dropped
        if got != want:
            raise AssertionError(
                f'rule "updates from a sample skip rewritten slots" is broken: '
                f"rb.dropped_updates(state) is {got}, the reference dropped {want} entries "
                "(those whose slot was written after the sample was drawn)"
            )

    def _check_priorities(self, m: int, state) -> None:
        model = self.members[m].priority
        if model is None:
            return
        stored = ref.stored_mask(self.rb, state)
        want = model.values(stored)
        sp = state.sampler
        got = (
            np.asarray(sp.tree.values)[: sp.tree.capacity]
            if not model.slices
            else np.where(stored, np.asarray(sp.prio), 0)
        )
        if not (np.array_equal(got == 0, want == 0) and np.allclose(got, want, rtol=1e-6, atol=0)):
            i = int(np.flatnonzero(~np.isclose(got, want, rtol=1e-6, atol=0))[0])
            raise AssertionError(
                f'rule "priorities follow the reference" is broken: position {i} holds value '
                f"{got[i]!r}, the reference {want[i]!r} (raw priority {model.raw[i]!r}; new "
                f"items get the running maximum, update sets stored items)"
            )
        if float(np.float32(sp.max_priority)) != float(np.float32(model.max_priority)):
            raise AssertionError(
                f'rule "priorities follow the reference" is broken: max_priority is '
                f"{float(sp.max_priority)!r}, the reference {model.max_priority!r}"
            )
