"""Plain-HTTP downloads for the dataset loaders (stdlib ``urllib`` only).

Every loader fetches the files its source serves over HTTP(S): no ``gsutil``, no
``huggingface_hub``, no ``datasets``/``tensorflow``. Hub libraries are replaced by the HTTP
endpoints they call:

- Hugging Face: ``{endpoint}/datasets/{repo}/resolve/{revision}/{path}`` for a file and
  ``{endpoint}/api/datasets/{repo}/tree/{revision}/{path}?recursive=true`` for a listing
  (paginated with a ``Link: <...>; rel="next"`` header). ``endpoint`` is the constructor's
  ``base_url``, else ``$HF_ENDPOINT`` (the variable ``huggingface_hub`` reads), else
  ``https://huggingface.co``.
- Google Cloud Storage (Atari DQN replay logs): the JSON API listing
  ``{endpoint}/storage/v1/b/{bucket}/o?prefix=...`` (``nextPageToken`` pagination) and the object
  URL ``{endpoint}/{bucket}/{object}``.

A file is streamed into a temporary ``<name>.<random>.part`` next to its destination and renamed
only once complete (and, when the server sent ``Content-Length``, of the announced size), so an
interrupted download never leaves a file that looks finished. HTTP and network failures raise
:class:`DatasetDownloadError` naming the URL.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

USER_AGENT = "functional_rb-datasets/0.1 (+urllib)"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_TIMEOUT = 60.0
_CHUNK = 1 << 20


class DatasetDownloadError(RuntimeError):
    """A dataset file could not be downloaded (the message names the URL and the reason)."""


def _open(url: str, where: str, headers: dict | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=_TIMEOUT)
    except urllib.error.HTTPError as e:
        raise DatasetDownloadError(
            f"{where}: GET {url} failed with HTTP {e.code} {e.reason}. Check the dataset id and "
            "the base URL (constructor argument base_url or its environment variable).") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DatasetDownloadError(f"{where}: GET {url} failed: {reason}.") from None


def download(url: str, dest, *, where: str) -> Path:
    """Stream ``url`` to ``dest`` through a temporary file renamed when complete."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f, _open(url, where) as resp:
            expected = resp.headers.get("Content-Length")
            got = 0
            while True:
                try:
                    chunk = resp.read(_CHUNK)
                except OSError as e:
                    raise DatasetDownloadError(f"{where}: reading {url} failed after {got} "
                                               f"bytes: {e}.") from None
                if not chunk:
                    break
                f.write(chunk)
                got += len(chunk)
        if expected is not None and got != int(expected):
            raise DatasetDownloadError(f"{where}: GET {url} ended after {got} of {expected} "
                                       "bytes (connection closed early).")
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


def fetch_bytes(url: str, *, where: str, gzip_ok: bool = False) -> tuple[bytes, dict]:
    """The body of ``url`` (gunzipped when the server gzip-encoded it) and its headers."""
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else None
    with _open(url, where, headers) as resp:
        try:
            body = resp.read()
        except OSError as e:
            raise DatasetDownloadError(f"{where}: reading {url} failed: {e}.") from None
        hdrs = dict(resp.headers.items())
    if gzip_ok and (hdrs.get("Content-Encoding") == "gzip" or body[:2] == b"\x1f\x8b"):
        body = gzip.decompress(body)
    return body, hdrs


def fetch_json(url: str, *, where: str):
    body, hdrs = fetch_bytes(url, where=where)
    try:
        return json.loads(body), hdrs
    except ValueError as e:
        raise DatasetDownloadError(f"{where}: GET {url} did not return JSON ({e}).") from None


# ---------------------------------------------------------------------------- Hugging Face
def hf_endpoint(base_url: str | None) -> str:
    return (base_url or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")


def hf_file_url(endpoint: str, repo: str, path: str, revision: str = "main") -> str:
    return (f"{endpoint}/datasets/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/"
            f"{urllib.parse.quote(path, safe='/')}")


_LINK_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


def hf_list_files(endpoint: str, repo: str, path: str, *, where: str,
                  revision: str = "main") -> list[str]:
    """Paths of every file under ``path`` in a Hugging Face dataset repo (the tree API)."""
    url = (f"{endpoint}/api/datasets/{repo}/tree/{urllib.parse.quote(revision, safe='')}/"
           f"{urllib.parse.quote(path.strip('/'), safe='/')}?recursive=true")
    files = []
    while url:
        entries, hdrs = fetch_json(url, where=where)
        if not isinstance(entries, list):
            raise DatasetDownloadError(f"{where}: GET {url} returned {type(entries).__name__}, "
                                       "expected a JSON list of tree entries.")
        files += [e["path"] for e in entries if e.get("type") == "file"]
        m = _LINK_NEXT.search(hdrs.get("Link", "") or hdrs.get("link", ""))
        url = urllib.parse.urljoin(url, m.group(1)) if m else None
    return files


# ---------------------------------------------------------------------------- Google Cloud Storage
def gcs_list(endpoint: str, bucket: str, prefix: str, *, where: str) -> list[str]:
    """Object names under ``prefix`` in a public GCS bucket (JSON API, all pages)."""
    base = (f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?prefix="
            f"{urllib.parse.quote(prefix, safe='')}")
    names, token = [], None
    while True:
        url = base + (f"&pageToken={urllib.parse.quote(token, safe='')}" if token else "")
        page, _ = fetch_json(url, where=where)
        names += [it["name"] for it in page.get("items", [])]
        token = page.get("nextPageToken")
        if not token:
            return names


def gcs_object_url(endpoint: str, bucket: str, name: str) -> str:
    return f"{endpoint}/{bucket}/{urllib.parse.quote(name, safe='/')}"
