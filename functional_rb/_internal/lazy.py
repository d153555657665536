"""Imports deferred to first use.

Importing JAX costs about 0.6 s, and the adapters' common paths (torch storages, the NumPy
samplers) never run it. Two tools keep it out of ``import functional_rb.adapters``:

- :func:`lazy_exports`: a package ``__init__`` names its public objects in a table and imports
  each one's module when the name is first read (``functional_rb.flashbax``).
- :func:`lazy_exports_from_type_checking`: the same, with the table read from the imports in
  the ``__init__``'s ``if TYPE_CHECKING:`` block, so that each public name is written once and
  type checkers see it (``functional_rb``, ``functional_rb.checkpoint``,
  ``functional_rb.service``).
- :func:`lazy_module`: a module whose JAX-backed parts serve only some of its functions binds
  the module holding them where it would import it; the import happens the first time one of
  its attributes is read (a :class:`Deferred` stand-in, kept out of ``sys.modules``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

__all__ = ("Deferred", "lazy_exports", "lazy_exports_from_type_checking", "lazy_module")


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
        self._module: types.ModuleType | None = None

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
            value = _from_import(value, attribute, package)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def lazy_exports_from_type_checking(package: str) -> tuple[tuple[str, ...], Callable, Callable]:
    """``(__all__, __getattr__, __dir__)`` for ``package``'s ``__init__``, whose public names
    are the ``from module import name`` statements of its top-level ``if TYPE_CHECKING:``
    block: type checkers and the API docs read those imports; at run time they do not run,
    and each name is imported on first read (:func:`lazy_exports`), as the statement would."""
    path = sys.modules[package].__file__
    if path is None:  # a namespace package: no __init__ to read
        raise ImportError(f"{package} has no __init__ module to read its imports from")
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ]
    if len(blocks) != 1:
        raise ImportError(
            f"lazy_exports_from_type_checking: {path} must have one top-level "
            f"`if TYPE_CHECKING:` block importing its public names, found {len(blocks)}"
        )
    exports = {}
    for node in blocks[0].body:
        if not isinstance(node, ast.ImportFrom) or node.level:
            raise ImportError(
                f"lazy_exports_from_type_checking: {path}:{node.lineno}: the TYPE_CHECKING "
                "block may hold only absolute `from module import name` statements (the "
                f"public names), got {ast.unparse(node)!r}"
            )
        for alias in node.names:
            exports[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return (tuple(exports), *lazy_exports(package, exports))


def _from_import(module, name: str, package: str):
    """``from module import name`` as Python runs it: the attribute, else the submodule. In
    ``package`` itself only its namespace is looked in, so that its lazy ``__getattr__`` is not
    asked for a name it delegates here."""
    if name in vars(module):
        return vars(module)[name]
    if module.__name__ != package and hasattr(module, name):
        return getattr(module, name)
    submodule = f"{module.__name__}.{name}"
    if hasattr(module, "__path__") and importlib.util.find_spec(submodule) is not None:
        return importlib.import_module(submodule)
    raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
