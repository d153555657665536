"""A LazyMemmapStorage-backed buffer extended from several worker processes loses no write.

TorchRL documents this use: build the buffer in the main process, hand it to
``multiprocessing`` workers that ``extend`` it, read everything back in the main process. The
same test runs against TorchRL itself (the reference, proving the test's logic) and against
``functional_rb.adapters``; the latter is skipped while this branch has no
``functional_rb.adapters.LazyMemmapStorage`` yet (it is built in the "adapters" branch).
"""
import multiprocessing as mp
import warnings

import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

WORKERS, CHUNKS, CHUNK = 3, 4, 5


def _chunk(wid, c):
    return tensordict.TensorDict({
        "wid": torch.full((CHUNK,), wid, dtype=torch.int64),
        "i": torch.arange(CHUNK, dtype=torch.int64) + c * CHUNK,
        "obs": torch.full((CHUNK, 2), float(wid)),
    }, batch_size=[CHUNK])


def _worker(rb, wid):
    for c in range(CHUNKS):
        rb.extend(_chunk(wid, c))


def _module(impl):
    if impl == "torchrl":
        return pytest.importorskip("torchrl.data")
    adapters = pytest.importorskip("functional_rb.adapters")
    if not hasattr(adapters, "LazyMemmapStorage") or \
            not hasattr(adapters, "TensorDictReplayBuffer"):
        pytest.skip("functional_rb.adapters.LazyMemmapStorage / TensorDictReplayBuffer are "
                    "not in this branch yet (helper 'adapters'); this test runs once merged.")
    return adapters


@pytest.mark.parametrize("impl", ["torchrl", "functional_rb"])
def test_extend_from_worker_processes_loses_no_write(tmp_path, impl):
    lib = _module(impl)
    total = 1 + WORKERS * CHUNKS * CHUNK
    rb = lib.TensorDictReplayBuffer(
        storage=lib.LazyMemmapStorage(total, scratch_dir=str(tmp_path / "rb")), batch_size=4)
    first = _chunk(-1, 0)[:1]
    rb.extend(first)  # the storage exists (files on disk) before it is shared
    if impl == "torchrl":
        # TorchRL's workers use torch only: fork is fine and fast.
        ctx = mp.get_context("fork")
    else:
        # Our buffer may run JAX in the workers, and JAX must not be forked after it started:
        # fork a fresh server that only imported the libraries, not this process.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tensordict", "functional_rb.adapters"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's "os.fork()" warning
        procs = [ctx.Process(target=_worker, args=(rb, w)) for w in range(WORKERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    assert len(rb) == total, f"{total - len(rb)} writes lost (len {len(rb)} of {total})"
    data = rb[:]
    pairs = sorted(zip(data["wid"].tolist(), data["i"].tolist()))
    want = sorted([(-1, 0)] + [(w, i) for w in range(WORKERS) for i in range(CHUNKS * CHUNK)])
    assert pairs == want, "some items were overwritten by a concurrent extend"
    assert torch.equal(data["obs"][:, 0], data["wid"].float())  # rows are whole items
