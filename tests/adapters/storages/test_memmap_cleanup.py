"""``LazyMemmapStorage``'s scratch directory: ``cleanup()`` and ``auto_cleanup`` as in TorchRL (a
chosen directory kept by default, a temporary one removed with the storage), never by another
process's copy, and at exit or on SIGTERM / SIGINT when asked."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pytest
from _hang import HANG_S

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402


def test_memmap_cleanup_matches_torchrl(tmp_path):
    for L in (T, A):
        st = L.LazyMemmapStorage(8, scratch_dir=tmp_path / L.__name__)
        rb = L.ReplayBuffer(storage=st, batch_size=2)
        rb.extend(TensorDict({"x": torch.ones(3)}, [3]))
        assert (tmp_path / L.__name__).exists()
        assert st.cleanup() is True and not (tmp_path / L.__name__).exists()
        assert st.cleanup() is False
    rb = A.ReplayBuffer(storage=A.LazyMemmapStorage(8), batch_size=2)  # a temporary directory
    rb.extend(TensorDict({"x": torch.ones(3)}, [3]))
    path = rb.storage.scratch_dir
    del rb
    gc.collect()
    assert not os.path.exists(path)  # auto_cleanup: the default for a temporary directory


def _fill(storage):
    rb = A.ReplayBuffer(storage=storage)
    rb.extend(TensorDict(a=torch.randn(10), batch_size=[10]))
    return rb


def test_memmap_cleanup_and_auto_cleanup(tmp_path):
    mine = tmp_path / "mine"
    st = A.LazyMemmapStorage(100, scratch_dir=mine, auto_cleanup=True)
    _fill(st)
    assert any(mine.iterdir())
    assert st.cleanup() is True and not mine.exists() and st.cleanup() is False
    kept = tmp_path / "kept"
    st = A.LazyMemmapStorage(100, scratch_dir=kept)  # a chosen directory: kept by default
    _fill(st)
    del st
    gc.collect()
    assert any(kept.iterdir())
    st = A.LazyMemmapStorage(100)  # a temporary one: removed with the storage
    _fill(st)
    temp = st.scratch_dir
    assert os.path.isdir(temp)
    del st
    gc.collect()
    assert not os.path.exists(temp)
    assert A.LazyMemmapStorage(100, auto_cleanup=True).cleanup() is False  # never written
    with pytest.raises(TypeError, match="auto_cleanup"):
        A.LazyMemmapStorage(10, auto_cleanup="yes")


def _clean_up_and_collect(storage):
    storage.cleanup()  # (explicitly, then at collection and exit: none of them may remove)
    del storage
    gc.collect()


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_memmap_cleanup_in_another_process_removes_nothing(tmp_path, how):
    st = A.LazyMemmapStorage(100, scratch_dir=tmp_path / "m", auto_cleanup=True)
    _fill(st)
    proc = mp.get_context(how).Process(target=_clean_up_and_collect, args=(st,))
    proc.start()
    proc.join(HANG_S)
    assert proc.exitcode == 0 and (tmp_path / "m").exists()
    assert st.cleanup() is True and not (tmp_path / "m").exists()  # the creator removes


_SCRIPT = """
import signal, sys, time, torch
signal.signal(signal.SIGINT, signal.default_int_handler)
from tensordict import TensorDict
from functional_rb.adapters import LazyMemmapStorage, ReplayBuffer
st = LazyMemmapStorage(100, scratch_dir=sys.argv[1], auto_cleanup=sys.argv[2] == "1")
ReplayBuffer(storage=st).extend(TensorDict(a=torch.randn(10), batch_size=[10]))
print("READY", flush=True)
if sys.argv[3] == "wait":
    while True:
        time.sleep(0.05)
"""
# The child stands for a program run in the foreground, where Ctrl+C raises KeyboardInterrupt:
# it sets Python's SIGINT handler itself, since a test run started as a shell's background job
# hands its children SIGINT ignored, and Python keeps it ignored (the signal would then be lost
# and the child would run on until the test's timeout).
# The child waits until the signal ends it (so that its exit shows the signal was handled), in
# short sleeps: a signal sent to the process may land on any of its threads (torch's and JAX's
# pools too), and Python runs its handler only when the main thread next checks, which one long
# sleep would not do until it ended.


@pytest.mark.parametrize("end", ["exit", "sigterm", "sigint"])
def test_memmap_auto_cleanup_at_exit_and_on_signals(tmp_path, end):
    for auto in ("1", "0"):
        where = tmp_path / f"{end}{auto}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(where), auto, "exit" if end == "exit" else "wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert "READY" in proc.stdout.readline()
            if end != "exit":
                proc.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGINT)
            proc.wait(HANG_S)
        finally:
            proc.kill()
            proc.communicate()
        assert where.exists() == (auto == "0"), (end, auto)
