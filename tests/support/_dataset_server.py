"""A local HTTP server (127.0.0.1) serving dataset files, and writers of small files in the
real formats the dataset loaders read (used by the tests in tests/adapters/datasets/, which take
the server as the fixture ``server = server_fixture(page_size)``).

The server answers the endpoints the loaders call: plain files (D4RL, Gen-DGRL, OpenML, the
Hugging Face ``resolve`` URLs, GCS objects), the Hugging Face tree API (paginated with a
``Link`` header, ``page_size`` entries per page) and the GCS JSON listing (paginated with
``nextPageToken``), with what the real services publish about a file: Hugging Face's
``X-Repo-Commit`` and ``ETag`` (git blob sha1; files in ``lfs`` are redirected to
``/cdn/<sha256>`` on another origin, with ``X-Linked-Etag``/``X-Linked-Size``, as the Hub
does), the tree's ``oid``/``lfs`` entries and GCS's ``md5Hash``/``size``. GET and HEAD honour ``Range`` (206, 416) and ``If-Range``.

Every request is logged (``log``: paths; ``events``: method, path, ``Range``/``If-Range``
headers, status and the body bytes sent), so tests can assert that a second construction
downloads nothing or what a resumed download transferred. ``faults[path]`` is a list of faults
consumed one per request: ``("status", code, headers)`` answers an error,
``("cut", n)`` / ``("reset", n)`` send the headers and ``n`` body bytes then close the
connection (cleanly / with a TCP reset), ``("stall", n, event)`` sends ``n`` bytes then waits
for ``event`` before closing, ``("body", data)`` sends ``data`` instead of the file (same
headers: corruption in transit).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import io
import json
import pickle
import re
import socket
import struct
import tarfile
import threading
import time
import urllib.parse

import numpy as np
import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_HF_RESOLVE = re.compile(r"^/datasets/[^/]+/[^/]+/resolve/[^/]+/")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_HEAD(self):  # noqa: N802 (http.server's name)
        self._serve(body=False)

    def do_GET(self):  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool):
        srv = self.server.owner
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        event = {
            "method": self.command,
            "path": path,
            "range": self.headers.get("Range"),
            "if_range": self.headers.get("If-Range"),
            "status": None,
            "sent": 0,
        }
        with srv.lock:
            srv.log.append(path)
            srv.events.append(event)
            fault = srv.faults[path].pop(0) if srv.faults.get(path) else None
        if fault is not None and fault[0] == "status":
            status, headers, data = fault[1], dict(fault[2] if len(fault) > 2 else {}), b"error"
        else:
            path = path.replace(f"/resolve/{COMMIT}/", "/resolve/main/", 1)  # pinned revision
            status, headers, data = srv.respond(path, query)
            if fault is not None and fault[0] == "body" and status == 200:
                data = fault[1]  # corrupted in transit: the headers describe the real file
            if status == 200 and (path in srv.files or path.startswith("/cdn/")):
                status, headers, data = _ranged(self.headers, headers, data)
        event["status"] = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not body:
            return
        if fault is not None and fault[0] in ("cut", "reset", "stall"):
            n = fault[1]
            event["sent"] = min(n, len(data))  # set first: the client may finish before us
            self.wfile.write(data[:n])
            self.wfile.flush()
            if fault[0] == "stall":
                fault[2].wait(30)
            if fault[0] == "reset":  # RST instead of FIN: the client sees ECONNRESET
                time.sleep(0.05)  # after reading what was sent (a RST drops unread data)
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            self.close_connection = True
            self.connection.close()
            return
        event["sent"] = len(data)
        self.wfile.write(data)


def _ranged(req_headers, headers, data):
    """Apply ``Range``/``If-Range`` (one ``bytes=a-`` or ``bytes=a-b`` range) to a 200."""
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", req_headers.get("Range") or "")
    if_range = req_headers.get("If-Range")
    if m is None or (if_range is not None and if_range != headers.get("ETag")):
        return 200, headers, data
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) else len(data) - 1
    if a >= len(data):
        return 416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b""
    b = min(b, len(data) - 1)
    return 206, {**headers, "Content-Range": f"bytes {a}-{b}/{len(data)}"}, data[a : b + 1]


class DatasetServer:
    """``files[path] = bytes`` serves a file; ``hf_tree(repo)`` / ``gcs_bucket(bucket)``
    register listings built from the files; paths in ``lfs`` are served as Hugging Face LFS
    files (a redirect to ``/cdn/<sha256>``)."""

    def __init__(self, page_size: int = 2):
        self.files: dict = {}
        self.listed_only: set = set()  # paths that listings name but GET answers 404 for
        self.lfs: set = set()
        self.faults: dict = {}
        self.etags = True  # False: plain files are served without ETag (no If-Range validator)
        self.log: list = []
        self.events: list = []
        self.lock = threading.Lock()
        self.page_size = page_size
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}"

    @property
    def cdn_url(self) -> str:
        """The same server under another origin (``localhost``), as the Hub's LFS redirects
        leave the Hub's origin for a CDN (clients must not follow them with Hub headers)."""
        return f"http://localhost:{self._httpd.server_port}"

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()

    def requests(self) -> int:
        with self.lock:
            return len(self.log)

    def gets(self, path) -> list:
        """The logged GET events for ``path``."""
        with self.lock:
            return [e for e in self.events if e["path"] == path and e["method"] == "GET"]

    # -------------------------------------------------------------- routing
    def respond(self, path, query):
        if path.startswith("/cdn/"):
            for p in self.lfs:
                if p in self.files and sha256(self.files[p]) == path[len("/cdn/") :]:
                    data = self.files[p]
                    return 200, {"ETag": f'"{hashlib.md5(data).hexdigest()}"'}, data
            return 404, {}, b"not found"
        hf = _HF_RESOLVE.match(path) is not None
        if path in self.files:
            data = self.files[path]
            if hf and path in self.lfs:
                digest = sha256(data)
                return (
                    302,
                    {
                        "Location": f"{self.cdn_url}/cdn/{digest}",
                        "X-Repo-Commit": COMMIT,
                        "X-Linked-Etag": f'"{digest}"',
                        "X-Linked-Size": str(len(data)),
                        "ETag": f'"{digest}"',
                    },
                    b"",
                )
            etag = git_sha1(data) if hf else hashlib.md5(data).hexdigest()
            headers = {"Content-Type": "application/octet-stream"}
            if hf or self.etags:
                headers["ETag"] = f'"{etag}"'
            if hf:
                headers["X-Repo-Commit"] = COMMIT
            return 200, headers, data
        m = re.fullmatch(rf"/api/datasets/([^/]+/[^/]+)/tree/(main|{COMMIT})(/.*)?", path)
        if m:
            return self._hf_tree(m.group(1), m.group(2), m.group(3) or "", query)
        if path == "/api/datasets":
            return self._hf_repos(query)
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/revision/main", path)
        if m:
            return self._hf_repo_info(m.group(1))
        if path.startswith("/storage/v1/b/"):
            return self._gcs_list(path, query)
        if hf:
            return (
                404,
                {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT},
                b"Entry not found",
            )
        return 404, {}, b"not found"

    def _hf_tree(self, repo, revision, sub, query):
        sub = sub.strip("/")
        prefix = f"/datasets/{repo}/resolve/main/"
        entries = sorted(
            p[len(prefix) :] for p in (*self.files, *self.listed_only) if p.startswith(prefix)
        )
        entries = [p for p in entries if not sub or p.startswith(sub + "/")]
        if not entries:
            return 404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "Entry not found"}'
        start = int(query.get("cursor", 0))
        page = entries[start : start + self.page_size]
        headers = {"Content-Type": "application/json"}
        if start + self.page_size < len(entries):
            nxt = (
                f"{self.url}/api/datasets/{repo}/tree/{revision}/{urllib.parse.quote(sub)}"
                f"?recursive=true&cursor={start + self.page_size}"
            )
            headers["Link"] = f'<{nxt}>; rel="next"'
        body = []
        for p in page:
            data = self.files.get(prefix + p, b"")
            entry = {"type": "file", "path": p, "size": len(data), "oid": git_sha1(data)}
            if prefix + p in self.lfs:
                entry["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
            body.append(entry)
        return 200, headers, json.dumps(body).encode()

    def _hf_paths(self, repo) -> list:
        prefix = f"/datasets/{repo}/resolve/main/"
        return sorted(p[len(prefix) :] for p in self.files if p.startswith(prefix))

    def _hf_repos(self, query):
        """``HfApi.list_datasets(author=..., search=...)``: the repos that hold files."""
        repos = sorted({"/".join(p.split("/")[2:4]) for p in self.files if _HF_RESOLVE.match(p)})
        author, search = query.get("author"), query.get("search", "")
        repos = [
            r
            for r in repos
            if (author is None or r.split("/")[0] == author) and search in r.split("/")[1]
        ]
        body = [{"id": r, "_id": r, "sha": COMMIT, "private": False} for r in repos]
        return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()

    def _hf_repo_info(self, repo):
        paths = self._hf_paths(repo)
        if not paths:
            return 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
        body = {
            "id": repo,
            "_id": repo,
            "sha": COMMIT,
            "private": False,
            "siblings": [{"rfilename": p} for p in paths],
        }
        return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()

    def _gcs_list(self, path, query):
        bucket = path[len("/storage/v1/b/") :].split("/")[0]
        prefix = query.get("prefix", "")
        names = sorted(
            p[len(f"/{bucket}/") :]
            for p in (*self.files, *self.listed_only)
            if p.startswith(f"/{bucket}/{prefix}")
        )
        start = int(query.get("pageToken", 0))
        items = []
        for n in names[start : start + self.page_size]:
            data = self.files.get(f"/{bucket}/{n}", b"")
            items.append(
                {
                    "name": n,
                    "size": str(len(data)),
                    "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
                }
            )
        page = {"kind": "storage#objects", "items": items}
        if start + self.page_size < len(names):
            page["nextPageToken"] = str(start + self.page_size)
        return 200, {"Content-Type": "application/json"}, json.dumps(page).encode()


def server_fixture(page_size: int):
    """A pytest fixture ``server``: a DatasetServer listing ``page_size`` entries per page,
    started for each test and closed after it (``server = server_fixture(2)`` in a module)."""

    @pytest.fixture
    def server():
        s = DatasetServer(page_size=page_size)
        yield s
        s.close()

    return server


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


def d4rl_file(tmp_path):
    """A small D4RL HDF5 file (7 steps, one termination, one timeout) and its arrays."""
    n = 7
    obs = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    act = (np.arange(n * 2, dtype=np.float32) + 100).reshape(n, 2)
    rew = np.arange(n, dtype=np.float32) * 0.5
    term = np.array([0, 0, 1, 0, 0, 0, 0], bool)
    tout = np.array([0, 0, 0, 0, 1, 0, 0], bool)
    qpos = np.arange(n, dtype=np.float64) + 0.25

    def fill(f):
        f["observations"], f["actions"], f["rewards"] = obs, act, rew
        f["terminals"], f["timeouts"], f["infos/qpos"] = term, tout, qpos
        f["metadata/algorithm"] = "SAC"
        f["metadata/iteration"] = np.int64(3)

    return h5_bytes(tmp_path, "d4rl.hdf5", fill), (obs, act, rew, term, tout, qpos)
