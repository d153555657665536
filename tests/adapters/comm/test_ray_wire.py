"""The distributed transport lets no one in and executes nothing from the wire (no Ray here:
a ChannelServer serving a real buffer in this process, its clients and a raw TCPStore client
playing the stranger, all on 127.0.0.1).

- The wire format: frames and layouts round-trip; any other bytes (random, truncated,
  oversized, bit-flipped, wrongly typed, tagged with another key) raise ProtocolError and
  nothing else (hypothesis); sizes are refused before anything is allocated; errors travel as
  a type name and a message.
- The server: a stranger's frames, a fuzzing client's bad headers and altered payloads drop
  that connection only; the other client keeps being served and the buffer's data does not
  change. A crafted pickle pushed into every queue runs nothing. A client with the wrong
  secret is refused (PermissionError), and the refusal is logged. The store and the gloo
  pairs listen on 127.0.0.1 only.
"""

import contextlib
import json
import logging
import os
import pickle
import struct
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from functional_rb.adapters import LazyTensorStorage, ReplayBuffer
from functional_rb.adapters.comm import wire
from functional_rb.adapters.comm.distributed import ChannelClient, ServiceGone
from functional_rb.adapters.comm.message_layout import flatten, from_wire, to_wire, unflatten
from functional_rb.adapters.comm.replay_service import ReplayService

HOST = "127.0.0.1"
KEY = b"k" * 32


def _items(start, n=4):
    return TensorDict(
        {
            "seq": torch.arange(start, start + n),
            "obs": torch.arange(start, start + n).float().unsqueeze(-1) * 2,
        },
        [n],
    )


# ---------------------------------------------------------------------- the wire format
def test_frames_round_trip_and_every_check_fires():
    frame = wire.encode(wire.REQUEST, {"seq": 3, "op": "extend"}, KEY)
    assert wire.decode(frame, KEY, (wire.REQUEST,)) == (wire.REQUEST, {"seq": 3, "op": "extend"})
    cases = {
        "must be bytes": "not bytes",
        "truncated": frame[:20],
        "exceeds the limit": frame[:10] + b" " * (wire.MAX_BODY + 1) + frame[-32:],
        "bad magic": b"XXXX" + frame[4:],
        "wire version 9": frame[:4] + bytes([9]) + frame[5:],
        "where \\['REPLY'\\]": frame,
        "declares a body of": frame[:6] + struct.pack(">I", 3) + frame[10:],
        "tag does not match": frame[:-1] + bytes([frame[-1] ^ 1]),
    }
    for match, bad in cases.items():
        kinds = (wire.REPLY,) if "REPLY" in match else (wire.REQUEST,)
        with pytest.raises(wire.ProtocolError, match=match):
            wire.decode(bad, KEY, kinds)
    with pytest.raises(wire.ProtocolError, match="tag does not match"):
        wire.decode(frame, b"another key", (wire.REQUEST,))
    # a body that is not a JSON object, or not JSON, even when tagged with the right key
    for body in (b"[1, 2]", b"\xff\xfe", b"{" * 100_000):
        head = struct.pack(">4sBBI", b"FRBW", 1, wire.REQUEST, len(body)) + body
        import hashlib
        import hmac

        tagged = head + hmac.new(KEY, head, hashlib.sha256).digest()
        with pytest.raises(wire.ProtocolError):
            wire.decode(tagged, KEY, (wire.REQUEST,))


@given(st.binary(max_size=300))
def test_random_bytes_are_only_ever_a_protocol_error(data):
    with pytest.raises(wire.ProtocolError):
        wire.decode(data, KEY, tuple(wire.KIND_NAMES))


@given(st.integers(0, 10**6), st.data())
def test_any_flipped_bit_is_refused(position, data):
    frame = wire.encode(wire.REPLY, {"seq": 1, "status": "ok", "layout": None}, KEY)
    bit = data.draw(st.integers(0, 7))
    i = position % len(frame)
    damaged = frame[:i] + bytes([frame[i] ^ (1 << bit)]) + frame[i + 1 :]
    with pytest.raises(wire.ProtocolError):
        wire.decode(damaged, KEY, (wire.REPLY,))


def test_layouts_round_trip_as_json_and_refuse_what_cannot_travel():
    values = [
        _items(0),
        (torch.arange(3), {"n": 1, "x": 2.5, "s": "text", "z": None}),
        [torch.zeros(2, dtype=torch.bfloat16), True],
        None,
    ]
    for value in values:
        tensors, layout = flatten(value, where="t", strict=False)
        back = from_wire(json.loads(json.dumps(to_wire(layout))))
        assert back == layout
        assert pickle.loads(pickle.dumps(layout)) == layout  # (Ray carries bound layouts)
        again = unflatten(tensors, back)
        assert type(again) is type(value)
    with pytest.raises(TypeError, match=r"\['a'\]: a object .*Use transport='ray'"):
        to_wire(flatten({"a": object()}, where="t", strict=False)[1])
    with pytest.raises(TypeError, match="non-string keys"):
        to_wire(flatten({1: torch.zeros(1)}, where="t", strict=False)[1])


def test_layout_sizes_and_fields_are_checked_before_allocating():
    good = to_wire(flatten(torch.zeros(3), where="t", strict=True)[1])
    huge = json.loads(json.dumps(good))
    huge["leaves"][0]["shape"] = [2**40, 2**40]
    with pytest.raises(wire.ProtocolError, match="exceeds the limit"):
        from_wire(huge)
    bad = {
        "leaves missing": {"spec": None},
        "unknown dtype": {"spec": None, "leaves": [dict(good["leaves"][0], dtype="object")]},
        "a shape must be": {"spec": None, "leaves": [dict(good["leaves"][0], shape=[-1])]},
        "unknown kind": {"spec": None, "leaves": [dict(good["leaves"][0], kind="pickle")]},
        "unknown layout node": {
            "spec": {"node": "os.system", "children": [None]},
            "leaves": good["leaves"],
        },
        "2 leaves": {"spec": {"node": "list", "children": [None, None]}, "leaves": good["leaves"]},
        "nested at most": {"spec": _nested(40), "leaves": good["leaves"]},
    }
    for match, data in bad.items():
        with pytest.raises(
            wire.ProtocolError, match=match if match != "leaves missing" else "field 'leaves'"
        ):
            from_wire(data)


def _nested(depth):
    node = None
    for _ in range(depth):
        node = {"node": "list", "children": [node]}
    return node


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "spec",
                        "leaves",
                        "node",
                        "children",
                        "keys",
                        "path",
                        "kind",
                        "shape",
                        "dtype",
                        "value",
                    ]
                ),
                c,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
)
def test_random_layouts_are_a_layout_or_a_protocol_error(data):
    with contextlib.suppress(wire.ProtocolError):
        from_wire(data)


def test_errors_travel_as_a_type_name_and_a_message():
    for error, cls in (
        (KeyError("no such key"), KeyError),
        (ValueError("bad"), ValueError),
        (OSError("disk"), OSError),
    ):
        body = wire.error_body(error)
        again = wire.remote_exception(body["type"], body["message"])
        assert type(again) is cls and str(error.args[0]) in str(again)

    class CustomError(Exception):
        pass

    again = wire.remote_exception(
        **dict(zip(("type_name", "message"), wire.error_body(CustomError("x")).values()))
    )
    assert isinstance(again, wire.RemoteError) and again.type_name == "CustomError"
    # a name that is not a built-in error never becomes a class
    assert isinstance(wire.remote_exception("SystemExit", "bye"), wire.RemoteError)
    assert isinstance(wire.remote_exception("os.system", "x"), wire.RemoteError)


# ---------------------------------------------------------------------- the server
@pytest.fixture
def service():
    """A ReplayService over a real buffer holding 8 items, extend bound to 4 items."""
    rb = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)
    rb.extend(_items(0, 8))
    svc = ReplayService(
        rb, threading.RLock(), host=HOST, where="svc", timeout=10.0, extend_spec=_items(0)
    )
    svc.bind("sample", 4)  # (a client binds it through Ray before its first sample)
    yield svc, rb
    assert svc.close() == []


def _client(svc, grant=None):
    info = svc.connect()
    return ChannelClient(
        info["address"],
        grant or info["grant"],
        host=HOST,
        backend="gloo",
        timeout=10.0,
        alive=lambda: True,
        name="client",
    )


def _extend(client, start):
    tensors, _ = flatten(_items(start), where="t", strict=True)
    return client.call("extend", tensors, timeout=10.0)


def _stranger(svc):
    return dist.TCPStore(
        HOST,
        svc.connect()["address"][1],
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )


def _push(stranger, key, frame):
    """Push, then a round trip on the same connection: the store has the frame now."""
    stranger.queue_push(key, frame)
    stranger.add("frb-test/sync", 1)


def _contents(rb):
    return rb[: len(rb)].clone(), len(rb), rb.write_count


def _same(a, b):
    assert a[1:] == b[1:] and (a[0] == b[0]).all()


class _Marker:
    """A pickle whose unpickling creates a file: the proof that something ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_stranger_frames_drop_one_connection_only(service, caplog):
    """A raw store client pushes bad frames into an established connection's request queue:
    truncated, oversized, wrongly typed, random, tagged with another key. Each drops that
    connection (logged), the other client is served, the data does not change."""
    svc, rb = service
    caplog.set_level(logging.WARNING)
    stranger, other = _stranger(svc), _client(svc)
    _extend(other, 100)
    before = _contents(rb)
    forged = wire.encode(
        wire.REQUEST, {"seq": 0, "op": "extend", "tensors": [], "digest": ""}, b"guessed key"
    )
    frames = [
        b"",
        b"FRBW\x01",
        os.urandom(64),
        b"x" * (2 * wire.MAX_BODY),
        forged,
        json.dumps({"op": "extend", "seq": 0}).encode(),
        pickle.dumps(("extend", 0)),
    ]
    for frame in frames:
        victim = _client(svc)
        _push(stranger, f"frb/{victim._connection}/req", frame)
        with pytest.raises(ServiceGone, match="dropped this connection"):
            victim.call("sample", [], timeout=10.0)
        victim.close()
        assert other.call("sample", [], timeout=10.0)["seq"].shape == (4,)
    _same(before, _contents(rb))
    assert svc._server.rejected == len(frames)
    assert sum("dropped:" in r.getMessage() for r in caplog.records) == len(frames)
    other.close()


def test_a_fuzzing_client_with_the_keys_cannot_change_the_data(service, caplog):
    """A client holding the connection's keys sends a replayed header, an unknown op,
    wrongly typed fields, announced tensors of another layout (10^12 elements: refused
    before allocating) and a payload altered after its digest; each ends its connection
    with nothing applied, and the other client goes on."""
    svc, rb = service
    caplog.set_level(logging.WARNING)
    other = _client(svc)
    before = _contents(rb)

    def push(client, body, tensors=()):
        client._store.queue_push(
            f"frb/{client._connection}/req", wire.encode(wire.REQUEST, body, client._c2s)
        )
        for tag, t in enumerate(tensors):
            client._group.send([t], 0, tag).wait()

    tensors, _ = flatten(_items(500), where="t", strict=True)
    announced = wire.describe_tensors(tensors)
    cases = {
        "was due": lambda c: push(c, {"seq": 7, "op": "extend", "tensors": announced}),
        "no operation 'drop_all'": lambda c: push(c, {"seq": 0, "op": "drop_all", "tensors": []}),
        "field 'seq'": lambda c: push(c, {"seq": "0", "op": "extend", "tensors": announced}),
        "field 'op'": lambda c: push(c, {"seq": 0, "op": ["extend"], "tensors": announced}),
        "announces tensors": lambda c: push(
            c, {"seq": 0, "op": "extend", "tensors": [["int64", [10**12]]] * 2, "digest": "0"}
        ),
        "expected 64 hex digits": lambda c: push(
            c, {"seq": 0, "op": "extend", "tensors": announced, "digest": "é" * 64}
        ),
        "does not match its header's digest": lambda c: push(
            c,
            {
                "seq": 0,
                "op": "extend",
                "tensors": announced,
                "digest": wire.digest(c._c2s, 0, tensors),
            },
            [t + 1 for t in tensors],
        ),
    }
    for match, attack in cases.items():
        fuzzer = _client(svc)
        attack(fuzzer)
        with pytest.raises(ServiceGone, match="dropped this connection"):
            fuzzer._pending = (0, "x", [], [])
            fuzzer._reply(None)
        assert any(match in r.getMessage() for r in caplog.records), match
        fuzzer.close()
        _same(before, _contents(rb))
        assert other.call("sample", [], timeout=10.0)["seq"].shape == (4,)
    assert _extend(other, 200).tolist() == list(range(8, 12))  # still served, and writing
    other.close()


def test_a_crafted_pickle_runs_nowhere(service, tmp_path, caplog):
    """The pickle goes into a fresh grant's hello slot, an established connection's request
    and reply queues, and the keys an older version read: no file appears, the client and
    the server only see broken frames, and the service keeps serving."""
    svc, rb = service
    caplog.set_level(logging.WARNING)
    marker = tmp_path / "ran"
    crafted = pickle.dumps(_Marker(str(marker)))
    stranger = _stranger(svc)
    fresh = svc.connect()
    _push(stranger, f"frb/{fresh['grant']['connection']}/req", crafted)
    with pytest.raises(PermissionError, match="refused"):
        ChannelClient(
            fresh["address"],
            fresh["grant"],
            host=HOST,
            backend="gloo",
            timeout=10.0,
            alive=lambda: True,
            name="late client",
        )
    victim = _client(svc)
    _push(stranger, f"frb/{victim._connection}/rep", crafted)  # to the client
    with pytest.raises(ServiceGone, match="breaks the wire format"):
        victim.call("sample", [], timeout=10.0)
    victim.close()
    victim = _client(svc)
    _push(stranger, f"frb/{victim._connection}/req", crafted)  # to the server
    with pytest.raises(ServiceGone, match="dropped"):
        victim.call("sample", [], timeout=10.0)
    for key in ("frb/0/req", "frb/1/rep"):
        _push(stranger, key, crafted)
    client = _client(svc)
    assert client.call("sample", [], timeout=10.0)["seq"].shape == (4,)
    client.close()
    assert not marker.exists()
    assert any("refused:" in r.getMessage() for r in caplog.records)


def test_a_client_with_the_wrong_secret_is_refused(service, caplog):
    svc, rb = service
    caplog.set_level(logging.WARNING)
    info = svc.connect()
    wrong = dict(info["grant"], secret=bytes(32))
    with pytest.raises(PermissionError, match="refused this connection .*tag does not match"):
        ChannelClient(
            info["address"],
            wrong,
            host=HOST,
            backend="gloo",
            timeout=10.0,
            alive=lambda: True,
            name="impostor",
        )
    assert svc._server.rejected == 1
    assert any("refused:" in r.getMessage() for r in caplog.records)
    stale = dict(svc.connect()["grant"], challenge=os.urandom(32))  # replaying a challenge
    with pytest.raises(PermissionError, match="another connection or challenge"):
        ChannelClient(
            info["address"],
            stale,
            host=HOST,
            backend="gloo",
            timeout=10.0,
            alive=lambda: True,
            name="replayer",
        )
    client = _client(svc)
    assert _extend(client, 300).tolist() == list(range(8, 12))
    assert repr(info["grant"]["secret"]) not in caplog.text  # the secret is never logged
    client.close()


def _listeners() -> dict[int, str]:
    """inode -> local address of this process's listening TCP sockets."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[9]) in mine:  # LISTEN
                    out[int(cols[9])] = cols[1].split(":")[0]
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_store_and_the_pairs_listen_on_the_address_asked_for():
    before = _listeners()
    rb = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    svc = ReplayService(rb, threading.RLock(), host=HOST, where="svc", timeout=10.0)
    client = _client(svc)
    new = {inode: addr for inode, addr in _listeners().items() if inode not in before}
    try:
        assert len(new) >= 2  # the store and the gloo pair's end
        loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
        assert set(new.values()) <= loopback, new
    finally:
        client.close()
        svc.close()
