"""Huge pages for the adapters' tensors (adapters/storages/_hugepages.py) and NumPy sum trees.

What the kernel records is read from ``/proc/self/smaps`` (``hg`` in the mapping's
``VmFlags``); those checks run where transparent huge pages are ``madvise`` or ``always`` and
skip, saying why, elsewhere. Tensors here are above the 32 MiB threshold: glibc maps each one
on its own, so a tensor never lands in memory an earlier test advised and "not advised" can
be checked in this process.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from functional_rb._internal import pages
from functional_rb.adapters import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    TensorStorage,
)
from functional_rb.adapters.samplers._trees import SumSegmentTree
from functional_rb.adapters.storages._hugepages import advise_tensors, advised

THP = pages.thp_mode()
needs_thp = pytest.mark.skipif(
    THP not in ("madvise", "always"),
    reason=f"transparent huge pages are {THP!r} here (need 'madvise' or 'always' to see the "
    "kernel record the advice)",
)

ROWS = 600_000  # x 16 float32: 38 MB, above the 32 MiB threshold


@pytest.fixture(autouse=True)
def _follow_environment(monkeypatch):
    """Each test starts with huge pages on, decided by an unset FRB_HUGEPAGES."""
    monkeypatch.delenv(pages.ENV, raising=False)
    previous = pages.set_enabled(None)
    yield
    pages.set_enabled(previous)


def _extend(storage, n=1000, seed=0):
    rb = ReplayBuffer(storage=storage, batch_size=32)
    g = torch.Generator().manual_seed(seed)
    rb.extend(
        TensorDict(
            {"obs": torch.randn(n, 16, generator=g), "act": torch.randint(0, 4, (n,), generator=g)},
            [n],
        )
    )
    return rb


# ------------------------------------------------------------------ what the kernel records
@needs_thp
@pytest.mark.parametrize("consolidated", [False, True])
def test_lazy_tensor_storage_is_advised_at_its_first_write(consolidated):
    rb = _extend(LazyTensorStorage(ROWS, consolidated=consolidated))
    obs = rb.storage.data["obs"]
    assert obs.untyped_storage().nbytes() >= pages.MIN_BYTES
    assert advised(obs) is True
    g = torch.Generator().manual_seed(0)
    torch.testing.assert_close(obs[:1000], torch.randn(1000, 16, generator=g))
    assert rb.sample()["obs"].shape == (32, 16)


@needs_thp
def test_a_pytree_storage_and_a_given_tensor_storage_are_advised():
    rb = ReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=8)
    rb.extend({"obs": torch.ones(10, 16), "small": torch.ones(10)})
    assert advised(rb.storage.data["obs"]) is True
    # 2.4 MB: left alone, below the threshold
    assert advise_tensors({"x": torch.empty(ROWS)}) == 0
    given = torch.zeros(ROWS, 16)
    storage = TensorStorage(given)
    assert advised(given) is True and storage.get(torch.tensor([3]))[0].sum() == 0


@needs_thp
def test_lazy_memmap_storage_maps_are_advised(tmp_path):
    storage = LazyMemmapStorage(ROWS, scratch_dir=tmp_path / "rb", auto_cleanup=True)
    rb = _extend(storage)
    obs = rb.storage.data["obs"]
    try:
        if advised(obs) is not True:
            if not pages.advise_range(obs.untyped_storage().data_ptr(), obs.nbytes):
                pytest.skip("the kernel refuses MADV_HUGEPAGE for file mappings here")
            pytest.fail("LazyMemmapStorage did not advise its maps, though the kernel takes it")
        assert rb.sample()["obs"].shape == (32, 16)
    finally:
        storage.cleanup()


@needs_thp
def test_shared_memory_is_advised_only_where_dev_shm_takes_huge_pages(monkeypatch):
    rb = _extend(LazyTensorStorage(ROWS))
    before = rb.storage.data["obs"][:1000].clone()
    rb.storage.share_memory_()
    obs = rb.storage.data["obs"]
    assert obs.is_shared()
    torch.testing.assert_close(obs[:1000], before)
    expected = pages.shared_mode() in ("always", "within_size", "advise")
    assert advised(obs) is expected, pages.shared_mode()
    # a /dev/shm that takes advice: the same tensors are advised (madvise records it)
    monkeypatch.setattr(pages, "shared_mode", lambda: "advise")
    assert advise_tensors(rb.storage.data, shared=True) > 0
    assert advised(obs) is True


@needs_thp
@pytest.mark.skipif(
    not np._core.multiarray._get_madvise_hugepage(),
    reason="NumPy's own huge-page advice is off in this process "
    "(NUMPY_MADVISE_HUGEPAGE=0, or a kernel older than 4.6)",
)
def test_numpy_sum_trees_come_out_advised_by_numpy_itself():
    sampler = PrioritizedSampler(ROWS, alpha=0.7, beta=0.5)
    for tree in (sampler._sum_tree, sampler._min_tree, SumSegmentTree(ROWS, np.float64)):
        assert tree.values.nbytes >= 4 << 20
        assert pages.advised_range(tree.values.ctypes.data, tree.values.nbytes) is True
    # and the copy a prioritized slice sampler keeps (StartTree): NumPy's copies too
    copy = sampler._sum_tree.values.copy()
    assert pages.advised_range(copy.ctypes.data, copy.nbytes) is True


# ------------------------------------------------------------------ off, and the results
# "Not advised" is checked in a fresh process: in this one, a large tensor may be carved from
# a part of glibc's heap that NumPy's own advice (every NumPy array of 4 MiB or more) already
# marked, so its mapping can carry "hg" whatever the adapters did.
_OFF = f"""
import sys, torch
from tensordict import TensorDict
from functional_rb._internal import pages
from functional_rb.adapters import LazyTensorStorage, ReplayBuffer
from functional_rb.adapters.storages._hugepages import advise_tensors, advised
if sys.argv[1] == "switch":
    pages.set_enabled(False)
rb = ReplayBuffer(storage=LazyTensorStorage({ROWS}), batch_size=32)
rb.extend(TensorDict({{"obs": torch.zeros(1000, 16)}}, [1000]))
print(advise_tensors(rb.storage.data, fresh=True), advised(rb.storage.data["obs"]))
"""


@pytest.mark.parametrize("how", ["environment", "switch"])
def test_off_leaves_the_tensors_unadvised(how):
    env = {k: v for k, v in os.environ.items() if k != pages.ENV}
    if how == "environment":
        env[pages.ENV] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _OFF, how], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    advised_count, flag = out.stdout.split()
    assert advised_count == "0"
    if THP in ("madvise", "always"):
        assert flag == "False"


def test_samples_are_the_same_with_and_without_huge_pages():
    def run(on):
        pages.set_enabled(on)
        rb = _extend(LazyTensorStorage(ROWS), n=5000)
        torch.manual_seed(3)
        return [rb.sample() for _ in range(3)], rb.storage.data["obs"]

    on, obs_on = run(True)
    off, obs_off = run(False)
    for a, b in zip(on, off):
        assert (a == b).all()
    if THP in ("madvise", "always"):  # (off: test_off_leaves_the_tensors_unadvised)
        assert advised(obs_on) is True


def test_madvise_failures_and_odd_leaves_fall_back_silently(monkeypatch):
    monkeypatch.setattr(pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(pages, "_madvise_fn", lambda: lambda *a: -1)
    odd = {
        "obs": torch.empty(ROWS, 16),
        "meta": "not a tensor",
        "sparse": torch.zeros(3, 3).to_sparse(),
        "meta_device": torch.empty(3, device="meta"),
    }
    assert advise_tensors(odd) == 0
    rb = _extend(LazyTensorStorage(ROWS))
    assert rb.sample()["obs"].shape == (32, 16)
    monkeypatch.setattr(pages, "thp_mode", lambda: "never")
    calls = []
    monkeypatch.setattr(pages, "_madvise", lambda *a: calls.append(a) or True)
    assert advise_tensors(torch.empty(ROWS, 16), fresh=True) == 0 and calls == []


_NO_JAX = """
import ctypes, mmap, sys
from functional_rb._internal import pages
buf = mmap.mmap(-1, 40 << 20)  # anonymous and private, like a fresh torch.empty
address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
done = pages.advise_range(address, len(buf), zeroed=True)
print(done > 0, pages.advised_range(address, len(buf)), sorted(pages.report())[0],
      sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "torch")))
"""


def test_the_kernel_side_the_adapters_call_imports_no_jax():
    # what advise_tensors runs at a first write (its own module imports torch and this one
    # only); that importing and using the adapters imports no JAX is checked by
    # tests/integration/test_structure.py
    out = subprocess.run(
        [sys.executable, "-c", _NO_JAX],
        env={k: v for k, v in os.environ.items() if k != pages.ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    on = str(THP in ("madvise", "always"))
    assert out.stdout.split() == [on, on, "anon_huge_pages_kib", "[]"], out.stdout


def test_a_lazy_stack_is_advised_through_its_members_without_stacking():
    # TorchRL's test_extend_lazystack: members of different shapes cannot be stacked, and
    # reading a lazy stack's leaves would try (a copy at best)
    from tensordict import LazyStackedTensorDict

    big = TensorDict({"obs": torch.zeros(ROWS, 16)}, [ROWS])
    ragged = LazyStackedTensorDict.lazy_stack(
        [TensorDict({"obs": torch.zeros(3, 2)}, []), TensorDict({"obs": torch.zeros(4, 2)}, [])]
    )
    assert advise_tensors(ragged) == 0  # small members, and no error
    stacked = LazyStackedTensorDict.lazy_stack([big, big.clone()])
    expected = 2 * advise_tensors(big) if THP in ("madvise", "always") else 0
    assert advise_tensors(stacked) == expected
    rb = ReplayBuffer(storage=LazyMemmapStorage(10), batch_size=2)
    rb.extend(LazyStackedTensorDict.lazy_stack([TensorDict({"obs": torch.zeros(2)}, [])] * 4))
    assert len(rb) == 4
