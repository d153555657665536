"""Imports deferred to first use.

Importing JAX costs about 0.6 s, and the adapters' common paths (torch storages, the NumPy
samplers) never run it. Two tools keep it out of ``import functional_rb.adapters``:

- :func:`lazy_exports`: a package ``__init__`` names its public objects in a table and imports
  each one's module when the name is first read (``functional_rb``, ``functional_rb.service``).
- :func:`lazy_module`: a module whose JAX-backed parts serve only some of its functions binds
  the module holding them where it would import it; the import happens the first time one of
  its attributes is read (a :class:`Deferred` stand-in, kept out of ``sys.modules``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable

__all__ = ("Deferred", "lazy_exports", "lazy_module")


def lazy_module(name: str) -> Deferred:
    """The module ``name``, imported the first time one of its attributes is read. Its parent
    packages are imported now (to check that it exists), so ``name`` should sit under packages
    whose ``__init__`` is cheap."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"lazy_module: no module named {name!r}", name=name)
    return Deferred(name)


class Deferred:
    """Stands for a module until one of its attributes is read, then imports it.

    It lives only where it is bound, never in ``sys.modules``: a placeholder module there
    would be imported by anything that walks ``sys.modules`` reading an attribute of each
    (``inspect.stack()`` reads every module's ``__file__``; the stdlib's ``LazyLoader`` modules
    load on it, so one traceback in a user's program cost the JAX import, ~0.7 s)."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attribute: str):
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<deferred module {self._name!r} ({state})>"


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
