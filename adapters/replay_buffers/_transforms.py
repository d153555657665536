"""A buffer's transforms: forward on what comes out, inverse (last first) on what goes in.

Elements are TorchRL ``Transform`` objects (callable, with ``inv``) or plain callables (forward
only; their inverse is the identity). TorchRL wraps them in its ``Compose``; this chain offers
the part of ``Compose`` a buffer uses (``len``, indexing, iteration, ``append`` / ``insert``,
calling, ``inv``, ``state_dict``, ``eval``) without importing TorchRL.
"""

from __future__ import annotations

from contextlib import nullcontext

from tensordict import is_tensor_collection

__all__ = ["TransformChain", "shallow_copy"]


def shallow_copy(data):
    """A new container over the same tensors (TorchRL's ``Compose.inv`` starts from one): what
    the buffer writes into it (``"index"``, priorities read back) never reaches the caller's
    TensorDict, and no tensor is copied."""
    if is_tensor_collection(data):
        return data.copy()
    return data


class _Inverted:
    """A transform used the other way round (``append_transform(t, invert=True)``)."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, data):
        inv = getattr(self.transform, "inv", None)
        return data if inv is None else inv(data)

    def inv(self, data):
        return self.transform(data)

    def __getattr__(self, name):
        return getattr(self.transform, name)

    def __repr__(self):
        return f"Inverted({self.transform!r})"


def _unlocked(data):
    return data.unlock_() if is_tensor_collection(data) and data.is_locked else nullcontext()


class TransformChain(list):
    """The transforms of one buffer, in order: a list (so that ``len`` and iteration, which
    every ``extend`` and ``sample`` ask for, are the list's own), compared and hashed by
    identity as TorchRL's ``Compose`` is."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def __init__(self, *transforms):
        super().__init__()
        for t in transforms:
            self.append(t)

    @staticmethod
    def _prepare(transform, invert: bool):
        if hasattr(transform, "eval"):
            transform.eval()  # TorchRL: a buffer's transforms run in eval mode
        return _Inverted(transform) if invert else transform

    def append(self, transform, *, invert: bool = False) -> None:
        super().append(self._prepare(transform, invert))

    def insert(self, index: int, transform, *, invert: bool = False) -> None:
        n = len(self)
        if not -n <= index <= n:
            raise ValueError(
                f"insert_transform: index expected to be between [-{n}, {n}] (the "
                f"buffer has {n} transforms), got index={index}."
            )
        super().insert(index, self._prepare(transform, invert))

    def __call__(self, data):
        return self.forward(data)  # as nn.Module: a replaced ``forward`` is what runs

    def forward(self, data):
        with _unlocked(data):
            for t in self:
                data = t(data)
                if data is None:
                    return None
        return data

    def inv(self, data):
        data = shallow_copy(data)
        for t in reversed(self):
            inv = getattr(t, "inv", None)
            if inv is not None:
                data = inv(data)
            if data is None:
                return None
        return data

    def eval(self):
        for t in self:
            if hasattr(t, "eval"):
                t.eval()
        return self

    def state_dict(self) -> dict:
        return {str(i): t.state_dict() for i, t in enumerate(self) if hasattr(t, "state_dict")}

    def load_state_dict(self, state_dict: dict) -> None:
        for i, t in enumerate(self):
            if str(i) in state_dict and hasattr(t, "load_state_dict"):
                t.load_state_dict(state_dict[str(i)])

    def share_memory(self) -> None:
        """What TorchRL does to a shared buffer's transforms: each with write-side state is put
        in shared memory, or the sharing is refused (a transform that declares
        ``requires_shared_write_state`` but cannot share it)."""
        for t in self:
            share = getattr(t, "share_memory_", None)
            if callable(share):
                share()
            elif getattr(t, "requires_shared_write_state", False):
                raise RuntimeError(
                    f"{type(t).__name__} keeps replay-buffer write state but does not implement "
                    "share_memory_(); a shared buffer's workers would each keep their own copy. "
                    "Use a centralized writer or a transform that can share its state."
                )

    def __repr__(self):
        return f"TransformChain({', '.join(map(repr, self))})"
