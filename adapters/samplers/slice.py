"""Slice samplers under TorchRL's names, drawing what TorchRL's draw.

The sampler keeps a host copy of the boundary signal of every stored step (the OR of the end
keys, or the trajectory ids), updated as steps are written (the storage is re-read only when
it changed otherwise). A sample rebuilds TorchRL's list of stored trajectories from it
(:func:`find_bounds`, TorchRL's rule, below and written once: ``find_start_stop_traj`` and
the trajectory queries of :mod:`functional_rb.adapters.boundaries` use it too; only after a
write) and asks the
generator exactly what TorchRL's ``SliceSampler`` asks: ``torch.randint(n_trajectories,
(num_slices,))`` then ``torch.rand(num_slices)`` for the starts, with the same shapes, dtypes
and order, so the same ``torch.manual_seed`` / ``generator=`` gives the same slices and leaves
the generator in the same state. The result is TorchRL's flat sample with its markers
(``truncated`` / ``done`` / ``terminated`` at slice ends, ``is_init`` at slice starts).

The signal: ``traj_key`` when given; ``end_key`` / ``end_keys`` when given; otherwise, as in
TorchRL, ``("collector", "traj_ids")`` or ``"episode"`` when the storage holds one, else
``("next", "done")``. A key missing from the storage falls back to the other kind.

The markers, TorchRL's, say in a sample's ``info`` what each sampled step is: ``truncated`` is
True at each slice's last valid step, ``done`` is the stored done OR truncated, ``terminated``
the stored flag (or False); ``init_key`` is True at each slice start, OR-ed with the stored flag
(only when the storage has one: a missing flag is not invented).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from functional_rb._internal.span import normalize_span
from functional_rb.adapters import errors
from functional_rb.adapters.samplers._fragments import (
    FragmentIndex,
    check_fragmented_args,
    check_fragmented_storage,
    draw_in_runs,
)
from functional_rb.adapters.samplers.base import EMPTY_STORAGE_ERROR, Sampler

__all__ = ["SliceSampler", "find_bounds", "windows"]

SLICE_TRAJ_KEYS = (("collector", "traj_ids"), ("episode",))
"""Where TorchRL's slice samplers look for trajectory ids when given no key, in order."""


# ------------------------------------------------------------------------------ TorchRL's rule
def find_bounds(sig: np.ndarray, *, by_id: bool, at_capacity: bool, cursor=None) -> tuple:
    """``(start_t, env, stop_t, lengths)``, int64 ``[N]`` each, in TorchRL's order, of the
    trajectories in ``sig`` (``[L, E]``: ids, or end flags, of stored rows ``0..L-1``;
    ``cursor``: the row written last, for a full storage)."""
    rows = sig.shape[0]
    if rows == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty
    if by_id:
        end = np.empty(sig.shape, bool)
        np.not_equal(sig[:-1], sig[1:], out=end[:-1])
        end[-1] = (sig[-1] != sig[0]) if at_capacity else True
    else:
        end = sig.astype(bool, copy=True)
        if not at_capacity:
            end[rows - 1] = True
    if at_capacity:
        if cursor is not None:
            end[int(cursor)] = True
        end[rows - 1, ~end.any(0)] = True
    env, stop_t = np.nonzero(end.T)
    n = stop_t.size
    start_t = np.empty(n, np.int64)
    start_t[1:] = stop_t[:-1] + 1
    first = np.ones(n, bool)
    first[1:] = env[1:] != env[:-1]
    last = np.ones(n, bool)
    last[:-1] = first[1:]
    start_t[first] = stop_t[last] + 1  # a column's first trajectory follows its last end
    start_t %= rows
    lengths = stop_t - start_t + 1
    lengths[lengths <= 0] += rows
    return start_t, env.astype(np.int64), stop_t.astype(np.int64), lengths


def windows(lengths: torch.Tensor, seq_length: int, strict_length: bool) -> int:
    """How many slices of ``seq_length`` steps the trajectories of ``lengths`` hold (TorchRL's
    count: with ``strict_length=False`` a shorter trajectory counts once)."""
    w = lengths - seq_length + 1
    w = w.clamp_min(0) if strict_length else torch.where(lengths > 0, w.clamp_min(1), 0)
    return int(w.sum())


def _key(k):
    """A key as a tuple (None kept)."""
    if k is None:
        return None
    return (k,) if isinstance(k, str) else tuple(k)


def _out_key(k: tuple):
    """A tuple key as TorchRL spells it: a plain string when it has one part."""
    return k[0] if len(k) == 1 else k


def _slice_markers(storage, index, mask: np.ndarray, keep, truncated_key, init_key) -> dict:
    """The markers (see the module) of slices at storage ``index`` (as a sampler returns it),
    ``mask`` bool ``[num_slices, width]`` (False: padding), ``keep`` the flat positions of
    ``mask`` the index holds (``slice(None)``: all)."""
    nxt = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
    last = torch.from_numpy((mask & ~nxt).reshape(-1)[keep].copy())
    first = np.zeros_like(mask)
    first[:, 0] = True
    first = torch.from_numpy(first.reshape(-1)[keep].copy())
    data = getattr(storage, "data", None)
    if not is_tensor_collection(data):
        data = None

    def read(key):  # only the entries the markers use: the sample's other entries are read
        value = None if data is None else data.get(key, None)  # once, by the buffer
        return None if value is None else value[index]

    info: dict[Any, Any] = {}
    if truncated_key is not None:
        tk = _key(truncated_key)
        truncated = last.unsqueeze(-1)
        done_key, term_key = tk[:-1] + ("done",), tk[:-1] + ("terminated",)
        done = read(_out_key(done_key))
        done = (
            truncated.clone()
            if done is None
            else done | truncated.reshape(truncated.shape + (1,) * (done.ndim - 2))
        )
        term = read(_out_key(term_key))
        info[_out_key(tk)] = truncated
        info[_out_key(done_key)] = done
        info[_out_key(term_key)] = torch.zeros_like(truncated) if term is None else term
    if init_key is not None:
        stored = read(init_key)
        if stored is not None:
            info[init_key] = stored | first.reshape(first.shape + (1,) * (stored.ndim - 1)).to(
                stored.dtype
            )
    return info


class SliceSampler(Sampler):
    """Contiguous slices of stored trajectories (TorchRL's ``SliceSampler``).

    A sample of ``batch_size`` steps holds ``num_slices`` slices of ``slice_len`` steps, laid
    end to end (``[num_slices * slice_len]``), each within one trajectory. The trajectories are
    found from a boundary signal of the stored steps: ``traj_key`` when given; ``end_key`` /
    ``end_keys`` when given; otherwise, as in TorchRL, ``("collector", "traj_ids")`` or
    ``"episode"`` when the storage holds one, else ``("next", "done")``.

    Args:
      num_slices: slices per batch (the slice length is ``batch_size // num_slices``);
        exactly one of ``num_slices`` and ``slice_len``.
      slice_len: steps per slice (the batch holds ``batch_size // slice_len`` slices).
      end_key: the per-step end-of-trajectory flag (default ``("next", "done")``).
      end_keys: several end flags, OR-ed (exclusive with ``end_key``).
      traj_key: the per-step trajectory id; a trajectory ends where it changes.
      step_key: with ``fragmented``, each step's number within its trajectory.
      fragmented: trajectories whose steps are interleaved in storage (several workers
        writing one buffer) are put back in order by their id (``traj_key``) and step number
        (``step_key``), and slices are drawn within runs of consecutive steps, as TorchRL's;
        one-dimensional storages, without ``span``, ``ends`` or ``trajectories``.
      ends: static end flags of the storage's rows, instead of a stored entry (with
        ``cache_values=True``).
      trajectories: static trajectory ids of the storage's rows (with ``cache_values=True``).
      cache_values: required by ``ends`` / ``trajectories``, as in TorchRL; otherwise
        accepted: the signal is kept up to date as steps are written.
      truncated_key: where ``info`` (and a TensorDict sample) marks each slice's last step;
        ``done`` and ``terminated`` markers are written beside it.
      init_key: where each slice's first step is marked (OR-ed with a stored flag).
      strict_length: only trajectories of at least the slice length are drawn; False:
        shorter ones come back shorter.
      pad_output: with ``strict_length=False``, short slices are padded by repeating their
        last step, with a mask under ``("collector", "mask")`` when the batch has padding.
      compile: TorchRL's ``torch.compile`` option; accepted, nothing to compile here.
      span: slices may hang over their trajectory's start and end and come back shorter:
        ``True`` keeps at least one step, an int ``i`` at least ``slice_len - i``, as TorchRL's
        formula gives (with the right span ``True``, a slice drawn at its trajectory's end has
        no step, as in TorchRL); a pair ``(left, right)`` sets each side.
      use_gpu: TorchRL's option to find trajectories on a GPU; accepted.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from functional_rb.adapters import (LazyTensorStorage, SliceSampler,
        ...                                     TensorDictReplayBuffer)
        >>> done = torch.zeros(20, 1, dtype=torch.bool)
        >>> done[9] = done[19] = True  # two episodes of 10 steps
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=8,
        ...                             sampler=SliceSampler(slice_len=4))
        >>> index = rb.extend(TensorDict({"obs": torch.arange(20), ("next", "done"): done},
        ...                              [20]))
        >>> slices = rb.sample().reshape(2, 4)["obs"]
        >>> bool(((slices[:, 1:] - slices[:, :-1]) == 1).all())  # consecutive steps
        True
    """

    bounds_revision = 0  # counts the rebuilds of the trajectory list (derived caches key on it)

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: NestedKey | None = None,
        end_keys: Sequence[NestedKey] | None = None,
        traj_key: NestedKey | None = None,
        step_key: NestedKey = "step_count",
        fragmented: bool = False,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        cache_values: bool = False,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        strict_length: bool = True,
        pad_output: bool = False,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        use_gpu: bool | torch.device = False,
    ):
        if not ((num_slices is None) ^ (slice_len is None)):
            raise TypeError(
                "Either num_slices or slice_len must be not None, and not both. "
                f"Got num_slices={num_slices} and slice_len={slice_len}."
            )
        if end_key is not None and end_keys is not None:
            raise RuntimeError("`end_key` and `end_keys` are exclusive arguments.")
        if pad_output and strict_length:
            raise ValueError(
                "pad_output=True is incompatible with strict_length=True: padding "
                "only happens when short trajectories are kept."
            )
        span = normalize_span(type(self).__name__, span)
        if fragmented:
            check_fragmented_args(
                type(self).__name__,
                own_sample=type(self).sample is not SliceSampler.sample,
                step_key=step_key,
                ends=ends,
                trajectories=trajectories,
                span=span,
                compile=compile,
            )
        static = ends if ends is not None else trajectories
        if static is not None:
            if traj_key is not None or end_key is not None or end_keys is not None:
                raise RuntimeError(
                    "`ends`/`trajectories` and `end_key`, `end_keys` or "
                    "`traj_key` are exclusive arguments."
                )
            if ends is not None and trajectories is not None:
                raise RuntimeError("trajectories and ends are exclusive arguments.")
            if not cache_values:
                raise RuntimeError(
                    "To be used, ends/trajectories require `cache_values` to be set to `True`."
                )
        self.num_slices, self.slice_len = num_slices, slice_len
        self.end_keys = None if end_keys is None else tuple(_key(k) for k in end_keys)
        self.end_key = end_key  # as given (TorchRL keeps the spelling); _key() to use
        self.traj_key = traj_key
        self._auto = traj_key is None and end_key is None and end_keys is None and static is None
        if self.end_key is None and self.end_keys is None:
            self.end_key = ("next", "done")
        self.step_key, self.fragmented = step_key, bool(fragmented)
        self.truncated_key = truncated_key
        self.init_key = init_key
        self.strict_length, self.pad_output = bool(strict_length), bool(pad_output)
        self.cache_values, self.compile = cache_values, compile
        self.use_gpu, self.span = use_gpu, span
        self._static = (
            None
            if static is None
            else ("traj" if trajectories is not None else "end", torch.as_tensor(static))
        )
        self._signal = None  # "end" or "traj" once resolved
        self._sig = None  # numpy [rows, inner]: each stored step's end flag or id
        self._revision = None  # the storage revision the copy reflects
        self._bounds = None  # TorchRL's trajectories of the copy (None: to rebuild)
        self._fragments = None  # fragmented: the (trajectory, step) record of each row

    # ------------------------------------------------------------------ the signal
    def _resolve(self, storage) -> None:
        if self._signal is not None:
            return
        if self._static is not None:
            self._signal = self._static[0]
        elif self.traj_key is not None:
            self._signal = (
                "traj"
                if self._has(storage, self.traj_key)
                or not self._has_end(storage)
                or self.fragmented
                else "end"
            )
        elif self._auto:
            found = next((k for k in SLICE_TRAJ_KEYS if self._has(storage, k)), None)
            if found is not None:
                self.traj_key, self._signal = _out_key(found), "traj"
            else:
                self._signal = "end"
        else:
            self._signal = "end" if self._has_end(storage) or self.traj_key is None else "traj"

    @staticmethod
    def _has(storage, key) -> bool:
        data = getattr(storage, "data", None)
        if not is_tensor_collection(data):
            return False
        return _out_key(_key(key)) in data.keys(include_nested=True, leaves_only=True)

    def _has_end(self, storage) -> bool:
        keys = self.end_keys if self.end_keys is not None else (_key(self.end_key),)
        return any(self._has(storage, k) for k in keys)

    def _signal_rows(self, storage, rows: torch.Tensor) -> np.ndarray:
        """The boundary signal of dim-0 ``rows`` (in order): ``[n, *inner]`` numpy."""
        if self._static is not None:
            return self._static[1][rows].cpu().numpy()
        data = getattr(storage, "data", None)
        if not is_tensor_collection(data):
            raise RuntimeError(
                "Could not get a tensordict out of the storage, which is required "
                f"for SliceSampler to compute the trajectories: "
                f"{type(self).__name__} reads the trajectory signal from "
                f"TensorDict data; this {type(storage).__name__} holds "
                f"{type(data).__name__}. Use a LazyTensorStorage or "
                "LazyMemmapStorage, or pass ends=/trajectories=."
            )
        if self._signal == "traj":
            fix = (
                "Pass traj_key= naming the stored per-step trajectory id, or end_key= / "
                "end_keys= naming a stored end-of-trajectory flag (the end key "
                f"{self.end_keys or self.end_key!r} is not stored either)."
            )
            ids = errors.entry(
                data, self.traj_key, where=type(self).__name__, argument="traj_key", fix=fix
            )
            return ids[rows].cpu().numpy()
        keys = self.end_keys if self.end_keys is not None else (_key(self.end_key),)
        done = None
        for k in keys:
            v = data.get(_out_key(k), None)
            if v is None:
                continue
            v = v[rows].bool()
            done = v if done is None else done | v
        if done is None:
            raise KeyError(
                f"{type(self).__name__}: none of the end keys {list(keys)} is in the "
                "storage; pass end_key=, end_keys= or traj_key= naming the stored "
                "boundary signal."
            )
        return done.cpu().numpy()

    def _cut_holes(self, storage, rows: torch.Tensor, sig: np.ndarray) -> np.ndarray:
        """Rows a dead writer may have torn end their own one-step trajectory, and the row
        before them ends too, so no slice longer than one step reaches into them."""
        holes = storage.holes()
        if holes is None:
            return sig
        hole = holes[rows].numpy()
        if not hole.any():
            return sig
        sig = sig.copy()
        lead = (slice(None),) + (None,) * (sig.ndim - 1)
        if self._signal == "end":
            before = np.concatenate([hole[1:], [False]])
            return sig | (hole | before)[lead]
        ids = np.where(hole, -1 - np.arange(hole.size), 0)  # distinct ids: one step each
        return np.where(hole[lead], ids[lead], sig)

    def _reduce(self, storage, sig: np.ndarray, inner: int) -> np.ndarray:
        """``[n, inner]`` per step of ``sig`` ``[n, inner, ...]``: the end flag (one element
        per step, as TorchRL's squeezed signal), or the id (its first element)."""
        n = sig.shape[0]
        sig = sig.reshape((n, inner, -1))
        if self._signal == "traj":
            return sig[..., 0].astype(np.int64)
        if sig.shape[-1] != 1:
            raise RuntimeError(
                f"Expected the end-of-trajectory signal to be {storage.ndim}-dimensional. Got "
                f"a tensor with shape[1]={storage.ndim + 1} instead: {type(self).__name__} "
                f"needs one end flag per stored element, the storage holds {sig.shape[-1]}. "
                "Store the flag as [..., 1] or pass end_key= naming a per-step flag."
            )
        return sig[..., 0].astype(bool)

    # ------------------------------------------------------------------ records
    def _geometry(self, storage):
        rows = storage.max_size_along_dim0()
        inner = storage.row_numel() if hasattr(storage, "row_numel") else 1
        return rows, inner

    def _init_state(self, storage) -> None:
        rows, inner = self._geometry(storage)
        self._sig = np.zeros((rows, inner), bool if self._signal == "end" else np.int64)
        self._bounds = None
        if self.fragmented:
            self._fragments = FragmentIndex(self.traj_key, self.step_key, rows)

    def _ring(self, storage):
        """``(filled, cursor)``: stored rows and the next row the ring writes."""
        rows, _ = self._geometry(storage)
        filled = storage.len_along_dim0
        cursor = storage.next_row()
        return filled, cursor % rows

    def _add_rows(self, storage, first: int, n: int) -> None:
        rows, inner = self._geometry(storage)
        n = min(n, rows)
        t = (first + torch.arange(n)) % rows
        if self.fragmented:
            holes = storage.holes()
            self._fragments.write(storage, t, None if holes is None else holes[t].numpy())
            return
        sig = self._reduce(storage, self._signal_rows(storage, t), inner)
        self._sig[t.numpy()] = self._cut_holes(storage, t, sig)
        self._bounds = None

    def _rebuild(self, storage) -> None:
        """The signal of the whole storage, read again."""
        self._init_state(storage)
        rows, _ = self._geometry(storage)
        filled, cursor = self._ring(storage)
        if filled:
            self._add_rows(storage, cursor if filled == rows else 0, filled)
        self._revision = storage.revision

    def _sync(self, storage) -> None:
        if len(storage) == 0:
            raise RuntimeError(EMPTY_STORAGE_ERROR)
        self._resolve(storage)
        if self.fragmented:
            check_fragmented_storage(storage, by_id=self._signal == "traj")
        if self._static is not None:  # TorchRL's bounds of the given tensor, never the data
            return
        if self._sig is None or self._revision != storage.revision:
            self._rebuild(storage)

    def extend(self, index, *, storage=None) -> None:
        """Record the steps just written at ``index`` (the ring run a FIFO writer returns);
        anything else makes the next sample rebuild the records from the storage."""
        if (
            storage is None
            or self._sig is None
            or self._revision is None
            or storage.revision != self._revision + 1
        ):
            return
        rows_idx = (
            torch.as_tensor(index).reshape(-1)
            if storage.ndim == 1
            else torch.as_tensor(index)[:: storage.row_numel(), 0]
        )
        rows, _ = self._geometry(storage)
        first = int(rows_idx[0]) if rows_idx.numel() else 0
        run = (first + torch.arange(rows_idx.numel())) % rows
        if rows_idx.numel() == 0 or not torch.equal(rows_idx.cpu(), run):
            return
        n = rows_idx.numel()
        if n > rows:
            first = (first + n - rows) % rows
        try:
            self._add_rows(storage, first, n)
        except (KeyError, TypeError, ValueError, RuntimeError):
            if not self.fragmented:
                raise
            self._sig = None  # bad records: raised by the next sample, as TorchRL reads them there
            return
        self._revision = storage.revision

    add = extend

    def mark_update(self, index, *, storage=None) -> None:
        """In-place writes are seen through the storage's revision: nothing to do here."""
        del index, storage

    # ------------------------------------------------------------------ sample
    def _shape(self, batch_size: int) -> tuple:
        if self.num_slices is not None:
            if batch_size % self.num_slices:
                raise RuntimeError(
                    f"The batch-size must be divisible by the number of slices, "
                    f"got batch_size={batch_size} and num_slices="
                    f"{self.num_slices}."
                )
            return self.num_slices, batch_size // self.num_slices
        if batch_size % self.slice_len:
            raise RuntimeError(
                f"The batch-size must be divisible by the slice length, got "
                f"batch_size={batch_size} and slice_len={self.slice_len}."
            )
        return batch_size // self.slice_len, self.slice_len

    # ------------------------------------------------------------------ TorchRL's draw
    def _bounds_of(self, storage):
        """``(start long [N, 2] (t, env), stop long [N, 2], lengths long [N])``: TorchRL's
        trajectories, in its order (rebuilt only after a write)."""
        if self._bounds is None:
            if self._static is not None:
                sig = self._static[1].cpu().numpy()
                sig = sig.reshape(sig.shape[0], -1)
                b = find_bounds(
                    sig if self._signal == "traj" else sig.astype(bool),
                    by_id=self._signal == "traj",
                    at_capacity=True,
                )
            else:
                rows = storage.len_along_dim0
                # a full storage wraps only where its ring was written: one whose write
                # position is unknown (a dataset written whole) ends a trajectory at its last
                # row, so no slice joins its last row to its first
                cursor = None
                if storage.is_full and storage.last_cursor is not None:  # the row written last
                    cursor = (storage.next_row() - 1) % storage.max_size_along_dim0()
                b = find_bounds(
                    self._sig[:rows],
                    by_id=self._signal == "traj",
                    at_capacity=cursor is not None,
                    cursor=cursor,
                )
            start_t, env, stop_t, lengths = (torch.from_numpy(x) for x in b)
            self._bounds = (
                torch.stack([start_t, env], -1),
                torch.stack([stop_t, env], -1),
                lengths,
            )
            self.bounds_revision += 1
        return self._bounds

    def sampleable_count(self, storage, batch_size: int) -> int:
        if len(storage) == 0:
            return 0
        if self.fragmented:  # no trajectory id: 0; a broken record raises (as TorchRL)
            self._resolve(storage)
            if self._signal != "traj":
                return 0
            self._sync(storage)
            lengths = self._fragments.runs(len(storage))[2]
        else:
            try:
                self._sync(storage)
                _, _, lengths = self._bounds_of(storage)
            except (KeyError, RuntimeError):
                return 0
        _, seq = self._shape(batch_size)
        return windows(lengths, seq, self.strict_length)

    def sample(self, storage, batch_size: int):
        self._sync(storage)
        num_slices, seq = self._shape(batch_size)
        if self.fragmented:
            slots, offsets, lengths = self._fragments.runs(len(storage))
            starts, n = draw_in_runs(
                lengths, offsets, seq, num_slices, self.strict_length, self.rng
            )
            target = seq if self.pad_output and not self.strict_length else None
            return self._slices(storage, starts, None, n, target, slots=slots)
        start, _, lengths = self._bounds_of(storage)
        return self._sample_slices(storage, start, lengths, seq, num_slices)

    def _sample_slices(self, storage, start, lengths, seq, num_slices, traj_idx=None):
        """TorchRL's ``_sample_slices``: which trajectories (``torch.randint`` unless
        ``traj_idx`` is given), dropping those too short when ``strict_length``."""

        def draw(n):
            return torch.randint(n, (num_slices,), generator=self.rng)

        target = None
        if bool((lengths < seq).any()):
            if self.strict_length:
                ok = lengths >= seq
                if not bool(ok.any()):
                    raise RuntimeError(
                        "Did not find a single trajectory with sufficient length (length range:"
                        f" {int(lengths.min())} - {int(lengths.max())} / required={seq})). "
                        "Add longer trajectories, sample shorter slices, or pass "
                        "strict_length=False."
                    )
                lengths, start = lengths[ok], start[ok]
                if traj_idx is None:
                    traj_idx = draw(lengths.shape[0])
                else:  # the epoch's trajectories that are long enough, in order
                    keep = torch.zeros_like(ok)
                    keep[traj_idx] = True
                    traj_idx = keep[ok].nonzero().squeeze(-1)
                    if not traj_idx.numel():
                        raise RuntimeError(
                            "None of the provided indices pointed to a trajectory of "
                            "sufficient length. Consider using strict_length=False for the "
                            "sampler instead."
                        )
                    num_slices = traj_idx.shape[0]
            else:
                if traj_idx is None:
                    traj_idx = draw(lengths.shape[0])
                else:
                    num_slices = traj_idx.shape[0]
                target = seq if self.pad_output else None
                seq = lengths[traj_idx].clamp_max(seq)
        elif traj_idx is None:
            traj_idx = draw(lengths.shape[0])
        else:
            num_slices = traj_idx.shape[0]
        return self._get_index(storage, start, lengths, seq, num_slices, traj_idx, target)

    def _get_index(self, storage, start, lengths, seq, num_slices, traj_idx, target):
        """TorchRL's ``_get_index``: each slice's start, ``torch.rand(num_slices)`` scaled
        over the admissible starts (``span`` widens them), and its length."""
        length = lengths[traj_idx]
        left, right = self.span
        if right is False or right == 0:
            end_point = length - seq + 1
        elif right is True:
            end_point = length + 1
        else:
            if right >= seq:
                raise ValueError(
                    "The right and left span must be strictly lower than the sequence length"
                )
            end_point = length - right
        if left is False or left == 0:
            start_point = 0
        elif left is True:
            start_point = -seq + 1
        else:
            if left >= seq:
                raise ValueError(
                    "The right and left span must be strictly lower than the sequence length"
                )
            start_point = -left
        rel = (torch.rand(num_slices, generator=self.rng) * (end_point - start_point)).floor().to(
            torch.long
        ) + start_point
        if left:
            out = rel < 0
            if bool(out.any()):
                seq_t = torch.as_tensor(seq, dtype=rel.dtype)
                seq = torch.where(~out, seq_t, seq_t + rel)
                rel = torch.where(~out, rel, torch.zeros_like(rel))
        if right and bool((rel + seq > length).any()):
            seq = torch.minimum(torch.as_tensor(seq, dtype=rel.dtype), length - rel)
        t0 = start[traj_idx, 0] + rel
        return self._slices(storage, t0, start[traj_idx, 1], seq, target)

    def _slices(self, storage, t0, env, seq, target, weight=None, slots=None):
        """TorchRL's flat sample of slices starting at rows ``t0`` of columns ``env`` with
        ``seq`` steps (an int, or per slice), padded to ``target`` steps when given. With
        ``slots`` (fragmented), ``t0`` indexes ``slots``, the rows in trajectory order."""
        num = t0.shape[0]
        if isinstance(seq, int):
            width = seq
            seq = torch.full((num,), seq, dtype=torch.long)
        else:
            width = target if target is not None else max(int(seq.max()) if num else 0, 1)
        ar = torch.arange(width)
        mask = ar[None, :] < seq[:, None]
        t = t0[:, None] + torch.minimum(ar[None, :], (seq - 1).clamp_min(0)[:, None])
        t = t % storage.shape[0] if slots is None else slots[t]
        mask_np = mask.numpy()
        padded = not bool(mask.all())
        whole = target is not None or not padded
        keep = slice(None) if whole else mask_np.reshape(-1)
        keep_t = slice(None) if whole else mask.reshape(-1)
        t_flat = t.reshape(-1)[keep_t]
        if storage.ndim == 1:
            index = (t_flat,)
        else:  # env is a flat column over the trailing dims (ndim=3: [time, workers, envs])
            col = env[:, None].expand(num, width).reshape(-1)[keep_t]
            index = (t_flat, *torch.unravel_index(col, tuple(storage.shape[1:])))
        info = self._markers(storage, index, mask_np, keep)
        # nothing padded: no mask, as TorchRL (whose fragmented draw always gives one)
        if target is not None and (padded or slots is not None):
            info[("collector", "mask")] = mask.reshape(-1)
        if weight is not None:
            info["priority_weight"] = weight[:, None].expand(num, width).reshape(-1)[keep_t]
        return index, info

    def slice_info(self, storage, index, mask: np.ndarray) -> dict:
        """The info :meth:`sample` gives, for slices chosen by other means (a streaming
        sampler's queued windows): ``index`` as ``sample`` returns it (``(t,)`` or ``(t, env)``
        over ``num_slices * slice_len`` steps), ``mask`` bool ``[num_slices, slice_len]`` (all
        True for whole slices)."""
        info = self._markers(storage, index, mask, slice(None))
        if self.pad_output and not mask.all():  # nothing padded: no mask, as TorchRL
            info[("collector", "mask")] = torch.from_numpy(mask.reshape(-1).copy())
        return info

    def _markers(self, storage, index, mask: np.ndarray, keep) -> dict:
        return _slice_markers(storage, index, mask, keep, self.truncated_key, self.init_key)

    def _empty(self) -> None:
        self._sig = None
        self._fragments = None
        self._revision = None
        self._bounds = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict) -> None:
        self._empty()

    def __getstate__(self):
        state = super().__getstate__()
        state["_sig"] = None  # rebuilt from the storage where it lands
        state["_fragments"] = None
        state["_revision"] = None
        state["_bounds"] = None
        return state

    def __repr__(self):
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}"
            f", end_key={self.end_key}, traj_key={self.traj_key}, truncated_key="
            f"{self.truncated_key}, strict_length={self.strict_length})"
        )
