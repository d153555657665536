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
    assert b.blocks == 2  # after the first calls, and before the first timed block

    b, calls = _Buffer(), []
    t = time.perf_counter()
    n = warm_up(b, lambda: (calls.append(1), time.sleep(0.002)), 0.05)
    assert time.perf_counter() - t >= 0.05
    assert n == len(calls) >= 10
    assert b.blocks == 2


def test_warm_up_seconds_count_from_after_the_first_calls(monkeypatch):
    """A first call that compiles for longer than the warm-up does not use it up: the steps
    still run for ``warmup_s`` after it (a W5 point whose compile took 2 s was timed cold)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.w5_scale import warm_up

    b, calls = _Buffer(), []

    def run():
        calls.append(time.perf_counter())
        time.sleep(0.1 if len(calls) == 1 else 0.002)

    n = warm_up(b, run, 0.05)
    assert n == len(calls) >= 10
    assert calls[-1] - calls[3] >= 0.04  # the calls after the first three span the warm-up


def test_a_point_records_its_warm_up(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.w5_scale import time_point

    rec = time_point("uniform", "functional_rb", 1000, "call", 5, 2, 0.01, None, warmup_s=0.05)
    assert rec["warmup_calls"] >= 3
    assert len(rec["blocks_us"]) == 2 and all(t > 0 for t in rec["blocks_us"])
    assert rec["steal_s"] is None or rec["steal_s"] >= 0


def test_cpu_ms_times_every_cpu_and_restores_the_affinity(monkeypatch):
    import os

    import pytest

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks._stats import cpu_ms

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    ms = cpu_ms(10_000)
    assert set(ms) == before and all(v > 0 for v in ms.values())
    assert os.sched_getaffinity(0) == before
    # the loop's time grows with its length: it measures the CPU, not a constant
    assert sum(cpu_ms(1_000_000).values()) > sum(ms.values())


def test_cpu_speed_samples_every_cpu_and_writes_its_summary(monkeypatch, tmp_path):
    import json
    import os

    import pytest

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import cpu_speed

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    out = tmp_path / "cpu.json"
    cpu_speed.main(["--samples", "3", "--gap-s", "0", "--loop", "1000", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["ms"]) == {str(c) for c in os.sched_getaffinity(0)}
    assert all(len(v) == 3 for v in res["ms"].values())
    assert cpu_speed.slow_share([8.0, 8.0, 16.0, 16.0]) == 0.5
    assert cpu_speed.slow_share([8.0, 9.0]) == 0.0
