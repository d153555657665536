"""The adapters' Ray services come back, and a live service's store runs nothing it is sent.

- In one process: the actor's host object dumps the buffer by ``checkpoint_every`` and a new
  one on the same path loads the newest (items, write count, sampler), reporting it in
  ``stats()``.
- Through Ray (a local runtime, 2 CPUs, loopback): ``ReplayBuffer(..., service_backend="ray",
  checkpoint_every=..., checkpoint_path=...)`` and ``RayReplayBuffer(transport="distributed")``
  with ``max_restarts``; the actor's process is killed (SIGKILL) between writes: the next
  calls are served by the restarted actor, which holds the newest checkpoint and says so in
  ``stats()["restored"]``; a client in another actor goes on; the distributed clients
  reconnect. A stranger who learned the live store's address and a connection's name pushes
  a crafted pickle into it: nothing runs, and the service keeps serving.
"""

import pickle
from datetime import timedelta
from functools import partial

import pytest
import ray
import torch
import torch.distributed as dist
from _ray_local import kill_actor, ray_runtime_fixture
from tensordict import TensorDict

from functional_rb.adapters import LazyTensorStorage, RayReplayBuffer, ReplayBuffer
from functional_rb.adapters.replay_buffers.ray import _Host
from functional_rb.service import ServiceInterrupted, runtime
from functional_rb.service.checkpoints import checkpoint_policy

pytestmark = pytest.mark.heavy

REMOTE = {"num_cpus": 0, "max_restarts": 2}


def _tagged(w, start, n=8):
    return TensorDict({"w": torch.full((n,), w), "seq": torch.arange(start, start + n)}, [n])


def _pairs(td):
    return list(zip(td["w"].tolist(), td["seq"].tolist()))


def test_the_host_dumps_by_policy_and_a_new_one_loads_the_newest(tmp_path):
    policy = checkpoint_policy({"items": 16}, tmp_path, "t")
    kwargs = {"storage": LazyTensorStorage(100), "batch_size": 4}
    host = _Host(ReplayBuffer, (), dict(kwargs), checkpoint=policy)
    for start in (0, 8, 16):
        host.call("extend", (_tagged(0, start),), {})
    stats = host.call("stats", (), {})
    assert stats["restored"] is None and stats["checkpoint"]["written"] == 1
    assert stats["checkpoint"]["inserted_since"] == 8
    again = _Host(ReplayBuffer, (), dict(kwargs, storage=LazyTensorStorage(100)), checkpoint=policy)
    restored = again.call("stats", (), {})
    assert restored["size"] == 16 and restored["write_count"] == 16
    assert restored["restored"]["items"] == 16 and restored["restored"]["write_count"] == 16
    assert _pairs(again.call("__getitem__", (slice(0, 16),), {})) == [(0, s) for s in range(16)]
    again.call("extend", (_tagged(1, 0),), {})  # written after the restored ones
    assert again.call("__len__", (), {}) == 24
    again.close()  # the last checkpoint: 24 items
    assert (
        _Host(
            ReplayBuffer, (), dict(kwargs, storage=LazyTensorStorage(100)), checkpoint=policy
        ).call("__len__", (), {})
        == 24
    )


def test_checkpoint_arguments_are_checked_before_ray_starts():
    running = ray.is_initialized()
    with pytest.raises(ValueError, match="RayReplayBuffer: .*checkpoint_path is missing"):
        RayReplayBuffer(storage=partial(LazyTensorStorage, 10), checkpoint_every=5)
    with pytest.raises(TypeError, match=r"\['checkpoint_path'\] given both"):
        ReplayBuffer(
            storage=partial(LazyTensorStorage, 10),
            service_backend="ray",
            checkpoint_path="p",
            service_backend_options={"checkpoint_path": "p"},
        )
    assert ray.is_initialized() == running


ray_runtime = ray_runtime_fixture()


class _Writer:
    def __init__(self, client):
        self.client = client

    def extend(self, w, start):
        try:
            return self.client.extend(_tagged(w, start)).tolist()
        except ServiceInterrupted:
            return "interrupted"


def test_a_killed_ray_transport_service_resumes_from_its_checkpoint(ray_runtime, tmp_path):
    ray = ray_runtime
    rb = ReplayBuffer(
        storage=partial(LazyTensorStorage, 100),
        batch_size=4,
        service_backend="ray",
        checkpoint_every={"items": 16},
        checkpoint_path=str(tmp_path),
        service_backend_options={"remote_config": REMOTE},
    )
    try:
        assert isinstance(rb, RayReplayBuffer) and rb.stats()["restored"] is None
        writer = ray.remote(num_cpus=0)(_Writer).remote(rb.client())
        for start in (0, 8, 16):
            assert ray.get(writer.extend.remote(0, start)) == list(range(start, start + 8))
        kill_actor(ray, rb._client._actor)  # 16 items checkpointed, 8 not
        assert len(rb) == 16  # (a read: waits for the restart, then is served)
        restored = rb.stats()["restored"]
        assert restored["items"] == 16 and restored["path"].endswith("ckpt-0000000001")
        assert _pairs(rb[:16]) == [(0, s) for s in range(16)]
        assert ray.get(writer.extend.remote(1, 0)) == list(range(16, 24))  # the writer goes on
        assert rb.sample().shape == (4,) and rb.write_count == 24
    finally:
        rb.close()
    assert not rb.is_alive


def test_a_killed_distributed_service_reconnects_and_runs_no_pickle(ray_runtime, tmp_path):
    ray = ray_runtime
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100),
        batch_size=4,
        transport="distributed",
        transport_options={"timeout": 30.0},
        checkpoint_every={"items": 16},
        checkpoint_path=str(tmp_path),
        remote_config=REMOTE,
    )
    marker = tmp_path / "ran"
    try:
        for start in (0, 8, 16):
            rb.extend(_tagged(0, start))
        # a stranger who learned the store's address and a connection's name
        info = runtime.call(rb._client._actor, "distributed_connect", where="stranger")
        stranger = dist.TCPStore(
            *info["address"], is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        crafted = pickle.dumps(_Marker(str(marker)))
        for key in (f"frb/{info['grant']['connection']}/req", "frb/0/req"):
            stranger.queue_push(key, crafted)
        stranger.add("sync", 1)
        assert rb.sample().shape == (4,) and len(rb) == 24  # served as before
        kill_actor(ray, rb._client._actor)
        assert len(rb) == 16  # reconnected to the restarted actor (a read, sent again)
        assert rb.stats()["restored"]["write_count"] == 16
        rb.extend(_tagged(1, 0))  # writes go on, over a new connection
        assert _pairs(rb[16:24]) == [(1, s) for s in range(8)]
        assert not marker.exists()
    finally:
        rb.close()


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")
