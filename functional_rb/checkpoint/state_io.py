"""Save and load a state: the tree described by :mod:`~functional_rb.checkpoint.codec`, its arrays in
one data file (or shard files), inside the envelope of :mod:`~functional_rb.checkpoint.atomic`."""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import hugepages
from functional_rb._internal.errors import check_not_consumed, keystr
from functional_rb.checkpoint import legacy, sharded_io
from functional_rb.checkpoint.atomic import (
    MANIFEST,
    CheckpointError,
    Manifest,
    NoManifestError,
    Stage,
    identity,
    staged,
    verify,
)
from functional_rb.checkpoint.codec import (
    HostBacked,
    decode,
    difference,
    encode,
    is_host,
    is_key,
    spec_str,
)

FORMAT = "functional_rb.checkpoint"
VERSION = (
    4  # 4: leaves split over devices stored shard by shard (functional_rb.checkpoint.sharded_io)
)
READS = (3, 4)  # 3: a directory in the checked envelope, every leaf whole (2 was one .npz file)
DATA = "data.bin"
_ALIGN = 64  # each array starts at a multiple of 64 bytes of the data file
_MATCH_FIX = (
    "Pass a template built by the same buffer configuration (capacity, ndim, "
    "storage, writer, sampler) and example as the saved state, or like=None."
)

__all__ = (
    "save",
    "load",
    "staged",
    "verify",
    "CheckpointError",
    "NoManifestError",
    "HostBacked",
    "Manifest",
    "Stage",
    "without_empty_leaves",
    "with_empty_leaves",
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "DATA",
)


# ------------------------------------------------------------------------------ save
def _leaf_record(x) -> tuple[dict, np.ndarray]:
    if is_key(x):
        data = np.asarray(jax.random.key_data(x))
        meta: dict[str, Any] = {"key_impl": str(jax.random.key_impl(x))}
    else:
        data = np.asarray(x)
        meta = {}
    meta.update(dtype=jnp.dtype(data.dtype).name, shape=list(data.shape))
    return meta, np.array(data, order="C", copy=None)


def save(path: str | os.PathLike, state: Any, *, meta: dict | None = None) -> None:
    """Write ``state`` (a ``BufferState`` or any tree of arrays in dicts/lists/tuples and
    ``functional_rb`` dataclasses) to the directory ``path``, bit-exactly and atomically.
    ``meta``: optional JSON-serialisable data of yours, stored in the manifest and read back
    by ``verify(path).meta["user"]``.

    Array leaves are copied to host memory; host-backed nodes (``MemmapStorage``) have their
    items copied into the checkpoint. Raises ``TypeError`` naming the offending node for
    anything that cannot be stored without pickle, before anything is written.
    """
    check_not_consumed(state, "checkpoint.save")  # not JAX's bare "Array has been deleted"
    leaves: list = []
    hosts: list = []
    tree = encode(state, leaves, hosts, "state")
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if len(paths) != len(leaves):  # pragma: no cover - a node type jax flattens differently
        raise TypeError(
            "checkpoint.save: the state holds a node type whose flattening differs "
            f"from jax.tree_util's ({len(leaves)} vs {len(paths)} leaves)."
        )
    parts: list = []
    offset = 0

    def place(arr: np.ndarray) -> dict:
        nonlocal offset
        pad = -offset % _ALIGN
        if pad:
            parts.append(bytes(pad))
        offset += pad
        raw = arr.reshape(-1).view(np.uint8)
        parts.append(raw)
        where = {"offset": offset, "nbytes": int(raw.size)}
        offset += raw.size
        return where

    records = []
    split = sharded_io.ShardPlacement()  # leaves split over devices: each process writes its shards
    for p, x in zip(paths, leaves):
        if sharded_io.is_split(x):
            records.append(split.record(p, x))
            continue
        record, data = _leaf_record(x)
        records.append(dict(record, path=p, **place(data)))
    host_records = []
    for k, (where, node) in enumerate(hosts):
        for key, arr in node.snapshot_arrays().items():
            arr = np.ascontiguousarray(arr)
            host_records.append(
                {
                    "node": k,
                    "name": key,
                    "path": where,
                    "dtype": arr.dtype.name,
                    "shape": list(arr.shape),
                    **place(arr),
                }
            )
    with sharded_io.staged(path, split, where="checkpoint.save") as stage:
        if stage is None:  # a process other than 0 of a multi-process save: its shards only
            return
        stage.write(DATA, *parts)
        stage.meta.update(
            format=FORMAT,
            version=VERSION,
            byteorder=sys.byteorder,
            tree=tree,
            leaves=records,
            host=host_records,
            user=meta,
            processes=jax.process_count(),
        )


# ------------------------------------------------------------------------------ load
def _array_at(manifest: Manifest, buf, rec: dict) -> np.ndarray:
    """The array a record describes, a view into the checked data file's map ``buf``."""
    dtype = jnp.dtype(rec["dtype"])
    shape = tuple(rec["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if rec["nbytes"] != nbytes or rec["offset"] + nbytes > len(buf):
        raise CheckpointError(
            manifest.where,
            manifest.path(DATA),
            f"does not hold {dtype.name}{list(shape)} at byte {rec['offset']} "
            f"for {rec['path']} (the manifest and the file disagree)",
        )
    return np.frombuffer(
        buf, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=rec["offset"]
    ).reshape(shape)


def _read_state(manifest: Manifest):
    """``(rebuilt state, [{name: array} per host node])`` from a checked manifest; the data
    file is checked against its checksum before anything is used."""
    meta, where = manifest.meta, manifest.where
    mfile = manifest.path(MANIFEST)
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            where,
            mfile,
            f"is not a {FORMAT} manifest (its meta has format "
            f"{meta.get('format')!r}: a directory written by another program "
            "through the envelope?)",
        )
    if meta.get("version") not in READS:
        raise CheckpointError(
            where,
            mfile,
            f"is {FORMAT} version {meta.get('version')!r}; "
            f"this functional_rb reads versions {READS}",
        )
    if meta.get("byteorder") != sys.byteorder:
        raise CheckpointError(
            where,
            mfile,
            f"was written on a {meta.get('byteorder')}-endian "
            f"machine; this one is {sys.byteorder}-endian",
        )
    buf = manifest.mapped(DATA)
    files = sharded_io.Files(manifest)
    leaves: list = []
    for rec in meta["leaves"]:
        if "shards" in rec:  # read when placed, shard by shard
            leaves.append(sharded_io.SplitLeaf(files, rec))
            continue
        arr = np.array(_array_at(manifest, buf, rec))  # a copy: the map may then close
        if "key_impl" in rec:
            leaves.append(jax.random.wrap_key_data(jnp.asarray(arr), impl=rec["key_impl"]))
        else:
            leaves.append(arr)
    host_nodes: list = []
    state = decode(meta["tree"], list(leaves), host_nodes, where)
    arrays: list[dict] = [{} for _ in host_nodes]
    for rec in meta["host"]:
        arrays[rec["node"]][rec["name"]] = _array_at(manifest, buf, rec)
    return state, arrays


def _place(x, template):
    """A loaded leaf as a JAX array, on the template leaf's sharding when it has one; a large
    one on the CPU moved onto huge pages (see :func:`_on_huge_pages`)."""
    if isinstance(x, sharded_io.SplitLeaf):
        return _on_huge_pages(x.restore(template))
    sharding = getattr(template, "sharding", None)
    if sharding is not None:
        return _on_huge_pages(jax.device_put(x, sharding))
    return _on_huge_pages(jnp.asarray(x))


def _on_huge_pages(x):
    """``x`` with its CPU buffers (32 MiB or more) collapsed into huge pages now, as
    ``init`` would have advised them (:mod:`functional_rb._internal.hugepages`).

    The copy into XLA's memory touched every page, so plain advice leaves them small until the
    kernel's ``khugepaged`` gets there (16 MiB per 10 s by default). Measured on one 256 MiB
    leaf (2 cores, load 5): load 0.72-0.99 s without advice, 0.75-1.1 s with plain advice (no
    huge page yet), 1.2-2.1 s collapsed (254 MiB of huge pages); a 1,024-row random gather
    then takes 91 us against 137 us (at 1 GiB 112 against 163), so the collapse pays for
    itself within some 10^4 samples."""
    hugepages.advise(x, collapse=True)
    return x


def _adopt(saved, like):
    """``like``'s tree (its host nodes' locations, its leaves' shardings) with ``saved``'s
    leaves; the two have no difference by ``_codec.difference``."""

    def pick(s, t):
        if is_host(s):  # the template's node (its storage), the saved dynamic leaves
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(t), jax.tree_util.tree_leaves(s)
            )
        return _place(s, t)

    return jax.tree_util.tree_map(pick, saved, like, is_leaf=is_host)


def _load_once(path, like):
    manifest = verify(path, data=False, where="checkpoint.load")
    state, arrays = _read_state(manifest)
    state = legacy.split_ted_pending(state)  # TED files from before state.storage.pending
    state = legacy.add_generations(state, like)  # files from before write generations
    if like is None:
        state = jax.tree_util.tree_map(lambda x: _place(x, None), state)
    else:
        problem = sharded_io.layout_difference(state, like)
        if problem:
            raise ValueError(f"checkpoint.load: {problem}.")
        problem = difference(state, like, "state")
        if problem:
            raise ValueError(f"checkpoint.load: {problem}. {_MATCH_FIX}")
        state = _adopt(state, like)
    host_nodes = [x for x in jax.tree_util.tree_leaves(state, is_leaf=is_host) if is_host(x)]
    if not host_nodes:
        return state
    restored = iter([node.restore_arrays(a) for node, a in zip(host_nodes, arrays)])
    return jax.tree_util.tree_map(
        lambda x: next(restored) if is_host(x) else x, state, is_leaf=is_host
    )


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
    # up to the template's structure: a None that is part of it (a buffer without a rate
    # limiter) is not a leaf, a None where the template has a leaf stands for an empty one
    try:
        got = treedef.flatten_up_to(tree)  # type: ignore[attr-defined]  # jaxlib has no stubs
    except (TypeError, ValueError):
        got = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
        raise ValueError(
            f"checkpoint.with_empty_leaves: the tree has {len(got)} leaves, the "
            f"template {len(paths)}; pass the template of the saved state."
        ) from None
    out = []
    for (p, t), x in zip(paths, got):
        if x is None:
            if not _empty(t):
                raise ValueError(
                    f"checkpoint.with_empty_leaves: leaf {keystr(p)} is None but "
                    f"the template's is {spec_str(t)}, not empty."
                )
            x = jnp.zeros(np.shape(t), t.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
