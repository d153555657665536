"""Services that come back, in one process (no Ray): the checkpoint policy's arguments, a
BufferHost writing checkpoints by items (before the add returns) and by seconds (a timer),
and a new host on the same path resuming from the newest: the same items, the same rate
limiter counts, the same PRNG key (the next sample is the one the first host would have
drawn); a damaged newest checkpoint falls back to the one before; a checkpoint of another
layout is refused; only the newest two are kept.
"""

import os
import time

import numpy as np
import pytest

import functional_rb as frb
from functional_rb.checkpoint import CheckpointError
from functional_rb.service import BufferHost, RayBufferService
from functional_rb.service.actor import ServiceActor
from functional_rb.service.checkpoints import KEEP, CheckpointPolicy, checkpoint_policy

EXAMPLE = {"w": np.int32(0), "seq": np.int32(0)}


def _items(start, n):
    return {"w": np.zeros(n, np.int32), "seq": np.arange(start, start + n, dtype=np.int32)}


def _rb():
    return frb.ReplayBuffer(
        capacity=100,
        batch_size=4,
        rate_limiter=frb.RateLimiter(
            samples_per_insert=1.0, min_size_to_sample=4, error_buffer=1000
        ),
    )


def _ckpts(path):
    return sorted(n for n in os.listdir(path) if n.startswith("ckpt-"))


def test_the_policy_reads_seconds_items_or_both_and_refuses_the_rest(tmp_path):
    assert checkpoint_policy(None, None, "S") is None
    assert checkpoint_policy(2, tmp_path, "S") == CheckpointPolicy(str(tmp_path), 2.0, None)
    assert checkpoint_policy({"items": 5, "seconds": 0.5}, "p", "S") == CheckpointPolicy(
        "p", 0.5, 5
    )
    errors = {
        "checkpoint_path is missing": (5, None),
        "checkpoint_every is missing": (None, "p"),
        "a dict with 'seconds' and/or 'items'": ({"minutes": 1}, "p"),
        "seconds must be a positive number": (0, "p"),
        "items must be a positive int": ({"items": 2.5}, "p"),
    }
    for match, (every, path) in errors.items():
        with pytest.raises(ValueError, match=f"S: .*{match}"):
            checkpoint_policy(every, path, "S")
    with pytest.raises(ValueError, match="a number of seconds, or a dict"):
        checkpoint_policy(True, "p", "S")  # (a bool is not a number of seconds)
    with pytest.raises(TypeError, match="checkpoint_path must be a directory"):
        checkpoint_policy(5, 3, "S")
    with pytest.raises(ValueError, match="go together"):  # (checked by the host too)
        BufferHost(_rb(), EXAMPLE, checkpoint_every=5)


def test_items_checkpoints_are_written_before_the_add_returns_and_restored(tmp_path):
    host = BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 8}, checkpoint_path=tmp_path)
    assert host.stats()["restored"] is None
    host.add(_items(0, 4))
    assert _ckpts(tmp_path) == []
    host.add(_items(4, 4))  # 8 since the last: written by this add
    assert _ckpts(tmp_path) == ["ckpt-0000000001"]
    first_after = host.sample()
    host.add(_items(8, 4))  # 4 more, not written: what a crash now would lose
    stats = host.stats()["checkpoint"]
    assert stats["written"] == 1 and stats["inserted_since"] == 4 and stats["error"] is None
    # a new host on the path (a restart): the checkpoint's items, counters and key
    again = BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 8}, checkpoint_path=tmp_path)
    restored = again.stats()
    assert restored["size"] == 8 and restored["inserts"] == 8 and restored["samples"] == 0
    assert restored["restored"]["path"].endswith("ckpt-0000000001")
    assert restored["restored"]["items"] == 8 and restored["restored"]["skipped"] == []
    assert again.get(np.arange(8))["seq"].tolist() == list(range(8))
    # the key came back: hosts restored from one checkpoint draw what the first one drew
    # after writing it (its next sample is the checkpoint's key's first split)
    twin = BufferHost(_rb(), None, checkpoint_every={"items": 8}, checkpoint_path=tmp_path)
    assert np.array_equal(again.sample().indices, first_after.indices)
    assert np.array_equal(twin.sample().indices, first_after.indices)


def test_seconds_checkpoints_come_from_a_timer_and_close_writes_the_last(tmp_path):
    host = BufferHost(_rb(), EXAMPLE, checkpoint_every=0.1, checkpoint_path=tmp_path)
    time.sleep(0.35)
    assert _ckpts(tmp_path) == []  # nothing changed: nothing written
    host.add(_items(0, 4))
    deadline = time.monotonic() + 10
    while not _ckpts(tmp_path):
        assert time.monotonic() < deadline, "the timer wrote no checkpoint"
        time.sleep(0.05)
    written = host.stats()["checkpoint"]["written"]
    time.sleep(0.35)
    assert host.stats()["checkpoint"]["written"] == written  # unchanged since: no new one
    host.add(_items(4, 2))
    host.close()  # the last one, with the 2 items added after the timer's
    again = BufferHost(_rb(), EXAMPLE, checkpoint_every=0.1, checkpoint_path=tmp_path)
    assert again.size() == 6
    again.close()


def test_a_damaged_newest_checkpoint_falls_back_and_only_two_are_kept(tmp_path):
    host = BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 2}, checkpoint_path=tmp_path)
    for start in range(0, 10, 2):
        host.add(_items(start, 2))
    assert _ckpts(tmp_path) == [f"ckpt-{n:010d}" for n in range(6 - KEEP, 6)]
    newest = tmp_path / "ckpt-0000000005" / "data.bin"
    newest.write_bytes(newest.read_bytes()[:-8])  # truncated
    again = BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 2}, checkpoint_path=tmp_path)
    restored = again.stats()["restored"]
    assert again.size() == 8 and restored["path"].endswith("ckpt-0000000004")
    assert len(restored["skipped"]) == 1 and "ckpt-0000000005" in restored["skipped"][0]
    assert (tmp_path / "damaged-ckpt-0000000005").is_dir()  # kept aside, for inspection
    again.add(_items(10, 2))  # numbered after the damaged one
    assert _ckpts(tmp_path) == ["ckpt-0000000004", "ckpt-0000000006"]
    for name in _ckpts(tmp_path):
        (tmp_path / name / "data.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="every checkpoint there is damaged"):
        BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 2}, checkpoint_path=tmp_path)


def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    host = BufferHost(_rb(), EXAMPLE, checkpoint_every={"items": 1}, checkpoint_path=tmp_path)
    host.add(_items(0, 2))
    other = {"w": np.int32(0), "seq": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="seq"):
        BufferHost(_rb(), other, checkpoint_every={"items": 1}, checkpoint_path=tmp_path)


def test_the_ray_service_checks_its_checkpoint_arguments_before_starting_ray():
    ray = pytest.importorskip("ray")
    running = ray.is_initialized()
    with pytest.raises(ValueError, match="RayBufferService: .*checkpoint_path is missing"):
        RayBufferService(_rb(), EXAMPLE, checkpoint_every=5)
    with pytest.raises(ValueError, match="max_task_retries.*stored twice"):
        ServiceActor("Svc", dict, options={"max_task_retries": 2})
    assert ray.is_initialized() == running  # (refused before Ray was started)
