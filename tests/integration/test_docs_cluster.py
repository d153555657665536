"""The cluster blocks of ``docs/distributed.md``, run as a user runs them, on this machine.

``tests/test_readme.py`` runs every Python block of the pages in its own process, where a
program guarded by ``if __name__ == "__main__"`` is only defined. Here the two cluster programs
run as printed, each after the page's own commands, with only what names another machine
replaced by this one (``HOST0_IP``, ``HEAD_IP`` -> ``127.0.0.1``, ``/shared`` and ``/data`` ->
a temporary folder) and fewer steps:

- "JAX on several hosts": ``train.py`` in two processes (``--process-id 0`` and ``1``), 4 CPU
  devices each, jax.distributed over loopback with gloo collectives; each writes its shards of
  one checkpoint, which is then read whole here.
- "TorchRL users: ``RayReplayBuffer``": a Ray cluster started with the page's ``ray start``
  commands (the head holds the ``replay`` resource, as the page's worker node does), then the
  program, which joins it with ``address="auto"``; then the cluster is stopped.
- "torch.distributed.rpc": ``rb_rpc.py`` on four ranks, as the page says to try it on one
  machine (``--master 127.0.0.1:PORT``, ``TP_SOCKET_IFNAME=lo``).

Together they start about ten processes on two cores: marked slow (CI
runs the blocks' code in one process through ``tests/test_readme.py``)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from _ranks import free_port, run_together

import functional_rb as frb

pytestmark = pytest.mark.slow

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
# Ray's command line, beside this Python (a virtual environment need not be on PATH)
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray") or "ray"


def _block(heading: str, lang: str, nth: int = 0) -> str:
    """The ``nth`` ```lang block under ``heading`` (a ``## `` line of the page)."""
    text = PAGE.read_text()
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)[nth]


def _replace(code: str, old: str, new: str) -> str:
    assert old in code, f"the page's block no longer has {old!r}: update this test"
    return code.replace(old, new)


def test_jax_multi_host_program_runs_on_two_processes(tmp_path):
    code = _block("JAX on several hosts", "python")
    port = free_port()
    code = _replace(code, "HOST0_IP:1234", f"127.0.0.1:{port}")
    code = _replace(code, '"/shared/ckpt/rb"', repr(str(tmp_path / "ckpt")))
    code = _replace(code, "range(1000)", "range(4)")
    (tmp_path / "train.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    # two hosts of 4 devices each, as the page says; CPU devices talk through gloo
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    )
    run_together(
        [[sys.executable, "train.py", "--process-id", str(i)] for i in range(2)],
        cwd=tmp_path,
        env=env,
    )
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "shards-0.bin" in files and "shards-1.bin" in files, files
    state = frb.checkpoint.load(tmp_path / "ckpt")
    # 4 steps of 32 rows per device on 8 devices, each device's rows in its own shard
    filled = np.asarray(state.shards.writer.filled)
    np.testing.assert_array_equal(filled, np.full(8, 4 * 32))


def _ray_status(port: int, env) -> str | None:
    out = subprocess.run(
        [RAY, "status", f"--address=127.0.0.1:{port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout if out.returncode == 0 else None


def test_ray_program_runs_on_a_cluster_started_as_the_page_says(tmp_path):
    pytest.importorskip("ray")
    commands = _block("A Ray cluster", "bash")
    assert "ray start --head --port=6379 --num-cpus=8" in commands
    code = _block("TorchRL users: `RayReplayBuffer`", "python")
    code = _replace(code, 'scratch_dir="/data/replay"', f"scratch_dir={str(tmp_path / 'r')!r}")
    code = _replace(code, "rb.clients(8)", "rb.clients(4)")
    code = _replace(code, "client, i, 1000)", "client, i, 20)")
    (tmp_path / "program.py").write_text(code)
    port = free_port()
    # loopback only (as tests/support/_ray_local.py keeps Ray), no token (the page's opt-out
    # for a private test network)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    # The head, with the worker node's "replay" resource (one machine: one node). Its own
    # temporary folder, so that no other Ray program on this machine finds it; --block, so
    # that stopping this command stops its processes and no other Ray's (`ray stop` would
    # stop every Ray on the machine).
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=8",
            "--resources",
            '{"replay": 1}',
            f"--temp-dir={temp}",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            "--include-dashboard=false",
            "--block",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        status = None
        while status is None or "replay" not in status:
            assert head.poll() is None and time.monotonic() < deadline, (
                f"ray start --head did not come up:\n{head.communicate(timeout=30)[0][-3000:]}"
            )
            time.sleep(1)
            status = _ray_status(port, env)
        out = subprocess.run(
            [sys.executable, "program.py"],
            cwd=tmp_path,
            env=dict(env, RAY_ADDRESS=f"127.0.0.1:{port}"),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        # rb.stats() as the program prints it: every item the collectors extended was written
        stats = out.stdout.strip().splitlines()[-1]
        assert "'write_count': 2560" in stats, stats
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_rpc_program_runs_on_four_ranks_as_the_page_says(tmp_path):
    # "To try it on one machine, start the four commands in four shells with --master
    # 127.0.0.1:29500 and TP_SOCKET_IFNAME=lo" (a free port here)
    commands = _block("torch.distributed.rpc", "bash")
    assert "python rb_rpc.py --rank 0 --world-size 4 --master A_IP:29500" in commands
    code = _block("torch.distributed.rpc", "python")
    code = _replace(code, 'scratch_dir="/data/replay"', f"scratch_dir={str(tmp_path / 'r')!r}")
    code = _replace(code, "args=(buffer, r, 1000))", "args=(buffer, r, 20))")
    (tmp_path / "rb_rpc.py").write_text(code)
    master = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    outs = run_together(
        [
            [sys.executable, "rb_rpc.py", "--rank", str(r), "--world-size", "4", "--master", master]
            for r in range(4)
        ],
        cwd=tmp_path,
        env=env,
    )
    # the trainer (rank 1) prints what the two collectors wrote: 2 x 20 extends of 64
    assert "2560 items written" in outs[1], outs[1][-2000:]
