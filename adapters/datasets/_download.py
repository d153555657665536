"""Plain-HTTP downloads for the dataset loaders (stdlib ``urllib``; ``tqdm`` for progress bars).

Every loader fetches the files its source serves over HTTP(S). Hub endpoints are called
directly (``_hub.py`` routes Hugging Face files through ``huggingface_hub`` instead when
``FRB_DATASETS_DOWNLOADER=hub``):

- Hugging Face: ``{endpoint}/datasets/{repo}/resolve/{revision}/{path}`` for a file and
  ``{endpoint}/api/datasets/{repo}/tree/{revision}/{path}?recursive=true`` for a listing
  (paginated with a ``Link: <...>; rel="next"`` header). ``endpoint`` is the constructor's
  ``base_url``, else ``$HF_ENDPOINT`` (the variable ``huggingface_hub`` reads), else
  ``https://huggingface.co``.
- Google Cloud Storage (Atari DQN replay logs): the JSON API listing
  ``{endpoint}/storage/v1/b/{bucket}/o?prefix=...`` (``nextPageToken`` pagination) and the object
  URL ``{endpoint}/{bucket}/{object}``.

:func:`download` streams a file into ``<dest>.part`` (its URL and validator in
``<dest>.download.json``) and renames it to ``dest`` only once complete and verified, so an
interrupted download never leaves a file that looks finished:

- resume: a ``.part`` left by an interrupted attempt (this process or an earlier one) is continued with ``Range: bytes=<size>-``, guarded by ``If-Range`` (the
  ETag or Last-Modified the server first sent), so a file changed on the server is fetched anew;
- retries: 408/425/429/5xx answers, refused or reset connections, timeouts and short bodies are
  retried with exponential backoff (:class:`Retry`; ``Retry-After`` is honoured); an attempt that
  received bytes resets the count. Other HTTP errors (404...) are not retried;
- checksums, where the source publishes them (Hugging Face: the tree listing's LFS sha256 or git
  blob sha1, or the ``X-Linked-Etag``/``ETag`` of ``resolve``; GCS: the listing's ``md5Hash``);
  a mismatch raises :class:`DatasetChecksumError` naming the URL and the local file;
- progress: a ``tqdm`` bar per file on stderr (``FRB_DATASETS_PROGRESS=0`` turns bars off).

The raw files of one dataset live in its staging directory (``_cache.staging_dir``).

Failures raise :class:`DatasetDownloadError` naming the URL; ``transient`` tells a network
failure (worth resuming later) from a permanent one (404, checksum).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.client
import json
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from functional_rb.adapters.datasets._progress import LazyBar

USER_AGENT = "functional_rb-datasets/0.1 (+urllib)"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_TIMEOUT = 60.0
_CHUNK = 1 << 20
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_REDIRECTS = 10


class DatasetDownloadError(RuntimeError):
    """A dataset file could not be downloaded (the message names the URL and the reason).

    ``transient`` is True for network failures that outlasted the retries (a later run resumes
    the partial file), False for answers that retrying cannot change (HTTP 404, a checksum
    mismatch)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class DatasetChecksumError(DatasetDownloadError):
    """A downloaded file does not match the checksum its source publishes (the file is
    deleted; the message names the URL, the local file and both digests)."""


class Checksum(NamedTuple):
    """A published digest: ``algo`` is ``"sha256"``, ``"md5"`` or ``"git-sha1"`` (git's blob
    id: sha1 of ``b"blob <size>\\0" + content``), ``hexdigest`` lower-case hex."""

    algo: str
    hexdigest: str

    def hasher(self, size: int | None):
        if self.algo == "git-sha1":
            if size is None:
                return None  # the header needs the size; unknown sizes are not checked
            h = hashlib.sha1()
            h.update(b"blob %d\0" % size)
            return h
        return hashlib.new(self.algo)


class Remote(NamedTuple):
    """A listed remote file: its size in bytes and published checksum (either may be None)."""

    size: int | None = None
    checksum: Checksum | None = None


@dataclass(frozen=True)
class Retry:
    """Retry policy: up to ``attempts`` tries of a request while no byte arrives (an attempt
    that received bytes resets the count; ``max_total`` bounds all tries), sleeping
    ``min(max_delay, backoff * factor**i)`` seconds (or the server's ``Retry-After``, capped
    at ``max_delay``) after the ``i``-th consecutive failure. ``sleep`` is injectable."""

    attempts: int = 6
    backoff: float = 1.0
    factor: float = 2.0
    max_delay: float = 60.0
    max_total: int = 100
    sleep: Callable[[float], None] = time.sleep

    def delay(self, failures: int, retry_after: str | None = None) -> float:
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                return min(self.max_delay, max(0.0, float(retry_after)))
        return min(self.max_delay, self.backoff * self.factor ** (failures - 1))


#: the policy used when a call passes none (tests replace it to avoid sleeping)
DEFAULT_RETRY = Retry()


# ---------------------------------------------------------------------------- requests
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # followed by _open, which keeps the first hop's headers


_OPENER = urllib.request.build_opener(_NoRedirect)


def _transient(e: BaseException) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code in _RETRY_STATUS
    reason = getattr(e, "reason", e)
    return not isinstance(reason, (ssl.SSLCertVerificationError, ValueError))


def _describe(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    return str(getattr(e, "reason", e)) or type(e).__name__


def _open(url: str, headers: dict | None = None, method: str = "GET"):
    """``(response, first_hop_headers)``; redirects are followed here so that the headers of
    the first answer (Hugging Face's ``X-Linked-Etag`` sits on the redirect) are kept."""
    first = None
    for _ in range(_MAX_REDIRECTS):
        req = urllib.request.Request(
            url, method=method, headers={"User-Agent": USER_AGENT, **(headers or {})}
        )
        try:
            resp = _OPENER.open(req, timeout=_TIMEOUT)
            return resp, (first if first is not None else resp.headers)
        except urllib.error.HTTPError as e:
            if e.code not in (301, 302, 303, 307, 308) or not e.headers.get("Location"):
                raise
            first = e.headers if first is None else first
            url = urllib.parse.urljoin(url, e.headers["Location"])
            e.close()
    raise urllib.error.URLError(f"more than {_MAX_REDIRECTS} redirects")


def _fail(where: str, url: str, e: BaseException, attempts: int):
    tried = f" (after {attempts} attempts)" if attempts > 1 else ""
    hint = (
        " Check the dataset id and the base URL (constructor argument base_url or its "
        "environment variable)."
        if isinstance(e, urllib.error.HTTPError)
        else ""
    )
    return DatasetDownloadError(
        f"{where}: GET {url} failed with {_describe(e)}{tried}.{hint}", transient=_transient(e)
    )


def _with_retry(url: str, where: str, retry: Retry | None, call):
    retry = retry or DEFAULT_RETRY
    failures = 0
    while True:
        try:
            return call()
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            failures += 1
            if not _transient(e) or failures >= retry.attempts:
                raise _fail(where, url, e, failures) from None
            after = e.headers.get("Retry-After") if isinstance(e, urllib.error.HTTPError) else None
            retry.sleep(retry.delay(failures, after))


def fetch_bytes(
    url: str, *, where: str, gzip_ok: bool = False, retry: Retry | None = None
) -> tuple[bytes, dict]:
    """The body of ``url`` (gunzipped when the server gzip-encoded it) and its headers."""
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else None

    def call():
        resp, _ = _open(url, headers)
        with resp:
            return resp.read(), dict(resp.headers.items())

    body, hdrs = _with_retry(url, where, retry, call)
    if gzip_ok and (hdrs.get("Content-Encoding") == "gzip" or body[:2] == b"\x1f\x8b"):
        body = gzip.decompress(body)
    return body, hdrs


def fetch_json(url: str, *, where: str, retry: Retry | None = None):
    body, hdrs = fetch_bytes(url, where=where, retry=retry)
    try:
        return json.loads(body), hdrs
    except ValueError as e:
        raise DatasetDownloadError(f"{where}: GET {url} did not return JSON ({e}).") from None


# ---------------------------------------------------------------------------- download
_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


def _content_range(value: str | None):
    m = _CONTENT_RANGE.match(value or "")
    if not m:
        return None, None
    start = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(3)) if m.group(3) != "*" else None
    return start, total


def hf_etag_checksum(headers) -> Checksum | None:
    """Hugging Face's convention for ``resolve``: ``X-Linked-Etag`` (on the redirect of an LFS
    file) or ``ETag`` is the file's sha256 (LFS) or git blob sha1 (64 / 40 hex digits)."""
    etag = (headers.get("X-Linked-Etag") or headers.get("ETag") or "").strip()
    if etag.startswith("W/"):
        return None
    etag = etag.strip('"').lower()
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        return Checksum("sha256", etag)
    if re.fullmatch(r"[0-9a-f]{40}", etag):
        return Checksum("git-sha1", etag)
    return None


def _validator(headers) -> str | None:
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):  # If-Range needs a strong validator
        return etag
    return headers.get("Last-Modified")


class _State:
    """The ``<dest>.download.json`` record: URL, validator, total size, published checksum,
    and whether ``dest`` is complete."""

    def __init__(self, path: Path, url: str):
        self.path, self.url = path, url
        self.data = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("url") == url:
                self.data = data

    def save(self, **kw):
        self.data.update(url=self.url, **kw)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def clear(self):
        self.data = {}
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _file_digest(path: Path, checksum: Checksum) -> str | None:
    h = checksum.hasher(path.stat().st_size)
    if h is None:
        return None
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def download(
    url: str,
    dest,
    *,
    where: str,
    checksum: Checksum | None = None,
    size: int | None = None,
    hf_etag: bool = False,
    retry: Retry | None = None,
    progress: bool | None = None,
) -> Path:
    """Download ``url`` to ``dest`` (resumed, retried, verified; see the module docstring).

    ``checksum``/``size``: what the source publishes for the file (checked when given);
    ``hf_etag``: take the checksum from Hugging Face's ``ETag`` headers when none is given.
    A complete ``dest`` recorded for the same URL (an earlier, interrupted build) is reused
    after its checks. Returns ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    state = _State(dest.with_name(dest.name + ".download.json"), url)
    if state.data.get("complete") and dest.exists() and _reusable(dest, state, checksum, size):
        return dest
    with contextlib.suppress(FileNotFoundError):
        dest.unlink()
    if not state.data and part.exists():
        part.unlink()  # a partial file of another URL (or of unknown origin)
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1]) or dest.name
    bar = LazyBar(name, progress)
    try:
        _fetch(
            url,
            part,
            state,
            where=where,
            retry=retry or DEFAULT_RETRY,
            bar=bar,
            hf_etag=hf_etag and checksum is None,
        )
    finally:
        bar.close()
    got = part.stat().st_size
    if size is not None and got != size:
        _discard(part, state)
        raise DatasetDownloadError(
            f"{where}: GET {url} gave {got} bytes, the source lists {size} for this file."
        )
    checksum = checksum or (
        Checksum(*state.data["checksum"]) if state.data.get("checksum") else None
    )
    if checksum is not None:
        digest = _file_digest(part, checksum)
        if digest is not None and digest != checksum.hexdigest:
            _discard(part, state)
            raise DatasetChecksumError(
                f"{where}: {dest.name} downloaded from {url} has {checksum.algo} {digest}, the "
                f"source publishes {checksum.hexdigest}; the file was deleted. Run again to "
                "download it anew; if the mismatch persists, the server's copy is corrupt."
            )
    os.replace(part, dest)
    state.save(complete=True, total=got)
    return dest


def _reusable(dest: Path, state: _State, checksum, size) -> bool:
    n = dest.stat().st_size
    if size is not None and n != size or state.data.get("total") not in (None, n):
        return False
    checksum = checksum or (
        Checksum(*state.data["checksum"]) if state.data.get("checksum") else None
    )
    return checksum is None or _file_digest(dest, checksum) in (None, checksum.hexdigest)


def _discard(part: Path, state: _State):
    with contextlib.suppress(FileNotFoundError):
        part.unlink()
    state.clear()


def _fetch(url, part: Path, state: _State, *, where, retry: Retry, bar, hf_etag: bool):
    """Fill ``part`` with the whole body of ``url``, resuming and retrying."""
    failures = tries = 0
    while True:
        tries += 1
        have = part.stat().st_size if part.exists() else 0
        before = have
        try:
            have = _attempt(url, part, state, have, bar=bar, hf_etag=hf_etag)
            if have is None:
                return
            e = ConnectionError(
                f"connection closed after {have} of {state.data.get('total')} bytes"
            )
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            e = err
            have = part.stat().st_size if part.exists() else 0
        failures = 1 if have > before else failures + 1
        if not _transient(e) or failures >= retry.attempts or tries >= retry.max_total:
            raise _fail(where, url, e, tries) from None
        after = e.headers.get("Retry-After") if isinstance(e, urllib.error.HTTPError) else None
        retry.sleep(retry.delay(failures, after))


def _attempt(url, part: Path, state: _State, have: int, *, bar, hf_etag: bool):
    """One GET; returns None when ``part`` is complete, else the bytes it holds (the body was
    cut short). Raises urllib/OSError errors for the retry loop."""
    headers = {}
    if have:
        headers["Range"] = f"bytes={have}-"
        if state.data.get("validator"):
            headers["If-Range"] = state.data["validator"]
    try:
        resp, first = _open(url, headers)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not have:
            raise
        _, total = _content_range(e.headers.get("Content-Range"))
        if total == have or (total is None and state.data.get("total") == have):
            return None  # the earlier attempt had received everything
        part.unlink()
        state.save(validator=None, total=None)
        raise ConnectionError(
            f"the server's file is shorter than the {have} bytes received earlier; starting again"
        ) from None
    with resp:
        if resp.status == 206:
            start, total = _content_range(resp.headers.get("Content-Range"))
            if start != have:
                raise ConnectionError(
                    f"server answered Range bytes={have}- with "
                    f"{resp.headers.get('Content-Range')!r}"
                )
            mode = "ab"
        else:
            start, mode = 0, "wb"
            length = resp.headers.get("Content-Length")
            total = int(length) if length is not None and length.isdigit() else None
            if resp.headers.get("Content-Encoding") not in (None, "identity"):
                total = None  # Content-Length counts the encoded bytes
        if mode == "wb" or not state.data.get("validator"):
            found = hf_etag_checksum(first) if hf_etag else None
            state.save(
                validator=_validator(resp.headers),
                total=total,
                checksum=list(found) if found else state.data.get("checksum"),
                complete=False,
            )
        bar.reset(total=total)
        bar.update(start)
        with open(part, mode) as f:
            got = start
            while True:
                chunk = resp.read1(_CHUNK)  # what has arrived: kept if the next read fails
                if not chunk:
                    break
                f.write(chunk)
                got += len(chunk)
                bar.update(len(chunk))
    if total is not None and got < total:
        return got
    return None


# ---------------------------------------------------------------------------- Hugging Face
def hf_endpoint(base_url: str | None) -> str:
    return (base_url or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")


def hf_file_url(endpoint: str, repo: str, path: str, revision: str = "main") -> str:
    return (
        f"{endpoint}/datasets/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/"
        f"{urllib.parse.quote(path, safe='/')}"
    )


_LINK_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


def hf_list_entries(
    endpoint: str, repo: str, path: str, *, where: str, revision: str = "main"
) -> dict[str, Remote]:
    """``{path: Remote(size, checksum)}`` for every file under ``path`` in a Hugging Face
    dataset repo (the tree API; LFS files carry their sha256, others their git blob sha1)."""
    url = (
        f"{endpoint}/api/datasets/{repo}/tree/{urllib.parse.quote(revision, safe='')}/"
        f"{urllib.parse.quote(path.strip('/'), safe='/')}?recursive=true"
    )
    files = {}
    while url:
        entries, hdrs = fetch_json(url, where=where)
        if not isinstance(entries, list):
            raise DatasetDownloadError(
                f"{where}: GET {url} returned {type(entries).__name__}, "
                "expected a JSON list of tree entries."
            )
        for e in entries:
            if e.get("type") == "file":
                files[e["path"]] = _hf_remote(e)
        m = _LINK_NEXT.search(hdrs.get("Link", "") or hdrs.get("link", ""))
        url = urllib.parse.urljoin(url, m.group(1)) if m else None
    return files


def _hf_remote(entry: dict) -> Remote:
    lfs = entry.get("lfs") or {}
    size = lfs.get("size", entry.get("size"))
    if lfs.get("oid"):
        return Remote(size, Checksum("sha256", str(lfs["oid"]).lower()))
    if entry.get("oid"):
        return Remote(size, Checksum("git-sha1", str(entry["oid"]).lower()))
    return Remote(size, None)


# ---------------------------------------------------------------------------- Google Cloud Storage
def gcs_list_entries(endpoint: str, bucket: str, prefix: str, *, where: str) -> dict[str, Remote]:
    """``{object name: Remote(size, md5)}`` under ``prefix`` in a public GCS bucket (JSON API,
    all pages; composite objects have no MD5)."""
    base = (
        f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?prefix="
        f"{urllib.parse.quote(prefix, safe='')}"
    )
    out, token = {}, None
    while True:
        url = base + (f"&pageToken={urllib.parse.quote(token, safe='')}" if token else "")
        page, _ = fetch_json(url, where=where)
        for it in page.get("items", []):
            size = int(it["size"]) if str(it.get("size", "")).isdigit() else None
            md5 = it.get("md5Hash")
            checksum = Checksum("md5", base64.b64decode(md5).hex()) if md5 else None
            out[it["name"]] = Remote(size, checksum)
        token = page.get("nextPageToken")
        if not token:
            return out


def gcs_object_url(endpoint: str, bucket: str, name: str) -> str:
    return f"{endpoint}/{bucket}/{urllib.parse.quote(name, safe='/')}"
