"""Minari datasets, from the Hugging Face repos Minari's hub client reads (``minari`` optional)."""

from __future__ import annotations

import json
import os
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

_NAME = {
    "observations": "observation",
    "rewards": "reward",
    "truncations": "truncated",
    "terminations": "terminated",
    "actions": "action",
    "infos": "info",
}
# entries holding one value per *state* (T + 1 per episode of T steps): root and ("next", ...)
_STATE_KEYS = ("observations", "state", "infos")
_NEXT_KEYS = ("rewards", "terminations", "truncations")


def _minari_namespace() -> str:
    # MINARI_REMOTE is Minari's own setting ("hf://<organisation>", default farama-minari)
    remote = os.environ.get("MINARI_REMOTE", "hf://farama-minari")
    if not remote.startswith("hf://"):
        raise ValueError(
            f"MinariExperienceReplay: MINARI_REMOTE={remote!r} is not a Hugging "
            "Face remote ('hf://<organisation>'); only those are supported."
        )
    return remote[len("hf://") :].strip("/")


class MinariExperienceReplay(BaseDatasetExperienceReplay):
    """Minari datasets (TorchRL's ``MinariExperienceReplay``).

    Source: Minari's Hugging Face remote (``MINARI_REMOTE``, default ``hf://farama-minari``).
    A dataset id ``"<ns>/<rest>"`` (e.g. ``"D4RL/door/human-v2"``) lives in the dataset repo
    ``farama-minari/<ns>``; the loader downloads ``<rest>/data/main_data.hdf5`` and
    ``<rest>/data/metadata.json`` from
    ``{base_url}/datasets/farama-minari/<ns>/resolve/main/...`` (``base_url``: the argument,
    ``$HF_ENDPOINT`` or ``https://huggingface.co``), the files ``minari.download_dataset``
    fetches (checked against the sha256 / git sha1 the Hub publishes in its ETags).
    ``load_from_local_minari=True`` reads ``$MINARI_DATASETS_PATH`` (default
    ``~/.minari/datasets``)``/<dataset_id>/data/`` instead. With
    ``FRB_DATASETS_DOWNLOADER=hub``, ``minari.download_dataset`` fetches the dataset into that
    cache first (any ``MINARI_REMOTE``; needs ``pip install "minari[hdf5,hf]"``; ``base_url``
    is then refused: huggingface_hub reads ``HF_ENDPOINT``).

    Format read (Minari's HDF5 storage): groups ``episode_<i>`` with ``observations``
    (``T + 1`` rows; a group for Dict spaces, ``_index_<j>`` groups for Tuple spaces),
    ``actions`` (``T`` rows, same nesting), ``rewards``, ``terminations``, ``truncations``
    (``T``) and ``infos`` (a group; entries with ``T + 1`` rows, or ``T`` rows that miss the
    reset info). Text (string) datasets are dropped, as in TorchRL.

    Data (TED, exactly TorchRL's keys; episodes in increasing ``episode_<i>`` order, stored
    contiguously): ``episode`` (int64, the ``i`` of ``episode_<i>``), ``observation`` /
    ``("next", "observation")`` (rows ``0..T-1`` / ``1..T`` of ``observations``, nested like the
    space, file dtypes), ``info`` / ``("next", "info")`` likewise (a ``T``-row entry is padded
    with zeros in front), ``action``, ``("next", "reward")`` (``[N, 1]``, file dtype),
    ``("next", "terminated")``, ``("next", "truncated")`` and ``("next", "done")`` (their OR),
    bool ``[N, 1]``. :attr:`metadata` is the dataset's ``metadata.json`` (a dict).

    The arguments are TorchRL's, plus ``base_url``.

    Args:
      load_from_local_minari: read ``$MINARI_DATASETS_PATH`` (default
        ``~/.minari/datasets``) instead of downloading."""

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
        load_from_local_minari: bool = False,
        base_url: str | None = None,
    ):
        self.dataset_id = dataset_id
        self.root = default_root("minari") if root is None else root
        self.split_trajs = split_trajs
        self.download = download
        self.load_from_local_minari = load_from_local_minari
        self.endpoint = dl.hf_endpoint(base_url)
        self._with_minari = not load_from_local_minari and _hub.use_hub(type(self).__name__)
        if self._with_minari and base_url is not None:
            raise ValueError(
                f"{type(self).__name__}: base_url cannot be used with "
                "FRB_DATASETS_DOWNLOADER=hub: minari downloads from MINARI_REMOTE "
                "through huggingface_hub, which reads HF_ENDPOINT."
            )
        ns, _, rest = dataset_id.partition("/")
        self.repo = f"{_minari_namespace()}/{ns}" if not self._with_minari else None
        self._prefix = f"{rest}/data" if rest else "data"
        if load_from_local_minari:
            download = "force"  # TorchRL re-reads the local Minari cache every time
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

    @property
    def metadata_path(self) -> Path:
        return self.data_path_root / "frb_dataset.json"

    def _build(self, out: Path):
        name = type(self).__name__
        with staging_dir(self.root, self.dataset_id) as tmp:
            if self.load_from_local_minari or self._with_minari:
                if self._with_minari:  # FRB_DATASETS_DOWNLOADER=hub: minari's own client
                    src = _hub.minari_download(self.dataset_id, where=name)
                else:
                    base = Path(
                        os.environ.get(
                            "MINARI_DATASETS_PATH", os.path.expanduser("~/.minari/datasets")
                        )
                    )
                    src = base / self.dataset_id / "data"
                h5, meta = src / "main_data.hdf5", src / "metadata.json"
                if not h5.exists():
                    raise FileNotFoundError(
                        f"{name}: {h5} does not exist in the local Minari cache."
                    )
                source = str(src)
            else:
                h5, meta = (
                    _hub.hf_download(
                        self.endpoint, self.repo, f"{self._prefix}/{f}", tmp / f, where=name
                    )
                    for f in ("main_data.hdf5", "metadata.json")
                )
                source = dl.hf_file_url(self.endpoint, self.repo, f"{self._prefix}/main_data.hdf5")
            metadata = {}
            if meta.exists():
                try:
                    metadata = json.loads(meta.read_text())
                except ValueError as e:
                    raise DatasetFormatError(
                        f"{name}: {meta.name} from {source} is not JSON ({e})."
                    ) from None
            convert_minari(
                h5,
                out,
                where=f"{name}({source})",
                source=source,
                dataset_id=self.dataset_id,
                metadata=metadata,
            )


def _episode_len(group, where) -> int:
    import h5py

    node = group.get("actions")
    while isinstance(node, h5py.Group):
        node = next(iter(node.values()), None)
    if node is None:
        raise DatasetFormatError(f"{where}: {group.name} has no 'actions'.")
    return int(node.shape[0])


def _minari_episode(group, num: int, steps: int, where: str) -> dict:
    out = {("episode",): np.full((steps,), num, np.int64)}
    for key, node in h5_tree(group).items():
        name = _NAME.get(key, key)
        ctx = f"{where}: {group.name}/{key}"
        if key in _STATE_KEYS:
            leaves = flatten(node) if isinstance(node, dict) else {(): node}
            for sub, v in leaves.items():
                v = np.asarray(v)
                if v.ndim == 0:
                    continue
                if len(v) == steps:  # no value at reset: TorchRL pads a zero in front
                    v = np.concatenate([np.zeros_like(v[:1]), v], 0)
                if len(v) != steps + 1:
                    raise DatasetFormatError(
                        f"{ctx}/{'/'.join(sub)} has {len(v)} rows, "
                        f"expected {steps + 1} (T + 1 states)."
                    )
                out[(name,) + sub] = v[:-1]
                out[("next", name) + sub] = v[1:]
        elif key in _NEXT_KEYS:
            v = np.asarray(node)
            if v.shape[:1] != (steps,):
                raise DatasetFormatError(f"{ctx} has shape {v.shape}, expected ({steps},).")
            out[("next", name)] = v.reshape(steps, -1) if v.ndim > 1 else v[:, None]
        else:
            leaves = flatten(node) if isinstance(node, dict) else {(): node}
            for sub, v in leaves.items():
                v = np.asarray(v)
                if v.shape[:1] != (steps,):
                    raise DatasetFormatError(
                        f"{ctx}/{'/'.join(sub)} has shape {v.shape}, expected {steps} rows."
                    )
                out[(name,) + sub] = v
    for req in ("terminated", "truncated"):
        if ("next", req) not in out:
            raise DatasetFormatError(f"{where}: {group.name} has no '{req[:-1]}ions' dataset.")
    out[("next", "terminated")] = out[("next", "terminated")].astype(bool)
    out[("next", "truncated")] = out[("next", "truncated")].astype(bool)
    out[("next", "done")] = out[("next", "terminated")] | out[("next", "truncated")]
    return out


def convert_minari(h5_path, out, *, where: str, **meta):
    """Minari's ``main_data.hdf5`` -> the TED memmap at ``out`` (see the class docstring)."""
    import h5py

    try:
        f = h5py.File(h5_path, "r")
    except OSError as e:
        raise DatasetFormatError(f"{where}: not an HDF5 file ({e}).") from None
    with f:
        eps = []
        for key in f.keys():
            if not key.startswith("episode_"):
                continue
            try:
                num = int(key[len("episode_") :])
            except ValueError:
                raise DatasetFormatError(f"{where}: unexpected group {key!r}.") from None
            eps.append((num, key))
        if not eps:
            raise DatasetFormatError(f"{where}: no 'episode_<i>' group (not a Minari file).")
        plan = []
        for num, key in sorted(eps):
            steps = _episode_len(f[key], where)
            plan.append((steps, lambda g=f[key], n=num, s=steps: _minari_episode(g, n, s, where)))
        write_episodes(out, plan, where=where, **meta)
