"""Dataset downloads against the local server with injected faults: resume with HTTP Range
(in the same call, in a later call, after SIGKILL), retries with backoff (no real sleeping),
published checksums, progress bars, the staging directory a loader keeps for the next run, and
the optional ``huggingface_hub`` path.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("h5py")
import _dataset_server as S  # noqa: E402

import functional_rb.adapters.datasets as D  # noqa: E402
from functional_rb.adapters.datasets import _cache, _hub  # noqa: E402
from functional_rb.adapters.datasets import _download as dl  # noqa: E402
from functional_rb.adapters.datasets._d4rl_files import D4RL_FILES  # noqa: E402

DATA = bytes(range(256)) * 400  # 102,400 bytes
DATA2 = bytes(reversed(range(256))) * 300


server = S.server_fixture(page_size=2)


@pytest.fixture
def slept(monkeypatch):
    """The delays the default retry policy asked for (nothing really sleeps)."""
    delays = []
    monkeypatch.setattr(dl, "DEFAULT_RETRY", dl.Retry(sleep=delays.append))
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "http")
    return delays


def get(server, url_path, dest, **kw):
    kw.setdefault("progress", False)
    return dl.download(server.url + url_path, dest, where="test", **kw)


def files_under(root) -> list:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------- resume
def test_closed_connection_is_resumed_with_range(server, tmp_path, slept):
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("cut", 30000)]
    out = get(server, "/f.bin", tmp_path / "f.bin")
    assert out.read_bytes() == DATA
    gets = server.gets("/f.bin")
    assert [g["range"] for g in gets] == [None, "bytes=30000-"]
    assert gets[1]["if_range"] == f'"{S.md5(DATA)}"'  # the ETag of the first answer
    assert [g["status"] for g in gets] == [200, 206]
    assert [g["sent"] for g in gets] == [30000, len(DATA) - 30000]  # no byte sent twice
    assert slept == [1.0]
    assert files_under(tmp_path) == ["f.bin", "f.bin.download.json"]


def test_reset_connection_is_resumed(server, tmp_path, slept):
    """After a TCP reset the client keeps what it had read (a reset may also drop bytes still
    unread in its socket buffer) and asks for the rest."""
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("reset", 30000)]
    assert get(server, "/f.bin", tmp_path / "f.bin").read_bytes() == DATA
    first, second = server.gets("/f.bin")
    kept = int(second["range"][len("bytes=") : -1]) if second["range"] else 0
    assert first["sent"] == 30000 and kept <= 30000
    assert second["status"] == (206 if kept else 200)
    assert second["sent"] == len(DATA) - kept
    assert slept == [1.0]


def test_interrupted_download_is_resumed_by_a_later_call(server, tmp_path, slept):
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("cut", 40000)]
    with pytest.raises(D.DatasetDownloadError, match="connection closed after 40000") as err:
        get(server, "/f.bin", tmp_path / "f.bin", retry=dl.Retry(attempts=1))
    assert err.value.transient and server.url + "/f.bin" in str(err.value)
    assert not (tmp_path / "f.bin").exists()
    assert (tmp_path / "f.bin.part").stat().st_size == 40000
    get(server, "/f.bin", tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == DATA
    gets = server.gets("/f.bin")
    assert [(g["range"], g["sent"]) for g in gets] == [
        (None, 40000),
        ("bytes=40000-", len(DATA) - 40000),
    ]
    # a complete file recorded for the same URL is not fetched again
    get(server, "/f.bin", tmp_path / "f.bin")
    assert len(server.gets("/f.bin")) == 2


def test_sigkilled_download_is_resumed(server, tmp_path, slept):
    """A child process is SIGKILLed mid-body; the next download continues its .part."""
    server.files["/f.bin"] = DATA
    release = threading.Event()
    server.faults["/f.bin"] = [("stall", 50000, release)]
    dest = tmp_path / "f.bin"
    # the child loads the two stdlib-only modules by path: the package imports jax and torch
    child = (
        "import importlib.util, sys\n"
        "def load(name, path):\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    sys.modules[name] = m = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(m)\n"
        "    return m\n"
        f"load('functional_rb.adapters.datasets._progress', "
        f"{str(Path(dl.__file__).with_name('_progress.py'))!r})\n"
        f"dl = load('functional_rb.adapters.datasets._download', {str(dl.__file__)!r})\n"
        f"dl.download({server.url + '/f.bin'!r}, {str(dest)!r}, where='child', "
        "progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child])
    part = tmp_path / "f.bin.part"
    try:
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size == 50000):
            assert proc.poll() is None and time.monotonic() < deadline, "child did not stall"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
    assert not dest.exists()
    get(server, "/f.bin", dest)
    assert dest.read_bytes() == DATA
    gets = server.gets("/f.bin")
    assert [(g["range"], g["status"], g["sent"]) for g in gets] == [
        (None, 200, 50000),
        ("bytes=50000-", 206, len(DATA) - 50000),
    ]


def test_file_changed_on_the_server_is_downloaded_anew(server, tmp_path, slept):
    """If-Range carries the first ETag: a changed file comes back whole (200), not spliced."""
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("cut", 30000)]
    with pytest.raises(D.DatasetDownloadError):
        get(server, "/f.bin", tmp_path / "f.bin", retry=dl.Retry(attempts=1))
    server.files["/f.bin"] = DATA2
    get(server, "/f.bin", tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == DATA2
    last = server.gets("/f.bin")[-1]
    assert last["range"] == "bytes=30000-" and last["status"] == 200
    assert last["sent"] == len(DATA2)


@pytest.mark.parametrize("shrunk_to", [40000, 20000])
def test_range_not_satisfiable(server, tmp_path, slept, shrunk_to):
    """Without a validator the server cannot tell a changed file: a 416 whose total equals the
    partial file means it was complete; a shorter total restarts the download."""
    server.etags = False
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("cut", 40000)]
    with pytest.raises(D.DatasetDownloadError):
        get(server, "/f.bin", tmp_path / "f.bin", retry=dl.Retry(attempts=1))
    server.files["/f.bin"] = DATA[:shrunk_to]
    assert get(server, "/f.bin", tmp_path / "f.bin").read_bytes() == DATA[:shrunk_to]
    gets = server.gets("/f.bin")[1:]
    assert gets[0]["range"] == "bytes=40000-" and gets[0]["if_range"] is None
    assert gets[0]["status"] == 416
    if shrunk_to == 40000:
        assert len(gets) == 1 and slept == []
    else:
        assert [(g["range"], g["status"], g["sent"]) for g in gets[1:]] == [(None, 200, shrunk_to)]
        assert slept == [1.0]


# ------------------------------------------------------------------------------- retries
def test_5xx_and_resets_are_retried_with_backoff(server, tmp_path, slept):
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [
        ("status", 503),
        ("status", 500),
        ("status", 429, {"Retry-After": "7"}),
        ("reset", 0),
    ]
    assert get(server, "/f.bin", tmp_path / "f.bin").read_bytes() == DATA
    assert [g["status"] for g in server.gets("/f.bin")] == [503, 500, 429, 200, 200]
    assert slept == [1.0, 2.0, 7.0, 8.0]  # doubling backoff; Retry-After honoured


def test_retries_give_up_with_a_transient_error(server, tmp_path, slept):
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("status", 503)] * 10
    with pytest.raises(D.DatasetDownloadError) as err:
        get(server, "/f.bin", tmp_path / "f.bin", retry=dl.Retry(attempts=3, sleep=slept.append))
    msg = str(err.value)
    assert "HTTP 503" in msg and "after 3 attempts" in msg and server.url in msg
    assert err.value.transient
    assert len(server.gets("/f.bin")) == 3 and slept == [1.0, 2.0]


def test_progress_resets_the_retry_count(server, tmp_path, slept):
    """Each attempt that received bytes starts the count again: 5 cuts with attempts=2."""
    server.files["/f.bin"] = DATA
    server.faults["/f.bin"] = [("cut", 10000)] * 5  # each attempt gets 10,000 more bytes
    get(server, "/f.bin", tmp_path / "f.bin", retry=dl.Retry(attempts=2, sleep=slept.append))
    assert (tmp_path / "f.bin").read_bytes() == DATA
    assert [g["sent"] for g in server.gets("/f.bin")] == [10000] * 5 + [len(DATA) - 50000]
    assert slept == [1.0] * 5


def test_client_errors_are_not_retried(server, tmp_path, slept):
    with pytest.raises(D.DatasetDownloadError, match="HTTP 404") as err:
        get(server, "/missing.bin", tmp_path / "m.bin")
    assert not err.value.transient
    assert len(server.gets("/missing.bin")) == 1 and slept == []
    assert files_under(tmp_path) == []


def test_refused_connection_is_retried(tmp_path, slept):
    with pytest.raises(D.DatasetDownloadError) as err:
        dl.download(
            "http://127.0.0.1:9/f.bin",
            tmp_path / "f.bin",
            where="test",
            retry=dl.Retry(attempts=3, sleep=slept.append),
            progress=False,
        )
    assert err.value.transient and "after 3 attempts" in str(err.value)
    assert slept == [1.0, 2.0]


def test_listings_are_retried(server, slept):
    base = "/datasets/org/repo/resolve/main/d/"
    for i in range(3):
        server.files[f"{base}{i}.bin"] = DATA[: 100 * (i + 1)]
    server.faults["/api/datasets/org/repo/tree/main/d"] = [("status", 502)]
    entries = dl.hf_list_entries(server.url, "org/repo", "d", where="test")
    assert sorted(entries) == ["d/0.bin", "d/1.bin", "d/2.bin"]
    assert entries["d/1.bin"] == dl.Remote(200, dl.Checksum("git-sha1", S.git_sha1(DATA[:200])))
    assert slept == [1.0]


# ------------------------------------------------------------------------------- checksums
@pytest.mark.parametrize(
    "algo,digest",
    [
        ("sha256", hashlib.sha256(DATA).hexdigest()),
        ("md5", S.md5(DATA)),
        ("git-sha1", S.git_sha1(DATA)),
    ],
)
def test_published_checksums_are_checked(server, tmp_path, slept, algo, digest):
    server.files["/f.bin"] = DATA
    out = get(
        server, "/f.bin", tmp_path / "f.bin", checksum=dl.Checksum(algo, digest), size=len(DATA)
    )
    assert out.read_bytes() == DATA
    server.faults["/f.bin"] = [("body", DATA2)]
    with pytest.raises(dl.DatasetChecksumError) as err:
        get(server, "/f.bin", tmp_path / "g.bin", checksum=dl.Checksum(algo, digest))
    msg = str(err.value)
    assert "g.bin" in msg and server.url + "/f.bin" in msg and digest in msg and algo in msg
    assert isinstance(err.value, D.DatasetDownloadError) and not err.value.transient
    assert not (tmp_path / "g.bin").exists() and not (tmp_path / "g.bin.part").exists()


def test_listed_size_is_checked(server, tmp_path, slept):
    server.files["/f.bin"] = DATA
    with pytest.raises(D.DatasetDownloadError, match="source lists 99 "):
        get(server, "/f.bin", tmp_path / "f.bin", size=99)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("lfs", [False, True])
def test_hugging_face_etag_is_the_checksum(server, tmp_path, slept, lfs):
    """Hugging Face's resolve answers carry the file's git sha1 (ETag) or, for LFS files, its
    sha256 (X-Linked-Etag on the redirect to the CDN): a body corrupted in transit fails."""
    path = "/datasets/org/repo/resolve/main/f.bin"
    server.files[path] = DATA
    if lfs:
        server.lfs.add(path)
    out = get(server, path, tmp_path / "f.bin", hf_etag=True)
    assert out.read_bytes() == DATA
    cdn = f"/cdn/{hashlib.sha256(DATA).hexdigest()}"
    served = cdn if lfs else path
    assert [e["status"] for e in server.events] == ([302, 200] if lfs else [200])
    server.faults[served] = [("body", DATA2)]
    with pytest.raises(dl.DatasetChecksumError, match="sha256" if lfs else "git-sha1") as err:
        get(server, path, tmp_path / "g.bin", hf_etag=True)
    assert (hashlib.sha256(DATA).hexdigest() if lfs else S.git_sha1(DATA)) in str(err.value)


def test_gcs_listing_md5_is_the_checksum(server, tmp_path, slept):
    server.files["/bucket/dir/a.gz"] = DATA
    entries = dl.gcs_list_entries(server.url, "bucket", "dir/", where="test")
    assert entries == {"dir/a.gz": dl.Remote(len(DATA), dl.Checksum("md5", S.md5(DATA)))}
    server.faults["/bucket/dir/a.gz"] = [("body", DATA2)]
    with pytest.raises(dl.DatasetChecksumError, match="md5"):
        get(server, "/bucket/dir/a.gz", tmp_path / "a.gz", checksum=entries["dir/a.gz"].checksum)


# ------------------------------------------------------------------------------- progress
def test_progress_bar_on_stderr(server, tmp_path, slept, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    server.files["/data/hopper.hdf5"] = DATA
    get(server, "/data/hopper.hdf5", tmp_path / "x", progress=True)
    err = capsys.readouterr().err
    assert "hopper.hdf5" in err and "100%" in err and "100k" in err  # 100 KiB
    monkeypatch.setenv("FRB_DATASETS_PROGRESS", "0")
    get(server, "/data/hopper.hdf5", tmp_path / "y", progress=None)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------- staging
def test_staging_dir_is_kept_only_for_resumable_failures(tmp_path):
    def run(exc):
        with pytest.raises(type(exc)), _cache.staging_dir(tmp_path, "ns/data-v0") as d:
            (d / "part").write_bytes(b"x")
            raise exc
        return files_under(tmp_path)

    kept = run(KeyboardInterrupt())
    assert [p for p in kept if p.endswith("/part")] and all(
        p.startswith(".downloads/") for p in kept
    )
    assert run(D.DatasetDownloadError("net", transient=True)) == kept
    assert run(D.DatasetDownloadError("404")) == []
    run(KeyboardInterrupt())
    assert run(ValueError("format")) == []
    with _cache.staging_dir(tmp_path, "ns/data-v0") as d:
        (d / "part").write_bytes(b"x")
    assert files_under(tmp_path) == [] and not (tmp_path / ".downloads").exists()


def test_staging_dir_serializes_concurrent_builds(tmp_path):
    order, inside, release = [], threading.Event(), threading.Event()

    def first():
        with _cache.staging_dir(tmp_path, "same"):
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    def second():
        with _cache.staging_dir(tmp_path, "same"):
            order.append("second in")

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    time.sleep(0.2)
    assert order == ["first in"]  # the second build waits
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["first in", "first out", "second in"]


def d4rl_bytes(tmp_path) -> bytes:
    n = 7
    rng = np.random.default_rng(0)

    def fill(f):
        f["observations"] = rng.normal(size=(n, 3)).astype(np.float32)
        f["actions"] = rng.normal(size=(n, 2)).astype(np.float32)
        f["rewards"] = np.arange(n, dtype=np.float32)
        f["terminals"] = np.array([0, 0, 1, 0, 0, 0, 0], bool)
        f["timeouts"] = np.zeros(n, bool)

    return S.h5_bytes(tmp_path, "d4rl.hdf5", fill)


def test_loader_resumes_an_interrupted_download(server, tmp_path, monkeypatch, slept):
    """A network failure that outlasts the retries keeps the partial file in
    <root>/.downloads; the next construction resumes it with a Range request."""
    data = d4rl_bytes(tmp_path)
    path = "/" + D4RL_FILES["hopper-medium-v2"]
    server.files[path] = data
    half = len(data) // 2
    server.faults[path] = [("reset", half)]
    monkeypatch.setattr(dl, "DEFAULT_RETRY", dl.Retry(attempts=1, sleep=slept.append))
    root = tmp_path / "root"
    with pytest.raises(D.DatasetDownloadError) as err:
        D.D4RLExperienceReplay("hopper-medium-v2", 2, root=root, base_url=server.url)
    assert err.value.transient
    left = files_under(root)
    parts = [p for p in left if p.endswith(".hdf5.part")]
    assert len(parts) == 1 and parts[0].startswith(".downloads/")
    assert (root / parts[0]).stat().st_size == half
    assert not (root / "hopper-medium-v2").exists()
    rb = D.D4RLExperienceReplay("hopper-medium-v2", 2, root=root, base_url=server.url)
    assert len(rb) == 6
    assert [(g["range"], g["sent"]) for g in server.gets(path)] == [
        (None, half),
        (f"bytes={half}-", len(data) - half),
    ]
    assert not (root / ".downloads").exists()  # removed once the dataset is built


# ------------------------------------------------------------------------------- huggingface_hub
def test_hub_client_path(server, tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "hub")
    base = "/datasets/org/repo/resolve/main/"
    server.files[base + "d/small.json"] = b'{"a": 1}'
    server.files[base + "d/big.bin"] = DATA
    server.lfs.add(base + "d/big.bin")
    listing = _hub.hf_list(server.url, "org/repo", "d", where="test")
    assert listing == {
        "d/big.bin": dl.Remote(len(DATA), dl.Checksum("sha256", hashlib.sha256(DATA).hexdigest())),
        "d/small.json": dl.Remote(8, dl.Checksum("git-sha1", S.git_sha1(b'{"a": 1}'))),
    }
    for name, data in (("d/big.bin", DATA), ("d/small.json", b'{"a": 1}')):
        out = _hub.hf_download(server.url, "org/repo", name, tmp_path / "x", where="test")
        assert out.read_bytes() == data
    # huggingface_hub asks HEAD for the metadata (the plain path never does), and fetches the
    # LFS file from the CDN the Hub redirects to
    heads = [e["path"] for e in server.events if e["method"] == "HEAD"]
    assert heads == [base + "d/big.bin", base + "d/small.json"]
    assert server.gets(f"/cdn/{hashlib.sha256(DATA).hexdigest()}")[0]["sent"] == len(DATA)
    with pytest.raises(D.DatasetDownloadError, match="HTTP 404") as err:
        _hub.hf_download(server.url, "org/repo", "d/missing", tmp_path / "m", where="test")
    assert not err.value.transient and "d/missing" in str(err.value)


def test_unknown_downloader_is_rejected(monkeypatch, tmp_path):
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "gsutil")
    with pytest.raises(ValueError, match="FRB_DATASETS_DOWNLOADER='gsutil'"):
        D.MinariExperienceReplay("test/x-v0", 2, root=tmp_path)
