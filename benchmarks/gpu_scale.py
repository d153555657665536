"""W5 on the device for ``benchmarks/gpu.py``: one backend per child process, its samplers in
turn, each (sampler, size) point built once (``scale_backends.py``'s buffers, items and
steps) and timed per call and in ``lax.scan``, as far as the device's memory and the job's
time go."""

from __future__ import annotations

import gc
import statistics
import sys
import time

from benchmarks.gpu_sections import (
    FRB,
    TORCH,
    TORCH_DEVICE,
    deadline_for,
    emit,
    reason,
    sync,
    w5_modes,
)


class _DeviceChunks:
    """Prefill adds the same chunk again and again: copy it to the device once (10^3 host
    copies of it would dominate building 10^9 items)."""

    def chunk_for(self, chunk, a, b):
        cache = self.__dict__.setdefault("_device_chunks", {})
        if (a, b) not in cache:
            cache[(a, b)] = super().chunk_for(chunk, a, b)
        return cache[(a, b)]


def _free_bytes(backend: str) -> float:
    """What the device that ``backend`` runs on has free."""
    if backend == TORCH and TORCH_DEVICE[0] == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    from benchmarks.w5_scale import _mem_available

    return _mem_available()


def scan_length(cfg: dict, call_us: float | None) -> int:
    """Steps of one scan call: ``w5_steps``, or fewer (at least 10) where the per-call step
    (``call_us``) says that many would outlast ``w5_block_s`` (flashbax's prioritised buffer
    on a GPU: 166 ms a step, 83 s for a scan of 500)."""
    steps = cfg["w5_steps"]
    if call_us:
        steps = max(10, min(steps, int(cfg["w5_block_s"] * 1e6 / call_us)))
    return steps


def _time_w5(b, mode: str, cfg: dict, call_us: float | None = None) -> list[float]:
    """Microseconds per step of each timed block (W5's method: warm up, then blocks of at
    most ``w5_steps`` calls or ``w5_block_s`` seconds; in scan mode one call of
    :func:`scan_length` steps per block)."""
    steps = cfg["w5_steps"] if mode == "call" else scan_length(cfg, call_us)
    run = b.step if mode == "call" else (lambda: b.scan_steps(steps))
    for _ in range(3 if mode == "call" else 2):
        run()
    b.block()
    # imported here like scale_backends: the child picks its device before JAX is imported
    from benchmarks.w5_scale import time_blocks

    return time_blocks(b, run, mode, steps, cfg["w5_blocks"], cfg["w5_block_s"])


def _w5_class(backend: str):
    """``(the class building a point, the backend name bytes_needed knows)``."""
    from benchmarks import scale_backends as sb

    if backend != TORCH:
        base = sb.FunctionalRB if backend == FRB else sb.Flashbax
        return type(base.__name__, (_DeviceChunks, base), {}), backend

    class TorchOnDevice(sb.TorchRL):
        """W5's TorchRL buffer, its storage and batch on ``torch_storage``'s device."""

        def __init__(self, *args):
            super().__init__(*args)
            self.batch = self.batch.to(TORCH_DEVICE[0])

        def block(self):
            sync()

    return TorchOnDevice, "torchrl"


def _guess(builds: dict, n: int) -> float:
    """Seconds to build ``n`` items, from the builds timed so far (``{size: seconds}``): a
    constant (compiling, the smallest build) plus a cost per item (from the largest)."""
    small, large = min(builds), max(builds)
    per_item = max(builds[large] - builds[small], 0.0) / large if large > small else 0.0
    return builds[small] + per_item * n


def series(sampler: str, backend: str, cfg: dict, deadline: float, torch_why) -> None:
    """One (sampler, backend) series in ``cfg["w5_sizes"]``'s order (the sizes that matter
    most first), each point built once and timed in every mode; a point that cannot run (not
    enough memory, or time) says why, and a size that did not fit stops every larger one."""
    from benchmarks import scale_backends as sb
    from functional_rb._internal import hugepages

    if backend == TORCH and torch_why:
        for n in cfg["w5_sizes"]:
            emit(
                "row",
                {
                    "workload": f"W5 {sampler}",
                    "sampler": sampler,
                    "mode": "call",
                    "backend": backend,
                    "size": n,
                    "skipped": torch_why,
                },
            )
        return
    cls, estimate_as = _w5_class(backend)
    if backend != TORCH:
        cls.build_deadline = deadline  # a build that cannot end in time stops and says so
    too_big, builds = None, {}  # (smallest size that did not fit, why); {size: build seconds}
    for n in cfg["w5_sizes"]:
        rows = [
            {
                "workload": f"W5 {sampler}",
                "sampler": sampler,
                "mode": m,
                "backend": backend,
                "size": n,
                "unit": "us/step",
            }
            for m in w5_modes(backend)
        ]
        need = sb.bytes_needed(sampler, estimate_as, n)[0]
        left, why = deadline - time.time(), None
        if too_big and n >= too_big[0]:
            why = too_big[1]
        elif (
            builds
            and (guess := _guess(builds, n) + cfg["w5_blocks"] * cfg["w5_block_s"] * len(rows))
            > left
        ):
            why = f"time budget: {left:.0f} s left, ~{guess:.0f} s needed"
        elif need > 0.9 * _free_bytes(backend):
            why = (
                f"needs ~{need / 1e9:.1f} GB, {_free_bytes(backend) / 1e9:.1f} GB free on "
                "the device"
            )
            too_big = (n, why)
        b = None
        try:
            if why is None:
                t0 = time.perf_counter()
                b = cls(sampler, n, None)
                builds[n] = time.perf_counter() - t0
                anon = hugepages.report()["anon_huge_pages_kib"]
            call_us = None
            while rows and why is None and time.time() < deadline:
                mode = rows[0]["mode"]
                blocks = _time_w5(b, mode, cfg, call_us)
                if mode == "call":
                    call_us = statistics.median(blocks)
                emit(
                    "row",
                    dict(
                        rows.pop(0),
                        value=statistics.median(blocks),
                        min=min(blocks),
                        max=max(blocks),
                        blocks_us=blocks,
                        build_s=round(builds[n], 2),
                        anon_huge_pages_kib=anon,
                    ),
                )
        except sb.Skip as e:
            why = str(e)
            if why.startswith("build stopped"):  # a larger build would not end in time either
                too_big = (n, f"{why} at {n:,} items")
        except ImportError as e:
            why = f"not installed ({e})"
        except Exception as e:  # noqa: BLE001 - out of memory stops the larger sizes
            why = reason(e)
            if why.startswith("out of memory"):
                too_big = (n, f"{why} at {n:,} items")
        for row in rows:
            emit("row", dict(row, skipped=why or "time budget spent"))
        del b
        gc.collect()
        if backend == TORCH and TORCH_DEVICE[0] == "cuda":
            import torch

            torch.cuda.empty_cache()
        print(f"[gpu] W5 {sampler} {backend} {n:,} done", file=sys.stderr, flush=True)


def run_w5(backend: str, samplers, cfg: dict, deadline: float, torch_why) -> None:
    """W5 for one backend: each sampler's series in turn, sharing the time until
    ``deadline`` (one process per backend: starting JAX on a GPU for each series would cost
    more than a point)."""
    for i, sampler in enumerate(samplers):
        series(
            sampler, backend, cfg, deadline_for([1.0] * (len(samplers) - i), deadline), torch_why
        )
