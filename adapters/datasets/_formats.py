"""Readers for the on-disk formats the datasets are distributed in (NumPy / h5py / stdlib).

- ``.npy`` (NumPy's format), plain or gzipped (Atari DQN replay logs), including object arrays
  (Gen-DGRL pickles a dict of arrays into each ``.npy``): object payloads go through
  :class:`SafeUnpickler`, which only rebuilds NumPy arrays, dtypes and scalars plus plain Python
  containers, so a hostile file cannot run code the way ``np.load(allow_pickle=True)`` would.
- Pickled episodes (Open X tar shards) with the same restricted unpickler.
- Tar archives, any compression (Gen-DGRL, Open X).
- HDF5 groups as nested dicts of arrays (D4RL, Minari, Roboset, V-D4RL ``.hdf5``).
- Encoded images (JPEG/PNG bytes) to ``uint8 [C, H, W]`` with Pillow.
- ARFF (OpenML's data files), dense and sparse.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import pickle
import tarfile
from typing import Any

import numpy as np


class DatasetFormatError(ValueError):
    """A downloaded file is not in the expected format (the message names the file)."""


def open_tar(path, what: str) -> tarfile.TarFile:
    """``tarfile.open(path)`` for a ``with`` block, any compression; a file that is not a tar
    archive raises :class:`DatasetFormatError` ``"{what} ({error})."``."""
    try:
        return tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise DatasetFormatError(f"{what} ({e}).") from None


# ---------------------------------------------------------------------------- safe pickles
_NUMPY_SAFE = {
    ("multiarray", "_reconstruct"),
    ("multiarray", "scalar"),
    ("numeric", "_frombuffer"),
    ("", "ndarray"),
    ("", "dtype"),
}
_BUILTINS_SAFE = {
    "list",
    "dict",
    "tuple",
    "set",
    "frozenset",
    "bytearray",
    "complex",
    "slice",
    "range",
    "bool",
    "int",
    "float",
    "str",
    "bytes",
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles NumPy arrays/scalars/dtypes and builtin containers only; anything else raises
    :class:`DatasetFormatError` (pickled datasets come from the internet)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS_SAFE:
            return super().find_class(module, name)
        if module in ("_codecs",) and name == "encode":  # protocol-2 pickles of bytes
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "numpy" or module.startswith(("numpy.core", "numpy._core")):
            sub = module.rsplit(".", 1)[-1] if module != "numpy" else ""
            if (sub, name) in _NUMPY_SAFE:
                # numpy >= 2 moved numpy.core to numpy._core (files written by numpy 1.x name
                # the old path)
                if module.startswith("numpy.core"):
                    module = "numpy._core" + module[len("numpy.core") :]
                try:
                    return super().find_class(module, name)
                except (ImportError, AttributeError):
                    return super().find_class(module.replace("numpy._core", "numpy.core"), name)
        raise DatasetFormatError(
            f"{self._where}: the pickled data references {module}.{name}, which is not a NumPy "
            "array/scalar or a builtin container; refusing to unpickle it (it could run code)."
        )


def safe_unpickle(data: bytes | Any, where: str):
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        return SafeUnpickler(f, where).load()
    except DatasetFormatError:
        raise
    except Exception as e:
        raise DatasetFormatError(
            f"{where}: not a readable pickle ({type(e).__name__}: {e})."
        ) from None


# ---------------------------------------------------------------------------- npy
def _npy_header(f):
    """``(shape, fortran_order, dtype)`` from a ``.npy`` stream positioned at its start."""
    if np.lib.format.read_magic(f) == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    return np.lib.format.read_array_header_2_0(f)


def read_npy(data: bytes, where: str) -> np.ndarray:
    """An array from ``.npy`` bytes; object arrays are unpickled with :class:`SafeUnpickler`."""
    f = io.BytesIO(data)
    try:
        shape, fortran, dtype = _npy_header(f)
    except Exception as e:
        raise DatasetFormatError(f"{where}: not a .npy file ({e}).") from None
    if dtype.hasobject:
        arr = safe_unpickle(f, where)
        if not isinstance(arr, np.ndarray):
            raise DatasetFormatError(
                f"{where}: the object .npy payload is a {type(arr).__name__}, not an array."
            )
        return arr
    count = int(np.prod(shape)) if shape else 1
    buf = f.read(count * dtype.itemsize)
    if len(buf) != count * dtype.itemsize:
        raise DatasetFormatError(
            f"{where}: truncated .npy data ({len(buf)} of {count * dtype.itemsize} bytes)."
        )
    arr = np.frombuffer(buf, dtype=dtype, count=count)
    return arr.reshape(shape, order="F" if fortran else "C")


def read_npy_gz(data: bytes, where: str) -> np.ndarray:
    import gzip

    try:
        raw = gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise DatasetFormatError(f"{where}: not a gzip file ({e}).") from None
    return read_npy(raw, where)


def npy_gz_shape(path, where: str) -> tuple:
    """``(shape, dtype)`` of a gzipped ``.npy`` file from its header (decompresses ~1 KB)."""
    import gzip

    try:
        with gzip.open(path, "rb") as f:
            shape, _, dtype = _npy_header(f)
    except Exception as e:
        raise DatasetFormatError(f"{where}: not a gzipped .npy file ({e}).") from None
    return tuple(shape), dtype


# ---------------------------------------------------------------------------- HDF5
def h5_tree(group, *, skip_text: bool = True) -> dict:
    """A nested dict of numpy arrays from an h5py group (string datasets dropped when
    ``skip_text``: tensor storages hold numbers; TorchRL drops text too)."""
    import h5py

    out = {}
    for name, obj in group.items():
        if isinstance(obj, h5py.Group):
            sub = h5_tree(obj, skip_text=skip_text)
            if sub:
                out[name] = sub
        else:
            if obj.dtype.kind in "OSUV" and skip_text:
                continue
            out[name] = obj[()]
    return out


def flatten(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


# ---------------------------------------------------------------------------- images
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF8", b"BM", b"RIFF")


def looks_like_image(buf) -> bool:
    return isinstance(buf, (bytes, bytearray)) and bytes(buf[:8]).startswith(_IMAGE_MAGIC)


def decode_image(buf: bytes, where: str) -> np.ndarray:
    """Encoded image bytes -> ``uint8 [C, H, W]`` (torchvision's ``pil_to_tensor`` layout)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is in the datasets extra
        raise ImportError(
            f"{where}: decoding images needs Pillow: pip install -c "
            'constraints.txt ".[datasets]" from a clone of the repository '
            "(or pip install pillow)."
        ) from None
    try:
        with Image.open(io.BytesIO(bytes(buf))) as img:
            arr = np.asarray(img)
    except Exception as e:
        raise DatasetFormatError(f"{where}: cannot decode image ({e}).") from None
    return arr[None] if arr.ndim == 2 else np.ascontiguousarray(arr.transpose(2, 0, 1))


# ---------------------------------------------------------------------------- ARFF
@dataclasses.dataclass
class ArffAttribute:
    name: str
    kind: str  # "numeric", "nominal", "string" or "date"
    values: list | None = None  # nominal values, in declaration order


def _tokens(line: str, where: str) -> list:
    """Comma-separated ARFF values: ``[(text, quoted), ...]`` (quotes '...' or "..." with
    backslash escapes; surrounding blanks ignored)."""
    out, i, n = [], 0, len(line)
    while i <= n:
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] in "'\"":
            q, j, buf = line[i], i + 1, []
            while j < n and line[j] != q:
                if line[j] == "\\" and j + 1 < n:
                    j += 1
                    buf.append({"n": "\n", "t": "\t", "r": "\r"}.get(line[j], line[j]))
                else:
                    buf.append(line[j])
                j += 1
            if j >= n:
                raise DatasetFormatError(f"{where}: unterminated quote in ARFF line {line!r}.")
            out.append(("".join(buf), True))
            i = j + 1
            while i < n and line[i] in " \t":
                i += 1
            if i < n and line[i] != ",":
                raise DatasetFormatError(f"{where}: text after a quoted value in {line!r}.")
        else:
            j = line.find(",", i)
            j = n if j < 0 else j
            out.append((line[i:j].strip(), False))
            i = j
        i += 1
    return out


def _split_name(rest: str, where: str) -> tuple:
    rest = rest.strip()
    if rest[:1] in "'\"":
        q = rest[0]
        j = 1
        while j < len(rest) and rest[j] != q:
            j += 2 if rest[j] == "\\" else 1
        if j >= len(rest):
            raise DatasetFormatError(f"{where}: unterminated attribute name in {rest!r}.")
        return ast.literal_eval(rest[: j + 1]) if q == '"' else rest[1:j], rest[j + 1 :].strip()
    parts = rest.split(None, 1)
    if len(parts) != 2:
        raise DatasetFormatError(f"{where}: attribute declaration without a type: {rest!r}.")
    return parts[0], parts[1].strip()


def parse_arff(text: str, where: str) -> tuple:
    """``(attributes, columns)``: numeric columns are float64 arrays (NaN = missing ``?``);
    nominal/string/date columns are lists of ``str`` (``None`` = missing)."""
    attrs: list[ArffAttribute] = []
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("%"):
            continue
        low = line.lower()
        if low.startswith("@relation"):
            continue
        if low.startswith("@attribute"):
            name, typ = _split_name(line[len("@attribute") :], where)
            tl = typ.lower()
            if typ.startswith("{"):
                if not typ.endswith("}"):
                    raise DatasetFormatError(f"{where}: bad nominal type {typ!r}.")
                vals = [t for t, _ in _tokens(typ[1:-1], where)]
                attrs.append(ArffAttribute(name, "nominal", vals))
            elif tl in ("numeric", "real", "integer"):
                attrs.append(ArffAttribute(name, "numeric"))
            elif tl == "string":
                attrs.append(ArffAttribute(name, "string"))
            elif tl.startswith("date"):
                attrs.append(ArffAttribute(name, "date"))
            else:
                raise DatasetFormatError(
                    f"{where}: unsupported ARFF attribute type {typ!r} (attribute {name!r})."
                )
            continue
        if low.startswith("@data"):
            break
        raise DatasetFormatError(f"{where}: unexpected ARFF header line {line!r}.")
    if not attrs:
        raise DatasetFormatError(f"{where}: no @attribute declarations (not an ARFF file?).")
    cols: list = [[] for _ in attrs]
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("%"):
            continue
        if line.startswith("{"):
            if not line.endswith("}"):
                raise DatasetFormatError(f"{where}: bad sparse ARFF row {line!r}.")
            # omitted entries of a sparse row are 0: the number 0, or a nominal's first value
            row = [("0", False) if a.kind != "nominal" else (a.values[0], True) for a in attrs]
            body = line[1:-1].strip()
            for t, _ in _tokens(body, where) if body else []:
                idx, _, val = t.partition(" ")
                val = val.strip()
                quoted = val[:1] in "'\""
                if quoted:
                    val = _tokens(val, where)[0][0]
                try:
                    row[int(idx)] = (val, quoted)
                except (ValueError, IndexError):
                    raise DatasetFormatError(
                        f"{where}: bad sparse entry {t!r} in {line[:200]!r}."
                    ) from None
        else:
            row = _tokens(line, where)
        if len(row) != len(attrs):
            raise DatasetFormatError(
                f"{where}: a data row has {len(row)} values, the header "
                f"declares {len(attrs)} attributes: {line[:200]!r}."
            )
        for c, (v, quoted) in zip(cols, row):
            c.append(None if (v == "?" and not quoted) else v)
    columns = []
    for a, c in zip(attrs, cols):
        if a.kind == "numeric":
            try:
                columns.append(np.array([np.nan if v is None else float(v) for v in c], np.float64))
            except ValueError as e:
                raise DatasetFormatError(
                    f"{where}: numeric attribute {a.name!r} holds a non-number ({e})."
                ) from None
        else:
            if a.kind == "nominal":
                bad = {v for v in c if v is not None} - set(a.values)
                if bad:
                    raise DatasetFormatError(
                        f"{where}: nominal attribute {a.name!r} holds "
                        f"undeclared values {sorted(bad)[:5]}."
                    )
            columns.append(c)
    return attrs, columns
