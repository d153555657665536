"""A griffe extension for the API reference of ``functional_rb.adapters``.

The reference documents what TorchRL users call. The adapters' components also carry public
methods that only the adapters call on each other (ring reservations, cross-process commits,
sampler bindings): ``_PLUMBING`` names them, and they are left out of the pages.

A subclass takes many of its parent's arguments (``SliceSamplerWithoutReplacement`` those of
``SliceSampler``, every dataset loader those of ``ReplayBuffer``): its docstring documents the
arguments it adds or whose meaning it changes, and the page gets the others' descriptions from
the nearest base class that documents them, or from its module (:func:`_inherit_parameters`),
so each is written once. The annotation shown is the subclass's own."""

from __future__ import annotations

import griffe
from griffe import DocstringParameter, DocstringSectionParameters

# methods and attributes the adapters' classes call on each other, not TorchRL's API
# fmt: off
_PLUMBING = frozenset([
    "adopt_loaded", "align_count", "apply_patch", "attached", "bind", "commit", "committed",
    "default_collate", "dump_config", "grow_to", "holes", "kept_slice_len", "len_along_dim0",
    "lock", "mark_update", "max_size_along_dim0", "new_holes", "next_row", "next_slots",
    "owner_pid", "patch_leaf", "pop_consumed", "prioritized", "random_index", "read_all_in_order",
    "refresh", "replicate_index", "remaining_batches", "reserve", "reserved", "restore",
    "restore_compressed", "reuses_slots", "rng", "row_numel", "sampleable_count", "shares_writes",
    "slice_info", "touched", "tree_values", "validate_patch", "write_all", "write_at",
])
# fmt: on


def _modules(module: griffe.Module):
    """The module and the modules defined under it (not the ones it imports)."""
    yield module
    for sub in module.members.values():
        if not sub.is_alias and sub.is_module:
            yield from _modules(sub)


def _parameters(obj) -> DocstringSectionParameters | None:
    """The parsed "Args" section of a class's (or a module's) docstring, or None."""
    if obj.docstring is None:
        return None
    return next(
        (sec for sec in obj.docstring.parsed if isinstance(sec, DocstringSectionParameters)), None
    )


def _sources(cls) -> list:
    """Where ``cls``'s undocumented arguments are looked up: its ancestors in resolution order
    (those griffe can resolve: not torch's), then the modules defining them (a private module's
    docstring may document the arguments a family of classes shares, e.g. the dataset
    loaders' in ``datasets/_common.py``)."""
    try:
        bases = cls.mro()
    except Exception:  # noqa: BLE001 - a base outside the loaded packages: none to inherit from
        bases = []
    modules = [b.parent for b in bases if b.parent is not None and b.parent.is_module]
    return [*bases, *dict.fromkeys(modules)]


def _inherit_parameters(cls) -> None:
    """Give ``cls``'s docstring a bullet for each ``__init__`` argument it does not document,
    from the nearest source (:func:`_sources`) that does."""
    try:  # its own __init__, else the one it inherits
        init = cls.all_members.get("__init__")
    except Exception:  # noqa: BLE001 - an unresolvable base: only its own members
        init = cls.members.get("__init__")
    if init is None or not init.is_function or cls.docstring is None:
        return
    own = _parameters(cls)
    documented = {p.name for p in own.value} if own else set()
    wanted = [
        p
        for p in init.parameters
        if p.name not in ("self", "cls") and not p.name.startswith("_") and p.name not in documented
    ]
    found = []
    for param in wanted:
        for source in _sources(cls):
            section = _parameters(source)
            match = section and next((d for d in section.value if d.name == param.name), None)
            if match:
                found.append(
                    DocstringParameter(
                        param.name,
                        description=match.description,
                        annotation=param.annotation,
                        value=param.default,
                    )
                )
                break
    if not found:
        return
    if own is None:
        cls.docstring.parsed.append(DocstringSectionParameters(found))
    else:  # in the signature's order
        order = {p.name: i for i, p in enumerate(init.parameters)}
        own.value[:] = sorted([*own.value, *found], key=lambda d: order.get(d.name, -1))


class AdaptersPlumbing(griffe.Extension):
    """Once the package is loaded: every class of the adapters loses its plumbing members and
    inherits the descriptions of the arguments it does not document."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        del kwargs
        if pkg.name != "functional_rb" or "adapters" not in pkg.members:
            return
        for module in _modules(pkg.members["adapters"]):
            for cls in module.classes.values():
                if not cls.is_alias:
                    for name in _PLUMBING & set(cls.members):
                        cls.del_member(name)
                    _inherit_parameters(cls)
