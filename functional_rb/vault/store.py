"""Vault I/O: create and open a vault, write time steps into it, read them back.

Every function runs on the host (vault files are written by tensorstore, outside ``jit``); a
:class:`VaultStore` holds the open arrays. Writes of every leaf are issued together and then
awaited, without an event loop, so they also work where one is already running (Jupyter).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal.errors import config_int, config_number, keystr
from functional_rb.vault.format import (
    DEFAULT_COMPRESSION,
    INDEX,
    MAX_LENGTH,
    METADATA_FILE,
    RESERVED,
    TIME_AXIS_MAX_LENGTH,
    VERSION,
    VaultError,
    check_leaf,
    encode_structure,
    json_ready,
    match_template,
    read_metadata,
    spec,
    stored_leaves,
    template_leaves,
    tensorstore_module,
    unique_names,
)

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class VaultStore:
    """An open vault: what :func:`create` and :func:`open` return and the others take.

    Attributes:
      path: the vault's directory (absolute).
      structure: the experience tree (the template's, or nested dicts and lists when opened
        without one) with ``jax.ShapeDtypeStruct`` leaves of the shapes and dtypes recorded
        at creation, ``[num_envs, T, ...]`` (``T``: the time length of the buffer it came
        from; the vault's own time axis is :func:`length` long).
      metadata: the user metadata stored beside the structure (a dict, maybe empty).
      version: the format version in ``metadata.json`` (``1.x``).

    It holds open tensorstore arrays; it is not a PyTree and is never saved.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))})
    >>> store.num_envs, store.structure["obs"].shape
    (2, (2, 5, 3))
    """

    path: str
    structure: PyTree
    metadata: dict
    version: float
    _names: tuple = dataclasses.field(repr=False)
    _arrays: tuple = dataclasses.field(repr=False)
    _index: Any = dataclasses.field(repr=False)

    @property
    def num_envs(self) -> int:
        """The rows of every leaf (flashbax's ``add_batch_size``)."""
        return int(jax.tree_util.tree_leaves(self.structure)[0].shape[0])


def _result(future, name: str, path: str, where: str):
    """``future.result()``; a tensorstore failure becomes a :class:`VaultError`."""
    try:
        return future.result()
    except ValueError as e:
        raise VaultError(
            f"{where}: reading or writing the datastore {name!r} of the vault at "
            f"{path} failed: the vault is damaged (e.g. a truncated or missing "
            f"file under {path}); restore it from a copy. tensorstore: "
            f"{str(e)[:300]}"
        ) from None


# ----------------------------------------------------------------------------- create / open
def create(
    path, like: PyTree, *, compression: dict | None = None, metadata: dict | None = None
) -> VaultStore:
    """Create an empty vault at ``path`` for experience shaped like ``like``.

    Args:
      path: the vault's directory; it must not exist (its parents are created). flashbax's
        ``Vault(vault_name, rel_dir=..., vault_uid=...)`` uses
        ``<cwd>/<rel_dir>/<vault_name>/<vault_uid>``.
      like: a PyTree of arrays or ``jax.ShapeDtypeStruct`` shaped ``[num_envs, T, ...]`` (a
        flashbax buffer's experience, or :func:`structure` of a core buffer state). ``T`` is
        only recorded; the vault's time axis grows with each append.
      compression: a zarr v2 compressor for every leaf (default ``DEFAULT_COMPRESSION``,
        gzip level 5), e.g. ``{"id": "zstd", "level": 3}`` or ``{"id": "blosc", "cname":
        "lz4", "clevel": 5, "shuffle": 1}``.
      metadata: a dict stored in ``metadata.json`` beside the structure (values that are not
        JSON scalars are stored as their ``str``, as flashbax does).

    Returns the open :class:`VaultStore` (length 0). The vault is built in a sibling
    directory and renamed into place: ``path`` holds a complete vault or nothing.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))},
    ...                          metadata={"env": "cartpole"})
    >>> frb.vault.length(store), store.metadata
    (0, {'env': 'cartpole'})
    """
    where = "functional_rb.vault.create"
    ts = tensorstore_module(where)
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise FileExistsError(
            f"{where}: {path} already exists. Open it with "
            "frb.vault.open(path), or choose a new path."
        )
    leaves = template_leaves(like, where)
    names = unique_names([p for p, _ in leaves], where)
    meta = {
        "version": VERSION,
        "structure_shape": encode_structure([(p, str(s.shape)) for p, s in leaves], where),
        "structure_dtype": encode_structure([(p, s.dtype.name) for p, s in leaves], where),
        **json_ready(metadata, where),
    }
    compressor = dict(DEFAULT_COMPRESSION if compression is None else compression)
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{base}.creating-", dir=parent)
    try:
        with builtins.open(os.path.join(stage, METADATA_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())  # tensorstore syncs its own files; this one before the rename
        context = ts.Context()
        try:
            pending = [
                ts.open(
                    {**spec(stage, name), "metadata": {"compressor": compressor}},
                    shape=(s.shape[0], TIME_AXIS_MAX_LENGTH, *s.shape[2:]),
                    dtype=s.dtype.name,
                    create=True,
                    context=context,
                )
                for name, (_, s) in zip(names, leaves)
            ]
            pending.append(
                ts.open(
                    spec(stage, INDEX), dtype=ts.int32, shape=(1,), create=True, context=context
                )
            )
            for future in pending:
                future.result()
        except ValueError as e:
            raise ValueError(
                f"{where}: tensorstore refused to create the arrays (with "
                f"compression={compression!r}): {e}. Pass a zarr v2 compressor, "
                "e.g. {'id': 'gzip', 'level': 5} or {'id': 'zstd', 'level': 3}."
            ) from None
        del pending, context
        os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _sync_directory(parent)  # the rename itself survives a crash
    return open(path, like)


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open(path, like: PyTree = None) -> VaultStore:
    """Open the vault at ``path``, written here or by flashbax (any 1.x format).

    Args:
      path: the vault's directory (the one holding ``metadata.json``).
      like: optional template (arrays or ``jax.ShapeDtypeStruct``, ``[num_envs, T, ...]``):
        reads then return its tree (NamedTuples, dataclasses). It must name every stored
        leaf, each of the vault's dtype, ``num_envs`` and trailing shape (the time axis may
        differ). Without it, reads return the recorded tree: nested dicts (and lists).

    Raises ``FileNotFoundError`` when nothing is at ``path``, :class:`VaultError` when the
    files are damaged, ``ValueError`` / ``TypeError`` when ``like`` does not match.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> path = tempfile.mkdtemp() + "/v"
    >>> _ = frb.vault.create(path, {"obs": jnp.zeros((2, 5, 3))})
    >>> frb.vault.open(path).structure
    {'obs': ShapeDtypeStruct(shape=(2, 5, 3), dtype=float32)}
    """
    where = "functional_rb.vault.open"
    ts = tensorstore_module(where)
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{where}: no vault at {path}. Create one with "
            "frb.vault.create(path, like), or check the path (flashbax "
            "keeps vaults at <cwd>/<rel_dir>/<vault_name>/<vault_uid>)."
        )
    meta = read_metadata(path)
    tree, stored = stored_leaves(meta, os.path.join(path, METADATA_FILE))
    if like is None:
        names = tuple(stored)
        structure = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(tree), [stored[n][1] for n in names]
        )
    else:
        structure, names, _ = match_template(stored, like, path)
    context = ts.Context()
    pending = [ts.open(spec(path, n), open=True, context=context) for n in names + (INDEX,)]
    arrays = [_opened(f, n, path) for f, n in zip(pending, names + (INDEX,))]
    for array, name in zip(arrays, names):
        _check_array(array, stored[name][1], name, path)
    return VaultStore(
        path=path,
        structure=structure,
        metadata={k: v for k, v in meta.items() if k not in RESERVED},
        version=meta["version"],
        _names=names,
        _arrays=tuple(arrays[:-1]),
        _index=arrays[-1],
    )


def _opened(future, name: str, path: str):
    try:
        return future.result()
    except ValueError as e:
        what = "missing" if "NOT_FOUND" in str(e) else "unreadable"
        raise VaultError(
            f"functional_rb.vault.open: the datastore {name!r} of the vault at "
            f"{path} is {what}: the vault is damaged or incomplete; restore it "
            f"from a copy. tensorstore: {str(e)[:300]}"
        ) from None


def _check_array(array, want, name: str, path: str) -> None:
    shape = tuple(int(d) for d in array.domain.shape)
    expected = (want.shape[0], TIME_AXIS_MAX_LENGTH, *want.shape[2:])
    if array.dtype.numpy_dtype != want.dtype or shape != expected:
        raise VaultError(
            f"functional_rb.vault.open: the datastore {name!r} of the vault at "
            f"{path} holds {array.dtype.name}{list(shape)}, but {METADATA_FILE} "
            f"records {want.dtype.name}{list(expected)}: the files are "
            "inconsistent (damaged, or edited by hand)."
        )


# ----------------------------------------------------------------------------- length
def length(store: VaultStore) -> int:
    """Time steps in the vault (its index, read from disk): every row holds ``[0, length)``.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))})
    >>> frb.vault.append(store, {"obs": jnp.ones((2, 5, 3))}), frb.vault.length(store)
    (5, 5)
    """
    return int(_result(store._index.read(), INDEX, store.path, "functional_rb.vault.length")[0])


def set_length(store: VaultStore, n: int) -> None:
    """Store ``n`` as the vault's length (its index). :func:`append` does it after writing;
    after :func:`write` at positions of your choice, call it yourself.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))})
    >>> frb.vault.write(store, {"obs": jnp.ones((2, 5, 3))}, dest_start=0)
    5
    >>> frb.vault.set_length(store, 5); frb.vault.length(store)
    5
    """
    where = "functional_rb.vault.set_length"
    n = config_int(
        where, "n", n, minimum=0, maximum=MAX_LENGTH, fix="(the vault index is stored as int32)."
    )
    _result(store._index.write(np.asarray([n], np.int32)), INDEX, store.path, where)


# ----------------------------------------------------------------------------- write
def _data_leaves(store: VaultStore, data, where: str) -> tuple:
    """The data's leaves in the store's order, checked: ``([(path, x)], T)``."""
    flat = jax.tree_util.tree_flatten_with_path(data)[0]
    by_name = dict(zip(unique_names([p for p, _ in flat], where), flat))
    missing = [n for n in store._names if n not in by_name]
    extra = [n for n in by_name if n not in store._names]
    if missing or extra:
        raise ValueError(
            f"{where}: the data's structure differs from the vault's: it lacks "
            f"{missing} and has {extra}, which the vault does not (the vault "
            f"holds {list(store._names)}: dict keys and attribute names joined "
            "by dots). Pass data with the vault's leaves."
        )
    out, times = [], set()
    for name, want in zip(store._names, jax.tree_util.tree_leaves(store.structure)):
        path, x = by_name[name]
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"{where}: leaf {keystr(path)} is traced (inside jax.jit, vmap or "
                "scan); a vault is written on the host: call this outside jit, "
                "with the arrays your jitted function returns."
            )
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        check_leaf(
            where,
            path,
            jax.ShapeDtypeStruct(np.shape(x), dtype),
            want,
            cast=True,
            fix="Pass data like the vault's experience: leaves [num_envs, T, ...] of its dtypes.",
        )
        times.add(np.shape(x)[1])
        out.append((path, x))
    if len(times) > 1:
        raise ValueError(
            f"{where}: the leaves have different time lengths {sorted(times)}; "
            "every leaf is [num_envs, T, ...] with one T."
        )
    return out, times.pop()


def _runs(source, t: int, where: str) -> list:
    """The runs of the time axis ``source`` selects, as flashbax reads a ring: ``(a, b)`` is
    ``[a, b)`` when ``a < b``, ``[a, T)`` then ``[0, b)`` when ``a > b``, nothing when equal."""
    if source is None:
        return [(0, t)] if t else []
    if not isinstance(source, (tuple, list)) or len(source) != 2:
        raise TypeError(
            f"{where}: source must be a pair (start, stop) of time indices, got {source!r}."
        )
    a, b = (
        config_int(
            where,
            f"source[{i}]",
            v,
            minimum=0,
            maximum=t,
            fix=f"(indices into the data's time axis, of length {t}).",
        )
        for i, v in enumerate(source)
    )
    return [(a, b)] if a < b else ([(a, t), (0, b)] if a > b else [])


def _host(x, dtype: np.dtype, path, where: str) -> np.ndarray:
    """``x`` as a NumPy array of ``dtype``, refusing integer values the cast would wrap."""
    x = np.asarray(x)
    if (
        x.dtype != dtype
        and x.size
        and np.issubdtype(dtype, np.integer)
        and not np.can_cast(x.dtype, dtype, "safe")
    ):
        info, lo, hi = np.iinfo(dtype), int(x.min()), int(x.max())
        if lo < info.min or hi > info.max:
            raise OverflowError(
                f"{where}: leaf {keystr(path)} has values in [{lo}, {hi}], "
                f"outside the range of the vault's dtype {dtype.name}; clip "
                "them, or create the vault with a wider dtype."
            )
    return x.astype(dtype, copy=False)


def _write_runs(store: VaultStore, leaves: list, runs: list, dest_start: int, where: str) -> int:
    n = sum(b - a for a, b in runs)
    if dest_start + n > TIME_AXIS_MAX_LENGTH:
        raise ValueError(
            f"{where}: writing {n} steps at {dest_start} passes the end of the "
            f"vault's time axis ({TIME_AXIS_MAX_LENGTH})."
        )
    pieces, at = [], dest_start
    for a, b in runs:  # every value is converted (and checked) before anything is written
        for (path, x), array in zip(leaves, store._arrays):
            pieces.append((array, at, _host(x[:, a:b], array.dtype.numpy_dtype, path, where)))
        at += b - a
    pending = [
        array[:, start : start + piece.shape[1]].write(piece) for array, start, piece in pieces
    ]
    for name, future in zip(store._names * len(runs), pending):
        _result(future, name, store.path, where)
    return n


def write(
    store: VaultStore, data: PyTree, *, dest_start: int, source: tuple[int, int] | None = None
) -> int:
    """Write the time steps ``source`` selects from ``data`` at vault time ``dest_start``
    onwards; the vault's length is left as it is (see :func:`append`, :func:`set_length`).

    Args:
      store: an open vault.
      data: the vault's structure (leaves matched by name: a dict may fill a vault written
        from NamedTuples), leaves ``[num_envs, T, ...]``, JAX or NumPy arrays of the vault's
        dtypes or of dtypes of the same kind (cast; integers that do not fit raise
        ``OverflowError``).
      dest_start: the first vault time step written.
      source: ``(a, b)``, a run of ``data``'s time axis read as a ring, as flashbax does:
        ``[a, b)`` when ``a < b``; ``[a, T)`` then ``[0, b)`` when ``a > b`` (a buffer whose
        write head wrapped); nothing when ``a == b``. Default: all ``T`` steps.

    Returns the number of time steps written.

    >>> import tempfile, numpy as np, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"x": np.zeros((1, 4), np.int32)})
    >>> ring = {"x": np.array([[4, 5, 2, 3]], np.int32)}   # oldest at 2; the head is at 2
    >>> frb.vault.write(store, ring, dest_start=0, source=(2, 2))
    0
    >>> frb.vault.write(store, ring, dest_start=0, source=(2, 1))
    3
    >>> frb.vault.set_length(store, 3); frb.vault.read(store, as_numpy=True)["x"]
    array([[2, 3, 4]], dtype=int32)
    """
    where = "functional_rb.vault.write"
    dest_start = config_int(where, "dest_start", dest_start, minimum=0)
    leaves, t = _data_leaves(store, data, where)
    return _write_runs(store, leaves, _runs(source, t, where), dest_start, where)


def append(store: VaultStore, data: PyTree, *, source: tuple[int, int] | None = None) -> int:
    """Write ``data`` (the steps ``source`` selects, as in :func:`write`; default all) at the
    end of the vault, then extend its length; returns the number of steps written. A crash
    before the length is stored leaves the vault as it was.

    >>> import tempfile, jax.numpy as jnp, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"obs": jnp.zeros((2, 5, 3))})
    >>> frb.vault.append(store, {"obs": jnp.ones((2, 5, 3))})
    5
    >>> frb.vault.append(store, {"obs": jnp.ones((2, 3, 3))}), frb.vault.length(store)
    (3, 8)
    """
    where = "functional_rb.vault.append"
    leaves, t = _data_leaves(store, data, where)
    runs = _runs(source, t, where)
    start, n = length(store), sum(b - a for a, b in runs)
    if start + n > MAX_LENGTH:
        raise ValueError(
            f"{where}: the vault holds {start} steps; {n} more would pass the "
            f"format's limit of {MAX_LENGTH} (an int32 index). Start a new vault."
        )
    _write_runs(store, leaves, runs, start, where)
    if n:
        set_length(store, start + n)
    return n


# ----------------------------------------------------------------------------- read
def _interval(n: int, timesteps, percentiles, where: str) -> tuple:
    if timesteps is not None and percentiles is not None:
        raise ValueError(f"{where}: pass timesteps or percentiles, not both.")
    if timesteps is not None:
        k = config_int(
            where, "timesteps", timesteps, minimum=0, maximum=n, fix=f"(the vault holds {n} steps)."
        )
        return n - k, n
    if percentiles is None:
        return 0, n
    if not isinstance(percentiles, (tuple, list)) or len(percentiles) != 2:
        raise TypeError(
            f"{where}: percentiles must be a pair (low, high) in [0, 100], got {percentiles!r}."
        )
    lo, hi = (
        config_number(where, f"percentiles[{i}]", p, minimum=0, maximum=100)
        for i, p in enumerate(percentiles)
    )
    if not lo < hi:
        raise ValueError(
            f"{where}: percentiles must be ascending, got {tuple(percentiles)}; "
            "e.g. (0, 50) for the first half."
        )
    return int(n * (lo / 100)), int(n * (hi / 100))  # flashbax's rounding


def read(
    store: VaultStore,
    *,
    timesteps: int | None = None,
    percentiles: tuple[float, float] | None = None,
    as_numpy: bool = False,
) -> PyTree:
    """Read time steps of every row: all of them (default), the last ``timesteps``, or
    ``[int(L * lo / 100), int(L * hi / 100))`` for ``percentiles=(lo, hi)`` (``L``: the
    vault's length; flashbax's rounding). Returns the store's tree, leaves ``[num_envs, steps,
    ...]``: JAX arrays (as flashbax), or NumPy arrays with ``as_numpy=True`` (kept on the
    host; with ``jax_enable_x64`` off, JAX arrays of 64-bit leaves are 32-bit).

    >>> import tempfile, numpy as np, functional_rb as frb
    >>> store = frb.vault.create(tempfile.mkdtemp() + "/v", {"x": np.zeros((1, 4), np.int32)})
    >>> _ = frb.vault.append(store, {"x": np.arange(10, dtype=np.int32)[None]})
    >>> frb.vault.read(store, timesteps=3)["x"].tolist()
    [[7, 8, 9]]
    >>> frb.vault.read(store, percentiles=(20, 50), as_numpy=True)["x"]
    array([[2, 3, 4]], dtype=int32)
    """
    where = "functional_rb.vault.read"
    a, b = _interval(length(store), timesteps, percentiles, where)
    pending = [array[:, a:b].read() for array in store._arrays]
    convert = np.asarray if as_numpy else jnp.asarray
    leaves = [
        convert(_result(f, name, store.path, where)) for f, name in zip(pending, store._names)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(store.structure), leaves)
