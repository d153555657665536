"""A griffe extension for the API reference of ``functional_rb.adapters``.

The reference documents what TorchRL users call. The adapters' components also carry public
methods that only the adapters call on each other (ring reservations, cross-process commits,
sampler bindings): ``_PLUMBING`` names them, and they are left out of the pages."""
from __future__ import annotations

import griffe

# methods and attributes the adapters' classes call on each other, not TorchRL's API
_PLUMBING = frozenset("""
    adopt_loaded align_count apply_patch attached bind commit committed default_collate
    dump_config grow_to holes kept_slice_len len_along_dim0 lock mark_update max_size_along_dim0
    new_holes next_row next_slots owner_pid patch_leaf pop_consumed prioritized random_index
    read_all_in_order refresh replicate_index remaining_batches reserve reserved restore
    restore_compressed reuses_slots rng row_numel sampleable_count shares_writes slice_info touched
    tree_values validate_patch write_all write_at
""".split())


def _modules(module: griffe.Module):
    """The module and the modules defined under it (not the ones it imports)."""
    yield module
    for sub in module.members.values():
        if not sub.is_alias and sub.is_module:
            yield from _modules(sub)


class AdaptersPlumbing(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        del kwargs
        if pkg.name != "functional_rb" or "adapters" not in pkg.members:
            return
        for module in _modules(pkg.members["adapters"]):
            for cls in module.classes.values():
                if not cls.is_alias:
                    for name in _PLUMBING & set(cls.members):
                        cls.del_member(name)
