"""The staging directory of a dataset's raw downloads, kept across interrupted builds so that
the next construction resumes them (see :func:`staging_dir`)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from pathlib import Path

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
            keep = (e.transient if isinstance(e, DatasetDownloadError)
                    else not isinstance(e, Exception))
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
