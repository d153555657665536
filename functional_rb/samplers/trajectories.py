"""Trajectory records: where the stored trajectories of each env row start (slice samplers).

What a trajectory is (the same as TorchRL's ``find_start_stop_traj`` on the storage as it is)
----------------------------------------------------------------------------------------------
* A step ends its trajectory when its end flag is True (``end_key`` mode), or when the next
  stored step carries another id (``traj_key`` mode). Ids are compared between consecutive
  steps only.
* The newest stored step always ends a trajectory: the still-running episode (no done yet) is
  a valid trajectory ending at the newest step. When later steps of the same episode arrive,
  that trajectory simply grows (it stays one trajectory across ``add`` calls).
* A ring buffer overwrites the oldest steps first. When the oldest episode has been partly
  overwritten, its surviving tail is a trajectory that starts at the oldest stored step: its
  length is the number of its steps still stored. Overwritten steps are never returned.
* With ``ndim=2`` (storage ``[num_envs, time]``) trajectories live inside one env row and the
  ring wraps inside each row.
* A *whole* episode (:func:`whole`, what :class:`~functional_rb.EpisodeSampler` draws) is a
  trajectory that has ended (a later one started in its row, or its newest step has the end
  flag) and whose first step is still stored. An ``add`` of more steps than a row holds keeps
  the last ``R``: the trajectory running at the first kept step counts as starting there, but
  as whole only if the step before it (overwritten in the same call) ended an episode.

How it stays fast and jittable
------------------------------
Episode boundaries are tracked incrementally at each ``add`` (sampling never rescans storage).
Because a FIFO ring stores time in order, the stored trajectories of a row form a queue: new
trajectories are appended at the tail, overwritten ones leave at the head. :class:`SliceState`
keeps, per row, a ring of trajectory records (the absolute step number at which each one
starts) and the ``head``/``tail`` record counters; :func:`append` appends the starts found in
the new steps and moves ``head`` with a binary search. A record's length follows from its
start and the next record's start (or the newest step), clipped by the oldest stored step.
``append`` costs ``O(T + log capacity)`` per row, a slice ``O(slice_len)``.

Ages count back from the newest step of a row (age 1). Counters are int32. Step counts are
compared by wrapping differences, but record ids index the record ring by ``id % R``, so a row
may receive at most 2**31 steps over the buffer's life (about 60 hours at 10,000 steps/s into
one row); beyond that, re-initialize.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import folds, hugepages
from functional_rb._internal.jit import read_whole
from functional_rb._internal.names import stable
from functional_rb._internal.tree import loaded, saved_columns
from functional_rb.protocol import Context, Layout

# Candidate trajectories drawn per slice before falling back to an exact O(capacity) draw
# (strict_length=True only): with a fraction p of trajectories long enough, the fallback runs
# for a batch with probability about num_slices * (1 - p) ** TRIES.
TRIES = 8
# Newest records per row checked by the cheap path of ``any_eligible`` (strict_length=True).
_QUICK = 8


@stable("SliceState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SliceState:
    """Trajectory bookkeeping of a slice sampler (``E = num_envs``, ``R = row capacity``).

    rec_start: int32 ``[E, R]``: the absolute step at which record ``k`` starts, slot ``k % R``.
    counters:  int32 ``[E, 4]``, read as ``head``, ``tail``, ``last_done`` and ``total``
               (:meth:`of` builds one from them): per row the id of the oldest record with a
               stored step, the records created so far (alive: ``head <= k < tail``), the
               end flag of the newest step (end_key mode), and the steps written per row so
               far (a wrapping counter, the same in every row). One array, not four: each
               array a jitted call takes and returns costs it dispatch time
               (``benchmarks/NOTES.md``, W5).
    last_id:   ``[E]`` (the trajectory ids' dtype): id of the newest step (traj_key mode).
    """

    rec_start: jax.Array
    counters: jax.Array
    last_id: jax.Array

    @classmethod
    def of(cls, rec_start, head, tail, total, last_done, last_id) -> SliceState:
        """The state from its named parts (``total`` a scalar, the others ``[E]``).

        >>> st = SliceState.of(jnp.zeros((2, 4), jnp.int32), jnp.array([0, 1]),
        ...                    jnp.array([2, 3]), 7, jnp.array([True, False]), jnp.zeros(2, jnp.int32))
        >>> st.head.tolist(), st.tail.tolist(), int(st.total), st.last_done.tolist()
        ([0, 1], [2, 3], 7, [True, False])
        """
        head = jnp.asarray(head, jnp.int32)
        cols = (head, tail, last_done, jnp.broadcast_to(total, head.shape))
        counters = jnp.stack([jnp.asarray(c).astype(jnp.int32) for c in cols], axis=-1)
        return cls(rec_start=rec_start, counters=counters, last_id=last_id)

    @property
    def head(self) -> jax.Array:
        """int32 ``[E]``: id of the oldest record with a stored step."""
        return self.counters[..., 0]

    @property
    def tail(self) -> jax.Array:
        """int32 ``[E]``: records created so far."""
        return self.counters[..., 1]

    @property
    def last_done(self) -> jax.Array:
        """bool ``[E]``: end flag of the newest step (end_key mode)."""
        return self.counters[..., 2] != 0

    @property
    def total(self) -> jax.Array:
        """int32 ``[]``: steps written per row so far (wrapping counter)."""
        return self.counters[..., 0, 3]

    @classmethod
    def from_saved(cls, **fields) -> SliceState:
        """The state from a checkpoint's fields; files written when the counters were arrays
        of their own hold ``head``, ``tail``, ``total`` and ``last_done``."""
        if "counters" in fields:
            return cls(**fields)
        # the total, one per state, goes in every row
        fields["head"] = loaded(fields["head"])
        fields["total"] = np.broadcast_to(loaded(fields["total"])[..., None], fields["head"].shape)
        counters = saved_columns(fields, ("head", "tail", "last_done", "total"))
        return cls(fields["rec_start"], counters, fields["last_id"])  # type: ignore[arg-type]  # host arrays


def init(layout: Layout, id_dtype) -> SliceState:
    """No records; ``id_dtype``: the trajectory ids' dtype (int32 in end-flag mode)."""
    e, r = layout.num_envs, layout.row_capacity
    return SliceState(
        rec_start=hugepages.zeros((e, r), jnp.int32),
        counters=jnp.zeros((e, 4), jnp.int32),
        last_id=jnp.zeros((e,), id_dtype),
    )


def below(bits, n):
    """int32 in ``[0, max(n, 1))`` from uint32 ``bits`` (``bits % n``: the bias, at most
    ``n / 2**32`` relative, is far below anything a test or a learner can see)."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.uint32)
    return (bits % n).astype(jnp.int32)


# ------------------------------------------------------------------------------ append
def _boundaries(st: SliceState, sig, skipped: int, by_id: bool):
    """``(first, inner, last_done, last_id)``: whether the first kept step starts a record
    (bool ``[E]``), whether each later kept step does (bool ``[E, kept - 1]``), and the
    carried end flag / id of the newest step."""
    no_record = st.tail == st.head
    if by_id:
        ids = sig[:, :, 0]
        inner = ids[:, skipped + 1 :] != ids[:, skipped:-1]
        first = (ids[:, skipped] != st.last_id.astype(ids.dtype)) | no_record
        return first, inner, st.last_done, ids[:, -1].astype(st.last_id.dtype)
    done = folds.any_(sig, axis=-1)
    return st.last_done | no_record, done[:, skipped:-1], done[:, -1], st.last_id


def _began(sig, skipped: int, by_id: bool):
    """bool ``[E]``: the first kept step (index ``skipped``) of ``sig`` begins an episode:
    the step before it ended one (end flags) or carries another id (ids)."""
    if by_id:
        return sig[:, skipped, 0] != sig[:, skipped - 1, 0]
    return folds.any_(sig[:, skipped - 1], axis=-1)


def append(st: SliceState, sig: jax.Array, ctx: Context, *, by_id: bool) -> SliceState:
    """Append the trajectory starts found in new steps; advance ``head``.

    sig: the boundary signal of the new steps, ``[E, T, ...]``: trajectory ids (``by_id``,
      one per step) or end flags (any nonzero element ends the step's trajectory).
    ctx: the buffer after the write.
    """
    layout = ctx.layout
    ne, cap = layout.num_envs, layout.row_capacity
    steps = sig.shape[1]
    if steps == 0:
        return st
    sig = sig.reshape(ne, steps, -1)
    kept = min(steps, cap)  # earlier steps of this call are overwritten within the call
    skipped = steps - kept
    first, inner, last_done, last_id = _boundaries(st, sig, skipped, by_id)
    # the start recorded for each kept step (used where it starts a record)
    abs_step = jnp.broadcast_to(
        st.total + jnp.int32(skipped) + jnp.arange(kept, dtype=jnp.int32)[None, :], (ne, kept)
    )
    if skipped:
        # everything before the first kept step is gone: it starts a record. When its episode
        # began earlier (among the steps overwritten within this call), the record is dated one
        # step earlier: that step is not stored, so lengths and slices are unchanged (ages are
        # clipped to the stored steps), but ``whole`` sees that its first step is lost
        began = _began(sig, skipped, by_id)
        abs_step = abs_step.at[:, 0].add(-(~began).astype(jnp.int32))
        first = jnp.ones_like(first)
    is_start = jnp.concatenate([first[:, None], inner], axis=1)  # [E, kept]
    csum = folds.cumsum(is_start, axis=1)
    rec_id = st.tail[:, None] + csum - 1
    row = jnp.arange(ne, dtype=jnp.int32)[:, None]
    flat = row * jnp.int32(cap) + jnp.remainder(rec_id, cap)
    # distinct out-of-range slots for non-starts: dropped, and the indices stay unique
    oob = jnp.int32(ne * cap) + jnp.arange(ne * kept, dtype=jnp.int32).reshape(ne, kept)
    flat = jnp.where(is_start, flat, oob)
    rec_start = (
        st.rec_start.reshape(-1)
        .at[flat.reshape(-1)]
        .set(abs_step.reshape(-1), mode="drop", unique_indices=True)
        .reshape(ne, cap)
    )
    tail = st.tail + csum[:, -1]
    total = st.total + jnp.int32(steps)
    head = _find_head(rec_start, st.head, tail, total, ctx.filled, cap)
    return SliceState.of(rec_start, head, tail, total, last_done, last_id)


def _find_head(rec_start, head, tail, total, filled, cap: int):
    """The last record (per row) starting at or before the oldest stored step.

    Only the newest ``cap`` records can be alive (each holds >= 1 stored step), and their slots
    are intact, so the search runs over ``[max(head, tail - cap), tail)``, where record start
    ages decrease monotonically.
    """
    lo = jnp.where(tail - head > cap, tail - jnp.int32(cap), head)
    row = jnp.arange(rec_start.shape[0], dtype=jnp.int32)
    return last_started(rec_start, total, row, lo, tail - lo, filled)


def last_started(rec_start, total, row, lo, m, age, unroll: bool | None = None):
    """The last of the ``m`` records ``lo, lo + 1, ...`` of ``row`` (ring slots mod the record
    capacity) that started at least ``age`` steps ago (start ages decrease along records);
    ``lo`` if none. Binary search; arrays of any common shape. ``unroll``: the loop unrolled
    (default: everywhere but on the CPU).

    >>> starts = jnp.array([[0, 5, 9, 0]], jnp.int32)  # records 0, 1, 2 began at steps 0, 5, 9
    >>> i32 = jnp.int32
    >>> int(last_started(starts, i32(12), i32(0), i32(0), i32(3), i32(5)))  # ages 12, 7, 3
    1
    """
    cap = rec_start.shape[1]

    def body(_, c):
        a, b = c
        mid = (a + b) // 2
        started = total - rec_start[row, jnp.remainder(lo + mid, cap)]
        go = (started >= age) & (a < b)
        return jnp.where(go, mid + 1, a), jnp.where(go | (a >= b), b, mid)

    # unrolled off the CPU: there a rolled loop is a `while` that sends its predicate to the
    # host every iteration (on an H200 a slice step in `lax.scan` took 461 us at 10^4 items
    # rolled, 53 unrolled); on the CPU a rolled loop costs nothing and stays (XLA may fuse an
    # unrolled chain of dependent levels into each level, see binary_tree._descend)
    n_iter = int(np.ceil(np.log2(cap + 1))) + 1
    if unroll is None:
        unroll = jax.default_backend() != "cpu"
    a, _ = jax.lax.fori_loop(0, n_iter, body, (jnp.zeros_like(m), m), unroll=unroll)
    return lo + jnp.maximum(a - 1, 0)


# ------------------------------------------------------------------------------ geometry
def find_record(st: SliceState, e, age):
    """Record id holding the stored step of age ``age`` (1 = newest) in row ``e``: the last
    alive record that started at least ``age`` steps ago (binary search, any shape)."""
    head = st.head[e]
    return last_started(st.rec_start, st.total, e, head, st.tail[e] - head, age)


def record(st: SliceState, e, k, filled):
    """``(age_hi, length)``: age of the oldest stored step of record ``k`` of row ``e`` and its
    stored length. Shapes follow ``e``/``k``."""
    nxt = k + 1
    starts = _read_starts(st.rec_start, e, jnp.stack(jnp.broadcast_arrays(k, nxt)))
    age_hi = jnp.minimum(st.total - starts[0], filled)
    age_lo = jnp.where(nxt != st.tail[e], st.total - starts[1] + 1, 1)
    return age_hi, age_hi - age_lo + 1


def _read_starts(rec_start, e, k):
    """``rec_start[e, k % R]`` (any shapes that broadcast), read by one thread on the CPU
    (:func:`~functional_rb._internal.jit.read_whole`)."""
    slot = jnp.remainder(k, rec_start.shape[1])
    return read_whole(lambda: rec_start[e, slot], rec_start, k)


def whole(st: SliceState, e, k, filled):
    """bool: record ``k`` of row ``e`` is a whole episode: its first step is still stored (it
    was not partly overwritten) and it has ended (a later record started in the row, or its
    newest step carries an end flag: ``traj_key`` mode never sets one, so there the newest
    record of a row never counts as ended). Shapes follow ``e``/``k``."""
    cap = st.rec_start.shape[1]
    first_stored = st.total - st.rec_start[e, jnp.remainder(k, cap)] <= filled
    ended = (k + 1 != st.tail[e]) | st.last_done[e]
    return first_stored & ended


def _eligible(st: SliceState, e, k, length, filled, seq_len: int, strict: bool, complete: bool):
    """bool: record ``(e, k)`` (alive) of ``length`` stored steps may be drawn: at least
    ``seq_len`` steps (``strict``), and a whole episode (``complete``, :func:`whole`)."""
    ok = length >= (seq_len if strict else 1)
    if complete:
        ok = ok & whole(st, e, k, filled)
    return ok


def _slots(st: SliceState, e, slot, filled, seq_len: int, strict: bool, complete: bool):
    """``(k, length, eligible)`` of record slots ``slot`` of rows ``e`` (int32, one shape):
    the record id each holds, its stored length, and whether it is alive and eligible (see
    :func:`all_records`); a slot at or past ``R`` is not eligible."""
    cap = st.rec_start.shape[1]
    d = jnp.remainder(slot - st.head[e], cap)
    alive = (slot < cap) & (d < st.tail[e] - st.head[e])
    k = st.head[e] + d
    _, length = record(st, e, k, filled)
    return k, length, alive & _eligible(st, e, k, length, filled, seq_len, strict, complete)


def all_records(st: SliceState, filled, seq_len: int, strict: bool, complete: bool = False):
    """Per record slot ``[E, R]``: its record id, length and eligibility (exact, O(capacity)).
    Eligible: alive, (``strict``) at least ``seq_len`` stored steps, and (``complete``) a
    whole episode."""
    ne, cap = st.rec_start.shape
    slot = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[None, :], (ne, cap))
    e = jnp.broadcast_to(jnp.arange(ne, dtype=jnp.int32)[:, None], (ne, cap))
    return _slots(st, e, slot, filled, seq_len, strict, complete)


# Record slots per block of the exact passes over all records (the fallback of
# :func:`draw_records`, :func:`count_eligible`): their working arrays are O(block), not
# O(E * R). XLA's CPU runtime allocates a program's temporaries at every call, those of a
# ``lax.cond`` branch not taken too, so one O(capacity) pass in a sampler's program cost a
# 1.2 GB allocation and its page faults at every sample of a 10^8-step buffer (a slice step per
# call, in a probe: 137 us with it, 79 without). Off the CPU a row is one block: there each
# iteration of a loop waits on the host, and temporaries come from a pool.
BLOCK = 1 << 14


def _block_size(st: SliceState) -> tuple[int, int]:
    """``(block, blocks per row)``: a row's ``R`` record slots in blocks of ``block``."""
    cap = st.rec_start.shape[1]
    block = min(BLOCK, cap) if jax.default_backend() == "cpu" else cap
    return block, -(-cap // block)


def _block(st: SliceState, b, filled, seq_len: int, strict: bool, complete: bool):
    """``(e, k, eligible)`` of the record slots of block ``b`` (blocks numbered row by row,
    slots in order within a row; slots past the row's end are not eligible), each
    ``[block]``."""
    block, per_row = _block_size(st)
    slot = (b % per_row) * block + jnp.arange(block, dtype=jnp.int32)
    e = jnp.broadcast_to(b // per_row, slot.shape)
    k, _, eligible = _slots(st, e, slot, filled, seq_len, strict, complete)
    return e, k, eligible


def _block_counts(st: SliceState, filled, seq_len: int, strict: bool, complete: bool):
    """int32 ``[blocks]``: eligible records (see :func:`all_records`) per block."""
    _, per_row = _block_size(st)

    def count(b):
        return folds.sum_(_block(st, b, filled, seq_len, strict, complete)[2])

    n = st.rec_start.shape[0] * per_row
    if n == 1:
        return count(jnp.int32(0))[None]
    return jax.lax.map(count, jnp.arange(n, dtype=jnp.int32))


def count_eligible(st: SliceState, filled, seq_len: int, strict: bool, complete: bool = False):
    """int32 ``[]``: the eligible records (:func:`all_records`), counted a block at a time."""
    return folds.sum_(_block_counts(st, filled, seq_len, strict, complete))


def _locate(st: SliceState, counts, u, filled, seq_len: int, strict: bool, complete: bool):
    """``(e, k)`` of the ``u``-th eligible record (0-based, in slot order row by row, as
    :func:`all_records` orders them); ``counts`` from :func:`_block_counts`."""
    b, r = folds.bucket_of(counts, u)
    e, k, elig = _block(st, b, filled, seq_len, strict, complete)
    j = folds.nth_true(elig, r)
    return e[j], k[j]


def _uniform_records(st: SliceState, bits):
    """Records uniform over all alive records of all rows: ``(e, k, any_alive)``, shaped
    like the uint32 random ``bits``."""
    n = st.tail - st.head
    cum = folds.cumsum(n)
    total = cum[-1]
    u = below(bits, total)
    shape = bits.shape
    if n.shape[0] == 1:
        e = jnp.zeros(shape, jnp.int32)
    else:
        e = jnp.searchsorted(cum, u, side="right").astype(jnp.int32)
        e = jnp.minimum(e, n.shape[0] - 1)
    k = st.head[e] + u - (cum[e] - n[e])
    return e, k, total > 0


def draw_records(st: SliceState, bits, seq_len: int, filled, strict: bool, complete: bool = False):
    """Records uniform among eligible ones: ``(e, k, ok)``, each ``[num]``; ``bits`` are
    uint32 ``[num, TRIES + 1]``.

    Eligible: every alive trajectory (``strict=False``) or those with at least ``seq_len``
    stored steps; with ``complete``, only whole episodes among them (:func:`whole`). Exact:
    candidates are drawn uniformly and the first eligible one is kept; slices whose ``TRIES``
    candidates all fail are redrawn from the exact cumulative count over all records, counted
    a block at a time (``lax.cond``: only when needed, except under vmap).
    """
    e, k, ok, _ = draw_records_read(st, bits, seq_len, filled, strict, complete)
    return e, k, ok


def draw_records_read(
    st: SliceState, bits, seq_len: int, filled, strict: bool, complete: bool = False
):
    """:func:`draw_records` and what it read of the drawn records: ``(e, k, ok, rec)``,
    ``rec`` the ``(age_hi, length)`` of :func:`record` for ``(e, k)`` (``None`` when the draw
    reads no record: every alive trajectory eligible). Passed to :func:`slice_indices`, it
    spares a second read of the records: two gathers of an array of the buffer's size, each
    a kernel XLA splits (NOTES, "Split kernels").

    >>> import functional_rb as frb
    >>> rb = frb.ReplayBuffer(capacity=16, sampler=frb.SliceSampler(slice_len=3), batch_size=3)
    >>> state = rb.init({"next": {"done": jnp.bool_(False)}})
    >>> done = jnp.array([0, 0, 1, 0, 0, 0, 0, 1, 0, 0], bool)  # episodes of 3, 5 and 2 steps
    >>> state = rb.add(state, {"next": {"done": done}})
    >>> bits = jax.random.bits(jax.random.key(0), (16, TRIES + 1), jnp.uint32)
    >>> filled = rb.context(state).filled
    >>> e, k, ok, (age_hi, length) = draw_records_read(state.sampler, bits, 3, filled, True)
    >>> bool(ok.all()), sorted(set(length.tolist()))  # never the 2-step episode
    (True, [3, 5])
    >>> bool((length == record(state.sampler, e, k, filled)[1]).all())
    True
    """
    num = bits.shape[0]
    if not strict and not complete:
        e, k, ok = _uniform_records(st, bits[:, 0])
        return e, k, jnp.broadcast_to(ok, (num,)), None

    def candidates(b):
        e, k, _ = _uniform_records(st, b)
        age_hi, length = record(st, e, k, filled)
        good = _eligible(st, e, k, length, filled, seq_len, strict, complete)
        return e, k, good & ((st.tail - st.head)[e] > 0), age_hi, length

    def exact(e, k, found):
        counts = _block_counts(st, filled, seq_len, strict, complete)
        n_elig = folds.sum_(counts)
        u = below(bits[:, TRIES], n_elig)

        def one(args):
            done, e0, k0, ui = args
            return jax.lax.cond(
                done,
                lambda: (e0, k0),
                lambda: _locate(st, counts, ui, filled, seq_len, strict, complete),
            )

        ef, kf = jax.lax.map(one, (found, e, k, u))
        return ef, kf, found | (n_elig > 0), *record(st, ef, kf, filled)

    e, k, good, age_hi, length = candidates(bits[:, :TRIES])
    pick, found = folds.first_true(good, axis=1)
    e, k, age_hi, length = (
        jnp.take_along_axis(x, pick[:, None], axis=1, mode="promise_in_bounds")[:, 0]
        for x in (e, k, age_hi, length)
    )
    e, k, ok, age_hi, length = jax.lax.cond(
        folds.all_(found),
        lambda _: (e, k, found, age_hi, length),
        lambda _: exact(e, k, found),
        None,
    )
    return e, k, ok, (age_hi, length)


def any_eligible(st: SliceState, filled, seq_len: int, strict: bool, complete: bool = False):
    """bool []: some stored trajectory is eligible (cheap check first, exact fallback)."""
    if not strict and not complete:
        return folds.any_(st.tail != st.head)
    ne = st.head.shape[0]
    q = jnp.arange(_QUICK, dtype=jnp.int32)[None, :]
    k = st.tail[:, None] - 1 - q
    alive = (1 + q) <= (st.tail - st.head)[:, None]
    e = jnp.broadcast_to(jnp.arange(ne, dtype=jnp.int32)[:, None], k.shape)
    _, length = record(st, e, k, filled)
    quick = folds.any_(alive & _eligible(st, e, k, length, filled, seq_len, strict, complete))
    return jax.lax.cond(
        quick,
        lambda _: jnp.bool_(True),
        lambda _: count_eligible(st, filled, seq_len, strict, complete) > 0,
        None,
    )


def span_limits(span, seq_len: int, where: str) -> tuple:
    """``span`` (a normalized ``(left, right)`` pair of bools / ints, see
    :class:`~functional_rb.samplers.slices.SliceSpec`) as the most steps a slice of ``seq_len`` may lose
    on each side: ``True`` is ``seq_len - 1`` (at least one step kept), an int ``i`` must be
    below ``seq_len`` (at least ``seq_len - i`` steps kept)."""
    out = []
    for side, v in zip(("left", "right"), span):
        n = seq_len - 1 if v is True else int(v)
        if n >= seq_len:
            raise ValueError(
                f"{where}: span={tuple(span)!r} lets a slice lose {n} steps on the "
                f"{side}, but slices have {seq_len}: the left and right span must "
                f"be strictly lower than the slice length. Use span <= {seq_len - 1}"
                " (or True: at least one step kept)."
            )
        out.append(n)
    return tuple(out)


def slice_indices(
    st: SliceState, bits, e, k, ok, seq_len: int, ctx: Context, span=(0, 0), rec=None
):
    """Indices/mask ``[num, seq_len]`` of a slice starting uniformly inside record (e, k)
    (``rec``: its :func:`record`, when the draw read it already).

    Without span the start offset is uniform in ``[0, L - s]`` with ``s = min(L, seq_len)``
    (TorchRL's ``floor(rand * (L - seq_len + 1))``). ``span=(l, r)`` (from
    :func:`span_limits`) lets the slice hang over the trajectory's ends by up to ``l`` steps on
    the left and ``r`` on the right (each at most ``s - 1``): the start is uniform in
    ``[-l, L - s + r]`` and the slice keeps the steps inside the trajectory. Padding repeats the
    last valid step.
    """
    layout = ctx.layout
    cap = layout.row_capacity
    age_hi, length = record(st, e, k, ctx.filled) if rec is None else rec
    length = jnp.where(ok, jnp.maximum(length, 1), 1)
    s = jnp.minimum(length, seq_len)
    left = jnp.minimum(span[0], s - 1)
    right = jnp.minimum(span[1], s - 1)
    rel = below(bits, length - s + left + right + 1) - left
    lo = jnp.maximum(rel, 0)
    eff = jnp.minimum(rel + s, length) - lo
    start_age = age_hi - lo
    j = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    jj = jnp.minimum(j, (eff - 1)[:, None])
    t = jnp.remainder(ctx.cursor - start_age[:, None] + jj, cap)
    idx = layout.to_flat(e[:, None], t)
    mask = (j < eff[:, None]) & ok[:, None]
    idx = jnp.where(ok[:, None], idx, 0)
    return idx.astype(jnp.int32), mask


def starts(st: SliceState, age, ctx: Context, slice_len: int, strict: bool):
    """For the steps of age ``age`` (int32 ``[E, W]``, 1 = newest of row ``e``): their flat
    positions (``capacity`` where nothing is stored) and whether each is a valid slice start
    (bool ``[E, W]``): at least ``slice_len`` steps remain to its trajectory's end or, with
    ``strict=False``, it is the first stored step of its trajectory."""
    layout = ctx.layout
    e = jnp.broadcast_to(jnp.arange(layout.num_envs, dtype=jnp.int32)[:, None], age.shape)
    stored = age <= ctx.filled
    k = find_record(st, e, age)
    age_hi, length = record(st, e, k, ctx.filled)
    remaining = age - (age_hi - length + 1) + 1
    valid = remaining >= slice_len
    if not strict:
        valid = valid | (age == age_hi)
    t = jnp.remainder(ctx.cursor - age, layout.row_capacity)
    pos = jnp.where(stored, layout.to_flat(e, t), jnp.int32(layout.capacity))
    return pos, valid & stored
