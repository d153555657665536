"""W5's timing harness (``benchmarks/w5_scale.py``): what every point runs before it is timed."""

import pathlib
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Buffer:
    def __init__(self):
        self.blocks = 0

    def block(self):
        self.blocks += 1


def test_warm_up_runs_at_least_three_calls_and_for_the_time_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.w5_scale import warm_up

    b, calls = _Buffer(), []
    assert warm_up(b, lambda: calls.append(1), 0.0) == 3 == len(calls)
    assert b.blocks == 1  # the queue is drained before the first timed block

    b, calls = _Buffer(), []
    t = time.perf_counter()
    n = warm_up(b, lambda: (calls.append(1), time.sleep(0.002)), 0.05)
    assert time.perf_counter() - t >= 0.05
    assert n == len(calls) >= 10
    assert b.blocks == 1


def test_a_point_records_its_warm_up(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.w5_scale import time_point

    rec = time_point("uniform", "functional_rb", 1000, "call", 5, 2, 0.01, None, warmup_s=0.05)
    assert rec["warmup_calls"] >= 3
    assert len(rec["blocks_us"]) == 2 and all(t > 0 for t in rec["blocks_us"])
