"""Huge pages for the tensor storages' CPU tensors (``LazyTensorStorage``, ``TensorStorage``,
``LazyMemmapStorage``), through the core's JAX-free :mod:`functional_rb._internal.pages`.

A replay buffer of 10^7-10^8 rows sampled at random pays a page-table walk per row on 4 KiB
pages; with 2 MiB pages the walk mostly goes (why, and the figures:
:mod:`functional_rb._internal.hugepages`). Each tensor's memory (its untyped storage, once
even when several leaves are views of one consolidated buffer) is advised when it holds at
least 32 MiB and lives on the CPU:

- a lazy storage's tensors, right after ``torch.empty`` made them at the first write: nothing
  has been written yet (the contents are not initialized), so any page already touched (a
  consolidated TensorDict's copy) is released and comes back huge at its first write;
- a ``TensorStorage``'s given data, and memory-mapped files: advised as they are (pages
  already written stay small until the kernel's ``khugepaged`` merges them);
- shared memory (``share_memory_``): only where ``/dev/shm`` can take huge pages
  (:func:`~functional_rb._internal.pages.shared_mode`); elsewhere nothing is asked.

Everything falls back silently, and ``FRB_HUGEPAGES=0`` turns it off, as for the core.
"""

from __future__ import annotations

import torch

from functional_rb._internal import pages
from functional_rb.adapters._utils import data as D

__all__ = ["advise_tensors", "advised"]


def advise_tensors(data, *, fresh: bool = False, shared: bool = False) -> int:
    """Ask for huge pages for the CPU tensors of ``data`` (a tensor, a TensorDict or
    tensorclass, or a PyTree of tensors); returns the bytes advised (0 when nothing was done,
    never an error).

    Args:
      data: the storage's data.
      fresh: the tensors were just allocated and hold nothing yet (``torch.empty``), so their
        touched pages may be released (private anonymous memory only).
      shared: the tensors are in shared memory (``share_memory_``).

    >>> import torch
    >>> from functional_rb.adapters.storages._hugepages import advise_tensors
    >>> advise_tensors({"obs": torch.empty(10, 3)})   # small: left alone
    0
    """
    done, seen = 0, set()
    for leaf in _tensors(data):
        if (
            not isinstance(leaf, torch.Tensor)
            or leaf.device.type != "cpu"
            or leaf.layout != torch.strided
            or leaf.is_nested
        ):
            continue  # (sparse and nested tensors have no one storage to advise)
        try:
            storage = leaf.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one
            continue
        if address in seen or not address:
            continue
        seen.add(address)
        done += pages.advise_range(address, storage.nbytes(), zeroed=fresh, shared=shared)
    return done


def _tensors(data) -> list:
    """The tensors holding ``data``'s memory: a lazy stack's members' own tensors (reading a
    lazy stack's leaves would stack them: a copy, or an error for members of different
    shapes), else its leaves."""
    members = getattr(data, "tensordicts", None)
    if members is not None:
        return [t for member in members for t in _tensors(member)]
    try:
        return D.leaves(data)
    except RuntimeError:  # a lazy stack nested deeper, of members of different shapes
        return []


def advised(tensor: torch.Tensor) -> bool | None:
    """Whether the kernel records huge-page advice for ``tensor``'s memory (its first whole
    page); None where that cannot be read.

    >>> import torch
    >>> from functional_rb.adapters.storages._hugepages import advised
    >>> advised(torch.empty(8)) in (True, False, None)
    True
    """
    storage = tensor.untyped_storage()
    return pages.advised_range(storage.data_ptr(), storage.nbytes())
