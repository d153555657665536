"""Eager calls: ``rb.add`` / ``rb.sample`` / ``rb.update`` outside ``jax.jit`` run as one cached,
compiled call that updates the state in place.

Why
---
A buffer's methods are made of dozens of small array operations. Called outside ``jit``, JAX
would dispatch them one by one, and could not write in place: every ``add`` would copy the
whole storage (at 1,000,000 items, tens of milliseconds per call against a fraction of a
millisecond compiled and donated). The obvious loop ::

    state = rb.add(state, items)
    sample, state = rb.sample(state, key)

must be the fast one, without its author knowing about ``jax.jit`` or donation.

Design
------
- **When.** A call takes this path only at top level: no JAX trace is active (``jit``,
  ``vmap``, ``scan``, ``grad``, ``shard_map``, ``pmap``) and no argument is a tracer. Anything
  traced runs the method's code as written, so inside a user's own ``jit``/``scan``/``vmap``
  nothing changes, and ``jax.jit(rb.sample)`` (with or without ``donate_argnums``) traces the
  same code as before.
- **What.** One ``jax.jit`` of the method itself per buffer, method, static arguments
  (``batch_size``, options that are not numbers) and argument signature; the first call
  compiles, later ones cost one dispatch. Tracing it once shows which leaves of the state the
  result returns unchanged: those are neither donated nor returned by the compiled call (the
  result gets the input's arrays back, in Python); the others are donated, so XLA writes the
  added batch into the input's storage. ``sample`` with a sampler that keeps no epoch changes
  nothing of the state: it donates nothing, copies nothing, and its ``Sample`` holds only the
  gathered batch.
- **The input state is consumed**, as with any function jitted with ``donate_argnums``: the
  arrays a call changes are deleted (``add``: the storage and the counters; ``sample``: a
  without-replacement epoch; ``update``: the priorities), the returned state replaces it, and
  it shares the unchanged arrays with the input. Treat every call as consuming its state.
  Passing a consumed state again raises :class:`~functional_rb._internal.errors.ConsumedStateError`
  ("consumed by an earlier call ... use the state that call returned"). To keep an older
  state too, copy it first (``jax.tree_util.tree_map(jnp.copy, state)``). A state donated to
  one's own ``jax.jit`` raises JAX's own "Array has been deleted" error there (JAX checks it
  before any code of ours runs); passed to an eager method, ``ConsumedStateError``.
- **Eager errors are kept.** The error policy (:mod:`functional_rb._internal.errors`) raises on bad
  *values* when they are concrete; compiled, they are traced. So a call first runs a compiled
  *check* of the same method whose only output is the policy's flags
  (:func:`~functional_rb._internal.errors.collect_flags`; XLA drops everything else, so it costs a few
  operations), and reads it. When it is set, the method runs again as plain eager code, not
  donated: it raises the error with the values in its message (or computes what eager code
  computes, when the flag came from a conversion at the jit boundary), and the input state is
  untouched. Trace-time errors (shapes, dtypes, structures) are raised while tracing, before
  anything is donated. A method without value checks (the default ``add``) skips the check.
- **Not waiting for ``sample``'s check.** Reading a flag waits for the device to finish the
  calls before it: once per call, an eager loop could not run ahead of the device as a jitted
  one does (measured: 2.5-3.5x slower). ``sample``'s checks depend on the state alone (its
  other arguments are a key and numbers): whether anything can be drawn. So a check that
  passed on a state is not repeated for the states its buffer's compiled calls derive from
  it; it is still computed inside those calls, and read when done (every 16 calls, without
  waiting; after 256 in any case). If it fails (a sampler that new data made unable to draw,
  as when short episodes overwrite every long one of a strict slice sampler), the following
  calls check again and raise; the calls before returned what they return under ``jit``
  (``mask`` False, weights 0). Checks of data (``add``'s items, ``update``'s priorities)
  run at every call, and so do ``sample``'s when the sampler ``depletes``
  (:class:`~functional_rb.SampleOnceSampler`: its own draws are what empties it, so the first
  call that can draw nothing raises).
- **Storages that read and write host memory** (``host_io``:
  :class:`~functional_rb.MemmapStorage`): ``add`` and ``sample`` are compiled without the
  storage's ``set`` / ``get``, which run between the compiled calls with concrete arrays
  (:mod:`functional_rb._internal.host_calls`); inside a compiled call they would be host
  callbacks, several times the cost of the rest.
- **Not taken** when it cannot be exact: a method whose compiled form has side effects (a
  host callback), integer arguments that JAX would wrap to 32 bits at the jit
  boundary (an int64 ``2**32 + 3`` index must stay out of range, not become item 3), or a
  static argument that is not hashable. Those calls run as plain eager code.

Alternatives considered: donating the whole state (every output aliased to its input) is as
fast, but a ``sample`` that changes nothing would consume the state for nothing. Pre-compiled
donated methods under other names (``rb.add_donated``) would leave the obvious code slow.
Raising after one donated call that also returns the flags would raise with the input already
consumed and the user's state lost.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import errors as _errors
from functional_rb._internal.jit import passed_through

try:  # the cheap test that no trace is active; JAX keeps it private
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - other JAX versions: tracers among the arguments only

    def _trace_state_clean() -> bool:
        return not jax.config.jax_disable_jit  # type: ignore[attr-defined]  # set at run time


_local = threading.local()
_PLAIN = "plain"


def top_level() -> bool:
    """Whether a buffer method called now may take the compiled path: no JAX trace is active
    (``jit``, ``vmap``, ``scan``, ``shard_map``...) and no plain run is in progress. Cheap (a
    microsecond): the buffer's methods ask it first; :func:`call` then checks the arguments."""
    return not getattr(_local, _PLAIN, False) and _trace_state_clean()


class _Plain:
    """Within the block, buffer methods run as written (the re-run that raises, and the body
    of the compiled call itself, so that ``jax.disable_jit`` cannot make it recurse)."""

    def __enter__(self):
        self.before = getattr(_local, _PLAIN, False)
        setattr(_local, _PLAIN, True)

    def __exit__(self, *exc):
        setattr(_local, _PLAIN, self.before)


def _method(rb, name, static, state, args, dynamic):
    with _Plain():
        return getattr(rb, name)(state, *args, **dict(static), **dynamic)


def _any(flags: list):
    return jnp.any(jnp.stack(flags)) if flags else None


def _flags(rb, name, static, state, args, dynamic):
    """The policy's flags of one call, reduced to one bool ``[]`` (None when it has none)."""
    with _errors.collect_flags() as flags:
        _method(rb, name, static, state, args, dynamic)
    return _any(flags)


class _Compiled(NamedTuple):
    """One method of one buffer, for one signature of its arguments.

    kind: "plain" when the compiled method has side effects (host callbacks), "unchecked"
      when it has no value checks, "checked" otherwise.
    run: ``(donated, kept, args, dynamic, pending) -> (computed, pending)``, jitted,
      ``donated`` donated: see :func:`_compile`.
    check: ``(state, args, dynamic) -> bool []`` (None: no checks), jitted.
    donated, kept: indices of the state's leaves that the call changes (donated) and that it
      returns unchanged or only reads (kept).
    plan: per output leaf, ``(True, k)``: the k-th computed leaf, or ``(False, i)``: the
      state's i-th leaf, returned unchanged (forwarded).
    out_tree: the tree structure of the result (with ``same_state``: of its other elements).
    same_state: the result is a tuple whose last element is the input state, unchanged.
    rb: the buffer (kept alive: the cache is keyed by its identity).
    keys_only: the positional arguments are PRNG keys only (see :func:`_carried`).
    """

    kind: str
    run: Any
    check: Any
    donated: tuple
    kept: tuple
    plan: tuple
    out_tree: Any
    same_state: bool
    keys_only: bool
    rb: Any


# (rb, name, static, tree structures and signature of the arguments) -> _Compiled, least
# recently used first. Bounded: each entry keeps its buffer and its executables alive, and a
# program that builds buffer after buffer (a property-based test) would otherwise grow it
# without end, executables' memory mappings included.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 128


def clear_cache() -> None:
    """Forget every compiled eager call (with ``jax.clear_caches()``, frees their executables:
    a test suite that builds thousands of buffers in one process calls both between modules)."""
    _COMPILED.clear()
    _LINEAGE.clear()


def _compile(rb, name, static, state, args, dynamic) -> _Compiled:
    """Trace the method once to see which state leaves its result returns unchanged: those
    are neither donated nor returned by the compiled call (the result gets the input's arrays
    back, in Python), so a call that changes nothing of the state (``sample`` with a
    ``RandomSampler``, ``update`` without priorities) consumes nothing, and the others donate
    only what they change (``add``: the storage and the counters; ``sample``: the epoch of a
    sampler without replacement). A closure per method and buffer: the jitted call then has
    no static arguments to hash and compare at each dispatch."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    closed, out_shape = jax.make_jaxpr(
        lambda s, a, d: _method(rb, name, static, s, a, d), return_shape=True
    )(state, args, dynamic)
    out_tree = jax.tree_util.tree_structure(out_shape)
    forwarded = {
        j: i for j, i in enumerate(passed_through(closed)) if i is not None and i < len(leaves)
    }
    computed = tuple(j for j in range(len(closed.jaxpr.outvars)) if j not in forwarded)
    donated = tuple(i for i in range(len(leaves)) if i not in set(forwarded.values()))
    kept = tuple(i for i in range(len(leaves)) if i not in donated)

    def run(donated_leaves, kept_leaves, args, dynamic, pending):
        both = dict(zip(donated, donated_leaves)) | dict(zip(kept, kept_leaves))
        state = jax.tree_util.tree_unflatten(treedef, [both[i] for i in range(len(leaves))])
        with _errors.collect_flags() as flags:
            out = jax.tree_util.tree_leaves(_method(rb, name, static, state, args, dynamic))
        return [out[j] for j in computed], pending if not flags else pending | _any(flags)

    check = jax.jit(functools.partial(_flags, rb, name, static))
    if closed.effects:
        kind = "plain"
    else:
        kind = "unchecked" if check(state, args, dynamic) is None else "checked"
    plan = tuple(
        (False, forwarded[j]) if j in forwarded else (True, computed.index(j))
        for j in range(len(closed.jaxpr.outvars))
    )
    n = len(leaves)
    same_state = (
        isinstance(out_shape, tuple)
        and len(out_shape) > 1
        and jax.tree_util.tree_structure(out_shape[-1]) == treedef  # type: ignore[operator]  # jaxlib has no stubs
        and plan[len(plan) - n :] == tuple((False, i) for i in range(n))
        and all(src for src, _ in plan[: len(plan) - n])
    )
    if same_state:
        out_tree = jax.tree_util.tree_structure(tuple(out_shape[:-1]))
    return _Compiled(
        kind,
        jax.jit(run, donate_argnums=(0,)),
        check,
        donated,
        kept,
        plan,
        out_tree,
        same_state,
        _keys_only(args),
        rb,
    )


def _result(fn: _Compiled, state, leaves: list, computed: list):
    """The method's result: the computed leaves, and the forwarded ones from the input. When
    the result ends with the input state unchanged (``sample`` with a sampler that keeps no
    epoch), that very state object is returned in it (rebuilding it costs microseconds)."""
    if fn.same_state:
        return (*jax.tree_util.tree_unflatten(fn.out_tree, computed), state)
    return jax.tree_util.tree_unflatten(
        fn.out_tree, [computed[k] if src else leaves[k] for src, k in fn.plan]
    )


class _Lineage(NamedTuple):
    """What the eager calls know of a state (kept by id, dropped when the state is freed).

    passed: keys of the checks that passed on it or on the states it derives from (through
      compiled calls of its buffer); such a check is not repeated (see :func:`call`).
    pending: bool ``[]``: whether a call since the last read would have failed its check.
    calls: how many calls ``pending`` covers.
    """

    ref: Any
    passed: frozenset
    pending: Any
    calls: int


_LINEAGE: dict = {}
# the carried-over checks are read after this many calls when they are computed, and after
# _WAIT_AFTER calls in any case (a wait)
_READ_EVERY = 16
_WAIT_AFTER = 256
_PURGE_AT = 64
_false = functools.lru_cache(maxsize=None)(lambda: jnp.asarray(False))


_NONE = None  # the empty lineage, built at the first call (it holds a device array)


def _lineage(state) -> _Lineage:
    global _NONE
    entry = _LINEAGE.get(id(state))
    if entry is None or entry.ref() is not state:
        if _NONE is None:
            _NONE = _Lineage(None, frozenset(), _false(), 0)
        return _NONE
    return entry


def _remember(state, passed: frozenset, pending, calls: int) -> None:
    if not passed:
        _LINEAGE.pop(id(state), None)
        return
    # read the carried-over checks when they are computed (no wait), at the latest (a wait)
    # after _WAIT_AFTER calls
    if calls >= _WAIT_AFTER or (calls >= _READ_EVERY and pending.is_ready()):
        if bool(pending):  # a carried-over check would have failed: check again from now on
            _LINEAGE.pop(id(state), None)
            return
        pending, calls = _false(), 0
    if len(_LINEAGE) >= _PURGE_AT:  # forget the states that were freed
        for i in [i for i, e in _LINEAGE.items() if e.ref() is None]:
            del _LINEAGE[i]
    _LINEAGE[id(state)] = _Lineage(weakref.ref(state), passed, pending, calls)


def _split(kwargs: dict) -> tuple[tuple, dict]:
    """Keyword arguments as ``(static items, dynamic dict)``: numbers that may change from
    call to call (floats, arrays: ``beta=``) are traced; Python ints, strings, None and other
    hashable values (``batch_size=``, ``axis_name=``) are static."""
    if not kwargs:
        return (), {}
    static, dynamic = [], {}
    for k, v in kwargs.items():
        if isinstance(v, (float, np.ndarray, np.generic, jax.Array)):
            dynamic[k] = v
        else:
            static.append((k, v))
    if len(static) > 1:
        static.sort(key=lambda kv: kv[0])
    return tuple(static), dynamic


_IS_ARRAY: dict = {}


def _is_array(x) -> bool:
    """``isinstance(x, jax.Array)``, cached per type (an ABC check costs microseconds)."""
    t = type(x)
    r = _IS_ARRAY.get(t)
    if r is None:
        r = _IS_ARRAY[t] = isinstance(x, jax.Array)
    return r


def _signature(leaves: list) -> tuple | None:
    """The arguments' shapes and dtypes; None when one of them cannot be passed to the compiled
    call exactly: a NumPy or Python integer that JAX would wrap to 32 bits at the jit boundary
    (x64 disabled): an int64 ``2**32 + 3`` index must stay out of range, not become item 3.
    (A tracer cannot be here, no trace being active, unless it leaked: jit then says so.)
    None too for anything that is not an array or a number (a NumPy ``Generator`` given as the
    key): the plain call's own checks then name the argument, where jit would not."""
    sig: list[tuple] = []
    for x in leaves:
        if _is_array(x):
            sig.append((x.shape, x.dtype))
            continue
        a = np.asarray(x)
        if a.dtype == object:
            return None
        if (
            a.dtype.kind in "iu"
            and a.dtype.itemsize > 4
            and a.size
            and not jax.config.jax_enable_x64  # type: ignore[attr-defined]  # set at run time
        ):
            info = np.iinfo(np.int32 if a.dtype.kind == "i" else np.uint32)
            if a.min() < info.min or a.max() > info.max:
                return None
        sig.append((type(x), a.shape, a.dtype))
    return tuple(sig)


def _keys_only(args: tuple) -> bool:
    """Whether every positional argument is a PRNG key (``sample``'s)."""
    return all(
        isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        for x in jax.tree_util.tree_leaves(args)
    )


def _carried(fn: _Compiled, dynamic: dict):
    """The part of a call's arguments that its carried-over check depends on, or None when
    the check must run at every call: it may only read the state, the static arguments, PRNG
    keys (whose values decide draws, not checks) and Python numbers (``beta=0.4``). Checks of
    data (``add``'s items, ``update``'s priorities) always run, and so does ``sample``'s
    when the buffer's sampler ``depletes`` (its own draws can leave nothing to draw)."""
    if not fn.keys_only or getattr(getattr(fn.rb, "sampler", None), "depletes", False):
        return None
    if not dynamic:
        return ()
    if any(not isinstance(v, float) for v in dynamic.values()):
        return None
    return tuple(sorted(dynamic.items()))


def _distinct(donated: list, others: list) -> list:
    """``donated``, with a copy of any leaf that is also another donated leaf or among
    ``others`` (kept leaves, arguments): XLA refuses to donate one buffer twice, and donating
    a buffer that is also passed undonated would delete it under the caller."""
    ids = {id(x) for x in donated}
    if len(ids) == len(donated) and not any(id(a) in ids for a in others):
        return donated
    seen, out = {id(a) for a in others}, []
    for x in donated:
        out.append(jnp.array(x, copy=True) if id(x) in seen else x)
        seen.add(id(x))
    return out


def call(rb, name: str, state, *args, **kwargs):
    """``getattr(rb, name)(state, *args, **kwargs)`` as one compiled call donating ``state``
    (see the module docstring); plain eager code where that could not be exact.

    The check of a call whose arguments are only PRNG keys and Python numbers (``sample``)
    runs once per lineage: when it passed on a state, the states derived from it by this
    buffer's compiled calls skip it, so an eager loop does not wait for each batch's check.
    The skipped checks are still computed (inside the call, or'ed into one flag) and read
    every ``_READ_EVERY`` calls or more: one that failed (the buffer can no longer be
    sampled: new short episodes overwrote every long one of a slice sampler, say) makes the
    following calls check again, and raise; until then those calls returned what they return
    under ``jit`` (``mask`` False, weights 0).
    """
    lineage = _lineage(state)
    if lineage.ref is None:  # not the newest state of a lineage: it may have been consumed
        _errors.check_not_consumed(state, f"ReplayBuffer.{name}")
    static, dynamic = _split(kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    arg_leaves, arg_def = jax.tree_util.tree_flatten((args, dynamic))
    sig = _signature(arg_leaves)
    if sig is None:
        return plain(rb, name, state, *args, **kwargs)
    # keyed by the buffer's identity (hashing a frozen dataclass recurses into its components
    # at every call); the entry keeps the buffer alive, so the identity is never reused
    key = (id(rb), name, static, treedef, arg_def, sig)
    try:
        fn = _COMPILED.get(key)
    except TypeError:  # a static argument that is not hashable
        return plain(rb, name, state, *args, **kwargs)
    try:
        if fn is None:
            fn = _COMPILED[key] = _compile(rb, name, static, state, args, dynamic)
            if len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        else:
            _COMPILED.move_to_end(key)
        if fn.kind == "plain":
            return plain(rb, name, state, *args, **kwargs)
        passed = lineage.passed
        check = None
        if fn.kind == "checked":
            carried = _carried(fn, dynamic)
            check = None if carried is None else (key, carried)
            if check is None or check not in passed:
                if bool(fn.check(state, args, dynamic)):
                    return plain(rb, name, state, *args, **kwargs)
                if check is not None:
                    passed = passed | {check}
        kept = [leaves[i] for i in fn.kept]
        donated = [leaves[i] for i in fn.donated]
        if lineage.ref is None:  # a state the compiled calls did not build: may share buffers
            donated = _distinct(donated, kept + arg_leaves)
        computed, pending = fn.run(donated, kept, args, dynamic, lineage.pending)
    except (RuntimeError, ValueError):
        # JAX's own error for a deleted array (a state donated to one's own jit): say so
        _errors.check_not_consumed(state, f"ReplayBuffer.{name}")
        raise
    out = _result(fn, state, leaves, computed)
    new = out[-1] if isinstance(out, tuple) else out
    if new is not state:  # the input may be consumed: its next call checks its arrays first
        _LINEAGE.pop(id(state), None)
    _remember(new, passed, pending, lineage.calls + 1)
    return out


def rebind(old, new) -> None:
    """Carry what the eager calls know of ``old`` over to ``new``, a state built from it in
    Python (the storage leaf replaced after a host write, :mod:`.host_calls`)."""
    entry = _LINEAGE.pop(id(old), None)
    if entry is not None and entry.ref() is old:
        _remember(new, entry.passed, entry.pending, entry.calls)


def plain(rb, name: str, state, *args, **kwargs):
    """The method run as plain eager code (op by op, not donated)."""
    with _Plain():
        return getattr(rb, name)(state, *args, **kwargs)
