"""RemoteTensorDictReplayBuffer over ``torch.distributed.rpc``, beside TorchRL's own.

Local ranks on 127.0.0.1 (spawned processes): rank 0 hosts the buffers and does nothing else,
rank 1 is the trainer, ranks 2+ are collectors. The trainer builds two buffers on rank 0
through ``rpc.remote`` (ours and TorchRL's ``RemoteTensorDictReplayBuffer``, each on a
``LazyMemmapStorage``), tells the collectors to extend both with the same batches while it
extends them too and samples from them, all with TorchRL's calling convention
``rpc.rpc_async(rref.owner(), Node.extend, args=(rref, td))``. The buffer rank therefore runs
the calls of several ranks at once in its RPC threads. The parent process then checks that
every item arrived exactly once in both buffers, each in its own slot, that no sample saw a
half-written row, and that both buffers answer alike. The trainer also records what goes wrong
when a call is misdirected, for the parent to check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from _ranks import free_port
from tensordict import TensorDict
from torchrl.data.replay_buffers import RemoteTensorDictReplayBuffer as TorchRLRemote
from torchrl.data.replay_buffers.samplers import RandomSampler as TorchRLRandomSampler
from torchrl.data.replay_buffers.storages import LazyMemmapStorage as TorchRLMemmap

from functional_rb.adapters import (
    LazyMemmapStorage,
    PrioritizedSampler,
    RandomSampler,
    RemoteTensorDictReplayBuffer,
)

pytestmark = pytest.mark.skipif(
    not rpc.is_available(), reason="this torch build has no torch.distributed.rpc"
)

BUFFER, TRAINER = "BUFFER", "TRAINER"
WIDTH = 8  # columns of "twice": a row written in two halves would show a mismatch


class OurNode(RemoteTensorDictReplayBuffer):
    """The buffer rank's buffer, as TorchRL's test and example define theirs."""

    def __init__(self, capacity: int, scratch_dir: str):
        super().__init__(
            storage=LazyMemmapStorage(capacity, scratch_dir=scratch_dir, device="cpu"),
            sampler=RandomSampler(),
            collate_fn=lambda x: x,
        )

    def contents(self):
        """A subclass's own public method: it accepts the RRef too."""
        return self[: len(self)]


class TorchRLNode(TorchRLRemote):
    def __init__(self, capacity: int, scratch_dir: str):
        super().__init__(
            storage=TorchRLMemmap(capacity, scratch_dir=scratch_dir, device="cpu"),
            sampler=TorchRLRandomSampler(),
            collate_fn=lambda x: x,
        )

    def contents(self):
        return self[: len(self)]


class OurPrioritizedNode(RemoteTensorDictReplayBuffer):
    def __init__(self, capacity: int):
        super().__init__(
            storage=LazyMemmapStorage(capacity),
            sampler=PrioritizedSampler(capacity, alpha=1.0, beta=1.0),
        )


def _name(rank: int) -> str:
    return {0: BUFFER, 1: TRAINER}.get(rank, f"COLLECTOR{rank}")


def _batch(rank: int, k: int, size: int) -> TensorDict:
    """Batch ``k`` of a rank: ids unique over all ranks and batches."""
    ids = rank * 100_000 + k * size + torch.arange(size)
    return TensorDict(
        {
            "id": ids,
            "twice": (2 * ids).unsqueeze(-1).expand(size, WIDTH).float(),
            ("next", "obs"): ids.float().unsqueeze(-1),
        },
        [size],
    )


def _collect(ours, theirs, rank: int, n_batches: int, size: int) -> dict:
    """A rank's writes: every batch sent to both buffers at once, then all awaited (so the
    buffer rank handles them concurrently). Returns the indices each buffer gave back."""
    futures = []
    for k in range(n_batches):
        td = _batch(rank, k, size)
        futures.append(
            (
                rpc.rpc_async(ours.owner(), OurNode.extend, args=(ours, td)),
                rpc.rpc_async(theirs.owner(), TorchRLNode.extend, args=(theirs, td.clone())),
            )
        )
    return {
        "ours": torch.cat([f.wait() for f, _ in futures]),
        "torchrl": torch.cat([g.wait() for _, g in futures]),
    }


def _sample_both(ours, theirs, size: int) -> tuple:
    return (
        rpc.rpc_sync(ours.owner(), OurNode.sample, args=(ours, size)),
        rpc.rpc_sync(theirs.owner(), TorchRLNode.sample, args=(theirs, size)),
    )


def _faults(ours, theirs) -> dict:
    """What a misdirected call raises, as text: an RRef used off its owner, and a wrong
    argument raised on the buffer rank (the trainer sees the remote error)."""
    out = {}
    try:  # a call on the trainer itself: the buffer is not here
        OurNode.extend(ours, _batch(1, 999, 2))
    except RuntimeError as err:
        out["off_owner"] = str(err)
    for key, node, ref in (("ours", OurNode, ours), ("torchrl", TorchRLNode, theirs)):
        try:
            rpc.rpc_sync(ref.owner(), node.extend, args=(ref, torch.zeros(3)))
        except Exception as err:  # noqa: BLE001 - torch re-raises the remote type
            out[f"remote_{key}"] = f"{type(err).__name__}: {err}"
    return out


def _priorities(size: int) -> dict:
    """update_priority through the RRef: the one item given almost all the mass is drawn."""
    ref = rpc.remote(BUFFER, OurPrioritizedNode, args=(size,))
    td = _batch(1, 0, size)
    index = rpc.rpc_sync(ref.owner(), OurPrioritizedNode.extend, args=(ref, td))
    priority = torch.full((size,), 1e-6)
    priority[size - 1] = 100.0
    rpc.rpc_sync(ref.owner(), OurPrioritizedNode.update_priority, args=(ref, index, priority))
    torch.manual_seed(0)
    return {
        "prioritized_ids": rpc.rpc_sync(ref.owner(), OurPrioritizedNode.sample, args=(ref, 64))[
            "id"
        ],
        "prioritized_last": td["id"][-1],
    }


def _trainer(world_size: int, out_dir: Path, n_batches: int, size: int) -> None:
    capacity = world_size * n_batches * size  # every rank's writes fit: nothing is overwritten
    ours = rpc.remote(BUFFER, OurNode, args=(capacity, str(out_dir / "ours")))
    theirs = rpc.remote(BUFFER, TorchRLNode, args=(capacity, str(out_dir / "torchrl")))
    collectors = [
        rpc.rpc_async(_name(r), _collect, args=(ours, theirs, r, n_batches, size))
        for r in range(2, world_size)
    ]
    returned = [_collect(ours, theirs, 1, n_batches, size)]
    samples = {"ours": [], "torchrl": []}
    while not all(f.done() for f in collectors) or not samples["ours"]:
        a, b = _sample_both(ours, theirs, 16)  # while the collectors write
        samples["ours"].append(a)
        samples["torchrl"].append(b)
    returned += [f.wait() for f in collectors]
    result = {
        "sent": torch.cat(
            [_batch(r, k, size)["id"] for r in range(1, world_size) for k in range(n_batches)]
        ),
        "index_ours": torch.cat([r["ours"] for r in returned]),
        "index_torchrl": torch.cat([r["torchrl"] for r in returned]),
        # our subclass method through the class-function call; TorchRL's through the proxy
        "stored_ours": rpc.rpc_sync(ours.owner(), OurNode.contents, args=(ours,)).to_dict(),
        "stored_torchrl": theirs.rpc_sync().contents().to_dict(),
        "len_ours": rpc.rpc_sync(ours.owner(), OurNode.__len__, args=(ours,)),
        "len_torchrl": theirs.rpc_sync().__len__(),
        "sample_types": [type(s).__name__ for s in _sample_both(ours, theirs, 4)],
        "samples": {k: torch.cat(v).to_dict() for k, v in samples.items()},
        "sample_keys": [
            sorted(map(str, s.keys(True, True))) for s in _sample_both(ours, theirs, 4)
        ],
        "add": [
            rpc.rpc_sync(ours.owner(), OurNode.add, args=(ours, _batch(1, 0, 1)[0])),
            rpc.rpc_sync(theirs.owner(), TorchRLNode.add, args=(theirs, _batch(1, 0, 1)[0])),
        ],
        **_faults(ours, theirs),
        **_priorities(32),
    }
    torch.save(result, out_dir / "result.pt")


def _rank_main(
    rank: int, world_size: int, port: int, out_dir: Path, n_batches: int, size: int
) -> None:
    # Loopback only: the rendezvous and TensorPipe's own sockets.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=60, init_method=f"tcp://127.0.0.1:{port}"
    )
    rpc.init_rpc(_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank == 1:
            _trainer(world_size, out_dir, n_batches, size)
    finally:
        rpc.shutdown()  # graceful: waits until every rank is done with the others


def _run_ranks(
    world_size: int, out_dir: Path, n_batches: int, size: int, deadline_s: float = 120.0
) -> dict:
    """Run the ranks to the end (or the deadline) and return the trainer's record; every
    process is ended on the way out, whatever happened."""
    ctx = mp.start_processes(
        _rank_main,
        args=(world_size, free_port(), out_dir, n_batches, size),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {world_size} RPC ranks did not finish in {deadline_s:.0f} s"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return torch.load(out_dir / "result.pt", weights_only=False)


def _check(result: dict, world_size: int, n_batches: int, size: int) -> None:
    sent = result["sent"]
    total = (world_size - 1) * n_batches * size
    assert sent.numel() == total and sent.unique().numel() == total
    for side in ("ours", "torchrl"):
        stored = result[f"stored_{side}"]
        # exactly once: the stored ids are the sent ids, no loss, no duplicate
        assert torch.equal(stored["id"].sort().values, sent.sort().values), side
        assert (stored["twice"] == 2 * stored["id"].unsqueeze(-1).float()).all(), side
        assert (stored["next"]["obs"].squeeze(-1) == stored["id"].float()).all(), side
        # each extend got its own slots
        assert torch.equal(result[f"index_{side}"].sort().values, torch.arange(total)), side
        drawn = result["samples"][side]
        assert (drawn["twice"] == 2 * drawn["id"].unsqueeze(-1).float()).all(), side
        assert torch.isin(drawn["id"], sent).all(), side
    assert result["len_ours"] == result["len_torchrl"] == total
    assert result["sample_types"] == ["TensorDict", "TensorDict"]
    assert result["sample_keys"][0] == result["sample_keys"][1]
    # add() of one item returns its int index, as TorchRL's does (the slot after the extends)
    assert result["add"] == [total, total] and all(type(a) is int for a in result["add"])


def test_rpc_ranks_extend_and_sample_like_torchrl(tmp_path):
    world_size, n_batches, size = 3, 6, 16  # buffer, trainer, one collector
    result = _run_ranks(world_size, tmp_path, n_batches, size)
    _check(result, world_size, n_batches, size)
    # the misdirected calls
    off_owner = result["off_owner"]
    assert "RemoteTensorDictReplayBuffer.extend" in off_owner and "'BUFFER'" in off_owner
    assert "rpc.rpc_sync(rref.owner()" in off_owner
    phrase = "only accepts TensorDictBase subclasses"
    assert phrase in result["remote_ours"] and phrase in result["remote_torchrl"]
    # update_priority through the RRef reached the sampler: the heavy item is always drawn
    assert (result["prioritized_ids"] == result["prioritized_last"]).all()


@pytest.mark.slow
def test_rpc_many_collectors(tmp_path):
    world_size, n_batches, size = 6, 20, 32  # buffer, trainer, four collectors
    result = _run_ranks(world_size, tmp_path, n_batches, size, deadline_s=300.0)
    _check(result, world_size, n_batches, size)


def test_local_calls_unchanged():
    """Off RPC the buffer is an ordinary TensorDictReplayBuffer; TorchRL's positional order of
    ``sample(batch_size, include_info, return_info)`` holds."""
    rb = OurNode(8, scratch_dir=None)
    assert rb.add(_batch(1, 0, 1)[0]) == 0
    assert rb.extend(_batch(1, 1, 3)).tolist() == [1, 2, 3]
    assert len(rb) == 4 and rb.contents()["id"].numel() == 4
    data, info = rb.sample(5, False, True)  # (include_info=False, return_info=True)
    assert data.batch_size == (5,) and info["index"].shape == (5,)
    written = {_batch(1, 0, 1)["id"].item(), *_batch(1, 1, 3)["id"].tolist()}
    assert set(data["id"].tolist()) <= written
