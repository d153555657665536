"""The sections of ``benchmarks/gpu.py`` (W1, W2, W3, frames), run in its child processes, and
the plan of rows every job reports (shared with the parent, which fills in what a child could
not say; W5's series are in ``gpu_scale.py``).

A job prints ``@@row {json}`` per planned row, with a ``value`` or the reason it has none
(``skipped``), again each time a value is added (the parent keeps a row's last line), then ``@@meta {json}`` (device, versions, host huge pages). The workloads are
the benchmark modules' own classes (``w1_uniform``, ``w2_prioritized``, ``w3_slices``; their
buffers are ``backends.py``'s), imported; what is added here is the GPU side (TorchRL's ``LazyTensorStorage`` on ``cuda``,
``--tiny``: on the CPU, with timings that wait for the device) and the time budget. JAX and
the peers are imported inside the functions that run in a child: the parent process never
touches the GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import statistics
import sys
import time

import numpy as np

FRB, FBX, BARE = "functional_rb", "flashbax", "bare jax (hand-written)"
FLOOR, TORCH = "jax dispatch floor (no-op calls)", "torchrl"
SECTIONS = ("w1", "w2", "w3", "frames", "w5")
WORKLOADS = {"w1": "W1 uniform", "w2": "W2 prioritized", "w3": "W3 slices", "frames": "frames"}
# each section's share of the budget (W5's is split between its series)
SHARES = {"w1": 0.11, "w2": 0.13, "w3": 0.11, "frames": 0.11, "w5": 0.54}
W5_SAMPLERS = ("uniform", "prioritized", "slices", "ted")
W5_BACKENDS = (FRB, FBX, TORCH)
FULL = {
    "w1_capacity": 1_000_000,
    "scan_steps": 1000,
    "steps": 500,
    "repeats": 3,
    "w2_capacities": [100_000, 1_000_000],
    "w3_steps": 1_000_000,
    "w3_block": 100,
    "w3_batches": 100,
    "frames_capacity": 1_000_000,
    # W5's sizes in the order they run: the ends of the range first (the growth), then
    # the rest as time allows
    "w5_sizes": [10**4, 10**8, 10**9, 10**6, 10**5, 10**7],
    "w5_steps": 200,
    "w5_blocks": 3,
    "w5_block_s": 0.5,
    "torch_device": "cuda",
}
TINY = {
    "w1_capacity": 2048,
    "scan_steps": 8,
    "steps": 4,
    "repeats": 1,
    "w2_capacities": [2048],
    "w3_steps": 3000,
    "w3_block": 4,
    "w3_batches": 2,
    "frames_capacity": 1024,
    "w5_sizes": [1000],
    "w5_steps": 4,
    "w5_blocks": 1,
    "w5_block_s": 0.2,
    "torch_device": "cpu",
}


def section_modes(section: str, cfg: dict) -> list[tuple[str, str, tuple]]:
    """``(mode label, contender method, backends timed in it)`` of a section, in table order.
    The plan of rows (parent) and the measurements (children) both come from here."""
    scan = f"lax.scan: {cfg['scan_steps']} steps per call"
    if section in ("w1", "frames"):
        return [
            ("per call: jit add + jit sample", "per_call", (FRB, FBX, BARE, TORCH)),
            ("per call: one fused jitted add + sample", "fused", (FRB, FBX, BARE)),
            (scan, "scan", (FRB, FBX, BARE)),
        ]
    if section == "w2":
        out = []
        for cap in cfg["w2_capacities"]:
            out += [
                (
                    f"per call: jit add + sample + update, cap {cap:,}",
                    "per_call",
                    (FRB, FBX, FLOOR, TORCH),
                ),
                (
                    f"per call: one fused jitted step, cap {cap:,}",
                    "fused",
                    (FRB, FBX, FLOOR),
                ),
                (f"{scan}, cap {cap:,}", "scan", (FRB, FBX)),
            ]
        return out
    if section == "w3":
        block = f"lax.scan: {cfg['w3_block']} batches per call"
        return [
            ("sample only, jit per batch", "sample_only", (FRB, FBX, TORCH)),
            ("add 500 + sample, jit per batch", "add_sample", (FRB, FBX, TORCH)),
            (f"sample only, {block}", "scan_sample_only", (FRB,)),
            (f"add 500 + sample, {block}", "scan_add_sample", (FRB,)),
        ]
    raise ValueError(f"gpu.section_modes: unknown section {section!r}; one of {SECTIONS[:-1]}")


def w5_modes(backend: str) -> tuple[str, ...]:
    return ("call",) if backend == TORCH else ("call", "scan")


def plan(cfg: dict, sections, samplers, backends=W5_BACKENDS) -> list[dict]:
    """Every row the run must report, as ``{workload, mode, backend[, sampler, size]}``."""
    rows = []
    for s in sections:
        if s == "w5":
            rows += [
                {"workload": f"W5 {sm}", "sampler": sm, "mode": m, "backend": b, "size": n}
                for sm in samplers
                for b in backends
                for m in w5_modes(b)
                for n in cfg["w5_sizes"]
            ]
        else:
            rows += [
                {"workload": WORKLOADS[s], "mode": label, "backend": b}
                for label, _, backends in section_modes(s, cfg)
                for b in backends
            ]
    return rows


def row_key(row: dict) -> tuple:
    return row["workload"], row["mode"], row["backend"], row.get("size")


# ====================================================================== running a job
def emit(kind: str, record: dict) -> None:
    print(f"@@{kind} " + json.dumps(record), flush=True)


def reason(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:200]
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return f"out of memory ({type(e).__name__}: {text})"
    return f"{type(e).__name__}: {text}"


def job_meta() -> dict:
    import jax

    from functional_rb._internal import hugepages

    dev = jax.devices()[0]
    out = {
        "jax": jax.__version__,
        "platform": dev.platform,
        "device": str(dev),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "loadavg": os.getloadavg(),
        "hugepages": hugepages.report(),
    }
    for name in ("flashbax", "torch", "tensordict", "torchrl"):
        try:  # flashbax has no __version__
            out[name] = importlib.metadata.version(name) if name in sys.modules else None
        except importlib.metadata.PackageNotFoundError:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        out["torch_gpu"] = sys.modules["torch"].cuda.get_device_name()
    return out


TORCH_DEVICE = ["cuda"]  # where TorchRL's storages and batches live (set by torch_storage)


def torch_storage(device: str) -> str | None:
    """Point ``torchrl.data.LazyTensorStorage`` at ``device`` (``"cuda"``; ``--tiny``:
    ``"cpu"``, to run the code) for the workload classes, which import it when they build;
    None, or why TorchRL cannot run there."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no GPU"
    try:
        import torchrl.data as trd
    except Exception as e:  # noqa: BLE001 - an extension built for another torch, reported
        return f"torchrl does not import ({reason(e)}); carry its wheel (see gpu.py's docstring)"
    base = getattr(trd.LazyTensorStorage, "frb_base", trd.LazyTensorStorage)

    class DeviceLazyTensorStorage(base):
        frb_base = base

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **dict(kwargs, device=device))

    trd.LazyTensorStorage = DeviceLazyTensorStorage
    TORCH_DEVICE[0] = device
    return None


def sync():
    """Wait for torch's queued GPU work (a timing must include it); nothing on the CPU."""
    if TORCH_DEVICE[0] == "cuda":
        import torch

        torch.cuda.synchronize()


def _torch_classes():
    """TorchRL contenders: the workload modules' own classes, their storage and batches on
    ``torch_storage``'s device and every timing waiting for it (torch runs asynchronously)."""
    import torch
    from tensordict import TensorDict

    from benchmarks import w1_uniform as w1
    from benchmarks import w3_slices as w3

    class W1Torch(w1.TorchRL):
        name = TORCH

        def __init__(self, capacity, prefill, batch):
            super().__init__(capacity, prefill, batch)
            self.batch = self.batch.to(TORCH_DEVICE[0])

        def per_call(self, keys):
            sync()
            t = time.perf_counter()
            for _ in keys:
                self.rb.extend(self.batch)
                s = self.rb.sample()
            del s
            sync()
            return len(keys) / (time.perf_counter() - t)

    class W2Torch:
        """W2's step in TorchRL: extend 256, sample 256, update their priorities."""

        name = TORCH

        def __init__(self, cap, prefill, batch, prios):
            from benchmarks.backends import torchrl_buffer

            self.rb = torchrl_buffer("prioritized", cap)

            def td(d, p):
                t = {k: torch.as_tensor(v) for k, v in d.items()}
                return TensorDict(dict(t, td_error=torch.as_tensor(p)), [len(p)])

            self.rb.extend(td(prefill, prios))
            ones = np.ones(len(batch["reward"]), np.float32)
            self.batch = td(batch, ones).to(TORCH_DEVICE[0])

        def per_call(self, keys):
            sync()
            t = time.perf_counter()
            for _ in keys:
                self.rb.extend(self.batch)
                s = self.rb.sample()
                s.set("td_error", s["reward"].abs() + 0.01)
                self.rb.update_tensordict_priority(s)
            sync()
            return len(keys) / (time.perf_counter() - t)

    class W3Torch(w3.TorchRL):
        def __init__(self, data, extra):
            super().__init__(data, extra, False)
            self.name = TORCH
            self.chunks = [c.to(TORCH_DEVICE[0]) for c in self.chunks]

        def sample_only(self, n):
            sync()
            t = time.perf_counter()
            super().sample_only(n)
            sync()
            return time.perf_counter() - t

        def add_sample(self, n):
            sync()
            t = time.perf_counter()
            super().add_sample(n)
            sync()
            return time.perf_counter() - t

    return W1Torch, W2Torch, W3Torch


class _W3Rates:
    """W3's contenders time ``n`` batches and return seconds: here batches per second. For
    functional_rb one ``w3.OursScan`` gives both forms (its own ``sample_only`` /
    ``add_sample`` run in ``lax.scan``; ``per_batch=w3.Ours`` names the jit-per-batch ones)."""

    def __init__(self, contender, n, per_batch=None):
        self.c, self.n, self.per_batch = contender, n, per_batch or type(contender)

    def sample_only(self, _):
        return self.n / self.per_batch.sample_only(self.c, self.n)

    def add_sample(self, _):
        return self.n / self.per_batch.add_sample(self.c, self.n)

    def scan_sample_only(self, _):
        return self.n / self.c.sample_only(self.n)

    def scan_add_sample(self, _):
        return self.n / self.c.add_sample(self.n)


def _build(factories: dict, deadline: float) -> dict:
    """``{backend: contender or the reason it is missing}``, building each in turn."""
    out = {}
    for name, make in factories.items():
        if isinstance(make, str):
            out[name] = make
        elif time.time() > deadline:
            out[name] = "time budget spent before it was built"
        else:
            try:
                out[name] = make()
            except Exception as e:  # noqa: BLE001 - a missing peer or a failure, reported
                out[name] = f"not installed ({e})" if isinstance(e, ImportError) else reason(e)
            print(f"[gpu] built {name}", file=sys.stderr, flush=True)
    return out


def _measure(workload, modes, contenders, args, repeats, deadline, unit):
    """Warm every (mode, backend) up and time it once, then time them interleaved until
    ``repeats`` values each; emits each row (the median so far) after every value, so that
    a child stopped at its deadline keeps what it measured (the parent keeps a row's last
    emission). Backend by backend, ours first; a (mode, backend) whose warm-up took over a
    third of the time left is not timed: one slow peer (flashbax's prioritised buffer on a
    GPU: 166 ms a step) would else spend every other row's time."""
    live, failed = {}, {}

    def report(key):
        row, _, _, vals = live[key]
        emit("row", dict(row, value=statistics.median(vals), runs=list(vals)))

    pairs = [(m, method, b) for m, method, backends in modes for b in backends if b in contenders]
    order = sorted(dict.fromkeys(b for _, _, b in pairs), key=lambda b: b != FRB)
    for label, method, b in sorted(pairs, key=lambda p: order.index(p[2])):  # ours first
        row = {"workload": workload, "mode": label, "backend": b, "unit": unit}
        c = contenders[b]
        if isinstance(c, str) or time.time() > deadline:
            failed[(label, b)] = (row, c if isinstance(c, str) else "time budget spent")
            continue
        try:
            start = time.time()
            getattr(c, method)(args[method])  # compile, first touches
            warm = time.time() - start
            if warm > (deadline - time.time()) / 3:
                failed[(label, b)] = (
                    row,
                    f"not timed: its warm-up took {warm:.0f} s, over a third of the time left",
                )
                continue
            live[(label, b)] = (row, c, method, [getattr(c, method)(args[method])])
            report((label, b))
        except Exception as e:  # noqa: BLE001 - reported in its row
            failed[(label, b)] = (row, reason(e))
    for _ in range(repeats - 1):
        for key, (_, c, method, vals) in list(live.items()):
            if time.time() > deadline:
                break
            try:
                vals.append(getattr(c, method)(args[method]))
                report(key)
            except Exception as e:  # noqa: BLE001
                failed[key] = (live.pop(key)[0], reason(e))
    for row, why in failed.values():
        emit("row", dict(row, skipped=why))


def run_section(section: str, cfg: dict, deadline: float, torch_why: str | None) -> None:
    """Build a section's contenders at ``cfg``'s sizes and time every mode of
    :func:`section_modes` until ``deadline``; TorchRL's rows say ``torch_why`` if set."""
    import jax

    from benchmarks import scale_backends as sb
    from benchmarks import w1_uniform as w1
    from benchmarks import w2_prioritized as w2
    from benchmarks import w3_slices as w3

    torch_classes = None if torch_why else _torch_classes()
    keys = list(jax.random.split(jax.random.key(1), cfg["steps"]))
    args = {
        "per_call": keys,
        "fused": keys,
        "scan": keys[0],
        "sample_only": None,
        "add_sample": None,
        "scan_sample_only": None,
        "scan_add_sample": None,
    }
    modes = section_modes(section, cfg)
    rng = np.random.default_rng(0)
    if section in ("w1", "frames"):
        cap = cfg["w1_capacity"] if section == "w1" else cfg["frames_capacity"]
        if section == "w1":
            prefill, batch = w1._np_batch(rng, cap), w1._np_batch(rng, w1.BATCH)
        else:
            prefill, batch = _frames(rng, cap), _frames(rng, w1.BATCH)
        jax_args = (cap, prefill, batch)
        contenders = _build(
            {
                FRB: lambda: w1.FunctionalRB(*jax_args, scan_steps=cfg["scan_steps"]),
                FBX: lambda: w1.Flashbax(*jax_args, scan_steps=cfg["scan_steps"]),
                BARE: lambda: w1.BareJax(*jax_args, scan_steps=cfg["scan_steps"]),
                TORCH: torch_why or (lambda: torch_classes[0](cap, prefill, batch)),
            },
            deadline,
        )
        del prefill, jax_args
        if section == "frames":
            # W1's scan shifts each batch by the step number in float32; keep each leaf's
            # dtype (uint8 frames) and the done flags as they are
            for name in (FRB, FBX, BARE):
                if not isinstance(contenders[name], str):
                    contenders[name].shift = sb.shifted
        _measure(WORKLOADS[section], modes, contenders, args, cfg["repeats"], deadline, "steps/s")
    elif section == "w2":
        batch = w1._np_batch(rng, w2.BATCH)
        scan = {"scan_steps": cfg["scan_steps"]}
        # flashbax's prioritised add is a sequential scan per item on a GPU (its 10^5-item
        # prefill took over a minute on an H200 and left no time for the other rows): it is
        # built and timed after every other backend at every capacity
        for group in ((FRB, FLOOR, TORCH), (FBX,)):
            for cap in cfg["w2_capacities"]:
                data = np.random.default_rng(cap)  # the same items for both groups
                prefill = w1._np_batch(data, cap)
                prios = data.exponential(1.0, cap).astype(np.float32)
                make = {
                    FRB: functools.partial(w2.FunctionalRB, cap, prefill, batch, prios, **scan),
                    FBX: functools.partial(w2.Flashbax, cap, prefill, batch, prios, **scan),
                    FLOOR: functools.partial(w2.DispatchFloor, cap, prefill, batch, prios, **scan),
                    TORCH: functools.partial(torch_classes[1], cap, prefill, batch, prios)
                    if torch_classes
                    else torch_why,
                }
                contenders = _build({b: make[b] for b in group}, deadline)
                del prefill, make
                _measure(
                    WORKLOADS[section],
                    [m for m in modes if m[0].endswith(f"cap {cap:,}")],
                    contenders,
                    args,
                    cfg["repeats"],
                    deadline,
                    "steps/s",
                )
                del contenders
    else:
        w3.N_STEPS, w3.OursScan.BLOCK = cfg["w3_steps"], cfg["w3_block"]
        data = w3.make_stream(w3.N_STEPS, seed=0)
        extra = w3.make_stream(w3.CHUNK * 200, seed=1)
        extra["ep"] = extra["ep"] + 10_000_000
        n = cfg["w3_batches"]
        contenders = _build(
            {
                FRB: lambda: _W3Rates(w3.OursScan(data, extra), n, per_batch=w3.Ours),
                FBX: lambda: _W3Rates(w3.Flashbax(data, extra), n),
                TORCH: torch_why
                or (lambda: _W3Rates(torch_classes[2](data, extra), max(n // 10, 2))),
            },
            deadline,
        )
        _measure(WORKLOADS[section], modes, contenders, args, cfg["repeats"], deadline, "batches/s")


def _frames(rng, n: int) -> dict:
    """``n`` items of the frames workload; the frames repeat a 4,096-frame random block (the
    contents do not change the timing, and 10^6 fresh frames would take seconds to draw)."""
    block = rng.integers(0, 256, (min(n, 4096), 32, 32, 3), dtype=np.uint8)
    return {
        "obs": np.resize(block, (n, 32, 32, 3)),
        "action": rng.integers(0, 18, n).astype(np.int32),
        "reward": rng.standard_normal(n).astype(np.float32),
        "done": rng.random(n) < 0.01,
    }


def deadline_for(shares: list, end: float) -> float:
    """When the first of the jobs still to run must end: they share the time left until
    ``end`` in proportion to their ``shares`` (so what one leaves unused goes to the rest)."""
    now = time.time()
    return now + max(end - now, 0.0) * shares[0] / sum(shares)
