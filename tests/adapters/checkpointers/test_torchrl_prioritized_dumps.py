"""Prioritized dumps both ways with TorchRL's own PrioritizedSampler code.

TorchRL's prioritized sampler keeps its priorities in compiled segment trees, and its compiled
extension does not load with this torch. Its Python code (dumps, loads, extend,
update_priority, sample) is run here over a NumPy stand-in for those trees that implements the
four operations TorchRL calls (``[]``, ``[]=``, ``query``, ``scan_lower_bound``) with the
compiled trees' semantics. What is checked is the file format: TorchRL's ``dumps`` writes
files our ``loads`` reads, and the reverse, with every item's stored priority value equal.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from _torchrl_trees import patch_torchrl_trees
from tensordict import TensorDict

import functional_rb.adapters as A

warnings.filterwarnings("ignore", module="torchrl")
T = pytest.importorskip("torchrl.data")
tprio = pytest.importorskip("torchrl.data.replay_buffers.samplers.prioritized")


class _Tree:
    """NumPy segment tree with the compiled trees' Python API (leaves only: queries scan)."""

    def __init__(self, size, dtype, identity, op):
        self.v = np.full(int(size), identity, dtype)
        self.op = op

    @staticmethod
    def _idx(index):
        if isinstance(index, torch.Tensor):
            return index.cpu().numpy()
        return np.asarray(index) if not isinstance(index, (int, np.integer)) else int(index)

    def __getitem__(self, index):
        out = self.v[self._idx(index)]
        return float(out) if np.ndim(out) == 0 else out

    def __setitem__(self, index, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        self.v[self._idx(index)] = value

    def query(self, start, end):
        return float(self.op(self.v[int(start) : int(end)]))

    def scan_lower_bound(self, values):  # first index whose prefix sum is >= value
        if isinstance(values, torch.Tensor):
            values = values.cpu().numpy()
        cs = np.cumsum(self.v.astype(np.float64))
        idx = np.searchsorted(cs, np.asarray(values, np.float64), side="left")
        return np.where(np.asarray(values) > cs[-1], self.v.size, idx).astype(np.int64)


@pytest.fixture
def torchrl_trees(monkeypatch):
    patch_torchrl_trees(monkeypatch, tprio, _Tree, np.sum, np.min)


CAP = 24


def _data(n, ndim):
    t = torch.arange(n)
    td = TensorDict(
        {
            "obs": t.float()[:, None].expand(n, 3).clone(),
            "ep": t // 6,
            ("next", "done"): (t % 6 == 5)[:, None],
            ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
        },
        [n],
    )
    return td.reshape(2, n // 2) if ndim == 2 else td


def _sampler(L, kind, alpha=0.7, eps=1e-6):
    if kind == "plain":
        return L.PrioritizedSampler(CAP, alpha=alpha, beta=0.5, eps=eps)
    return L.PrioritizedSliceSampler(
        CAP, alpha=alpha, beta=0.5, eps=eps, slice_len=3, traj_key="ep", truncated_key=None
    )


def _buffer(L, kind, ndim, alpha=0.7, eps=1e-6):
    return L.TensorDictReplayBuffer(
        storage=L.LazyTensorStorage(CAP, ndim=ndim),
        sampler=_sampler(L, kind, alpha, eps),
        batch_size=6,
    )


def _our_values(rb, index):
    """Our stored (p + eps) ** alpha at TorchRL indices (``[N]`` or ``[N, 2]`` (t, env))."""
    values = rb.sampler.tree_values()  # by TorchRL's flat index
    idx = np.asarray(index).reshape(len(index), -1)
    if idx.shape[1] == 2:
        return values[idx[:, 0] * rb.storage.shape[1] + idx[:, 1]]
    return values[idx[:, 0]]


def _theirs_flat(rb, index):
    idx = np.asarray(index).reshape(len(index), -1)
    if idx.shape[1] == 2:
        return idx[:, 0] * rb.storage.shape[1] + idx[:, 1]  # raveled over [time, env]
    return idx[:, 0]


CASES = [("plain", 1), ("plain", 2), ("slice", 1)]


def _filled_with_priorities(L, kind, ndim, lo, hi):
    """A full buffer of library ``L`` whose sampled items got priorities ``lo..hi``; returns
    ``(buffer, index)``, ``index`` as ``update_priority`` takes it."""
    rb = _buffer(L, kind, ndim)
    rb.extend(_data(CAP, ndim))
    index = rb.sample(return_info=True)[1]["index"]
    index = torch.stack(index, -1) if isinstance(index, tuple) else index
    rb.update_priority(index, torch.linspace(lo, hi, len(index)))
    return rb, index


def _every_item(ndim):
    """TorchRL's index of every stored item, in its flat order."""
    i = np.arange(CAP)
    return np.stack([i // 2, i % 2], -1) if ndim == 2 else i


@pytest.mark.parametrize("kind, ndim", CASES)
def test_torchrl_prioritized_dump_loads_here(torchrl_trees, kind, ndim, tmp_path):
    """TorchRL's dump (its own dumps code) loads with every item's priority, not the max."""
    theirs, index = _filled_with_priorities(T, kind, ndim, 0.5, 9.0)
    theirs.dumps(tmp_path / "t")
    assert (tmp_path / "t" / "sampler" / "sumtree.memmap").exists()

    ours = _buffer(A, kind, ndim)
    ours.loads(tmp_path / "t")
    flat = _theirs_flat(theirs, index)
    tree = theirs._sampler._sum_tree.v
    # every stored item: the value TorchRL stored, bit for bit (float32)
    np.testing.assert_array_equal(_our_values(ours, _every_item(ndim)), tree.astype(np.float32))
    assert len(set(tree[flat].tolist())) > 1  # the updated items differ from each other
    mp = theirs._sampler._max_priority[0]
    assert float(ours.sampler.default_priority) == pytest.approx(float(mp))
    s, info = ours.sample(return_info=True)
    assert torch.all(info["priority_weight"] > 0)


@pytest.mark.parametrize("kind, ndim", CASES)
def test_our_prioritized_dump_loads_in_torchrl(torchrl_trees, kind, ndim, tmp_path):
    """Our dump, read by TorchRL's loads: its trees hold our values, its max priority ours."""
    ours, _ = _filled_with_priorities(A, kind, ndim, 0.25, 4.0)
    ours.dumps(tmp_path / "o")
    meta = json.loads((tmp_path / "o" / "sampler" / "sampler_metadata.json").read_text())
    assert meta["_schema_version"] == 1 and meta["_max_capacity"] == CAP

    theirs = _buffer(T, kind, ndim)
    theirs.loads(tmp_path / "o")
    np.testing.assert_array_equal(
        theirs._sampler._sum_tree.v.astype(np.float32), _our_values(ours, _every_item(ndim))
    )
    np.testing.assert_array_equal(theirs._sampler._min_tree.v, theirs._sampler._sum_tree.v)
    assert theirs._sampler.default_priority == pytest.approx(4.0)
    assert theirs.sample(return_info=True)[1]["priority_weight"].gt(0).all()


def test_partly_filled_dump_and_min_tree_identity(torchrl_trees, tmp_path):
    """Slots that hold no item: 0 in the sum tree and the float32 max in the min tree, as
    TorchRL's compiled trees have them; they load as empty (never drawn)."""
    theirs = _buffer(T, "plain", 1)
    theirs.extend(_data(CAP, 1)[:10])
    theirs.dumps(tmp_path / "t")
    ours = _buffer(A, "plain", 1)
    ours.extend(_data(CAP, 1)[:10])
    ours.dumps(tmp_path / "o")
    for name in ("sumtree.memmap", "mintree.memmap"):
        assert (tmp_path / "t" / "sampler" / name).read_bytes() == (
            tmp_path / "o" / "sampler" / name
        ).read_bytes(), name
    back = _buffer(A, "plain", 1)
    back.loads(tmp_path / "t")
    leaves = back.sampler.tree_values()
    assert (leaves[10:] == 0).all() and (leaves[:10] > 0).all()


def test_other_alpha_takes_the_dumps_and_bad_files_raise(torchrl_trees, tmp_path):
    """A dump made with another alpha/eps loads as TorchRL's ``loads`` does: alpha, beta and
    eps become the dump's and the values are kept as they are. Files that disagree with the
    buffer (another capacity, a short tree file) are refused by name."""
    theirs = _buffer(T, "plain", 1, alpha=0.5, eps=1e-3)
    theirs.extend(_data(CAP, 1))
    raw = torch.linspace(0.1, 5.0, CAP)
    theirs.update_priority(torch.arange(CAP), raw)
    theirs.dumps(tmp_path / "t")
    ours = _buffer(A, "plain", 1, alpha=0.9, eps=1e-6)
    ours.loads(tmp_path / "t")
    assert (ours.sampler.alpha, ours.sampler.eps) == (0.5, 1e-3)
    np.testing.assert_array_equal(
        ours.sampler.tree_values(), theirs._sampler._sum_tree.v.astype(np.float32)
    )

    meta_file = tmp_path / "t" / "sampler" / "sampler_metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(dict(meta, _max_capacity=CAP + 6)))
    with pytest.raises(RuntimeError, match="max_capacity 30, this one 24"):
        _buffer(A, "plain", 1).loads(tmp_path / "t")
    meta_file.write_text(json.dumps(meta))
    tree_file = tmp_path / "t" / "sampler" / "sumtree.memmap"
    tree_file.write_bytes(tree_file.read_bytes()[:-8])
    with pytest.raises(RuntimeError, match="holds 23 values, expected 24"):
        _buffer(A, "plain", 1).loads(tmp_path / "t")


def test_alpha_zero_dump_loads_with_alpha_zero(torchrl_trees, tmp_path):
    """alpha=0 stores 1.0 for every item; loading adopts alpha=0 (TorchRL's ``loads``), so
    sampling stays uniform until priorities are updated."""
    theirs = _buffer(T, "plain", 1, alpha=0.0)
    theirs.extend(_data(CAP, 1))
    theirs.update_priority(torch.arange(CAP), torch.linspace(0.1, 5.0, CAP))
    theirs.dumps(tmp_path / "t")
    ours = _buffer(A, "plain", 1, alpha=0.7)
    ours.loads(tmp_path / "t")
    assert ours.sampler.alpha == 0.0
    np.testing.assert_array_equal(ours.sampler.tree_values(), np.ones(CAP))
