"""The record type of ``functional_rb.flashbax``: flashbax's states, samples and buffers as
frozen dataclasses that behave as flashbax's (``chex.dataclass``) do for its users.

flashbax users rely on four habits of ``chex.dataclass``, and :func:`record` gives all four
without depending on chex:

- ``state.replace(field=...)`` and ``buffer.replace(add=jax.jit(buffer.add, donate_argnums=0))``;
- states and samples are PyTrees (``jit``, ``vmap``, ``pmap``, ``tree_map``, donation), whose
  key paths name the fields (``.experience``);
- mapping access: ``state["experience"]``, ``state.keys()`` and ``Cls(**state)``;
- ``Cls[Experience]`` in type annotations (the classes are ``typing.Generic``).

A record that is a PyTree also gets a stable checkpoint name (``flashbax.<ClassName>``), so
``functional_rb.checkpoint.save`` / ``load`` handle these states like the core's.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar

import jax

from functional_rb._internal.names import stable

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: for type checkers only

    def dataclass_transform(**kwargs):
        return lambda f: f


class Record:
    """Mixin of :func:`record` classes: ``replace`` and read-only mapping access."""

    # for type checkers: every Record is a dataclass (record() makes it one)
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied (as ``chex.dataclass.replace``).

        >>> from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferSample
        >>> TrajectoryBufferSample(experience=1).replace(experience=2).experience
        2
        """
        return dataclasses.replace(self, **changes)

    def keys(self):
        return [f.name for f in dataclasses.fields(self)]

    def values(self):
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def items(self):
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def __getitem__(self, name: str):
        if name not in self.keys():
            raise KeyError(
                f"{type(self).__name__} has no field {name!r}; its fields are {self.keys()}."
            )
        return getattr(self, name)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


@dataclass_transform(frozen_default=True, eq_default=False, field_specifiers=(dataclasses.field,))
def record(cls=None, *, pytree: bool = True, sort_fields: bool = True):
    """Class decorator for a :class:`Record` subclass: a frozen dataclass; ``pytree=True``
    registers it as a PyTree (every field a child but those declared with
    ``dataclasses.field(metadata=dict(static=True))``, as the core's states mark theirs) under
    the stable checkpoint name ``flashbax.<ClassName>``. Buffers (records of functions) pass
    ``pytree=False``.

    The children are flattened in the order flashbax's classes flatten theirs, so leaf lists,
    ``tree_flatten_with_path`` and checkpoints written by flashbax line up: sorted by field
    name (``chex.dataclass``, flashbax's states and samples), or in declaration order with
    ``sort_fields=False`` (``flax.struct.dataclass``, flashbax's ``SumTreeState``)."""

    def wrap(cls):
        if not issubclass(cls, Record):
            raise TypeError(
                f"record: {cls.__qualname__} must subclass functional_rb.flashbax._records.Record."
            )
        cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
        if pytree:
            fields = dataclasses.fields(cls)
            static = [f.name for f in fields if f.metadata.get("static", False)]
            data = [f.name for f in fields if f.name not in static]
            jax.tree_util.register_dataclass(
                cls, data_fields=sorted(data) if sort_fields else data, meta_fields=static
            )
            stable(f"flashbax.{cls.__name__}")(cls)
        return cls

    return wrap if cls is None else wrap(cls)
