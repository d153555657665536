"""TorchRL's ``transport="distributed"`` for Ray-hosted buffers, and the scoped defaults
``service_backend(...)`` / ``transport_backend(...)``.

One local Ray runtime (2 CPUs, loopback) for the module. Two Ray actors extend through
distributed-transport clients while the driver samples: every item arrives exactly once and in
its writer's order, beside TorchRL's own RayReplayBuffer(transport="distributed") doing the
same. Layout binding (a call of another layout raises before sending), the options, priorities
over the wire, a timeout, an actor that dies mid-call (a clear error, no hang), shutdown
releasing every thread; the contexts' precedence, nesting and per-process scoping, case by case
against TorchRL's own contexts.
"""

import os
import pickle
import threading
import time
from functools import partial

import pytest
import torch
from _ray_local import ray_runtime_fixture
from tensordict import TensorDict

from functional_rb.adapters import (
    LazyTensorStorage,
    RayReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    service_backend,
    transport_backend,
)
from functional_rb.adapters.comm import backends
from functional_rb.adapters.comm.distributed import ChannelClient, ChannelServer, ServiceGone
from functional_rb.adapters.comm.message_layout import flatten
from functional_rb.adapters.comm.replay_service import ReplayService, check_options

pytestmark = pytest.mark.heavy

REMOTE = {"num_cpus": 0}  # the actors share the 2 CPUs of the local runtime
OPTIONS = {"timeout": 30.0}


ray_runtime = ray_runtime_fixture()


def _tagged(w, start, n):  # (writer id, sequence number) per item
    return TensorDict(
        {"w": torch.full((n,), w), "seq": torch.arange(start, start + n)}, batch_size=[n]
    )


class _Writer:
    def __init__(self, client):
        self.client = client

    def run(self, w, n, chunk):
        for start in range(0, n, chunk):
            self.client.extend(_tagged(w, start, chunk), timeout=30.0)
        return len(self.client)


class _SleepOnce:  # a transform, in the actor: the first sample after it takes 3 s
    slept = False

    def __call__(self, data):
        if not self.slept:
            self.slept = True
            time.sleep(3.0)
        return data


def _die(data):
    os._exit(1)


@pytest.fixture(scope="module")
def dist_rb(ray_runtime):
    """One distributed-transport buffer for the module's Ray tests (in file order; the last
    kills its actor). extend_spec binds extend's layout up front."""
    with service_backend("ray"), transport_backend("distributed"):
        rb = TensorDictPrioritizedReplayBuffer(
            alpha=0.7,
            beta=0.5,
            storage=LazyTensorStorage(100),
            batch_size=8,
            service_backend_options={"remote_config": REMOTE},
            transport_options=dict(OPTIONS, extend_spec=_tagged(0, 0, 8)),
        )
    yield rb
    rb.shutdown()
    assert not rb.is_alive


def _torchrl_buffer():
    from torchrl import service_backend as t_service
    from torchrl import transport_backend as t_transport
    from torchrl.data import LazyTensorStorage as TStorage
    from torchrl.data import ReplayBuffer as TReplayBuffer

    with t_service("ray"), t_transport("distributed"):
        return TReplayBuffer(
            storage=partial(TStorage, 100),
            batch_size=8,
            service_backend_options={"remote_config": REMOTE},
            transport_options=OPTIONS,
        )


def _two_writers_and_a_sampler(ray, rb):
    """2 actors x 32 items in chunks of 8 through distributed clients while the driver
    samples; the (writer, seq) pairs of the first 72 stored items."""
    client = rb.client()
    assert not hasattr(client, "shutdown") and not hasattr(client, "close")
    assert client.extend(_tagged(9, 0, 8), timeout=30.0).tolist() == list(range(8))
    writers = [ray.remote(num_cpus=0)(_Writer).remote(c) for c in rb.clients(2)]
    refs = [a.run.remote(w, 32, 8) for w, a in enumerate(writers)]
    seen = 0
    while len(ray.wait(refs, num_returns=2, timeout=0)[0]) < 2 or seen == 0:
        batch = client.sample(timeout=30.0)
        assert batch.shape == (8,) and ((batch["w"] < 2) | (batch["w"] == 9)).all()
        seen += 1
    assert all(n >= 40 for n in ray.get(refs))
    assert len(client) == 72 and client.write_count == 72 and rb.write_count == 72
    with pytest.raises((RuntimeError, ValueError)):  # bound by the first call, any client
        client.extend(_tagged(0, 0, 4), timeout=30.0)
    with pytest.raises((RuntimeError, ValueError)):
        client.sample(4, timeout=30.0)
    with pytest.raises(RuntimeError, match="transport='ray'"):
        client.update_if_present(index=torch.zeros(1), generation=torch.zeros(1), patch={})
    for actor in writers:
        ray.kill(actor)
    # (read through Ray: TorchRL's distributed client has no rb[...])
    stored = (
        rb.state_dict()["_storage"]["_storage"] if rb.__module__.startswith("torchrl") else rb[:72]
    )
    return list(zip(stored["w"][:72].tolist(), stored["seq"][:72].tolist()))


def _check_pairs(pairs):
    assert sorted(pairs) == [(w, s) for w in (0, 1) for s in range(32)] + [(9, s) for s in range(8)]
    for w in (0, 1):  # each writer's items in its order
        assert [s for ww, s in pairs if ww == w] == list(range(32))


def test_two_actors_extend_while_the_driver_samples(ray_runtime, dist_rb):
    assert dist_rb.transport_kind == "distributed" and isinstance(dist_rb, RayReplayBuffer)
    _check_pairs(_two_writers_and_a_sampler(ray_runtime, dist_rb))


@pytest.mark.slow
def test_torchrl_does_the_same(ray_runtime):
    """TorchRL's own RayReplayBuffer(transport="distributed"), the same run: the same items."""
    rb = _torchrl_buffer()
    try:
        _check_pairs(_two_writers_and_a_sampler(ray_runtime, rb))
    finally:
        rb.shutdown()


def test_layouts_and_priorities(dist_rb):
    """Errors name what differs; key order does not matter; priorities travel both ways."""
    rb = dist_rb
    with pytest.raises(
        ValueError,
        match=r"expected \['seq'\]: int64\[8\], got "
        r"\['seq'\]: float32\[8\]",
    ):
        rb.extend(_tagged(0, 0, 8).set("seq", torch.zeros(8)))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \[\"\['extra'\]\"\]"):
        rb.extend(_tagged(0, 0, 8).set("extra", torch.zeros(8)))
    with pytest.raises(TypeError, match="sends tensors.*use transport='ray'"):
        rb.extend({"w": "text"})
    data = TensorDict({"seq": torch.arange(100, 108), "w": torch.full((8,), 5)}, [8])
    assert rb.extend(data).tolist() == list(range(72, 80))  # (keys in another order)
    assert rb.add(_tagged(6, 0, 1)[0]) == 80 and len(rb) == 81
    assert rb.stats()["capacity"] == 100 and rb.stats()["size"] == 81
    # all the mass on item 7, then priorities given back with a sample
    priority = torch.full((81,), 1e-8)
    priority[7] = 1e3
    rb.update_priority(torch.arange(81), priority)
    sample = rb.sample()
    assert (sample["index"] == 7).all() and sample["seq"].shape == (8,)
    sample.set("td_error", torch.full((8,), 1e-6))
    rb.update_priority(sample)  # a single TensorDict: update_tensordict_priority
    assert (rb.sample()["index"] != 7).any()  # now uniform: all 8 on item 7 has p ~ 1e-15


def test_timeout_then_an_actor_that_dies(dist_rb):
    """A call past its timeout raises TimeoutError and the next call still works; an actor
    dying mid-call gives a RuntimeError within the timeout, not a hang. (Last: it kills the
    module's buffer.)"""
    rb = dist_rb
    rb.append_transform(_SleepOnce())  # (through Ray: a control call)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no reply within the timeout"):
        rb.sample(timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert rb.sample(timeout=30.0).shape == (8,)  # (after the late reply is read)
    rb.append_transform(_die)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="actor hosting the buffer is dead"):
        rb.sample(timeout=20.0)
    assert time.monotonic() - t0 < 20.0


def test_options_and_backends_fail_clearly():
    with pytest.raises(TypeError, match=r"unexpected distributed transport_options \['port'\]"):
        check_options({"port": 1}, "RayReplayBuffer")
    with pytest.raises(ValueError, match="'gloo' .* or 'nccl'"):
        check_options({"backend": "mpi"}, "RayReplayBuffer")
    with pytest.raises(ValueError, match="positive number"):
        check_options({"timeout": 0}, "RayReplayBuffer")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'nccl' moves CUDA tensors.*backend='gloo'"):
            ReplayService(
                ReplayBuffer(), threading.Lock(), host="127.0.0.1", where="rb", backend="nccl"
            )
    with pytest.raises(ValueError, match="transport_options are not used"):
        RayReplayBuffer(transport="ray", transport_options={"timeout": 3})


# ---------------------------------------------------------------------- scoped backends
def _outcome(rb_cls, build):
    """The built buffer's backend, or which context an error blames."""
    try:
        return build(rb_cls).service_backend
    except ValueError as e:
        return (
            "error"
            + (" [service ctx]" if "service_backend context" in str(e) else "")
            + (" [transport ctx]" if "transport_backend context" in str(e) else "")
        )


def _cases(service, transport):
    return {
        "service direct": lambda cls: _in(service("direct"), lambda: cls()),
        "explicit wins": lambda cls: _in(
            service("threading"), lambda: cls(service_backend="direct")
        ),
        "alias refused": lambda cls: _in(service("threading"), lambda: cls()),
        "transport refused": lambda cls: _in(transport("distributed"), lambda: cls()),
        "transport explicit": lambda cls: _in(
            transport("distributed"), lambda: cls(transport="auto")
        ),
        "nested inner": lambda cls: _in(
            service("rpc"), lambda: _in(service("direct"), lambda: cls())
        ),
        "nested restores": lambda cls: _in(
            service("rpc"), lambda: [_in(service("direct"), lambda: cls()), cls()][1]
        ),
    }


def _in(ctx, fn):
    with ctx:
        return fn()


def test_scoped_backends_match_torchrl():
    from torchrl import service_backend as t_service
    from torchrl import transport_backend as t_transport
    from torchrl.data import ReplayBuffer as TReplayBuffer

    ours = {
        k: _outcome(ReplayBuffer, f) for k, f in _cases(service_backend, transport_backend).items()
    }
    theirs = {k: _outcome(TReplayBuffer, f) for k, f in _cases(t_service, t_transport).items()}
    assert ours == theirs
    assert ours["explicit wins"] == "direct" and "[transport ctx]" in ours["transport refused"]
    assert "[service ctx]" in ours["alias refused"]
    for bad in (lambda: service_backend("bogus"), lambda: transport_backend("bogus")):
        with pytest.raises(ValueError, match="Unsupported"):
            bad().__enter__()


def test_scoped_backends_stay_in_their_process_and_context():
    with service_backend("ray"), transport_backend("distributed"):
        assert backends.current_service_backend() == "ray"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(backends.current_service_backend()))
        thread.start()
        thread.join()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no context, a direct buffer builds
            try:
                out = (
                    backends.current_service_backend(),
                    backends.current_transport_backend(),
                    ReplayBuffer().service_backend,
                )
            except BaseException as e:
                out = repr(e)
            os.write(write, pickle.dumps(out))
            os._exit(0)
        os.close(write)
        child = pickle.loads(os.read(read, 4096))
        os.waitpid(pid, 0)
        os.close(read)
    assert seen == [None]  # a new thread starts with a fresh context
    assert child == (None, None, "direct")
    assert backends.current_service_backend() is None


# ---------------------------------------------------------------------- the channel itself
class _Double:
    def __init__(self, layout):
        self.layout = layout

    def request_layout(self, op):
        return self.layout

    def handle(self, op, value):
        if op == "fail":
            raise KeyError("no such thing")
        return {"doubled": value * 2, "total": int(value.sum()), "note": "constant"}


def test_channel_replies_and_close_ends_every_thread():
    layout = flatten(torch.zeros(3), where="test", strict=True)[1]
    server = ChannelServer(
        _Double(layout), host="127.0.0.1", backend="gloo", timeout=10.0, name="frbtest"
    )
    client = ChannelClient(
        server.address,
        server.accept(),
        host="127.0.0.1",
        backend="gloo",
        timeout=10.0,
        alive=lambda: True,
        name="frbtest",
    )
    for _ in range(2):
        out = client.call("x", [torch.arange(3.0)], timeout=10.0)
        assert out["doubled"].tolist() == [0.0, 2.0, 4.0] and out["total"] == 3
        assert out["note"] == "constant" and isinstance(out["total"], int)
    with pytest.raises(KeyError, match="no such thing"):  # the handler's error, as itself
        client.call("fail", [torch.arange(3.0)], timeout=10.0)
    server.accept()  # a connection nobody opens: its thread ends with close() too
    assert server.close() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("frbtest")]
    with pytest.raises(ServiceGone, match="unreachable"):
        client.call("x", [torch.arange(3.0)], timeout=5.0)
    client.close()
