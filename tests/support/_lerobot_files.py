"""Small LeRobot datasets written in LeRobot's real on-disk layout (v3.0 and v2.1) with pyarrow,
as ``{repo path: bytes}`` to serve from tests/support/_dataset_server.py.

Layout and schemas follow lerobot (``src/lerobot/datasets/utils.py``, ``io_utils.py``,
``feature_utils.get_hf_features_from_features``): ``meta/info.json``; v3: data in
``data/chunk-000/file-XXX.parquet`` (several episodes per file), ``meta/episodes/chunk-000/
file-000.parquet`` (``episode_index``, ``tasks``, ``length``, ``data/chunk_index``,
``data/file_index``, ``dataset_from_index``/``dataset_to_index``, ``meta/episodes/*``,
``stats/*``), ``meta/tasks.parquet`` (pandas frame indexed by ``task``); v2.1: one
``data/chunk-000/episode_XXXXXX.parquet`` per episode, ``meta/episodes.jsonl``,
``meta/tasks.jsonl``, ``meta/episodes_stats.jsonl``. Feature columns: shape ``(1,)`` ->
a scalar column, 1-D -> ``fixed_size_list``, ``image`` -> ``struct<bytes, path>`` holding PNG
bytes; the ``huggingface`` schema metadata carries the ``datasets`` features, as
``Dataset.to_parquet`` writes it.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _dataset_server import png_bytes

TASKS = ["pick the cube", "open the drawer"]
LENGTHS = (4, 3, 5)
EPISODE_TASK = (0, 1, 0)
IMAGE_HWC = (4, 5, 3)
FPS = 10


def _features(video: bool) -> dict:
    f = {
        "observation.state": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
        "observation.environment_state": {"dtype": "float64", "shape": [2], "names": None},
        "action": {"dtype": "float32", "shape": [3], "names": ["vx", "vy", "grip"]},
        "observation.images.top": {
            "dtype": "image",
            "shape": list(IMAGE_HWC),
            "names": ["height", "width", "channels"],
        },
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    if video:
        f["observation.images.wrist"] = {
            "dtype": "video",
            "shape": [8, 8, 3],
            "names": ["height", "width", "channels"],
            "info": {
                "video.fps": float(FPS),
                "video.height": 8,
                "video.width": 8,
                "video.channels": 3,
                "video.codec": "av1",
                "video.pix_fmt": "yuv420p",
                "video.is_depth_map": False,
                "has_audio": False,
            },
        }
    return f


def frames(seed: int = 0) -> dict:
    """The raw per-frame columns (as LeRobot records them), episodes back to back."""
    rng = np.random.default_rng(seed)
    n = sum(LENGTHS)
    ep = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    frame = np.concatenate([np.arange(t) for t in LENGTHS])
    done = np.concatenate([np.arange(t) == t - 1 for t in LENGTHS])
    return {
        "observation.state": rng.normal(size=(n, 2)).astype(np.float32),
        "observation.environment_state": rng.normal(size=(n, 2)),
        "action": rng.normal(size=(n, 3)).astype(np.float32),
        "observation.images.top": rng.integers(0, 255, (n,) + IMAGE_HWC, np.uint8),
        "next.reward": done.astype(np.float32),
        "next.done": done,
        "timestamp": (frame / FPS).astype(np.float32),
        "frame_index": frame.astype(np.int64),
        "episode_index": ep.astype(np.int64),
        "index": np.arange(n, dtype=np.int64),
        "task_index": np.asarray(EPISODE_TASK, np.int64)[ep],
    }


def _hf_feature(ft: dict) -> dict:
    if ft["dtype"] == "image":
        return {"_type": "Image"}
    value = {"dtype": ft["dtype"], "_type": "Value"}
    if list(ft["shape"]) == [1]:
        return value
    return {"_type": "List", "feature": value, "length": int(ft["shape"][0])}


def _column(name: str, values: np.ndarray, ft: dict) -> pa.Array:
    if ft["dtype"] == "image":
        return pa.array(
            [{"bytes": png_bytes(v), "path": f"frame_{i:06d}.png"} for i, v in enumerate(values)],
            pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
    typ = pa.from_numpy_dtype(np.dtype(ft["dtype"]))
    if list(ft["shape"]) == [1]:
        return pa.array(values, typ)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), typ), int(ft["shape"][0]))


def data_parquet(cols: dict, rows, features: dict) -> bytes:
    """One data file: ``rows`` of the frames, columns in the features' order."""
    stored = {k: f for k, f in features.items() if f["dtype"] != "video"}
    arrays = [_column(k, cols[k][rows], f) for k, f in stored.items()]
    schema = pa.schema(
        [pa.field(k, a.type) for k, a in zip(stored, arrays)],
        metadata={
            "huggingface": json.dumps(
                {"info": {"features": {k: _hf_feature(f) for k, f in stored.items()}}}
            )
        },
    )
    return _parquet(pa.Table.from_arrays(arrays, schema=schema))


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _stats(cols: dict, rows) -> dict:
    out = {}
    for k in ("observation.state", "action"):
        v = cols[k][rows].astype(np.float64)
        out[k] = {
            "min": v.min(0).tolist(),
            "max": v.max(0).tolist(),
            "mean": v.mean(0).tolist(),
            "std": v.std(0).tolist(),
            "count": [len(v)],
        }
    return out


def _info(version: str, data_path: str, video: bool, **extra) -> dict:
    return {
        "codebase_version": version,
        "robot_type": "koch",
        "total_episodes": len(LENGTHS),
        "total_frames": sum(LENGTHS),
        "total_tasks": len(TASKS),
        "chunks_size": 1000,
        "fps": FPS,
        "splits": {"train": f"0:{len(LENGTHS)}"},
        "data_path": data_path,
        "video_path": (
            "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
            if video
            else None
        ),
        "features": _features(video),
        **extra,
    }


def _episode_rows(ep: int):
    start = sum(LENGTHS[:ep])
    return np.arange(start, start + LENGTHS[ep])


def v3(cols: dict, *, video: bool = False, file_episodes=((0, 1), (2,))) -> dict:
    """A LeRobot v3.0 repo: ``{path: bytes}``; episodes grouped into data files."""
    features = _features(video)
    files = {}
    ep_rows = {
        k: []
        for k in (
            "episode_index",
            "tasks",
            "length",
            "data/chunk_index",
            "data/file_index",
            "dataset_from_index",
            "dataset_to_index",
            "meta/episodes/chunk_index",
            "meta/episodes/file_index",
            "stats/action/mean",
        )
    }
    for fi, eps in enumerate(file_episodes):
        rows = np.concatenate([_episode_rows(e) for e in eps])
        files[f"data/chunk-000/file-{fi:03d}.parquet"] = data_parquet(cols, rows, features)
        for e in eps:
            r = _episode_rows(e)
            for k, v in (
                ("episode_index", e),
                ("tasks", [TASKS[EPISODE_TASK[e]]]),
                ("length", len(r)),
                ("data/chunk_index", 0),
                ("data/file_index", fi),
                ("dataset_from_index", int(r[0])),
                ("dataset_to_index", int(r[-1]) + 1),
                ("meta/episodes/chunk_index", 0),
                ("meta/episodes/file_index", 0),
                ("stats/action/mean", cols["action"][r].mean(0).tolist()),
            ):
                ep_rows[k].append(v)
    if video:
        for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            ep_rows[f"videos/observation.images.wrist/{k}"] = [0] * len(LENGTHS)
    order = sorted(range(len(LENGTHS)), key=lambda i: ep_rows["episode_index"][i])
    files["meta/episodes/chunk-000/file-000.parquet"] = _parquet(
        pa.table({k: [v[i] for i in order] for k, v in ep_rows.items()})
    )
    tasks = pa.table(
        {
            "task_index": pa.array(range(len(TASKS)), pa.int64()),
            "task": pa.array(TASKS, pa.string()),
        }
    )
    files["meta/tasks.parquet"] = _parquet(
        tasks.replace_schema_metadata(
            {
                "pandas": json.dumps(
                    {
                        "index_columns": ["task"],
                        "column_indexes": [],
                        "columns": [
                            {
                                "name": "task_index",
                                "field_name": "task_index",
                                "pandas_type": "int64",
                                "numpy_type": "int64",
                                "metadata": None,
                            },
                            {
                                "name": "task",
                                "field_name": "task",
                                "pandas_type": "unicode",
                                "numpy_type": "object",
                                "metadata": None,
                            },
                        ],
                        "creator": {"library": "pyarrow", "version": pa.__version__},
                        "pandas_version": "2.2.3",
                    }
                )
            }
        )
    )
    files["meta/info.json"] = json.dumps(
        _info(
            "v3.0",
            "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            video,
            data_files_size_in_mb=100,
            video_files_size_in_mb=200,
        ),
        indent=4,
    ).encode()
    files["meta/stats.json"] = json.dumps(_stats(cols, slice(None)), indent=4).encode()
    if video:
        files["videos/observation.images.wrist/chunk-000/file-000.mp4"] = b"\x00\x00\x00 ftyp"
    return files


def v21(cols: dict) -> dict:
    """A LeRobot v2.1 repo: one data file per episode, JSON-lines metadata."""
    features = _features(False)
    files = {}
    episodes, stats = [], []
    for e in range(len(LENGTHS)):
        r = _episode_rows(e)
        files[f"data/chunk-000/episode_{e:06d}.parquet"] = data_parquet(cols, r, features)
        episodes.append({"episode_index": e, "tasks": [TASKS[EPISODE_TASK[e]]], "length": len(r)})
        stats.append({"episode_index": e, "stats": _stats(cols, r)})
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode()  # noqa: E731
    files["meta/episodes.jsonl"] = jsonl(episodes)
    files["meta/episodes_stats.jsonl"] = jsonl(stats)
    files["meta/tasks.jsonl"] = jsonl({"task_index": i, "task": t} for i, t in enumerate(TASKS))
    files["meta/info.json"] = json.dumps(
        _info(
            "v2.1",
            "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            False,
            total_chunks=1,
            total_videos=0,
        ),
        indent=4,
    ).encode()
    return files


def serve(server, repo: str, files: dict, lfs=("data/",)) -> str:
    """Put a repo's files on the server (paths under ``lfs`` as LFS files, as the Hub stores
    parquet); returns the resolve prefix."""
    prefix = f"/datasets/{repo}/resolve/main/"
    for path, data in files.items():
        server.files[prefix + path] = data
        if path.startswith(tuple(lfs)):
            server.lfs.add(prefix + path)
    return prefix
