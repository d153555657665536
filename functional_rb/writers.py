"""Writers: where the next items go (the protocol: :class:`functional_rb.protocol.Writer`).

A writer is a frozen, hashable config with pure functions::

    init(layout)                      -> state     # every writer state reads int32 `filled`, `cursor`
    write(state, items, layout)       -> (WriteRecord, state)

``items`` leaves are ``[B, ...]`` (``ndim=1``) or ``[num_envs, T, ...]`` (``ndim=2``); the
record's positions are flat storage positions ``[B]`` (``[num_envs * T]``, env-major), unique
where its mask is True. Items whose mask is False are not written (superseded within the same
call, or rejected by a MaxValueWriter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import describe_structure, shape_mismatch
from functional_rb._internal.names import stable
from functional_rb._internal.tree import Key, get_key, normalize_key, saved_columns
from functional_rb.protocol import Layout, Writer, WriteRecord


@stable("RoundRobinState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundRobinState:
    """A FIFO ring's counters: ``counters`` int32 ``[2]``, the ``cursor`` (next time index to
    write, in ``[0, row_capacity)``) and ``filled`` (time steps stored per row, in ``[0,
    row_capacity]``), read as those two attributes; build one with :meth:`of`. One array,
    not two: each array a jitted call takes and returns costs it dispatch time
    (``benchmarks/NOTES.md``, W5).

    >>> st = RoundRobinState.of(3, 5)
    >>> int(st.cursor), int(st.filled)
    (3, 5)
    """

    counters: jax.Array

    @classmethod
    def of(cls, cursor, filled) -> RoundRobinState:
        """The state with these counters (int32 scalars, or arrays of one shape)."""
        c, f = jnp.asarray(cursor, jnp.int32), jnp.asarray(filled, jnp.int32)
        return cls(counters=jnp.stack(jnp.broadcast_arrays(c, f), axis=-1))

    @property
    def cursor(self) -> jax.Array:
        """int32 ``[]``: the next time index to write."""
        return self.counters[..., 0]

    @property
    def filled(self) -> jax.Array:
        """int32 ``[]``: time steps stored per row."""
        return self.counters[..., 1]

    @classmethod
    def from_saved(cls, **fields) -> RoundRobinState:
        """The state from a checkpoint's fields; files written when the counters were two
        arrays hold ``cursor`` and ``filled``."""
        if "counters" in fields:
            return cls(**fields)
        return cls(counters=saved_columns(fields, ("cursor", "filled")))  # type: ignore[arg-type]


def _batch_len(items, layout: Layout) -> int:
    leaf = jax.tree_util.tree_leaves(items)[0]
    return leaf.shape[layout.ndim - 1]


def _ring_positions(cursor, filled, steps: int, layout: Layout):
    """Positions for ``steps`` new time steps per row of a FIFO ring, and the new counters.

    When one call brings more than ``row_capacity`` steps, only the last ``row_capacity`` are
    written (the earlier ones would be overwritten within the call anyway), so the result is
    well defined: the last items, in order.
    """
    cap = layout.row_capacity
    ar = jnp.arange(steps, dtype=jnp.int32)
    t = (cursor + ar) % jnp.int32(cap)
    mask = ar >= jnp.int32(steps - cap)
    new_cursor = (cursor + jnp.int32(steps % cap)) % jnp.int32(cap)
    new_filled = jnp.minimum(filled + jnp.int32(min(steps, cap)), jnp.int32(cap))
    if layout.ndim == 2:
        env = jnp.arange(layout.num_envs, dtype=jnp.int32)[:, None]
        positions = layout.to_flat(env, t[None, :]).reshape(-1)
        mask = jnp.broadcast_to(mask[None, :], (layout.num_envs, steps)).reshape(-1)
        record = WriteRecord(positions, mask)
    else:
        # one run of ring slots from the cursor: samplers may update by ranges
        record = WriteRecord(t, mask, run_start=cursor)
    return record, new_cursor, new_filled


@dataclasses.dataclass(frozen=True)
class RoundRobinWriter(Writer):
    """FIFO ring: items are written in order and the oldest are overwritten first.

    With ``ndim=2`` every row advances together along time (one vectorized step per column).
    With ``ndim=1`` the record's ``run_start`` is the cursor (positions ``(cursor + arange(B))
    % capacity``).
    """

    time_ordered = True
    state_types = (RoundRobinState,)

    def init(self, layout: Layout) -> RoundRobinState:
        del layout
        return RoundRobinState.of(0, 0)

    def write(self, state: RoundRobinState, items, layout: Layout):
        steps = _batch_len(items, layout)
        record, cursor, filled = _ring_positions(state.cursor, state.filled, steps, layout)
        return record, RoundRobinState.of(cursor, filled)


@stable("MaxValueState")
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaxValueState:
    cursor: jax.Array  # int32 []: unused by the policy; kept == filled % capacity
    filled: jax.Array  # int32 []: slots in use; they are always slots [0, filled)
    ranks: jax.Array  # float32 [capacity]: rank of the item in each slot (stale past `filled`)


_REDUCTIONS: dict[str, Callable[..., jax.Array]] = {
    "sum": jnp.sum,
    "mean": jnp.mean,
    "max": jnp.max,
    "min": jnp.min,
}


@dataclasses.dataclass(frozen=True)
class MaxValueWriter(Writer):
    """Keeps the ``capacity`` highest-ranked items ever added (TorchRL's TensorDictMaxValueWriter).

    Args:
      rank_key: key (string or tuple for nested dicts) of the leaf that ranks an item.
      reduction: how a non-scalar rank leaf ``[B, ...]`` becomes one number per item:
        ``"sum"`` (default), ``"mean"``, ``"max"`` or ``"min"``.

    Semantics of one ``add`` of ``B`` items: while free slots remain, items fill them; then an
    item replaces the lowest-ranked stored item when its rank is strictly greater (ties keep the
    stored item). The result is the top-``capacity`` multiset of everything added. Items with a
    NaN rank are never stored. Only ``ndim=1`` storages (ranks over a [env, time] grid have no
    meaning TorchRL defines).
    """

    rank_key: Key = "rank"
    reduction: str = "sum"
    state_types = (MaxValueState,)

    def __post_init__(self):
        object.__setattr__(self, "rank_key", normalize_key(self.rank_key))
        if self.reduction not in _REDUCTIONS:
            raise ValueError(
                f"MaxValueWriter: reduction must be one of {sorted(_REDUCTIONS)}, "
                f"got {self.reduction!r}"
            )

    def check_item_spec(self, item_spec) -> None:
        """Raise unless the items (``item_spec``: one item's tree of shapes/dtypes) hold a
        real-valued leaf at ``rank_key``. ``ReplayBuffer.init`` calls it, so a wrong key fails
        when the buffer is built rather than at the first ``add``."""
        leaf = get_key(item_spec, self.rank_key, where="MaxValueWriter.init")
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(
                f"MaxValueWriter.init: rank_key={self.rank_key!r} is a sub-tree with leaves "
                f"{describe_structure(leaf)}, not an array leaf. Pass the key of the leaf that "
                "ranks an item."
            )
        if np.dtype(leaf.dtype).kind not in "biuf":
            raise TypeError(
                f"MaxValueWriter.init: the rank leaf {self.rank_key!r} has dtype {leaf.dtype}; "
                "ranks must be real numbers (bool, integer or float)."
            )

    def check_state(self, state: MaxValueState, capacity: int):
        """Scalar counters and ``ranks`` of shape ``[capacity]``."""
        return super().check_state(state, capacity) or shape_mismatch(
            [("state.writer.ranks", state.ranks, (capacity,), True, f" (capacity={capacity})")]
        )

    def init(self, layout: Layout) -> MaxValueState:
        if layout.ndim != 1:
            raise ValueError(
                "MaxValueWriter: only ndim=1 buffers are supported, got "
                f"ndim={layout.ndim}. Use RoundRobinWriter for [env, time] storage."
            )
        return MaxValueState(
            cursor=jnp.int32(0),
            filled=jnp.int32(0),
            ranks=jnp.full((layout.capacity,), -jnp.inf, jnp.float32),
        )

    def item_ranks(self, items) -> jax.Array:
        """float32 [B]: one rank per item."""
        r = jnp.asarray(get_key(items, self.rank_key, where="MaxValueWriter"))
        if r.ndim > 1:
            r = _REDUCTIONS[self.reduction](r, axis=tuple(range(1, r.ndim)))
        return r.astype(jnp.float32)

    def write(self, state: MaxValueState, items, layout: Layout):
        cap = layout.capacity
        new = self.item_ranks(items)
        b = new.shape[0]
        k = min(b, cap)
        order = jnp.argsort(-new, stable=True)[:k]  # new items, best first (NaN last)
        slot_ids = jnp.arange(cap, dtype=jnp.int32)
        empty = slot_ids >= state.filled
        old_key = jnp.where(empty, -jnp.inf, state.ranks)
        # k lowest slots, empty slots first; lax.top_k breaks ties by lower index, which keeps
        # the occupied slots a prefix [0, filled).
        _, slots = jax.lax.top_k(jnp.where(empty, jnp.inf, -old_key), k)
        slots = slots.astype(jnp.int32)
        cand = new[order]
        take = ~jnp.isnan(cand) & (empty[slots] | (cand > state.ranks[slots]))
        positions = jnp.zeros((b,), jnp.int32).at[order].set(slots)
        mask = jnp.zeros((b,), bool).at[order].set(take)
        ranks = state.ranks.at[jnp.where(take, slots, cap)].set(cand, mode="drop")
        filled = jnp.minimum(
            state.filled + jnp.sum(take & empty[slots], dtype=jnp.int32), jnp.int32(cap)
        )
        return WriteRecord(positions, mask), MaxValueState(
            cursor=filled % jnp.int32(cap), filled=filled, ranks=ranks
        )


_IMMUTABLE_MSG = (
    "ImmutableWriter: this buffer is read-only and `add` is not allowed. Build its state in one "
    "go with `rb.init_from_data(data)` (leaves [N, ...]), or use RoundRobinWriter to add items."
)


@dataclasses.dataclass(frozen=True)
class ImmutableWriter(Writer):
    """A read-only buffer (datasets): ``add`` raises; fill it with ``rb.init_from_data``
    (whose items are written in time order, as a :class:`RoundRobinWriter` writes them)."""

    time_ordered = True
    state_types = (RoundRobinState,)

    def init(self, layout: Layout) -> RoundRobinState:
        del layout
        return RoundRobinState.of(0, 0)

    def write(self, state, items, layout):
        raise RuntimeError(_IMMUTABLE_MSG)
