"""Pure-Python stand-ins for TorchRL's C++ segment trees (its extension does not load with this
torch), so TorchRL's own PrioritizedSampler runs in comparisons."""

from __future__ import annotations

import numpy as np


def patch_torchrl_trees(monkeypatch, prioritized_module, tree, add, minimum) -> None:
    """Replace ``SumSegmentTreeFp{32,64}`` / ``MinSegmentTreeFp{32,64}`` in TorchRL's
    ``prioritized`` module with ``tree(capacity, dtype, neutral, reduce)``, reducing with ``add``
    for the sum trees and ``minimum`` for the min trees."""
    for bits, dt in ((32, np.float32), (64, np.float64)):
        monkeypatch.setattr(
            prioritized_module, f"SumSegmentTreeFp{bits}", lambda n, dt=dt: tree(n, dt, 0.0, add)
        )
        monkeypatch.setattr(
            prioritized_module,
            f"MinSegmentTreeFp{bits}",
            lambda n, dt=dt: tree(n, dt, np.finfo(dt).max, minimum),
        )
