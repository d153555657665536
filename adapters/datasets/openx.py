"""Open X-Embodiment datasets, from the Hugging Face mirror TorchRL reads
(``jxu124/OpenX-Embodiment``: webdataset tar shards of pickled episodes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets import _hub
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._formats import (
    DatasetFormatError,
    decode_image,
    looks_like_image,
    open_tar,
    safe_unpickle,
)
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.slice import SliceSampler
from functional_rb.adapters.samplers.slice_without_replacement import SliceSamplerWithoutReplacement
from functional_rb.adapters.writers.base import Writer

REPO = "jxu124/OpenX-Embodiment"
TEXT_FILE = "frb_text.json"
_KEY_MAP = {
    ("is_first",): ("is_init",),
    ("is_last",): ("next", "done"),
    ("is_terminal",): ("next", "terminated"),
    ("reward",): ("next", "reward"),
}


class OpenXExperienceReplay(BaseDatasetExperienceReplay):
    """Open X-Embodiment (https://robotics-transformer-x.github.io/; TorchRL's
    ``OpenXExperienceReplay`` with ``download=True``).

    Source: the Hugging Face dataset repo ``jxu124/OpenX-Embodiment`` that TorchRL loads with
    ``datasets.load_dataset``: the tar shards ``<dataset_id>/*.tar`` listed with
    ``{base_url}/api/datasets/jxu124/OpenX-Embodiment/tree/main/<dataset_id>?recursive=true``
    and fetched from ``{base_url}/datasets/jxu124/OpenX-Embodiment/resolve/main/<path>``
    (``base_url``: the argument, ``$HF_ENDPOINT`` or ``https://huggingface.co``).

    Format read: each shard is a tar (webdataset) whose ``*.data.pickle`` members are pickled
    RLDS episodes ``{"steps": [step, ...], ...}`` (read with a restricted unpickler that only
    rebuilds NumPy arrays/scalars and builtin containers); a step is a nested dict with
    ``observation`` (arrays and JPEG/PNG-encoded camera images, raw ``bytes`` or
    ``{"bytes": ...}``), ``action`` (array or dict), ``reward``, ``discount``, ``is_first``,
    ``is_last``, ``is_terminal``, ``language_instruction`` (text), ``language_embedding``...

    Data (TED, TorchRL's ``_format_data``; shards in path order, episodes in shard order):
    every numeric step entry at its nested key (file dtypes; Python scalars as NumPy would make
    them), images decoded to uint8 ``[N, C, H, W]``; ``("next", "observation", ...)`` = the next
    step's observation (zeros on an episode's last step); ``is_init`` (= ``is_first``),
    ``("next", "reward")`` ``[N, 1]``, ``("next", "done")`` = ``is_last``, ``("next",
    "terminated")`` = ``is_terminal``, ``("next", "truncated")`` = done and not terminated,
    root ``done``/``terminated``/``truncated`` False (bool ``[N, 1]``), ``episode`` int32.
    Text entries are not tensors: samples (and ``dataset[i]``) carry them as
    ``NonTensorStack`` entries at their key, as TorchRL's ``NonTensorData``.

    The arguments are TorchRL's, plus ``base_url``. Deviations: ``streaming=True`` is not implemented (``NotImplementedError``), and when
    neither ``download`` nor ``streaming`` is given the data is downloaded (TorchRL streams).
    Iterating without a batch size yields whole episodes (cropped to a random window of
    ``slice_len`` steps when given), in random order when ``shuffle``.

    Args:
      shuffle: with ``replacement=False``, draw each epoch in a random order; when iterating
        without a batch size, the episodes' order.
      num_slices: builds a ``SliceSampler(end_key=("next", "done"), strict_length=...)``
        drawing this many slices per batch.
      slice_len: builds the same sampler with slices of this many steps (exclusive with
        ``num_slices``).
      pad: the value short trajectories are padded with (``True``: 0; None or False: no
        padding).
      replacement: False: the slice sampler is a
        ``SliceSamplerWithoutReplacement(shuffle=shuffle)``.
      streaming: ``True`` is not implemented (``NotImplementedError``).
      download: as above; when neither ``download`` nor ``streaming`` is given the data is
        downloaded (TorchRL streams).
      strict_length: passed to the slice sampler."""

    available_datasets = [
        "fractal20220817_data",
        "kuka",
        "bridge",
        "taco_play",
        "jaco_play",
        "berkeley_cable_routing",
        "roboturk",
        "nyu_door_opening_surprising_effectiveness",
        "viola",
        "berkeley_autolab_ur5",
        "toto",
        "language_table",
        "columbia_cairlab_pusht_real",
        "stanford_kuka_multimodal_dataset_converted_externally_to_rlds",
        "nyu_rot_dataset_converted_externally_to_rlds",
        "stanford_hydra_dataset_converted_externally_to_rlds",
        "austin_buds_dataset_converted_externally_to_rlds",
        "nyu_franka_play_dataset_converted_externally_to_rlds",
        "maniskill_dataset_converted_externally_to_rlds",
        "furniture_bench_dataset_converted_externally_to_rlds",
        "cmu_franka_exploration_dataset_converted_externally_to_rlds",
        "ucsd_kitchen_dataset_converted_externally_to_rlds",
        "ucsd_pick_and_place_dataset_converted_externally_to_rlds",
        "austin_sailor_dataset_converted_externally_to_rlds",
        "austin_sirius_dataset_converted_externally_to_rlds",
        "bc_z",
        "usc_cloth_sim_converted_externally_to_rlds",
        "utokyo_pr2_opening_fridge_converted_externally_to_rlds",
        "utokyo_pr2_tabletop_manipulation_converted_externally_to_rlds",
        "utokyo_saytap_converted_externally_to_rlds",
        "utokyo_xarm_pick_and_place_converted_externally_to_rlds",
        "utokyo_xarm_bimanual_converted_externally_to_rlds",
        "robo_net",
        "berkeley_mvp_converted_externally_to_rlds",
        "berkeley_rpt_converted_externally_to_rlds",
        "kaist_nonprehensile_converted_externally_to_rlds",
        "stanford_mask_vit_converted_externally_to_rlds",
        "tokyo_u_lsmo_converted_externally_to_rlds",
        "dlr_sara_pour_converted_externally_to_rlds",
        "dlr_sara_grid_clamp_converted_externally_to_rlds",
        "dlr_edan_shared_control_converted_externally_to_rlds",
        "asu_table_top_converted_externally_to_rlds",
        "stanford_robocook_converted_externally_to_rlds",
        "eth_agent_affordances",
        "imperialcollege_sawyer_wrist_cam",
        "iamlab_cmu_pickup_insert_converted_externally_to_rlds",
        "uiuc_d3field",
        "utaustin_mutex",
        "berkeley_fanuc_manipulation",
        "cmu_playing_with_food",
        "cmu_play_fusion",
        "cmu_stretch",
        "berkeley_gnm_recon",
        "berkeley_gnm_cory_hall",
        "berkeley_gnm_sac_son",
    ]

    def __init__(
        self,
        dataset_id: str,
        batch_size: int | None = None,
        *,
        shuffle: bool = True,
        num_slices: int | None = None,
        slice_len: int | None = None,
        pad: float | bool | None = None,
        replacement: bool | None = None,
        streaming: bool | None = None,
        root: str | Path | None = None,
        download: bool | str | None = None,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        split_trajs: bool = False,
        strict_length: bool = True,
        base_url: str | None = None,
    ):
        name = type(self).__name__
        if streaming:
            raise NotImplementedError(
                f"{name}: streaming=True is not implemented; use "
                "download=True (the episodes are converted to memory "
                "maps once)."
            )
        if download is None:
            download = True
        if num_slices is not None and slice_len is not None:
            raise ValueError("num_slices or slice_len can be not None, but not both.")
        if split_trajs:
            raise NotImplementedError(f"{name}: split_trajs is not implemented (nor in TorchRL).")
        if pad is not None:
            raise RuntimeError("the `pad` argument is to be used only with streaming datasets.")
        if dataset_id not in self.available_datasets:
            raise ValueError(
                f"{name}: {dataset_id!r} is not in OpenXExperienceReplay.available_datasets."
            )
        self.dataset_id = dataset_id
        self.shuffle, self.num_slices, self.slice_len = shuffle, num_slices, slice_len
        self.pad, self.strict_length, self.split_trajs = pad, strict_length, split_trajs
        self.streaming, self.download = False, download
        self.root = default_root("openx") if root is None else root
        self.endpoint = dl.hf_endpoint(base_url)
        replacement = True if replacement is None else replacement
        if num_slices is not None or slice_len is not None:
            if sampler is not None:
                raise ValueError(
                    "`num_slices` and `slice_len` are exclusive with the `sampler` argument."
                )
            if replacement:
                if not shuffle:
                    raise RuntimeError("shuffle=False can only be used when replacement=False.")
                sampler = SliceSampler(
                    num_slices=num_slices,
                    slice_len=slice_len,
                    end_key=("next", "done"),
                    strict_length=strict_length,
                )
            else:
                sampler = SliceSamplerWithoutReplacement(
                    num_slices=num_slices,
                    slice_len=slice_len,
                    end_key=("next", "done"),
                    strict_length=strict_length,
                    shuffle=shuffle,
                )
        path = self._prepare(download, self._build)
        text_file = path / TEXT_FILE
        self._text = {}
        if text_file.exists():
            with open(text_file) as f:
                for key, entry in json.load(f).items():
                    self._text[tuple(key.split("/"))] = (entry["per"], entry["values"])
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

    def __iter__(self):
        if self._batch_size is not None:
            yield from super().__iter__()
            return
        ep = np.asarray(self._storage.leaf(("episode",))).reshape(-1)
        starts = np.concatenate([[0], np.flatnonzero(ep[1:] != ep[:-1]) + 1, [len(ep)]])
        order = np.arange(len(starts) - 1)
        if self.shuffle:
            order = order[torch.randperm(len(order), generator=self._rng).numpy()]
        for i in order:
            s, e = int(starts[i]), int(starts[i + 1])
            if self.slice_len is not None and e - s > self.slice_len:
                s += int(torch.randint(0, e - s - self.slice_len + 1, (1,), generator=self._rng))
                e = s + self.slice_len
            yield self[s:e]

    def _build(self, out: Path):
        name = type(self).__name__
        listing = _hub.hf_list(self.endpoint, REPO, self.dataset_id, where=name)
        shards = sorted(p for p in listing if p.endswith(".tar"))
        if not shards:
            raise DatasetFormatError(
                f"{name}: no .tar shard under {self.dataset_id}/ in "
                f"{self.endpoint}/datasets/{REPO}."
            )
        with staging_dir(self.root, self.dataset_id) as tmp:
            plan, texts, num = [], [], 0
            for s, shard in enumerate(shards):
                url = dl.hf_file_url(self.endpoint, REPO, shard)
                local = _hub.hf_download(
                    self.endpoint,
                    REPO,
                    shard,
                    tmp / f"{s:05d}.tar",
                    where=name,
                    remote=listing[shard],
                )
                with open_tar(local, f"{name}({url}): not a tar file") as tar:
                    for member in tar:
                        if not (member.isfile() and member.name.endswith(".data.pickle")):
                            continue
                        where = f"{name}({url}:{member.name})"
                        episode = safe_unpickle(tar.extractfile(member).read(), where)
                        arrays, text = _episode(episode, num, where)
                        part = tmp / f"ep{num:08d}.npz"
                        np.savez(part, **{"/".join(k): v for k, v in arrays.items()})
                        plan.append((len(arrays[("episode",)]), lambda p=part: _load_part(p)))
                        texts.append(text)
                        num += 1
                local.unlink()
            if not plan:
                raise DatasetFormatError(f"{name}: the shards hold no '*.data.pickle' episode.")
            write_episodes(
                out,
                plan,
                where=name,
                dataset_id=self.dataset_id,
                source=f"{self.endpoint}/datasets/{REPO}/{self.dataset_id}",
                shards=shards,
            )
            _write_text(out, texts, [n for n, _ in plan])


def _load_part(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        out = {tuple(k.split("/")): z[k] for k in z.files}
    path.unlink()
    return out


def _leaves(tree, prefix=()):
    """Flatten a step: ``{key tuple: value}`` (``{"bytes": b}`` image dicts are leaves)."""
    if isinstance(tree, dict) and not (set(tree) <= {"bytes", "path"} and "bytes" in tree):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def _episode(episode, num: int, where: str):
    """One pickled RLDS episode -> (TED arrays ``{key: [T, ...]}``, ``{key: [T] str}``)."""
    steps = episode.get("steps") if isinstance(episode, dict) else None
    if not isinstance(steps, (list, tuple)) or not steps:
        raise DatasetFormatError(f"{where}: expected a dict with a non-empty 'steps' list.")
    flat = [_leaves(s) for s in steps]
    keys = list(flat[0])
    t = len(steps)
    arrays, text = {}, {}
    for key in keys:
        col = [f.get(key) for f in flat]
        if any(v is None for v in col):
            raise DatasetFormatError(
                f"{where}: step entry {'/'.join(key)!r} is missing in some steps."
            )
        first = col[0]
        if isinstance(first, dict):
            first, col = first["bytes"], [v["bytes"] for v in col]
        if isinstance(first, (bytes, bytearray)) and looks_like_image(first):
            arrays[key] = np.stack([decode_image(v, f"{where}:{'/'.join(key)}") for v in col])
        elif isinstance(first, (bytes, bytearray, str, np.bytes_, np.str_)):
            text[key] = [
                v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
                for v in col
            ]
        else:
            try:
                arrays[key] = np.stack([np.asarray(v) for v in col])
            except ValueError as e:
                raise DatasetFormatError(
                    f"{where}: step entry {'/'.join(key)!r} changes shape within the episode ({e})."
                ) from None
            if arrays[key].dtype == object:
                raise DatasetFormatError(f"{where}: step entry {'/'.join(key)!r} is not numeric.")
    for req in (("is_last",), ("is_terminal",)):
        if req not in arrays:
            raise DatasetFormatError(f"{where}: the steps have no {req[0]!r} entry.")
    out = {}
    for key, v in arrays.items():
        out[_KEY_MAP.get(key, key)] = v
        if key[0] == "observation":
            nxt = np.zeros_like(v)
            nxt[:-1] = v[1:]
            out[("next",) + key] = nxt
    done = out[("next", "done")].astype(bool).reshape(t, 1)
    term = out[("next", "terminated")].astype(bool).reshape(t, 1)
    out[("next", "done")], out[("next", "terminated")] = done, term
    out[("next", "truncated")] = done & ~term
    if ("next", "reward") in out:
        out[("next", "reward")] = out[("next", "reward")].reshape(t, 1)
    for k in ("done", "terminated", "truncated"):
        out[(k,)] = np.zeros((t, 1), bool)
    out[("episode",)] = np.full((t,), num, np.int32)
    return out, text


def _write_text(out: Path, texts: list, lengths: list):
    keys = sorted({k for t in texts for k in t})
    if not keys:
        return
    table = {}
    for key in keys:
        if any(key not in t for t in texts):
            raise DatasetFormatError(
                f"OpenXExperienceReplay: text entry {'/'.join(key)!r} is missing in some episodes."
            )
        cols = [t[key] for t in texts]
        if all(len(set(c)) <= 1 for c in cols):
            table["/".join(key)] = {"per": "episode", "values": [c[0] for c in cols]}
        else:
            table["/".join(key)] = {"per": "step", "values": [s for c in cols for s in c]}
    with open(out / TEXT_FILE, "w") as f:
        json.dump(table, f)
