"""Runs ``tests/core/sharded/eight_devices`` (sharded buffers on 8 CPU devices) in a child process whose JAX starts
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``: the flag must be set before JAX's
backend starts, and this process keeps its single device for the rest of the suite (see
``eight_devices/conftest.py``)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[3]
EIGHT = pathlib.Path(__file__).resolve().with_name("eight_devices")
FLAG = "--xla_force_host_platform_device_count=8"


def test_sharded_tests_pass_on_eight_devices():
    if FLAG in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("this process has 8 devices: eight_devices/ is collected and run directly")
    # XLA's backend optimizations off: these tests check values, not speed, and it halves
    # the compile time that dominates them
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join(
            [os.environ.get("XLA_FLAGS", ""), FLAG, "--xla_backend_optimization_level=0"]
        ).strip(),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-n",
            "0",
            str(EIGHT),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"tests/core/sharded/eight_devices failed on 8 devices:\n{out}"
    assert " passed" in proc.stdout, out
