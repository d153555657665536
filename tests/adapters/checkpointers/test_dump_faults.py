"""Adapter dumps under faults: a dumping process killed at any moment leaves the previous dump
or the new one, never a mix; every damaged file is named; a dump of another configuration is
refused before anything is read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _kill_trials import forkserver, kill_at_random

torch = pytest.importorskip("torch")
from tensordict import TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402
from functional_rb.checkpoint import CheckpointError  # noqa: E402

N = 4096


def _buffer(gen: int, n: int = N, storage=None):
    rb = A.TensorDictReplayBuffer(
        storage=storage or A.LazyTensorStorage(n),
        batch_size=8,
        sampler=A.SamplerWithoutReplacement(),
    )
    rb.extend(
        TensorDict(
            {
                "gen": torch.full((n,), gen),
                "obs": torch.full((n, 64), float(gen)),
                "i": torch.arange(n),
            },
            [n],
        )
    )
    rb.sample()
    return rb


def _dump_forever(path: str, gen: int, conn) -> None:
    rb = _buffer(gen)
    rb.dumps(path)
    conn.send("ready")  # one new dump is complete; the kill lands in one of the next ones
    while True:
        rb.dumps(path)


def _kill_trials(tmp_path: Path, trials: int) -> dict:
    path = tmp_path / "dump"
    _buffer(0).dumps(path)
    # forkserver: children fork from a clean process that only imported the libraries (a fork
    # of this process, whose torch and JAX thread pools are running, may deadlock)
    ctx = forkserver("torch", "tensordict", "functional_rb.adapters")
    seen = {"old": 0, "new": 0}
    rng = random.Random(0)
    for trial in range(trials):
        if rng.random() < 0.5:  # half the kills during the first dump over the old one
            kill_at_random(ctx, _dump_forever, (str(path), trial + 1), rng.uniform(0.0, 0.3))
        else:  # the others once it completed (waiting at most 60 s)
            kill_at_random(
                ctx, _dump_forever, (str(path), trial + 1), rng.uniform(0.0, 0.1), ready_s=60
            )
        back = A.TensorDictReplayBuffer(
            storage=A.LazyTensorStorage(N), batch_size=8, sampler=A.SamplerWithoutReplacement()
        )
        back.loads(path)
        data = back[:]
        gens = set(data["gen"].tolist()) | set(data["obs"].reshape(-1).long().tolist())
        assert len(gens) == 1, f"trial {trial}: a mix of dumps {sorted(gens)}"
        assert torch.equal(data["i"], torch.arange(N))
        seen["new" if gens != {0} else "old"] += 1
        _buffer(0).dumps(path)  # the next trial starts from the old dump again
        leftovers = [p for p in tmp_path.iterdir() if p.name != "dump"]
        _buffer(0, 16).dumps(tmp_path / "probe")  # the next save cleans killed saves up
        assert not [p for p in tmp_path.iterdir() if ".frb-" in p.name], leftovers
        (tmp_path / "probe").exists() and __import__("shutil").rmtree(tmp_path / "probe")
    return seen


def test_killed_dumps_leave_the_old_or_the_new_dump(tmp_path):
    seen = _kill_trials(tmp_path, 6)
    assert sum(seen.values()) == 6


@pytest.mark.slow
def test_killed_dumps_fifty_trials(tmp_path):
    seen = _kill_trials(tmp_path, 50)
    print("50 killed dumps:", seen)  # shown with -s
    assert seen["old"] and seen["new"], seen  # kills landed before and after the rename


def _damaged_variants(root: Path):
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        size = file.stat().st_size
        yield file, "truncated", lambda f=file, s=size: f.write_bytes(f.read_bytes()[: s // 2])
        if size:

            def flip(f=file):
                b = bytearray(f.read_bytes())
                b[len(b) // 2] ^= 0x40
                f.write_bytes(bytes(b))

            yield file, "flipped", flip


def test_every_damaged_file_is_named(tmp_path):
    src = tmp_path / "src"
    _buffer(1, 64).dumps(src)
    count = 0
    for file, how, damage in _damaged_variants(src):
        work = tmp_path / f"w{count}"
        __import__("shutil").copytree(src, work)
        rel = file.relative_to(src)
        damage(work / rel)
        back = A.TensorDictReplayBuffer(
            storage=A.LazyTensorStorage(64), batch_size=8, sampler=A.SamplerWithoutReplacement()
        )
        with pytest.raises(CheckpointError) as e:
            back.loads(work)
        assert str(work / rel) in str(e.value), (rel, how, str(e.value))
        count += 1
    assert count >= 10


def test_a_dump_of_another_configuration_is_refused(tmp_path):
    _buffer(1, 64).dumps(tmp_path / "d")
    for storage, want in (
        (A.LazyTensorStorage(32), "max_size=64 there, 32 here"),
        (A.LazyMemmapStorage(64), "storage='LazyTensorStorage' there"),
    ):
        rb = A.TensorDictReplayBuffer(
            storage=storage, batch_size=8, sampler=A.SamplerWithoutReplacement()
        )
        with pytest.raises(ValueError, match=want):
            rb.loads(tmp_path / "d")
    other = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(64), batch_size=8)
    with pytest.raises(ValueError, match="sampler='SamplerWithoutReplacement' there"):
        other.loads(tmp_path / "d")


def test_dumping_over_a_directory_that_is_not_a_dump_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no buffer dump"):
        _buffer(1, 16).dumps(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
