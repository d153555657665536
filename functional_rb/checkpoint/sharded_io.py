"""Checkpoints of arrays split over devices (sharded states): each process writes its own shards.

:func:`functional_rb.checkpoint.save` stores an array leaf whose sharding splits it over
several devices (every leaf of a :class:`~functional_rb.ShardedState`) shard by shard, never
gathered: the bytes of each distinct shard (one replica of it) go to the file of the process
holding it, ``shards-<process>.bin``, and the leaf's record in the manifest lists its shards::

    {"path": ..., "dtype": ..., "shape": [global shape],
     "mesh": {"data": 8}, "spec": ["data"],
     "shards": [{"index": [[start, stop], ...], "file": "shards-0.bin",
                 "offset": ..., "nbytes": ...}, ...]}

Every process computes the whole layout alike (from shapes, dtypes and shardings only), so
no process needs to be told where the others' shards go. With several processes
(``jax.distributed``) process 0 stages the checkpoint directory and broadcasts its name; each
process writes and fsyncs its file into it; after a barrier process 0 writes ``data.bin`` (the
other leaves), seals the directory (SHA-256 of every file, manifest last) and renames it into
place; a last barrier returns everyone once the checkpoint is there. So a crash at any moment
leaves the previous checkpoint or the new one, as for a single process. The processes must
share the file system of ``path``.

Loading with a template (``like=srb.init(example)`` or its ``jax.eval_shape``) puts each shard
straight onto the devices that the template's sharding assigns it (each process reads only
the shards its devices hold, from whichever file has them): the same mesh shape is required,
and another one raises ``ValueError`` naming both. Without a template the arrays are
assembled whole in host memory and returned on the default device.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb.checkpoint import atomic as _atomic
from functional_rb.checkpoint.codec import is_key

_ALIGN = 64


def _file(process: int) -> str:
    return f"shards-{process}.bin"


def is_split(x) -> bool:
    """``x`` is a JAX array whose sharding splits it over several devices."""
    if not isinstance(x, jax.Array) or x.is_fully_replicated:
        return False
    return len(x.sharding.device_set) > 1


def _index(idx, shape) -> tuple:
    """A shard's index (tuple of slices) as ``((start, stop), ...)``."""
    out = []
    for s, dim in zip(idx, shape):
        start, stop, _ = s.indices(dim)
        out.append((start, stop))
    return tuple(out)


def _mesh_of(sharding) -> tuple[dict, list]:
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    shape = dict(mesh.shape) if mesh is not None else {"devices": len(sharding.device_set)}
    return {str(k): int(v) for k, v in shape.items()}, [
        None if s is None else (list(s) if isinstance(s, tuple) else s) for s in (spec or ())
    ]


class ShardPlacement:
    """Where the shards of a save's split leaves go (computed alike by every process). Not the
    buffer's :class:`~functional_rb.protocol.Layout` (the storage grid)."""

    def __init__(self):
        self.sizes: dict[str, int] = {}  # bytes per shard file so far
        self.mine: list = []  # (file, offset, array getter) of this process

    def record(self, path: str, x: jax.Array) -> dict:
        """The manifest record of split leaf ``x``; notes the shards this process writes."""
        rec: dict = {}
        if is_key(x):
            rec["key_impl"] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        shape = tuple(x.shape)
        itemsize = jnp.dtype(x.dtype).itemsize
        holders: dict = {}
        for dev, idx in sorted(
            x.sharding.devices_indices_map(shape).items(),
            key=lambda kv: kv[0].id,  # type: ignore[attr-defined]  # jaxlib has no stubs
        ):
            holders.setdefault(_index(idx, shape), dev)
        local = {(_index(s.index, shape), s.device.id): s for s in x.addressable_shards}
        me = jax.process_index()
        shards = []
        for index, dev in holders.items():
            name = _file(dev.process_index)
            offset = self.sizes.get(name, 0)
            offset += -offset % _ALIGN
            nbytes = int(np.prod([b - a for a, b in index], dtype=np.int64)) * itemsize
            self.sizes[name] = offset + nbytes
            shards.append(
                {
                    "index": [list(p) for p in index],
                    "file": name,
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            if dev.process_index == me:
                self.mine.append((name, offset, local[(index, dev.id)]))
        mesh, spec = _mesh_of(x.sharding)
        ids = getattr(getattr(x.sharding, "mesh", None), "device_ids", None)
        rec.update(
            path=path,
            dtype=jnp.dtype(x.dtype).name,
            shape=list(shape),
            mesh=mesh,
            spec=spec,
            shards=shards,
            devices=None if ids is None else np.asarray(ids).reshape(-1).tolist(),
        )
        return rec

    def write_mine(self, stage: _atomic.Stage) -> None:
        """Write this process's shard file (if it holds any shard) into ``stage``."""
        name = _file(jax.process_index())
        parts: list = []
        at = 0
        for _file_name, offset, shard in sorted(
            (m for m in self.mine if m[0] == name), key=lambda m: m[1]
        ):
            if offset > at:
                parts.append(bytes(offset - at))
            data = np.ascontiguousarray(np.asarray(shard.data))
            parts.append(data.reshape(-1).view(np.uint8))
            at = offset + data.nbytes
        if name in self.sizes:
            stage.write(name, *parts)


# the name of earlier releases (functional_rb.sharded_io.Layout), kept importable; the class is
# ShardPlacement, so that Layout means one thing: the storage grid (functional_rb.protocol)
Layout = ShardPlacement


@contextlib.contextmanager
def staged(path, layout: ShardPlacement, *, where: str) -> Iterator:
    """Stage ``path`` for a save with split leaves; every process writes its shard file.
    Yields the :class:`~functional_rb.checkpoint.atomic.Stage` in process 0 (write the other files and
    the meta into it) and None in the others."""
    if jax.process_count() == 1:
        with _atomic.staged(path, where=where) as stage:
            layout.write_mine(stage)
            yield stage
        return
    from jax.experimental import multihost_utils as mh

    words = np.array([os.getpid(), secrets.randbits(32), secrets.randbits(32)], np.uint32)
    pid, a, b = (int(w) for w in mh.broadcast_one_to_all(words))
    token = f"{a:08x}{b:08x}"
    tag = f"functional_rb.checkpoint {token}"
    if jax.process_index() == 0:
        with _atomic.staged(path, where=where, token=token) as stage:
            mh.sync_global_devices(tag + " staged")
            layout.write_mine(stage)
            yield stage
            mh.sync_global_devices(tag + " written")
        mh.sync_global_devices(tag + " installed")
    else:
        mh.sync_global_devices(tag + " staged")
        layout.write_mine(_atomic.Stage(_atomic.staging_path(path, pid, token)))
        yield None
        mh.sync_global_devices(tag + " written")
        mh.sync_global_devices(tag + " installed")


# ------------------------------------------------------------------------------ loading
class Files:
    """The checked shard files of one load, each mapped (and its SHA-256 checked) once."""

    def __init__(self, manifest):
        self.manifest = manifest
        self._maps: dict = {}

    def read(self, shard: dict, dtype, shape) -> np.ndarray:
        name = shard["file"]
        if name not in self._maps:
            self._maps[name] = self.manifest.mapped(name)
        buf = self._maps[name]
        count = int(np.prod(shape, dtype=np.int64))
        if shard["nbytes"] != count * dtype.itemsize or shard["offset"] + shard["nbytes"] > len(
            buf
        ):
            raise _atomic.CheckpointError(
                self.manifest.where,
                self.manifest.path(name),
                f"does not hold {dtype.name}{list(shape)} at byte {shard['offset']} (the "
                "manifest and the file disagree)",
            )
        return (
            np.frombuffer(buf, dtype=dtype, count=count, offset=shard["offset"])
            .reshape(shape)
            .copy()
        )


class SplitLeaf:
    """A leaf stored shard by shard, read when placed (:meth:`restore`)."""

    def __init__(self, files: Files, rec: dict):
        self.files, self.rec = files, rec
        self.dtype = jnp.dtype(rec["dtype"])
        self.shape = tuple(rec["shape"])
        self.shards = {tuple(tuple(p) for p in s["index"]): s for s in rec["shards"]}

    def _shard(self, index: tuple) -> np.ndarray:
        shard = self.shards[index]
        return self.files.read(shard, self.dtype, tuple(b - a for a, b in index))

    def whole(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        for index in self.shards:
            out[tuple(slice(a, b) for a, b in index)] = self._shard(index)
        return out

    def _sharding(self, template):
        """The template's sharding, on concrete devices: a template from ``jax.eval_shape``
        has an abstract mesh, which is given the devices of the save (by id)."""
        sharding = getattr(template, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if not isinstance(mesh, jax.sharding.AbstractMesh):
            return sharding
        by_id = {d.id: d for d in jax.devices()}
        ids = self.rec.get("devices") or []
        if (
            len(ids) != mesh.size
            or any(i not in by_id for i in ids)
            or dict(mesh.shape) != self.rec["mesh"]
        ):
            raise ValueError(
                f"checkpoint.load: the template of leaf {self.rec['path']} has an abstract mesh "
                f"of shape {dict(mesh.shape)} (from jax.eval_shape), and the devices of the "
                "save are not all here to stand for it; pass a template on real devices "
                "(like=srb.init(example))."
            )
        devices = np.array([by_id[i] for i in ids], dtype=object).reshape(tuple(mesh.axis_sizes))
        real = jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return jax.sharding.NamedSharding(real, sharding.spec)

    def layout_difference(self, template) -> str | None:
        """Why the template's sharding cannot take these shards (a sentence), or None."""
        sharding = getattr(template, "sharding", None)
        if sharding is None:
            return None  # no placement asked: the whole array
        mesh, spec = _mesh_of(sharding)
        saved = (
            f"leaf {self.rec['path']} was saved in {len(self.shards)} shards over a mesh "
            f"of shape {self.rec['mesh']} (spec {self.rec['spec']})"
        )
        fix = (
            "Restore onto a mesh of the same shape as the save's (the same number of "
            "devices along each axis), or load without like= to get the whole arrays"
        )
        if mesh != self.rec["mesh"]:
            return f"{saved}; the template's mesh has shape {mesh}. {fix}"
        if tuple(np.shape(template)) != self.shape:
            return None  # the same mesh, another shape: the caller names the difference
        want = {
            _index(i, self.shape)
            for i in self._sharding(template).devices_indices_map(self.shape).values()
        }
        if want <= set(self.shards):
            return None
        return f"{saved}; the template cuts it in {len(want)} shards (spec {spec}). {fix}"

    def restore(self, template=None):
        """The leaf as a JAX array: on the template's sharding (each process reading the
        shards its devices hold), or whole on the default device."""
        sharding = self._sharding(template)
        if sharding is None:
            arr = jnp.asarray(self.whole())
        else:
            arr = jax.make_array_from_callback(
                self.shape, sharding, lambda idx: self._shard(_index(idx, self.shape))
            )
        if "key_impl" in self.rec:
            return jax.random.wrap_key_data(arr, impl=self.rec["key_impl"])
        return arr


def layout_difference(saved, like) -> str | None:
    """The first split leaf of ``saved`` (a loaded tree) that ``like``'s shardings cannot take,
    as a sentence; None if every one fits (or the trees differ otherwise: reported later)."""
    s_leaves = jax.tree_util.tree_leaves(saved, is_leaf=lambda x: isinstance(x, SplitLeaf))
    l_leaves = jax.tree_util.tree_leaves(like)
    if len(s_leaves) != len(l_leaves):
        return None
    for s, t in zip(s_leaves, l_leaves):
        if isinstance(s, SplitLeaf):
            problem = s.layout_difference(t)
            if problem:
                return problem
    return None
