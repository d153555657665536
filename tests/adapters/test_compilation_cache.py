"""JAX's persistent compilation cache, turned on by importing functional_rb.adapters
(adapters/_compilation_cache.py): where it lives, the opt-out, a user's own setting
winning, and a second process compiling nothing it compiled before.

Each case runs in a fresh interpreter: the settings are process-wide and JAX decides whether to
use a cache at its first compilation.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

# a TensorDictMaxValueWriter buffer compiles its rank bookkeeping with JAX on first use
_PROGRAM = r"""
import json, warnings
warnings.simplefilter("error", RuntimeWarning)
import jax
from jax._src import monitoring
seen = {"compiles": 0, "hits": 0}
monitoring.register_event_duration_secs_listener(
    lambda name, dur, **kw: seen.__setitem__("compiles", seen["compiles"] + 1)
    if name.endswith("backend_compile_duration") else None)
monitoring.register_event_listener(
    lambda name, **kw: seen.__setitem__("hits", seen["hits"] + 1)
    if name == "/jax/compilation_cache/cache_hits" else None)
PRE
import torch
from tensordict import TensorDict
import functional_rb.adapters as A
rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(64),
                              writer=A.TensorDictMaxValueWriter(rank_key="r"), batch_size=8)
rb.extend(TensorDict({"r": torch.arange(32.0), "x": torch.ones(32, 2)}, [32]))
rb.sample()
print(json.dumps(dict(seen, dir=jax.config.jax_compilation_cache_dir,
                      min_s=jax.config.jax_persistent_cache_min_compile_time_secs)))
"""


def _run(env_extra, pre=""):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "FRB_COMPILATION_CACHE",
            "FRB_COMPILATION_CACHE_DIR",
            "JAX_COMPILATION_CACHE_DIR",
            "XDG_CACHE_HOME",
        )
    }
    env.update(env_extra, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM.replace("PRE", pre)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run({"FRB_COMPILATION_CACHE_DIR": str(cache)})
    assert first["dir"] == str(cache) and first["min_s"] == 0.0
    assert first["compiles"] > 0 and first["hits"] == 0
    assert any(cache.iterdir()), "nothing was written to the cache"
    second = _run({"FRB_COMPILATION_CACHE_DIR": str(cache)})
    assert second["hits"] == first["compiles"], (first, second)


def test_default_directory_is_under_the_user_cache_dir(tmp_path):
    got = _run({"XDG_CACHE_HOME": str(tmp_path)})
    assert got["dir"] == str(tmp_path / "functional_rb" / "jax")
    assert (tmp_path / "functional_rb" / "jax").is_dir()


def test_opt_out_changes_nothing(tmp_path):
    got = _run({"FRB_COMPILATION_CACHE": "0", "XDG_CACHE_HOME": str(tmp_path)})
    assert got["dir"] is None and got["min_s"] == 1.0 and got["hits"] == 0
    assert not (tmp_path / "functional_rb").exists()


def test_a_cache_the_user_configured_wins(tmp_path):
    mine = tmp_path / "mine"
    got = _run(
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        pre=f"jax.config.update('jax_compilation_cache_dir', {str(mine)!r})",
    )
    assert got["dir"] == str(mine) and got["min_s"] == 1.0  # JAX's own threshold kept
    assert not (tmp_path / "xdg").exists()


def test_unwritable_directory_warns_and_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRB_COMPILATION", "JAX_"))}
    env.update(FRB_COMPILATION_CACHE_DIR=str(blocker / "sub"), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", "import functional_rb.adapters"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compilation cache stays off" in out.stderr and str(blocker / "sub") in out.stderr
    assert "FRB_COMPILATION_CACHE=0" in out.stderr
