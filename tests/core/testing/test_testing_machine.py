"""functional_rb.testing.ReplayBufferMachine: it passes on the built-in configurations
(eagerly, under jit, and vmapped over a population), and it finds seeded bugs and reports a
minimal failing sequence."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import functional_rb as frb
from functional_rb.protocol import Drawn, Writer, WriteRecord
from functional_rb.testing import ReplayBufferMachine
from functional_rb.testing.strategies import episode_example

pytestmark = pytest.mark.heavy

TRAJ = ("collector", "traj_ids")


def _settings(examples, steps=8):
    """At most ``examples`` runs of ``steps`` rules (the CI profile may ask for fewer)."""
    return settings(
        settings(),
        max_examples=min(examples, settings().max_examples),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[p for p in Phase if p is not Phase.explain],
    )


def _machine(rb, mode, **attrs):
    """A machine class for ``rb``; two add sizes (1 and 2R + 1: an add that brings more than
    the ring holds, wrapping it), so each configuration compiles add twice."""
    attrs = dict(
        dict(
            buffer=rb, example=episode_example(rb.ndim, 2), mode=mode, add_sizes=("one", "overflow")
        ),
        **attrs,
    )
    return type("Machine", (ReplayBufferMachine,), attrs)


SLOW = pytest.mark.slow

# (id, buffer arguments, ndim, mode): every built-in sampler, writer and storage at least once,
# each mode at least twice. CI runs the short version (each mode; prioritized slices over TED,
# MaxValueWriter with priorities, ImmutableWriter with slices), FRB_SLOW=1 all of them.
CONFIGS = [
    ("random", {}, 2, "eager"),
    pytest.param(
        "without_replacement_leaves",
        dict(
            sampler=frb.SamplerWithoutReplacement(drop_last=True),
            storage=frb.DeviceStorage(pack=False),
        ),
        1,
        "eager",
        marks=SLOW,
    ),
    pytest.param(
        "prioritized_stratified",
        dict(sampler=frb.PrioritizedSampler(stratified=True)),
        2,
        "jit",
        marks=SLOW,
    ),
    pytest.param(
        "slice_traj_ids",
        dict(sampler=frb.SliceSampler(slice_len=2, traj_key=TRAJ)),
        1,
        "jit",
        marks=SLOW,
    ),
    pytest.param(
        "slice_without_replacement",
        dict(
            sampler=frb.SliceSamplerWithoutReplacement(slice_len=2, drop_last=True, shuffle=False)
        ),
        2,
        "jit",
        marks=SLOW,
    ),
    (
        "prioritized_slice_ted",
        dict(
            sampler=frb.PrioritizedSliceSampler(
                alpha=0.7, beta=0.5, slice_len=2, strict_length=False
            ),
            storage=frb.TEDStorage(min_episode_len=1),
        ),
        1,
        "jit",
    ),
    pytest.param(
        "prioritized_slice",
        dict(sampler=frb.PrioritizedSliceSampler(alpha=1.0, beta=1.0, num_slices=2)),
        2,
        "vmap",
        marks=SLOW,
    ),
    (
        "max_value",
        dict(
            sampler=frb.PrioritizedSampler(alpha=0.7, beta=0.5),
            writer=frb.MaxValueWriter(("next", "reward")),
        ),
        1,
        "vmap",
    ),
    (
        "immutable",
        dict(
            writer=frb.ImmutableWriter(),
            sampler=frb.SliceSampler(num_slices=2, strict_length=False),
        ),
        2,
        "jit",
    ),
]


def _id(c):
    c = c.values if hasattr(c, "values") else c
    return f"{c[0]}-ndim{c[2]}-{c[3]}"


@pytest.mark.parametrize("name,kw,ndim,mode", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_built_in_configurations_pass(name, kw, ndim, mode):
    rb = frb.ReplayBuffer(capacity=8, batch_size=4, ndim=ndim, **kw)
    run_state_machine_as_test(_machine(rb, mode), settings=_settings(4))


# jit: reads and writes are host callbacks; eager: compiled plan and draw, NumPy I/O between
# (functional_rb/_internal/host_calls.py)
MEMMAP = [
    ("prioritized", dict(sampler=frb.PrioritizedSampler()), 1, "jit"),
    ("prioritized", dict(sampler=frb.PrioritizedSampler()), 1, "eager"),
    ("slices", dict(sampler=frb.SliceSampler(slice_len=2, strict_length=False)), 2, "eager"),
    pytest.param(
        "without_replacement", dict(sampler=frb.SamplerWithoutReplacement()), 1, "eager", marks=SLOW
    ),
]


@pytest.mark.parametrize("name,kw,ndim,mode", MEMMAP, ids=[_id(c) for c in MEMMAP])
def test_memmap_storage_passes(tmp_path, name, kw, ndim, mode):
    rb = frb.ReplayBuffer(
        capacity=6, batch_size=2, ndim=ndim, storage=frb.MemmapStorage(str(tmp_path)), **kw
    )
    # (6 runs: with 2, hypothesis's first short runs may not reach a sample)
    run_state_machine_as_test(_machine(rb, mode), settings=_settings(6))


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_host_storage_passes(mode):
    rb = frb.ReplayBuffer(
        capacity=6, batch_size=2, storage=frb.HostStorage(), sampler=frb.PrioritizedSampler()
    )
    run_state_machine_as_test(_machine(rb, mode), settings=_settings(6))


def test_a_subclass_needs_a_buffer_and_an_example():
    with pytest.raises(TypeError, match="set the class attributes `buffer`"):
        ReplayBufferMachine()


# ------------------------------------------------------------------ seeded bugs
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingState:
    cursor: jax.Array
    filled: jax.Array


@dataclasses.dataclass(frozen=True)
class OffByOneRing(Writer):
    """A copy of the ring writer (ndim=1) with an off-by-one in its overflow rule: when a call
    brings ``capacity`` items or more, the first one it should keep is dropped (``>`` where
    ``>=`` belongs)."""

    time_ordered = True

    def init(self, layout):
        return RingState(jnp.int32(0), jnp.int32(0))

    def write(self, state, items, layout):
        cap = layout.capacity
        steps = jax.tree_util.tree_leaves(items)[0].shape[0]
        ar = jnp.arange(steps, dtype=jnp.int32)
        positions = (state.cursor + ar) % cap
        mask = ar > steps - cap  # the bug: ar >= steps - cap
        cursor = (state.cursor + steps % cap) % cap
        filled = jnp.minimum(state.filled + min(steps, cap), cap)
        return WriteRecord(positions, mask, run_start=state.cursor), RingState(cursor, filled)


def _failure(machine, examples=60, steps=10, shrink=True):
    phases = [p for p in Phase if p is not Phase.explain and (shrink or p is not Phase.shrink)]
    with pytest.raises(AssertionError) as e:
        run_state_machine_as_test(
            machine,
            settings=settings(
                _settings(examples, steps),
                max_examples=examples,
                derandomize=True,
                database=None,
                phases=phases,
            ),
        )
    return str(e.value), "\n".join(getattr(e.value, "__notes__", []))


@pytest.mark.parametrize("mode", ["jit"])
def test_finds_an_off_by_one_in_a_ring_writer_and_shrinks_it(mode):
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, writer=OffByOneRing())
    machine = type(
        "Machine",
        (ReplayBufferMachine,),
        dict(buffer=rb, example={"obs": jnp.zeros(2), "id": jnp.int32(0)}, mode=mode),
    )
    message, notes = _failure(machine)
    assert 'rule "stored items follow the reference" is broken: positions [0]' in message
    assert message.endswith("after: init; add(4 steps)")
    # hypothesis prints the minimal failing program: one add of exactly `capacity` items
    steps = [line for line in notes.splitlines() if line.startswith("state.")]
    assert [
        s
        for s in steps
        if s.startswith(("state.add", "state.sample", "state.update", "state.checkpoint"))
    ] == ["state.add(seed=0, steps='full')"], notes


@dataclasses.dataclass(frozen=True)
class StaleMaxPriority(frb.PrioritizedSampler):
    """A prioritized sampler whose update forgets to raise the running maximum."""

    def update(self, state, indices, priorities, ctx):
        new = super().update(state, indices, priorities, ctx)
        return dataclasses.replace(new, max_priority=state.max_priority)


@SLOW  # the short version: the ring-writer bug above
def test_finds_a_priority_bug_under_vmap():
    rb = frb.ReplayBuffer(capacity=4, batch_size=2, sampler=StaleMaxPriority())
    message, notes = _failure(_machine(rb, "vmap"), shrink=False)
    # a priority above the running maximum: assert_invariants sees it after the update
    assert 'rule "priorities at most the running maximum" is broken' in message
    assert "; update(priorities" in message and "state.update(" in notes


def test_catches_a_bug_in_a_user_sampler_with_the_generic_rules():
    @dataclasses.dataclass(frozen=True)
    class Newest(frb.RandomSampler):
        """Meant to draw the newest item. The bug: the cursor is the next slot to write, which
        holds nothing until the ring is full."""

        def sample(self, state, key, batch_size, ctx):
            idx = jnp.broadcast_to(ctx.cursor % ctx.layout.capacity, (batch_size,))
            ok = jnp.broadcast_to(ctx.size > 0, (batch_size,))
            return Drawn(idx.astype(jnp.int32), ok.astype(jnp.float32), ok), state

    rb = frb.ReplayBuffer(capacity=4, batch_size=2, sampler=Newest())
    message, _ = _failure(_machine(rb, "jit", add_sizes=("one", "full")), shrink=False)
    assert 'rule "drawn items are stored" is broken: mask True at empty positions' in message
