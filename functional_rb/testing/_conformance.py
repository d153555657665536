"""Rules shared by the conformance checks (``check_sampler``, ``check_writer``,
``check_storage``): protocol members, hashable configs, stable state structure, purity,
jittability and no retracing, and the error they raise."""

from __future__ import annotations

import collections
import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import functional_rb as frb
from functional_rb import protocol

_REQUIRED = {
    "Sampler": ("init", "on_add", "can_sample", "sample", "update", "finalize"),
    "Writer": ("init", "write"),
    "Storage": ("init", "item_spec", "set", "get"),
}


class ConformanceError(AssertionError):
    """A broken protocol rule; ``rule`` names it."""

    def __init__(self, where: str, rule: str, detail: str, fix: str):
        self.rule = rule
        super().__init__(f'{where}: rule "{rule}" is broken: {detail}. {fix}')


def default_example() -> dict:
    """One TED item that every built-in component accepts."""
    return {
        "observation": jnp.zeros((3,), jnp.float32),
        "action": jnp.int32(0),
        "collector": {"traj_ids": jnp.int32(0)},
        "next": {
            "observation": jnp.zeros((3,), jnp.float32),
            "reward": jnp.float32(0),
            "done": jnp.zeros((1,), bool),
            "truncated": jnp.zeros((1,), bool),
            "terminated": jnp.zeros((1,), bool),
        },
    }


# ------------------------------------------------------------------ shared rules
def protocol_members(obj, kind: str) -> list:
    return protocol.missing_members(obj, getattr(protocol, kind))


def check_config(obj, kind: str, where: str) -> None:
    missing = protocol_members(obj, kind)
    not_callable = [m for m in _REQUIRED[kind] if hasattr(obj, m) and not callable(getattr(obj, m))]
    if missing or not_callable:
        raise ConformanceError(
            where,
            f"implements the {kind} protocol",
            f"{type(obj).__name__} lacks {missing}"
            + (f" and {not_callable} are not methods" if not_callable else ""),
            f"Subclass functional_rb.protocol.{kind} (it supplies the optional members' defaults)"
            " "
            "and define the required methods.",
        )
    try:
        same = copy.deepcopy(obj)
        ok = hash(same) == hash(obj) and same == obj
    except TypeError as e:
        raise ConformanceError(
            where,
            "hashable frozen config",
            f"hash({type(obj).__name__}(...)) raised {e}",
            "Make it a @dataclasses.dataclass(frozen=True) of static settings: jit caches on it.",
        ) from e
    # every dataclass has __dataclass_params__; typeshed's DataclassInstance names only its fields
    frozen = (not dataclasses.is_dataclass(obj)) or obj.__dataclass_params__.frozen  # type: ignore[union-attr]
    if not (ok and frozen):
        raise ConformanceError(
            where,
            "hashable frozen config",
            f"{type(obj).__name__} is {'not frozen' if not frozen else 'not equal to its copy'}",
            "Use @dataclasses.dataclass(frozen=True): two equal configs "
            "must hash equal so that jit reuses its compilations.",
        )


def signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(
        (
            tuple(np.shape(x)),
            str(getattr(x, "dtype", type(x))),
            bool(getattr(x, "weak_type", False)),
        )
        for x in leaves
    )


def check_stable(before, after, where: str, what: str) -> None:
    a, b = signature(before), signature(after)
    if a != b:
        diff = [(i, x, y) for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y][:3]
        detail = (
            f"the tree changed from {a[0]} to {b[0]}"
            if a[0] != b[0]
            else f"leaves changed (index, (shape, dtype, weak_type) before, after): {diff}"
        )
        raise ConformanceError(
            where,
            "state structure is stable (no retrace)",
            f"after {what} {detail}",
            "Return states of the same tree, shapes and dtypes as init "
            "(cast with .astype; jnp.int32(...) for scalars): otherwise "
            "lax.scan fails and jit retraces.",
        )


def check_arrays(tree, where: str, what: str) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, jax.Array):
            raise ConformanceError(
                where,
                "state is a PyTree of arrays",
                f"{what} has leaf {jax.tree_util.keystr(path)} of type {type(x).__name__}",
                "Keep static settings on the config object (or as static "
                "dataclass fields) and only jax arrays as leaves.",
            )


def equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):  # type: ignore[operator]  # jaxlib has no stubs
        return False
    return all(
        np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


def call_jitted(jitted, *args, where: str):
    """Call a jitted function; a failure to trace or run is the "jittable" rule."""
    try:
        return jitted(*args)
    except ConformanceError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure breaks the rule; the cause is chained
        raise ConformanceError(
            where, "jittable", f"{getattr(jitted, 'what', 'a jitted call')} raised {e!r}", JIT_FIX
        ) from e


def check_same(eager, other, where: str, rule: str, what: str, fix: str) -> None:
    if not equal(jax.device_get(eager), jax.device_get(other)):
        raise ConformanceError(where, rule, f"{what} differ", fix)


PURE_FIX = (
    "Draw randomness only from the key argument and keep no Python state between "
    "calls: the component's functions must be pure."
)
JIT_FIX = (
    "Avoid Python control flow on traced values and host callbacks with side effects; "
    "use lax.cond / jnp.where."
)


def make_buffer(where: str, **kw):
    try:
        return frb.ReplayBuffer(**kw)
    except (TypeError, ValueError) as e:
        raise ConformanceError(
            where,
            "accepted by ReplayBuffer",
            str(e),
            "Fix the component (or the check's arguments).",
        ) from e


def component_example(example, ndim: int, num_envs: int):
    item = default_example() if example is None else example
    item = jax.tree_util.tree_map(jnp.asarray, item)
    if ndim == 2:
        return jax.tree_util.tree_map(lambda x: jnp.stack([x] * num_envs), item)
    return item


def add_sizes(row: int) -> list[int]:
    """Steps per add: a few, then one that crosses the capacity and wraps the ring, one that
    brings more than the ring holds, and the first size again (three shapes to compile)."""
    first = 3 if row > 3 else 1
    return [first, row + 1, 2 * row + 1, first]


def counted(counter: collections.Counter, name: str, fn, **jit_kw):
    """``jax.jit(fn)`` that counts its traces in ``counter[name]``."""

    def traced(*args, **kwargs):
        counter[name] += 1  # runs once per trace
        return fn(*args, **kwargs)

    jitted = jax.jit(traced, **jit_kw)
    jitted.what = f"jax.jit({name})"  # type: ignore[attr-defined]  # a label, read by call_jitted
    return jitted


def check_no_retrace(counter, where: str, shapes=None) -> None:
    """Each jitted function traced once per distinct input shape (``shapes``: how many a
    function was given; 1 by default)."""
    shapes = shapes or {}
    again = {k: v for k, v in counter.items() if v > shapes.get(k, 1)}
    if again:
        raise ConformanceError(
            where,
            "no retrace",
            f"jitted calls of the same shapes were traced again: {again} traces",
            "Keep every state leaf's shape, "
            "dtype and weak type fixed (jnp.int32(0), not 0) and configs "
            "hashable and equal across calls.",
        )


def member_of(tree, i: int):
    return jax.tree_util.tree_map(lambda x: x[i], tree)
