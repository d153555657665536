"""TorchRL's ``RemoteTensorDictReplayBuffer``: a buffer that lives on one
``torch.distributed.rpc`` worker and is used by the others through an ``RRef``.

The buffer rank only runs ``rpc.init_rpc``; a trainer builds the buffer there with
``rref = rpc.remote("BUFFER", ReplayBufferNode, args=(...))`` and then calls its methods *on
the class*, with the ``RRef`` in place of ``self``, on the worker that owns it::

    rpc.rpc_sync(rref.owner(), ReplayBufferNode.extend, args=(rref, td))
    batch = rpc.rpc_sync(rref.owner(), ReplayBufferNode.sample, args=(rref, 32))

Torch's RPC pickles the function by its qualified name and runs it in the owner's RPC thread
pool, so every public method here first swaps an ``RRef`` it receives for the buffer it names
(``accept_remote_rref_invocation``). The calls of several collectors and trainers then run
concurrently on the owner: the buffer's re-entrant lock (``ReplayBuffer.lock``) serializes
their reads and writes, so every item extended lands in exactly one slot.

``rref.rpc_sync().extend(td)`` (torch's RRef proxies) works as well, with no unwrapping needed.
Public methods that a subclass adds (``ReplayBufferNode.stats_for_trainer``) accept an ``RRef``
too, which TorchRL's class decorator leaves to the subclass to arrange.
"""

from __future__ import annotations

import functools
import inspect

import torch
from tensordict import TensorDictBase

from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer

__all__ = [
    "RemoteTensorDictReplayBuffer",
    "accept_remote_rref_invocation",
    "accept_remote_rref_udf_invocation",
]

try:  # torch builds without distributed support (some macOS / Windows wheels) have no RRef
    from torch.distributed.rpc import PyRRef as _RRef
except ImportError:  # pragma: no cover - depends on the torch build
    _RRef = ()

# Dunder methods that remote callers use as ordinary calls (the rest are Python's protocol).
_REMOTE_DUNDERS = ("__len__", "__getitem__", "__setitem__")


def _owned_value(ref, where: str):
    """The object ``ref`` names, which must live on this worker."""
    if ref.is_owner():
        return ref.local_value()
    raise RuntimeError(
        f"{where}: received an RRef to an object owned by worker {ref.owner().name!r}, but "
        "this call runs on another worker. Run it where the buffer lives: "
        f"rpc.rpc_sync(rref.owner(), {where}, args=(rref, ...)), or use "
        "rref.rpc_sync().<method>(...)."
    )


def accept_remote_rref_invocation(func):
    """Decorate a method so that it may be called with the ``RRef`` of its object in place of
    ``self`` (as ``rpc.rpc_sync(rref.owner(), Class.method, args=(rref, ...))`` does); called
    on the object itself it behaves as before."""
    if getattr(func, "_frb_accepts_rref", False):
        return func

    @functools.wraps(func)
    def unpack_rref_and_invoke(self, *args, **kwargs):
        if isinstance(self, _RRef):
            self = _owned_value(self, func.__qualname__)
        return func(self, *args, **kwargs)

    unpack_rref_and_invoke._frb_accepts_rref = True
    return unpack_rref_and_invoke


def _remote_names(namespace) -> list[str]:
    return [
        name
        for name, value in namespace.items()
        if (not name.startswith("_") or name in _REMOTE_DUNDERS) and inspect.isfunction(value)
    ]  # (not properties, classmethods or staticmethods)


def accept_remote_rref_udf_invocation(cls):
    """Class decorator: every public method of ``cls``, inherited ones included, accepts the
    ``RRef`` of an instance in place of ``self`` (``accept_remote_rref_invocation``)."""
    for klass in reversed(cls.__mro__[:-1]):
        for name in _remote_names(vars(klass)):
            func = inspect.getattr_static(cls, name)
            if not inspect.isfunction(func) or getattr(func, "_frb_accepts_rref", False):
                continue
            wrapped = accept_remote_rref_invocation(func)
            # RPC pickles a function by module and qualified name: an inherited method's
            # wrapper must be found under this class, not under its original (unwrapped) home.
            wrapped.__module__, wrapped.__qualname__ = cls.__module__, f"{cls.__qualname__}.{name}"
            setattr(cls, name, wrapped)
    return cls


@accept_remote_rref_udf_invocation
class RemoteTensorDictReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``RemoteTensorDictReplayBuffer``: a :class:`TensorDictReplayBuffer` whose
    public methods can be invoked by other workers through ``torch.distributed.rpc`` with the
    buffer's ``RRef`` in place of ``self``, or called locally as usual.

    Build it on the buffer rank from another rank with ``rpc.remote(buffer_worker,
    RemoteTensorDictReplayBuffer or a subclass, args=..., kwargs=...)``, then call
    ``rpc.rpc_sync(rref.owner(), Class.extend, args=(rref, td))`` (or ``rpc_async``,
    ``rpc.remote``). Calls from several ranks run concurrently in the owner's RPC threads and
    are serialized by the buffer's lock. Prefer a :class:`LazyMemmapStorage` (its tensors
    pickle cheaply). Subclasses' own public methods accept an ``RRef`` as well.

    Args:
      priority_key: as in :class:`TensorDictReplayBuffer`.
      **kwargs: the arguments of :class:`~functional_rb.adapters.ReplayBuffer`.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in _remote_names(vars(cls)):
            setattr(cls, name, accept_remote_rref_invocation(vars(cls)[name]))

    # TorchRL's signatures (``sample``'s positional order differs from the parent's).
    def sample(
        self,
        batch_size: int | None = None,
        include_info: bool | None = None,
        return_info: bool = False,
    ) -> TensorDictBase:
        return super().sample(
            batch_size=batch_size, include_info=include_info, return_info=return_info
        )

    def add(self, data: TensorDictBase) -> int:
        return super().add(data)

    def extend(
        self, tensordicts: TensorDictBase, *, update_priority: bool | None = None
    ) -> torch.Tensor:
        return super().extend(tensordicts, update_priority=update_priority)

    def update_priority(self, index: int | torch.Tensor, priority: float | torch.Tensor) -> None:
        return super().update_priority(index, priority)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        return super().update_tensordict_priority(data)
