"""Hypothesis strategies for replay-buffer tests (needs the ``test`` extra).

* :func:`item_specs` / :func:`items`: PyTree item specs (nested dicts and tuples, dtypes,
  shapes) and items or batches of them;
* :func:`episodes`: TED step streams (observations, actions, ``("next", ...)`` entries with
  done / terminated / truncated flags, trajectory ids), ``ndim`` 1 or 2;
* :func:`buffers`: valid ``ReplayBuffer`` configurations over every built-in sampler, writer
  and storage (``TEDStorage`` and ``MemmapStorage`` included), or over your own components;
* :func:`operations`: programs of add / sample / update / checkpoint operations whose batch
  sizes cross the capacity and wrap the ring; :func:`run_operations` runs one (eagerly or
  under jit), checking :func:`~functional_rb.testing.assert_invariants` after each step.

Every configuration :func:`buffers` draws accepts the items of :func:`episode_example`
(``num_envs`` envs for ``ndim=2``), which :func:`operations` uses by default.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.testing._hypothesis import require

require()
from hypothesis import assume  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import functional_rb as frb  # noqa: E402
from functional_rb.storages.device import PackedStorage  # noqa: E402
from functional_rb.testing._data import TRAJ_KEY, StepStream  # noqa: E402
from functional_rb.testing.invariants import assert_invariants  # noqa: E402

PyTree = Any

# the defaults of episodes(steps=) and buffers(row_capacities=, batch_sizes=)
_STEPS = st.integers(1, 24)
_ROW_CAPACITIES = st.integers(1, 8)
_BATCH_SIZES = st.sampled_from([1, 2, 4, 6])

__all__ = (
    "Add",
    "Checkpoint",
    "Sample",
    "Update",
    "buffers",
    "episode_example",
    "episodes",
    "item_specs",
    "items",
    "operations",
    "run_operations",
)

DTYPES = (np.bool_, np.uint8, np.int32, np.float32)


# ------------------------------------------------------------------ items
def item_specs(
    *, dtypes=DTYPES, max_leaves: int = 4, max_dims: int = 2, max_side: int = 3
) -> st.SearchStrategy:
    """PyTrees of ``jax.ShapeDtypeStruct``: nested dicts (string keys) and tuples, at most
    ``max_leaves`` leaves of the given dtypes, each of at most ``max_dims`` axes."""
    leaf = st.builds(
        jax.ShapeDtypeStruct,
        hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=1, max_side=max_side),
        st.sampled_from([np.dtype(d) for d in dtypes]),
    )
    keys = st.text("abcdefghij", min_size=1, max_size=3)

    def extend(children):
        return st.one_of(
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def _elements(dtype: np.dtype):
    if dtype.kind == "f":
        width = 8 * dtype.itemsize
        # type-checked as Literal[16, 32, 64], which a float dtype's 8 * itemsize always is
        return st.floats(-1e6, 1e6, width=width, allow_subnormal=False)  # type: ignore[arg-type]
    return None


@st.composite
def items(draw, spec=None, *, batch_shape=()) -> PyTree:
    """An item shaped like ``spec`` (a tree of arrays or ``ShapeDtypeStruct``; default: one
    drawn by :func:`item_specs`) with leaves ``[*batch_shape, *shape]`` as NumPy arrays.
    ``batch_shape``: a tuple or a strategy of tuples (``()``: one item)."""
    if spec is None:
        spec = draw(item_specs())
    if isinstance(batch_shape, st.SearchStrategy):
        batch_shape = draw(batch_shape)

    def leaf(s):
        dtype = np.dtype(s.dtype)
        return draw(
            hnp.arrays(dtype, tuple(batch_shape) + tuple(s.shape), elements=_elements(dtype))
        )

    return jax.tree_util.tree_map(leaf, spec)


def episode_example(ndim: int = 1, num_envs: int = 2, obs_shape: tuple = (2,)) -> dict:
    """One TED item (``ndim=2``: one vectorized step, leaves ``[num_envs, ...]``) of the
    structure :func:`episodes` produces."""
    lead = (num_envs,) if ndim == 2 else ()
    flag = jnp.zeros(lead + (1,), bool)
    return {
        "observation": jnp.zeros(lead + tuple(obs_shape), jnp.float32),
        "action": jnp.zeros(lead, jnp.int32),
        "done": flag,
        "terminated": flag,
        "truncated": flag,
        "collector": {"traj_ids": jnp.zeros(lead, jnp.int32)},
        "next": {
            "observation": jnp.zeros(lead + tuple(obs_shape), jnp.float32),
            "reward": jnp.zeros(lead + (1,), jnp.float32),
            "done": flag,
            "terminated": flag,
            "truncated": flag,
        },
    }


@st.composite
def episodes(
    draw, *, ndim: int = 1, num_envs: int = 2, steps=_STEPS, obs_shape: tuple = (2,)
) -> dict:
    """A TED step stream: leaves ``[T, ...]`` (``ndim=2``: ``[num_envs, T, ...]``).

    Episode ends (``("next", "done")``) are drawn per step, some of them truncations; the
    last episode of an env may be still running. Within an episode ``("next",
    "observation")`` of a step is the next step's ``"observation"``; ``("collector",
    "traj_ids")`` numbers the episodes (unique across envs). Root done flags are False.
    ``steps``: the steps per env, an int or a strategy (default ``st.integers(1, 24)``).
    """
    t = draw(steps) if isinstance(steps, st.SearchStrategy) else int(steps)
    envs = num_envs if ndim == 2 else 1
    ends = [
        draw(st.lists(st.booleans(), min_size=t, max_size=t), label=f"ends[{e}]")
        for e in range(envs)
    ]
    truncs = [
        draw(st.lists(st.booleans(), min_size=t, max_size=t), label=f"truncated[{e}]")
        for e in range(envs)
    ]
    rng = np.random.default_rng(draw(st.integers(0, 2**16 - 1), label="seed"))
    ex = episode_example(2, envs, obs_shape)
    out = jax.tree_util.tree_map(lambda x: np.zeros((envs, t) + x.shape[1:], x.dtype), ex)
    next_id = 0
    for e in range(envs):
        obs = rng.integers(0, 4, obs_shape).astype(np.float32)
        tid, next_id = next_id, next_id + 1
        for j in range(t):
            nxt = rng.integers(0, 4, obs_shape).astype(np.float32)
            end, trunc = ends[e][j], ends[e][j] and truncs[e][j]
            out["observation"][e, j] = obs
            out["action"][e, j] = rng.integers(0, 3)
            out["collector"]["traj_ids"][e, j] = tid
            out["next"]["observation"][e, j] = nxt
            out["next"]["reward"][e, j] = rng.integers(-4, 4) * 0.5
            out["next"]["done"][e, j] = end
            out["next"]["truncated"][e, j] = trunc
            out["next"]["terminated"][e, j] = end and not trunc
            obs = rng.integers(0, 4, obs_shape).astype(np.float32) if end else nxt
            if end:
                tid, next_id = next_id, next_id + 1
    return out if ndim == 2 else jax.tree_util.tree_map(lambda x: x[0], out)


# ------------------------------------------------------------------ buffers
_MEMMAP_ROOT: list = []


def _memmap_dir() -> str:
    """A fresh directory per drawn MemmapStorage (an existing one would be reopened with its
    data), under one root removed at exit."""
    if not _MEMMAP_ROOT:
        _MEMMAP_ROOT.append(tempfile.mkdtemp(prefix="frb-testing-"))
        atexit.register(shutil.rmtree, _MEMMAP_ROOT[0], True)
    return tempfile.mkdtemp(dir=_MEMMAP_ROOT[0])


def _choose(given, default: st.SearchStrategy) -> st.SearchStrategy:
    if given is None:
        return default
    if isinstance(given, st.SearchStrategy):
        return given
    return st.sampled_from(list(given))


def _writers(ndim: int) -> st.SearchStrategy:
    options = [st.just(frb.RoundRobinWriter()), st.just(frb.ImmutableWriter())]
    if ndim == 1:
        options.append(
            st.builds(
                frb.MaxValueWriter,
                st.just(("next", "reward")),
                st.sampled_from(["sum", "mean", "max", "min"]),
            )
        )
    return st.one_of(options)


@st.composite
def _slice_sampler(draw, row: int, batch_size: int):
    kind = draw(st.sampled_from(["slice", "without_replacement", "prioritized"]))
    strict = draw(st.booleans())
    lens = [n for n in range(1, batch_size + 1) if batch_size % n == 0 and (not strict or n <= row)]
    assume(lens)
    length = draw(st.sampled_from(lens))
    by = draw(st.sampled_from(["slice_len", "num_slices"]))
    kw = {"slice_len": length} if by == "slice_len" else {"num_slices": batch_size // length}
    kw.update(strict_length=strict, traj_key=draw(st.sampled_from([None, TRAJ_KEY])))
    if kind == "slice":
        return frb.SliceSampler(**kw)
    if kind == "without_replacement":
        return frb.SliceSamplerWithoutReplacement(
            drop_last=draw(st.booleans()), shuffle=draw(st.booleans()), **kw
        )
    return frb.PrioritizedSliceSampler(
        alpha=draw(st.sampled_from([0.0, 0.6, 1.0])),
        beta=draw(st.sampled_from([0.0, 0.4, 1.0])),
        **kw,
    )


def _samplers(fifo: bool, row: int, capacity: int, batch_size: int) -> st.SearchStrategy:
    options = [
        st.just(frb.RandomSampler()),
        st.builds(
            frb.SamplerWithoutReplacement,
            drop_last=st.booleans() if batch_size <= capacity else st.just(False),
            shuffle=st.booleans(),
        ),
        st.builds(
            frb.PrioritizedSampler,
            alpha=st.sampled_from([0.0, 0.6, 1.0]),
            beta=st.sampled_from([0.0, 0.4, 1.0]),
            stratified=st.booleans(),
        ),
    ]
    if fifo:
        options.append(_slice_sampler(row, batch_size))
    return st.one_of(options)


def _storages(fifo: bool, memmap: bool) -> st.SearchStrategy:
    options: list[st.SearchStrategy] = [st.just(PackedStorage())]  # DeviceStorage()
    if fifo:
        options.append(st.just(frb.TEDStorage(min_episode_len=1)))
    if memmap:
        options.append(st.builds(lambda: frb.MemmapStorage(_memmap_dir())))
    return st.one_of(options)


@st.composite
def buffers(
    draw,
    samplers=None,
    writers=None,
    storages=None,
    *,
    ndims=(1, 2),
    row_capacities=_ROW_CAPACITIES,
    batch_sizes=_BATCH_SIZES,
    num_envs: int = 2,
    memmap: bool = True,
) -> frb.ReplayBuffer:
    """Valid ``ReplayBuffer`` configurations.

    ``samplers`` / ``writers`` / ``storages``: ``None`` (every built-in one, with drawn
    settings), a sequence of instances, or a strategy. Combinations the core refuses (a slice
    sampler or ``TEDStorage`` with a writer that is not time-ordered, ``MaxValueWriter`` with
    ``ndim=2``, ...) are never returned. ``ndim=2`` buffers are sized for ``num_envs`` envs.
    ``memmap=False`` leaves out ``MemmapStorage`` (it writes files and cannot be vmapped).
    ``row_capacities`` / ``batch_sizes``: ints or strategies (default ``st.integers(1, 8)`` /
    ``st.sampled_from([1, 2, 4, 6])``).
    """
    ndim = draw(st.sampled_from(list(ndims)))
    row = (
        draw(row_capacities)
        if isinstance(row_capacities, st.SearchStrategy)
        else int(row_capacities)
    )
    envs = num_envs if ndim == 2 else 1
    batch_size = (
        draw(batch_sizes) if isinstance(batch_sizes, st.SearchStrategy) else int(batch_sizes)
    )
    writer = draw(_choose(writers, _writers(ndim)))
    fifo = bool(getattr(writer, "time_ordered", False)) or isinstance(
        writer, (frb.RoundRobinWriter, frb.ImmutableWriter)
    )
    sampler = draw(_choose(samplers, _samplers(fifo, row, envs * row, batch_size)))
    storage = draw(_choose(storages, _storages(fifo, memmap)))
    try:
        rb = frb.ReplayBuffer(
            capacity=envs * row,
            sampler=sampler,
            writer=writer,
            storage=storage,
            batch_size=batch_size,
            ndim=ndim,
        )
        jax.eval_shape(rb.init, episode_example(ndim, num_envs))
    except (TypeError, ValueError, KeyError):
        assume(False)
    return rb


# ------------------------------------------------------------------ operations
class Add(NamedTuple):
    """``rb.add(state, items)``."""

    items: PyTree


class Sample(NamedTuple):
    """``rb.sample(state, jax.random.key(seed))`` when something can be sampled."""

    seed: int


class Update(NamedTuple):
    """``rb.update`` of the last sample's indices with priorities drawn from ``values``
    (cycled over the indices)."""

    values: tuple


class Checkpoint(NamedTuple):
    """``frb.checkpoint.save`` then ``load(like=state)``."""


def _add_sizes(row: int) -> list[int]:
    return sorted({1, max(row - 1, 1), row, row + 1, 2 * row + 1})


@st.composite
def operations(
    draw, rb, example=None, *, num_envs: int = 2, min_size: int = 1, max_size: int = 12
) -> list:
    """A program for ``rb``: a list of :class:`Add`, :class:`Sample`, :class:`Update` and
    :class:`Checkpoint`. Add sizes are 1, ``R - 1``, ``R``, ``R + 1`` and ``2R + 1`` for row
    capacity ``R`` (crossing the capacity and wrapping the ring within one add). The items
    continue one stream of episodes (:class:`~functional_rb.testing._data.StepStream`) shaped
    like ``example`` (default :func:`episode_example`). Run it with :func:`run_operations`.
    ``ImmutableWriter`` buffers get no adds (their state comes from ``init_from_data``)."""
    if example is None:
        example = episode_example(rb.ndim, num_envs)
    stream = StepStream(example, ndim=rb.ndim, seed=draw(st.integers(0, 2**16 - 1)))
    row = rb.capacity // (num_envs if rb.ndim == 2 else 1)
    kinds = ["sample", "update", "checkpoint"]
    if not isinstance(rb.writer, frb.ImmutableWriter):
        kinds = ["add", "add"] + kinds
    ops: list = []
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=min_size, max_size=max_size)):
        if kind == "add":
            ops.append(Add(stream.take(draw(st.sampled_from(_add_sizes(row))))))
        elif kind == "sample":
            ops.append(Sample(draw(st.integers(0, 2**16 - 1))))
        elif kind == "update":
            ops.append(
                Update(
                    tuple(
                        draw(
                            st.lists(
                                st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0, 1e3]),
                                min_size=1,
                                max_size=4,
                            )
                        )
                    )
                )
            )
        else:
            ops.append(Checkpoint())
    return ops


def run_operations(
    rb, ops, example=None, *, num_envs: int = 2, jit: bool = False, check: bool = True, data=None
):
    """Run a program from :func:`operations` on a fresh state; returns the final state.

    The state starts as ``rb.init(example)`` (``ImmutableWriter``: ``rb.init_from_data(data)``,
    default one ring's worth of :func:`episode_example`-shaped steps). ``jit=True`` runs
    ``add``/``sample``/``update`` under ``jax.jit``; ``check`` calls
    :func:`~functional_rb.testing.assert_invariants` after each operation."""
    import os

    if example is None:
        example = episode_example(rb.ndim, num_envs)
    wrap = jax.jit if jit else (lambda f: f)
    add, sample, update = wrap(rb.add), wrap(rb.sample), wrap(rb.update)
    if isinstance(rb.writer, frb.ImmutableWriter):
        if data is None:
            rows = rb.capacity // (num_envs if rb.ndim == 2 else 1)
            data = StepStream(example, ndim=rb.ndim).take(rows)
        state = rb.init_from_data(data)
    else:
        state = rb.init(example)
    last = None
    if check:
        assert_invariants(rb, state)
    for op in ops:
        if isinstance(op, Add):
            state = add(state, op.items)
        elif isinstance(op, Sample):
            if bool(rb.can_sample(state)):
                last, state = sample(state, jax.random.key(op.seed))
        elif isinstance(op, Update):
            if last is not None:
                prio = np.resize(np.asarray(op.values, np.float32), last.indices.shape)
                state = update(state, last.indices, jnp.asarray(prio))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "state.npz")
                frb.checkpoint.save(path, state)
                state = frb.checkpoint.load(path, like=state)
        if check:
            assert_invariants(rb, state)
    return state
