"""A core :class:`~functional_rb.ReplayBuffer` and its state, served to concurrent callers.

:class:`BufferHost` is the object a Ray actor holds for
:class:`~functional_rb.service.RayBufferService` (it needs no Ray: a thread pool can share one
too). It owns the state and the PRNG key, takes items as arrays (NumPy over the wire) and
returns samples as NumPy arrays. Every call holds one condition variable, so the pure
functions of the buffer run one at a time on the one state.

Rate limiting as Reverb does it. The core's :class:`~functional_rb.RateLimiter` only answers
questions (``can_insert`` / ``can_sample``); here an ``add`` or a ``sample`` that the limiter
(or an empty buffer) does not allow *waits* until other callers' samples or inserts allow it,
for at most ``timeout`` seconds, and then raises :class:`RateLimitTimeout` naming the counts
and the limiter's window. ``timeout=None`` waits for ever (Reverb's default); the service's
own ``timeout`` is the default of every call. An add too large to ever fit in the window is
refused at once (``ValueError``) rather than waiting for ever.

Checkpoints (``checkpoint_every=`` and ``checkpoint_path=``,
:mod:`functional_rb.service.checkpoints`): the state and the PRNG key are written with
:func:`functional_rb.checkpoint.save`, holding the condition, so a checkpoint is one
consistent state; a host built on a path that holds checkpoints starts from the newest.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb import checkpoint
from functional_rb.buffer import ReplayBuffer
from functional_rb.protocol import Sample
from functional_rb.rate_limiter import allows_sample
from functional_rb.service.checkpoints import Checkpointer, checkpoint_policy

__all__ = ["BufferHost", "RateLimitTimeout"]


class _Default:
    """The ``timeout`` default: "the service's own timeout". Pickled by name, so that it is
    still ``DEFAULT`` in the actor's process."""

    def __reduce__(self):
        return "DEFAULT"

    def __repr__(self):
        return "<the service's timeout>"


DEFAULT = _Default()


# batches one call may draw: what it returns is held in memory whole (a count from a caller
# must not allocate without bound)
MAX_PER_CALL = 256


class RateLimitTimeout(TimeoutError):
    """An ``add`` or ``sample`` of a service waited ``timeout`` seconds without the rate
    limiter (or, for a sample, the items stored) allowing it."""


def _check_timeout(where: str, timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(
            f"{where}: timeout must be None (wait for ever) or a number of "
            f"seconds >= 0, got {timeout!r}."
        )
    return float(timeout)


def _split_key(key):
    new, sub = jax.random.split(key)
    return new, sub


def _sample_allowed(rb: ReplayBuffer, state, batch_size: int):
    """bool []: the items stored (the sampler) and the rate limiter allow a batch of
    ``batch_size``: :meth:`ReplayBuffer.can_sample` for any batch size."""
    ctx = rb.context(state)
    return jnp.asarray(rb.sampler.can_sample(state.sampler, ctx, batch_size)) & allows_sample(
        rb.rate_limiter, state.limiter, ctx.size, batch_size
    )


class BufferHost:
    """Serve one core buffer (``rb``) and its state to concurrent callers.

    Args:
      rb: a :class:`functional_rb.ReplayBuffer` (its ``rate_limiter`` is enforced by waiting).
      example: one item (no batch axis) to build the state now; ``None``: the first ``add``
        builds it from its first item.
      seed: seeds the PRNG key the service splits for every sample.
      timeout: default seconds an ``add`` / ``sample`` waits for the rate limiter (None: for
        ever).
      checkpoint_every: seconds between checkpoints, or ``{"items": n}`` (after every ``n``
        items added) or both (``{"seconds": s, "items": n}``); with ``checkpoint_path``.
      checkpoint_path: the directory of the checkpoints; the host starts from the newest
        one there (``stats()["restored"]`` says which).

    Examples:
      >>> import numpy as np, functional_rb as frb
      >>> host = BufferHost(frb.ReplayBuffer(capacity=8, batch_size=2),
      ...                   {"obs": np.zeros(3, np.float32)})
      >>> host.add({"obs": np.ones((4, 3), np.float32)})
      4
      >>> host.sample().data["obs"].shape
      (2, 3)
    """

    def __init__(
        self,
        rb: ReplayBuffer,
        example=None,
        *,
        seed: int = 0,
        timeout=60.0,
        checkpoint_every=None,
        checkpoint_path=None,
    ):
        if not isinstance(rb, ReplayBuffer):
            raise TypeError(
                f"BufferHost: rb must be a functional_rb.ReplayBuffer, got "
                f"{type(rb).__name__}; e.g. frb.ReplayBuffer(capacity=100_000)."
            )
        self._rb = rb
        self._timeout = _check_timeout("BufferHost", timeout)
        policy = checkpoint_policy(checkpoint_every, checkpoint_path, "BufferHost")
        self._key = jax.random.key(int(seed))
        # one compiled call each where eager code would dispatch several small ops per add or
        # sample (their checks and the key split cost as much as a frame batch's draw)
        self._split = jax.jit(_split_key)
        self._allowed = jax.jit(functools.partial(_sample_allowed, rb), static_argnums=1)
        self._insertable = jax.jit(rb.can_insert)  # the count traced: one program for any add
        self._cond = threading.Condition()
        self._state: Any = None  # a BufferState once the first item (or example) is in
        self._waiting = {"add": 0, "sample": 0}
        self._closed = False
        self._checkpoints: Checkpointer | None = None
        if example is not None:
            self.init_state(example)
        if policy is not None:
            self._checkpoints = Checkpointer(
                policy,
                save=self._write_checkpoint,
                load=self._read_checkpoint,
                lock=self._cond,
                where="RayBufferService",
            )
            restored = self._checkpoints.restore()  # (the checkpointer's .restored)
            if restored is not None:
                restored.update(self._restored_counts())
            self._checkpoints.start()

    def init_state(self, example) -> None:
        """Build the empty state from one item (no batch axis); once only."""
        with self._cond:
            if self._state is not None:
                raise RuntimeError(
                    "RayBufferService: the state is already built (from the "
                    "example or the first add)."
                )
            self._state = self._rb.init(example)

    # ------------------------------------------------------------------ waiting
    def _wait(self, where: str, kind: str, allowed, timeout, explain) -> None:
        """Wait (holding the condition) until ``allowed()``; raise after ``timeout``.
        ``kind``: ``"add"`` or ``"sample"``, the waiters counted in :meth:`stats`."""
        timeout = self._timeout if timeout is DEFAULT else _check_timeout(where, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting[kind] += 1
        try:
            while not self._closed and not allowed():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RateLimitTimeout(f"{where}: waited {timeout} s; {explain()}")
                self._cond.wait(left)
        finally:
            self._waiting[kind] -= 1
        if self._closed:
            raise RuntimeError(f"{where}: the service was closed while this call waited.")

    def _counts(self) -> str:
        rb, state = self._rb, self._state
        size = 0 if state is None else int(rb.size(state))
        text = f"{size} items stored (capacity {rb.capacity})"
        lim = rb.rate_limiter
        if lim is not None and state is not None:
            text += (
                f", {int(state.limiter.inserts)} inserted and {int(state.limiter.samples)}"
                f" sampled so far: error = inserts * {lim.samples_per_insert:g} - samples"
                f" = {float(lim.error(state.limiter)):g}, window [{lim.min_diff:g}, "
                f"{lim.max_diff:g}], min_size_to_sample {lim.min_size_to_sample}"
            )
        return text

    # ------------------------------------------------------------------ writing
    def _num_items(self, items) -> int:
        leaves = jax.tree_util.tree_leaves(items)
        if not leaves:
            raise ValueError("add: the items have no array leaves.")
        shape = np.shape(leaves[0])
        need = self._rb.ndim
        if len(shape) < need:
            raise ValueError(
                f"add: items need {need} leading batch axes "
                f"({'[B]' if need == 1 else '[num_envs, T]'}), got a leaf of "
                f"shape {shape}."
            )
        return int(np.prod(shape[:need]))

    def add(self, items, timeout=DEFAULT) -> int:
        """Add a batch (leaves ``[B, ...]``; ``ndim=2``: ``[num_envs, T, ...]``) once the rate
        limiter allows it; returns the number of items added."""
        where = "RayBufferService.add"
        n = self._num_items(items)
        rb, lim = self._rb, self._rb.rate_limiter
        with self._cond:
            if self._state is None:
                first = jax.tree_util.tree_map(
                    lambda x: np.asarray(x)[0] if rb.ndim == 1 else np.asarray(x)[:, 0], items
                )
                self._state = rb.init(first)
            if lim is not None:  # without a limiter every insert is allowed: no wait
                if (
                    n * lim.samples_per_insert > lim.max_diff - lim.min_diff
                    and int(rb.size(self._state)) + n > lim.min_size_to_sample
                ):
                    most = int((lim.max_diff - lim.min_diff) // lim.samples_per_insert)
                    raise ValueError(
                        f"{where}: {n} items at samples_per_insert={lim.samples_per_insert:g} "
                        f"exceed the rate limiter's whole error window [{lim.min_diff:g}, "
                        f"{lim.max_diff:g}]: this add could never be allowed. Add at most "
                        f"{most} items per call, or widen the RateLimiter's error_buffer."
                    )
                self._wait(
                    where,
                    "add",
                    lambda: bool(self._insertable(self._state, np.int32(n))),
                    timeout,
                    lambda: (
                        f"inserting {n} items would put the error above max_diff; "
                        f"{self._counts()}. The learner is not sampling fast enough: "
                        "sample more, pass a larger timeout= (None waits for ever) or "
                        "widen the RateLimiter's error_buffer."
                    ),
                )
            self._state = rb.add(self._state, items)
            self._changed(n)
            self._cond.notify_all()
        return n

    def update(self, indices, priorities) -> None:
        """Set the priorities of ``indices`` (a sample's ``indices``); see
        :meth:`functional_rb.ReplayBuffer.update`."""
        with self._cond:
            self._require_state("RayBufferService.update")
            self._state = self._rb.update(
                self._state,
                np.asarray(indices),
                np.asarray(priorities),  # type: ignore[arg-type]  # update takes any array
            )
            self._changed(0)

    # ------------------------------------------------------------------ sampling
    def _can_sample(self, batch_size: int) -> bool:
        return self._state is not None and bool(self._allowed(self._state, batch_size))

    def sample(self, batch_size: int | None = None, timeout=DEFAULT, **options) -> Sample:
        """Draw a batch once the items stored and the rate limiter allow it; a
        :class:`~functional_rb.Sample` of NumPy arrays."""
        bs = self._batch_size("RayBufferService.sample", batch_size)
        with self._cond:
            return self._draw("RayBufferService.sample", bs, timeout, options)

    def sample_many(
        self, count: int, batch_size: int | None = None, timeout=DEFAULT, **options
    ) -> tuple:
        """Up to ``count`` batches, each drawn as :meth:`sample` draws one (its own key, its
        own wait for the rate limiter), one after the other: a tuple of
        :class:`~functional_rb.Sample`. Over Ray they come back as one object, whose cost
        (~2 ms for 1.8 MB here) is paid once for all of them. When a wait after the first
        batch times out, the batches drawn so far are returned (the rate limiter counted
        them); when the first one's does, :class:`RateLimitTimeout` is raised."""
        where = "RayBufferService.sample_many"
        if (
            isinstance(count, bool)
            or not isinstance(count, (int, np.integer))
            or not 1 <= count <= MAX_PER_CALL
        ):
            raise ValueError(
                f"{where}: count must be an int in [1, {MAX_PER_CALL}], got {count!r} (the "
                "batches of one call are held together until it returns)."
            )
        bs = self._batch_size(where, batch_size)
        out: list = []
        with self._cond:
            for _ in range(int(count)):
                try:
                    out.append(self._draw(where, bs, timeout, options))
                except RateLimitTimeout:
                    if not out:
                        raise
                    break
        return tuple(out)

    def _batch_size(self, where: str, batch_size) -> int:
        bs = self._rb.batch_size if batch_size is None else batch_size
        if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or bs < 1:
            raise ValueError(f"{where}: batch_size must be a positive int, got {batch_size!r}.")
        return int(bs)

    def _draw(self, where: str, bs: int, timeout, options: dict) -> Sample:
        """One batch, holding the condition: wait until it is allowed, draw, notify."""
        self._wait(
            where,
            "sample",
            lambda: self._can_sample(bs),
            timeout,
            lambda: (
                f"sampling {bs} items is not allowed yet; {self._counts()}. "
                "The actors are not inserting fast enough: add more items, "
                "pass a larger timeout= (None waits for ever) or widen the "
                "RateLimiter's error_buffer."
            ),
        )
        self._key, key = self._split(self._key)
        sample, self._state = self._rb.sample(self._state, key, batch_size=bs, **options)
        self._changed(0)
        self._cond.notify_all()
        return Sample(*jax.device_get(tuple(sample)))

    def get(self, indices):
        """The stored items at flat storage ``indices`` (NumPy leaves ``[*indices.shape,
        ...]``); see :meth:`functional_rb.ReplayBuffer.get`."""
        with self._cond:
            self._require_state("RayBufferService.get")
            return jax.device_get(self._rb.get(self._state, np.asarray(indices)))

    # ------------------------------------------------------------------ questions
    def _require_state(self, where: str) -> None:
        if self._state is None:
            raise RuntimeError(
                f"{where}: the buffer holds nothing yet (no example was given "
                "and nothing was added); add items first."
            )

    def size(self) -> int:
        with self._cond:
            return 0 if self._state is None else int(self._rb.size(self._state))

    def can_sample(self, batch_size: int | None = None) -> bool:
        with self._cond:
            return self._can_sample(self._rb.batch_size if batch_size is None else batch_size)

    def can_insert(self, num_items: int = 1) -> bool:
        with self._cond:
            if self._state is None:
                return True
            return bool(self._rb.can_insert(self._state, num_items))

    def stats(self) -> dict:
        """Size, capacity, the limiter's counters and the calls waiting for it."""
        with self._cond:
            rb, state = self._rb, self._state
            size = 0 if state is None else int(rb.size(state))
            out = {
                "size": size,
                "capacity": rb.capacity,
                "utilization": size / rb.capacity,
                "initialized": state is not None,
                "waiting_adds": self._waiting["add"],
                "waiting_samples": self._waiting["sample"],
            }
            if rb.rate_limiter is not None and state is not None:
                out.update(
                    inserts=int(state.limiter.inserts),
                    samples=int(state.limiter.samples),
                    error=float(rb.rate_limiter.error(state.limiter)),
                )
            if self._checkpoints is not None:
                out.update(self._checkpoints.stats())
            return out

    # ------------------------------------------------------------------ persistence
    def save(self, path: str) -> None:
        """:func:`functional_rb.checkpoint.save` of the state, on the service's machine."""
        with self._cond:
            self._require_state("RayBufferService.save")
            checkpoint.save(path, self._state)

    def load(self, path: str) -> None:
        """Replace the state by a checkpoint (checked against the current state's layout when
        there is one); waiting calls re-check the limiter."""
        with self._cond:
            self._state = checkpoint.load(path, like=self._state)
            self._changed(0)
            self._cond.notify_all()

    def _changed(self, items: int) -> None:
        if self._checkpoints is not None:
            self._checkpoints.changed(items)

    def _write_checkpoint(self, directory: str) -> None:
        if self._state is None:
            raise RuntimeError("RayBufferService: nothing to checkpoint before the first add.")
        checkpoint.save(directory, {"state": self._state, "key": jax.random.key_data(self._key)})

    def _read_checkpoint(self, directory: str) -> None:
        like = (
            None
            if self._state is None
            else {"state": self._state, "key": jax.random.key_data(self._key)}
        )
        tree = checkpoint.load(directory, like=like)
        self._state, self._key = tree["state"], jax.random.wrap_key_data(tree["key"])

    def _restored_counts(self) -> dict:
        stats = self.stats()
        return {"items": stats["size"], "inserts": stats.get("inserts")}

    def close(self) -> None:
        """Write a last checkpoint (when checkpointing and anything changed), then wake
        every waiting ``add`` / ``sample`` with an error; later ones raise too."""
        if self._checkpoints is not None:
            self._checkpoints.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
