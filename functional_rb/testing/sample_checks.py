"""What a sample must look like, given the reference model (used by ``ReplayBufferMachine``).

Every sampler: shapes and dtypes, indices in range and pointing at stored items, data equal to
the stored items, weights finite and 0 where masked, a masked-out sample when nothing can be
drawn. The built-in samplers (matched by exact type, so a subclass of your own only gets the
generic rules) also get their documented semantics, restated from the reference model:

* ``RandomSampler``: every draw valid, weight 1;
* ``SamplerWithoutReplacement``: no item twice within an epoch, padding only at the end;
* ``PrioritizedSampler``: weights ``(min_j v_j / v_i) ** beta`` from the reference values;
* slice samplers: each slice is consecutive stored steps of one trajectory, of length
  ``min(slice_len, steps left in the trajectory)`` (``slice_len`` with ``strict_length``),
  padded at the end by repeating its last index; the slice end is marked under
  ``truncated_key`` (and its sibling ``done``), OR-ed with the stored flag; without
  replacement no trajectory twice within an epoch; prioritized starts are valid starts and
  their weights come from the reference priorities.
"""

from __future__ import annotations

import jax
import numpy as np

import functional_rb as frb
from functional_rb.testing import reference as ref
from functional_rb.testing._data import item_key, key_of, norm_key

_KINDS = {
    frb.RandomSampler: "random",
    frb.SamplerWithoutReplacement: "wor",
    frb.PrioritizedSampler: "per",
    frb.SliceSampler: "slice",
    frb.SliceSamplerWithoutReplacement: "slice_wor",
    frb.PrioritizedSliceSampler: "pslice",
}
_SLICES = ("slice", "slice_wor", "pslice")


def _rule(name: str, detail: str):
    raise AssertionError(f'rule "{name}" is broken: {detail}')


class SampleChecker:
    """Checks the samples of one buffer of the machine's population."""

    def __init__(self, rb, layout):
        self.rb, self.lay = rb, layout
        self.kind = _KINDS.get(type(rb.sampler))
        self.epoch, self.drawn = None, set()

    # ------------------------------------------------------------------ reference facts
    def _slice_len(self, state) -> int:
        s = self.rb.sampler
        if self.kind == "pslice":
            return int(state.sampler.slice_len)
        return s.slice_len if s.slice_len is not None else self.rb.batch_size // s.num_slices

    def _steps(self, mem, paths):
        """Per stored position ``(row, k, traj start position, steps left, first)`` from the
        reference ring (``k``: index in the row, oldest first), and the rows' positions."""
        s = self.rb.sampler
        by_ids = s.traj_key is not None
        at = paths.index(norm_key(s.traj_key if by_ids else s.end_key))
        stored = mem.writer.stored()
        rows = mem.writer.rows_in_order()
        info = {}
        for e, pos in enumerate(rows):
            leaves = [stored[int(p)][1][at] for p in pos]
            signal = np.array(
                [
                    np.asarray(x).reshape(-1)[0] if by_ids else bool(np.asarray(x).any())
                    for x in leaves
                ]
            )
            lengths = ref.trajectories(signal, by_ids)
            rem, first = ref.remaining_steps(lengths)
            start = 0
            for n in lengths:
                for j in range(start, start + n):
                    info[int(pos[j])] = (e, j, int(pos[start]), int(rem[j]), bool(first[j]))
                start += n
        return info, rows

    def _valid_starts(self, info, length: int) -> dict:
        strict = self.rb.sampler.strict_length
        return {
            p: rem >= length or (first and not strict) for p, (_, _, _, rem, first) in info.items()
        }

    def expected_can_sample(self, state, mem, paths=None):
        """What ``can_sample`` must say, from the reference (None: no opinion)."""
        size = int(self.rb.size(state))
        k, s, bs = self.kind, self.rb.sampler, self.rb.batch_size
        if k == "random":
            return size > 0
        if k == "wor":
            return size >= bs if s.drop_last else size > 0
        if k == "per":
            stored = ref.stored_mask(self.rb, state)
            return size > 0 and bool((mem.priority.values(stored) > 0).any())
        if k in _SLICES and mem.kind == "fifo" and paths is not None:
            info, _ = self._steps(mem, paths)
            length = self._slice_len(state)
            if k == "pslice":
                return any(self._valid_starts(info, length).values())
            lens = {}
            for _, _, start, _, _ in info.values():
                lens[start] = lens.get(start, 0) + 1
            eligible = [n for n in lens.values() if n >= length or not s.strict_length]
            if k == "slice_wor" and s.drop_last:
                return len(eligible) >= bs // length
            return bool(eligible)
        return None

    # ------------------------------------------------------------------ checks
    def check(self, sample, before, after, mem, can: bool, paths, exact: bool) -> None:
        rb = self.rb
        idx, w, mask = (np.asarray(x) for x in (sample.indices, sample.weights, sample.mask))
        if (
            idx.dtype != np.int32
            or w.dtype != np.float32
            or mask.dtype != bool
            or not (idx.shape == w.shape == mask.shape)
            or idx.size != rb.batch_size
        ):
            _rule(
                "sample shapes and dtypes",
                f"indices {idx.dtype}{list(idx.shape)}, weights "
                f"{w.dtype}{list(w.shape)}, mask {mask.dtype}{list(mask.shape)}",
            )
        if idx.min() < 0 or idx.max() >= rb.capacity:
            _rule("indices in range", f"indices span [{idx.min()}, {idx.max()}]")
        stored = ref.stored_mask(rb, before)
        if np.any(mask & ~stored[idx]):
            _rule(
                "drawn items are stored",
                f"mask True at empty positions {sorted(set(idx[mask & ~stored[idx]].tolist()))}",
            )
        if not np.all(np.isfinite(w)) or np.any(w[~mask] != 0) or np.any(w[mask] <= 0):
            _rule("weights consistent with mask", f"weights {w.tolist()}, mask {mask.tolist()}")
        if not can:
            if mask.any():
                _rule(
                    "nothing to draw gives mask False",
                    "can_sample is False but the sample has valid entries",
                )
            return
        if not mask.any():
            _rule("can_sample agrees with sample", "can_sample is True, the mask all False")
        if self.kind in _SLICES and mem.kind == "fifo":
            self._check_slices(sample, idx, w, mask, before, mem, paths, exact)
        else:
            self._check_items(sample, idx, w, mask, before, mem, exact)
        self._check_epoch(idx, mask, after, mem, paths)

    def _expected_items(self, before, mem, positions):
        if mem.kind == "fifo":
            stored = mem.writer.stored()
            return [stored[int(p)][1] for p in positions]
        return ref.leaf_rows(ref.read(self.rb, before, np.asarray(positions, np.int32)))

    def _check_items(self, sample, idx, w, mask, before, mem, exact: bool) -> None:
        k, s = self.kind, self.rb.sampler
        if exact:
            data = ref.host(sample.data)
            rows = ref.leaf_rows(data)
            want = self._expected_items(before, mem, idx[mask])
            if any(
                item_key(a) != item_key(b)
                for a, b in zip([rows[i] for i in np.flatnonzero(mask)], want)
            ):
                _rule(
                    "sampled data are the stored items",
                    "a sampled row differs from the item stored at its index",
                )
        if k in ("random", "per") and not mask.all():
            _rule("every draw is valid", f"mask {mask.tolist()} although items can be drawn")
        if k in ("random", "wor") and np.any(w[mask] != 1):
            _rule("uniform weights are 1", f"weights {w.tolist()}")
        if k == "wor":
            n = int(mask.sum())
            if not mask[:n].all():
                _rule("padding only at the end", f"mask {mask.tolist()}")
        if k == "per":
            v = mem.priority.values(ref.stored_mask(self.rb, before)).astype(np.float64)
            want = (v[v > 0].min() / v[idx]) ** s.beta
            if not np.allclose(w, want, rtol=1e-5):
                _rule(
                    "prioritized weights",
                    f"weights {w.tolist()}, (min v / v_i) ** beta from "
                    f"the reference priorities: {want.tolist()}",
                )

    def _check_slices(self, sample, idx, w, mask, before, mem, paths, exact: bool) -> None:
        s = self.rb.sampler
        info, rows = self._steps(mem, paths)
        length = idx.shape[1]
        valid = self._valid_starts(info, length) if self.kind == "pslice" else None
        data = {
            key_of(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(ref.host(sample.data))[0]
        }
        marked = set()
        if s.truncated_key is not None:
            tk = norm_key(s.truncated_key)
            marked = {tk, tk[:-1] + ("done",)}
        stored = mem.writer.stored()
        for i in range(idx.shape[0]):
            n = int(mask[i].sum())
            if n == 0:
                continue
            if not mask[i, :n].all():
                _rule("slice padding only at the end", f"slice {i}: mask {mask[i].tolist()}")
            e, k, start, rem, _ = info[int(idx[i, 0])]
            want_pos = [int(rows[e][k + j]) if k + j < len(rows[e]) else -1 for j in range(n)]
            if (
                idx[i, :n].tolist() != want_pos
                or len({info[p][2] for p in want_pos if p in info}) != 1
            ):
                _rule(
                    "slices are consecutive steps of one trajectory",
                    f"slice {i}: indices "
                    f"{idx[i].tolist()}, the stored steps from its start are {want_pos}",
                )
            if n != min(length, rem) or (s.strict_length and n != length):
                _rule(
                    "slice length",
                    f"slice {i} has {n} valid steps; {rem} steps are left in "
                    f"its trajectory from its start, slice_len={length}, strict_length="
                    f"{s.strict_length}",
                )
            if np.any(idx[i, n:] != idx[i, n - 1]):
                _rule("slice padding repeats the last index", f"slice {i}: {idx[i].tolist()}")
            if valid is not None and not valid[int(idx[i, 0])]:
                _rule(
                    "prioritized slices start at valid starts",
                    f"slice {i} starts at "
                    f"{int(idx[i, 0])} with {rem} steps left (slice_len={length})",
                )
            if exact:
                self._check_slice_data(i, n, idx, data, paths, stored, marked)
        if self.kind == "pslice" and valid is not None:
            v = mem.priority.values(ref.stored_mask(self.rb, before)).astype(np.float64)
            starts = [p for p, ok in valid.items() if ok]
            vmin = v[starts].min()
            want = np.where(mask, ((vmin / v[idx[:, 0]]) ** s.beta)[:, None], 0.0)
            if not np.allclose(w, want, rtol=1e-5):
                _rule("prioritized weights", f"weights {w.tolist()}, expected {want.tolist()}")
        elif np.any(w[mask] != 1):
            _rule("uniform weights are 1", f"weights {w.tolist()}")

    @staticmethod
    def _check_slice_data(i, n, idx, data, paths, stored, marked) -> None:
        length = idx.shape[1]
        for a, path in enumerate(paths + [p for p in marked if p not in paths and p in data]):
            got = data[path][i]
            if path in marked:
                flag = np.zeros(got.shape, bool)
                if a < len(paths):
                    flag = np.stack(
                        [np.asarray(stored[int(idx[i, j])][1][a]) != 0 for j in range(length)]
                    ).reshape(got.shape)
                j = np.arange(length).reshape((length,) + (1,) * (got.ndim - 1))
                want = ((flag & (j < n)) | (j == n - 1)).astype(got.dtype)
                rule = "slice ends are marked"
            else:
                want = np.stack([np.asarray(stored[int(idx[i, j])][1][a]) for j in range(length)])
                rule = "sampled data are the stored items"
            if got.shape != want.shape or got.tobytes() != want.tobytes():
                _rule(rule, f"slice {i}, leaf {path}: got {got.tolist()}, expected {want.tolist()}")

    def _check_epoch(self, idx, mask, after, mem, paths) -> None:
        if self.kind not in ("wor", "slice_wor"):
            return
        epoch = int(after.sampler.epoch)
        if epoch != self.epoch:
            self.epoch, self.drawn = epoch, set()
        if self.kind == "wor":
            new = idx[mask].tolist()
        else:
            info, _ = self._steps(mem, paths)
            new = [info[int(p)][:1] + info[int(p)][2:3] for p in idx[mask[:, 0], 0]]
        if len(set(new)) != len(new) or set(new) & self.drawn:
            what = "item" if self.kind == "wor" else "trajectory (row, start)"
            _rule(
                "each element once per epoch",
                f"epoch {epoch}: a {what} among {new} was "
                f"drawn before in this epoch ({sorted(self.drawn)})",
            )
        self.drawn.update(new)
