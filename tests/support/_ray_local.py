"""A local Ray runtime for the service tests: 2 CPUs, loopback only, no dashboard.

Ray binds its services to the machine's reachable address unless it believes clusters are
disabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` on Linux); the tests must listen on
127.0.0.1 only, so the flag is set in the environment (for the worker processes) and, because
another test module may have imported Ray already (torchrl imports it), on Ray's constants too.
"""

import contextlib
import os

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
