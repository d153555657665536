"""Host storage in this process's memory: NumPy arrays, read and written by NumPy.

``HostStorage()`` is :class:`~functional_rb.MemmapStorage` without the files: the same
``host_io`` calls, no journal and no crash safety. Its rows are packed as
:class:`~functional_rb.storages.PackedStorage`'s are: the leaves of one dtype side by side in
one ``[capacity, width]`` slab, so a sampled item is one contiguous row per dtype. It suits a buffer whose items are produced
and consumed by host code (NumPy, PyTorch) around each step: an eager ``add`` / ``sample``
writes and gathers rows with NumPy, and nothing is copied to a device and back.

How it runs
-----------
- Eagerly (concrete arrays) ``set``/``get`` are NumPy writes and reads; the storage declares
  ``host_io``, so an eager ``rb.add`` / ``rb.sample`` compiles the buffer's other work and
  calls them in between (:mod:`functional_rb._internal.host_calls`). An eager ``set`` refuses a
  state that is not the newest of its arrays (a later write moved them on), naming it.
- Under ``jax.jit`` / ``lax.scan`` they are ``io_callback(ordered=True)`` calls, ordered by the
  int32 ``version`` in the state (the arrays' count of writes, modulo 2**32), as
  ``MemmapStorage``'s are. ``jax.vmap`` over a state is not supported (every state would share
  the arrays): ``set``/``get`` raise a ``TypeError``.

Whose arrays
------------
A state is a handle: every state that follows from one ``init`` shares its arrays (as a
``MemmapStorage`` state shares its files). The arrays live as long as a state of them does;
compiled programs hold only their key. Pickling a state (or ``copy.deepcopy``) copies the
arrays, and the copy is a new buffer of its own. ``functional_rb.checkpoint.save`` copies the
items; ``load`` writes them back into the template's arrays.

Host code that writes rows itself (``functional_rb.sb3`` writes each environment step this
way, a NumPy assignment per field) takes the live arrays with :meth:`HostStorage.arrays`.
"""

from __future__ import annotations

import dataclasses
import pickle
import uuid
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from functional_rb._internal import hugepages
from functional_rb._internal.errors import is_traced, keystr
from functional_rb._internal.item_spec import ItemSpec, packing
from functional_rb._internal.jit import to_device
from functional_rb._internal.names import stable
from functional_rb.protocol import Context, Layout, Storage, WriteRecord

PyTree = Any

__all__ = ["HostStorage", "HostStorageState"]


class _Rows:
    """The slabs of one buffer, a view of each leaf into them (item leaf order, ``[capacity,
    *item_shape]``), its count of writes, and the version array of the newest eager write
    (the state holding it is current without a device read)."""

    def __init__(self, slabs: dict, item: ItemSpec):
        self.slabs = slabs
        layout, _ = packing(item)
        self.layout = layout
        self.arrays = [
            slabs[name][:, off : off + width].reshape(-1, *shape)
            for name, shape, off, width in layout
        ]
        self.writes = 0
        self.last: Any = None


# key -> _Rows, held by the states (not here): a buffer whose states are gone is freed
_ROWS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _register(rows: _Rows) -> str:
    key = uuid.uuid4().hex
    _ROWS[key] = rows
    return key


def _rows(key: str, where: str) -> _Rows:
    rows = _ROWS.get(key)
    if rows is None:
        raise ValueError(
            f"{where}: the arrays of HostStorage state {key[:8]} are gone from this process "
            "(every state of them was dropped). Pass a state of a live buffer, or rb.init a "
            "new one."
        )
    return rows


@stable("HostStorageState")
@dataclasses.dataclass(frozen=True)
class HostStorageState:
    """Only a counter is dynamic; the arrays are found by ``key`` and held by the state.

    version: int32 ``[]``: the count of writes to the arrays after this state's last write
      (modulo 2**32); orders reads after writes.
    item: the stored item's description; capacity: rows per leaf; key: which arrays.
    """

    version: jax.Array
    item: ItemSpec = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    key: str = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        # strong reference: the arrays live while a state of them does (None when they are
        # gone, e.g. a state decoded from a checkpoint before load replaces it)
        object.__setattr__(self, "_held", _ROWS.get(self.key))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        held = state["_held"]
        state["_slabs"] = None if held is None else held.slabs
        state["_held"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        slabs = state.pop("_slabs")
        self.__dict__.update(state)
        if slabs is not None:  # a copy of the arrays: a buffer of its own, under a new key
            rows = _Rows(slabs, state["item"])
            rows.writes = int(np.asarray(state["version"]))
            object.__setattr__(self, "key", _register(rows))
            object.__setattr__(self, "_held", rows)

    def __copy__(self) -> HostStorageState:
        return dataclasses.replace(self)  # the same arrays

    def __deepcopy__(self, memo) -> HostStorageState:
        del memo
        return pickle.loads(pickle.dumps(self))  # the arrays copied, under a new key

    # -- frb.checkpoint.HostBacked: a checkpoint copies the items, a load writes them back
    def snapshot_arrays(self) -> dict:
        """``{slab name: array [capacity, width]}``: every row of every slab."""
        rows = _rows(self.key, "checkpoint.save")
        _wait(self, rows)
        return dict(rows.slabs)

    def mismatch(self, other: HostStorageState, where: str) -> str | None:
        if self.capacity != other.capacity:
            return (
                f"{where}.capacity is {self.capacity} in the checkpoint, "
                f"{other.capacity} in the template (a different capacity?)"
            )
        if self.item != other.item:
            return (
                f"{where}.item is {_describe(self.item)} in the checkpoint, "
                f"{_describe(other.item)} in the template (a different example?)"
            )
        return None

    def restore_arrays(self, arrays: dict) -> HostStorageState:
        """Write the saved rows into this state's arrays; the state after that write."""
        rows = _rows(self.key, "checkpoint.load")
        for name, slab in rows.slabs.items():
            slab[...] = arrays[name]
        rows.writes += 1
        return dataclasses.replace(self, version=jnp.asarray(np.int32(_wrap(rows.writes))))


jax.tree_util.register_dataclass(
    HostStorageState, data_fields=["version"], meta_fields=["item", "capacity", "key"]
)


def _paths(item: ItemSpec) -> list:
    return [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(item.shapes())[0]]


def _describe(item: ItemSpec) -> str:
    return ", ".join(f"{p}: {d}{list(s)}" for p, (s, d) in zip(_paths(item), item.leaves))


def _wrap(count: int) -> int:
    return (count + 2**31) % 2**32 - 2**31  # as int32 holds it


def _wait(state: HostStorageState, rows: _Rows) -> None:
    """Wait for the write that produced ``state`` (a jitted one may still be running)."""
    if state.version is not rows.last:
        np.asarray(state.version)


def _check_not_batched(where: str, *xs):
    for x in xs:
        if type(x).__name__ == "BatchTracer":  # jax keeps the class private
            raise TypeError(
                f"{where}: HostStorage does not support jax.vmap (every state would share the "
                "same host arrays, and ordered host callbacks cannot be batched). Use one "
                "buffer with ndim=2 for several environments, or DeviceStorage to vmap over "
                "independent buffers."
            )


def _write(key, positions, mask, *leaves) -> np.int32:
    rows = _rows(key, "HostStorage.set")
    keep = np.asarray(mask).reshape(-1).astype(bool)
    pos = np.asarray(positions).reshape(-1)
    if not keep.all():
        pos, leaves = pos[keep], tuple(np.asarray(x)[keep] for x in leaves)
    for a, x in zip(rows.arrays, leaves):
        a[pos] = x
    rows.writes += 1
    return np.int32(_wrap(rows.writes))


def _read(key, indices) -> list:
    rows = _rows(key, "HostStorage.get")
    idx = np.asarray(indices)
    # one gather per slab (take: a new array; ~3x faster than fancy indexing for short rows),
    # out-of-range indices clamped like gather_rows'
    got = {name: slab.take(idx, axis=0, mode="clip") for name, slab in rows.slabs.items()}
    return [
        got[name][..., off : off + width].reshape(idx.shape + shape)
        for name, shape, off, width in rows.layout
    ]


@jax.jit
def _next_version(version):
    return version + jnp.int32(1)


@dataclasses.dataclass(frozen=True)
class HostStorage(Storage):
    """Items in NumPy arrays in this process's memory: the leaves of one dtype side by side in
    one ``[capacity, width]`` slab (:meth:`arrays` gives a ``[capacity, *item]`` view of each).

    State: :class:`HostStorageState` (an int32 version counter; the arrays by key).

    >>> import jax.numpy as jnp
    >>> import functional_rb as frb
    >>> from functional_rb.storages import HostStorage
    >>> rb = frb.ReplayBuffer(8, storage=HostStorage(), batch_size=2)
    >>> state = rb.add(rb.init({"x": jnp.zeros(3)}), {"x": jnp.ones((4, 3))})
    >>> rb.storage.arrays(state.storage)[0][:5, 0].tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0]
    """

    state_types = (HostStorageState,)
    host_io = True

    def init(self, item: PyTree, layout: Layout) -> HostStorageState:
        spec = ItemSpec.from_tree(item)
        slabs = {}
        for name, (dtype, width) in packing(spec)[1].items():
            slabs[name] = np.zeros((layout.capacity, width), np.dtype(dtype))
            hugepages.advise(slabs[name], zeroed=True)
        rows = _Rows(slabs, spec)
        rows.last = jnp.int32(0)
        return HostStorageState(
            version=rows.last, item=spec, capacity=int(layout.capacity), key=_register(rows)
        )

    def check_state(self, state: HostStorageState, capacity: int, num_envs: int) -> str | None:
        del num_envs
        if state.capacity != capacity:
            return f"state.storage.capacity is {state.capacity}, expected capacity={capacity}"
        return None

    def item_spec(self, state: HostStorageState) -> PyTree:
        return state.item.shapes()

    def set(
        self, state: HostStorageState, record: WriteRecord, items: PyTree, ctx: Context
    ) -> HostStorageState:
        del ctx
        leaves = jax.tree_util.tree_leaves(items)
        args = (state.version, record.positions, record.mask, *leaves)
        _check_not_batched("HostStorage.set", *args)
        if not any(is_traced(a) for a in args):
            rows = _rows(state.key, "HostStorage.set")
            _check_current(state, rows)
            _write(state.key, *(np.asarray(a) for a in args[1:]))
            # the new version is computed where it lives (a copy of the host's count to the
            # device would cost more)
            rows.last = _next_version(state.version)
            return dataclasses.replace(state, version=rows.last)
        key = state.key
        version = io_callback(
            lambda v, *a: _write(key, *a),
            jax.ShapeDtypeStruct((), jnp.int32),
            *args,
            ordered=True,
        )
        return dataclasses.replace(state, version=version)

    def get(self, state: HostStorageState, indices: jax.Array, ctx: Context) -> PyTree:
        del ctx
        _check_not_batched("HostStorage.get", state.version, indices)
        if not (is_traced(state.version) or is_traced(indices)):
            leaves = to_device(*self.arrays_at(state, indices))
        else:
            key = state.key
            shapes = [
                jax.ShapeDtypeStruct(tuple(indices.shape) + x.shape, x.dtype)
                for x in jax.tree_util.tree_leaves(state.item.shapes())
            ]
            leaves = io_callback(
                lambda v, i: _read(key, i),
                shapes,
                state.version,
                jnp.asarray(indices, jnp.int32),
                ordered=True,
            )
        return jax.tree_util.tree_unflatten(state.item.treedef, list(leaves))

    def arrays_at(self, state: HostStorageState, indices) -> list:
        """Every leaf's rows at concrete ``indices`` (item leaf order), as new NumPy arrays."""
        _wait(state, _rows(state.key, "HostStorage.get"))
        return _read(state.key, indices)

    def read_host(self, state: HostStorageState, indices) -> PyTree:
        """``get`` for concrete ``indices``, as new NumPy arrays (no device copy)."""
        return jax.tree_util.tree_unflatten(state.item.treedef, self.arrays_at(state, indices))

    def arrays(self, state: HostStorageState) -> list:
        """The live arrays (item leaf order, ``[capacity, *item]``: views into the slabs), for
        host code that reads or writes rows in place, outside ``jit``. They are the buffer's
        items: a row written here is what the next ``get`` returns, with no version change, so
        write only while no jitted call of this buffer is running (this waits for the one
        that produced ``state``), and write rows the buffer's writer has placed (its
        positions)."""
        rows = _rows(state.key, "HostStorage.arrays")
        _wait(state, rows)
        return rows.arrays


def _check_current(state: HostStorageState, rows: _Rows) -> None:
    if state.version is rows.last:
        return
    version = int(np.asarray(state.version))  # waits for the write that produced it
    if version != _wrap(rows.writes):
        raise ValueError(
            f"HostStorage.set: these arrays have had {rows.writes} writes, but this state's "
            f"storage version is {version}: it is not the newest state of them (a later add "
            "wrote over its items). Pass the state returned by the last add."
        )
