"""A core buffer served by a Ray actor, for JAX actors and learners in other processes or on
other machines of a Ray cluster (``docs/distributed.md``).

::

    import functional_rb as frb
    from functional_rb.service import RayBufferService

    rb = frb.ReplayBuffer(capacity=100_000, batch_size=256, rate_limiter=frb.RateLimiter(
        samples_per_insert=4.0, min_size_to_sample=1_000, error_buffer=2_000))
    service = RayBufferService(rb, example={"obs": np.zeros(4, np.float32)})
    client = service.client()        # picklable: hand it to Ray actors / tasks
    client.add({"obs": obs_batch})   # waits while the rate limiter forbids it
    sample = client.sample()         # frb.Sample of NumPy arrays
    service.close()

The actor runs a :class:`~functional_rb.service.host.BufferHost` (threaded, so that a call
waiting for the rate limiter does not block the calls that will allow it). Arrays travel as
NumPy through Ray's object store; a sample comes back as a :class:`~functional_rb.Sample` of
NumPy arrays (``jnp.asarray`` puts them on a device).
"""
from __future__ import annotations

import jax
import numpy as np

from functional_rb.service import runtime
from functional_rb.service.host import DEFAULT, BufferHost

__all__ = ["BufferClient", "RayBufferService"]

_WHERE = "RayBufferService"


def _host_arrays(tree):
    """NumPy leaves (JAX arrays are copied to host memory once, here, not by pickling)."""
    return jax.tree_util.tree_map(np.asarray, tree)


class BufferClient:
    """A picklable handle on a :class:`RayBufferService`: every method is one remote call.

    It has no lifecycle rights (``close`` belongs to the service). ``timeout`` arguments: the
    seconds an ``add`` / ``sample`` may wait for the rate limiter (default: the service's).
    """

    def __init__(self, actor) -> None:
        self._actor = actor

    def _call(self, name: str, *args, **kwargs):
        return runtime.get(getattr(self._actor, name).remote(*args, **kwargs),
                           f"{_WHERE}.{name}")

    def add(self, items, *, timeout=DEFAULT) -> int:
        """Add a batch (leaves ``[B, ...]``); waits while the rate limiter forbids it."""
        return self._call("add", _host_arrays(items), timeout)

    def sample(self, batch_size: int | None = None, *, timeout=DEFAULT, **options):
        """A :class:`~functional_rb.Sample` of NumPy arrays; waits while nothing can be
        sampled or the rate limiter forbids it. ``options`` go to the sampler (``beta=``)."""
        return self._call("sample", batch_size, timeout, **options)

    def update(self, indices, priorities) -> None:
        """Set the priorities of a sample's ``indices``."""
        return self._call("update", np.asarray(indices), np.asarray(priorities))

    def get(self, indices):
        """The stored items at flat storage ``indices`` (NumPy leaves)."""
        return self._call("get", np.asarray(indices))

    def size(self) -> int:
        return self._call("size")

    __len__ = size

    def can_sample(self, batch_size: int | None = None) -> bool:
        return self._call("can_sample", batch_size)

    def can_insert(self, num_items: int = 1) -> bool:
        return self._call("can_insert", num_items)

    def stats(self) -> dict:
        """``size``, ``capacity``, ``utilization``, the limiter's ``inserts`` / ``samples`` /
        ``error`` and the calls waiting (``waiting_adds``, ``waiting_samples``)."""
        return self._call("stats")

    def save(self, path: str) -> None:
        """Checkpoint the state to ``path`` on the service's machine."""
        return self._call("save", str(path))

    def load(self, path: str) -> None:
        """Replace the state by the checkpoint at ``path`` on the service's machine."""
        return self._call("load", str(path))


class RayBufferService(BufferClient):
    """Serve a core :class:`~functional_rb.ReplayBuffer` from a Ray actor.

    Args:
      rb: the buffer (any sampler, writer, storage; its ``rate_limiter`` is enforced by
        waiting, as Reverb does).
      example: one item to build the state now (``None``: the first ``add`` builds it).
      seed: seeds the service's PRNG key.
      timeout: default seconds an ``add`` / ``sample`` waits for the rate limiter before
        raising :class:`~functional_rb.service.RateLimitTimeout` (``None``: for ever).
      ray_init_config: ``ray.init`` keyword arguments, used only when Ray is not running yet
        (e.g. ``{"address": "auto"}`` to join a cluster started with ``ray start``).
      remote_config: ``ray.remote`` options of the actor (``num_cpus``, ``resources``,
        ``scheduling_strategy``, ...). Default ``{"num_cpus": 1, "max_concurrency": 64}``;
        ``max_concurrency`` must stay >= 2 so that waiting calls do not block the others.

    The service is itself a client; :meth:`client` / :meth:`clients` give picklable handles
    for other processes. :meth:`close` ends the actor (and Ray, if the service started it).
    """

    def __init__(self, rb, example=None, *, seed: int = 0, timeout=60.0,
                 ray_init_config: dict | None = None, remote_config: dict | None = None):
        options = {"num_cpus": 1, "max_concurrency": 64}
        if remote_config is not None:
            if not isinstance(remote_config, dict):
                raise TypeError(f"{_WHERE}: remote_config must be a dict of ray.remote "
                                f"options, got {type(remote_config).__name__}.")
            options.update(remote_config)
        if options["max_concurrency"] < 2:
            raise ValueError(f"{_WHERE}: remote_config['max_concurrency'] must be >= 2 (an add "
                             "or sample waiting for the rate limiter holds one thread while "
                             f"the calls that unblock it need another), got "
                             f"{options['max_concurrency']!r}.")
        BufferHost(rb, None, timeout=timeout)  # check the arguments here, not in the actor
        self._lease = runtime.RayRuntime.acquire(_WHERE, ray_init_config)
        ray = runtime.import_ray(_WHERE)
        try:
            actor = ray.remote(**options)(BufferHost).remote(rb, None, seed=seed,
                                                              timeout=timeout)
            super().__init__(actor)
            if example is not None:  # (a call, so that a bad example raises as itself)
                self._call("init_state", _host_arrays(example))
        except BaseException:
            if hasattr(self, "_actor"):
                ray.kill(self._actor, no_restart=True)
                del self._actor
            self._lease.release()
            raise

    @property
    def is_alive(self) -> bool:
        return hasattr(self, "_actor")

    def client(self) -> BufferClient:
        """A picklable handle without lifecycle rights, for another process."""
        if not self.is_alive:
            raise RuntimeError(f"{_WHERE}.client: the service is closed.")
        return BufferClient(self._actor)

    def clients(self, num_clients: int) -> list[BufferClient]:
        """``num_clients`` independent handles (one per actor or learner)."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError(f"{_WHERE}.clients: num_clients must be an int, got "
                            f"{num_clients!r}.")
        if num_clients < 1:
            raise ValueError(f"{_WHERE}.clients: num_clients must be at least 1, got "
                             f"{num_clients}.")
        return [self.client() for _ in range(num_clients)]

    def __reduce__(self):
        # shipped to another process, the service is a client there: the actor's lifetime
        # stays with the process that built it
        return BufferClient, (self._actor,)

    def close(self) -> None:
        """Wake waiting calls with an error, end the actor, release Ray."""
        if not self.is_alive:
            return
        ray = runtime.import_ray(_WHERE)
        try:
            self._call("close")
        except Exception:  # the actor may already be gone (ray.shutdown()); ending it anyway
            pass
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:
            pass
        del self._actor
        self._lease.release()

    shutdown = close

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
