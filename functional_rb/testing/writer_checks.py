"""``check_writer``: conformance of a writer to the ``Writer`` protocol (see
:mod:`functional_rb.testing.checks`)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.testing import reference as ref
from functional_rb.testing._conformance import (
    JIT_FIX,
    PURE_FIX,
    ConformanceError,
    add_sizes,
    call_jitted,
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


# ------------------------------------------------------------------ writers
def check_writer(
    writer,
    example=None,
    *,
    capacity: int = 8,
    ndims=(1, 2),
    num_envs: int = 2,
    seed: int = 0,
    vmap: bool = True,
) -> None:
    """Check a writer against the ``Writer`` protocol; raise :class:`ConformanceError`.

    Writers that only support ``ndim=1`` (e.g. ``MaxValueWriter``) take ``ndims=(1,)``.
    """
    where = f"check_writer({type(writer).__name__})"
    check_config(writer, "Writer", where)
    for ndim in ndims:
        envs = num_envs if ndim == 2 else 1
        rb = make_buffer(where, capacity=capacity * envs, writer=writer, batch_size=1, ndim=ndim)
        here = f"{where} [ndim={ndim}]"
        ex = component_example(example, ndim, num_envs)
        stream = StepStream(ex, ndim=ndim, seed=seed)
        try:
            state = rb.init(ex)
        except (TypeError, ValueError) as e:
            raise ConformanceError(
                here,
                "init builds a state",
                str(e),
                "Pass ndims=(1,) for writers that only support ndim=1.",
            ) from e
        lay = rb.layout(state)
        ws = state.writer
        _check_counters(ws, lay, here, None)
        added: set = set()
        counts: collections.Counter = collections.Counter()
        jwrite = counted(counts, "write", writer.write, static_argnums=2)
        jadd = counted(counts, "add", rb.add)
        sizes = add_sizes(capacity)
        for step, n in enumerate(sizes):
            items = rb.check_items(state, stream.take(n, seed=n), where=here)
            record, new_ws = call_jitted(jwrite, state.writer, items, lay, where=here)
            _check_record(record, state.writer, new_ws, n, lay, writer, here)
            check_stable(state.writer, new_ws, here, f"a write of {n} steps")
            if step == 1:  # the write that wraps the ring: eagerly too
                once = writer.write(state.writer, items, lay)
                check_same(
                    once,
                    writer.write(state.writer, items, lay),
                    here,
                    "pure",
                    "two eager writes of the same items",
                    PURE_FIX,
                )
                check_same(
                    once,
                    (record, new_ws),
                    here,
                    "jit equals eager",
                    "write eagerly and under jax.jit",
                    JIT_FIX,
                )
            flat = jax.tree_util.tree_map(
                lambda x, ndim=ndim: np.asarray(x).reshape((-1,) + x.shape[ndim:]), items
            )
            rows = ref.leaf_rows(flat)
            added.update(item_key(r) for r in rows)
            state = call_jitted(jadd, state, items, where=here)
            _check_landing(rb, state, record, rows, added, here)
        check_no_retrace(counts, here, {"write": len(set(sizes)), "add": len(set(sizes))})
        if vmap:
            _check_vmap_write(writer, state.writer, items, lay, here)


def _check_counters(ws, lay, where: str, before) -> None:
    for name in ("cursor", "filled"):
        x = getattr(ws, name, None)
        if x is None or np.asarray(x).shape != () or np.asarray(x).dtype != np.int32:
            raise ConformanceError(
                where,
                "writer state counters",
                f"state.{name} is {x!r}",
                "Every writer state has int32 [] `cursor` and `filled`.",
            )
    c, f = int(ws.cursor), int(ws.filled)
    if not (0 <= f <= lay.row_capacity and 0 <= c < lay.row_capacity) or (
        before is not None and f < int(before.filled)
    ):
        raise ConformanceError(
            where,
            "writer state counters",
            f"cursor={c}, filled={f} "
            f"(before: filled={None if before is None else int(before.filled)}"
            f"), row capacity {lay.row_capacity}",
            "0 <= cursor < row capacity, 0 <= filled <= row capacity, filled never decreases.",
        )


def _check_record(record, old, new, steps: int, lay, writer, where: str) -> None:
    pos, mask = getattr(record, "positions", None), getattr(record, "mask", None)
    b = steps * lay.num_envs
    if (
        pos is None
        or mask is None
        or np.asarray(pos).dtype != np.int32
        or np.asarray(mask).dtype != bool
        or np.shape(pos) != (b,)
        or np.shape(mask) != (b,)
    ):
        raise ConformanceError(
            where,
            "write returns (WriteRecord, state)",
            f"got {record!r}",
            f"Return functional_rb.protocol.WriteRecord(positions int32 [{b}], "
            f"mask bool [{b}]) (flat, env-major).",
        )
    _check_counters(new, lay, where, old)
    pos, mask = np.asarray(pos), np.asarray(mask)
    live = pos[mask]
    if live.size and (
        live.min() < 0 or live.max() >= lay.capacity or np.unique(live).size != live.size
    ):
        raise ConformanceError(
            where,
            "positions unique and in range",
            f"written positions {live.tolist()} (capacity {lay.capacity})",
            "Unmasked "
            "positions are distinct flat positions; mask out superseded "
            "items instead of writing them twice.",
        )
    env = np.repeat(np.arange(lay.num_envs), steps)[mask]
    t = live % lay.row_capacity
    if np.any(live // lay.row_capacity != env) or np.any(t >= int(new.filled)):
        raise ConformanceError(
            where,
            "writes stay in their row's stored prefix",
            f"positions {live.tolist()} for envs {env.tolist()}, filled {int(new.filled)} per row",
            "Env e's items go to row e, and "
            "every written slot t is below the new `filled` (samplers draw "
            "t < filled).",
        )
    run_start = getattr(record, "run_start", None)
    if run_start is not None and not np.array_equal(
        pos, (int(run_start) + np.arange(b)) % lay.capacity
    ):
        raise ConformanceError(
            where,
            "run_start promise",
            f"run_start={int(run_start)} but positions are {pos.tolist()}",
            "Set run_start only when positions == (run_start + arange(B)) % capacity.",
        )
    if getattr(writer, "time_ordered", False):
        r, c0, f0 = lay.row_capacity, int(old.cursor), int(old.filled)
        k = min(steps, r)
        want_t = (c0 + np.arange(steps - k, steps)) % r
        got_t = pos.reshape(lay.num_envs, steps)[:, steps - k :] % r
        want_mask = np.arange(steps) >= steps - k
        if (
            not np.all(got_t == want_t[None])
            or not np.array_equal(
                mask.reshape(lay.num_envs, steps), np.broadcast_to(want_mask, (lay.num_envs, steps))
            )
            or int(new.cursor) != (c0 + steps) % r
            or int(new.filled) != min(f0 + steps, r)
        ):
            raise ConformanceError(
                where,
                "time_ordered writers are FIFO rings",
                f"from cursor "
                f"{c0}, filled {f0}: {steps} steps went to slots "
                f"{got_t.tolist()} (mask {mask.tolist()}), new cursor "
                f"{int(new.cursor)}, filled {int(new.filled)}",
                "A time_ordered writer writes step j at (cursor + j) % R, "
                "keeps the last R steps, and advances cursor and filled; "
                "or declare time_ordered = False.",
            )


def _check_landing(rb, state, record, rows, added, where: str) -> None:
    pos, mask = np.asarray(record.positions), np.asarray(record.mask)
    got = ref.leaf_rows(ref.read(rb, state, pos[mask]))
    want = [rows[i] for i in np.flatnonzero(mask)]
    if any(item_key(a) != item_key(b) for a, b in zip(got, want)):
        raise ConformanceError(
            where,
            "items land at their positions",
            "after an add, a "
            "written position holds another item than the one the record "
            "sent there",
            "Positions and mask must describe the write.",
        )
    stored = ref.leaf_rows(ref.read(rb, state, ref.prefix_positions(rb, state)))
    if any(item_key(r) not in added for r in stored):
        raise ConformanceError(
            where,
            "stores only items it was given",
            "a stored slot (t < filled) holds an item that was never added",
            "Grow `filled` only over slots that were written.",
        )


def _check_vmap_write(writer, ws, items, lay, where: str) -> None:
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ws)
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), items)
    try:
        out = jax.jit(jax.vmap(writer.write, in_axes=(0, 0, None)), static_argnums=2)(
            states, batch, lay
        )
    except Exception as e:  # noqa: BLE001
        raise ConformanceError(
            where,
            "vmappable",
            f"jax.vmap(writer.write) raised {e!r}",
            "Use batchable operations; pass vmap=False to skip.",
        ) from e
    check_same(
        writer.write(ws, items, lay),
        member_of(out, 1),
        where,
        "vmappable",
        "a vmapped write and the unbatched one",
        "Do not mix batch members.",
    )
