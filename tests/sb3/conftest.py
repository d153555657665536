"""SB3 writes a logger directory for every ``learn`` (``$SB3_LOGDIR``, else a new
``/tmp/SB3-<time>``): the tests' go to one temporary directory that pytest removes."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _sb3_logs_in_a_temporary_directory(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3_logs")))
        yield
