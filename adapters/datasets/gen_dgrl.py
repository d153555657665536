"""Gen-DGRL (Procgen offline datasets), from Meta's public file server."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._formats import DatasetFormatError, open_tar, read_npy

GEN_DGRL_BASE_URL = "https://dl.fbaipublicfiles.com/DGRL/Procgen/Datasets/Compressed"
_GAMES = (
    "bigfish",
    "bossfight",
    "caveflyer",
    "chaser",
    "climber",
    "coinrun",
    "dodgeball",
    "fruitbot",
    "heist",
    "jumper",
    "leaper",
    "maze",
    "miner",
    "ninja",
    "plunder",
    "starpilot",
)
_CATEGORIES = {
    "1M_E": ("1M/level_200/expert", 1_000_000),
    "1M_S": ("1M/level_200/suboptimal", 1_000_000),
    "10M": ("10M/level_200/expert", 10_000_000),
    "25M": ("25M/level_200/expert", 25_000_000),
    "level_1_E": ("100k/level_1/expert", 100_000),
    "level_1_S": ("100k/level_1/suboptimal", 100_000),
    "level_40_E": ("100k/level_40/expert", 100_000),
    "level_40_S": ("100k/level_40/suboptimal", 100_000),
}


class GenDGRLExperienceReplay(BaseDatasetExperienceReplay):
    """Gen-DGRL ("The Generalization Gap in Offline Reinforcement Learning",
    https://github.com/facebookresearch/gen_dgrl; TorchRL's ``GenDGRLExperienceReplay``).

    Source: ``{base_url}/<category path>/<game>.tar.xz`` with ``base_url`` =
    ``$FRB_GEN_DGRL_BASE_URL`` or ``https://dl.fbaipublicfiles.com/DGRL/Procgen/Datasets/
    Compressed`` (TorchRL's URL); ``dataset_id`` is ``"<game>-<category>"``, e.g.
    ``"bigfish-1M_E"`` -> ``1M/level_200/expert/bigfish.tar.xz`` (see
    :attr:`available_datasets`).

    Format read: an xz-compressed tar of ``.npy`` files, one trajectory each: a pickled dict
    (read with a restricted unpickler that only rebuilds NumPy arrays) with ``observations``
    (``[T + 1, 64, 64, 3]``), ``actions`` ``[T]``, ``rewards`` ``[T]``, ``dones`` ``[T]``.

    Data (TED, TorchRL's keys; trajectories in archive order): ``observation`` uint8
    (``observations[:-1]``), ``("next", "observation")`` uint8 (``observations[1:]``),
    ``action`` (file dtype), ``("next", "reward")`` ``[N]`` (file dtype, not unsqueezed, as in
    TorchRL), ``("next", "terminated")`` = ``dones``, ``("next", "truncated")``, ``("next",
    "done")`` and root ``done``/``terminated``/``truncated`` (False), bool ``[N, 1]``; other
    ``[T]`` arrays of the dict at the root. Deviations from TorchRL: a trajectory's last step is
    marked truncated when ``dones`` is not set there (so slices never join trajectories), and
    the data is the category's size at most (1M/10M/25M/100k steps) but never zero-padded up to
    it.

    The arguments are TorchRL's, plus ``base_url``.

    Args:
      dataset_id: ``"<game>-<category>"``.
      **kwargs: the buffer's arguments (``sampler``, ``writer``, ``transform``,
        ``collate_fn``, ...).
    """

    available_datasets = [f"{g}-{c}" for c in _CATEGORIES for g in _GAMES]

    def __init__(
        self,
        dataset_id: str,
        batch_size: int | None = None,
        *,
        download: bool | str = True,
        root: str | None = None,
        base_url: str | None = None,
        **kwargs,
    ):
        game, _, category = dataset_id.partition("-")
        if game not in _GAMES or category not in _CATEGORIES:
            raise ValueError(
                f"{type(self).__name__}: {dataset_id!r} is not '<game>-<category>'"
                f" with game in {_GAMES} and category in {tuple(_CATEGORIES)}."
            )
        self.dataset_id = dataset_id
        self._dataset_name, self._category_name = game, category
        self.root = default_root("gen_dgrl") if root is None else root
        base = (base_url or os.environ.get("FRB_GEN_DGRL_BASE_URL") or GEN_DGRL_BASE_URL).rstrip(
            "/"
        )
        self.url = f"{base}/{_CATEGORIES[category][0]}/{game}.tar.xz"
        path = self._prepare(download, self._build)
        self._open(path, batch_size=batch_size, **kwargs)

    def _build(self, out: Path):
        name = type(self).__name__
        where = f"{name}({self.url})"
        with staging_dir(self.root, self.dataset_id) as tmp:
            archive = dl.download(self.url, tmp / Path(self.url).name, where=name)
            plan = []
            with open_tar(archive, f"{where}: not a (xz) tar archive") as tar:
                for i, member in enumerate(tar):
                    if not member.isfile() or not member.name.endswith(".npy"):
                        continue
                    raw = tar.extractfile(member).read()
                    ted = _trajectory(
                        read_npy(raw, f"{where}:{member.name}"), f"{where}:{member.name}"
                    )
                    # parked uncompressed on disk: the archive is read once
                    part = tmp / f"{i:08d}.npz"
                    np.savez(part, **{"/".join(k): v for k, v in ted.items()})
                    plan.append((len(ted[("action",)]), lambda p=part: _load_part(p)))
            if not plan:
                raise DatasetFormatError(f"{where}: no .npy trajectory in the archive.")
            write_episodes(
                out,
                plan,
                where=where,
                max_items=_CATEGORIES[self._category_name][1],
                dataset_id=self.dataset_id,
                source=self.url,
            )


def _load_part(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        out = {tuple(k.split("/")): z[k] for k in z.files}
    os.unlink(path)
    return out


def _trajectory(arr: np.ndarray, where: str) -> dict:
    d = arr.item() if arr.dtype == object and arr.shape == () else arr
    if not isinstance(d, dict):
        raise DatasetFormatError(
            f"{where}: expected a pickled dict of arrays, got {type(d).__name__}."
        )
    for req in ("observations", "actions", "rewards", "dones"):
        if req not in d:
            raise DatasetFormatError(f"{where}: no {req!r} entry (found {sorted(d)}).")
    obs = np.asarray(d["observations"])
    t = len(np.asarray(d["actions"]))
    if len(obs) != t + 1:
        raise DatasetFormatError(
            f"{where}: 'observations' has {len(obs)} rows, expected "
            f"{t + 1} (one more than 'actions')."
        )
    obs = obs.astype(np.uint8, copy=False)
    done = np.asarray(d["dones"]).astype(bool).reshape(t, 1)
    truncated = np.zeros((t, 1), bool)
    truncated[-1] = ~done[-1]
    out = {
        ("observation",): obs[:-1],
        ("next", "observation"): obs[1:],
        ("action",): np.asarray(d["actions"]),
        ("next", "reward"): np.asarray(d["rewards"]).reshape(t),
        ("next", "terminated"): done,
        ("next", "truncated"): truncated,
        ("next", "done"): done | truncated,
        ("done",): np.zeros((t, 1), bool),
        ("terminated",): np.zeros((t, 1), bool),
        ("truncated",): np.zeros((t, 1), bool),
    }
    for k, v in d.items():
        if k in ("observations", "actions", "rewards", "dones"):
            continue
        v = np.asarray(v)
        if v.ndim and len(v) == t and v.dtype != object:
            out[(k,)] = v
    return out
