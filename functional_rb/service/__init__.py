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

from functional_rb._internal.lazy import lazy_exports_from_type_checking

# imported on first use: the adapters' Ray buffer needs only ``runtime`` (no JAX)
# (the public names, each written once: read by type checkers, the API docs and
# lazy_exports_from_type_checking, which imports each on first read)
if TYPE_CHECKING:
    from functional_rb.service.host import BufferHost, RateLimitTimeout
    from functional_rb.service.ray_service import BufferClient, RayBufferService
    from functional_rb.service.runtime import ServiceInterrupted

__all__, __getattr__, __dir__ = lazy_exports_from_type_checking(__name__)
