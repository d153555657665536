"""Actors and a learner in threads, kept at a samples-per-insert ratio by ``frb.RateLimiter``.

    python examples/actor_learner.py [--actors 2] [--updates 400] [--samples-per-insert 8]

The setup of Reverb-based agents (Acme), with one process and no server: actor threads step
their environments and add transitions, a learner thread samples batches and takes gradient
steps. Left alone, whichever is faster runs away (a fast learner replays the same items
hundreds of times, a fast actor fills the buffer with items that are never replayed). The
buffer carries a ``RateLimiter``: its counters live in the buffer state, ``rb.can_insert`` and
``rb.can_sample`` say whether an add or a sample keeps ``inserts * samples_per_insert -
samples`` inside the error window, and each thread waits on a condition variable until its
call is allowed (nothing in the buffer blocks: it is a pure function of its state).

The buffer state is shared through one lock: every ``add`` and ``sample`` is a jitted,
donated call made while holding it, so the state is updated in place and always consistent.
The learner's gradient step runs outside the lock, as does the actors' environment stepping.

At the end the script prints the inserts, samples and their ratio, and the smallest and
largest error seen once sampling had started: inside the window, whatever the relative speed
of the threads (try ``--actors 1`` and ``--actors 6``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import functional_rb as frb

OBS = 8
ADD = 16  # transitions an actor adds at a time
BATCH = 64  # the learner's batch


class Shared:
    """The buffer state and the statistics, guarded by one condition variable."""

    def __init__(self, rb: frb.ReplayBuffer):
        self.rb = rb
        self.cond = threading.Condition()
        self.state = rb.init({"obs": np.zeros(OBS, np.float32), "reward": np.float32(0)})
        self.add = jax.jit(rb.add, donate_argnums=0)
        self.sample = jax.jit(rb.sample, donate_argnums=0)
        self.can_insert = jax.jit(rb.can_insert, static_argnums=1)
        self.can_sample = jax.jit(rb.can_sample)
        self.error = jax.jit(lambda s: rb.rate_limiter.error(s.limiter))
        self.errors: list[float] = []  # after each call, once sampling has started
        self.blocked = {"actor": 0, "learner": 0}
        self.stop = False

    def record(self) -> None:
        if int(self.state.limiter.samples) > 0:
            self.errors.append(float(self.error(self.state)))


def actor(shared: Shared, seed: int) -> None:
    """A toy environment: a random walk whose reward is a fixed linear function of the state."""
    rng = np.random.default_rng(seed)
    w_true = np.linspace(-1, 1, OBS).astype(np.float32)
    x = rng.normal(size=OBS).astype(np.float32)
    while True:
        obs = x + np.cumsum(rng.normal(scale=0.1, size=(ADD, OBS)), 0).astype(np.float32)
        x = obs[-1]
        items = {
            "obs": obs,
            "reward": obs @ w_true + rng.normal(scale=0.01, size=ADD).astype(np.float32),
        }
        with shared.cond:
            if not bool(shared.can_insert(shared.state, ADD)):
                shared.blocked["actor"] += 1
            shared.cond.wait_for(lambda: shared.stop or bool(shared.can_insert(shared.state, ADD)))
            if shared.stop:
                return
            shared.state = shared.add(shared.state, items)
            shared.record()
            shared.cond.notify_all()


@jax.jit
def sgd_step(w, obs, reward, weights):
    """One step of weighted least squares: the learner's 'training'."""

    def loss(w):
        return jnp.sum(weights * (obs @ w - reward) ** 2) / jnp.maximum(jnp.sum(weights), 1.0)

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.05 * grad, value


def learner(shared: Shared, updates: int, out: dict) -> None:
    w = jnp.zeros(OBS, jnp.float32)
    key = jax.random.key(0)
    for _ in range(updates):
        key, k = jax.random.split(key)
        with shared.cond:
            if not bool(shared.can_sample(shared.state)):
                shared.blocked["learner"] += 1
            shared.cond.wait_for(lambda: bool(shared.can_sample(shared.state)))
            sample, shared.state = shared.sample(shared.state, k)
            shared.record()
            shared.cond.notify_all()
        w, loss = sgd_step(w, sample.data["obs"], sample.data["reward"], sample.weights)
    out["loss"] = float(loss)
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()


def run(
    actors: int = 2,
    updates: int = 400,
    samples_per_insert: float = 8.0,
    error_buffer: float = 256.0,
    seed: int = 0,
) -> dict:
    limiter = frb.RateLimiter(
        samples_per_insert=samples_per_insert, min_size_to_sample=256, error_buffer=error_buffer
    )
    rb = frb.ReplayBuffer(capacity=10_000, batch_size=BATCH, rate_limiter=limiter)
    shared = Shared(rb)
    out: dict = {}
    threads = [threading.Thread(target=actor, args=(shared, seed + i)) for i in range(actors)]
    threads.append(threading.Thread(target=learner, args=(shared, updates, out)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    inserts, samples = int(shared.state.limiter.inserts), int(shared.state.limiter.samples)
    return dict(
        inserts=inserts,
        samples=samples,
        ratio=samples / inserts,
        error_min=min(shared.errors),
        error_max=max(shared.errors),
        min_diff=limiter.min_diff,
        max_diff=limiter.max_diff,
        loss=out["loss"],
        blocked=dict(shared.blocked),
        seconds=time.perf_counter() - t0,
        target=samples_per_insert,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--updates", type=int, default=400)
    p.add_argument("--samples-per-insert", type=float, default=8.0)
    p.add_argument("--error-buffer", type=float, default=256.0)
    args = p.parse_args(argv)
    r = run(args.actors, args.updates, args.samples_per_insert, args.error_buffer)
    print(
        f"{args.actors} actor(s), 1 learner, {r['seconds']:.1f} s: {r['inserts']:,} items "
        f"inserted, {r['samples']:,} sampled ({args.updates} batches of {BATCH}); "
        f"waits: actors {r['blocked']['actor']}, learner {r['blocked']['learner']}"
    )
    print(
        f"samples per insert: {r['ratio']:.2f} (target {r['target']:g}); error "
        f"(inserts * {r['target']:g} - samples) stayed in [{r['error_min']:.0f}, "
        f"{r['error_max']:.0f}], the limiter's window is [{r['min_diff']:.0f}, "
        f"{r['max_diff']:.0f}]; learner loss {r['loss']:.4f}"
    )
    inside = r["min_diff"] <= r["error_min"] and r["error_max"] <= r["max_diff"]
    print("the ratio held within the error buffer" if inside else "OUTSIDE the error buffer")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
