"""How a buffer's sampler follows writes made by other processes to a shared storage.

A storage shared by processes (:class:`~functional_rb.adapters.LazyMemmapStorage`) counts the
steps every process reserved and committed (``storage.committed(since)``). Each buffer object
keeps, in a :class:`Follower`, how many of those steps its sampler has been told of; before it
samples (and after it writes) it tells the sampler about the rest, in the order the steps were
reserved, so trajectory boundaries and the priorities of new items are those one process would
have after the same writes. A copy of the buffer in another process only writes: the process
that built the buffer keeps the sampler's state.
"""
from __future__ import annotations

import os

import torch

__all__ = ["Follower"]


class Follower:
    """The steps of a shared storage a buffer's sampler has been told of."""

    def __init__(self):
        self.owner = os.getpid()
        self.seen = 0

    def foreign(self) -> bool:
        """Whether this copy runs in another process than the one that built the buffer."""
        return os.getpid() != self.owner

    def written(self, storage, sampler, writer, index) -> None:
        """This process wrote ``index``: tell the sampler (with a shared storage, every step
        committed so far, in reservation order)."""
        if storage.committed(self.seen) is not None:
            self.catch_up(storage, sampler, writer, own_write=True)
        elif not self.foreign():
            sampler.extend(index, storage=storage)

    def catch_up(self, storage, sampler, writer, own_write: bool = False) -> None:
        """Tell the sampler about the steps committed since it was last told (a range larger
        than the ring: its last ``rows``)."""
        got = storage.committed(self.seen)
        if got is None or self.foreign() or got[1] <= got[0]:
            return
        start, end = got
        rows = storage.max_size_along_dim0()
        start = max(start, end - rows)
        if not own_write:
            storage.touched()  # other processes changed the data this process reads
        index = writer.replicate_index((start + torch.arange(end - start)) % rows)
        sampler.mark_update(index, storage=storage)
        sampler.extend(index, storage=storage)
        self.seen = end

    def rebase(self, storage) -> None:
        """The storage was replaced or emptied: its committed steps are all known."""
        got = storage.committed(0)
        self.seen = 0 if got is None else got[1]
