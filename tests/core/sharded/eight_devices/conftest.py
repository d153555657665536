"""The tests of sharded buffers need 8 devices: JAX must start with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (read once, when its CPU backend starts).

How they run: in the main suite (one device, so the rest of the suite is unchanged), this
directory is not collected; ``tests/core/sharded/test_sharded_suite.py`` runs it in a child process that
starts with the flag. With the flag already set (``XLA_FLAGS=... python -m pytest tests/core/sharded/eight_devices``
or the whole suite), these tests are collected and run directly and the wrapper skips.
"""

import os

import pytest

FLAG = "--xla_force_host_platform_device_count=8"
ACTIVE = FLAG in os.environ.get("XLA_FLAGS", "")


def pytest_ignore_collect(collection_path, config):
    if not ACTIVE:
        return True
    return None


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    import jax

    assert jax.device_count() >= 8, (
        f"XLA_FLAGS has {FLAG} but JAX has {jax.device_count()} devices: its backend started "
        "before the flag was read."
    )
