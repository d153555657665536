"""A local Ray runtime for the service tests: 2 CPUs, loopback only, no dashboard.

Ray binds its services to the machine's reachable address unless it believes clusters are
disabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` on Linux); the tests must listen on
127.0.0.1 only, so the flag is set in the environment (for the worker processes) and, because
another test module may have imported Ray already (torchrl imports it), on Ray's constants too.

A test module takes the runtime as a module-scoped fixture (``ray_runtime_fixture``): one
runtime per module, the module's functions shipped to the workers.
"""

import contextlib
import os
import signal

import pytest

ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def local_ray(num_cpus: int = 2, ship=None):
    """A local Ray runtime on 127.0.0.1; ``ship``: a test module whose functions the workers
    receive by value (they cannot import a test module)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "0"
    import ray
    from ray._private import ray_constants

    old_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.shutdown()
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        if ship is not None:
            ray.cloudpickle.register_pickle_by_value(ship)
        yield ray
    finally:
        if ship is not None:
            ray.cloudpickle.unregister_pickle_by_value(ship)
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def ray_runtime_fixture():
    """A module-scoped pytest fixture: a local Ray runtime (2 CPUs) for the test module that
    holds it, whose functions the workers receive by value (``ray_runtime =
    ray_runtime_fixture()`` in the module)."""

    @pytest.fixture(scope="module")
    def ray_runtime(request):
        with local_ray(num_cpus=2, ship=request.module) as ray:
            yield ray

    return ray_runtime


def kill_actor(ray, actor):
    """SIGKILL the process of a Ray actor (Ray restarts it if its ``max_restarts`` allows)."""
    os.kill(ray.get(actor.__ray_call__.remote(lambda body: os.getpid())), signal.SIGKILL)
