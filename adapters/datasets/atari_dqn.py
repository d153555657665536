"""The DQN Replay Dataset (Atari), from its public Google Cloud Storage bucket over HTTPS."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay, shifted_next
from functional_rb.adapters.datasets._formats import DatasetFormatError, npy_gz_shape, read_npy_gz
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.samplers.random import SamplerWithoutReplacement
from functional_rb.adapters.samplers.slice import SliceSampler
from functional_rb.adapters.samplers.slice_without_replacement import SliceSamplerWithoutReplacement
from functional_rb.adapters.writers.base import Writer

GCS_ENDPOINT = "https://storage.googleapis.com"
BUCKET = "atari-replay-datasets"
_GAMES = (
    "AirRaid",
    "Alien",
    "Amidar",
    "Assault",
    "Asterix",
    "Asteroids",
    "Atlantis",
    "BankHeist",
    "BattleZone",
    "BeamRider",
    "Berzerk",
    "Bowling",
    "Boxing",
    "Breakout",
    "Carnival",
    "Centipede",
    "ChopperCommand",
    "CrazyClimber",
    "DemonAttack",
    "DoubleDunk",
    "ElevatorAction",
    "Enduro",
    "FishingDerby",
    "Freeway",
    "Frostbite",
    "Gopher",
    "Gravitar",
    "Hero",
    "IceHockey",
    "Jamesbond",
    "JourneyEscape",
    "Kangaroo",
    "Krull",
    "KungFuMaster",
    "MontezumaRevenge",
    "MsPacman",
    "NameThisGame",
    "Phoenix",
    "Pitfall",
    "Pong",
    "Pooyan",
    "PrivateEye",
    "Qbert",
    "Riverraid",
    "RoadRunner",
    "Robotank",
    "Seaquest",
    "Skiing",
    "Solaris",
    "SpaceInvaders",
)
# replay-log file name (before ".<checkpoint>.gz") -> what it holds
_FILES = {
    "$store$_observation_ckpt": "observation",
    "$store$_action_ckpt": "action",
    "$store$_reward_ckpt": "reward",
    "$store$_terminal_ckpt": "terminal",
    "add_count_ckpt": "add_count",
    "invalid_range_ckpt": "invalid_range",
}
_REQUIRED = ("observation", "action", "reward", "terminal")


class AtariDQNExperienceReplay(BaseDatasetExperienceReplay):
    """The DQN Replay Dataset (https://offline-rl.github.io/; TorchRL's
    ``AtariDQNExperienceReplay``).

    Source: the public bucket ``gs://atari-replay-datasets`` over HTTPS (what TorchRL reaches
    with ``gsutil``): the listing ``{base_url}/storage/v1/b/atari-replay-datasets/o?prefix=
    dqn/<Game>/<run>/replay_logs/`` and the objects ``{base_url}/atari-replay-datasets/dqn/
    <Game>/<run>/replay_logs/<file>``; ``base_url`` defaults to ``$FRB_ATARI_BASE_URL`` or
    ``https://storage.googleapis.com``. ``dataset_id`` is ``"<Game>/<run>"`` (run 1 to 5, see
    :attr:`available_datasets`).

    Format read: Dopamine replay-buffer checkpoints, one set per checkpoint ``k``:
    ``$store$_observation_ckpt.k.gz`` (gzipped ``.npy``, uint8 ``[n, 84, 84]``),
    ``$store$_action_ckpt.k.gz`` (int32 ``[n]``), ``$store$_reward_ckpt.k.gz`` (float32
    ``[n]``), ``$store$_terminal_ckpt.k.gz`` (uint8 ``[n]``), ``add_count_ckpt.k.gz`` and
    ``invalid_range_ckpt.k.gz`` (kept in :attr:`metadata`). Checkpoints are read as linear
    logs in increasing ``k`` (as TorchRL does) and stored contiguously.

    Data (TED, ``N`` = total frames): ``observation`` uint8 ``[N, 84, 84]`` (stored once),
    ``("next", "observation")`` = ``observation[i + 1]`` computed at read time, zeros where
    ``("next", "done")`` (Atari-DQN has no next frame after a terminal step; TorchRL also fills
    0s), ``action`` (file dtype, int32), ``("next", "reward")`` float32 ``[N]``,
    ``("next", "terminated")`` = the terminal flag, ``("next", "truncated")`` True at the last
    frame of each checkpoint (its next frame is not in the log), ``("next", "done")`` = their
    OR, and root ``done``/``terminated``/``truncated`` (all False), bool ``[N, 1]``.
    Deviation from TorchRL: flags are bool ``[N, 1]`` (TorchRL: uint8 ``[N]``), checkpoint ends
    are marked truncated, and the per-checkpoint metadata is in :attr:`metadata` instead of a
    ``"metadata"`` entry of every sample. :attr:`episodes` (int64 ``[N]``) numbers the episodes.

    The arguments are TorchRL's, plus ``base_url``. The class attribute ``_max_runs`` (TorchRL's debugging knob) keeps checkpoints
    ``k < _max_runs`` only.

    Args:
      num_procs: accepted; files are downloaded one after the other.
      num_slices: builds a ``SliceSampler(end_key=("next", "done"),
        strict_length=strict_len)`` drawing this many slices per batch.
      slice_len: builds the same sampler with slices of this many steps (exclusive with
        ``num_slices``).
      strict_len: passed to the slice sampler as ``strict_length``.
      replacement: False: ``SliceSamplerWithoutReplacement`` with ``num_slices`` /
        ``slice_len``, else ``SamplerWithoutReplacement``.
      mp_start_method: accepted; files are downloaded one after the other.
      **kwargs: more arguments of the buffer.
    """

    available_datasets = [f"{g}/{r}" for g in _GAMES for r in range(1, 6)]
    _max_runs = None

    def __init__(
        self,
        dataset_id: str,
        batch_size: int | None = None,
        *,
        root: str | Path | None = None,
        download: bool | str = True,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        transform: Callable | None = None,
        num_procs: int = 0,
        num_slices: int | None = None,
        slice_len: int | None = None,
        strict_len: bool = True,
        replacement: bool = True,
        mp_start_method: str = "fork",
        base_url: str | None = None,
        **kwargs,
    ):
        if dataset_id not in self.available_datasets:
            raise ValueError(
                f"{type(self).__name__}: {dataset_id!r} is not an available dataset; ids are "
                "'<Game>/<run>' with run 1 to 5 (see AtariDQNExperienceReplay."
                "available_datasets)."
            )
        self.dataset_id = dataset_id
        self.root = default_root("atari") if root is None else root
        self.num_procs = num_procs
        self.mp_start_method = mp_start_method
        self.endpoint = (base_url or os.environ.get("FRB_ATARI_BASE_URL") or GCS_ENDPOINT).rstrip(
            "/"
        )
        if sampler is None:
            if num_slices is not None or slice_len is not None:
                cls = SliceSampler if replacement else SliceSamplerWithoutReplacement
                sampler = cls(
                    num_slices=num_slices,
                    slice_len=slice_len,
                    end_key=("next", "done"),
                    strict_length=strict_len,
                )
            elif not replacement:
                sampler = SamplerWithoutReplacement()
        path = self._prepare(download, self._build, options={"max_runs": self._max_runs})
        self._open(
            path,
            batch_size=batch_size,
            sampler=sampler,
            writer=writer,
            transform=transform,
            collate_fn=kwargs.pop("collate_fn", None),
            virtual={("next", "observation"): shifted_next(("observation",))},
            **kwargs,
        )

    @property
    def dataset_path(self) -> Path:
        return self.data_path_root

    @property
    def episodes(self) -> torch.Tensor:
        """int64 ``[N]``: the episode of every frame (a new one after each ``("next",
        "done")``)."""
        done = np.asarray(self._storage.leaf(("next", "done"))).reshape(len(self), -1).any(-1)
        ep = np.concatenate([[0], np.cumsum(done[:-1])])
        return torch.from_numpy(ep.astype(np.int64))

    def _build(self, out: Path):
        name = type(self).__name__
        prefix = f"dqn/{self.dataset_id}/replay_logs/"
        names = dl.gcs_list_entries(self.endpoint, BUCKET, prefix, where=name)
        ckpts: dict = defaultdict(dict)
        for obj in names:
            fname = obj.rsplit("/", 1)[-1]
            parts = fname.split(".")
            if len(parts) != 3 or parts[2] != "gz" or parts[0] not in _FILES:
                continue
            ckpts[int(parts[1])][_FILES[parts[0]]] = obj
        if self._max_runs is not None:
            ckpts = {k: v for k, v in ckpts.items() if k < self._max_runs}
        if not ckpts:
            raise DatasetFormatError(
                f"{name}: no replay-log checkpoint under {self.endpoint}/storage/v1/b/{BUCKET}/o"
                f"?prefix={prefix}."
            )
        with staging_dir(self.root, self.dataset_id) as tmp:
            plan, meta = [], []
            for k in sorted(ckpts):
                files = ckpts[k]
                missing = [f for f in _REQUIRED if f not in files]
                if missing:
                    raise DatasetFormatError(
                        f"{name}: checkpoint {k} lacks {missing} in the listing of {prefix}."
                    )
                local = {}
                for what, obj in files.items():
                    url = dl.gcs_object_url(self.endpoint, BUCKET, obj)
                    local[what] = (
                        dl.download(
                            url,
                            tmp / obj.rsplit("/", 1)[-1],
                            where=name,
                            checksum=names[obj].checksum,
                            size=names[obj].size,
                        ),
                        url,
                    )
                obs_path, obs_url = local["observation"]
                shape, _ = npy_gz_shape(obs_path, f"{name}({obs_url})")
                info = {"checkpoint": k}
                for what in ("add_count", "invalid_range"):
                    if what in local:
                        p, url = local[what]
                        info[what] = read_npy_gz(p.read_bytes(), f"{name}({url})").tolist()
                meta.append(info)
                plan.append((shape[0], lambda loc=local: _checkpoint(loc, name)))
            write_episodes(
                out,
                plan,
                where=name,
                dataset_id=self.dataset_id,
                source=f"{self.endpoint}/{BUCKET}/{prefix}",
                metadata={"dataset_id": self.dataset_id, "checkpoints": meta},
                options={"max_runs": self._max_runs},
            )


def _checkpoint(local: dict, name: str) -> dict:
    arrays = {}
    for what in _REQUIRED:
        path, url = local[what]
        arrays[what] = read_npy_gz(path.read_bytes(), f"{name}({url})")
        os.unlink(path)  # the raw file is not needed once read
    n = len(arrays["observation"])
    for what in ("action", "reward", "terminal"):
        if arrays[what].shape[:1] != (n,):
            raise DatasetFormatError(
                f"{name}({local[what][1]}): {arrays[what].shape[0]} rows, "
                f"the observations have {n}."
            )
    terminated = arrays["terminal"].astype(bool).reshape(n, 1)
    truncated = np.zeros((n, 1), bool)
    truncated[-1] = ~terminated[-1]
    zeros = np.zeros((n, 1), bool)
    return {
        ("observation",): arrays["observation"],
        ("action",): arrays["action"],
        ("next", "reward"): arrays["reward"],
        ("next", "terminated"): terminated,
        ("next", "truncated"): truncated,
        ("next", "done"): terminated | truncated,
        ("done",): zeros,
        ("terminated",): zeros,
        ("truncated",): zeros,
    }
