"""The summary every benchmark's JSON keeps of one measured quantity over its rounds."""

from __future__ import annotations

import statistics


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
