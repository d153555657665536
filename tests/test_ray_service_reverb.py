"""benchmarks/ray_service.py's Reverb peer, without Reverb: the job both sides parse, the
exactly-once check, the merging of rounds, the subprocess's command line and the driver's
end of its line protocol (a stand-in peer speaks it)."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("tensordict")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name, file):
    # by path: the checkout's benchmarks/ is not an installed package
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("frb_ray_service", "ray_service.py")


@pytest.fixture(scope="module")
def peer():
    return _load("frb_reverb_peer", "_reverb_peer.py")


def test_exactly_once_counts_missing_duplicated_and_foreign_items(peer):
    every = [(w, s) for w in range(2) for s in range(3)]
    assert peer.exactly_once(every[::-1], 2, 3) == {
        "ok": True,
        "stored": 6,
        "missing": 0,
        "duplicates": 0,
    }
    assert peer.exactly_once(every[:-1], 2, 3) == {
        "ok": False,
        "stored": 5,
        "missing": 1,
        "duplicates": 0,
    }
    twice = every[:-1] + [every[0]]  # as many items as expected, one of them twice
    assert peer.exactly_once(twice, 2, 3) == {
        "ok": False,
        "stored": 6,
        "missing": 1,
        "duplicates": 1,
    }
    foreign = every[:-1] + [(2, 0)]  # a writer that does not exist
    assert peer.exactly_once(foreign, 2, 3)["duplicates"] == 1


def test_the_peer_gets_the_drivers_job(bench, peer):
    args = bench.parse_args(
        ["--obs-shape", "84,84", "--writers", "3", "--items", "128", "--both-rate", "5000"]
    )
    assert (args.obs_shape, args.obs_dtype, args.in_flight) == ((84, 84), "uint8", 256)
    got = peer.parse_args(peer.job_argv(args))
    names = ("writers", "items", "chunk", "batch", "obs_shape", "obs_dtype", "in_flight")
    for name in (*names, "both_rate"):
        assert getattr(got, name) == getattr(args, name), name
    default = bench.parse_args([])
    assert (default.obs_shape, default.obs_dtype) == ((64,), "float32")
    assert bench.REVERB not in default.peer_names  # no --reverb-python, no Reverb
    with_reverb = bench.parse_args(["--reverb-python", "/x/python"])
    assert with_reverb.peer_names[-1] == bench.REVERB


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--obs-shape", "84,0"], "--obs-shape: expected positive integers"),
        (["--items", "100", "--chunk", "64"], "--items (100) must be a multiple of --chunk"),
        (["--peers", "reverb"], "--peers: unknown ['reverb']"),
        (["--both-rate", "-1"], "--both-rate must be >= 0"),
    ],
)
def test_impossible_jobs_are_refused(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def _row(inserted, paths=("TrajectoryDataset", "client.sample"), ok=True):
    return {
        "inserted": inserted,
        "sampled": {p: 10.0 * (i + 1) for i, p in enumerate(paths)},
        "both_inserted": 1.0,
        "both_sampled": 2.0,
        "both_path": paths[0],
        "exactly_once": ok,
    }


def test_summarize_keeps_each_sample_path_and_every_check(bench):
    got = bench.summarize([_row(3.0), _row(1.0), _row(2.0, ok=False)])
    assert got["inserted"] == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}
    assert list(got["sampled"]) == ["TrajectoryDataset", "client.sample"]
    assert got["sampled"]["client.sample"]["median"] == 20.0
    assert got["exactly_once"] is False  # one round lost or doubled an item
    with pytest.raises(ValueError, match="round 1 sampled through"):
        bench.summarize([_row(1.0), _row(1.0, paths=("client.sample",))])


def test_reverb_runs_in_a_loopback_only_namespace(bench):
    cmd = bench.reverb_command("/venv/bin/python", ["--writers=2"])
    assert cmd[:3] == ["unshare", "--net", "--"]
    assert "ip link set lo up" in cmd[5]
    assert cmd[-3:] == [
        "/venv/bin/python",
        str(ROOT / "benchmarks" / "_reverb_peer.py"),
        "--writers=2",
    ]
    plain = bench.reverb_command("/venv/bin/python", [], isolate=False)
    assert plain == ["/venv/bin/python", str(ROOT / "benchmarks" / "_reverb_peer.py")]


STAND_IN = """
import json, sys
print("a log line that is not the protocol", flush=True)
print(json.dumps({"event": "ready", "argv": sys.argv[1:]}), flush=True)
for line in sys.stdin:
    if line.strip() == "round":
        print("{not json", flush=True)
        print(json.dumps({"event": "round", "row": {"inserted": 7.0}}), flush=True)
    elif line.strip() == "quit":
        break
    else:
        sys.exit(3)
"""


def test_the_driver_reads_the_peers_lines_past_its_logs(bench, tmp_path, monkeypatch):
    args = bench.parse_args(["--reverb-python", sys.executable, "--reverb-any-address"])
    monkeypatch.setattr(
        bench, "reverb_command", lambda python, argv, isolate: [python, "-c", STAND_IN, *argv]
    )
    p = bench.ReverbPeer(args, str(tmp_path / "reverb.log"))
    assert p.ready["argv"] == bench.job_argv(args)
    assert p.round() == {"inserted": 7.0} and p.round() == {"inserted": 7.0}
    p.close()
    assert p.proc.returncode == 0
    dead = bench.ReverbPeer(args, str(tmp_path / "dead.log"))
    dead.proc.stdin.write("nonsense\n")
    dead.proc.stdin.flush()
    with pytest.raises(RuntimeError, match=r"ended \(exit 3\) before its 'round' line"):
        dead._read("round")


def test_pace_holds_the_learner_to_its_rate(peer):
    """``--both-rate``: a learner drawing batches as ``pace`` allows draws at most the rate
    (a few batches' slack for the sleep's granularity), and draws freely without one."""
    import time

    assert peer.pace(time.perf_counter(), 10**9, 0.0) == 0.0
    start, drawn, rate = time.perf_counter(), 0, 20_000.0
    while time.perf_counter() - start < 0.3:
        wait = peer.pace(start, drawn, rate)
        if wait > 0:
            time.sleep(min(wait, 0.002))
        else:
            drawn += 256
    elapsed = time.perf_counter() - start
    assert drawn <= rate * elapsed + 256
    assert drawn >= 0.5 * rate * elapsed  # it does draw, near the rate
