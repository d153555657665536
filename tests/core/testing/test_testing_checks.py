"""functional_rb.testing.check_sampler / check_writer / check_storage: every built-in component
passes, a correct component written from scratch passes, and each seeded defect fails with the
rule it breaks."""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import io_callback

import functional_rb as frb
from functional_rb.protocol import Drawn, Sampler, Storage, Writer, WriteRecord
from functional_rb.testing import ConformanceError, check_sampler, check_storage, check_writer

EX = {
    "obs": jnp.zeros((2,), jnp.float32),
    "id": jnp.int32(0),
    "next": {"done": jnp.zeros((1,), bool)},
}


def _fails(rule, check, *args, **kw):
    with pytest.raises(ConformanceError, match=re.escape(f'rule "{rule}" is broken')) as e:
        check(*args, **kw)
    assert e.value.rule == rule


# ------------------------------------------------------------------ built-ins pass
# Every check compiles a buffer's functions a few times over: CI runs the default components
# (the short version; tests/core/testing/test_testing_machine.py drives the others through the machine),
# FRB_SLOW=1 all of them.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "sampler,ndims",
    [
        (
            frb.RandomSampler(),
            (2,),
        ),  # ndim=1: the README's sampler (tests/core/testing/test_testing_readme.py)
        pytest.param(frb.RandomSampler(), (1,), marks=SLOW),
        pytest.param(
            frb.PrioritizedSliceSampler(alpha=0.7, beta=0.5, slice_len=2), (2,), marks=SLOW
        ),
        pytest.param(frb.SamplerWithoutReplacement(drop_last=True), (2,), marks=SLOW),
        pytest.param(frb.PrioritizedSampler(alpha=0.7, beta=0.5), (1,), marks=SLOW),
        pytest.param(frb.SliceSampler(slice_len=2, strict_length=False), (2,), marks=SLOW),
        pytest.param(
            frb.SliceSamplerWithoutReplacement(num_slices=2, traj_key=("collector", "traj_ids")),
            (1,),
            marks=SLOW,
        ),
    ],
    ids=lambda s: type(s).__name__ if not isinstance(s, tuple) else f"ndim{s}",
)
def test_built_in_samplers_conform(sampler, ndims):
    check_sampler(sampler, ndims=ndims)


def test_built_in_writers_and_storages_conform(tmp_path):
    check_writer(frb.RoundRobinWriter())
    check_storage(frb.MemmapStorage(str(tmp_path / "mm")), ndims=(1,), vmap=False)


@SLOW
def test_all_built_in_writers_and_storages_conform():
    check_writer(frb.MaxValueWriter(("next", "reward")), ndims=(1,))
    check_storage(frb.DeviceStorage())
    check_storage(frb.DeviceStorage(pack=False))
    check_storage(frb.TEDStorage(min_episode_len=1))


# ------------------------------------------------------------------ samplers of your own
_CALLS = itertools.count()


@dataclasses.dataclass(frozen=True)
class Uniform(Sampler):
    """Uniform with replacement, written from scratch; ``bug`` seeds one defect."""

    bug: str = ""

    def init(self, item_spec, layout):
        draws = jnp.asarray(0) if self.bug == "weak" else jnp.int32(0)  # weak: a Python int
        return {"draws": draws}

    def sample(self, state, key, batch_size, ctx):
        n = ctx.size
        if self.bug == "concrete":
            n = int(n)  # fine eagerly, impossible under jit
        u = jax.random.randint(key, (batch_size,), 0, jnp.maximum(n, 1), dtype=jnp.int32)
        if self.bug == "impure":  # a hidden counter: the same key gives other draws
            u = (u + next(_CALLS)) % jnp.maximum(n, 1)
        idx = ctx.layout.rank_to_flat(u, ctx.filled)
        ok = jnp.broadcast_to(n > 0, (batch_size,))
        weights = ok.astype(jnp.float32)
        if self.bug == "range":
            idx = idx + ctx.layout.capacity
        elif self.bug == "empty_slots":
            idx = jax.random.randint(key, (batch_size,), 0, ctx.layout.capacity, jnp.int32)
        elif self.bug == "dtype":
            idx = idx.astype(jnp.int16)
        elif self.bug == "weights":
            weights = jnp.ones((batch_size,), jnp.float32)  # 1 also where nothing was drawn
        elif self.bug == "io_callback":
            idx = io_callback(
                lambda x: x, jax.ShapeDtypeStruct(idx.shape, idx.dtype), idx, ordered=True
            )
        return Drawn(idx, weights, ok), {"draws": jnp.int32(state["draws"] + 1)}


@SLOW  # the short version: the README's sampler (tests/core/testing/test_testing_readme.py)
def test_a_correct_sampler_of_your_own_conforms():
    check_sampler(Uniform(), example=EX, ndims=(1,))


@pytest.mark.parametrize(
    "bug,rule",
    [
        ("range", "indices in range"),
        ("empty_slots", "drawn items are stored"),
        ("dtype", "Drawn shapes and dtypes"),
        ("weights", "weights consistent with mask"),
        ("impure", "pure"),
        ("concrete", "jittable"),
        ("weak", "state structure is stable (no retrace)"),
        ("io_callback", "vmappable"),
    ],
)
def test_sampler_defects_are_named(bug, rule):
    _fails(rule, check_sampler, Uniform(bug), example=EX, ndims=(1,))


def test_sampler_protocol_and_config_rules():
    class NotASampler:
        def sample(self, state, key, batch_size, ctx):
            return None

    _fails("implements the Sampler protocol", check_sampler, NotASampler())

    class ByIdentity(Uniform):  # equal only to itself: jit would compile for every copy
        __eq__ = object.__eq__
        __hash__ = object.__hash__

    _fails("hashable frozen config", check_sampler, ByIdentity())


# ------------------------------------------------------------------ writers of your own
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingState:
    cursor: jax.Array
    filled: jax.Array


@dataclasses.dataclass(frozen=True)
class Ring(Writer):
    """A FIFO ring written from scratch; ``bug`` seeds one defect."""

    bug: str = ""
    time_ordered: bool = True

    def init(self, layout):
        return RingState(jnp.int32(0), jnp.int32(0))

    def write(self, state, items, layout):
        r, e = layout.row_capacity, layout.num_envs
        steps = jax.tree_util.tree_leaves(items)[0].shape[layout.ndim - 1]
        ar = jnp.arange(steps, dtype=jnp.int32)
        t = (state.cursor + ar) % r
        if self.bug == "reversed":
            t = (state.cursor + steps - 1 - ar) % r
        mask = ar >= steps - r
        if self.bug == "duplicate":
            mask = jnp.ones_like(mask)
        env = jnp.arange(e, dtype=jnp.int32)[:, None]
        if self.bug == "row":
            env = (env + 1) % e
        pos = layout.to_flat(env, t[None, :]).reshape(-1)
        mask = jnp.broadcast_to(mask[None, :], (e, steps)).reshape(-1)
        filled = jnp.minimum(state.filled + min(steps, r), r)
        if self.bug == "filled":
            filled = jnp.int32(r)
        run_start = state.cursor if layout.ndim == 1 and self.bug != "reversed" else None
        if self.bug == "run_start" and run_start is not None:
            run_start = run_start + 1
        if self.bug == "record":
            pos = pos.astype(jnp.float32)
        return WriteRecord(pos, mask, run_start), RingState((state.cursor + steps) % r, filled)


def test_a_correct_writer_of_your_own_conforms():
    check_writer(Ring(), example=EX, ndims=(1,))


@pytest.mark.parametrize(
    "bug,rule,time_ordered,ndims",
    [
        ("duplicate", "positions unique and in range", True, (1,)),
        ("reversed", "time_ordered writers are FIFO rings", True, (1,)),
        ("row", "writes stay in their row's stored prefix", True, (2,)),
        ("filled", "stores only items it was given", False, (1,)),
        ("run_start", "run_start promise", True, (1,)),
        ("record", "write returns (WriteRecord, state)", True, (1,)),
    ],
)
def test_writer_defects_are_named(bug, rule, time_ordered, ndims):
    _fails(rule, check_writer, Ring(bug, time_ordered), example=EX, ndims=ndims)


# ------------------------------------------------------------------ storages of your own
@dataclasses.dataclass(frozen=True)
class Leaves(Storage):
    """One array per leaf, written from scratch; ``bug`` seeds one defect."""

    bug: str = ""

    def init(self, item, layout):
        return {
            "data": jax.tree_util.tree_map(
                lambda x: jnp.zeros((layout.capacity,) + jnp.shape(x), jnp.result_type(x)), item
            )
        }

    def item_spec(self, state):
        spec = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state["data"]
        )
        if self.bug == "spec":
            spec = jax.tree_util.tree_map(
                lambda s: jax.ShapeDtypeStruct((1,) + s.shape, s.dtype), spec
            )
        return spec

    def set(self, state, record, items, ctx):
        pos, mask = record.positions, record.mask
        if self.bug == "mask":
            mask = jnp.ones_like(mask)
        if self.bug == "stale":  # the last item of every add is lost
            mask = mask.at[-1].set(False)
        pos = jnp.where(mask, pos, ctx.layout.capacity)
        return {
            "data": jax.tree_util.tree_map(
                lambda leaf, x: leaf.at[pos].set(x.astype(leaf.dtype), mode="drop"),
                state["data"],
                items,
            )
        }

    def get(self, state, indices, ctx):
        out = jax.tree_util.tree_map(
            lambda leaf: leaf[jnp.clip(indices, 0, leaf.shape[0] - 1)], state["data"]
        )
        if self.bug == "shape":
            out = jax.tree_util.tree_map(lambda x: x[..., None], out)
        return out


def test_a_correct_storage_of_your_own_conforms():
    check_storage(Leaves(), example=EX, ndims=(2,))


@pytest.mark.parametrize(
    "bug,rule",
    [
        ("spec", "item_spec describes the item"),
        ("stale", "get returns what set stored"),
        ("shape", "get keeps shapes and dtypes"),
        ("mask", "masked positions are untouched"),
    ],
)
def test_storage_defects_are_named(bug, rule):
    _fails(rule, check_storage, Leaves(bug), example=EX, ndims=(1,))
