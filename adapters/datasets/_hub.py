"""Hub downloads: plain HTTP (default) or the hubs' own client libraries (optional).

``FRB_DATASETS_DOWNLOADER`` picks the path:

- ``http`` (default): :mod:`._download` (``urllib``): resume, retries, published checksums,
  progress bars; no extra package.
- ``hub``: files hosted on the Hugging Face Hub go through ``huggingface_hub``
  (``hf_hub_download``, ``HfApi.list_repo_tree``: its token handling (``HF_TOKEN``), Xet
  transfers, retries and resumption, its progress bars and ``HF_HUB_*`` settings), into the
  dataset's staging directory; Minari datasets go through ``minari.download_dataset`` (any
  ``MINARI_REMOTE``, ``gcp://`` included) into Minari's own cache
  (``$MINARI_DATASETS_PATH``), as TorchRL's loader does. Needs ``pip install huggingface_hub``
  and, for Minari, ``pip install "minari[hdf5,hf]"``.
"""

from __future__ import annotations

import os
from pathlib import Path

from functional_rb.adapters.datasets import _download as dl

_CHOICES = ("http", "hub")


def use_hub(where: str) -> bool:
    """Whether ``$FRB_DATASETS_DOWNLOADER`` asks for the hub client libraries."""
    choice = os.environ.get("FRB_DATASETS_DOWNLOADER", "http").strip().lower() or "http"
    if choice not in _CHOICES:
        raise ValueError(
            f"{where}: FRB_DATASETS_DOWNLOADER={choice!r}; expected one of {_CHOICES}."
        )
    return choice == "hub"


def _require(module: str, pip: str, where: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{where}: FRB_DATASETS_DOWNLOADER=hub needs {module}: pip install "
            f"{pip!r} (or unset FRB_DATASETS_DOWNLOADER for plain HTTP)."
        ) from None


def _hub_error(e: Exception, what: str, where: str) -> dl.DatasetDownloadError:
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    transient = status is None or status >= 500 or status in (408, 429)
    code = f"HTTP {status}: " if status is not None else ""
    return dl.DatasetDownloadError(
        f"{where}: huggingface_hub could not fetch {what} ({code}{type(e).__name__}: {e}).",
        transient=transient,
    )


def hf_list(
    endpoint: str, repo: str, path: str, *, where: str, revision: str = "main"
) -> dict[str, dl.Remote]:
    """``{path: Remote(size, checksum)}`` of the files under ``path`` in a dataset repo."""
    if not use_hub(where):
        return dl.hf_list_entries(endpoint, repo, path, where=where, revision=revision)
    hf = _require("huggingface_hub", "huggingface_hub", where)
    api = hf.HfApi(endpoint=endpoint)
    try:
        tree = list(
            api.list_repo_tree(
                repo,
                path_in_repo=path.strip("/") or None,
                recursive=True,
                repo_type="dataset",
                revision=revision,
            )
        )
    except (hf.errors.HfHubHTTPError, OSError) as e:
        raise _hub_error(
            e, f"the listing of {endpoint}/datasets/{repo}/tree/{revision}/{path}", where
        ) from None
    out = {}
    for entry in tree:
        if isinstance(entry, hf.hf_api.RepoFile):
            lfs = getattr(entry, "lfs", None)
            sha = (
                (lfs.get("sha256") or lfs.get("oid"))
                if isinstance(lfs, dict)
                else getattr(lfs, "sha256", None)
            )
            checksum = (
                dl.Checksum("sha256", sha)
                if sha
                else dl.Checksum("git-sha1", entry.blob_id)
                if entry.blob_id
                else None
            )
            out[entry.path] = dl.Remote(entry.size, checksum)
    return out


def hf_download(
    endpoint: str,
    repo: str,
    path: str,
    dest,
    *,
    where: str,
    remote: dl.Remote | None = None,
    revision: str = "main",
) -> Path:
    """Download ``path`` of a dataset repo; returns the local file (``dest`` on the HTTP path;
    ``<dest's directory>/.hf/<path>`` through ``huggingface_hub``). ``remote``: the listing's
    size and checksum; without it the HTTP path checks Hugging Face's ETag."""
    if not use_hub(where):
        remote = remote or dl.Remote()
        return dl.download(
            dl.hf_file_url(endpoint, repo, path, revision),
            dest,
            where=where,
            checksum=remote.checksum,
            size=remote.size,
            hf_etag=True,
        )
    hf = _require("huggingface_hub", "huggingface_hub", where)
    try:
        local = hf.hf_hub_download(
            repo_id=repo,
            filename=path,
            repo_type="dataset",
            revision=revision,
            endpoint=endpoint,
            local_dir=Path(dest).parent / ".hf",
        )
    except (hf.errors.HfHubHTTPError, hf.errors.LocalEntryNotFoundError, OSError) as e:
        raise _hub_error(e, dl.hf_file_url(endpoint, repo, path, revision), where) from None
    return Path(local)


def minari_download(dataset_id: str, *, where: str) -> Path:
    """``minari.download_dataset(dataset_id)`` (skipped when Minari's cache has it); returns
    the dataset's ``data`` directory in Minari's cache."""
    _require("huggingface_hub", "minari[hdf5,hf]", where)
    minari = _require("minari", "minari[hdf5,hf]", where)
    from minari.storage import get_dataset_path

    path = Path(get_dataset_path(dataset_id)) / "data"
    if not (path / "main_data.hdf5").exists():
        try:
            minari.download_dataset(dataset_id)
        except ValueError as e:  # minari's "not found" / "incompatible version"
            raise dl.DatasetDownloadError(
                f"{where}: minari.download_dataset({dataset_id!r}) failed: {e}"
            ) from None
        except Exception as e:  # huggingface_hub's or google-cloud-storage's errors
            raise _hub_error(e, f"{dataset_id!r} (minari.download_dataset)", where) from None
    return path
