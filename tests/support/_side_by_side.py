"""The adapters beside TorchRL on the same data: ``both`` builds the same thing from each
library, ``steps`` is the small TensorDict of steps the feature and writer tests feed both."""

from __future__ import annotations


def both(fn):
    """``(fn(torchrl.data), fn(functional_rb.adapters))``."""
    import torchrl.data

    import functional_rb.adapters

    return fn(torchrl.data), fn(functional_rb.adapters)


def steps(n, start=0):
    """``n`` steps numbered from ``start``: ``obs`` ``[n, 2]``, ``r``, ``step`` and a
    ``("next", "done")`` every sixth step."""
    import torch
    from tensordict import TensorDict

    t = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": t.float()[:, None].expand(n, 2).clone(),
            "r": t.float(),
            "step": t,
            ("next", "done"): (t % 6 == 5)[:, None],
        },
        [n],
    )
