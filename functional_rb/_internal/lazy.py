"""Imports deferred to first use.

Importing JAX costs about 0.6 s, and the adapters' common paths (torch storages, the NumPy
samplers) never run it. Two tools keep it out of ``import functional_rb.adapters``:

- :func:`lazy_exports`: a package ``__init__`` names its public objects in a table and imports
  each one's module when the name is first read (``functional_rb``, ``functional_rb.service``).
- :func:`lazy_module`: a module whose JAX-backed parts serve only some of its functions binds
  the module holding them where it would import it; the import happens the first time one of
  its attributes is read (the stdlib's ``importlib.util.LazyLoader``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Callable

__all__ = ("lazy_exports", "lazy_module")


def lazy_module(name: str) -> ModuleType:
    """The module ``name`` (not a package), executed on first attribute access. Its parent
    packages are imported now, so ``name`` should sit under packages whose ``__init__`` is
    cheap."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"lazy_module: no module named {name!r}", name=name)
    if spec.submodule_search_locations is not None:
        # importing one of its submodules first would run that submodule twice
        raise ValueError(f"lazy_module: {name!r} is a package; bind one of its modules, or give "
                         "the package lazy_exports.")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``: ``exports`` maps each public
    name to ``"module"`` (a namespace) or ``"module:attribute"``, imported on first read and
    then cached in the package's namespace."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str):
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
