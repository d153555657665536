"""A local HTTP server (127.0.0.1) serving dataset files, and writers of small files in the
real formats the dataset loaders read (used by tests/test_datasets.py).

The server answers the endpoints the loaders call: plain files (D4RL, Gen-DGRL, OpenML, the
Hugging Face ``resolve`` URLs, GCS objects), the Hugging Face tree API (paginated with a
``Link`` header, ``page_size`` entries per page) and the GCS JSON listing (paginated with
``nextPageToken``). Every request is logged, so tests can assert that a second construction
downloads nothing.
"""
from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import pickle
import tarfile
import threading
import urllib.parse

import numpy as np


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):  # noqa: N802 (http.server's name)
        srv = self.server.owner
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        with srv.lock:
            srv.log.append(path)
        status, headers, body = srv.respond(path, query)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class DatasetServer:
    """``files[path] = bytes`` serves a file; ``hf_tree(repo)`` / ``gcs_bucket(bucket)``
    register listings built from the files."""

    def __init__(self, page_size: int = 2):
        self.files: dict = {}
        self.listed_only: set = set()  # paths that listings name but GET answers 404 for
        self.log: list = []
        self.lock = threading.Lock()
        self.page_size = page_size
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,),
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}"

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()

    def requests(self) -> int:
        with self.lock:
            return len(self.log)

    # -------------------------------------------------------------- routing
    def respond(self, path, query):
        if path in self.files:
            return 200, {"Content-Type": "application/octet-stream"}, self.files[path]
        if path.startswith("/api/datasets/") and "/tree/main" in path:
            return self._hf_tree(path, query)
        if path.startswith("/storage/v1/b/"):
            return self._gcs_list(path, query)
        return 404, {}, b"not found"

    def _hf_tree(self, path, query):
        repo, _, sub = path[len("/api/datasets/"):].partition("/tree/main")
        sub = sub.strip("/")
        prefix = f"/datasets/{repo}/resolve/main/"
        entries = sorted(p[len(prefix):] for p in (*self.files, *self.listed_only)
                         if p.startswith(prefix))
        entries = [p for p in entries if not sub or p.startswith(sub + "/")]
        if not entries:
            return 404, {}, b'{"error": "Entry not found"}'
        start = int(query.get("cursor", 0))
        page = entries[start:start + self.page_size]
        headers = {"Content-Type": "application/json"}
        if start + self.page_size < len(entries):
            nxt = (f"{self.url}/api/datasets/{repo}/tree/main/{urllib.parse.quote(sub)}"
                   f"?recursive=true&cursor={start + self.page_size}")
            headers["Link"] = f'<{nxt}>; rel="next"'
        body = [{"type": "file", "path": p, "size": len(self.files.get(prefix + p, b""))}
                for p in page]
        return 200, headers, json.dumps(body).encode()

    def _gcs_list(self, path, query):
        bucket = path[len("/storage/v1/b/"):].split("/")[0]
        prefix = query.get("prefix", "")
        names = sorted(p[len(f"/{bucket}/"):] for p in (*self.files, *self.listed_only)
                       if p.startswith(f"/{bucket}/{prefix}"))
        start = int(query.get("pageToken", 0))
        page = {"kind": "storage#objects",
                "items": [{"name": n} for n in names[start:start + self.page_size]]}
        if start + self.page_size < len(names):
            page["nextPageToken"] = str(start + self.page_size)
        return 200, {"Content-Type": "application/json"}, json.dumps(page).encode()


# ------------------------------------------------------------------ format writers
def h5_bytes(tmp_path, name, fill) -> bytes:
    """An HDF5 file written by ``fill(h5py.File)``, as bytes."""
    import h5py
    p = tmp_path / name
    with h5py.File(p, "w") as f:
        fill(f)
    data = p.read_bytes()
    p.unlink()
    return data


def npy_bytes(arr, allow_pickle=False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def npy_gz_bytes(arr) -> bytes:
    return gzip.compress(npy_bytes(arr))


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def tar_bytes(members: dict, mode="w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def png_bytes(img: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def pickle_bytes(obj) -> bytes:
    return pickle.dumps(obj, protocol=4)


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()
