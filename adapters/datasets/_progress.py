"""Progress bars of the dataset loaders: ``tqdm`` on stderr, off with
``FRB_DATASETS_PROGRESS=0`` (or ``progress=False``); inert when ``tqdm`` is not installed."""

from __future__ import annotations

import os
import sys


def progress_enabled(progress: bool | None = None) -> bool:
    """``progress`` if given, else ``$FRB_DATASETS_PROGRESS`` (default on; ``0`` turns off)."""
    if progress is not None:
        return bool(progress)
    return os.environ.get("FRB_DATASETS_PROGRESS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


class _NoBar:
    n = 0

    def update(self, n=1):
        self.n += n

    def reset(self, total=None):
        self.n = 0

    def close(self):
        pass


def progress_bar(
    total: int | None, desc: str, *, unit: str = "B", initial: int = 0, progress: bool | None = None
):
    """A ``tqdm`` bar on stderr (``update(n)``, ``reset(total)``, ``close()``), or an inert one
    when progress is off or ``tqdm`` is not installed. Bytes are shown scaled (KiB, MiB...);
    outside a terminal the bar is redrawn at most every 10 s so logs stay short."""
    if not progress_enabled(progress):
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    kw = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        mininterval=0.1 if tty else 10.0,
        dynamic_ncols=tty,
        leave=True,
        **kw,
    )


class LazyBar:
    """A byte bar drawn from the first answer on, when the size is known."""

    def __init__(self, desc: str, progress: bool | None):
        self.desc, self.progress, self.bar = desc, progress, None

    def reset(self, total=None):
        if self.bar is None:
            self.bar = progress_bar(total, self.desc, progress=self.progress)
        else:
            self.bar.reset(total=total)

    def update(self, n):
        self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()
