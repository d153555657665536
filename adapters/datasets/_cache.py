"""The dataset loaders' cache on disk: where it lives (:func:`default_root`), the staging
directory of a dataset's raw downloads (:func:`staging_dir`), and the converted datasets
(:func:`write_episodes`, :func:`build_split`, each marked complete by :data:`MARKER`).

Cache layout: each converted dataset is a memory-mapped TensorDict directory (TorchRL's on-disk
layout: ``meta.json`` + one ``<key>.memmap`` per leaf, loadable with
``tensordict.TensorDict.load_memmap``) at ``<root>/<dataset_id>``. It is written into a hidden
temporary directory next to it and renamed into place only when complete, so an interrupted or
failed download/conversion never leaves a directory that looks like a finished dataset. The raw
downloads live in ``<root>/.downloads/<key>`` until the build succeeds or fails for good; an
interrupted build keeps them, and the next construction resumes them. The default ``root`` is
``$FRB_DATASETS_CACHE/<source>`` or ``~/.cache/functional_rb/datasets/<source>`` (not
TorchRL's ``~/.cache/torchrl``: some layouts differ from TorchRL's, e.g. Atari's, so the two
libraries must not read each other's caches).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from functional_rb.adapters.datasets._download import DatasetDownloadError


@contextlib.contextmanager
def staging_dir(root, key: str):
    """A directory for the raw downloads of one dataset: ``<root>/.downloads/<key>``.

    It survives an interrupted build (Ctrl-C, SIGKILL, a network failure that outlasted the
    retries) so that the next construction reuses its complete files and resumes its partial
    ones; it is removed when the block succeeds or fails for good (an HTTP 404, a checksum
    mismatch, a format error). Concurrent builds of the same dataset wait for each other
    (``flock`` on ``<key>.lock``, where available)."""
    base = Path(root) / ".downloads"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._") or "dataset"
    safe = f"{safe[:80]}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    path = base / safe
    with _locked(base / (safe + ".lock")) as unlock:
        path.mkdir(exist_ok=True)
        keep = False
        try:
            yield path
        except BaseException as e:  # KeyboardInterrupt, SystemExit, network: resume next time
            keep = (
                e.transient if isinstance(e, DatasetDownloadError) else not isinstance(e, Exception)
            )
            raise
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
                unlock()
                with contextlib.suppress(OSError):
                    base.rmdir()  # only when empty


@contextlib.contextmanager
def _locked(lock_path: Path):
    """Hold an exclusive ``flock`` on ``lock_path``; yields ``remove()`` that deletes the lock
    file while it is still held (waiters notice and lock the new file)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds are not serialized
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        yield lambda: None
        return
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by the previous holder
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    removed = []

    def remove():
        if not removed:
            removed.append(True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)

    try:
        yield remove
    finally:
        os.close(fd)


MARKER = "frb_dataset.json"
FORMAT_VERSION = 1

_NP_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
# unsigned types torch cannot memory-map portably are widened (values are kept exactly)
_WIDEN = {np.dtype(np.uint16): np.dtype(np.int32), np.dtype(np.uint32): np.dtype(np.int64)}


def default_root(source: str) -> Path:
    base = os.environ.get("FRB_DATASETS_CACHE")
    if base:
        return Path(base).expanduser() / source
    return Path.home() / ".cache" / "functional_rb" / "datasets" / source


def storable_dtype(dtype, key, where: str) -> np.dtype:
    dtype = np.dtype(dtype)
    dtype = _WIDEN.get(dtype, dtype)
    if dtype not in _NP_TO_TORCH:
        raise TypeError(
            f"{where}: leaf {key!r} has dtype {dtype}, which tensor storages cannot "
            f"hold (supported: {sorted(str(d) for d in _NP_TO_TORCH)})."
        )
    return dtype


@contextlib.contextmanager
def atomic_dir(path):
    """Yield a temporary directory that becomes ``path`` (replacing it) only if the block
    succeeds; on any error it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
        os.replace(path, old / "data")
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class MemmapWriter:
    """A memmapped TensorDict of ``n`` items (TorchRL's layout) created in ``directory``; the
    numpy views in :attr:`maps` (``{key tuple: array [n, ...]}``) are filled in place."""

    def __init__(self, directory, specs: dict, n: int, where: str):
        if n <= 0:
            raise ValueError(f"{where}: the downloaded files hold no step (0 items).")
        item = TensorDict({}, [])
        for key, (shape, dtype) in specs.items():
            item.set(
                key if len(key) > 1 else key[0],
                torch.zeros(tuple(shape), dtype=_NP_TO_TORCH[np.dtype(dtype)]),
            )
        self.td = item.expand(n).memmap_like(str(directory))
        self.maps = {key: self.td.get(key if len(key) > 1 else key[0]).numpy() for key in specs}
        self.n = n

    def close(self):
        self.maps = {}
        self.td = None


def write_marker(directory, **meta):
    with open(Path(directory) / MARKER, "w") as f:
        json.dump({"format": FORMAT_VERSION, **meta}, f, indent=1, default=_json_default)


def read_marker(directory) -> dict:
    p = Path(directory) / MARKER
    if not p.exists():
        return {}
    with open(p) as f:
        return json.load(f)


def _json_default(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def write_episodes(
    directory, episodes: Sequence, *, where: str, max_items: int | None = None, **meta
) -> int:
    """Write episodes contiguously as one memmapped TensorDict in ``directory``.

    ``episodes``: ``(length, load)`` pairs; ``load()`` returns ``{key tuple: array [length,
    ...]}``. Every episode must have the keys and item shapes of the first one (dtypes are cast
    to the first one's, same kind). ``max_items`` truncates the total (TorchRL's fixed-size
    categories). Returns the number of items written.
    """
    lengths = [int(n) for n, _ in episodes]
    total = sum(lengths) if max_items is None else min(sum(lengths), int(max_items))
    if not episodes or total <= 0:
        raise ValueError(f"{where}: the downloaded files hold no step (0 items).")
    first = {tuple(k): np.asarray(v) for k, v in episodes[0][1]().items()}
    specs = {k: (v.shape[1:], storable_dtype(v.dtype, k, where)) for k, v in first.items()}
    w = MemmapWriter(directory, specs, total, where)
    start = 0
    for i, ((_, load), length) in enumerate(zip(episodes, lengths)):
        if start >= total:
            break
        ep = first if i == 0 else {tuple(k): np.asarray(v) for k, v in load().items()}
        if set(ep) != set(specs):
            raise ValueError(
                f"{where}: episode {i} has keys {sorted(ep)}, the first episode has "
                f"{sorted(specs)} (missing {sorted(set(specs) - set(ep))}, unexpected "
                f"{sorted(set(ep) - set(specs))})."
            )
        take = min(length, total - start)
        for k, v in ep.items():
            shape, dtype = specs[k]
            if v.shape != (length,) + tuple(shape):
                raise ValueError(
                    f"{where}: episode {i}, leaf {k!r}: expected shape "
                    f"{(length,) + tuple(shape)}, got {v.shape}."
                )
            if not np.can_cast(v.dtype, dtype, "same_kind") and v.dtype != np.bool_:
                raise ValueError(
                    f"{where}: episode {i}, leaf {k!r}: dtype {v.dtype} cannot be "
                    f"stored as the first episode's {dtype}."
                )
            w.maps[k][start : start + take] = v[:take]
        start += take
    w.close()
    write_marker(directory, num_items=total, **meta)
    return total


def build_split(src, dest, *, where: str, done_key=("next", "done")):
    """TorchRL's ``split_trajectories`` layout at ``dest``: items ``[num_traj, max_len, ...]``
    zero-padded, ``"mask"`` (bool, valid steps) and ``"traj_ids"`` (int64) added; trajectories
    end where ``done_key`` is set (and at the last step)."""
    td = TensorDict.load_memmap(str(src))
    n = td.batch_size[0]
    done = td.get(done_key).numpy().reshape(n, -1).any(-1)
    starts = np.concatenate([[0], np.flatnonzero(done[:-1]) + 1]).astype(np.int64)
    ends = np.concatenate([starts[1:], [n]])
    max_len = int((ends - starts).max())
    leaves = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        leaves[key] = td.get(key).numpy()
    specs = {k: ((max_len,) + v.shape[1:], v.dtype) for k, v in leaves.items()}
    specs[("mask",)] = ((max_len,), np.dtype(np.bool_))
    specs[("traj_ids",)] = ((max_len,), np.dtype(np.int64))
    with atomic_dir(dest) as tmp:
        w = MemmapWriter(tmp, specs, len(starts), where)
        for t, (s, e) in enumerate(zip(starts, ends)):
            for k, v in leaves.items():
                w.maps[k][t, : e - s] = v[s:e]
            w.maps[("mask",)][t, : e - s] = True
            w.maps[("traj_ids",)][t] = t
        w.close()
        write_marker(tmp, num_items=len(starts), split_from=str(src), max_len=max_len)
