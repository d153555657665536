"""Each item drawn at most once until its slot is rewritten (sampling without replacement
across calls, with no epochs).

:class:`~functional_rb.SamplerWithoutReplacement` draws each item once per *epoch* and starts a
new epoch (every item drawable again) when the old one runs out. :class:`SampleOnceSampler`
has no epochs: it keeps one flag per slot, set when the item in it is drawn and cleared only
when a writer puts a new item into the slot. An item is therefore returned at most once in its
whole life in the buffer, whatever the number of ``sample`` calls; only new data is drawable
again (flashbax issue #59).

How a batch is drawn (:func:`draw`): ``count`` distinct drawable slots, uniformly without
replacement, in a uniformly random order. A cheap path draws ``4 * count`` candidate slots
uniformly with replacement and keeps the first ``count`` distinct drawable ones in draw order;
it costs ``O(count log count)`` and holds whenever enough slots are drawable. Otherwise (under
``lax.cond``, so only then; under ``vmap`` both run) an exact pass ranks every drawable slot by
a random score and takes the top ``count`` with ``lax.top_k``: ``O(capacity)``. Both give the
same distribution: the distinct values of an i.i.d. uniform stream, in order of first
appearance, are a uniformly random ordering of the drawable set, and whether the cheap path
holds does not depend on which slots are drawable, only on how many.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from functional_rb._internal.names import stable
from functional_rb._internal.random import bits32
from functional_rb.protocol import Context, Drawn, Layout, Sampler
from functional_rb.samplers.uniform import uniform_index

__all__ = ("SampleOnceSampler", "SampleOnceState", "draw")

# candidates drawn per requested item on the cheap path (see the module docstring): with a
# fraction f of the slots drawable the path fails about as often as Binomial(4 count, f) falls
# below count, so for f >= 1/2 it almost never does
_CANDIDATES = 4


@stable("SampleOnceState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOnceState:
    """State of a :class:`SampleOnceSampler`.

    used: bool ``[capacity]``: the slot holds no item that can be drawn: it was drawn since its
      slot was last written, or nothing was ever written there (True at ``init``).
    left: int32 ``[]``: stored items not drawn yet (the False entries of ``used``), so that
      ``can_sample`` costs nothing.
    """

    used: jax.Array
    left: jax.Array


def draw(
    key: jax.Array, count: int, capacity: int, drawable: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Up to ``count`` distinct slots of ``[0, capacity)``, drawn uniformly without replacement
    among the drawable ones, in a uniformly random order.

    ``count`` and ``capacity`` are Python ints; ``drawable(slots)`` says, for int32 ``slots`` of
    any shape, whether each may be drawn (bool, same shape); it is called on a few candidates
    or on all of ``arange(capacity)``. Returns ``(slots int32 [count], ok bool [count])``: the
    first ``min(count, drawable)`` entries are drawn slots, the rest padding (``ok`` False,
    slot 0).

    >>> import jax, jax.numpy as jnp
    >>> from functional_rb.samplers.once import draw
    >>> free = jnp.arange(10) % 3 == 0                  # slots 0, 3, 6 and 9
    >>> slots, ok = draw(jax.random.key(0), 5, 10, lambda s: free[s])
    >>> sorted(slots[ok].tolist()), ok.tolist()
    ([0, 3, 6, 9], [True, True, True, True, False])
    """
    k_fast, k_exact = jax.random.split(key)

    def exact(_):
        slots = jnp.arange(capacity, dtype=jnp.int32)
        ok = drawable(slots)
        # the smallest random words win (bits32's words are distinct for one key); float32
        # holds words below 2**24 exactly and keeps 24 bits of the others, so two scores tie
        # only with probability about 2**-24 per pair, and a tie is broken by slot
        score = jnp.where(ok, -bits32(k_exact, (capacity,)).astype(jnp.float32), -jnp.inf)
        k = min(count, capacity)
        _, top = jax.lax.top_k(score, k)
        top = top.astype(jnp.int32)
        got = ok[top]
        pad = count - k
        if pad:
            top = jnp.concatenate([top, jnp.zeros((pad,), jnp.int32)])
            got = jnp.concatenate([got, jnp.zeros((pad,), bool)])
        return jnp.where(got, top, 0), got

    m = _CANDIDATES * count
    if m > capacity:  # as many candidates as slots: the exact pass is as cheap
        return exact(None)
    cand = uniform_index(k_fast, (m,), jnp.int32(capacity), capacity)
    order = jnp.argsort(cand, stable=True)
    sorted_cand = cand[order]
    first_sorted = jnp.concatenate([jnp.ones((1,), bool), sorted_cand[1:] != sorted_cand[:-1]])
    first = jnp.zeros((m,), bool).at[order].set(first_sorted, unique_indices=True)
    keep = first & drawable(cand)
    # the kept candidates first, in draw order (a stable sort of the flags)
    pick = jnp.argsort(~keep, stable=True)[:count]
    fast = (cand[pick], keep[pick])
    return jax.lax.cond(jnp.all(fast[1]), lambda _: fast, exact, None)


def mark(used: jax.Array, slots: jax.Array, ok: jax.Array) -> jax.Array:
    """``used`` with the ``slots`` where ``ok`` set (the others untouched)."""
    return used.at[jnp.where(ok, slots, used.shape[0])].set(True, mode="drop")


def forget(used: jax.Array, slots: jax.Array, written: jax.Array) -> jax.Array:
    """``used`` with the ``slots`` where ``written`` cleared: they hold new items."""
    return used.at[jnp.where(written, slots, used.shape[0])].set(False, mode="drop")


@dataclasses.dataclass(frozen=True)
class SampleOnceSampler(Sampler):
    """Each item drawn at most once until its slot is rewritten (flashbax issue #59).

    Args:
      drop_last: False (default): when fewer than ``batch_size`` undrawn items remain, the batch
        holds them all, followed by padding (``mask`` False, weight 0), eagerly and under
        ``jit`` alike, as the last batch of an epoch of
        :class:`~functional_rb.SamplerWithoutReplacement`. True: only full batches:
        ``can_sample`` is False until ``batch_size`` undrawn items are stored, and a ``sample``
        then (eagerly a ``ValueError``; under ``jit`` ``mask`` all False, weights 0) draws
        nothing, so no item is spent on a batch that is thrown away.

    A batch is uniform without replacement over the undrawn stored items; weights are 1 (0 on
    padding). An item's flag is set when it is drawn and cleared when a writer writes its slot,
    so with a :class:`~functional_rb.RoundRobinWriter` every item can be returned once between
    its ``add`` and its overwrite, never twice; with ``ImmutableWriter`` and
    ``rb.init_from_data`` a dataset is read through once. ``can_sample`` is False when nothing
    undrawn is stored (an empty buffer, or everything drawn): ``sample`` then raises eagerly
    and returns ``mask`` all False under ``jit`` (the core's policy for an empty buffer). Works
    with every writer and with ``ndim=1`` and ``2``.

    Cost: the state is one bool per slot and a counter; ``sample`` costs
    ``O(batch_size log batch_size)`` while at least about half of the slots hold undrawn items,
    ``O(capacity)`` otherwise (:func:`draw`); ``can_sample`` ``O(1)``.

    >>> import functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=8, batch_size=3, sampler=frb.SampleOnceSampler())
    >>> state = rb.add(rb.init({"id": jnp.int32(0)}), {"id": jnp.arange(5, dtype=jnp.int32)})
    >>> a, state = rb.sample(state, jax.random.key(0))
    >>> b, state = rb.sample(state, jax.random.key(1))     # 2 items left: one padded entry
    >>> sorted(a.data["id"].tolist() + b.data["id"][b.mask].tolist()), b.mask.tolist()
    ([0, 1, 2, 3, 4], [True, True, False])
    >>> bool(rb.can_sample(state))                          # all drawn: wait for new items
    False
    >>> state = rb.add(state, {"id": jnp.array([5], jnp.int32)})
    >>> c, state = rb.sample(state, jax.random.key(2))
    >>> c.data["id"][c.mask].tolist()
    [5]
    """

    drop_last: bool = False
    state_types = (SampleOnceState,)
    depletes = True  # an eager sample checks at every call whether anything is left

    def __post_init__(self):
        if not isinstance(self.drop_last, bool):
            raise TypeError(
                f"SampleOnceSampler: drop_last must be a Python bool, got {self.drop_last!r} "
                f"({type(self.drop_last).__name__}). Pass drop_last=True for full batches "
                "only, or False (default) for batches padded with mask False."
            )

    def validate(self, *, capacity: int, batch_size: int, ndim: int):
        del ndim
        if self.drop_last and batch_size > capacity:
            raise ValueError(
                f"SampleOnceSampler: batch_size={batch_size} exceeds capacity={capacity} with "
                "drop_last=True, so no full batch could ever be drawn. Use a batch_size <= "
                "capacity or drop_last=False."
            )

    def init(self, item_spec, layout: Layout) -> SampleOnceState:
        del item_spec
        return SampleOnceState(used=jnp.ones((layout.capacity,), bool), left=jnp.int32(0))

    def on_add(self, state: SampleOnceState, record, items, ctx: Context) -> SampleOnceState:
        del items, ctx
        # a written slot that held nothing drawable now does; one whose item was not drawn yet
        # holds another undrawn item (the positions of written items are distinct)
        fresh = record.mask & state.used[record.positions]
        return SampleOnceState(
            used=forget(state.used, record.positions, record.mask),
            left=state.left + jnp.sum(fresh, dtype=jnp.int32),
        )

    def can_sample(self, state: SampleOnceState, ctx: Context, batch_size: int):
        del ctx
        return state.left >= batch_size if self.drop_last else state.left > 0

    def sample(self, state: SampleOnceState, key, batch_size: int, ctx: Context):  # type: ignore[override]  # only its .options
        self.validate(capacity=ctx.layout.capacity, batch_size=batch_size, ndim=ctx.layout.ndim)
        return self.draw(state, key, batch_size, lambda slots: ~state.used[slots])

    def draw(self, state: SampleOnceState, key, count: int, drawable) -> tuple:
        """``(Drawn [count], new state)``: :func:`draw` over the slots for which
        ``drawable(slots)`` holds (it should imply ``~state.used[slots]``), which are then
        marked drawn; with ``drop_last`` nothing is drawn unless ``count`` slots are. The
        ``sample`` of buffers whose items are not single slots (``functional_rb.flashbax``'s
        flat buffer: a transition is drawable when its next step is stored too)."""
        used = state.used
        slots, ok = draw(key, count, used.shape[0], drawable)
        if self.drop_last:
            ok = ok & jnp.all(ok)
            slots = jnp.where(ok, slots, 0)
        new = SampleOnceState(
            used=mark(used, slots, ok), left=state.left - jnp.sum(ok, dtype=jnp.int32)
        )
        return Drawn(slots, ok.astype(jnp.float32), ok), new
