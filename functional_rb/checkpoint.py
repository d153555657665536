"""Save and load a buffer state: bit-exact, atomic, checked, without pickle.

Typical use::

    frb.checkpoint.save("ckpt/rb", state)                    # a directory, replaced atomically
    state = frb.checkpoint.load("ckpt/rb")                   # the tree from the manifest
    state = frb.checkpoint.load("ckpt/rb", like=rb.init(ex)) # ... checked against a template

Guarantees
----------
- **Atomic and durable.** A save is staged in a sibling directory, every file is fsynced, the
  manifest is written last, and one atomic rename puts the directory at ``path`` (the parent
  is then fsynced). After a crash at any moment, ``load(path)`` returns the previous checkpoint
  or the new one, never a mix. Leftovers of killed saves are deleted by the next save.
- **Checked.** ``load`` checks every file's size and SHA-256 against the manifest before using
  it; a damaged, truncated, missing or altered file raises :class:`CheckpointError` naming the
  file and what is wrong.
- **Exact.** Every leaf's bits come back (NaN payloads, -0.0, bfloat16, typed PRNG keys), and so
  does the tree, static fields included (``num_envs``, a packed storage's item description, a
  slice sampler's ``slice_len``): a loaded state samples exactly what the saved one would have
  (sampler state, priorities, epochs).
- **Matched.** With ``like=`` (a state of the buffer you resume, e.g. ``rb.init(example)``, or
  its ``jax.eval_shape``) a checkpoint of another configuration (capacity, ``ndim``, sampler,
  writer or storage kind, item shapes or dtypes) raises ``ValueError`` at load time naming the
  first difference; the result takes the template's tree, and its leaves the template's
  shardings.
- **No pickle.** Only classes defined in ``functional_rb`` modules are rebuilt, by name.

On disk
-------
``path/`` holds ``frb_manifest.json`` and one raw file per array: ``leaf_00000.bin``, ... (C
order, the leaf's dtype, native byte order) in ``jax.tree_util`` flatten order, and
``host_00000.bin``, ... for the items of host-backed states. The manifest (plain JSON) holds
the envelope (``files``: each file's size and SHA-256; ``manifest_sha256``: its own checksum)
and, under ``meta``: ``format`` (``"functional_rb.checkpoint"``), ``version`` (3), the tree
(containers, dataclass names, static fields), and per leaf its path
(``jax.tree_util.keystr``), dtype, shape and file.

Host-backed states
------------------
A state node whose items live outside its array leaves implements :class:`HostBacked`
(:class:`functional_rb.memmap.MemmapStorageState` does): ``save`` copies its items into the
checkpoint, so the checkpoint is self-contained, and ``load`` writes them back into the
node's storage: the template's (``like=``) or, without one, the one recorded at save time.

The envelope, for other writers
-------------------------------
The atomic, checked directory is available to any writer (the torch adapters use it for
TorchRL-layout dumps)::

    with frb.checkpoint.staged(path) as stage:   # stage.directory: a new, empty sibling
        write_any_files(stage.directory)         # any layout, any subdirectories
        stage.meta["layout"] = "torchrl"         # optional JSON stored in the manifest
    # here: files fsynced and hashed, manifest written last, renamed onto path atomically

    manifest = frb.checkpoint.verify(path)       # sizes + SHA-256 of every listed file
    read_files_from(manifest.directory)          # path (see below)

- ``staged(path, replace_foreign=False)`` yields a :class:`Stage` (``directory``, ``meta``,
  ``write(name, bytes)`` which hashes while writing; other files are read back and hashed at
  the end). An exception in the block leaves ``path`` untouched. ``path`` may be missing, an
  empty directory or an earlier checkpoint; a directory without a manifest is replaced only
  with ``replace_foreign=True``, a file never.
- ``verify(path, data=True)`` returns a :class:`Manifest` (``directory``, ``meta``, ``files``,
  ``read(name)``, ``check_file(name)``). It raises :class:`NoManifestError` (a subclass of
  :class:`CheckpointError`) when the directory has no manifest: not damage, but a directory
  written by something else (a TorchRL dump), which the caller may read its own way; and
  :class:`CheckpointError` for damage, ``FileNotFoundError`` when nothing is at ``path``.
  ``data=False`` checks sizes only. ``manifest.directory`` is ``path`` except after a save
  killed on a filesystem without atomic exchange (see :mod:`functional_rb._atomic`).

Orbax
-----
A device-backed state (DeviceStorage, TEDStorage) is a plain PyTree of arrays with its static
fields in the tree definition, so ``orbax.checkpoint`` saves it, beside your parameters if you
like, and restores it given a template (``pip install functional-rb[orbax]``)::

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(d, {"params": params, "rb": without_empty_leaves(state)})
    tree = ckptr.restore(d, {"params": abstract_params,
                             "rb": without_empty_leaves(jax.eval_shape(lambda: state))})
    state = with_empty_leaves(tree["rb"], like=rb.init(example))

Orbax refuses arrays with no elements, which some states hold (a sum tree no larger than its
fan-out, ``TEDStorage``'s ``dist`` when ``frame_stack=1``): :func:`without_empty_leaves`
replaces them with ``None`` and :func:`with_empty_leaves` puts them back (a state with none
needs neither). Orbax stores array leaves only: a ``MemmapStorage`` state's items are in its
files, so use this module or ``MemmapStorage.checkpoint`` for it.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._atomic import (MANIFEST, CheckpointError, Manifest, NoManifestError, Stage,
                                   identity, staged, verify)
from functional_rb._errors import keystr
from functional_rb.storages import ItemSpec

FORMAT = "functional_rb.checkpoint"
VERSION = 3  # 3: a directory in the checked envelope (2 was a single .npz file)
_ALLOWED_MODULE = "functional_rb"
_MATCH_FIX = ("Pass a template built by the same buffer configuration (capacity, ndim, "
              "storage, writer, sampler) and example as the saved state, or like=None.")

__all__ = ("save", "load", "staged", "verify", "CheckpointError", "NoManifestError",
           "HostBacked", "Manifest", "Stage", "without_empty_leaves", "with_empty_leaves",
           "FORMAT", "VERSION", "MANIFEST")


@runtime_checkable
class HostBacked(Protocol):
    """A state node whose items live outside its array leaves (e.g. in files).

    ``snapshot_arrays()``: ``{name: numpy array}``, everything needed to rebuild the items
    (C-contiguous; may be memory maps). ``mismatch(other, where)``: why ``other`` (a node of
    the same class from a template, at path ``where``) cannot take this node's items (a
    sentence naming the difference), or None. ``restore_arrays(arrays)``: write the arrays of
    ``snapshot_arrays`` (read-only, possibly memory maps) back into this node's storage;
    returns the node to use from then on.
    """

    def snapshot_arrays(self) -> dict: ...

    def mismatch(self, other, where: str) -> str | None: ...

    def restore_arrays(self, arrays: dict) -> Any: ...


def _is_host(x) -> bool:
    return isinstance(x, HostBacked) and dataclasses.is_dataclass(x)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _class_name(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(name: str, where: str):
    module, qualname = name.split(":")
    if module.split(".")[0] != _ALLOWED_MODULE:
        raise ValueError(f"{where}: refusing to rebuild class {name!r}: only classes from "
                         f"{_ALLOWED_MODULE} modules are allowed.")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise ValueError(f"{where}: {name!r} is not a dataclass.")
    return obj


# ------------------------------------------------------------------------------ encoding
def _encode_static(value, where: str):
    """A static field's value as JSON that keeps tuples, dicts with any keys, tree
    definitions and functional_rb's frozen dataclasses (e.g. an item description)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, np.dtype):
        return {"dtype": value.name}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return {type(value).__name__: [_encode_static(v, f"{where}[{i}]")
                                       for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[_encode_static(k, where), _encode_static(v, f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    if isinstance(value, jax.tree_util.PyTreeDef):
        stand_ins = jax.tree_util.tree_unflatten(value, [0] * value.num_leaves)
        return {"treedef": _encode(stand_ins, [], [], where)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if cls.__module__.split(".")[0] == _ALLOWED_MODULE:
            return {"static_dataclass": _class_name(cls),
                    "fields": {f.name: _encode_static(getattr(value, f.name), f"{where}.{f.name}")
                               for f in dataclasses.fields(value)}}
    raise TypeError(f"checkpoint.save: static field {where}={value!r} cannot be stored (JSON "
                    "scalars, tuples, lists, dicts, tree definitions and functional_rb "
                    "dataclasses only).")


def _decode_static(enc, where: str):
    if not isinstance(enc, dict):
        return enc
    if "static_dataclass" in enc:
        cls = _import_class(enc["static_dataclass"], where)
        return cls(**{k: _decode_static(v, where) for k, v in enc["fields"].items()})
    (kind, body), = enc.items()
    if kind in ("list", "tuple"):
        out = [_decode_static(v, where) for v in body]
        return out if kind == "list" else tuple(out)
    if kind == "dict":
        return {_decode_static(k, where): _decode_static(v, where) for k, v in body}
    if kind == "dtype":
        return jnp.dtype(body)
    if kind == "treedef":
        return jax.tree_util.tree_structure(_decode(body, _StandIns(), [], where))
    raise ValueError(f"{where}: unknown static value {enc!r} in the manifest.")


class _StandIns:
    """Leaves for a decoded tree definition: fresh objects (any non-container is a leaf)."""

    def pop(self, _=0):
        return object()


def _encode(node, leaves: list, hosts: list, where: str):
    """JSON description of ``node``; appends its array leaves to ``leaves`` in flatten order
    and its host-backed nodes to ``hosts``."""
    if node is None:
        return {"t": "none"}
    if isinstance(node, dict):
        keys = sorted(node)  # jax flattens dicts in sorted-key order
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"checkpoint.save: dict keys must be strings at {where}, got {keys!r}")
        return {"t": "dict", "k": keys,
                "c": [_encode(node[k], leaves, hosts, f"{where}[{k!r}]") for k in keys]}
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        return {"t": type(node).__name__,
                "c": [_encode(v, leaves, hosts, f"{where}[{i}]") for i, v in enumerate(node)]}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        cls = type(node)
        if cls.__module__.split(".")[0] != _ALLOWED_MODULE:
            raise TypeError(
                f"checkpoint.save: {where} is a {cls.__module__}.{cls.__qualname__}; only state "
                f"classes defined in {_ALLOWED_MODULE} modules can be checkpointed (loading "
                "rebuilds them by name). Convert it to dicts/arrays first.")
        data, static = [], {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.metadata.get("static", False):
                static[f.name] = _encode_static(value, f"{where}.{f.name}")
            else:
                data.append([f.name, _encode(value, leaves, hosts, f"{where}.{f.name}")])
        desc = {"t": "dataclass", "cls": _class_name(cls), "data": data, "static": static}
        if _is_host(node):
            desc["host"] = len(hosts)
            hosts.append((where, node))
        return desc
    if isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        leaves.append(node)
        return {"t": "leaf"}
    raise TypeError(f"checkpoint.save: cannot store {where} of type {type(node).__name__}; a "
                    "state holds arrays in dicts, lists, tuples and functional_rb dataclasses.")


def _decode(desc, leaves, hosts: list, where: str):
    t = desc["t"]
    if t == "none":
        return None
    if t == "leaf":
        return leaves.pop(0)
    if t == "dict":
        return {k: _decode(c, leaves, hosts, where) for k, c in zip(desc["k"], desc["c"])}
    if t in ("list", "tuple"):
        out = [_decode(c, leaves, hosts, where) for c in desc["c"]]
        return out if t == "list" else tuple(out)
    if t == "dataclass":
        cls = _import_class(desc["cls"], where)
        kwargs = {name: _decode(c, leaves, hosts, where) for name, c in desc["data"]}
        kwargs.update({name: _decode_static(v, where) for name, v in desc["static"].items()})
        node = cls(**kwargs)
        if "host" in desc:
            hosts.append(node)
        return node
    raise ValueError(f"{where}: unknown node type {t!r} in the manifest.")


# ------------------------------------------------------------------------------ save
def _leaf_record(x) -> tuple[dict, np.ndarray]:
    if _is_key(x):
        data = np.asarray(jax.random.key_data(x))
        meta = {"key_impl": str(jax.random.key_impl(x))}
    else:
        data = np.asarray(x)
        meta = {}
    meta.update(dtype=jnp.dtype(data.dtype).name, shape=list(data.shape))
    # (np.ascontiguousarray would turn a 0-d leaf into shape [1])
    return meta, np.array(data, order="C", copy=None).reshape(-1).view(np.uint8)


def save(path: str | os.PathLike, state: Any, *, meta: dict | None = None) -> None:
    """Write ``state`` (a ``BufferState`` or any tree of arrays in dicts/lists/tuples and
    ``functional_rb`` dataclasses) to the directory ``path``, bit-exactly and atomically.
    ``meta``: optional JSON-serialisable data of yours, stored in the manifest and read back
    by ``verify(path).meta["user"]``.

    Array leaves are copied to host memory; host-backed nodes (``MemmapStorage``) have their
    items copied into the checkpoint. Raises ``TypeError`` naming the offending node for
    anything that cannot be stored without pickle, before anything is written.
    """
    leaves: list = []
    hosts: list = []
    tree = _encode(state, leaves, hosts, "state")
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if len(paths) != len(leaves):  # pragma: no cover - a node type jax flattens differently
        raise TypeError("checkpoint.save: the state holds a node type whose flattening differs "
                        f"from jax.tree_util's ({len(leaves)} vs {len(paths)} leaves).")
    with staged(path, where="checkpoint.save") as stage:
        records = []
        for i, (p, x) in enumerate(zip(paths, leaves)):
            record, raw = _leaf_record(x)
            name = f"leaf_{i:05d}.bin"
            stage.write(name, raw)
            records.append(dict(record, path=p, file=name))
        host_records = []
        for k, (where, node) in enumerate(hosts):
            for key, arr in node.snapshot_arrays().items():
                arr = np.asarray(arr)
                name = f"host_{len(host_records):05d}.bin"
                stage.write(name, np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                host_records.append({"node": k, "name": key, "path": where, "file": name,
                                     "dtype": arr.dtype.name, "shape": list(arr.shape)})
        stage.meta.update(format=FORMAT, version=VERSION, byteorder=sys.byteorder, tree=tree,
                          leaves=records, host=host_records, user=meta)


# ------------------------------------------------------------------------------ load
def _array_from(manifest: Manifest, rec: dict, data) -> np.ndarray:
    dtype = jnp.dtype(rec["dtype"])
    shape = tuple(rec["shape"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise CheckpointError(manifest.where, manifest.path(rec["file"]),
                              f"has {len(data)} bytes, expected {expected} for "
                              f"{dtype.name}{list(shape)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _read_state(manifest: Manifest):
    """``(rebuilt state, [(host node, {name: array})])`` from a checked manifest; every file
    is checked against its checksum before use."""
    meta, where = manifest.meta, manifest.where
    mfile = manifest.path(MANIFEST)
    if meta.get("format") != FORMAT:
        raise CheckpointError(where, mfile, f"describes a {meta.get('format')!r}, not a "
                              f"{FORMAT!r} (a directory written by another program?)")
    if meta.get("version") != VERSION:
        raise CheckpointError(where, mfile, f"is {FORMAT} version {meta.get('version')!r}; "
                              f"this functional_rb reads version {VERSION}")
    if meta.get("byteorder") != sys.byteorder:
        raise CheckpointError(where, mfile, f"was written on a {meta.get('byteorder')}-endian "
                              f"machine; this one is {sys.byteorder}-endian")
    leaves = []
    for rec in meta["leaves"]:
        arr = _array_from(manifest, rec, manifest.read(rec["file"]))
        if "key_impl" in rec:
            leaves.append(jax.random.wrap_key_data(jnp.asarray(arr), impl=rec["key_impl"]))
        else:
            leaves.append(arr)
    host_nodes: list = []
    state = _decode(meta["tree"], list(leaves), host_nodes, where)
    arrays: list[dict] = [{} for _ in host_nodes]
    for rec in meta["host"]:
        manifest.check_file(rec["file"])
        dtype, shape = jnp.dtype(rec["dtype"]), tuple(rec["shape"])
        if manifest.files[rec["file"]]["size"] == 0:
            arr = np.zeros(shape, dtype)
        else:
            arr = np.memmap(manifest.path(rec["file"]), dtype=dtype, mode="r", shape=shape)
        arrays[rec["node"]][rec["name"]] = arr
    return state, arrays


def _spec_str(x) -> str:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return f"{jnp.dtype(dtype).name}{list(np.shape(x))}"


def _item_difference(a, b, where: str) -> str:
    """A sentence naming how two item descriptions (``ItemSpec``-like) differ."""
    sa = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(a.shapes())[0]}
    sb = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(b.shapes())[0]}
    for p in sa:
        if p in sb and (sa[p].shape, sa[p].dtype) != (sb[p].shape, sb[p].dtype):
            return (f"the stored item's leaf {where}{p} is {_spec_str(sa[p])} in the "
                    f"checkpoint, expected {_spec_str(sb[p])} from the template (a different "
                    "example?)")
    return (f"the stored item ({where}) has leaves {sorted(sa)} in the checkpoint, "
            f"{sorted(sb)} in the template (a different example?)")


def _is_node(x) -> bool:
    """A container of the trees ``save`` stores (not a leaf)."""
    return x is None or isinstance(x, (dict, list, tuple)) or (
        dataclasses.is_dataclass(x) and not isinstance(x, type))


def _difference(saved, like, where: str) -> str | None:
    """The first difference between a loaded state and a template, as a sentence."""
    if _is_host(saved) or _is_host(like):
        if type(saved) is not type(like):
            return (f"{where} is a {type(saved).__name__} in the checkpoint, a "
                    f"{type(like).__name__} in the template")
        return saved.mismatch(like, where)
    if not (_is_node(saved) or _is_node(like)):
        if tuple(np.shape(saved)) != tuple(np.shape(like)) or _spec_str(saved) != _spec_str(like):
            return (f"leaf {where} is {_spec_str(saved)} in the checkpoint, expected "
                    f"{_spec_str(like)} from the template (a different capacity or example?)")
        return None
    if type(saved) is not type(like):
        return (f"{where} is a {type(saved).__name__} in the checkpoint, a "
                f"{type(like).__name__} in the template")
    if saved is None:
        return None
    if isinstance(saved, dict):
        if sorted(saved) != sorted(like):
            return (f"{where} has keys only in the checkpoint: "
                    f"{sorted(set(saved) - set(like))}, missing from the checkpoint: "
                    f"{sorted(set(like) - set(saved))}")
        for k in sorted(saved):
            found = _difference(saved[k], like[k], f"{where}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(saved, (list, tuple)):
        if len(saved) != len(like):
            return f"{where} has {len(saved)} entries in the checkpoint, {len(like)} in the template"
        for i, (a, b) in enumerate(zip(saved, like)):
            found = _difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    if dataclasses.is_dataclass(saved):  # static fields first: they explain the leaves
        fields = sorted(dataclasses.fields(saved), key=lambda f: not f.metadata.get("static"))
        for f in fields:
            a, b = getattr(saved, f.name), getattr(like, f.name)
            if not f.metadata.get("static", False):
                found = _difference(a, b, f"{where}.{f.name}")
            elif a == b:
                found = None
            elif isinstance(a, ItemSpec) and isinstance(b, ItemSpec):
                found = _item_difference(a, b, f"{where}.{f.name}")
            else:
                found = f"{where}.{f.name} is {a!r} in the checkpoint, {b!r} in the template"
            if found:
                return found
    return None


def _place(x, template):
    """A loaded leaf as a JAX array, on the template leaf's sharding when it has one."""
    sharding = getattr(template, "sharding", None)
    if sharding is not None:
        return jax.device_put(x, sharding)
    return jnp.asarray(x)


def _adopt(saved, like):
    """``like``'s tree (its host nodes' locations, its leaves' shardings) with ``saved``'s
    leaves; the two have no difference by :func:`_difference`."""
    def pick(s, t):
        if _is_host(s):  # the template's node (its storage), the saved dynamic leaves
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(t),
                                                jax.tree_util.tree_leaves(s))
        return _place(s, t)
    return jax.tree_util.tree_map(pick, saved, like, is_leaf=_is_host)


def _load_once(path, like):
    manifest = verify(path, data=False, where="checkpoint.load")
    state, arrays = _read_state(manifest)
    if like is None:
        state = jax.tree_util.tree_map(jnp.asarray, state)
    else:
        problem = _difference(state, like, "state")
        if problem:
            raise ValueError(f"checkpoint.load: {problem}. {_MATCH_FIX}")
        state = _adopt(state, like)
    host_nodes = [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_host) if _is_host(x)]
    if not host_nodes:
        return state
    restored = iter([node.restore_arrays(a) for node, a in zip(host_nodes, arrays)])
    return jax.tree_util.tree_map(lambda x: next(restored) if _is_host(x) else x, state,
                                  is_leaf=_is_host)


def load(path: str | os.PathLike, like: Any = None) -> Any:
    """Read a state written by :func:`save`; leaves come back as JAX arrays, bit-exact.

    Args:
      path: the checkpoint directory.
      like: optional template: a state (e.g. ``rb.init(example)``) or its
        ``jax.eval_shape``. The checkpoint must then have the same tree (containers, state
        classes, static fields such as ``num_envs``), leaf shapes and dtypes; a difference
        raises ``ValueError`` naming it. The result has the template's tree and shardings,
        and host-backed nodes restore into the template's storage (its directory).

    Raises :class:`CheckpointError` naming the file when a file is damaged, truncated,
    missing or altered (checked before anything is used or written), :class:`NoManifestError`
    when ``path`` is a directory without a manifest, ``FileNotFoundError`` when nothing is
    there. A save that replaces ``path`` while it is being read is retried.
    """
    for attempt in range(3):
        before = identity(path)
        try:
            return _load_once(path, like)
        except (CheckpointError, FileNotFoundError):
            if attempt == 2 or identity(path) == before:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------------------ orbax
def _empty(x) -> bool:
    return any(d == 0 for d in np.shape(x))


def without_empty_leaves(state: Any) -> Any:
    """``state`` (or its ``jax.eval_shape``) with every leaf that has no elements replaced by
    ``None``, for savers that refuse such arrays (Orbax); undone by :func:`with_empty_leaves`."""
    return jax.tree_util.tree_map(lambda x: None if _empty(x) else x, state)


def with_empty_leaves(tree: Any, like: Any) -> Any:
    """Inverse of :func:`without_empty_leaves`: ``like``'s tree with ``tree``'s leaves, and
    zero-element arrays of ``like``'s shapes and dtypes where ``tree`` has ``None``."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    got = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
    if len(got) != len(paths):
        raise ValueError(f"checkpoint.with_empty_leaves: the tree has {len(got)} leaves, the "
                         f"template {len(paths)}; pass the template of the saved state.")
    out = []
    for (p, t), x in zip(paths, got):
        if x is None:
            if not _empty(t):
                raise ValueError(f"checkpoint.with_empty_leaves: leaf {keystr(p)} is None but "
                                 f"the template's is {_spec_str(t)}, not empty.")
            x = jnp.zeros(np.shape(t), t.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
