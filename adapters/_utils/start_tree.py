"""The prioritized slice sampler's tree of slice starts: a copy of the priority sum tree in
which only the steps a slice may start at carry their priority, kept up to date by rewriting
only the leaves that changed.

TorchRL's ``PrioritizedSliceSampler`` zeroes, for every draw, the priorities of the steps no
slice can start at (the last ``slice_len - 1`` of each trajectory), draws, and restores them:
two writes of every such step per sample. Here the zeroed copy is kept beside the priority
tree instead. A priority write reaches it through the priority tree's journal of written
leaves; a change of the stored trajectories (a write) through the trajectories that appeared
or went away (their blocked steps are released or blocked; the others' are unchanged, since
trajectories never share a step); a change of the slice length or of the storage's shape
recomputes the blocked steps. So a draw is a plain tree draw. The segment trees' node values
are a function of their leaves alone (:mod:`.segment_tree`), so this copy's nodes are
bit-identical to those of TorchRL's zeroed tree, and so are the drawn indices.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from functional_rb.adapters._utils.segment_tree import SumSegmentTree

__all__ = ["StartTree"]


class StartTree:
    """A :class:`SumSegmentTree` equal to a source tree with the leaves no slice may start at
    held at 0. :meth:`follow` brings it up to date and returns it."""

    def __init__(self):
        self._source: SumSegmentTree | None = None
        self._tree: SumSegmentTree | None = None
        self._blocked: np.ndarray | None = None   # bool [source.capacity]
        self._geometry = None                     # what the blocked steps were computed for
        self._revision = None                     # the trajectory list they were computed from
        self._start = self._lengths = None        # that list

    def follow(self, source: SumSegmentTree, geometry, revision: int, start: torch.Tensor,
               lengths: torch.Tensor,
               excluded: Callable[[torch.Tensor, torch.Tensor], np.ndarray]) -> SumSegmentTree:
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
        self._geometry, self._revision, self._start, self._lengths = \
            geometry, revision, start, lengths
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
            raise IndexError(f"PrioritizedSliceSampler.sample: step {bad} is outside the "
                             f"priority tree's {cap} leaves (max_capacity rounded up to a power "
                             "of two); build the sampler with max_capacity at least the "
                             "storage's size.")
        return index

    def reset(self) -> None:
        """Forget the copy (rebuilt from the source at the next :meth:`follow`)."""
        self.__init__()
