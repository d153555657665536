"""The core buffer served to other processes: functional_rb.service.

In one process (threads sharing a BufferHost): the rate limiter is enforced by waiting, as
Reverb does, and a wait past ``timeout`` raises RateLimitTimeout naming the counts. Through
Ray (a local runtime, 2 CPUs, loopback): several writer processes add items tagged (writer,
sequence number) while the learner samples under the rate limiter; every item arrives exactly
once, in each writer's order, and the limiter's counts match what was done.
"""

import sys
import threading
import time

import jax
import numpy as np
import pytest
from _ray_local import ray_runtime_fixture

import functional_rb as frb
from functional_rb.service import BufferHost, RateLimitTimeout, RayBufferService

EXAMPLE = {"w": np.int32(0), "seq": np.int32(0)}


def _items(w, start, n):
    return {"w": np.full(n, w, np.int32), "seq": np.arange(start, start + n, dtype=np.int32)}


def _limited(capacity=1000, batch_size=4, spi=1.0, min_size=8, error_buffer=16):
    # window [min_size * spi - e, min_size * spi + e] = [-8, 24] by default
    return frb.ReplayBuffer(
        capacity=capacity,
        batch_size=batch_size,
        rate_limiter=frb.RateLimiter(
            samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=error_buffer
        ),
    )


def _wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _in_thread(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except Exception as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


# ---------------------------------------------------------------------------------- in-process
def test_sample_waits_until_inserts_allow_it():
    host = BufferHost(_limited(), EXAMPLE, timeout=10.0)
    thread, out = _in_thread(host.sample)
    _wait_until(lambda: host.stats()["waiting_samples"] == 1)
    host.add(_items(0, 0, 4))  # 4 < min_size_to_sample: still waiting
    time.sleep(0.1)
    assert thread.is_alive() and host.stats()["waiting_samples"] == 1
    host.add(_items(0, 4, 4))
    thread.join(10)
    assert not thread.is_alive() and "error" not in out
    sample = out["value"]
    assert isinstance(sample, frb.Sample) and isinstance(sample.data["seq"], np.ndarray)
    assert sample.data["seq"].shape == (4,) and sample.mask.all()
    assert set(sample.data["seq"].tolist()) <= set(range(8))
    assert host.stats()["samples"] == 4 and host.stats()["inserts"] == 8


def test_sample_times_out_with_the_counts():
    host = BufferHost(_limited(), EXAMPLE, timeout=10.0)
    host.add(_items(0, 0, 5))
    start = time.monotonic()
    with pytest.raises(RateLimitTimeout, match=r"waited 0.2 s; sampling 4 items") as info:
        host.sample(timeout=0.2)
    assert time.monotonic() - start >= 0.2
    assert "5 items stored" in str(info.value) and "min_size_to_sample 8" in str(info.value)
    assert host.stats()["waiting_samples"] == 0 and host.stats()["samples"] == 0


def test_sample_many_draws_each_batch_as_sample_does():
    """``count`` batches, each with its own key and its own wait for the rate limiter: the
    second batch of a call waits for inserts the first did not need."""
    host = BufferHost(_limited(), EXAMPLE, timeout=10.0)
    for bad in (0, 257, True):
        with pytest.raises(ValueError, match=r"count must be an int in \[1, 256\]"):
            host.sample_many(bad)
    host.add(_items(0, 0, 12))  # error 12 in the window [-8, 24]: four batches of 4 leave -4
    first = host.sample_many(4)
    assert len(first) == 4 and all(isinstance(s, frb.Sample) for s in first)
    assert all(s.mask.all() and set(s.data["seq"].tolist()) <= set(range(12)) for s in first)
    draws = [tuple(s.indices.tolist()) for s in first]
    assert len(set(draws)) == 4  # its own key each (4 equal draws of 4 from 12: ~1e-12)
    assert host.stats()["samples"] == 16
    # of three more batches the first takes the error to -8, the second would take it to -12
    thread, out = _in_thread(host.sample_many, 3)
    _wait_until(lambda: host.stats()["waiting_samples"] == 1)
    assert host.stats()["samples"] == 20  # the first was drawn; the second waits
    host.add(_items(0, 12, 8))  # error 0: room for the other two
    thread.join(10)
    assert not thread.is_alive() and "error" not in out and len(out["value"]) == 3
    assert host.stats()["samples"] == 28 and host.stats()["waiting_samples"] == 0
    with pytest.raises(RateLimitTimeout, match=r"RayBufferService.sample_many: waited 0.2 s"):
        host.sample_many(2, timeout=0.2)  # error -8: not even the first batch
    host.add(_items(0, 20, 4))  # error -4: room for one batch of the two
    assert len(host.sample_many(2, timeout=0.2)) == 1  # the drawn one is not thrown away
    assert host.stats()["samples"] == 32


def test_add_waits_for_the_learner_then_times_out():
    host = BufferHost(_limited(), EXAMPLE, timeout=10.0)
    host.add(_items(0, 0, 8))  # filling up: error 8
    host.add(_items(0, 8, 16))  # error 24 = max_diff: allowed
    with pytest.raises(RateLimitTimeout, match="would put the error above max_diff") as info:
        host.add(_items(0, 24, 4), timeout=0.2)
    assert "error = inserts * 1 - samples = 24" in str(info.value)
    assert host.size() == 24  # the refused add wrote nothing
    thread, out = _in_thread(host.add, _items(0, 24, 4))
    _wait_until(lambda: host.stats()["waiting_adds"] == 1)
    host.sample()  # error 20: the waiting add fits
    thread.join(10)
    assert out == {"value": 4} and host.size() == 28
    assert host.stats()["error"] == 24.0


def test_add_larger_than_the_window_is_refused_at_once():
    host = BufferHost(_limited(), EXAMPLE, timeout=10.0)
    host.add(_items(0, 0, 8))
    start = time.monotonic()
    with pytest.raises(ValueError, match="could never be allowed. Add at most 32 items"):
        host.add(_items(0, 8, 40))
    assert time.monotonic() - start < 5


def _episode(start, n):
    done = np.zeros(n, bool)
    done[-1] = True
    return {"obs": np.arange(start, start + n, dtype=np.float32), "next": {"done": done}}


def test_without_a_limiter_adds_never_wait_and_a_sample_waits_for_eligible_items():
    # a slice sampler's can_sample depends on the stored episodes, not only on their count
    rb = frb.ReplayBuffer(capacity=64, batch_size=4, sampler=frb.SliceSampler(slice_len=4))
    example = {"obs": np.float32(0), "next": {"done": np.bool_(False)}}
    host = BufferHost(rb, example, timeout=10.0)
    thread, out = _in_thread(host.sample)
    _wait_until(lambda: host.stats()["waiting_samples"] == 1)
    assert host.add(_episode(0, 3)) == 3  # no slice of 4 in an episode of 3: still waiting
    time.sleep(0.1)
    assert thread.is_alive() and host.stats()["waiting_adds"] == 0
    host.add(_episode(100, 6))
    thread.join(10)
    assert not thread.is_alive() and "error" not in out
    obs = out["value"].data["obs"].ravel()
    assert out["value"].mask.all() and set(obs.tolist()) <= set(range(100, 106))
    assert np.all(np.diff(obs) == 1)  # one slice of 4 consecutive steps of the long episode


def test_a_seeded_host_draws_what_the_buffer_draws_with_split_keys():
    rb = frb.ReplayBuffer(capacity=100, batch_size=8)
    host = BufferHost(rb, EXAMPLE, seed=3)
    host.add(_items(0, 0, 50))
    drawn = [host.sample().data["seq"] for _ in range(3)]
    state = rb.add(rb.init(EXAMPLE), _items(0, 0, 50))
    key = jax.random.key(3)
    for got in drawn:
        key, sub = jax.random.split(key)
        want, state = rb.sample(state, sub)
        np.testing.assert_array_equal(got, np.asarray(want.data["seq"]))


def test_close_wakes_a_waiting_call():
    host = BufferHost(_limited(), EXAMPLE, timeout=None)
    thread, out = _in_thread(host.sample)
    _wait_until(lambda: host.stats()["waiting_samples"] == 1)
    host.close()
    thread.join(10)
    assert isinstance(out.get("error"), RuntimeError)
    assert "closed while this call waited" in str(out["error"])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="timeout must be None"):
        BufferHost(_limited(), timeout=-1)
    with pytest.raises(TypeError, match="rb must be a functional_rb.ReplayBuffer"):
        BufferHost(object())
    host = BufferHost(_limited())
    with pytest.raises(RuntimeError, match="holds nothing yet"):
        host.update(np.zeros(2, np.int32), np.ones(2))
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        host.sample(0)


def test_threads_keep_the_ratio_in_the_window():
    """Two writers and a learner racing: every op waits for its turn, none is lost, and the
    error never leaves the window (checked after every sample)."""
    lim_rb = _limited(batch_size=4, spi=2.0, min_size=8, error_buffer=24)  # window [-8, 40]
    host = BufferHost(lim_rb, EXAMPLE, timeout=20.0)
    lim = lim_rb.rate_limiter
    writers = [
        _in_thread(lambda w=w: [host.add(_items(w, s, 4)) for s in range(0, 80, 4)])
        for w in range(2)
    ]
    errors, drawn = [], 0
    while drawn < 2 * 160 - 40:  # what the limiter lets through by the end
        host.sample()
        drawn += 4
        errors.append(host.stats()["error"])
    for thread, out in writers:
        thread.join(20)
        assert "error" not in out
    assert host.size() == 160 and host.stats()["inserts"] == 160
    assert min(errors) >= lim.min_diff and max(errors) <= lim.max_diff + 4 * 2.0


# ---------------------------------------------------------------------------------- Ray
ray_runtime = ray_runtime_fixture()


def _writer(client, w, n, chunk):
    for start in range(0, n, chunk):
        client.add(_items(w, start, chunk))
    return n


def test_actors_extend_and_a_learner_samples(ray_runtime, tmp_path):
    ray = ray_runtime
    rb = _limited(capacity=1000, batch_size=8, spi=1.0, min_size=16, error_buffer=32)
    with RayBufferService(rb, EXAMPLE, timeout=30.0, remote_config={"num_cpus": 0}) as service:
        writer = ray.remote(num_cpus=0)(_writer)
        refs = [writer.remote(client, w, 64, 8) for w, client in enumerate(service.clients(3))]
        sampled = 0
        while sampled < 3 * 64 - 32:  # a learner at samples_per_insert=1, to the last window
            ray.get(ray.wait(refs, num_returns=len(refs), timeout=0)[0])  # a writer's error
            sample = service.sample(timeout=30.0)
            assert sample.mask.all() and sample.data["seq"].max() < 64
            sampled += 8
        assert ray.get(refs) == [64] * 3
        stats = service.stats()
        assert stats["size"] == 192 and stats["inserts"] == 192 and stats["samples"] == sampled
        stored = service.get(np.arange(192))
        pairs = list(zip(stored["w"].tolist(), stored["seq"].tolist()))
        assert sorted(pairs) == [(w, s) for w in range(3) for s in range(64)]  # exactly once
        for w in range(3):  # each writer's items in its order
            assert [s for ww, s in pairs if ww == w] == list(range(64))
        # a checkpoint round trip on the service's side
        service.save(str(tmp_path / "ckpt"))
        service.add(_items(7, 0, 8))
        service.load(str(tmp_path / "ckpt"))
        assert service.size() == 192
        # error 192 - 160 = 32: six more batches of 8 keep it >= min_diff = -16, a seventh
        # would not
        for _ in range(6):
            service.sample(timeout=5.0)
        with pytest.raises(RateLimitTimeout, match="sampling 8 items is not allowed"):
            service.sample(timeout=0.3)
    assert not service.is_alive


def test_samples_in_flight_are_drawn_ahead_and_counted(ray_runtime):
    rb = _limited(capacity=1000, batch_size=8, spi=1.0, min_size=16, error_buffer=1000)
    with RayBufferService(rb, EXAMPLE, timeout=30.0, remote_config={"num_cpus": 0}) as service:
        with pytest.raises(ValueError, match="in_flight must be a positive int, got 0"):
            service.samples(in_flight=0)
        service.add(_items(0, 0, 64))
        batches = service.samples(in_flight=3)
        got = [next(batches) for _ in range(5)]
        for sample in got:
            assert sample.mask.all() and sample.data["seq"].shape == (8,)
            stored = service.get(sample.indices)  # each batch holds the items it names
            assert np.array_equal(stored["seq"], sample.data["seq"])
            assert (stored["w"] == 0).all()
        # five returned and three sent ahead: the service drew eight batches
        _wait_until(lambda: service.stats()["samples"] == 8 * 8)
        batches.close()
        assert service.stats()["samples"] == 8 * 8  # closing sends nothing more
        # four batches a call, two calls in flight: each batch still names its items
        with pytest.raises(ValueError, match="per_call must be a positive int, got 0"):
            service.samples(per_call=0)
        with pytest.raises(ValueError, match="per_call must be at most 256, got 257"):
            service.samples(per_call=257)
        grouped = service.samples(in_flight=8, per_call=4)
        got = [next(grouped) for _ in range(6)]
        for sample in got:
            assert sample.mask.all() and sample.data["seq"].shape == (8,)
            stored = service.get(sample.indices)
            assert np.array_equal(stored["seq"], sample.data["seq"])
        assert len({tuple(s.indices.tolist()) for s in got}) == 6
        # six returned from two calls, two more calls sent: 4 calls of 4 batches drawn
        _wait_until(lambda: service.stats()["samples"] == 8 * 8 + 4 * 4 * 8)
        grouped.close()
        # an error of a call in flight (here the rate limiter's) arrives from next()
        with (
            RayBufferService(
                _limited(min_size=16), EXAMPLE, timeout=0.2, remote_config={"num_cpus": 0}
            ) as empty,
            pytest.raises(RateLimitTimeout, match="0 items stored"),
        ):
            next(empty.samples(in_flight=2))


def test_errors_arrive_as_themselves(ray_runtime):
    ray = ray_runtime
    with pytest.raises(ValueError, match="the example has no array leaves"):
        RayBufferService(_limited(), {}, remote_config={"num_cpus": 0})
    with pytest.raises(ValueError, match="max_concurrency"):
        RayBufferService(_limited(), remote_config={"max_concurrency": 1})
    service = RayBufferService(_limited(), EXAMPLE, timeout=0.2, remote_config={"num_cpus": 0})
    try:
        with pytest.raises(RateLimitTimeout, match="0 items stored"):
            service.sample()
        # the service shipped to a task is a client there (no lifecycle rights)
        size = ray.get(
            ray.remote(num_cpus=0)(lambda s: (type(s).__name__, s.size())).remote(service)
        )
        assert size == ("BufferClient", 0)
        with pytest.raises(TypeError, match="num_clients must be an int"):
            service.clients(2.0)
    finally:
        service.close()
    with pytest.raises(RuntimeError, match="the service is closed"):
        service.client()
    assert ray.is_initialized()  # a runtime the user started is left running


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(
        ImportError, match=r"RayBufferService needs Ray.*constraints\.txt \"\.\[ray\]\""
    ):
        RayBufferService(_limited(), EXAMPLE)
