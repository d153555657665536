"""JAX's persistent compilation cache for the adapters: a process reuses the programs an earlier
process compiled, so a TorchRL program's first ``extend`` / ``sample`` does not pay XLA's
compile time again at every start (first ``SliceSampler`` extend + sample in a fresh process:
1.4-3.1 s with a cold cache, 0.35-0.47 s with a warm one, on a shared 2-core VM).

:func:`enable_default` runs when ``functional_rb.adapters`` is imported and turns the cache on
for the process, with these rules:

* ``FRB_COMPILATION_CACHE=0`` (or ``false`` / ``off`` / ``no``) opts out: nothing is changed.
* A cache the user configured wins: when ``jax_compilation_cache_dir`` is already set (by
  ``jax.config.update`` or ``JAX_COMPILATION_CACHE_DIR``) nothing is changed.
* Otherwise the cache lives in ``FRB_COMPILATION_CACHE_DIR`` if set, else
  ``$XDG_CACHE_HOME/functional_rb/jax`` (``~/.cache/functional_rb/jax``), capped at 1 GiB
  (least recently used entries are evicted), and every compiled program is kept: JAX's default
  keeps only programs that took over 1 s to compile, and the adapters' take 0.05-0.5 s each.

These are JAX's process-wide settings: other JAX code in the same process shares the cache.
When JAX is not imported yet (the adapters' torch paths never import it), the settings go into
JAX's environment variables (``JAX_COMPILATION_CACHE_DIR``, ...), which JAX reads when it is
imported; child processes inherit them and share the cache.
JAX decides whether to use a cache at its first compilation, so the settings take effect only
if nothing was compiled before ``functional_rb.adapters`` is imported (import it first, or set
``jax_compilation_cache_dir`` yourself). A directory that cannot be created leaves the cache
off, with a warning that names it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

ENV_SWITCH = "FRB_COMPILATION_CACHE"
ENV_DIR = "FRB_COMPILATION_CACHE_DIR"
MAX_BYTES = 1 << 30
_OFF = ("0", "false", "off", "no")


def default_dir() -> str:
    """``FRB_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/functional_rb/jax``, else
    ``~/.cache/functional_rb/jax``."""
    if os.environ.get(ENV_DIR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_DIR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "functional_rb", "jax")


def enable_default() -> str | None:
    """Turn JAX's persistent compilation cache on (see the module docstring); returns the
    directory now in use by this function's doing, or None when it changed nothing."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in _OFF:
        return None
    jax = sys.modules.get("jax")  # not imported here: importing JAX costs ~0.6 s
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
        jax is not None and jax.config.jax_compilation_cache_dir
    ):
        return None
    path = default_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        warnings.warn(
            f"functional_rb.adapters: JAX's compilation cache stays off: cannot create "
            f"{path} ({e.strerror}). Set {ENV_DIR} to a writable directory, or "
            f"{ENV_SWITCH}=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
    }
    # JAX's default is unbounded; its eviction needs the filelock package (torch depends on it)
    unbounded = (
        jax.config.jax_compilation_cache_max_size == -1
        if jax is not None
        else "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ
    )
    if unbounded and importlib.util.find_spec("filelock"):
        settings["jax_compilation_cache_max_size"] = MAX_BYTES
    for name, value in settings.items():
        if jax is not None:
            jax.config.update(name, value)
        else:
            os.environ[name.upper()] = str(value)
    return path
