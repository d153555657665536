"""Test configuration: strict promotion so that silent broadcasting bugs fail, and hypothesis
profiles sized for a 2-core CI machine."""

import gc
import os
import shutil
import subprocess
import sys
import tempfile
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
from _users_hlo import OLD_EMITTERS  # noqa: E402

# the suite leaves the user's JAX compilation cache (~/.cache/functional_rb/jax) alone; the
# cache's own tests turn it on in subprocesses with a temporary directory
os.environ.setdefault("FRB_COMPILATION_CACHE", "0")

# Compile time is most of the suite's time: thousands of small programs, each run a few times.
# - XLA's CPU compiler splits a program into LLVM modules that it compiles on parallel threads;
#   on two cores the split costs more than it saves (test_sum_tree 18% faster without it).
# - LLVM's optimizations (XLA's backend optimization level, 2 by default) make the machine code
#   faster, not different in what it computes: at level 0 the suite used 13% less CPU (19.5
#   against 22.5 minutes, every test passing). XLA's own passes over the program (fusion,
#   buffer assignment, donation) run as at any level.
# - XLA's older CPU emitters compile these programs in less time than its MLIR fusion emitters
#   (test_slices.py alone: 41 against 58 s); they compute the same values, but rewrite every
#   scatter as a loop first, so a test that reads compiled HLO compiles with the emitters
#   users get (support/_users_hlo.py).
# Set before JAX starts its backend; subprocesses that tests start inherit them. A flag the
# caller set in XLA_FLAGS is kept.
_FAST_COMPILE = ["--xla_cpu_parallel_codegen_split_count=1"]
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _FAST_COMPILE.append("--xla_backend_optimization_level=0")


def _old_emitters_known() -> bool:
    """Whether this jaxlib knows the emitters flag: XLA aborts the process on an unknown flag
    in XLA_FLAGS, and jax is not pinned. Asked once, in a child process; the answer is passed
    on in the environment to the xdist workers and to the subprocesses that tests start."""
    known = os.environ.get("FRB_TEST_OLD_EMITTERS_KNOWN")
    if known is None:
        env = dict(os.environ, XLA_FLAGS=OLD_EMITTERS, JAX_PLATFORMS="cpu")
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        known = str(int(subprocess.run(probe, env=env, capture_output=True).returncode == 0))
        os.environ["FRB_TEST_OLD_EMITTERS_KNOWN"] = known
    return known == "1"


if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and _old_emitters_known():
    _FAST_COMPILE.append(OLD_EMITTERS)
for _flag in _FAST_COMPILE:
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")

# One compilation cache for the run, in a temporary directory the xdist workers share (the
# controller makes it before it starts them, and removes it at the end): the eager and jitted
# variants of a test, and the same buffer built in many tests, compile the same programs, which
# then compile once (a third of test_slices' compilations). Set with jax.config, not JAX_*
# variables: a subprocess that a test starts compiles without it, unless it runs this conftest
# (the eight-device suite), which then shares the directory and leaves its removal to the owner.
_JAX_CACHE_ENV = "FRB_TEST_JAX_CACHE"
_owns_jax_cache = _JAX_CACHE_ENV not in os.environ
if _owns_jax_cache:
    os.environ[_JAX_CACHE_ENV] = tempfile.mkdtemp(prefix="frb-test-jax-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[_JAX_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _owns_jax_cache:
        shutil.rmtree(os.environ.pop(_JAX_CACHE_ENV), ignore_errors=True)


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


def _mappings_near_the_limit() -> bool:
    """Whether this process holds over half the kernel's memory mappings (True where that
    cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f) > limit // 2
    except (OSError, ValueError):
        return True


@pytest.fixture(scope="module", autouse=True)
def _free_executables():
    """Every compiled executable keeps memory mappings; one process running the whole suite
    would pass the kernel's limit (65,530 by default; XLA then crashes compiling). Drop them
    after a module once half the limit is used (a module adds a few thousand at most): not
    after every module, which would compile again in each module what an earlier one had
    (clearing after every module made a run of seven core modules 13% slower)."""
    yield
    if not _mappings_near_the_limit():
        return
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
