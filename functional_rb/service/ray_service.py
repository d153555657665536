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

A service that comes back: with ``checkpoint_every=`` / ``checkpoint_path=`` the actor writes
checkpoints (:mod:`functional_rb.service.checkpoints`), and with Ray's ``max_restarts``
(``remote_config={"max_restarts": 3}``) a restarted actor resumes from the newest. Clients need
nothing new: a read in flight is sent again once the actor is back, and an interrupted write
raises :class:`~functional_rb.service.ServiceInterrupted` (it may or may not have been applied).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import jax
import numpy as np

from functional_rb.service import runtime
from functional_rb.service.actor import ServiceActor, ServiceOwner
from functional_rb.service.checkpoints import checkpoint_policy
from functional_rb.service.host import DEFAULT, MAX_PER_CALL, BufferHost

__all__ = ["BufferClient", "RayBufferService"]

_WHERE = "RayBufferService"
# calls sent again after a restart of the actor (reads: a second send stores nothing twice)
_READS = frozenset({"sample", "sample_many", "get", "size", "can_sample", "can_insert", "stats"})


def _host_arrays(tree):
    """NumPy leaves (JAX arrays are copied to host memory once, here, not by pickling)."""
    return jax.tree_util.tree_map(np.asarray, tree)


class BufferClient:
    """A picklable handle on a :class:`RayBufferService`: every method is one remote call.

    It has no lifecycle rights (``close`` belongs to the service). ``timeout`` arguments: the
    seconds an ``add`` / ``sample`` may wait for the rate limiter (default: the service's).
    When Ray restarts the service's actor (``max_restarts``), a read is sent again and an
    interrupted write raises :class:`~functional_rb.service.ServiceInterrupted`.

    Examples:
      >>> from functional_rb.service import BufferClient
      >>> [name for name in ("add", "sample", "update", "stats") if hasattr(BufferClient, name)]
      ['add', 'sample', 'update', 'stats']
    """

    def __init__(self, actor) -> None:
        self._actor = actor

    def _call(self, name: str, *args, **kwargs):
        actor = self.__dict__.get("_actor")
        if actor is None:
            raise RuntimeError(f"{_WHERE}.{name}: the service is closed.")
        return runtime.call(
            actor, name, *args, where=f"{_WHERE}.{name}", retry=name in _READS, **kwargs
        )

    def add(self, items, *, timeout=DEFAULT) -> int:
        """Add a batch (leaves ``[B, ...]``); waits while the rate limiter forbids it."""
        return self._call("add", _host_arrays(items), timeout)

    def sample(self, batch_size: int | None = None, *, timeout=DEFAULT, **options):
        """A :class:`~functional_rb.Sample` of NumPy arrays; waits while nothing can be
        sampled or the rate limiter forbids it. ``options`` go to the sampler (``beta=``)."""
        return self._call("sample", batch_size, timeout, **options)

    def samples(
        self,
        batch_size: int | None = None,
        *,
        in_flight: int = 4,
        per_call: int = 1,
        timeout=DEFAULT,
        **options,
    ) -> Iterator:
        """Samples without end, ``in_flight`` batches asked for ahead of the one returned
        (Reverb's samples in flight): the service draws the next batches while the learner
        trains on this one, so a learner waits for the transfer of a batch only when it
        consumes faster than the service serves.

        ``per_call``: batches one remote call draws (:meth:`BufferHost.sample_many`) and
        returns as one object. Ray's cost is per object (here ~2 ms for one 1.8 MB batch of
        84x84 frames, ~0.8 ms a batch for four in one object), so large items are served
        faster with ``per_call=4``. ``ceil(in_flight / per_call)`` calls are kept in flight.

        Each batch is drawn when its call reaches the service, which may be while up to
        ``ceil(in_flight / per_call) * per_call + per_call - 1`` batches are still ahead of
        it: priorities updated after its call was sent do not shape it, and the rate limiter
        counts it when drawn. A call whose wait timed out after some of its batches were
        drawn returns those (the next call raises if it still cannot draw). Closing the iterator
        (or dropping it) abandons the calls in flight: the service still draws them. After a
        restart of the service's actor the calls in flight are sent again (reads, as
        :meth:`sample` is).

        Examples:
          >>> batches = client.samples(256, in_flight=8, per_call=4)  # doctest: +SKIP
          >>> sample = next(batches)  # doctest: +SKIP
        """
        where = f"{_WHERE}.samples"
        for name, n in (("in_flight", in_flight), ("per_call", per_call)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {n!r}.")
        if per_call > MAX_PER_CALL:
            raise ValueError(f"{where}: per_call must be at most {MAX_PER_CALL}, got {per_call}.")
        calls = -(-in_flight // per_call)
        return self._samples(where, batch_size, calls, per_call, timeout, options)

    def _samples(self, where, batch_size, calls, per_call, timeout, options):
        actor = self.__dict__.get("_actor")
        if actor is None:
            raise RuntimeError(f"{where}: the service is closed.")
        ray = runtime.import_ray(where)

        def send():
            if per_call == 1:
                return actor.invoke.remote("sample", (batch_size, timeout), options)
            return actor.invoke.remote("sample_many", (per_call, batch_size, timeout), options)

        pending = collections.deque(send() for _ in range(calls))
        while True:
            try:
                got = runtime.get(pending[0], where)
            except ray.exceptions.ActorDiedError as e:
                raise runtime.dead(where, e) from None
            except ray.exceptions.ActorUnavailableError:
                if not runtime.wait_back(actor, where):
                    raise runtime.dead(where) from None
                pending = collections.deque(send() for _ in range(calls))
                continue
            pending.popleft()
            pending.append(send())
            yield from (got,) if per_call == 1 else got

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


class RayBufferService(ServiceOwner, BufferClient):
    """Serve a core :class:`~functional_rb.ReplayBuffer` from a Ray actor.

    Args:
      rb: the buffer (any sampler, writer, storage; its ``rate_limiter`` is enforced by
        waiting, as Reverb does).
      example: one item to build the state now (``None``: the first ``add`` builds it).
      seed: seeds the service's PRNG key.
      timeout: default seconds an ``add`` / ``sample`` waits for the rate limiter before
        raising :class:`~functional_rb.service.RateLimitTimeout` (``None``: for ever).
      checkpoint_every: seconds between checkpoints, or ``{"items": n}`` (written by the add
        that brings the items inserted since the last one to ``n``), or both; needs
        ``checkpoint_path``.
      checkpoint_path: a directory on the actor's machine. The service starts from the newest
        checkpoint there, and so does its actor when Ray restarts it
        (``remote_config={"max_restarts": n}``); ``stats()["restored"]`` says what was
        loaded. ``close()`` writes a last one.
      ray_init_config: ``ray.init`` keyword arguments, used only when Ray is not running yet
        (e.g. ``{"address": "auto"}`` to join a cluster started with ``ray start``).
      remote_config: ``ray.remote`` options of the actor (``num_cpus``, ``resources``,
        ``scheduling_strategy``, ``max_restarts``, ...). Default ``{"num_cpus": 1,
        "max_concurrency": 64}``; ``max_concurrency`` must stay >= 2 so that waiting calls do
        not block the others.

    The service is itself a client; :meth:`client` / :meth:`clients` give picklable handles
    for other processes. :meth:`close` ends the actor (and Ray, if the service started it).

    Examples:
      >>> import numpy as np, functional_rb as frb
      >>> from functional_rb.service import RayBufferService
      >>> rb = frb.ReplayBuffer(capacity=100, batch_size=4)
      >>> service = RayBufferService(rb, {"obs": np.zeros(3, np.float32)},  # doctest: +SKIP
      ...     checkpoint_every={"items": 50}, checkpoint_path="/tmp/rb-ckpt",
      ...     remote_config={"max_restarts": 3})
      >>> service.add({"obs": np.ones((8, 3), np.float32)})                 # doctest: +SKIP
      8
      >>> service.close()                                                   # doctest: +SKIP
    """

    _where = _WHERE

    def __init__(
        self,
        rb,
        example=None,
        *,
        seed: int = 0,
        timeout=60.0,
        checkpoint_every=None,
        checkpoint_path=None,
        ray_init_config: dict | None = None,
        remote_config: dict | None = None,
    ):
        options = {"num_cpus": 1, "max_concurrency": 64}
        if remote_config is not None:
            if not isinstance(remote_config, dict):
                raise TypeError(
                    f"{_WHERE}: remote_config must be a dict of ray.remote "
                    f"options, got {type(remote_config).__name__}."
                )
            options.update(remote_config)
        if options["max_concurrency"] < 2:
            raise ValueError(
                f"{_WHERE}: remote_config['max_concurrency'] must be >= 2 (an add "
                "or sample waiting for the rate limiter holds one thread while "
                f"the calls that unblock it need another), got "
                f"{options['max_concurrency']!r}."
            )
        BufferHost(rb, None, timeout=timeout)  # check the arguments here, not in the actor
        checkpoint_policy(checkpoint_every, checkpoint_path, _WHERE)
        # the example travels with the constructor: a restarted actor builds the same state
        example = None if example is None else _host_arrays(example)
        self._service = ServiceActor(
            _WHERE,
            BufferHost,
            (rb, example),
            {
                "seed": seed,
                "timeout": timeout,
                "checkpoint_every": checkpoint_every,
                "checkpoint_path": checkpoint_path,
            },
            options=options,
            ray_init_config=ray_init_config,
        )
        super().__init__(self._service.handle)

    def _new_client(self) -> BufferClient:
        return BufferClient(self._actor)

    def _after_close(self, stopped) -> None:
        del self._actor
