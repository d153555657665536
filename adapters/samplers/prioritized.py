"""TorchRL's ``PrioritizedSampler`` over a NumPy port of TorchRL's segment trees, and
TorchRL's prioritized-sampler files (shared with the prioritized slice sampler).

Same seed, same draws: a sample asks the generator exactly what TorchRL's does. With the
buffer's ``generator=`` that is ``torch.rand(batch_size, generator=g) * p_sum``; with none,
TorchRL draws ``np.random.uniform(0.0, p_sum, size=batch_size)`` from NumPy's global
generator (not torch's), and so does this sampler: seed it with ``np.random.seed`` (torch's
global generator is left untouched). The masses then walk TorchRL's tree
(:mod:`functional_rb.adapters.samplers._trees`) with its float32 / float64 sums, so the
indices are TorchRL's.
"""

from __future__ import annotations

import json
import warnings
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from functional_rb.adapters.samplers._trees import MinSegmentTree, SumSegmentTree
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, Sampler, ravel, unravel

__all__ = ["PrioritizedSampler", "LoadedPriorities", "read_priority_files", "write_priority_files"]


class PrioritizedSampler(Sampler):
    """Proportional prioritized sampling (TorchRL's ``PrioritizedSampler``) over TorchRL's
    segment trees (ported to NumPy: ``_sum_tree`` / ``_min_tree`` have the compiled trees'
    API and float semantics).

    Item ``i`` (TorchRL's flat index: ``t * n + env`` for ``ndim=2``) is drawn with probability
    ``(p_i + eps) ** alpha / sum_j (p_j + eps) ** alpha``; ``info["priority_weight"]`` is
    ``(p_min / p_i) ** beta`` over the stored items. New items get the largest priority seen
    (1.0 before any), or with ``max_priority_within_buffer`` the largest still stored.
    Priorities must be finite and >= 0: others raise.

    Seeded draws are TorchRL's: from the buffer's ``generator`` when it has one, else from
    NumPy's global generator (``np.random.seed``), not torch's. One difference: with a
    ``generator`` and ``dtype=torch.float64``, TorchRL's compiled tree rejects the float32
    masses ``torch.rand`` gives; here they are searched as float64.

    Args:
      max_capacity: the trees' size. It may differ from the storage's: as in TorchRL,
        indices up to the tree's padded size (``max_capacity`` rounded up past a power of
        two) are kept, larger ones raise ``IndexError``.
      alpha: the priority exponent (0: uniform).
      beta: the importance-weight exponent.
      eps: added to every priority.
      dtype: the trees' dtype, ``torch.float32`` or ``torch.float64``.
      reduction: how a priority with several elements per item is reduced (``"max"``,
        ``"min"``, ``"sum"``, ``"mean"`` or ``"median"``).
      max_priority_within_buffer: new items get the largest priority still stored, not the
        largest ever seen.
      device: TorchRL's device of the trees; the NumPy trees live on the host.

    Example:
        >>> import numpy as np, torch
        >>> from functional_rb.adapters import (LazyTensorStorage, PrioritizedSampler,
        ...                                     ReplayBuffer)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4,
        ...                   sampler=PrioritizedSampler(10, alpha=1.0, beta=0.5))
        >>> index = rb.extend(torch.arange(4.0))
        >>> rb.update_priority(torch.arange(4), torch.tensor([0.0, 0.0, 0.0, 1.0]))
        >>> np.random.seed(0)  # without a generator=, TorchRL's prioritized draws use NumPy's
        >>> rb.sample()
        tensor([3., 3., 3., 3.])
    """

    _SCHEMA = 1
    prioritized = True

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
    ):
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        if reduction not in ("max", "min", "sum", "mean", "median"):
            raise ValueError(
                f"PrioritizedSampler: reduction must be one of max, min, sum, "
                f"mean, median; got {reduction!r}."
            )
        self._max_capacity = int(max_capacity)
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.dtype, self.reduction = dtype, reduction
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self._device = None if device is None else torch.device(device)
        self._init()

    def _init(self) -> None:
        dtype = _tree_dtype(self.dtype)
        self._sum_tree = SumSegmentTree(self._max_capacity, dtype)
        self._min_tree = MinSegmentTree(self._max_capacity, dtype)
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
        if old == value or not written.size:
            return
        if old == 0:
            warnings.warn(
                "Changing alpha away from 0 cannot recover the raw priorities "
                "(alpha == 0 stores 1.0 for every item); sampling stays uniform "
                "until priorities are updated.",
                stacklevel=2,
            )
            return
        raw = np.maximum(values[written].astype(np.float64) ** (1.0 / old) - self._eps, 0.0)
        new = (raw + self._eps) ** self._alpha  # float64, then the trees' dtype (TorchRL's)
        self._sum_tree[written] = new
        self._min_tree[written] = new

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        """Checked before it is kept, so a refused value leaves the sampler as it was."""
        if not np.isfinite(float(value)) or value < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={value}")
        self._beta = float(value)

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
        """``[max_capacity]`` in the trees' dtype: ``(p + eps) ** alpha`` of each item (0:
        none)."""
        return self._sum_tree.leaves(self._max_capacity)

    def _flat(self, index, storage) -> torch.Tensor:
        """Flat tree positions (long ``[N]``) of TorchRL-style indices; -1 kept."""
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, dtype=torch.long).detach().cpu()
        if index.ndim > 1:
            if storage is None:
                raise RuntimeError(
                    "storage should be provided to Sampler.update_priority when "
                    "the storage has more than one dimension."
                )
            index = ravel(index, storage.shape)
        return index.reshape(-1)

    @torch.no_grad()
    def update_priority(self, index, priority, *, storage=None) -> None:
        """Set the priorities of ``index`` (TorchRL's indices; -1 entries are skipped). The
        stored value is ``torch.pow(priority + eps, alpha)`` computed in the priority's own
        dtype, then cast to the trees' (as TorchRL computes it)."""
        index = self._flat(index, storage)
        priority = torch.as_tensor(priority).detach().cpu()
        if not priority.is_floating_point():
            priority = priority.to(torch.get_default_dtype())
        if priority.numel() > 1 and priority.numel() != index.numel():
            raise RuntimeError(
                "priority should be a number or an iterable of the same length "
                f"as index. Got priority of shape {tuple(priority.shape)} and "
                f"index {tuple(index.shape)}."
            )
        priority = (
            priority.reshape(-1).expand(index.shape)
            if priority.numel() == 1
            else priority.reshape(-1)
        )
        keep = index >= 0
        if not bool(keep.all()):
            index, priority = index[keep], priority[keep]
        if index.numel() == 0:
            return
        self._check(index, priority)
        imax = int(torch.argmax(priority))
        mp, _ = self._max_priority
        if mp is None or float(priority[imax]) > mp:
            self._max_priority = (float(priority[imax]), int(index[imax]))
        value = torch.pow(priority + self._eps, self._alpha)
        self._sum_tree[index] = value
        self._min_tree[index] = value
        if (
            self._max_priority_within_buffer
            and self._alpha != 0
            and bool((index == self._max_priority[1]).any())
        ):
            self._recompute_max()

    def _check(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        bad = ~torch.isfinite(priority) | (priority < 0)
        if bool(bad.any()):
            i = int(torch.argmax(bad.to(torch.uint8)))
            raise ValueError(
                f"PrioritizedSampler.update_priority: priority "
                f"{float(priority[i])!r} at index {int(index[i])} is not a finite "
                f"number >= 0 ({int(bad.sum())} bad); pass e.g. td_error.abs()."
            )
        top = int(index.max())
        if top >= self._sum_tree.capacity:
            raise IndexError(
                f"PrioritizedSampler.update_priority: index {top} is outside the "
                f"sampler's tree (max_capacity={self._max_capacity}, "
                f"{self._sum_tree.capacity} slots with TorchRL's padding); build "
                "the sampler with max_capacity at least the storage's size."
            )

    def _recompute_max(self) -> None:
        """The raw max priority from the trees (TorchRL's ``_tree_argmax`` and inversion)."""
        values = torch.from_numpy(self.tree_values())
        maxval, maxidx = values.max(0)
        if maxval <= 0:
            self._max_priority = (None, None)
            return
        raw = (maxval ** (1.0 / self._alpha) - self._eps).clamp_min(0)
        self._max_priority = (float(raw), int(maxidx))

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
    def _masses(self, batch_size: int, p_sum: float):
        """TorchRL's draw: ``torch.rand`` with the generator, else NumPy's global one."""
        if self.rng is None:
            return np.random.uniform(0.0, p_sum, size=batch_size)
        return torch.rand(batch_size, generator=self.rng) * p_sum

    def _draw(self, n: int, batch_size: int):
        """``(index long [B], weight [B])`` over the first ``n`` slots (TorchRL's sample)."""
        p_sum = self._sum_tree.query(0, n)
        p_min = self._min_tree.query(0, n)
        if p_sum <= 0:
            raise RuntimeError(
                "non-positive p_sum: every stored item has priority 0 (set "
                "positive priorities with update_priority)."
            )
        if p_min <= 0:
            raise RuntimeError("non-positive p_min: an item has priority 0 with alpha > 0.")
        index = torch.from_numpy(self._sum_tree.scan_lower_bound(self._masses(batch_size, p_sum)))
        index.clamp_max_(n - 1)
        weight = self._sum_tree[index]
        zero = weight == 0  # a mass past the stored items: step back to one (TorchRL's walk)
        while bool(zero.any()):
            index = torch.where(zero, index - 1, index)
            if bool((index < 0).any()):
                raise RuntimeError("Failed to find a suitable index")
            weight = self._sum_tree[index]
            zero = weight == 0
        return index, torch.pow(weight / p_min, -self._beta)

    def sample(self, storage, batch_size: int):
        n = len(storage)
        if n == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        index, weight = self._draw(n, batch_size)
        if storage.ndim > 1:
            index = unravel(index, storage.shape)
        return index, {"priority_weight": weight}

    def _empty(self) -> None:
        self._init()

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """TorchRL's entries; the trees as float64 tensors of their leaves (TorchRL's are
        compiled objects, which ``load_state_dict`` also reads)."""
        return {
            "_schema_version": self._SCHEMA,
            "_alpha": self._alpha,
            "_beta": self._beta,
            "_eps": self._eps,
            "_max_priority": self._max_priority,
            "_sum_tree": torch.from_numpy(self.tree_values().astype(np.float64)),
            "_min_tree": torch.from_numpy(
                self._min_tree.leaves(self._max_capacity).astype(np.float64)
            ),
        }

    def load_state_dict(self, state_dict) -> None:
        """Restores alpha, beta, eps, the max priority and the trees, as TorchRL's: a payload
        without ``_schema_version`` (TorchRL before pytorch/rl#3925 stored the transformed
        value there) gets its max priority recomputed from the trees."""
        self._alpha, self._beta = float(state_dict["_alpha"]), float(state_dict["_beta"])
        self._eps = float(state_dict["_eps"])
        self._init()
        self._install_values(
            _leaves_of(state_dict["_sum_tree"], self._max_capacity),
            _leaves_of(state_dict.get("_min_tree"), self._max_capacity),
        )
        mp = state_dict["_max_priority"]
        mp = (None, None) if mp is None else tuple(mp)
        self._max_priority = tuple(
            None if v is None else (float(v) if i == 0 else int(v)) for i, v in enumerate(mp)
        )
        self._maybe_recompute_legacy_max(state_dict.get("_schema_version", 0))

    def _maybe_recompute_legacy_max(self, version) -> None:
        if (
            int(version) < 1
            and self._max_priority_within_buffer
            and self._max_priority[0] is not None
            and self._alpha != 0
        ):
            self._recompute_max()

    def _install_values(self, values: np.ndarray, mins: np.ndarray | None = None) -> None:
        """Load leaves ``(p + eps) ** alpha`` as they are (0: no item); the min tree from
        ``mins`` (TorchRL's file) or from the values."""
        if values.shape != (self._max_capacity,):
            raise RuntimeError(
                f"PrioritizedSampler: {values.shape[0]} stored priorities, "
                f"expected max_capacity={self._max_capacity}."
            )
        values = np.where(np.isfinite(values) & (values > 0), values, 0.0)
        if mins is None or mins.shape != values.shape:
            mins = np.where(values > 0, values, self._min_tree.identity_element)
        self._sum_tree.load_leaves(values)
        self._min_tree.load_leaves(np.minimum(mins, self._min_tree.identity_element))

    def dumps(self, path) -> None:
        write_priority_files(
            path,
            self.tree_values(),
            self._max_priority,
            self._alpha,
            self._beta,
            self._eps,
            self._max_capacity,
            self._SCHEMA,
            mins=self._min_tree.leaves(self._max_capacity),
        )

    def loads(self, path) -> None:
        """TorchRL's ``loads``: alpha, beta and eps are the dump's, the trees its values."""
        loaded = read_priority_files(path, self._max_capacity)
        self._alpha, self._beta, self._eps = loaded.alpha, loaded.beta, loaded.eps
        self._init()
        self._install_values(loaded.values, loaded.mins)
        self._max_priority = loaded.max_priority
        self._maybe_recompute_legacy_max(loaded.schema)

    def __getstate__(self):
        # (a module-level name, as TorchRL's: tests patch it to stand for a spawn)
        if get_spawning_popen() is not None:
            raise RuntimeError(
                f"Samplers of type {type(self).__name__} cannot be shared between processes: "
                "their priorities live in this process. Use "
                "TensorDictPrioritizedReplayBuffer(sync=False) (or PrioritizedReplayBuffer("
                "sync=False)) over a LazyMemmapStorage instead: the workers get a uniform "
                "sampler and write, this process keeps the priorities."
            )
        return super().__getstate__()

    def __repr__(self):
        return (
            f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, "
            f"eps={self._eps}, reduction={self.reduction})"
        )


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
def write_priority_files(
    path,
    values: np.ndarray,
    max_priority: tuple,
    alpha: float,
    beta: float,
    eps: float,
    capacity: int,
    schema: int,
    mins: np.ndarray | None = None,
) -> None:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    values = np.asarray(values, np.float64)
    big = float(torch.finfo(torch.float32).max)
    values.tofile(path / "sumtree.memmap")
    mins = (
        np.where(values > 0, values, big)
        if mins is None
        else np.minimum(np.asarray(mins, np.float64), big)
    )
    mins.tofile(path / "mintree.memmap")
    mp = [None if v is None else float(v) for v in max_priority]
    meta = {
        "_alpha": alpha,
        "_beta": beta,
        "_eps": eps,
        "_max_priority": mp,
        "_max_capacity": float(capacity),
        "_schema_version": schema,
    }
    with open(path / "sampler_metadata.json", "w") as f:
        json.dump(meta, f)


class LoadedPriorities(NamedTuple):
    values: np.ndarray  # float64 [capacity]: the sum tree's leaves as dumped
    mins: np.ndarray | None  # float64 [capacity]: the min tree's leaves (None: no file)
    max_priority: tuple  # (raw max priority or None, its index or None)
    alpha: float
    beta: float
    eps: float
    schema: int


def read_priority_files(path, capacity: int) -> LoadedPriorities:
    """The files :func:`write_priority_files` (or TorchRL) wrote, checked against
    ``capacity``. As TorchRL's ``loads``, the values are taken as they are, with the dump's
    alpha, beta and eps."""
    path = Path(path).absolute()
    meta = _read_json(path / "sampler_metadata.json")
    cap = int(meta["_max_capacity"])
    if cap != capacity:
        raise RuntimeError(
            f"loads: the dumped prioritized sampler has max_capacity {cap}, this "
            f"one {capacity} ({path / 'sampler_metadata.json'})."
        )
    values = _read_values(path / "sumtree.memmap", cap)
    mins = (
        _read_values(path / "mintree.memmap", cap) if (path / "mintree.memmap").exists() else None
    )
    mp = meta.get("_max_priority") or [None, None]
    return LoadedPriorities(
        values,
        mins,
        (mp[0], None if mp[1] is None else int(mp[1])),
        float(meta["_alpha"]),
        float(meta["_beta"]),
        float(meta["_eps"]),
        int(meta.get("_schema_version", 0)),
    )


def _leaves_of(tree, n: int) -> np.ndarray | None:
    """float64 ``[n]`` leaves of a state_dict's tree entry: a tensor of values (ours) or a
    tree object with TorchRL's ``tree[indices]`` (TorchRL's compiled trees, ours)."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return tree.detach().double().cpu().numpy().reshape(-1)[:n]
    if hasattr(tree, "__getitem__"):
        return np.asarray(tree[np.arange(n, dtype=np.int64)], np.float64).reshape(-1)
    raise TypeError(
        f"PrioritizedSampler.load_state_dict: a tree entry must be a tensor of "
        f"leaf values or a segment tree, got {type(tree).__name__}."
    )


def _tree_dtype(dtype) -> type:
    if dtype in (torch.float, torch.float32, "float", "float32", np.float32):
        return np.float32
    if dtype in (torch.double, torch.float64, "double", "float64", np.float64):
        return np.float64
    raise NotImplementedError(
        f"dtype {dtype} not supported by PrioritizedSampler (use torch.float32 or torch.float64)."
    )


def _read_values(file: Path, n: int) -> np.ndarray:
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist: not a prioritized sampler dump.")
    values = np.fromfile(file, dtype=np.float64)
    if values.size != n:
        raise RuntimeError(
            f"loads: {file} holds {values.size} values, expected {n} "
            "(max_capacity); the file is truncated or from another sampler."
        )
    return values
