"""``check_storage``: conformance of a storage to the ``Storage`` protocol (see
:mod:`functional_rb.testing.checks`)."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.protocol import WriteRecord
from functional_rb.testing import reference as ref
from functional_rb.testing._conformance import (
    JIT_FIX,
    ConformanceError,
    add_sizes,
    call_jitted,
    check_arrays,
    check_config,
    check_no_retrace,
    check_same,
    check_stable,
    component_example,
    counted,
    make_buffer,
    member_of,
)
from functional_rb.testing._data import StepStream, item_key


# ------------------------------------------------------------------ storages
def check_storage(
    storage,
    example=None,
    *,
    capacity: int = 8,
    ndims=(1, 2),
    num_envs: int = 2,
    seed: int = 0,
    vmap: bool = True,
) -> None:
    """Check a storage against the ``Storage`` protocol; raise :class:`ConformanceError`.

    Items read back must be bit-identical to the items written (NaN payloads and -0.0 among
    them); storages whose ``get`` returns another view of the items than ``item_spec``
    describes (``TEDStorage(frame_stack > 1)``) are out of scope. ``vmap=False`` for storages
    that cannot be mapped (``MemmapStorage``).
    """
    where = f"check_storage({type(storage).__name__})"
    check_config(storage, "Storage", where)
    for ndim in ndims:
        envs = num_envs if ndim == 2 else 1
        rb = make_buffer(where, capacity=capacity * envs, storage=storage, batch_size=2, ndim=ndim)
        here = f"{where} [ndim={ndim}]"
        ex = component_example(example, ndim, num_envs)
        state = rb.init(ex)
        check_arrays(state.storage, here, "init's state")
        item = jax.tree_util.tree_map(lambda x, ndim=ndim: x[0] if ndim == 2 else x, ex)
        want = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), item)
        spec = storage.item_spec(state.storage)
        if jax.tree_util.tree_structure(spec) != jax.tree_util.tree_structure(want) or any(  # type: ignore[operator]  # jaxlib has no stubs
            (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype)
            for a, b in zip(jax.tree_util.tree_leaves(spec), jax.tree_util.tree_leaves(want))
        ):
            raise ConformanceError(
                here,
                "item_spec describes the item",
                f"item_spec is {spec}, the example item is {want}",
                "item_spec returns one item's tree of ShapeDtypeStruct, as given to init.",
            )
        _drive_storage(rb, state, ex, ndim, seed, here)
        if vmap:
            _check_vmap_get(rb, rb.init(ex), here)


def _special(items, rng):
    """Put NaN, -0.0 and inf into float leaves now and then (bit-exact storage)."""

    def put(x):
        x = np.array(x)
        if x.dtype.kind == "f" and x.size:
            flat = x.reshape(-1)
            pick = rng.random(flat.shape) < 0.2
            flat[pick] = rng.choice(np.array([np.nan, -0.0, np.inf], x.dtype), pick.sum())
        return x

    return jax.tree_util.tree_map(put, items)


def _drive_storage(rb, state, ex, ndim: int, seed: int, where: str) -> None:
    stream = StepStream(ex, ndim=ndim, seed=seed)
    rng = np.random.default_rng(seed)
    lay = rb.layout(state)
    model = ref.RingModel(lay.num_envs, lay.row_capacity)
    counts: collections.Counter = collections.Counter()
    jadd, jget = counted(counts, "add", rb.add), counted(counts, "get", rb.get)
    sizes = add_sizes(lay.row_capacity)
    for step, n in enumerate(sizes):
        items = _special(stream.take(n, seed=n), rng)
        # the add that wraps the ring runs eagerly, the others under jit; both must leave what
        # the reference ring holds (one lineage: a storage may have side effects, e.g. files)
        new = rb.add(state, items) if step == 1 else call_jitted(jadd, state, items, where=where)
        check_stable(state, new, where, f"add of {n} steps")
        state = new
        flat = jax.tree_util.tree_map(
            lambda x, n=n: np.asarray(x).reshape((lay.num_envs, n) + x.shape[ndim:]), items
        )
        model.add(
            [
                ref.leaf_rows(jax.tree_util.tree_map(lambda x, e=e: x[e], flat))
                for e in range(lay.num_envs)
            ]
        )
        stored = model.stored()
        pos = np.resize(np.array(sorted(stored), np.int32), lay.capacity)  # one shape
        got = ref.leaf_rows(
            jax.tree_util.tree_map(np.asarray, call_jitted(jget, state, pos, where=where))
        )
        bad = sorted({int(p) for p, g in zip(pos, got) if item_key(g) != stored[int(p)][0]})
        if bad:
            raise ConformanceError(
                where,
                "get returns what set stored",
                f"after adds of "
                f"{model.added} steps per row ({'eager' if step == 1 else 'jit'}"
                f" add), positions {bad} read back other bits than the items "
                "written there",
                "set writes items[i] at positions[i] where "
                "mask[i], bit for bit; get reads them back.",
            )
        if step == 1:
            check_same(
                rb.get(state, pos),
                call_jitted(jget, state, pos, where=where),
                where,
                "jit equals eager",
                "get eagerly and under jax.jit",
                JIT_FIX,
            )
    idx = jnp.asarray(pos[:6].reshape(2, 3))
    spec = rb.storage.item_spec(state.storage)
    for x, s in zip(
        jax.tree_util.tree_leaves(jax.jit(rb.get)(state, idx)), jax.tree_util.tree_leaves(spec)
    ):
        if x.shape != (2, 3) + tuple(s.shape) or x.dtype != s.dtype:
            raise ConformanceError(
                where,
                "get keeps shapes and dtypes",
                f"get with indices "
                f"[2, 3] gave {x.dtype}{list(x.shape)}, expected {s.dtype}"
                f"{[2, 3] + list(s.shape)}",
                "get returns leaves [*indices.shape, *item_shape] of the stored dtypes.",
            )
    check_no_retrace(counts, where, {"add": len(set(sizes))})
    if not getattr(rb.storage, "requires_fifo", False):
        _check_masked(rb, state, stream, rng, where)


def _check_masked(rb, state, stream, rng, where: str) -> None:
    lay = rb.layout(state)
    pos = ref.prefix_positions(rb, state)
    before = ref.read(rb, state, pos)
    steps = pos.size // lay.num_envs
    items = rb.check_items(state, _special(stream.take(steps, seed=999), rng), where=where)
    if lay.ndim == 2:
        items = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
    mask = np.zeros(pos.size, bool)
    mask[::2] = True
    record = WriteRecord(jnp.asarray(pos), jnp.asarray(mask))
    new = rb.storage.set(state.storage, record, items, rb.context(state))
    after = ref.read(rb, dataclasses.replace(state, storage=new), pos)
    for b, a in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        if np.asarray(b)[~mask].tobytes() != np.asarray(a)[~mask].tobytes():
            raise ConformanceError(
                where,
                "masked positions are untouched",
                "set changed positions whose mask is False",
                "Drop masked rows (e.g. scatter them to out-of-range rows with mode='drop').",
            )


def _check_vmap_get(rb, state, where: str) -> None:
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    idx = jnp.zeros((2, 3), jnp.int32)
    try:
        out = jax.jit(jax.vmap(rb.get))(states, idx)
    except Exception as e:  # noqa: BLE001
        raise ConformanceError(
            where,
            "vmappable",
            f"jax.vmap(rb.get) raised {e!r}",
            "Use batchable operations; pass vmap=False to skip (e.g. MemmapStorage).",
        ) from e
    check_same(
        rb.get(state, idx[1]),
        member_of(out, 1),
        where,
        "vmappable",
        "a vmapped get and the unbatched one",
        "Do not mix batch members.",
    )
