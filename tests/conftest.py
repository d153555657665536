"""Test configuration: strict promotion so that silent broadcasting bugs fail, and hypothesis
profiles sized for a 2-core CI machine."""

import gc
import os
import sys
from pathlib import Path

# `python -m pytest` puts the checkout first on sys.path. Move it to the end so that the
# installed functional_rb (what CI builds from pyproject: a wheel, or an editable install) is
# the one tested, and a module left out of the package list fails here; without an install the
# checkout is imported (functional_rb/adapters links to adapters/, so it is whole either way).
_ROOT = Path(__file__).resolve().parents[1]
if "functional_rb" not in sys.modules:
    _here = [p for p in sys.path if Path(p or os.getcwd()).resolve() == _ROOT]
    sys.path[:] = [p for p in sys.path if p not in _here] + _here

# helpers shared by test modules in several folders (a local HTTP server for the dataset
# loaders, TED streams): importable by their module names
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# the suite leaves the user's JAX compilation cache (~/.cache/functional_rb/jax) alone; the
# cache's own tests turn it on in subprocesses with a temporary directory
os.environ.setdefault("FRB_COMPILATION_CACHE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    # derandomize: CI runs the same examples every time (a red build is reproducible); raise
    # FRB_HYPOTHESIS_EXAMPLES or set FRB_HYPOTHESIS_RANDOM=1 locally to search wider.
    "ci",
    max_examples=int(os.environ.get("FRB_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    derandomize=not os.environ.get("FRB_HYPOTHESIS_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")


@pytest.fixture(scope="module", autouse=True)
def _free_executables():
    """Every compiled executable keeps memory mappings; one process running the whole suite
    would pass the kernel's limit of 65,530 (XLA then crashes compiling). Drop them between
    modules."""
    yield
    from functional_rb._internal import eager as _eager
    from functional_rb._internal import host_calls as _host_calls

    _eager.clear_cache()
    _host_calls.clear_cache()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _seed_torch():
    """The adapters draw from torch's global generator, as TorchRL does. Each test starts it
    from the same seed, so that a statistical test's draws do not depend on which tests ran
    before it in its worker (one that was not seeded failed 2 of 150 seeds, as its threshold
    predicts)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Run a test's buffer functions both without and under jax.jit."""
    if request.param:
        return jax.jit
    return lambda f, **kw: f


def pytest_collection_modifyitems(config, items):
    """``heavy`` modules are collected first; ``@pytest.mark.slow`` tests (the long versions of
    fault-injection and statistical runs) run only with FRB_SLOW=1; each has a short version
    that CI runs."""
    # ``heavy`` modules first: with --dist loadfile a module runs whole on one worker, and
    # one of these started last would keep the suite waiting on it alone
    items.sort(key=lambda item: "heavy" not in item.keywords)
    if os.environ.get("FRB_SLOW"):
        return
    skip = pytest.mark.skip(reason="long version: run with FRB_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
