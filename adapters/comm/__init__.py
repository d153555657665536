"""Communication between a buffer's owner and its users (TorchRL's ``torchrl/_comm``):
:mod:`.backends` (the scoped defaults ``service_backend(...)`` / ``transport_backend(...)``),
:mod:`.layout` (what a payload holds), :mod:`.distributed` (request/reply channels over
torch.distributed), :mod:`.wire` (their authenticated, pickle-free headers) and
:mod:`.replay_service` (a replay buffer served over them: ``transport="distributed"``)."""

from functional_rb.adapters.comm.backends import (
    normalize_service_backend,
    service_backend,
    transport_backend,
)
from functional_rb.adapters.comm.replay_service import DistributedReplayClient
from functional_rb.adapters.comm.wire import RemoteError

__all__ = [
    "DistributedReplayClient",
    "RemoteError",
    "normalize_service_backend",
    "service_backend",
    "transport_backend",
]
