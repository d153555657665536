"""TorchRL's compiled segment trees (``SumSegmentTreeFp32`` / ``MinSegmentTreeFp64`` ...), in
NumPy with the same float semantics, so a prioritized sampler here draws what TorchRL's draws.

TorchRL's tree (``torchrl/csrc/segment_tree.h``) is a binary heap over ``capacity`` leaves,
``capacity`` the smallest power of two strictly above ``size``; node ``i`` holds
``op(node 2i, node 2i + 1)`` computed in the tree's dtype (float32 or float64), leaves ``i``
at ``i | capacity``. Every internal node is recomputed from its two children on each write,
so the node values are a function of the leaves alone: this port writes leaves, then
recomputes the touched parents level by level, and gets bit-identical nodes whatever the
order of the writes. ``scan_lower_bound`` walks down from the root exactly as the C++ does
(``value > left``: go right and subtract ``left``, in the tree's dtype), and ``query(l, r)``
reduces the range in the C++ loop's order, so the float sums, and therefore the drawn
indices, are the same as TorchRL's (see ``docs/prioritized.md``, "Same seed, same draws").

A tree can keep a journal of the leaves written since its reader last looked
(:meth:`track_writes` / :meth:`drain_writes`): a copy kept beside it (the prioritized slice
sampler's tree of slice starts) then follows it by rewriting only those leaves.

Like TorchRL's, a leaf index may go up to ``capacity - 1`` (the padding above ``size``):
TorchRL's ``update_priority`` accepts such indices and so does this tree. Indices at or
above ``capacity`` (which TorchRL's C++ writes outside its array) raise ``IndexError``.

The prioritized slice sampler's tree of slice starts (:class:`StartTree`): a copy of the
priority sum tree in which only the steps a slice may start at carry their priority, kept
up to date by rewriting only the leaves that changed.

TorchRL's ``PrioritizedSliceSampler`` zeroes, for every draw, the priorities of the steps no
slice can start at (the last ``slice_len - 1`` of each trajectory), draws, and restores them:
two writes of every such step per sample. Here the zeroed copy is kept beside the priority
tree instead. A priority write reaches it through the priority tree's journal of written
leaves; a change of the stored trajectories (a write) through the trajectories that appeared
or went away (their blocked steps are released or blocked; the others' are unchanged, since
trajectories never share a step); a change of the slice length or of the storage's shape
recomputes the blocked steps. So a draw is a plain tree draw. The segment trees' node values
are a function of their leaves alone (above), so this copy's nodes are
bit-identical to those of TorchRL's zeroed tree, and so are the drawn indices.

Huge pages: a descent reads one node per level at random, so a large tree gains from 2 MiB
pages as the storages do (:mod:`functional_rb._internal.hugepages`). NumPy asks for them
itself: on Linux it advises every array of 4 MiB or more (``MADV_HUGEPAGE``) as it
allocates it (``np._core.multiarray._get_madvise_hugepage()``), so the node arrays
(``np.full`` here, their copies in :class:`StartTree`) are advised with no call of ours;
``NUMPY_MADVISE_HUGEPAGE=0`` in the environment turns NumPy's advice off (``FRB_HUGEPAGES``
governs the library's own calls only).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["MinSegmentTree", "StartTree", "SumSegmentTree"]


class _SegmentTree:
    _op = None  # numpy ufunc combining two children

    def __init__(self, size: int, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.size = int(size)
        cap = 1
        while cap <= self.size:  # strictly above size, as the C++ constructor
            cap <<= 1
        self.capacity = cap
        self._depth = cap.bit_length() - 1
        self.values = np.full(2 * cap, self.identity_element, self.dtype)
        # leaf-index arrays written since the last drain_writes; None: not kept (or too many
        # to be worth keeping: the reader reloads every leaf)
        self._journal: list | None = None
        self._journal_size = 0

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------ leaves
    def _leaf_index(self, index) -> np.ndarray:
        idx = np.asarray(
            index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else index,
            dtype=np.int64,
        )
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise IndexError(
                f"{type(self).__name__}: index {bad} is outside the tree's "
                f"{self.capacity} leaves (size {self.size} rounded up to a power "
                "of two); make the sampler's max_capacity at least the storage's "
                "size."
            )
        return idx

    def __getitem__(self, index):
        """Leaf values: a Python float for an int, a tensor for a tensor (as TorchRL's)."""
        idx = self._leaf_index(index)
        out = self.values[idx | self.capacity]
        if isinstance(index, torch.Tensor):
            return torch.from_numpy(np.array(out, copy=True)).reshape(index.shape)
        return float(out) if np.ndim(out) == 0 else out

    at = __getitem__

    def __setitem__(self, index, value) -> None:
        idx = self._leaf_index(index).reshape(-1)
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        value = np.asarray(value, self.dtype).reshape(-1)
        if idx.size == 0:
            return
        if value.size == 1:
            value = np.broadcast_to(value, idx.shape)
        elif value.size != idx.size:
            raise RuntimeError(
                f"{type(self).__name__}: {value.size} values for {idx.size} "
                "indices; pass one value or one per index."
            )
        if idx.size > 1:  # the C++ writes in order: the last of duplicated indices wins
            _, last = np.unique(idx[::-1], return_index=True)
            keep = idx.size - 1 - last  # sorted by index: parents come out sorted too
            idx, value = idx[keep], value[keep]
        self._log(idx)
        nodes = idx | self.capacity
        self.values[nodes] = value
        for _ in range(self._depth):
            nodes = nodes >> 1
            if nodes.size > 1:  # each parent once (sorted: duplicates are adjacent)
                nodes = nodes[np.concatenate(([True], nodes[1:] != nodes[:-1]))]
            self.values[nodes] = self._op(self.values[2 * nodes], self.values[2 * nodes + 1])

    update = __setitem__

    def load_leaves(self, leaves: np.ndarray) -> None:
        """Set leaves ``[0, len(leaves))`` at once (the rest keep their value)."""
        leaves = np.asarray(leaves, self.dtype)
        self._journal = None  # every leaf may have changed: the reader reloads them all
        self.values[self.capacity : self.capacity + leaves.size] = leaves
        lo, hi = self.capacity, 2 * self.capacity
        while lo > 1:
            lo, hi = lo >> 1, hi >> 1
            self.values[lo:hi] = self._op(
                self.values[2 * lo : 2 * hi : 2], self.values[2 * lo + 1 : 2 * hi : 2]
            )

    # ------------------------------------------------------------------ write journal
    def track_writes(self) -> None:
        """Start (or restart, emptied) the journal of written leaves (one reader)."""
        self._journal, self._journal_size = [], 0

    def drain_writes(self) -> np.ndarray | None:
        """The leaves written since the last call (int64, may repeat), and an emptied journal;
        None when no journal was kept since then (never started, or dropped by
        :meth:`load_leaves` or by growing past ``capacity`` entries): any leaf may have
        changed. Call :meth:`track_writes` again after a None."""
        if self._journal is None:
            return None
        out = np.concatenate(self._journal) if self._journal else np.zeros(0, np.int64)
        self._journal, self._journal_size = [], 0
        return out

    def _log(self, idx: np.ndarray) -> None:
        if self._journal is None:
            return
        self._journal_size += idx.size
        if self._journal_size > self.capacity:  # a reload is cheaper than replaying these
            self._journal = None
        else:
            self._journal.append(idx.copy())

    def leaves(self, n: int | None = None) -> np.ndarray:
        """A copy of leaves ``[0, n)`` (default: ``size``)."""
        n = self.size if n is None else n
        return self.values[self.capacity : self.capacity + n].copy()

    # ------------------------------------------------------------------ reductions
    def query(self, l: int, r: int):
        """``op`` over leaves ``[l, r)`` in the C++ loop's order (the root when the range
        covers ``[0, size)``), as a Python float."""
        l, r = int(l), int(r)
        if l <= 0 and r >= self.size:
            return float(self.values[1])
        ret = self.dtype.type(self.identity_element)
        l |= self.capacity
        r |= self.capacity
        while l < r:
            if l & 1:
                ret = self._op(ret, self.values[l])
                l += 1
            if r & 1:
                r -= 1
                ret = self._op(ret, self.values[r])
            l >>= 1
            r >>= 1
        return float(ret)

    def __getstate__(self):
        return {"size": self.size, "dtype": self.dtype.str, "leaves": self.leaves(self.capacity)}

    def __setstate__(self, state):
        self.__init__(state["size"], np.dtype(state["dtype"]))
        self.load_leaves(state["leaves"])

    def __deepcopy__(self, memo):
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.values = self.values.copy()
        out._journal = None if self._journal is None else list(self._journal)
        return out


class SumSegmentTree(_SegmentTree):
    """TorchRL's ``SumSegmentTreeFp32`` / ``Fp64`` (``dtype``): sums, prefix-sum search."""

    _op = np.add
    identity_element = 0.0

    def scan_lower_bound(self, value) -> np.ndarray:
        """The first leaf whose prefix sum is not below each ``value`` (``size`` when it is
        above the total), found by TorchRL's descent in the tree's dtype. ``value`` is cast
        to the dtype first, as TorchRL's binding casts it (round to nearest)."""
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        cur = np.array(value, self.dtype, ndmin=1).reshape(-1)
        over = cur > self.values[1]
        node = np.ones(cur.shape, np.int64)
        values = self.values
        for _ in range(self._depth):
            node <<= 1
            left = values[node]
            right = cur > left
            cur = np.where(right, cur - left, cur)
            node |= right
        node ^= self.capacity
        node[over] = self.size
        return node


class MinSegmentTree(_SegmentTree):
    """TorchRL's ``MinSegmentTreeFp32`` / ``Fp64``: minima; empty leaves hold the dtype's
    largest value."""

    _op = np.minimum

    @property
    def identity_element(self):
        return float(np.finfo(self.dtype).max)


class StartTree:
    """A :class:`SumSegmentTree` equal to a source tree with the leaves no slice may start at
    held at 0. :meth:`follow` brings it up to date and returns it."""

    def __init__(self):
        self._source: SumSegmentTree | None = None
        self._tree: SumSegmentTree | None = None
        self._blocked: np.ndarray | None = None  # bool [source.capacity]
        self._geometry = None  # what the blocked steps were computed for
        self._revision = None  # the trajectory list they were computed from
        self._start = self._lengths = None  # that list

    def follow(
        self,
        source: SumSegmentTree,
        geometry,
        revision: int,
        start: torch.Tensor,
        lengths: torch.Tensor,
        excluded: Callable[[torch.Tensor, torch.Tensor], np.ndarray],
    ) -> SumSegmentTree:
        """The tree of starts of ``source``.

        geometry: any value compared with ``==`` (slice length, storage shape): when it
          changes every blocked step is recomputed.
        revision, start, lengths: the stored trajectories (``start`` long ``[N, 2]`` (row,
          column), ``lengths`` long ``[N]``) and a number that changes with them.
        excluded: ``(start, lengths)`` of some trajectories -> their blocked leaves (int).
        """
        try:
            return self._follow(source, geometry, revision, start, lengths, excluded)
        except BaseException:
            self.reset()  # the journal may have been drained: rebuild from scratch next time
            raise

    def _follow(self, source, geometry, revision, start, lengths, excluded) -> SumSegmentTree:
        if source is not self._source or self._tree is None:
            self._source, self._geometry = source, None
            self._tree = SumSegmentTree(source.size, source.dtype)
            self._blocked = np.zeros(source.capacity, bool)
            written = None
        else:
            written = source.drain_writes()
        changed = None
        if geometry != self._geometry:
            mask = np.zeros_like(self._blocked)
            mask[self._checked(excluded(start, lengths))] = True
            changed = np.flatnonzero(mask != self._blocked)
            self._blocked = mask
        elif revision != self._revision:
            gone, came = self._diff(start, lengths)
            off = self._checked(excluded(self._start[gone], self._lengths[gone]))
            on = self._checked(excluded(start[came], lengths[came]))
            self._blocked[off] = False  # first: a step may pass from one trajectory to another
            self._blocked[on] = True
            changed = np.concatenate([off, on])
        self._geometry, self._revision, self._start, self._lengths = (
            geometry,
            revision,
            start,
            lengths,
        )
        if written is None:  # no journal since the last look: reload every leaf
            source.track_writes()
            leaves = source.leaves(source.capacity)
            leaves[self._blocked] = 0
            self._tree.load_leaves(leaves)
            return self._tree
        if changed is not None:
            written = np.concatenate([written, changed])
        if written.size:
            self._tree[written] = np.where(self._blocked[written], 0, source[written])
        return self._tree

    def _diff(self, start: torch.Tensor, lengths: torch.Tensor):
        """Indices of the trajectories that went away (in the old list) and came (in the new
        one). A trajectory is known by its first step (unique: trajectories share no step)
        and its length."""

        def first(s):
            s = s.numpy()
            return (s[:, 1] << 32) | s[:, 0]

        old, new = first(self._start), first(start)
        _, i_old, i_new = np.intersect1d(old, new, assume_unique=True, return_indices=True)
        same = self._lengths.numpy()[i_old] == lengths.numpy()[i_new]
        kept_old = np.zeros(old.size, bool)
        kept_old[i_old[same]] = True
        kept_new = np.zeros(new.size, bool)
        kept_new[i_new[same]] = True
        return np.flatnonzero(~kept_old), np.flatnonzero(~kept_new)

    def _checked(self, index) -> np.ndarray:
        index = np.asarray(index, np.int64).reshape(-1)
        cap = self._blocked.size
        if index.size and (int(index.min()) < 0 or int(index.max()) >= cap):
            bad = int(index.min()) if int(index.min()) < 0 else int(index.max())
            raise IndexError(
                f"PrioritizedSliceSampler.sample: step {bad} is outside the "
                f"priority tree's {cap} leaves (max_capacity rounded up to a power "
                "of two); build the sampler with max_capacity at least the "
                "storage's size."
            )
        return index

    def reset(self) -> None:
        """Forget the copy (rebuilt from the source at the next :meth:`follow`)."""
        self.__init__()
