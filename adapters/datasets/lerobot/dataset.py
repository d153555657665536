"""LeRobotExperienceReplay: a LeRobot dataset downloaded from the Hugging Face Hub, converted
once to a memory-mapped TensorDict and opened as a read-only buffer."""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets._cache import (
    default_root,
    read_marker,
    staging_dir,
    write_episodes,
)
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets.lerobot._snapshot import Snapshot
from functional_rb.adapters.datasets.lerobot.columns import (
    columns_to_leaves,
    map_lerobot_key,
    nested_key,
)
from functional_rb.adapters.datasets.lerobot.rehydrate import rehydrate_transforms
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.slice import SliceSampler
from functional_rb.adapters.writers.base import Writer

TEXT_FILE = "frb_text.json"


class LeRobotExperienceReplay(BaseDatasetExperienceReplay):
    """A LeRobot dataset (https://huggingface.co/lerobot; TorchRL's ``LeRobotExperienceReplay``
    with ``download=True``).

    Source: the Hugging Face dataset repo ``repo_id``: ``meta/info.json`` (``codebase_version``
    v2.x or v3.x, ``fps``, ``features`` with ``dtype``/``shape``/``names``, ``data_path``,
    ``total_frames``...), ``meta/episodes/**/*.parquet`` (v3) or ``meta/episodes.jsonl``
    (v2.x), ``meta/tasks.parquet`` (v3) or ``meta/tasks.jsonl`` (v2.x), ``meta/stats.json`` and
    every ``data/**/*.parquet`` (v3 ``data/chunk-XXX/file-XXX.parquet``, v2.x
    ``data/chunk-XXX/episode_XXXXXX.parquet``), listed with
    ``{base_url}/api/datasets/<repo_id>/tree/main/<dir>?recursive=true`` and fetched from
    ``{base_url}/datasets/<repo_id>/resolve/main/<path>`` (``base_url``: the argument,
    ``$HF_ENDPOINT`` or ``https://huggingface.co``; ``FRB_DATASETS_DOWNLOADER=hub`` goes through
    ``huggingface_hub``). Every data file the episode metadata names must be in the repo, and
    the frames must add up to ``total_frames``: a missing or unreadable file raises
    :class:`DatasetFormatError` naming it.

    Data (TorchRL's layout, flat ``[N]``, files in path order, frames sorted by ``index``):
    every parquet column at :func:`map_lerobot_key`'s key (see
    :func:`lerobot_columns_to_tensordict`), with the dtypes TorchRL's loader gives through
    ``datasets``' torch formatting: integers int64, floats float32, bools bool; ``image``
    features (PNG/JPEG bytes in the parquet) decoded to uint8 ``[C, H, W]``; ``("next", ...)``
    columns ``[N, 1]``; ``language_instruction`` (the ``task`` of each frame's
    ``task_index``) as a ``NonTensorStack`` in samples. No ``("next", "observation")`` is stored
    (TorchRL's neither): ``rehydrate=True`` fills it per sampled slice. ``metadata`` holds
    ``{"info": info.json, "stats": stats.json}``.

    The arguments are TorchRL's, plus ``base_url``. Deviations: ``video`` features (MP4 files, which TorchRL decodes
    with ``torchcodec``) are not decoded: with ``decode_video=True`` (the default) a dataset
    that has any raises ``NotImplementedError`` naming them; with ``decode_video=False`` they
    are left out (listed in :attr:`video_keys`; the MP4s are not downloaded), where TorchRL
    keeps undecoded ``VideoClipRef`` references. A ``sampler`` given with ``num_slices``/
    ``slice_len`` raises (TorchRL ignores the two).

    Args:
      repo_id: the dataset's Hugging Face Hub repository, e.g. ``"lerobot/pusht"``.
      num_slices: builds a ``SliceSampler(traj_key=<episode key>, strict_length=...)``
        drawing this many slices per batch (a ``sampler`` given with it raises).
      slice_len: builds the same sampler with slices of this many steps (exclusive with
        ``num_slices``).
      key_map: maps source columns to TensorDict keys (recorded with the converted data: a
        cache converted with another map raises; pass ``download="force"``).
      decode_video: True (the default): a dataset with ``video`` features raises
        ``NotImplementedError`` naming them (MP4 decoding is not provided); False: they are
        left out (listed in :attr:`video_keys`).
      rehydrate: rebuild the ``("next", ...)`` observations of each sampled slice from its
        following row.
      strict_length: passed to the slice sampler."""

    def __init__(
        self,
        repo_id: str,
        *,
        root: str | Path | None = None,
        download: bool | str = True,
        batch_size: int | None = None,
        num_slices: int | None = None,
        slice_len: int | None = None,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        transform: Callable | None = None,
        key_map: dict | None = None,
        decode_video: bool = True,
        rehydrate: bool = False,
        strict_length: bool = True,
        pin_memory: bool = False,
        prefetch: int | None = None,
        base_url: str | None = None,
        _columns: dict | None = None,
    ):
        if num_slices is not None and slice_len is not None:
            raise ValueError("num_slices or slice_len can be passed, but not both.")
        if sampler is not None and (num_slices is not None or slice_len is not None):
            raise ValueError(
                "`num_slices` and `slice_len` are exclusive with the `sampler` argument."
            )
        if not isinstance(repo_id, str) or not repo_id:
            raise ValueError(
                f"{type(self).__name__}: repo_id must be a non-empty str such as "
                f"'lerobot/pusht', got {repo_id!r}."
            )
        self.repo_id = self.dataset_id = repo_id
        self.key_map, self.decode_video, self.rehydrate = key_map, decode_video, rehydrate
        self.num_slices, self.slice_len, self.strict_length = num_slices, slice_len, strict_length
        if root is None and _columns is not None:  # from_columns: nothing outlives the buffer
            root = tempfile.mkdtemp(prefix="frb-lerobot-")
            weakref.finalize(self, shutil.rmtree, root, True)
        self.root = default_root("lerobot") if root is None else root
        self.endpoint = dl.hf_endpoint(base_url)
        self._columns = _columns
        options = {"key_map": _jsonable(key_map)}
        path = self._prepare(
            "force" if _columns is not None else download, self._build, options=options
        )
        self._columns = None  # written: the memory maps hold them now
        marker_videos = self._read_conversion(path)
        if marker_videos and decode_video:
            raise _video_error(type(self).__name__, repo_id, marker_videos)
        episode_key = map_lerobot_key("episode_index", key_map)
        if num_slices is not None or slice_len is not None:
            sampler = SliceSampler(
                num_slices=num_slices,
                slice_len=slice_len,
                traj_key=episode_key if len(episode_key) > 1 else episode_key[0],
                strict_length=strict_length,
            )
        self._open(
            path,
            batch_size=batch_size,
            sampler=sampler,
            writer=writer,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            prefetch=prefetch,
        )
        if rehydrate:
            for t in rehydrate_transforms(self[:1], episode_key, key_map):
                self.append_transform(t)
        if transform is not None:
            self.append_transform(transform)

    @classmethod
    def from_columns(
        cls,
        columns: dict[str, Any],
        *,
        repo_id: str = "local",
        key_map: dict | None = None,
        **kwargs,
    ) -> LeRobotExperienceReplay:
        """Build from an in-memory LeRobot-style columnar dict (TorchRL's method; see
        :func:`lerobot_columns_to_tensordict`); ``kwargs``: the constructor's. The columns are
        written as memory maps into a temporary directory removed with the buffer (or, given
        ``root``, into ``<root>/<repo_id>``, replaced on each call)."""
        if kwargs.pop("download", False) not in (False, None):
            raise ValueError("from_columns: download must be False (nothing is downloaded).")
        return cls(repo_id, key_map=key_map, download=False, _columns=dict(columns), **kwargs)

    @property
    def data_path_root(self) -> Path:
        """``<root>/<repo_id with '/' replaced by '_'>`` (TorchRL's layout)."""
        return Path(self._root) / self.repo_id.replace("/", "_")

    @property
    def video_keys(self) -> list[str]:
        """The dataset's ``video`` features (left out of the data: ``decode_video=False``)."""
        return list(self._video_keys)

    def _read_conversion(self, path: Path) -> list:
        marker = read_marker(path)
        self._video_keys = list(marker.get("video_features", []))
        self._text = {}
        if (path / TEXT_FILE).exists():
            with open(path / TEXT_FILE) as f:
                for key, entry in json.load(f).items():
                    self._text[tuple(key.split("/"))] = (entry["per"], entry["values"])
        return self._video_keys

    # ------------------------------------------------------------------ conversion
    def _build(self, out: Path):
        name = f"{type(self).__name__}({self.repo_id!r})"
        if self._columns is not None:
            arrays, text, n = columns_to_leaves(self._columns, self.key_map, name)
            write_episodes(
                out,
                [(n, lambda: arrays)],
                where=name,
                dataset_id=self.repo_id,
                source="from_columns",
                options={"key_map": _jsonable(self.key_map)},
                video_features=[],
            )
            _write_text(out, text)
            return
        with staging_dir(self.root, self.repo_id) as tmp:
            snap = Snapshot(self.endpoint, self.repo_id, tmp, name)
            videos = snap.video_features()
            if videos and self.decode_video:
                raise _video_error(type(self).__name__, self.repo_id, videos)
            files, plan, texts = snap.frames(self.key_map)
            write_episodes(
                out,
                plan,
                where=name,
                dataset_id=self.repo_id,
                source=f"{self.endpoint}/datasets/{self.repo_id}",
                files=files,
                metadata={"info": snap.info, "stats": snap.stats},
                options={"key_map": _jsonable(self.key_map)},
                video_features=videos,
            )
            _write_text(out, {k: [s for t in texts for s in t[k]] for k in texts[0]})


def _jsonable(key_map):
    return None if key_map is None else {k: list(nested_key(v)) for k, v in sorted(key_map.items())}


def _video_error(cls: str, repo_id: str, videos: list) -> NotImplementedError:
    return NotImplementedError(
        f"{cls}({repo_id!r}): the features {videos} are stored as MP4 videos (dtype 'video' in "
        "meta/info.json), and decoding them needs a video decoder (TorchRL uses torchcodec "
        "with FFmpeg) that this loader does not provide. Pass decode_video=False to load every "
        "other feature (the video features are then left out and listed in rb.video_keys)."
    )


def _write_text(out: Path, text: dict):
    if text:
        with open(Path(out) / TEXT_FILE, "w") as f:
            json.dump({"/".join(k): {"per": "step", "values": v} for k, v in text.items()}, f)
