"""Serving a core buffer to other processes and machines (optional: the ``functional_rb[ray]``
extra).

- :class:`RayBufferService`: a Ray actor holding a :class:`~functional_rb.ReplayBuffer` and
  its state; :class:`BufferClient` handles (``service.client()``) for JAX actors and
  learners: arrays in, NumPy arrays out, the buffer's rate limiter enforced by waiting
  (:class:`RateLimitTimeout` after ``timeout`` seconds), as Reverb does.
- :class:`BufferHost`: the same serving without Ray (the object the actor holds; threads of
  one process may share it).

Ray is imported only when a service is built; ``docs/distributed.md`` shows a cluster.
"""
from functional_rb.service.host import BufferHost
from functional_rb.service.host import RateLimitTimeout
from functional_rb.service.ray_service import BufferClient
from functional_rb.service.ray_service import RayBufferService

__all__ = [
    "BufferClient",
    "BufferHost",
    "RateLimitTimeout",
    "RayBufferService",
]
