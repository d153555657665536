"""D4RL offline datasets, downloaded directly (no ``d4rl``/``gym`` install)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._d4rl_files import D4RL_FILES
from functional_rb.adapters.datasets._formats import DatasetFormatError, flatten, h5_tree
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.writers.base import Writer

D4RL_BASE_URL = "http://rail.eecs.berkeley.edu/datasets/offline_rl"
_RENAME = {
    "observations": "observation",
    "actions": "action",
    "rewards": "reward",
    "terminals": "terminated",
    "timeouts": "truncated",
    "infos": "info",
}


class D4RLExperienceReplay(BaseDatasetExperienceReplay):
    """D4RL datasets (TorchRL's ``D4RLExperienceReplay`` with ``direct_download=True``).

    Source: the HDF5 file D4RL publishes for ``dataset_id`` at
    ``{base_url}/<path>`` (``base_url`` defaults to ``$FRB_D4RL_BASE_URL`` or
    ``http://rail.eecs.berkeley.edu/datasets/offline_rl``; ``<path>`` from D4RL's list, e.g.
    ``gym_mujoco_v2/hopper_medium-v2.hdf5``; ids in :attr:`available_datasets`).

    Format read: HDF5 datasets ``observations [N, ...]``, ``actions``, ``rewards [N]``,
    ``terminals [N]``, optional ``timeouts [N]``, ``next_observations``, ``infos/*`` (group) and
    ``metadata/*`` (kept out of the data: scalars go to :attr:`metadata`).

    Data (TED, ``M = N - 1`` items, exactly TorchRL's conversion): row ``t`` holds
    ``observation`` (file dtype, ``[M, obs_dim]``), ``action``, ``info/*``; ``("next",
    "observation")`` = ``next_observations[t]`` if present else ``observations[t + 1]``, zeroed
    where ``("next", "done")`` (the next state of an episode end is unknown); ``("next",
    "reward")`` (``[M, 1]``, file dtype) = ``rewards[t]``; ``("next", "terminated")`` =
    ``terminals[t]``, ``("next", "truncated")`` = ``timeouts[t]`` and ``("next", "done")`` =
    their OR (only ``terminated`` with ``use_truncated_as_done=False``), bool ``[M, 1]``;
    ``("next", "info", *)`` = ``infos[t + 1]``. Root ``reward``/``done``/``terminated``/
    ``truncated`` are the previous step's (0 at ``t = 0``), as in TorchRL.

    The arguments are TorchRL's, plus ``base_url``. Only the direct download is implemented:
    ``from_env=True`` or ``direct_download=False`` (which need the ``d4rl`` package) raise
    ``NotImplementedError``.

    Args:
      split_trajs: items are whole trajectories ``[max_len, ...]``, zero-padded, with
        ``"mask"`` and ``"traj_ids"``.
      from_env: read the data through the ``d4rl`` package's environments: not implemented
        (raises ``NotImplementedError``).
      use_truncated_as_done: ``done`` is ``terminated | truncated``; False: ``terminated``
        only.
      direct_download: download the files directly (the only implemented way: False raises
        ``NotImplementedError``).
      terminate_on_end: TorchRL's option of the ``d4rl``-package path; accepted.
      **env_kwargs: accepted for TorchRL's signature.
    """

    available_datasets = list(D4RL_FILES)

    def __init__(
        self,
        dataset_id: str,
        batch_size: int | None = None,
        sampler: Sampler | None = None,
        writer: Writer | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        split_trajs: bool = False,
        from_env: bool = False,
        use_truncated_as_done: bool = True,
        direct_download: bool | None = None,
        terminate_on_end: bool | None = None,
        download: bool | str = True,
        root: str | Path | None = None,
        *,
        base_url: str | None = None,
        **env_kwargs,
    ):
        name = type(self).__name__
        if from_env or direct_download is False:
            raise NotImplementedError(
                f"{name}: from_env=True / direct_download=False need the d4rl package and gym; "
                "this loader implements D4RL's direct download (the default)."
            )
        if terminate_on_end is False:
            raise ValueError(
                f"{name}: terminate_on_end=False is not compatible with the "
                "direct download (as in TorchRL)."
            )
        if env_kwargs:
            raise RuntimeError(
                f"{name}: cannot pass env_kwargs with the direct download. Got "
                f"env_kwargs keys: {sorted(env_kwargs)}."
            )
        if dataset_id not in D4RL_FILES:
            raise KeyError(
                f"{name}: unknown D4RL dataset {dataset_id!r}; see {name}.available_datasets."
            )
        self.dataset_id = dataset_id
        self.use_truncated_as_done = use_truncated_as_done
        self.from_env = from_env
        self.root = default_root("d4rl") if root is None else root
        self.base_url = (base_url or os.environ.get("FRB_D4RL_BASE_URL") or D4RL_BASE_URL).rstrip(
            "/"
        )
        self.url = f"{self.base_url}/{D4RL_FILES[dataset_id]}"
        path = self._prepare(
            download,
            self._build,
            split_trajs=split_trajs,
            options={"use_truncated_as_done": bool(use_truncated_as_done)},
        )
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
        self.specs = None

    def _build(self, out: Path):
        import h5py

        name = type(self).__name__
        with staging_dir(self.root, self.dataset_id) as tmp:
            h5 = dl.download(self.url, tmp / Path(self.url).name, where=name)
            where = f"{name}({h5.name} from {self.url})"
            try:
                with h5py.File(h5, "r") as f:
                    tree = h5_tree(f)
            except OSError as e:
                raise DatasetFormatError(f"{where}: not an HDF5 file ({e}).") from None
        metadata = tree.pop("metadata", {})
        data = convert_d4rl(tree, self.use_truncated_as_done, where)
        m = len(data[("action",)])
        small = {"/".join(k): v for k, v in flatten(metadata).items() if np.size(v) <= 16}
        write_episodes(
            out,
            [(m, lambda: data)],
            where=where,
            source=self.url,
            dataset_id=self.dataset_id,
            metadata=small,
            options={"use_truncated_as_done": bool(self.use_truncated_as_done)},
        )


def convert_d4rl(tree: dict, use_truncated_as_done: bool, where: str) -> dict:
    """D4RL's flat arrays -> TED leaves ``{key tuple: array [N - 1, ...]}`` (see the class)."""
    for req in ("observations", "actions", "rewards", "terminals"):
        if req not in tree:
            raise DatasetFormatError(
                f"{where}: the HDF5 file has no {req!r} dataset (found "
                f"{sorted(tree)}); not a D4RL file."
            )
    flat = {}
    for key, v in flatten(tree).items():
        flat[(_RENAME.get(key[0], key[0]),) + key[1:]] = np.asarray(v)
    n = len(flat[("observation",)])
    for key, v in flat.items():
        if v.ndim == 0 or len(v) != n:
            raise DatasetFormatError(
                f"{where}: dataset {'/'.join(key)!r} has shape {v.shape}, "
                f"expected {n} rows like 'observations'."
            )
    if n < 2:
        raise DatasetFormatError(f"{where}: {n} step(s); a transition needs two.")
    terminated = flat.pop(("terminated",)).astype(bool).reshape(n, 1)
    truncated = flat.pop(("truncated",), None)
    truncated = None if truncated is None else truncated.astype(bool).reshape(n, 1)
    done = (
        terminated | truncated
        if (use_truncated_as_done and truncated is not None)
        else terminated.copy()
    )
    reward = flat.pop(("reward",)).reshape(n, 1)
    next_obs = flat.pop(("next_observations",), None)
    out = {}
    for key, v in flat.items():
        out[key] = v[:-1]
        if key[0] in ("observation", "info"):
            out[("next",) + key] = v[1:]
    if next_obs is not None:
        out[("next", "observation")] = next_obs[:-1]
    flags = {"reward": reward, "done": done, "terminated": terminated}
    if truncated is not None:
        flags["truncated"] = truncated
    for k, v in flags.items():
        cur = v[:-1]
        out[("next", k)] = cur
        shifted = np.zeros_like(cur)
        shifted[1:] = cur[:-1]
        out[(k,)] = shifted
    nxt = np.array(out[("next", "observation")], copy=True)
    nxt[out[("next", "done")][:, 0]] = 0
    out[("next", "observation")] = nxt
    return out
