"""Serving a core buffer to other processes and machines (optional: the ``functional_rb[ray]``
extra).

- :class:`RayBufferService`: a Ray actor holding a :class:`~functional_rb.ReplayBuffer` and
  its state; :class:`BufferClient` handles (``service.client()``) for JAX actors and
  learners: arrays in, NumPy arrays out, the buffer's rate limiter enforced by waiting
  (:class:`RateLimitTimeout` after ``timeout`` seconds), as Reverb does.
- :class:`BufferHost`: the same serving without Ray (the object the actor serves; threads of
  one process may share it).
- Services that come back: ``checkpoint_every=`` / ``checkpoint_path=`` and Ray's
  ``max_restarts``; a write interrupted by a restart raises :class:`ServiceInterrupted`.

Ray is imported only when a service is built; ``docs/distributed.md`` shows a cluster.
"""

from typing import TYPE_CHECKING

from functional_rb._internal.lazy import lazy_exports

# imported on first use: the adapters' Ray buffer needs only ``runtime`` (no JAX)
_EXPORTS = {
    "BufferClient": "functional_rb.service.ray_service:BufferClient",
    "BufferHost": "functional_rb.service.host:BufferHost",
    "RateLimitTimeout": "functional_rb.service.host:RateLimitTimeout",
    "RayBufferService": "functional_rb.service.ray_service:RayBufferService",
    "ServiceInterrupted": "functional_rb.service.runtime:ServiceInterrupted",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, imported, for type checkers and the API docs
    from functional_rb.service.host import BufferHost, RateLimitTimeout
    from functional_rb.service.ray_service import BufferClient, RayBufferService
    from functional_rb.service.runtime import ServiceInterrupted
