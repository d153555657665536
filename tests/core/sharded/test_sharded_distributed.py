"""Sharded buffers across processes: two processes of 4 CPU devices each (jax.distributed, gloo
collectives, coordinator on 127.0.0.1) run one global buffer of 8 shards: items added from each
process's own data, global prioritized draws whose rows and weights are exact, a checkpoint
written shard by shard by both processes and restored by both, and read whole here."""

import json
import os
import pathlib
import sys

import numpy as np
import pytest
from _ranks import free_port, run_together
from scipy import stats

import functional_rb as frb

WORKER = pathlib.Path(__file__).with_name("_sharded_worker.py")
N, CAP, PER = 8, 16, 5


def test_two_processes_share_one_sharded_buffer(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run_together(
        [[sys.executable, str(WORKER), str(i), str(port), str(tmp_path)] for i in range(2)],
        env=env,
        timeout=300,
    )
    results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["size"] == N * PER and r["restored_equal"]
    assert results[0]["counts"] == results[1]["counts"]  # one global draw, seen by both
    # every stored item drawn in proportion to its priority, 1 + its shard (alpha = 1)
    counts = np.array(results[0]["counts"]).reshape(N, CAP)
    assert counts[:, PER:].sum() == 0
    expected = np.repeat(np.arange(1, N + 1)[:, None], PER, 1).astype(float)
    expected = expected / expected.sum() * counts.sum()
    assert stats.chisquare(counts[:, :PER].reshape(-1), expected.reshape(-1)).pvalue > 1e-3
    # weights (min_j v_j / v_i) ** beta with the global minimum (shard 0's items, value 1)
    for g, w in results[0]["weights"].items():
        assert w == pytest.approx(1.0 / (int(g) // CAP + 1), rel=1e-5)
    # the checkpoint both processes wrote: one shard file each, read whole in this process
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files == ["data.bin", "frb_manifest.json", "shards-0.bin", "shards-1.bin"]
    whole = frb.checkpoint.load(tmp_path / "ckpt")
    ids = np.asarray(whole.shards.storage.slabs["int32"])[:, :PER, 0]
    np.testing.assert_array_equal(ids, 100 * np.arange(N)[:, None] + np.arange(PER))
