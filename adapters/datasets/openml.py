"""OpenML tabular datasets (bandit data), from openml.org's REST API (no scikit-learn)."""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._formats import DatasetFormatError, parse_arff
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.random import SamplerWithoutReplacement
from functional_rb.adapters.writers.base import Writer

OPENML_BASE_URL = "https://api.openml.org"
# TorchRL's names -> (OpenML dataset name, version), as TorchRL passes them to fetch_openml
_DATASETS = {
    "adult_num": ("adult", 1),
    "adult_onehot": ("adult", 1),
    "mushroom_num": ("mushroom", 1),
    "mushroom_onehot": ("mushroom", 1),
    "covertype": ("covertype", 3),
    "shuttle": ("shuttle", 1),
    "magic": ("MagicTelescope", 1),
}


class OpenMLExperienceReplay(BaseDatasetExperienceReplay):
    """OpenML classification datasets as contextual-bandit data (TorchRL's
    ``OpenMLExperienceReplay``; Dua & Graff, UCI Machine Learning Repository).

    Source: openml.org's REST API, the calls scikit-learn's ``fetch_openml`` makes (TorchRL
    uses it): ``{base_url}/api/v1/json/data/list/data_name/<name>/limit/2/data_version/<v>``
    (dataset id), ``{base_url}/api/v1/json/data/<id>`` (description: file id, target, MD5),
    ``{base_url}/api/v1/json/data/features/<id>`` (ignored / row-id attributes) and the data
    file ``{base_url}/data/v1/download/<file_id>`` (ARFF, possibly gzipped; its MD5 is
    checked). ``base_url`` defaults to ``$FRB_OPENML_BASE_URL`` or ``https://api.openml.org``.
    ``name`` is one of ``"adult_num"``, ``"adult_onehot"``, ``"mushroom_num"``,
    ``"mushroom_onehot"``, ``"covertype"``, ``"shuttle"``, ``"magic"``.

    Format read: ARFF (dense or sparse; nominal, numeric, string attributes; ``?`` missing).

    Data (TorchRL's preprocessing, done in NumPy instead of scikit-learn/pandas): ``X``
    float64 ``[N, F]`` and ``y`` int64 ``[N]``.

    - ``adult_*``: rows with a missing feature dropped; ``y`` = the ``occupation`` feature
      label-encoded (sorted category names -> 0..K-1), which is removed from ``X``; nominal
      features label-encoded; ``adult_num``: every column standardized (zero mean, unit
      population std; constant columns only centred); ``adult_onehot``: the numeric columns
      standardized, followed by one-hot codes of the nominal ones.
    - ``mushroom_*``: every (nominal) feature label-encoded (missing values take the last
      code), ``y`` = the target label-encoded; ``_num`` standardizes, ``_onehot`` one-hot
      encodes.
    - ``covertype``, ``shuttle``, ``magic``: numeric features standardized, ``y`` = the target
      label-encoded.

    The arguments are TorchRL's, plus ``download`` and ``base_url``. :attr:`max_outcome_val`
    is ``y.max()``.

    Args:
      name: the OpenML dataset's name.
      sampler: which items ``sample`` draws (default ``SamplerWithoutReplacement``)."""

    available_datasets = list(_DATASETS)

    def __init__(
        self,
        name: str,
        batch_size: int | None = None,
        root: Path | None = None,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        *,
        download: bool | str = True,
        base_url: str | None = None,
    ):
        if name not in _DATASETS:
            raise RuntimeError(
                f"{type(self).__name__}: dataset {name!r} does not exist; "
                f"choose one of {sorted(_DATASETS)}."
            )
        if sampler is None:
            sampler = SamplerWithoutReplacement()
        self.dataset_id = name
        self.root = default_root("openml") if root is None else root
        self.base_url = (
            base_url or os.environ.get("FRB_OPENML_BASE_URL") or OPENML_BASE_URL
        ).rstrip("/")
        path = self._prepare(download, self._build)
        self._open(
            path,
            batch_size=batch_size,
            sampler=sampler,
            writer=writer,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            prefetch=prefetch,
            transform=transform,
        )
        self.max_outcome_val = int(np.asarray(self._storage.leaf(("y",))).max())

    def _build(self, out: Path):
        who = type(self).__name__
        oml_name, version = _DATASETS[self.dataset_id]
        api = f"{self.base_url}/api/v1/json"
        listing, _ = dl.fetch_json(
            f"{api}/data/list/data_name/{oml_name}/limit/2/data_version/{version}", where=who
        )
        try:
            did = int(listing["data"]["dataset"][0]["did"])
            desc, _ = dl.fetch_json(f"{api}/data/{did}", where=who)
            desc = desc["data_set_description"]
            file_id = desc["file_id"]
            target = desc["default_target_attribute"]
            feats, _ = dl.fetch_json(f"{api}/data/features/{did}", where=who)
            feats = feats["data_features"]["feature"]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise DatasetFormatError(
                f"{who}: unexpected OpenML API answer for {oml_name!r} "
                f"v{version} ({type(e).__name__}: {e})."
            ) from None
        url = f"{self.base_url}/data/v1/download/{file_id}"
        with staging_dir(self.root, self.dataset_id) as tmp:
            raw = dl.download(url, tmp / f"{file_id}.arff", where=who).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        md5 = desc.get("md5_checksum")
        if md5 and hashlib.md5(raw).hexdigest() != md5:
            raise DatasetFormatError(
                f"{who}: {url} has MD5 {hashlib.md5(raw).hexdigest()}, the "
                f"OpenML description says {md5} (corrupted download)."
            )
        where = f"{who}({url})"
        attrs, cols = parse_arff(raw.decode("utf-8"), where)
        skip = {
            f["name"]
            for f in feats
            if str(f.get("is_ignore")).lower() == "true"
            or str(f.get("is_row_identifier")).lower() == "true"
        }
        columns = {a.name: (a, c) for a, c in zip(attrs, cols)}
        if target not in columns:
            raise DatasetFormatError(f"{where}: target attribute {target!r} not in the file.")
        features = [a.name for a in attrs if a.name != target and a.name not in skip]
        x, y = _preprocess(self.dataset_id, columns, features, target, where)
        write_episodes(
            out,
            [(len(y), lambda: {("X",): x, ("y",): y})],
            where=where,
            dataset_id=self.dataset_id,
            source=url,
            openml_id=did,
        )


# ---------------------------------------------------------------------------- preprocessing
def _label_encode(values) -> np.ndarray:
    """scikit-learn's ``LabelEncoder``: sorted distinct values -> 0..K-1 (missing last)."""
    present = sorted({v for v in values if v is not None and not _isnan(v)})
    code = {v: i for i, v in enumerate(present)}
    miss = len(present)
    return np.array([miss if (v is None or _isnan(v)) else code[v] for v in values], np.int64)


def _isnan(v) -> bool:
    return isinstance(v, float) and v != v


def _standardize(x: np.ndarray) -> np.ndarray:
    """scikit-learn's ``StandardScaler``: population std, constant columns only centred."""
    x = np.asarray(x, np.float64)
    mean = x.mean(0)
    std = x.std(0)
    std[std == 0] = 1.0
    return (x - mean) / std


def _one_hot(codes: np.ndarray) -> np.ndarray:
    """scikit-learn's ``OneHotEncoder``: one column per distinct value of each column,
    columns and values in sorted order."""
    parts = []
    for j in range(codes.shape[1]):
        cats = np.unique(codes[:, j])
        parts.append((codes[:, j][:, None] == cats[None, :]).astype(np.float64))
    return np.concatenate(parts, 1) if parts else np.zeros((len(codes), 0))


def _numeric(attr, col, where) -> np.ndarray:
    if attr.kind == "numeric":
        return np.asarray(col, np.float64)
    try:  # nominal features with numeric labels ('0'/'1') convert like pandas categories
        return np.array([np.nan if v is None else float(v) for v in col], np.float64)
    except ValueError:
        raise DatasetFormatError(
            f"{where}: feature {attr.name!r} is {attr.kind}, not numeric."
        ) from None


def _preprocess(name, columns, features, target, where):
    if name.startswith("adult"):
        if "occupation" not in features:
            raise DatasetFormatError(f"{where}: no 'occupation' attribute.")
        n = len(columns[features[0]][1])
        missing = np.zeros(n, bool)
        for f in features:
            a, c = columns[f]
            missing |= np.isnan(c) if a.kind == "numeric" else np.array([v is None for v in c])
        keep = ~missing
        y = _label_encode([v for v, k in zip(columns["occupation"][1], keep) if k])
        feats = [f for f in features if f != "occupation"]
        enc = {}
        for f in feats:
            a, c = columns[f]
            if a.kind == "numeric":
                enc[f] = np.asarray(c, np.float64)[keep]
            else:
                enc[f] = _label_encode([v for v, k in zip(c, keep) if k]).astype(np.float64)
        num = [f for f in feats if columns[f][0].kind == "numeric"]
        cat = [f for f in feats if columns[f][0].kind != "numeric"]
        if name == "adult_onehot":
            x = np.concatenate(
                [
                    _standardize(np.stack([enc[f] for f in num], 1)),
                    _one_hot(np.stack([enc[f] for f in cat], 1).astype(np.int64)),
                ],
                1,
            )
        else:
            x = _standardize(np.stack([enc[f] for f in feats], 1))
        return x, y
    ta, tc = columns[target]
    y = _label_encode(tc if ta.kind != "numeric" else [float(v) for v in tc])
    if name.startswith("mushroom"):
        codes = np.stack([_label_encode(columns[f][1]) for f in features], 1)
        x = _one_hot(codes) if name == "mushroom_onehot" else _standardize(codes)
        return x, y
    x = _standardize(np.stack([_numeric(*columns[f], where) for f in features], 1))
    return x, y
