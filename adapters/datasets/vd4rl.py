"""V-D4RL (visual D4RL) datasets, from the Hugging Face repo ``conglu/vd4rl``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from functional_rb.adapters.datasets import _download as dl
from functional_rb.adapters.datasets import _hub
from functional_rb.adapters.datasets._cache import default_root, staging_dir, write_episodes
from functional_rb.adapters.datasets._common import (
    BaseDatasetExperienceReplay,
    Resize,
    ToTensorImage,
)
from functional_rb.adapters.datasets._formats import DatasetFormatError, flatten, h5_tree
from functional_rb.adapters.samplers.base import Sampler
from functional_rb.adapters.writers.base import Writer

REPO = "conglu/vd4rl"
_NAME = {
    "is_first": ("is_init",),
    "is_last": ("next", "done"),
    "is_terminal": ("next", "terminated"),
    "reward": ("next", "reward"),
    "image": ("pixels",),
    "observation": ("pixels",),
    "discount": ("discount",),
    "action": ("action",),
}
_IMAGE_KEYS = ["pixels", ("next", "pixels")]


class VD4RLExperienceReplay(BaseDatasetExperienceReplay):
    """V-D4RL (https://arxiv.org/abs/2206.04779; TorchRL's ``VD4RLExperienceReplay``).

    Source: the Hugging Face dataset repo ``conglu/vd4rl`` (what TorchRL reads with
    ``huggingface_hub``): every ``.npz``/``.hdf5`` file under ``vd4rl/<dataset_id>/`` (e.g.
    ``dataset_id="main/walker_walk/random/64px"``), listed with
    ``{base_url}/api/datasets/conglu/vd4rl/tree/main/vd4rl/<dataset_id>?recursive=true`` and
    fetched from ``{base_url}/datasets/conglu/vd4rl/resolve/main/<path>`` (``base_url``: the
    argument, ``$HF_ENDPOINT`` or ``https://huggingface.co``). Files are read in path order.

    Format read: episode files (DreamerV2 ``.npz`` or flat ``.hdf5``) with per-step arrays
    ``image``/``observation`` (uint8 ``[T, H, W, 3]``), ``action``, ``reward``, ``discount``,
    ``is_first``, ``is_last``, ``is_terminal`` and possibly other state arrays.

    Data (TED, TorchRL's mapping, row ``t`` = the file's row ``t``): ``pixels`` (uint8
    ``[N, H, W, 3]`` on disk), ``("next", "pixels")`` = the file's ``pixels[t + 1]`` (zeros on
    its last row), ``action``, ``discount``, ``is_init`` (= ``is_first``), ``("next",
    "reward")`` ``[N, 1]``, ``("next", "done")`` = ``is_last``, ``("next", "terminated")`` =
    ``is_terminal``, ``("next", "truncated")`` = done and not terminated, root
    ``done``/``terminated``/``truncated`` False (bool ``[N, 1]``); any other array ``x`` goes to
    ``("state", x)`` with ``("next", "state", x)`` shifted like the pixels. With
    ``totensor=True`` (default) samples pass through :class:`ToTensorImage` (pixels as float32
    ``[..., 3, H, W]`` in ``[0, 1]``), and ``image_size`` appends a bilinear :class:`Resize`, as
    TorchRL's transforms do.

    The arguments are TorchRL's, plus ``base_url``.

    Args:
      totensor: TorchRL's option to append a ``ToTensorImage`` transform; accepted.
      image_size: TorchRL's option to append a ``Resize`` transform; accepted.
      num_workers: accepted; files are downloaded one after the other.
      **env_kwargs: accepted for TorchRL's signature; any entry raises ``TypeError``.
    """

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
        totensor: bool = True,
        image_size: int | Sequence[int] | None = None,
        num_workers: int = 0,
        base_url: str | None = None,
        **env_kwargs,
    ):
        if env_kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(env_kwargs)}.")
        self.dataset_id = dataset_id.strip("/")
        self.root = default_root("vd4rl") if root is None else root
        self.split_trajs = split_trajs
        self.download = download
        self.num_workers = num_workers
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
        if totensor and not any(type(t).__name__ == "ToTensorImage" for t in self.transform):
            self.append_transform(ToTensorImage(_IMAGE_KEYS))
        if image_size is not None:
            self.append_transform(Resize(image_size, _IMAGE_KEYS))

    def _build(self, out: Path):
        name = type(self).__name__
        prefix = f"vd4rl/{self.dataset_id}"
        listing = _hub.hf_list(self.endpoint, REPO, prefix, where=name)
        files = sorted(p for p in listing if p.endswith((".npz", ".hdf5")))
        if not files:
            raise DatasetFormatError(
                f"{name}: no .npz/.hdf5 file under {prefix} in {self.endpoint}/datasets/{REPO}; "
                "check the dataset id (e.g. 'main/walker_walk/random/64px')."
            )
        with staging_dir(self.root, self.dataset_id) as tmp:
            plan = []
            for i, f in enumerate(files):
                url = dl.hf_file_url(self.endpoint, REPO, f)
                local = _hub.hf_download(
                    self.endpoint,
                    REPO,
                    f,
                    tmp / f"{i:06d}{Path(f).suffix}",
                    where=name,
                    remote=listing[f],
                )
                n = _file_len(local, f"{name}({url})")
                plan.append((n, lambda p=local, w=f"{name}({url})": _process(_read_file(p, w), w)))
            write_episodes(
                out,
                plan,
                where=name,
                dataset_id=self.dataset_id,
                source=f"{self.endpoint}/datasets/{REPO}/{prefix}",
            )


def _file_len(path: Path, where: str) -> int:
    """Steps in an episode file, read from its smallest array."""
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                for k in ("reward", "is_first", "discount", "action"):
                    if k in z.files:
                        return len(z[k])
                return len(z[z.files[0]])
        except Exception as e:
            raise DatasetFormatError(f"{where}: not a readable .npz file ({e}).") from None
    import h5py

    try:
        with h5py.File(path, "r") as f:
            node = f
            while isinstance(node, h5py.Group):
                node = node[sorted(node.keys())[0]]
            return int(node.shape[0])
    except (OSError, IndexError) as e:
        raise DatasetFormatError(f"{where}: not a readable HDF5 episode file ({e}).") from None


def _read_file(path: Path, where: str) -> dict:
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except Exception as e:
            raise DatasetFormatError(f"{where}: not a readable .npz file ({e}).") from None
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return h5_tree(f)
    except OSError as e:
        raise DatasetFormatError(f"{where}: not an HDF5 file ({e}).") from None


def _process(arrays: dict, where: str) -> dict:
    out = {}
    n = None
    for name, v in arrays.items():
        leaves = flatten(v) if isinstance(v, dict) else {(): np.asarray(v)}
        for sub, arr in leaves.items():
            key = _NAME.get(name, ("state", name)) + sub
            if n is None:
                n = len(arr)
            if arr.ndim == 0 or len(arr) != n:
                raise DatasetFormatError(
                    f"{where}: array {name!r} has shape {arr.shape}, expected {n} rows."
                )
            out[key] = arr
    if ("pixels",) not in out:
        raise DatasetFormatError(
            f"{where}: no 'image'/'observation' array (found {sorted(arrays)})."
        )
    if ("next", "reward") in out:
        out[("next", "reward")] = out[("next", "reward")].reshape(n, 1)
    if ("next", "done") in out and ("next", "terminated") in out:
        done = out[("next", "done")].astype(bool).reshape(n, 1)
        term = out[("next", "terminated")].astype(bool).reshape(n, 1)
        out[("next", "done")], out[("next", "terminated")] = done, term
        out[("next", "truncated")] = done & ~term
        for k in ("done", "terminated", "truncated"):
            out[(k,)] = np.zeros((n, 1), bool)
    for key in [k for k in out if k[0] in ("pixels", "state")]:
        nxt = np.zeros_like(out[key])
        nxt[:-1] = out[key][1:]
        out[("next",) + key] = nxt
    return out
