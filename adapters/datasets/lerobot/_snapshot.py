"""LeRobot's on-disk format (v2.x and v3.x) as it sits in a Hugging Face dataset repo:
``meta/info.json``, the episodes and tasks tables, the data parquet files, read with pyarrow
into columns with the dtypes TorchRL's loader gets through ``datasets``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets import _hub
from functional_rb.adapters.datasets._formats import DatasetFormatError, decode_image
from functional_rb.adapters.datasets.lerobot.columns import columns_to_leaves

_SUPPORTED_MAJOR = (2, 3)


class Snapshot:
    """The files of one LeRobot dataset repo, downloaded into ``tmp`` as they are needed."""

    def __init__(self, endpoint: str, repo: str, tmp: Path, where: str):
        self.endpoint, self.repo, self.tmp, self.where = endpoint, repo, tmp, where
        self.meta = _hub.hf_list(endpoint, repo, "meta", where=where)
        self.info = self.json("meta/info.json")
        version = str(self.info.get("codebase_version", ""))
        try:
            self.major = int(version.lstrip("v").split(".")[0])
        except ValueError:
            self.major = None
        if self.major not in _SUPPORTED_MAJOR or not isinstance(self.info.get("features"), dict):
            raise DatasetFormatError(
                f"{where}: {self.url('meta/info.json')} has codebase_version {version!r} and "
                f"features of type {type(self.info.get('features')).__name__}; expected a "
                "LeRobot v2.x or v3.x info.json with a 'features' dict."
            )
        self.stats = self.json("meta/stats.json") if "meta/stats.json" in self.meta else None

    def url(self, path: str) -> str:
        return dl.hf_file_url(self.endpoint, self.repo, path)

    def fetch(self, path: str, listing: dict) -> Path:
        if path not in listing:
            raise DatasetFormatError(
                f"{self.where}: {self.url(path)} is missing: the repo "
                f"{self.endpoint}/datasets/{self.repo} has no {path!r}."
            )
        dest = self.tmp / path.replace("/", "__")
        return _hub.hf_download(
            self.endpoint, self.repo, path, dest, where=self.where, remote=listing[path]
        )

    def json(self, path: str, lines: bool = False):
        try:
            text = self.fetch(path, self.meta).read_text()
            return (
                [json.loads(x) for x in text.splitlines() if x.strip()]
                if lines
                else json.loads(text)
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetFormatError(
                f"{self.where}: {self.url(path)} is not JSON{' lines' if lines else ''} ({e})."
            ) from None

    def table(self, path: str, listing: dict, columns=None):
        pq = _pyarrow(self.where)
        local = self.fetch(path, listing)
        try:
            return pq.read_table(local, columns=columns)
        except Exception as e:  # pyarrow's ArrowInvalid, OSError...: a damaged file
            raise DatasetFormatError(
                f"{self.where}: {self.url(path)} is not a readable parquet "
                f"file ({type(e).__name__}: {e})."
            ) from None

    def video_features(self) -> list:
        return sorted(
            k
            for k, f in self.info["features"].items()
            if isinstance(f, dict) and f.get("dtype") == "video"
        )

    def episodes(self) -> list | None:
        """Per-episode rows (``episode_index``, ``length``, v3's ``data/chunk_index`` ...)."""
        v3 = sorted(
            p for p in self.meta if p.startswith("meta/episodes/") and p.endswith(".parquet")
        )
        if v3:
            rows = []
            for p in v3:
                t = self.table(p, self.meta)
                keep = [c for c in t.column_names if not c.startswith("stats/")]
                rows += t.select(keep).to_pylist()
        elif "meta/episodes.jsonl" in self.meta:
            rows = self.json("meta/episodes.jsonl", lines=True)
        else:
            return None
        return sorted(rows, key=lambda r: int(r["episode_index"]))

    def tasks(self) -> dict:
        if "meta/tasks.parquet" in self.meta:
            rows = self.table("meta/tasks.parquet", self.meta).to_pylist()
            text = lambda r: r.get("task", r.get("__index_level_0__"))  # noqa: E731
        elif "meta/tasks.jsonl" in self.meta:
            rows, text = self.json("meta/tasks.jsonl", lines=True), lambda r: r.get("task")
        else:
            return {}
        out = {}
        for r in rows:
            if r.get("task_index") is None or not isinstance(text(r), str):
                raise DatasetFormatError(
                    f"{self.where}: a row of the tasks table has no "
                    f"'task_index' or task string: {r}."
                )
            out[int(r["task_index"])] = text(r)
        return out

    def expected_files(self, episodes: list | None) -> dict:
        """``{data file: [episode, ...]}`` as the episode metadata places them."""
        if not episodes:
            return {}
        template, out = self.info.get("data_path"), {}
        for r in episodes:
            e = int(r["episode_index"])
            try:
                if self.major >= 3:
                    path = template.format(
                        chunk_index=int(r["data/chunk_index"]), file_index=int(r["data/file_index"])
                    )
                else:
                    path = template.format(
                        episode_chunk=e // int(self.info.get("chunks_size", 1000)), episode_index=e
                    )
            except (KeyError, AttributeError, ValueError, TypeError) as err:
                raise DatasetFormatError(
                    f"{self.where}: cannot place episode {e} with data_path {template!r} of "
                    f"{self.url('meta/info.json')} ({type(err).__name__}: {err})."
                ) from None
            out.setdefault(path, []).append(e)
        return out

    def frames(self, key_map):
        """(data files, ``write_episodes`` plan (one unit per file, or one sorted unit when the
        files are not in ``index`` order), per-unit text lists filled as units load)."""
        data = _hub.hf_list(self.endpoint, self.repo, "data", where=self.where)
        files = sorted(p for p in data if p.endswith(".parquet"))
        for path, eps in self.expected_files(self.episodes()).items():
            if path not in data:
                raise DatasetFormatError(
                    f"{self.where}: {self.url(path)} is missing: the episode metadata puts "
                    f"episodes {eps[:5]}{'...' if len(eps) > 5 else ''} in it."
                )
        if not files:
            raise DatasetFormatError(
                f"{self.where}: no data/**/*.parquet file in {self.endpoint}/datasets/{self.repo}."
            )
        tasks = self.tasks()
        features = self.info["features"]
        index = [
            self.table(p, data, ["index"]).column("index").to_numpy()
            if "index" in features
            else None
            for p in files
        ]
        sizes = [
            len(i) if i is not None else self.table(p, data).num_rows for p, i in zip(files, index)
        ]
        total = self.info.get("total_frames")
        if total is not None and int(total) != sum(sizes):
            raise DatasetFormatError(
                f"{self.where}: {self.url('meta/info.json')} says total_frames={total}, the "
                f"data files {files} hold {sum(sizes)} frames (a data file is missing or "
                "truncated)."
            )
        texts: list = []

        def load(paths):
            cols = {}
            for p in paths:
                for k, v in _columns(
                    self.table(p, data), features, tasks, f"{self.where}({self.url(p)})"
                ).items():
                    cols.setdefault(k, []).append(v)
            cols = {
                k: sum(v, []) if isinstance(v[0], list) else np.concatenate(v)
                for k, v in cols.items()
            }
            if "index" in cols and len(paths) > 1:
                order = np.argsort(cols["index"], kind="stable")
                cols = {
                    k: [v[i] for i in order] if isinstance(v, list) else v[order]
                    for k, v in cols.items()
                }
            arrays, text, _ = columns_to_leaves(cols, key_map, self.where)
            texts.append(text)
            return arrays

        flat = np.concatenate(index) if index[0] is not None else None
        if flat is not None and (np.diff(flat) < 0).any():  # TorchRL sorts by "index"
            return files, [(sum(sizes), lambda: load(files))], texts
        return files, [(n, lambda p=p: load([p])) for n, p in zip(sizes, files)], texts


def _pyarrow(where: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"{where}: reading LeRobot's parquet files needs pyarrow: pip install pyarrow."
        ) from None
    return pq


def _columns(table, features: dict, tasks: dict, where: str) -> dict:
    """One data file's columns: numeric arrays with TorchRL's dtypes, images decoded, strings
    as lists; ``task`` added from ``task_index`` and the tasks table."""
    import pyarrow as pa

    out = {}
    for name in table.column_names:
        if name.startswith("__index_level_"):
            continue  # a pandas index written by to_parquet, not a feature
        col = table.column(name).combine_chunks()
        feature = features.get(name) or {}
        if col.null_count:
            raise DatasetFormatError(f"{where}: column {name!r} has {col.null_count} nulls.")
        if pa.types.is_struct(col.type) or feature.get("dtype") == "image":
            out[name] = _images(col, name, where)
        elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            out[name] = col.to_pylist()
        else:
            out[name] = _numeric(col, name, feature, where)
    if "task" not in out and "task_index" in out and tasks:
        missing = sorted(set(out["task_index"].tolist()) - set(tasks))
        if missing:
            raise DatasetFormatError(
                f"{where}: task_index values {missing[:5]} are not in the "
                "dataset's tasks table (meta/tasks.*)."
            )
        out["task"] = [tasks[int(i)] for i in out["task_index"]]
    return out


def _images(col, name: str, where: str) -> np.ndarray:
    if not hasattr(col.type, "get_field_index") or col.type.get_field_index("bytes") < 0:
        raise DatasetFormatError(
            f"{where}: image column {name!r} has type {col.type}; "
            "expected LeRobot's struct<bytes: binary, path: string>."
        )
    raw = col.field("bytes").to_pylist()
    if any(b is None for b in raw):
        raise DatasetFormatError(
            f"{where}: image column {name!r} holds paths without bytes; "
            "LeRobot embeds the encoded images in the parquet file."
        )
    return np.stack([decode_image(b, f"{where}:{name}") for b in raw])


def _numeric(col, name: str, feature: dict, where: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    n, shape = len(col), []
    while (
        pa.types.is_list(col.type)
        or pa.types.is_large_list(col.type)
        or pa.types.is_fixed_size_list(col.type)
    ):
        lengths = np.unique(pc.list_value_length(col).to_numpy(zero_copy_only=False))
        if len(lengths) > 1:
            raise DatasetFormatError(
                f"{where}: column {name!r} holds lists of lengths "
                f"{lengths.tolist()}; a feature has one shape."
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        col = col.flatten()
    try:
        values = col.to_numpy(zero_copy_only=False)
    except (pa.ArrowException, TypeError) as e:
        raise DatasetFormatError(
            f"{where}: column {name!r} of type {col.type} is not numeric ({e})."
        ) from None
    if values.dtype == object:
        raise DatasetFormatError(f"{where}: column {name!r} of type {col.type} is not numeric.")
    values = values.reshape([n] + shape)
    declared = [int(s) for s in feature.get("shape", [])]
    if declared and shape != declared and not (declared == [1] and not shape):
        raise DatasetFormatError(
            f"{where}: column {name!r} has item shape {tuple(shape)}, "
            f"meta/info.json declares {tuple(declared)}."
        )
    # the dtypes TorchRL gets from datasets' torch formatting
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind == "f":
        return values.astype(np.float32)
    return values
