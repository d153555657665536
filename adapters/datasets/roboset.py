"""RoboSet (RoboHive) datasets, from the Hugging Face repo ``jdvakil/RoboSet_Sim``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets import _hub
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._formats import DatasetFormatError, flatten, h5_tree
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.writers.base import Writer

REPO = "jdvakil/RoboSet_Sim"
_NAME = {
    "observations": "observation",
    "rewards": "reward",
    "actions": "action",
    "env_infos": "info",
}
_TRIAL = re.compile(r"^Trial(\d+)$")


class RobosetExperienceReplay(BaseDatasetExperienceReplay):
    """RoboSet (https://sites.google.com/view/robohive/roboset; TorchRL's
    ``RobosetExperienceReplay``).

    Source: the Hugging Face dataset repo ``jdvakil/RoboSet_Sim`` (read by TorchRL with
    ``huggingface_hub``): every ``.h5`` file whose path starts with ``dataset_id`` (e.g.
    ``"FK1-v4(expert)/FK1_MicroOpenRandom_v2d-v4"``), listed with
    ``{base_url}/api/datasets/jdvakil/RoboSet_Sim/tree/main/<dir>?recursive=true`` and fetched
    from ``{base_url}/datasets/jdvakil/RoboSet_Sim/resolve/main/<path>`` (``base_url``: the
    argument, ``$HF_ENDPOINT`` or ``https://huggingface.co``). File ``s`` (in path order) is
    "seed" ``s``.

    Format read: HDF5 groups ``Trial<k>`` with ``T``-row datasets ``observations``,
    ``actions``, ``rewards``, ``done``, ``env_infos`` (a group, possibly nested) and others
    (e.g. ``time``).

    Data (TED, TorchRL's keys; episodes sorted by trial number then seed, as TorchRL does):
    ``episode`` and ``seed`` (int64), ``observation`` / ``info`` and ``("next",
    "observation")`` / ``("next", "info")`` (the next row, zeros on an episode's last row),
    ``action`` and other arrays at the root (file dtypes), ``("next", "reward")`` ``[N, 1]``,
    ``done`` (the file's flag, as in TorchRL), ``("next", "terminated")`` = the file's
    ``done``, ``("next", "truncated")``, ``("next", "done")``, ``terminated``/``truncated``
    (False), bool ``[N, 1]``. Deviation from TorchRL: an episode's last step is marked
    ``("next", "truncated")`` (and so ``("next", "done")``) when the file's ``done`` is not
    set there, so that slice samplers never join two episodes (consecutive rows of the same
    trial number come from different files).

    The arguments are TorchRL's, plus ``base_url``.

    Args:
      dataset_id: the dataset's name, one of :attr:`available_datasets`.
      **env_kwargs: accepted for TorchRL's signature; any entry raises ``TypeError``.
    """

    available_datasets = [
        "DAPG(expert)/door_v2d-v1",
        "DAPG(expert)/relocate_v2d-v1",
        "DAPG(expert)/hammer_v2d-v1",
        "DAPG(expert)/pen_v2d-v1",
        "DAPG(human)/door_v2d-v1",
        "DAPG(human)/relocate_v2d-v1",
        "DAPG(human)/hammer_v2d-v1",
        "DAPG(human)/pen_v2d-v1",
        "FK1-v4(expert)/FK1_MicroOpenRandom_v2d-v4",
        "FK1-v4(expert)/FK1_Knob2OffRandom_v2d-v4",
        "FK1-v4(expert)/FK1_LdoorOpenRandom_v2d-v4",
        "FK1-v4(expert)/FK1_SdoorOpenRandom_v2d-v4",
        "FK1-v4(expert)/FK1_Knob1OnRandom_v2d-v4",
        "FK1-v4(human)/human_demos_by_playdata",
        "FK1-v4(human)/human_demos_by_task/human_demo_singleTask_Fixed-v4",
        "FK1-v4(human)/human_demos_by_task/FK1_SdoorOpenRandom_v2d-v4",
        "FK1-v4(human)/human_demos_by_task/FK1_LdoorOpenRandom_v2d-v4",
        "FK1-v4(human)/human_demos_by_task/FK1_Knob2OffRandom_v2d-v4",
        "FK1-v4(human)/human_demos_by_task/FK1_Knob1OnRandom_v2d-v4",
        "FK1-v4(human)/human_demos_by_task/FK1_MicroOpenRandom_v2d-v4",
    ]

    def __init__(
        self,
        dataset_id: str,
        batch_size: int | None = None,
        *,
        root: str | Path | None = None,
        download: bool | str = True,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        split_trajs: bool = False,
        base_url: str | None = None,
        **env_kwargs,
    ):
        if env_kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(env_kwargs)}.")
        if dataset_id not in self.available_datasets:
            raise ValueError(
                f"{type(self).__name__}: the dataset_id {dataset_id!r} isn't part "
                "of the accepted datasets (RobosetExperienceReplay."
                "available_datasets)."
            )
        self.dataset_id = dataset_id
        self.root = default_root("roboset") if root is None else root
        self.split_trajs = split_trajs
        self.download = download
        self.endpoint = dl.hf_endpoint(base_url)
        path = self._prepare(download, self._build, split_trajs=split_trajs)
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

    def _build(self, out: Path):
        import h5py

        name = type(self).__name__
        parent = self.dataset_id.rsplit("/", 1)[0]
        listing = _hub.hf_list(self.endpoint, REPO, parent, where=name)
        files = sorted(p for p in listing if p.startswith(self.dataset_id) and p.endswith(".h5"))
        if not files:
            raise DatasetFormatError(
                f"{name}: no .h5 file starting with {self.dataset_id!r} in "
                f"{self.endpoint}/datasets/{REPO}."
            )
        with staging_dir(self.root, self.dataset_id) as tmp:
            handles, episodes = [], []
            try:
                for seed, f in enumerate(files):
                    url = dl.hf_file_url(self.endpoint, REPO, f)
                    local = _hub.hf_download(
                        self.endpoint,
                        REPO,
                        f,
                        tmp / f"{seed:04d}.h5",
                        where=name,
                        remote=listing[f],
                    )
                    try:
                        h5 = h5py.File(local, "r")
                    except OSError as e:
                        raise DatasetFormatError(
                            f"{name}({url}): not an HDF5 file ({e})."
                        ) from None
                    handles.append(h5)
                    for key in h5.keys():
                        m = _TRIAL.match(key)
                        if m is None:
                            continue
                        steps = _trial_len(h5[key], f"{name}({url})")
                        episodes.append((int(m.group(1)), seed, h5[key], steps, f"{name}({url})"))
                if not episodes:
                    raise DatasetFormatError(f"{name}: no 'Trial<k>' group in {files}.")
                # TorchRL's order: by trial number (stable: seeds in file order)
                episodes.sort(key=lambda e: e[0])
                plan = [(e[3], lambda e=e: _trial(*e)) for e in episodes]
                write_episodes(
                    out,
                    plan,
                    where=name,
                    dataset_id=self.dataset_id,
                    source=f"{self.endpoint}/datasets/{REPO}",
                    files=files,
                )
            finally:
                for h in handles:
                    h.close()


def _trial_len(group, where) -> int:
    if "actions" not in group:
        raise DatasetFormatError(f"{where}: {group.name} has no 'actions' dataset.")
    return int(group["actions"].shape[0])


def _trial(num: int, seed: int, group, steps: int, where: str) -> dict:
    out = {
        ("episode",): np.full((steps,), num, np.int64),
        ("seed",): np.full((steps,), seed, np.int64),
    }
    done = np.zeros((steps, 1), bool)
    for key, node in h5_tree(group).items():
        name = _NAME.get(key, key)
        leaves = flatten(node) if isinstance(node, dict) else {(): node}
        for sub, v in leaves.items():
            v = np.asarray(v)
            if v.shape[:1] != (steps,):
                raise DatasetFormatError(
                    f"{where}: {group.name}/{key}/{'/'.join(sub)} has "
                    f"shape {v.shape}, expected {steps} rows."
                )
            if key in ("observations", "env_infos"):
                nxt = np.zeros_like(v)
                nxt[:-1] = v[1:]
                out[(name,) + sub] = v
                out[("next", name) + sub] = nxt
            elif key == "rewards":
                out[("next", "reward")] = v.reshape(steps, -1) if v.ndim > 1 else v[:, None]
            elif key == "done":
                done = v.astype(bool).reshape(steps, 1)
            elif key in ("terminated", "truncated"):
                continue  # derived below, as TorchRL fills them
            else:
                out[(name,) + sub] = v
    truncated = np.zeros((steps, 1), bool)
    truncated[-1] = ~done[-1]
    out[("done",)] = done
    out[("terminated",)] = np.zeros((steps, 1), bool)
    out[("truncated",)] = np.zeros((steps, 1), bool)
    out[("next", "terminated")] = done
    out[("next", "truncated")] = truncated
    out[("next", "done")] = done | truncated
    return out
