"""Stable names of the classes a checkpoint records, so that files outlive module moves.

On the ground floor (it imports nothing of the package): every state class registers here,
and :mod:`functional_rb.checkpoint`, above the components, reads the registry.

A checkpoint's manifest names every dataclass node of the state tree (``BufferState``, a
sampler's state, a packed storage's ``ItemSpec``) by the name it was registered under with
:func:`stable_name`, never by its module path: code can move between modules without breaking
a single file. Files written before the names existed recorded ``module:qualname``;
:data:`ALIASES` maps every such path that any earlier version wrote to its stable name.

Loading rebuilds registered classes only: no other import, no pickle. The library's own
classes register with the same decorator (spelled ``stable`` in its modules); your own state
classes with ``@frb.checkpoint.stable_name("MyState")``.
"""

from __future__ import annotations

import importlib

_BY_NAME: dict[str, type] = {}
_NAME_OF: dict[type, str] = {}

# module:qualname as checkpoints recorded them until the package was rehoused (format versions
# 3 and 4 before stable names), from every module that ever defined a checkpointed class.
ALIASES = {
    "functional_rb.buffer:BufferState": "BufferState",
    "functional_rb.memmap:MemmapStorageState": "MemmapStorageState",
    "functional_rb.prioritized:PrioritizedState": "PrioritizedState",
    "functional_rb.prioritized_slices:PrioritizedSliceState": "PrioritizedSliceState",
    "functional_rb.rate_limiter:RateLimiterState": "RateLimiterState",
    "functional_rb.samplers:EmptySamplerState": "EmptySamplerState",
    "functional_rb.samplers:WithoutReplacementState": "WithoutReplacementState",
    "functional_rb.sharded:ShardedState": "ShardedState",
    "functional_rb.slices:PrioritizedSliceState": "PrioritizedSliceState",
    "functional_rb.slices:SliceState": "SliceState",
    "functional_rb.slices:SliceWithoutReplacementState": "SliceWithoutReplacementState",
    "functional_rb.staleness:StalenessState": "StalenessState",
    "functional_rb.storages:DeviceStorageState": "DeviceStorageState",
    "functional_rb.storages:ItemSpec": "ItemSpec",
    "functional_rb.storages:PackedStorageState": "PackedStorageState",
    "functional_rb.sum_tree:SumTreeState": "SumTreeState",
    "functional_rb.ted:TEDStorageState": "TEDStorageState",
    "functional_rb.trajectories:SliceState": "SliceState",
    "functional_rb.writers:MaxValueState": "MaxValueState",
    "functional_rb.writers:RoundRobinState": "RoundRobinState",
}

# every module that registers a stable name: ``functional_rb`` imports its modules on first use,
# so a process may load a checkpoint before it imported the class a file names
# (tests/integration/test_structure.py checks the list is complete)
DEFINED_IN = (
    "functional_rb._internal.item_spec",
    "functional_rb.flashbax.buffers._once",
    "functional_rb.flashbax.buffers.flat_buffer",
    "functional_rb.flashbax.buffers.prioritised_flat_buffer",
    "functional_rb.flashbax.buffers.prioritised_trajectory_buffer",
    "functional_rb.flashbax.buffers.sum_tree",
    "functional_rb.flashbax.buffers.trajectory_buffer",
    "functional_rb.flashbax.buffers.trajectory_queue",
    "functional_rb.generations",
    "functional_rb.protocol",
    "functional_rb.queue",
    "functional_rb.rate_limiter",
    "functional_rb.samplers.binary_tree",
    "functional_rb.samplers.once",
    "functional_rb.samplers.prioritized",
    "functional_rb.samplers.prioritized_slices",
    "functional_rb.samplers.sequences",
    "functional_rb.samplers.slices",
    "functional_rb.samplers.staleness",
    "functional_rb.samplers.sum_tree_state",
    "functional_rb.samplers.trajectories",
    "functional_rb.samplers.uniform",
    "functional_rb.sharded.buffer",
    "functional_rb.storages.device",
    "functional_rb.storages.host",
    "functional_rb.storages.memmap",
    "functional_rb.ted.state",
    "functional_rb.writers",
)


def stable_name(name: str):
    """Class decorator: record the class in checkpoints as ``name``, for good.

    A name, once written to a file, is never given to another class. Renaming a class keeps its
    stable name; moving it needs nothing.

    Example:
        >>> import dataclasses, jax, jax.numpy as jnp
        >>> import functional_rb as frb
        >>> @frb.checkpoint.stable_name("docs.CounterState")
        ... @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass(frozen=True)
        ... class CounterState:
        ...     count: jax.Array
        >>> name_of(CounterState)
        'docs.CounterState'
    """

    def register(cls):
        if _BY_NAME.get(name, cls) is not cls:
            raise ValueError(
                f"stable_name: {name!r} is already the stable name of "
                f"{_BY_NAME[name].__module__}.{_BY_NAME[name].__qualname__}; choose "
                "another name for "
                f"{cls.__module__}.{cls.__qualname__}."
            )
        _BY_NAME[name] = cls
        _NAME_OF[cls] = name
        return cls

    return register


stable = stable_name  # the spelling the library's own modules use: @stable("BufferState")


def name_of(cls: type) -> str | None:
    """The stable name of ``cls``, or None when it has none (it cannot be checkpointed)."""
    return _NAME_OF.get(cls)


def lookup(name: str, where: str) -> type:
    """The class recorded as ``name`` (a stable name, or a ``module:qualname`` of older files)."""
    stable_name = ALIASES.get(name, name)
    if stable_name not in _BY_NAME:
        for module in DEFINED_IN:
            importlib.import_module(module)
    cls = _BY_NAME.get(stable_name)
    if cls is None:
        raise ValueError(
            f"{where}: refusing to rebuild class {name!r}: it is neither a "
            "registered stable name nor a module path that earlier versions of "
            "functional_rb wrote. Load it with the version that wrote it, or with "
            "one that knows this class."
        )
    return cls
