"""A griffe extension for the API reference: ``adapters/`` is installed as
``functional_rb.adapters`` (pyproject's ``package-dir``), a mapping that griffe, which reads the
source tree without importing it, cannot see. When griffe loads ``functional_rb`` from the
clone, this extension loads ``adapters/`` and attaches it as the submodule ``adapters``, so the
pages reference ``functional_rb.adapters.<Name>`` and ``functional_rb.adapters.datasets.<Name>``
as users import them.

A public name that the source does not bind statically (a module ``__getattr__`` that imports it
on first use) is pointed at the module that defines it, found by importing the package once.

The reference documents what TorchRL users call. The adapters' components also carry public
methods that only the adapters call on each other (ring reservations, cross-process commits,
sampler bindings): ``_PLUMBING`` names them, and they are left out of the pages."""
from __future__ import annotations

import importlib
import inspect
import pathlib

import griffe

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_ADAPTERS = _ROOT / "adapters"
# methods and attributes the adapters' classes call on each other, not TorchRL's API
_PLUMBING = frozenset("""
    adopt_loaded align_count apply_patch attached bind commit committed default_collate
    dump_config grow_to holes kept_slice_len len_along_dim0 lock mark_update max_size_along_dim0
    new_holes next_row next_slots owner_pid patch_leaf pop_consumed prioritized random_index
    read_all_in_order refresh replicate_index remaining_batches reserve reserved restore
    restore_compressed reuses_slots rng row_numel sampleable_count shared_ok slice_info touched
    tree_values validate_patch write_all write_at
""".split())


def _defining_module(package: str, name: str) -> str | None:
    """``functional_rb.adapters.<path>`` of the file that defines ``package.name`` at run time."""
    try:
        obj = getattr(importlib.import_module(package), name)
        source = pathlib.Path(inspect.getsourcefile(obj)).resolve()
        rel = source.relative_to(_ADAPTERS).with_suffix("")
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["functional_rb", "adapters", *parts])


def _modules(module: griffe.Module):
    """The module and the modules defined under it (not the ones it imports)."""
    yield module
    for sub in module.members.values():
        if not sub.is_alias and sub.is_module:
            yield from _modules(sub)


def _drop_plumbing(module: griffe.Module) -> None:
    for cls in module.classes.values():
        if cls.is_alias:
            continue
        for name in _PLUMBING & set(cls.members):
            cls.del_member(name)


def _repair_exports(module: griffe.Module) -> None:
    for name, member in list(module.members.items()):
        if not member.is_alias:
            continue
        try:
            member.final_target  # noqa: B018
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            where = _defining_module(module.path, name)
            if where is not None:
                member.target_path = f"{where}.{name}"


class AdaptersPackage(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        del kwargs
        if pkg.name != "functional_rb" or "adapters" in pkg.members:
            return
        init = _ADAPTERS / "__init__.py"
        if not init.exists():
            return
        # loaded as a submodule of functional_rb, so every path under it is functional_rb.adapters.*
        module = loader._load_module("adapters", init, parent=pkg)  # noqa: SLF001
        pkg.set_member("adapters", module)
        modules = list(_modules(module))
        for mod in modules:
            loader.expand_exports(mod)
        for mod in modules:
            _repair_exports(mod)
            _drop_plumbing(mod)
