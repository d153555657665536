"""TorchRL's ``PrioritizedSampler`` over the functional core's jittable sum tree, and
TorchRL's prioritized-sampler files (shared with the prioritized slice sampler)."""


from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

import functional_rb as frb
from functional_rb.adapters._utils import core as _core
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, Sampler, ravel, unravel

__all__ = ["PrioritizedSampler", "LoadedPriorities", "read_priority_files",
           "write_priority_files"]


class PrioritizedSampler(Sampler):
    """Proportional prioritized sampling (TorchRL's ``PrioritizedSampler``) over the core's
    jittable sum tree (``frb.PrioritizedSampler``).

    Item ``i`` (TorchRL's flat index: ``t * n + env`` for ``ndim=2``) is drawn with probability
    ``(p_i + eps) ** alpha / sum_j (p_j + eps) ** alpha``; ``info["priority_weight"]`` is
    ``(p_min / p_i) ** beta`` over the stored items. New items get the largest priority seen
    (1.0 before any), or with ``max_priority_within_buffer`` the largest still stored.
    ``max_capacity`` may differ from the storage's size. The tree is float32 (``dtype`` is
    accepted for compatibility). Priorities must be finite and >= 0: others raise.
    """

    _SCHEMA = 1
    prioritized = True

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max",
                 max_priority_within_buffer: bool = False, device=None):
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        if reduction not in ("max", "min", "sum", "mean", "median"):
            raise ValueError(f"PrioritizedSampler: reduction must be one of max, min, sum, "
                             f"mean, median; got {reduction!r}.")
        self._max_capacity = int(max_capacity)
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.dtype, self.reduction = dtype, reduction
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self._device = None if device is None else torch.device(device)
        self._init()

    def _init(self) -> None:
        self._core = frb.PrioritizedSampler(alpha=self._alpha, beta=self._beta, eps=self._eps)
        self._layout = _core.make_layout(self._max_capacity)
        self._state = _core.init_sampler(self._core, None, self._layout)
        self._max_priority = (None, None)

    @property
    def max_size(self) -> int:
        return self._max_capacity

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        """Re-expresses the stored values with the new exponent (TorchRL's rule; from 0 the raw
        priorities are gone and sampling stays uniform until they are updated)."""
        if value < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={value}")
        old, values = self._alpha, self.tree_values()
        self._alpha = float(value)
        written = np.flatnonzero(values > 0)
        state = self._state
        self._core = frb.PrioritizedSampler(alpha=self._alpha, beta=self._beta, eps=self._eps)
        self._state = state
        if old == value or not written.size:
            return
        if old == 0:
            warnings.warn("Changing alpha away from 0 cannot recover the raw priorities "
                          "(alpha == 0 stores 1.0 for every item); sampling stays uniform "
                          "until priorities are updated.")
            return
        raw = np.maximum(values[written].astype(np.float64) ** (1.0 / old) - self._eps, 0.0)
        self._write(written, raw)

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)
        self._core = frb.PrioritizedSampler(alpha=self._alpha, beta=self._beta, eps=self._eps)

    @property
    def eps(self) -> float:
        return self._eps

    @property
    def device(self) -> torch.device:
        return self._device or torch.device("cpu")

    @property
    def default_priority(self) -> float:
        mp = self._max_priority[0]
        return 1.0 if mp is None else float(mp)

    # ------------------------------------------------------------------ the tree
    def tree_values(self) -> np.ndarray:
        """float32 ``[max_capacity]``: ``(p + eps) ** alpha`` of each item (0: none)."""
        return _core.tree_values(self._state, self._max_capacity)

    def _write(self, index: np.ndarray, priority: np.ndarray) -> None:
        self._state = _core.update(self._core, self._layout, self._state, index, priority,
                                   filled=self._max_capacity, cursor=0)

    def _flat(self, index, storage) -> torch.Tensor:
        """Flat tree positions (long ``[N]``) of TorchRL-style indices; -1 kept."""
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, dtype=torch.long).detach().cpu()
        if index.ndim > 1:
            if storage is None:
                raise RuntimeError("storage should be provided to Sampler.update_priority when "
                                   "the storage has more than one dimension.")
            index = ravel(index, storage.shape)
        return index.reshape(-1)

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Set the priorities of ``index`` (TorchRL's indices; -1 entries are skipped)."""
        index = self._flat(index, storage)
        priority = torch.as_tensor(priority).detach().to(torch.float64).cpu()
        if priority.numel() > 1 and priority.numel() != index.numel():
            raise RuntimeError("priority should be a number or an iterable of the same length "
                               f"as index. Got priority of shape {tuple(priority.shape)} and "
                               f"index {tuple(index.shape)}.")
        priority = priority.reshape(-1).expand(index.shape) if priority.numel() == 1 \
            else priority.reshape(-1)
        keep = index >= 0
        index, priority = index[keep].numpy(), priority[keep].numpy()
        if index.size == 0:
            return
        self._check(index, priority)
        imax = int(np.argmax(priority))
        mp, _ = self._max_priority
        if mp is None or priority[imax] > mp:
            self._max_priority = (float(priority[imax]), int(index[imax]))
        self._write(index, priority)
        if self._max_priority_within_buffer and self._alpha != 0 and \
                np.any(index == self._max_priority[1]):
            self._recompute_max()

    def _check(self, index: np.ndarray, priority: np.ndarray) -> None:
        bad = ~np.isfinite(priority) | (priority < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"PrioritizedSampler.update_priority: priority {priority[i]!r} at "
                             f"index {int(index[i])} is not a finite number >= 0 ({int(bad.sum())}"
                             " bad); pass e.g. td_error.abs().")
        if index.max() >= self._max_capacity:
            raise IndexError(f"PrioritizedSampler.update_priority: index {int(index.max())} is "
                             f"outside the sampler's max_capacity={self._max_capacity}.")

    def _recompute_max(self) -> None:
        values = self.tree_values()
        i = int(np.argmax(values))
        if values[i] <= 0:
            self._max_priority = (None, None)
            return
        raw = max(float(values[i]) ** (1.0 / self._alpha) - self._eps, 0.0)
        self._max_priority = (raw, i)

    def mark_update(self, index, *, storage=None) -> None:
        """Items at ``index`` were (re)written: they start at :attr:`default_priority`."""
        self.update_priority(index, self.default_priority, storage=storage)

    def _erase_max_if_overwritten(self, index, storage) -> None:
        if not self._max_priority_within_buffer or self._max_priority[1] is None:
            return
        flat = self._flat(index, storage) if not isinstance(index, int) else torch.tensor([index])
        if bool((flat == self._max_priority[1]).any()):
            self._max_priority = (None, None)

    def add(self, index, *, storage=None) -> None:
        self._erase_max_if_overwritten(index, storage)

    def extend(self, index, *, storage=None) -> None:
        self._erase_max_if_overwritten(index, storage)

    # ------------------------------------------------------------------ sample
    def sample(self, storage, batch_size: int):
        n = len(storage)
        if n == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        idx, w, ok, _ = _core.sample(self._core, self._layout, self._state,
                                     _core.seed_key(self.rng), batch_size,
                                     filled=min(n, self._max_capacity), cursor=0)
        if not ok.all():
            raise RuntimeError("non-positive p_sum: every stored item has priority 0 (set "
                               "positive priorities with update_priority).")
        index = torch.from_numpy(idx.astype(np.int64)).clamp_max_(n - 1)
        weight = torch.from_numpy(np.array(w, np.float32))
        if storage.ndim > 1:
            index = unravel(index, storage.shape)
        return index, {"priority_weight": weight}

    def _empty(self) -> None:
        self._init()

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        values = torch.from_numpy(self.tree_values().astype(np.float64))
        return {"_schema_version": self._SCHEMA, "_alpha": self._alpha, "_beta": self._beta,
                "_eps": self._eps, "_max_priority": self._max_priority,
                "_sum_tree": values, "_min_tree": values.clone()}

    def load_state_dict(self, state_dict) -> None:
        self._alpha, self._beta = float(state_dict["_alpha"]), float(state_dict["_beta"])
        self._eps = float(state_dict["_eps"])
        tree = state_dict["_sum_tree"]
        if not isinstance(tree, torch.Tensor):
            raise TypeError("PrioritizedSampler.load_state_dict: '_sum_tree' must be the tensor "
                            "of stored values that this sampler's state_dict() writes; TorchRL's "
                            "compiled trees cannot be read here (use dumps/loads, whose files "
                            "both read).")
        self._init()
        self._install_values(tree.double().numpy())
        mp = state_dict["_max_priority"]
        self._max_priority = (None, None) if mp is None else tuple(mp)

    def _install_values(self, values: np.ndarray) -> None:
        """Store tree values ``(p + eps) ** alpha`` as they are (0: no item)."""
        if values.shape != (self._max_capacity,):
            raise RuntimeError(f"PrioritizedSampler: {values.shape[0]} stored priorities, "
                               f"expected max_capacity={self._max_capacity}.")
        values = np.where(np.isfinite(values) & (values > 0), values, 0.0).astype(np.float32)
        self._state = _core.set_tree_values(self._state, np.arange(self._max_capacity), values)

    def dumps(self, path) -> None:
        write_priority_files(path, self.tree_values(), self._max_priority, self._alpha,
                             self._beta, self._eps, self._max_capacity, self._SCHEMA)

    def loads(self, path) -> None:
        loaded = read_priority_files(path, self._max_capacity, self._alpha, self._eps)
        self._beta = loaded.beta
        self._init()
        self._install_values(loaded.values)
        mp = loaded.max_priority
        if loaded.schema < 1 and mp[0] is not None and self._max_priority_within_buffer and \
                self._alpha != 0:
            self._recompute_max()
        else:
            self._max_priority = mp

    def __getstate__(self):
        import multiprocessing.context as mpc
        if mpc.get_spawning_popen() is not None:
            raise RuntimeError(
                f"Samplers of type {type(self).__name__} cannot be shared between processes: "
                "their priorities live in this process. Use "
                "TensorDictPrioritizedReplayBuffer(sync=False) (or PrioritizedReplayBuffer("
                "sync=False)) over a LazyMemmapStorage instead: the workers get a uniform "
                "sampler and write, this process keeps the priorities.")
        return super().__getstate__()

    def __repr__(self):
        return (f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, "
                f"eps={self._eps}, reduction={self.reduction})")


def _read_json(file: Path) -> dict:
    try:
        return json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} does not exist: not a sampler dump.") from None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{file} is damaged (not valid JSON: {e}).") from None


# TorchRL's prioritized-sampler files: ``sumtree.memmap`` and ``mintree.memmap`` (float64
# ``[max_capacity]``: each item's ``(p + eps) ** alpha`` by TorchRL's flat index; slots without
# an item hold 0 in the sum tree and float32's largest value, the compiled min tree's identity,
# in the min tree) and ``sampler_metadata.json`` (alpha, beta, eps, the raw max priority and its
# index, the capacity, the schema version).
def write_priority_files(path, values: np.ndarray, max_priority: tuple, alpha: float,
                         beta: float, eps: float, capacity: int, schema: int) -> None:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    values = np.asarray(values, np.float64)
    big = float(torch.finfo(torch.float32).max)
    values.tofile(path / "sumtree.memmap")
    np.where(values > 0, values, big).tofile(path / "mintree.memmap")
    mp = [None if v is None else float(v) for v in max_priority]
    meta = {"_alpha": alpha, "_beta": beta, "_eps": eps, "_max_priority": mp,
            "_max_capacity": float(capacity), "_schema_version": schema}
    with open(path / "sampler_metadata.json", "w") as f:
        json.dump(meta, f)


class LoadedPriorities(NamedTuple):
    values: np.ndarray    # float64 [capacity], re-expressed with the loading sampler's alpha
    max_priority: tuple   # (raw max priority or None, its index or None)
    beta: float
    schema: int


def read_priority_files(path, capacity: int, alpha: float, eps: float) -> LoadedPriorities:
    """The files :func:`write_priority_files` (or TorchRL) wrote, checked against
    ``capacity``; values stored with another alpha / eps are re-expressed with ours (TorchRL's
    rule: each raw priority is recovered, then re-weighted)."""
    path = Path(path).absolute()
    meta = _read_json(path / "sampler_metadata.json")
    cap = int(meta["_max_capacity"])
    if cap != capacity:
        raise RuntimeError(f"loads: the dumped prioritized sampler has max_capacity {cap}, this "
                           f"one {capacity} ({path / 'sampler_metadata.json'}).")
    values = _read_values(path / "sumtree.memmap", cap)
    a0, e0 = float(meta["_alpha"]), float(meta["_eps"])
    if (a0, e0) != (alpha, eps):
        values = _reweight(values, a0, e0, alpha, eps)
    mp = meta.get("_max_priority") or [None, None]
    return LoadedPriorities(values, (mp[0], None if mp[1] is None else int(mp[1])),
                            float(meta["_beta"]), int(meta.get("_schema_version", 0)))


def _reweight(values: np.ndarray, a0: float, e0: float, alpha: float, eps: float):
    if a0 == 0:
        if alpha != 0:
            warnings.warn("loads: the dump was made with alpha=0, which stores 1.0 for every "
                          "item: the raw priorities cannot be recovered, so sampling stays "
                          "uniform until priorities are updated (TorchRL does the same).")
        return values
    with np.errstate(all="ignore"):
        raw = np.maximum(np.where(values > 0, values, 0.0) ** (1.0 / a0) - e0, 0.0)
        return np.where(values > 0, (raw + eps) ** alpha, 0.0)


def _read_values(file: Path, n: int) -> np.ndarray:
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist: not a prioritized sampler dump.")
    values = np.fromfile(file, dtype=np.float64)
    if values.size != n:
        raise RuntimeError(f"loads: {file} holds {values.size} values, expected {n} "
                           "(max_capacity); the file is truncated or from another sampler.")
    return values
