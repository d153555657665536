"""The vault format on disk: its constants, its names for leaves, and its structure
description in ``metadata.json`` (read and written as plain JSON, never unpickled).

``metadata.json`` holds ``{"version": 1.2, "structure_shape": S, "structure_dtype": D, **user
metadata}``. ``S`` and ``D`` describe the experience PyTree as flashbax's (orbax's
``serialize_tree``) JSON does: named children (dict keys, NamedTuple and dataclass fields)
become JSON objects, sequences (tuples, lists) JSON arrays; the leaves of ``S`` are
``str(shape)`` (``"(4, 256, 3)"``, parsed here as a tuple of integers, never evaluated), those
of ``D`` dtype names. Vaults of flashbax's first format (one ``"structure"`` tree whose leaves
are ``[shape, dtype]``) are read too.

Each leaf is a zarr array named by :func:`leaf_name`, shaped ``[num_envs,
TIME_AXIS_MAX_LENGTH, ...]``, in one OCDBT database at the vault's directory, beside the int32
``[1]`` array ``"vault_index"`` (the time steps written).
"""

from __future__ import annotations

import builtins
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import keystr

PyTree = Any

VERSION = 1.2  # what flashbax 0.1.2 and 0.1.3 write; 1.x is read
METADATA_FILE = "metadata.json"
TIME_AXIS_MAX_LENGTH = 10**13  # flashbax's int(10e12): every array's time axis
DEFAULT_COMPRESSION = {"id": "gzip", "level": 5}
INDEX = "vault_index"  # the datastore holding the number of steps written
MAX_LENGTH = 2**31 - 1  # that number is stored as int32
RESERVED = ("version", "structure_shape", "structure_dtype", "structure")
_SHAPE = re.compile(r"^\(\s*(\d+\s*(,\s*\d+\s*)*,?)?\s*\)$")


class VaultError(ValueError):
    """A vault's files are damaged or inconsistent; the message names the file or leaf.

    >>> from functional_rb.vault import VaultError
    >>> issubclass(VaultError, ValueError)
    True
    """


def tensorstore_module(where: str):
    """The ``tensorstore`` module, or an ``ImportError`` saying how to install it.

    >>> from functional_rb.vault.format import tensorstore_module
    >>> tensorstore_module("example").__name__
    'tensorstore'
    """
    try:
        import tensorstore
    except ImportError as e:
        raise ImportError(
            f"{where}: vaults are zarr arrays written by tensorstore, which is not "
            'installed. Install it with: pip install "functional-rb[vault]"'
        ) from e
    return tensorstore


def spec(base: str, name: str) -> dict:
    """The tensorstore spec of the datastore ``name`` of the vault at ``base`` (flashbax's).

    >>> from functional_rb.vault.format import spec
    >>> spec("/data/v", "obs.")["kvstore"]
    {'driver': 'ocdbt', 'base': 'file:///data/v', 'path': 'obs.'}
    """
    return {
        "driver": "zarr",
        "kvstore": {"driver": "ocdbt", "base": f"file://{base}", "path": name},
    }


# ----------------------------------------------------------------------------- names
def leaf_name(path) -> str:
    """The datastore name of the leaf at the key ``path``: each dict key or attribute name
    followed by a dot; a sequence position adds the dot alone (so a NamedTuple and a dict
    with the same names share a layout, and two leaves of one tuple would collide).

    >>> import jax
    >>> from functional_rb.vault.format import leaf_name
    >>> [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path({"obs": {"x": 0}})[0]]
    ['obs.x.']
    """
    out = ""
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            out += str(key.key)
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out += key.name
        out += "."
    return out


def unique_names(paths, where: str) -> tuple:
    """:func:`leaf_name` of each key path; ``ValueError`` when two leaves would share one.

    >>> import jax
    >>> from functional_rb.vault.format import unique_names
    >>> paths = [p for p, _ in jax.tree_util.tree_flatten_with_path({"a": 0, "b": 1})[0]]
    >>> unique_names(paths, "example")
    ('a.', 'b.')
    """
    names = tuple(leaf_name(p) for p in paths)
    seen: dict = {}
    for path, name in zip(paths, names):
        if name in seen:
            raise ValueError(
                f"{where}: leaves {keystr(seen[name])} and {keystr(path)} would share the "
                f"datastore {name!r}: the vault format names a leaf by its dict keys and "
                "attribute names only, not by sequence positions (flashbax fails the same "
                "way). Put those leaves in a dict or a NamedTuple instead of a tuple or list."
            )
        seen[name] = path
    return names


def _key_name(key, where: str):
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    raise TypeError(
        f"{where}: the experience has a node whose children have no names (key "
        f"{key!r}: a PyTree registered without keys); a vault names each leaf by "
        "its dict keys and attribute names. Use dicts, NamedTuples or dataclasses."
    )


# ----------------------------------------------------------------------------- structure JSON
def encode_structure(pairs: list, where: str):
    """The JSON tree of ``(key path, value)`` pairs, as ``metadata.json`` holds it: objects for
    named children, arrays for sequences, ``value`` at each leaf.

    >>> import jax
    >>> from functional_rb.vault.format import encode_structure
    >>> tree = {"obs": (1, 2), "act": 3}
    >>> encode_structure(jax.tree_util.tree_flatten_with_path(tree)[0], "example")
    {'act': 3, 'obs': [1, 2]}
    """
    if len(pairs) == 1 and not pairs[0][0]:
        return pairs[0][1]

    def new(key):
        return [] if isinstance(key, jax.tree_util.SequenceKey) else {}

    root = new(pairs[0][0][0])
    for path, value in pairs:
        node = root
        for key, after in zip(path, path[1:] + (None,)):
            name = _key_name(key, where)
            child = value if after is None else new(after)
            if isinstance(node, list):
                node.extend([None] * (name + 1 - len(node)))
                node[name] = child if node[name] is None else node[name]
            else:
                node.setdefault(name, child)
            node = node[name]
    return root


def _lookup(tree, path):
    """The node of the JSON tree ``tree`` at the key ``path`` (None when missing)."""
    for key in path:
        name = _key_name(key, "functional_rb.vault")
        if isinstance(tree, dict):
            tree = tree.get(name, tree.get(str(name)))
        elif isinstance(tree, list) and isinstance(name, int) and name < len(tree):
            tree = tree[name]
        else:
            return None
    return tree


def _parse_shape(text, name: str, file: str) -> tuple:
    if not isinstance(text, str) or not _SHAPE.match(text):
        raise VaultError(
            f"functional_rb.vault: {file} records the shape of leaf {name!r} as "
            f"{text!r}, expected a tuple of integers such as '(4, 256, 3)': the "
            "file is damaged or was not written by a vault."
        )
    return tuple(int(d) for d in re.findall(r"\d+", text))


def json_ready(metadata, where: str) -> dict:
    """User metadata as flashbax stores it: JSON scalars as they are, other leaves as their
    ``str``; ``ValueError`` for the format's own keys.

    >>> import numpy as np
    >>> from functional_rb.vault.format import json_ready
    >>> json_ready({"seed": 0, "gamma": np.float32(0.5)}, "example")
    {'gamma': '0.5', 'seed': 0}
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(
            f"{where}: metadata must be a dict (or None), got {type(metadata).__name__}."
        )
    clash = sorted(set(metadata) & set(RESERVED))
    if clash:
        raise ValueError(
            f"{where}: metadata keys {clash} are reserved by the vault format "
            f"(they would replace its structure); rename them, e.g. "
            f"'user_{clash[0]}'."
        )
    return jax.tree_util.tree_map(
        lambda x: x if isinstance(x, (bool, str, int, float, type(None))) else str(x), metadata
    )


def read_metadata(path: str) -> dict:
    """The checked contents of ``<path>/metadata.json``; :class:`VaultError` when it is
    missing, not JSON, lacks the format's fields or has another major version.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> from functional_rb.vault.format import read_metadata
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))})
    >>> read_metadata(store.path)["structure_shape"]
    {'obs': '(2, 5, 3)'}
    """
    where = "functional_rb.vault.open"
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        raise VaultError(
            f"{where}: {path} holds no {METADATA_FILE}: it is not a vault, or its "
            "creation was interrupted. Point at the vault's own directory "
            "(<rel_dir>/<vault_name>/<vault_uid> for flashbax vaults)."
        )
    try:
        with builtins.open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise VaultError(
            f"{where}: {file} is damaged (not valid JSON: {e}); restore it from "
            "a copy of the vault."
        ) from None
    ok = (
        isinstance(meta, dict)
        and isinstance(meta.get("version"), (int, float))
        and (("structure_shape" in meta and "structure_dtype" in meta) or "structure" in meta)
    )
    if not ok:
        raise VaultError(
            f"{where}: {file} lacks the vault's fields (version, structure_shape, "
            "structure_dtype): it is damaged or was not written by a vault."
        )
    if meta["version"] // 1 != VERSION // 1:
        raise VaultError(
            f"{where}: {file} has format version {meta['version']}, expected "
            f"{VERSION // 1:.0f}.x (the versions flashbax 0.1.x writes)."
        )
    return meta


def stored_leaves(meta: dict, file: str) -> tuple:
    """``(JSON tree, {leaf name: (key path, jax.ShapeDtypeStruct)})`` of the structure that
    ``meta`` (the contents of ``file``) records, in the tree's flatten order.

    >>> from functional_rb.vault.format import stored_leaves
    >>> meta = {"structure_shape": {"obs": "(2, 5)"}, "structure_dtype": {"obs": "int8"}}
    >>> stored_leaves(meta, "metadata.json")[1]["obs."][1]
    ShapeDtypeStruct(shape=(2, 5), dtype=int8)
    """
    if "structure_shape" in meta:
        tree = meta["structure_shape"]
        pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
        dtypes = [_lookup(meta["structure_dtype"], p) for p, _ in pairs]
    else:  # flashbax's first format: one tree whose leaves are [shape, dtype]
        tree = meta["structure"]
        pairs = jax.tree_util.tree_flatten_with_path(
            tree,
            is_leaf=lambda x: (
                isinstance(x, list) and len(x) == 2 and all(isinstance(v, str) for v in x)
            ),
        )[0]
        pairs, dtypes = [(p, v[0]) for p, v in pairs], [v[1] for _, v in pairs]
    stored = {}
    for (path, shape), dtype in zip(pairs, dtypes):
        name = leaf_name(path)
        try:
            dtype = np.dtype(jnp.dtype(dtype))
        except TypeError:
            raise VaultError(
                f"functional_rb.vault: {file} records dtype {dtype!r} for leaf "
                f"{name!r}, which is not a dtype name: the file is damaged."
            ) from None
        shape = _parse_shape(shape, name, file)
        if len(shape) < 2 or name in stored:
            raise VaultError(
                f"functional_rb.vault: {file} records leaf {name!r} "
                f"{'twice' if name in stored else f'with shape {shape}'}: a vault "
                "leaf is [num_envs, time, ...], each name once. It is damaged."
            )
        stored[name] = (path, jax.ShapeDtypeStruct(shape, dtype))
    if not stored:
        raise VaultError(f"functional_rb.vault: {file} records no leaves: it is damaged.")
    return tree, stored


# ----------------------------------------------------------------------------- templates
def template_leaves(like, where: str) -> list:
    """``[(key path, jax.ShapeDtypeStruct)]`` of a template (arrays or ShapeDtypeStructs),
    checked: leaves ``[num_envs, T, ...]`` with one ``num_envs``.

    >>> import numpy as np
    >>> from functional_rb.vault.format import template_leaves
    >>> template_leaves({"obs": np.zeros((2, 5, 3))}, "example")[0][1]
    ShapeDtypeStruct(shape=(2, 5, 3), dtype=float64)
    """
    flat = jax.tree_util.tree_flatten_with_path(like)[0]
    if not flat:
        raise ValueError(
            f"{where}: the experience has no array leaves; pass a PyTree of "
            "arrays shaped [num_envs, T, ...], e.g. {'obs': jnp.zeros((4, 100, 3))}."
        )
    out = []
    for path, x in flat:
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        shape = tuple(int(d) for d in np.shape(x))
        if len(shape) < 2:
            raise ValueError(
                f"{where}: leaf {keystr(path)} has shape {shape}; every leaf of a "
                "vault is [num_envs, time, ...]. Add the missing axes, e.g. "
                "x[:, None] for one time step, or reshape to (num_envs, T, ...)."
            )
        out.append((path, jax.ShapeDtypeStruct(shape, dtype)))
    if len({s.shape[0] for _, s in out}) > 1:
        raise ValueError(
            f"{where}: the leaves do not share one num_envs axis: "
            + ", ".join(f"{keystr(p)} {s.shape}" for p, s in out[:8])
            + ". Every leaf is [num_envs, time, ...] with the same num_envs."
        )
    return out


def check_leaf(where: str, path, got, want, *, fix: str, cast: bool = False) -> None:
    """Raise unless ``got`` (a ShapeDtypeStruct) has ``want``'s dtype (``cast``: one of the
    same kind), ``num_envs`` and trailing shape; the time axis (axis 1) may differ.

    >>> import jax, numpy as np
    >>> from functional_rb.vault.format import check_leaf
    >>> s = jax.ShapeDtypeStruct((2, 5, 3), np.float32)
    >>> check_leaf("example", (), jax.ShapeDtypeStruct((2, 9, 3), np.float32), s, fix="")
    """
    got_dtype, want_dtype = np.dtype(got.dtype), np.dtype(want.dtype)
    if got_dtype != want_dtype and not (cast and np.can_cast(got_dtype, want_dtype, "same_kind")):
        kind = ", or a dtype of the same kind, which is cast" if cast else ""
        raise TypeError(
            f"{where}: leaf {keystr(path)} has dtype {got_dtype.name}, expected "
            f"{want_dtype.name} (the vault's{kind}). {fix}"
        )
    if len(got.shape) < 2 or got.shape[:1] + got.shape[2:] != want.shape[:1] + want.shape[2:]:
        tail = "".join(f", {d}" for d in want.shape[2:])
        raise ValueError(
            f"{where}: leaf {keystr(path)} has shape {tuple(got.shape)}, expected "
            f"({want.shape[0]}, T{tail}) (the vault records {tuple(want.shape)}; "
            f"only the time axis may differ). {fix}"
        )


def match_template(stored: dict, like, path: str) -> tuple:
    """Map a template's leaves onto the stored ones by name, checking dtypes and shapes:
    ``(structure in the template's tree, names, key paths)``.

    >>> import numpy as np
    >>> from functional_rb.vault.format import match_template, stored_leaves
    >>> meta = {"structure_shape": {"obs": "(2, 5)"}, "structure_dtype": {"obs": "int8"}}
    >>> stored = stored_leaves(meta, "metadata.json")[1]
    >>> match_template(stored, {"obs": np.zeros((2, 9), np.int8)}, "v")[1]
    ('obs.',)
    """
    where = "functional_rb.vault.open"
    leaves = template_leaves(like, where)
    names = unique_names([p for p, _ in leaves], where)
    fix = (
        "Pass a template with the vault's structure, or like=None to read the structure it "
        "records (nested dicts)."
    )
    for (p, s), name in zip(leaves, names):
        if name not in stored:
            raise ValueError(
                f"{where}: the template's leaf {keystr(p)} (datastore {name!r}) "
                f"is not in the vault at {path}, which holds {sorted(stored)}. "
                f"{fix}"
            )
        check_leaf(where, p, s, stored[name][1], fix=fix)
    extra = sorted(set(stored) - set(names))
    if extra:
        raise ValueError(
            f"{where}: the vault at {path} holds leaves {extra} that the template "
            f"lacks (it has {list(names)}). {fix}"
        )
    structure = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(like), [stored[n][1] for n in names]
    )
    return structure, names, tuple(p for p, _ in leaves)
