"""TorchRL's ``ImmutableDatasetWriter``: a read-only buffer."""

from __future__ import annotations

from typing import Any

from functional_rb.adapters.writers.base import Writer

__all__ = ["ImmutableDatasetWriter"]


class ImmutableDatasetWriter(Writer):
    """A read-only buffer (TorchRL's ``ImmutableDatasetWriter``): writes raise.

    Args:
      compilable: TorchRL's flag for ``torch.compile``; accepted, no effect here.

    Example:
        >>> import torch
        >>> from functional_rb.adapters import (ImmutableDatasetWriter, ReplayBuffer,
        ...                                     TensorStorage)
        >>> rb = ReplayBuffer(storage=TensorStorage(torch.arange(4)),
        ...                   writer=ImmutableDatasetWriter())
        >>> rb.extend(torch.arange(2))
        Traceback (most recent call last):
        ...
        RuntimeError: This dataset doesn't allow writing: the buffer is read-only (ImmutableDatasetWriter).
    """

    WRITING_ERR = (
        "This dataset doesn't allow writing: the buffer is read-only (ImmutableDatasetWriter)."
    )

    def add(self, data):
        raise RuntimeError(self.WRITING_ERR)

    def extend(self, data):
        raise RuntimeError(self.WRITING_ERR)

    def write_at(self, index, data):
        raise RuntimeError(self.WRITING_ERR)

    def _empty(self, empty_write_count: bool = True) -> None:
        raise RuntimeError(self.WRITING_ERR)

    def dumps(self, path) -> None:
        del path

    def loads(self, path) -> None:
        del path

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict) -> None:
        del state_dict
