"""The summary every benchmark's JSON keeps of one measured quantity over its rounds."""

from __future__ import annotations

import os
import statistics
import time


def summary(values: list[float]) -> dict:
    """Median, min and max of ``values`` (one per round), and the values themselves.

    >>> summary([3.0, 1.0, 2.0])
    {'median': 2.0, 'min': 1.0, 'max': 3.0, 'values': [3.0, 1.0, 2.0]}
    """
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def run_meta(**extra) -> dict:
    """When (UTC) and at which commit a run was taken, with ``extra``, for its JSON.

    >>> sorted(run_meta(rounds=5))
    ['commit', 'rounds', 'when']
    """
    import datetime
    import subprocess

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"when": when, "commit": commit, **extra}


def _spin(n: int) -> float:
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return (time.perf_counter() - t) * 1e3


def cpu_ms(n: int = 300_000) -> dict:
    """ms that a fixed pure-Python loop of ``n`` steps takes on each CPU this process may run
    on, pinned to each in turn (its affinity is restored after): ``{cpu: ms}``.

    These VMs' CPUs sometimes run at half speed for seconds at a time, on an idle guest, with
    no steal time counted (NOTES, "The warm-up after the compiles, and CPUs at half speed"); a
    point timed then is ~2x slower whatever library it runs. Taken before and after a point,
    it says how the CPUs ran around it, not within it: the state changes within seconds.
    ``{}`` where affinity cannot be set (not Linux).

    >>> ms = cpu_ms(1000)
    >>> all(v > 0 for v in ms.values())
    True
    """
    if not hasattr(os, "sched_setaffinity"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    out = {}
    try:
        for c in cpus:
            os.sched_setaffinity(0, {c})
            out[c] = round(_spin(n), 2)
    finally:
        os.sched_setaffinity(0, cpus)
    return out
