"""Module paths of earlier releases, kept importable after the package was rehoused.

Until the core was split into role packages, each of these was a module directly under
``functional_rb``; code written against them (``import functional_rb.slices``,
``from functional_rb.memmap import MemmapStorage``) keeps working because each old name is
resolved, on first import, to the module that now holds its code. New code imports the new
paths. (Checkpoints do not depend on this table: they name classes by stable names, see
:mod:`functional_rb._internal.names`.)
"""

import importlib
import importlib.abc
import importlib.util
import sys

OLD_TO_NEW = {
    "functional_rb.checkpoint.names": "functional_rb._internal.names",
    "functional_rb.epochs": "functional_rb.samplers.epochs",
    "functional_rb.base": "functional_rb.protocol",
    "functional_rb.layout": "functional_rb.protocol",
    "functional_rb.memmap": "functional_rb.storages.memmap",
    "functional_rb.nstep": "functional_rb.ted.nstep",
    "functional_rb.priorities": "functional_rb.samplers.priorities",
    "functional_rb.prioritized": "functional_rb.samplers.prioritized",
    "functional_rb.prioritized_slices": "functional_rb.samplers.prioritized_slices",
    "functional_rb.sharded_draws": "functional_rb.collectives.draws",
    "functional_rb.sharded_exchange": "functional_rb.collectives.exchange",
    "functional_rb.sharded_io": "functional_rb.checkpoint.sharded_io",
    "functional_rb.sharded_ops": "functional_rb.collectives.ops",
    "functional_rb.slices": "functional_rb.samplers.slices",
    "functional_rb.staleness": "functional_rb.samplers.staleness",
    "functional_rb.sum_tree": "functional_rb.samplers.sum_tree",
    "functional_rb.ted_flat": "functional_rb.ted.flat",
    "functional_rb.ted_write": "functional_rb.ted.write",
    "functional_rb.trajectories": "functional_rb.samplers.trajectories",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module that now holds its code (the same module object)."""

    def __init__(self, new: str):
        self._new = new

    def create_module(self, spec):
        module = importlib.import_module(self._new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        # already executed under its new name; the import system gave it the old path's spec
        module.__spec__ = self._spec


class _OldPaths(importlib.abc.MetaPathFinder):
    """Resolves each old path on first import, so importing the package imports nothing."""

    def find_spec(self, fullname, path=None, target=None):
        new = OLD_TO_NEW.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Registers the old paths (once per process)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
