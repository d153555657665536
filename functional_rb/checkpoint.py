"""Save and load a buffer state, bit-exactly, without pickle.

A checkpoint is one ``.npz`` file (written atomically) holding:

- ``manifest``: UTF-8 JSON with the format version, the state's tree (dicts, lists, tuples,
  ``None`` and registered dataclasses from ``functional_rb`` modules, with their static fields
  such as ``num_envs`` or a packed storage's item description), and per leaf its path
  (``jax.tree_util.keystr``), dtype and shape;
- ``leaf_00000``, ``leaf_00001``, ...: each leaf's raw bytes (``uint8``), so every bit survives
  (NaN payloads, -0.0, bfloat16), in ``jax.tree_util`` flatten order.

Loading never unpickles anything (``allow_pickle=False``) and only rebuilds classes that live in
``functional_rb`` modules. Typical use::

    frb.checkpoint.save("rb.npz", state)
    state = frb.checkpoint.load("rb.npz")                    # the tree from the manifest
    state = frb.checkpoint.load("rb.npz", like=rb.init(ex))  # ... checked against a template

Typed PRNG keys in a state are stored as their key data and the name of their implementation.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._errors import keystr
from functional_rb.storages import ItemSpec

FORMAT = "functional_rb.checkpoint"
VERSION = 2  # 2: a packed storage keeps its item description in the manifest, not as leaves
_ALLOWED_MODULE = "functional_rb"

__all__ = ("save", "load", "FORMAT", "VERSION")


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _encode(node, leaves: list, where: str):
    """JSON description of ``node``; appends its array leaves to ``leaves`` in flatten order."""
    if node is None:
        return {"t": "none"}
    if isinstance(node, dict):
        keys = sorted(node)  # jax flattens dicts in sorted-key order
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"checkpoint.save: dict keys must be strings at {where}, got {keys!r}")
        return {"t": "dict", "k": keys,
                "c": [_encode(node[k], leaves, f"{where}[{k!r}]") for k in keys]}
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        return {"t": type(node).__name__,
                "c": [_encode(v, leaves, f"{where}[{i}]") for i, v in enumerate(node)]}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        cls = type(node)
        if not cls.__module__.split(".")[0] == _ALLOWED_MODULE:
            raise TypeError(
                f"checkpoint.save: {where} is a {cls.__module__}.{cls.__qualname__}; only state "
                f"classes defined in {_ALLOWED_MODULE} modules can be checkpointed (loading "
                "rebuilds them by name). Convert it to dicts/arrays first.")
        data, static = [], {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, ItemSpec):
                # a packed storage's item: its containers encoded as any tree (the leaves'
                # stand-ins are not stored), its leaves' item shapes and dtypes beside them
                stand_ins: list = []
                item = jax.tree_util.tree_unflatten(value.treedef, [0] * len(value.leaves))
                static[f.name] = {"item_spec": {
                    "tree": _encode(item, stand_ins, f"{where}.{f.name}"),
                    "leaves": [{"shape": list(shape), "dtype": dtype}
                               for shape, dtype in value.leaves]}}
            elif f.metadata.get("static", False):
                try:
                    json.dumps(value)
                except TypeError as e:
                    raise TypeError(
                        f"checkpoint.save: static field {where}.{f.name}={value!r} is not JSON "
                        "serialisable (ints, floats, strings, lists only).") from e
                static[f.name] = value
            else:
                data.append([f.name, _encode(value, leaves, f"{where}.{f.name}")])
        return {"t": "dataclass", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "data": data, "static": static}
    if isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        leaves.append(node)
        return {"t": "leaf"}
    raise TypeError(f"checkpoint.save: cannot store {where} of type {type(node).__name__}; a "
                    "state holds arrays in dicts, lists, tuples and functional_rb dataclasses.")


def _leaf_record(x) -> tuple[dict, np.ndarray]:
    if _is_key(x):
        impl = str(jax.random.key_impl(x))
        data = np.asarray(jax.random.key_data(x))
        meta = {"key_impl": impl}
    else:
        data = np.asarray(x)
        meta = {}
    meta.update(dtype=jnp.dtype(data.dtype).name, shape=list(data.shape))
    # (np.ascontiguousarray would turn a 0-d leaf into shape [1])
    return meta, np.array(data, order="C").reshape(-1).view(np.uint8)


def save(path: str | os.PathLike, state: Any) -> None:
    """Write ``state`` (a ``BufferState`` or any tree of arrays in dicts/lists/tuples and
    ``functional_rb`` dataclasses) to the ``.npz`` file ``path``, bit-exactly and atomically.

    Array leaves are copied to host memory. Raises ``TypeError`` naming the offending node for
    anything that cannot be stored without pickle.
    """
    leaves: list = []
    tree = _encode(state, leaves, "state")
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if len(paths) != len(leaves):  # pragma: no cover - a node type jax flattens differently
        raise TypeError("checkpoint.save: the state holds a node type whose flattening differs "
                        f"from jax.tree_util's ({len(leaves)} vs {len(paths)} leaves).")
    records, arrays = [], {}
    for i, (p, x) in enumerate(zip(paths, leaves)):
        meta, raw = _leaf_record(x)
        records.append(dict(meta, path=p))
        arrays[f"leaf_{i:05d}"] = raw
    manifest = {"format": FORMAT, "version": VERSION, "tree": tree, "leaves": records}
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode("utf-8"), np.uint8)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _decode(desc, leaves: list):
    t = desc["t"]
    if t == "none":
        return None
    if t == "leaf":
        return leaves.pop(0)
    if t == "dict":
        return {k: _decode(c, leaves) for k, c in zip(desc["k"], desc["c"])}
    if t in ("list", "tuple"):
        out = [_decode(c, leaves) for c in desc["c"]]
        return out if t == "list" else tuple(out)
    if t == "dataclass":
        module, qualname = desc["cls"].split(":")
        if module.split(".")[0] != _ALLOWED_MODULE:
            raise ValueError(f"checkpoint.load: refusing to rebuild class {desc['cls']!r}: only "
                             f"classes from {_ALLOWED_MODULE} modules are allowed.")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
            raise ValueError(f"checkpoint.load: {desc['cls']!r} is not a dataclass.")
        kwargs = {name: _decode(c, leaves) for name, c in desc["data"]}
        for name, value in desc["static"].items():
            if isinstance(value, dict) and "item_spec" in value:
                spec = value["item_spec"]
                value = ItemSpec.from_tree(_decode(spec["tree"], [
                    jax.ShapeDtypeStruct(tuple(x["shape"]), jnp.dtype(x["dtype"]))
                    for x in spec["leaves"]]))
            kwargs[name] = value
        return obj(**kwargs)
    raise ValueError(f"checkpoint.load: unknown node type {t!r} in the manifest.")


def _read(path) -> tuple[dict, list]:
    with np.load(os.fspath(path), allow_pickle=False) as z:
        if "manifest" not in z.files:
            raise ValueError(f"checkpoint.load: {os.fspath(path)!r} is not a functional_rb "
                             "checkpoint (no manifest).")
        manifest = json.loads(z["manifest"].tobytes().decode("utf-8"))
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"checkpoint.load: unsupported checkpoint format "
                             f"{manifest.get('format')!r} version {manifest.get('version')!r}; "
                             f"this library reads {FORMAT!r} version {VERSION}.")
        leaves = []
        for i, rec in enumerate(manifest["leaves"]):
            raw = z[f"leaf_{i:05d}"]
            dtype = jnp.dtype(rec["dtype"])
            arr = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(tuple(rec["shape"]))
            if "key_impl" in rec:
                arr = jax.random.wrap_key_data(jnp.asarray(arr), impl=rec["key_impl"])
            else:
                arr = jnp.asarray(arr)
            leaves.append(arr)
    return manifest, leaves


def _spec_str(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _static_difference(saved, like, where: str) -> str:
    """A sentence naming the first static field that differs between two states ("" if none
    is found, e.g. the containers differ)."""
    if not (dataclasses.is_dataclass(saved) and type(saved) is type(like)):
        return ""
    for f in dataclasses.fields(saved):
        a, b = getattr(saved, f.name), getattr(like, f.name)
        if not f.metadata.get("static", False):
            found = _static_difference(a, b, f"{where}.{f.name}")
            if found:
                return found
        elif a != b and isinstance(a, ItemSpec) and isinstance(b, ItemSpec):
            # an item description: name the first item leaf whose shape, dtype or path differs
            sa = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(a.shapes())[0]}
            sb = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(b.shapes())[0]}
            for p in sa:
                if p in sb and (sa[p].shape, sa[p].dtype) != (sb[p].shape, sb[p].dtype):
                    return (f"field: the stored item's leaf {where}.{f.name}{p} is "
                            f"{_spec_str(sa[p])} in the checkpoint, expected {_spec_str(sb[p])} "
                            "from the template (a different example?).")
            return (f"field: the stored item ({where}.{f.name}) has leaves "
                    f"{sorted(sa)} in the checkpoint, {sorted(sb)} in the template (a "
                    "different example?).")
        elif a != b:
            return (f"field: {where}.{f.name} is {a!r} in the checkpoint, {b!r} in the "
                    "template.")
    return ""


def load(path: str | os.PathLike, like: Any = None) -> Any:
    """Read a state written by :func:`save`; leaves come back as JAX arrays, bit-exact.

    Args:
      path: the ``.npz`` file.
      like: optional template: a state (e.g. ``rb.init(example)``) or its
        ``jax.eval_shape``. When given, the checkpoint must have the same tree (including static
        fields such as ``num_envs``), leaf paths, shapes and dtypes, and the result uses the
        template's tree; a mismatch raises ``ValueError`` naming the leaf.
    """
    manifest, leaves = _read(path)
    if like is None:
        state = _decode(manifest["tree"], list(leaves))
        got = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        want = [r["path"] for r in manifest["leaves"]]
        if got != want:  # pragma: no cover - a class whose fields changed since saving
            raise ValueError(f"checkpoint.load: rebuilt leaves {got} differ from the saved {want}.")
        return state
    like_leaves, like_def = jax.tree_util.tree_flatten_with_path(like)
    saved_paths = [r["path"] for r in manifest["leaves"]]
    like_paths = [keystr(p) for p, _ in like_leaves]
    if like_paths != saved_paths:
        raise ValueError(
            f"checkpoint.load: the template's leaves differ from the checkpoint's. Missing from "
            f"the checkpoint: {sorted(set(like_paths) - set(saved_paths))}; only in the "
            f"checkpoint: {sorted(set(saved_paths) - set(like_paths))}. Pass a template built "
            "with the same buffer configuration and example (or like=None).")
    rebuilt = _decode(manifest["tree"], list(leaves))
    if jax.tree_util.tree_structure(rebuilt) != jax.tree_util.tree_structure(like):
        what = _static_difference(rebuilt, like, "state")
        raise ValueError(
            "checkpoint.load: the template's tree differs from the checkpoint's in a static "
            + (what if what else
               f"field or container type (checkpoint: {jax.tree_util.tree_structure(rebuilt)}, "
               f"template: {jax.tree_util.tree_structure(like)}); e.g. a different num_envs."))
    for (p, t), x in zip(like_leaves, leaves):
        t_shape = tuple(np.shape(t))
        t_dtype = t.dtype if hasattr(t, "dtype") else np.asarray(t).dtype
        if tuple(x.shape) != t_shape or x.dtype != t_dtype:
            raise ValueError(
                f"checkpoint.load: leaf {keystr(p)} is {x.dtype}{list(x.shape)} in the "
                f"checkpoint, expected {t_dtype}{list(t_shape)} from the template (a different "
                "capacity or example?).")
    return jax.tree_util.tree_unflatten(like_def, leaves)
