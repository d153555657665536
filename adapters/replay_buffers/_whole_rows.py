"""A sample never holds a torn row: the draws whose rows another process was writing are put
back, once, by other draws of the same batch.

A shared :class:`~functional_rb.adapters.LazyMemmapStorage` tells, for each row it gathered,
whether the row was one whole committed item (``storage.read_checked``: the row's stamp was
even and did not change across the gather). The sampler drew only committed rows, but a writer
may start to overwrite one between the draw and the gather. Such a draw, with its whole unit
(the slice it belongs to for slice samplers), is replaced by another unit of the same batch
that was read whole, with its index and info, so every sampler's batch keeps its size, its
layout and consistent weights. Only when no unit of a batch is whole is the batch drawn again:
at most ``REDRAWS`` times with short sleeps between (``MAX_WAIT_S`` in all), then a
``RuntimeError`` says why (a ring no larger than what is in flight).
"""

from __future__ import annotations

import time

import torch

from functional_rb.adapters._utils import data as D

__all__ = ["MAX_WAIT_S", "REDRAWS", "sample_whole"]

REDRAWS = 8
_SLEEPS = [min(0.001 * 2**k, 0.05) for k in range(REDRAWS)]
MAX_WAIT_S = sum(_SLEEPS)  # the longest a sample waits for writers (about 0.2 s)

_ALL_TORN = (
    "{name}.sample: every row drawn in {tries} tries was being written by another "
    "process (or was left half-written by a writer that died). Keep the storage's ring "
    "larger than the items the writers have in flight at once."
)


def _unit(sampler, n: int) -> int:
    """Positions per unit of a batch of ``n``: a slice sampler's slice length, else 1."""
    num, length = getattr(sampler, "num_slices", None), getattr(sampler, "slice_len", None)
    u = length if length else (n // num if num else 1)
    return u if u and n % u == 0 else n


def _take(x, src, n):
    if isinstance(x, tuple):
        return tuple(_take(v, src, n) for v in x)
    if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == n:
        return x[src.to(x.device)]
    return x


def sample_whole(draw, storage, sampler, generator, name: str):
    """``(index, info, data)`` of ``draw()`` (which returns ``(index, info)``) whose rows
    ``storage`` read whole."""
    for pause in _SLEEPS:
        index, info = draw()
        data, torn = storage.read_checked(index)
        if torn is None:
            return index, info, data
        n = torn.numel()
        u = _unit(sampler, n)
        bad = torn.reshape(n // u, u).any(1)
        good = (~bad).nonzero().flatten()
        if good.numel():
            src = torch.arange(n // u)
            src[bad] = good[torch.randint(good.numel(), (int(bad.sum()),), generator=generator)]
            src = (src[:, None] * u + torch.arange(u)).reshape(-1)
            info = {k: _take(v, src, n) for k, v in info.items()}
            return _take(index, src, n), info, D.index(data, src)
        time.sleep(pause)
    raise RuntimeError(_ALL_TORN.format(name=name, tries=len(_SLEEPS)))
