"""GPU figures in one command: W1, W2, W3, the frames workload and W5 on the device JAX sees.

What it measures, on whatever device JAX picks (a GPU when one is there), within ``--budget-s``
seconds (default 450: the whole command ends inside 8 minutes):

* **W1** uniform, **W2** prioritized, **W3** slices: the workloads of ``w1_uniform.py``,
  ``w2_prioritized.py`` and ``w3_slices.py`` (their classes and ``backends.py``'s,
  imported), per call (jitted, donated ``add`` / ``sample`` [/ ``update``] called from
  Python), as one fused jitted step, and inside ``lax.scan`` (every sampled batch consumed
  into the carry).
* **frames**: add 256 + sample 256 items from 10^6 items of ``uint8[32, 32, 3]`` frames (with
  an int32 action, a float32 reward and a bool done), W1's drivers; the goal is < 100 us per
  step on an H100/H200.
* **W5**: per-step cost from 10^4 up to 10^9 items (``scale_backends.py``'s buffers and
  items) for the four samplers, per call and in ``lax.scan``; the ends of the range first
  (10^4, 10^8, 10^9, then 10^6, 10^5, 10^7 as time allows); a size that does not fit in the
  device's free memory (checked before building it) or runs out of it skips every larger
  one; each point records the host's ``AnonHugePages`` after its build.
* Peers on the same device: flashbax (a note where it is not installed) and TorchRL's
  buffers over ``LazyTensorStorage(..., device="cuda")`` (rows ``torchrl``; where torch sees
  no GPU they say so). cpprb runs on the CPU only: it is left out.

Each section, and W5 for each backend, runs in a child process with its share of the time
budget: what one leaves unused goes to the next, and a point that would not finish in time
says so instead (JAX does not preallocate, so TorchRL fits beside it). Writes ``--out``/gpu.json (every row of the plan, a
value or why not, plus the device, versions, load and the host's huge pages), ``gpu.md`` (the
tables) and ``gpu.log`` (the children's stderr).

``python benchmarks/gpu.py --tiny --out /tmp/gpu`` runs everything with tiny sizes on the CPU,
TorchRL's storages included, in one child process and with XLA's optimizations off (it checks
that the code runs, not how fast: tests/test_gpu_script.py runs it, about 30-60 s).

On a lent GPU (see the device tool's README): the device has JAX, torch, flax, chex,
tensorstore but not flashbax, tensordict or TorchRL. Here, once, in the repository root::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        --platform manylinux1_x86_64 -d .whl \\
        flashbax==0.1.3 tensordict==0.14.3 torchrl==0.14.1 pyvers==0.2.3

(4 MB; pyvers is the one import of tensordict/TorchRL the device lacks; their other
requirements are there or optional.) Then one ``run`` call, ``carry=[".whl"]``,
``timeout_s=600``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    nvidia-smi -L; PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT

and copy the tables of ``gpu.md`` into ``benchmarks/README.md``. TorchRL's prioritized
buffer needs its C++ extension, built for another torch: its rows may say why they are
missing. ``--sections``, ``--w5-sizes``, ``--w5-samplers``, ``--w5-backends`` and ``--budget-s``
narrow a rerun.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
if str(_ROOT) not in sys.path:  # `python benchmarks/gpu.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks.gpu_scale import run_w5
from benchmarks.gpu_sections import (
    FRB,
    FULL,
    SECTIONS,
    SHARES,
    TINY,
    TORCH,
    W5_BACKENDS,
    W5_SAMPLERS,
    WORKLOADS,
    deadline_for,
    emit,
    job_meta,
    plan,
    row_key,
    run_section,
    torch_storage,
)


# ====================================================================== a child process
def child(spec: dict) -> int:
    """Run the jobs of ``spec`` (``[[job, share], ...]``, all before ``spec["end"]``) in turn
    and print their rows, then their meta."""
    cfg, jobs = spec["cfg"], spec["jobs"]
    torch_why = spec["torch_why"]
    if torch_why is None and any(j[0] != "w5" or j[1] == TORCH for j, _ in jobs):
        torch_why = torch_storage(cfg["torch_device"])  # imports torch: only where it runs
    with contextlib.suppress(ImportError):  # its rows say so
        import flashbax  # noqa: F401 - so that job_meta reports its version
    for i, (job, _) in enumerate(jobs):
        start = time.time()
        deadline = deadline_for([share for _, share in jobs[i:]], spec["end"])
        if job[0] == "w5":
            run_w5(job[1], job[2:], cfg, deadline, torch_why)
        else:
            run_section(job[0], cfg, deadline, torch_why)
        emit("meta", dict(job_meta(), job=" ".join(job), wall_s=round(time.time() - start, 1)))
    return 0


# ====================================================================== the parent process
GRACE_S = 30  # a child may finish the measurement or build it started past its deadline


def _nvidia() -> bool:
    """Whether an NVIDIA GPU could be there (without importing torch, slow on a CPU box)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def _jobs(sections, samplers, backends=W5_BACKENDS) -> list[tuple[tuple, float]]:
    """``(job, share of the budget)`` in running order."""
    out = [((s,), SHARES[s]) for s in sections if s != "w5"]
    if "w5" in sections:
        out += [(("w5", b, *samplers), SHARES["w5"] / len(backends)) for b in backends]
    return out


def _env(job: tuple, tiny: bool, hugepages_off: bool) -> dict:
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
    )
    # W5's JAX series have the GPU to themselves; elsewhere TorchRL shares it with JAX
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9" if job[0] == "w5" else "0.6")
    if tiny:  # a check that everything runs, not a measurement: compile quickly
        env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    if job[0] == "w5" and job[1] == TORCH:
        env["JAX_PLATFORMS"] = "cpu"
    if hugepages_off:
        env["FRB_HUGEPAGES"] = "0"
    return env


def _launch(spec: dict, env: dict, timeout: float, log) -> tuple[list, list, str | None]:
    """Run jobs in a child process: their rows, their metas, and why it ended early (or
    None)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--job", json.dumps(spec)]
    try:
        p = subprocess.run(
            cmd,
            cwd=_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=timeout,
            check=False,
        )
        out, why = p.stdout, None if p.returncode == 0 else f"child exited with {p.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"stopped at the time budget ({timeout:.0f} s)"
    rows: dict = {}  # a row is emitted again as values are added: its last line counts
    metas = []
    for line in out.splitlines():
        if line.startswith("@@row "):
            row = json.loads(line[6:])
            rows[row_key(row)] = row
        elif line.startswith("@@meta "):
            metas.append(json.loads(line[7:]))
    return list(rows.values()), metas, why


def tables(result: dict) -> str:
    """The markdown of a run: one table per workload (steps or batches per second, with the
    ratio to flashbax) and W5's grid (microseconds per step)."""
    from benchmarks.run import table
    from benchmarks.w5_scale import table as w5_table

    meta, rows = result["meta"], result["rows"]
    dev = meta.get("device", {})
    out = [
        (
            f"Device: {dev.get('device_kind', '?')} ({dev.get('platform', '?')}), JAX "
            f"{dev.get('jax')}, flashbax {dev.get('flashbax')}, torch {meta.get('torch')}, "
            f"torchrl {meta.get('torchrl')} (storage on {meta['cfg']['torch_device']}); "
            f"{meta['date']}, {meta['elapsed_s']:.0f} s, load "
            f"{meta['loadavg_before'][0]:.1f} -> {meta['loadavg_after'][0]:.1f}; host huge "
            f"pages {dev.get('hugepages', {}).get('thp')}."
        ),
        "",
    ]
    for wl in [w for w in WORKLOADS.values() if any(r["workload"] == w for r in rows)]:
        mine = [r for r in rows if r["workload"] == wl]
        modes = list(dict.fromkeys(r["mode"] for r in mine))  # rows come backend by backend
        timed = sorted((r for r in mine if "value" in r), key=lambda r: modes.index(r["mode"]))
        out += [f"### {wl}", "", table(timed, ("flashbax",)) if timed else "(nothing timed)"]
        if wl == "frames":
            out += [
                f"\n{r['backend']}, {r['mode']}: {1e6 / r['value']:.1f} us per step "
                "(goal: < 100 us on an H100/H200)"
                for r in timed
                if r["backend"] == FRB
            ]
        out += (
            [""]
            + [f"- {r['mode']} / {r['backend']}: {r['skipped']}" for r in mine if "value" not in r]
            + [""]
        )
    grid = [
        dict(
            sampler=r["sampler"],
            backend=f"{r['backend']} ({r['mode']})",
            size=r["size"],
            **(
                {"median_us": r["value"], "min_us": r["min"], "max_us": r["max"]}
                if "value" in r
                else {"reason": r.get("skipped", "?")}
            ),
        )
        for r in rows
        if r["workload"].startswith("W5")
    ]
    if grid:
        out += [
            "### W5: us per step (lower is better), median (min-max) of the blocks",
            "",
            w5_table(grid),
        ]
    return "\n".join(out) + "\n"


def run(args) -> dict:
    cfg = dict(TINY if args.tiny else FULL)
    if args.w5_sizes:
        cfg["w5_sizes"] = args.w5_sizes
    # --tiny runs TorchRL's buffers on the CPU (the code, not the figures); else on the GPU
    torch_why = None if args.tiny or _nvidia() else "no NVIDIA GPU on this machine"
    jobs = _jobs(args.sections, args.w5_samplers, args.w5_backends)
    ended = {" ".join(j): torch_why for j, _ in jobs if torch_why and j[:2] == ("w5", TORCH)}
    jobs = [(j, s) for j, s in jobs if " ".join(j) not in ended]
    # each job in a fresh process (GPU memory back, a crash contained); --tiny: one for all,
    # as starting JAX again for each would take longer than the jobs
    groups = [jobs] if args.tiny else [[j] for j in jobs]
    start, load0 = time.time(), os.getloadavg()
    end = start + args.budget_s
    rows, metas = [], {}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu.log", "w") as log:
        for i, group in enumerate(groups):
            shares = [sum(s for _, s in g) for g in groups[i:]]
            group_end = deadline_for(shares, end)
            names = [" ".join(j) for j, _ in group]
            spec = {
                "jobs": [[list(j), s] for j, s in group],
                "end": group_end,
                "cfg": cfg,
                "torch_why": torch_why,
            }
            log.write(f"== {', '.join(names)}\n")
            log.flush()
            now = time.time()
            got, got_metas, why = _launch(
                spec,
                _env(group[0][0], args.tiny, args.no_hugepages),
                max(group_end - now, 5) + GRACE_S,
                log,
            )
            rows += got
            metas.update({m["job"]: m for m in got_metas})
            ended.update({n: why for n in names if why})
            print(
                f"[gpu] {', '.join(names)}: {len(got)} rows in {time.time() - now:.0f} s"
                + (f" ({why})" if why else ""),
                file=sys.stderr,
                flush=True,
            )
    have = {row_key(r) for r in rows}
    for want in plan(cfg, args.sections, args.w5_samplers, args.w5_backends):
        if row_key(want) not in have:  # a child that died or ran out of time: say so
            job = (
                f"w5 {want['backend']} "
                if "size" in want
                else next(s for s, w in WORKLOADS.items() if w == want["workload"])
            )
            why = next((w for name, w in ended.items() if name.startswith(job) and w), None)
            rows.append(dict(want, skipped=why or "no result: see gpu.log"))
    first = next((m for m in metas.values() if m.get("platform")), {})
    torch_meta = next((m for m in metas.values() if m.get("torch")), {})
    return {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "tiny": args.tiny,
            "budget_s": args.budget_s,
            "elapsed_s": time.time() - start,
            "cfg": cfg,
            "device": first,
            "torch": torch_meta.get("torch"),
            "torchrl": torch_meta.get("torchrl"),
            "loadavg_before": load0,
            "loadavg_after": os.getloadavg(),
            "jobs": metas,
        },
        "rows": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)  # a child: one job, JSON spec
    ap.add_argument(
        "--out",
        type=pathlib.Path,
        default=_HERE / "results" / "gpu",
        help="directory for gpu.json, gpu.md and gpu.log",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="tiny sizes, on the CPU, in seconds (CI's check that this runs)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for all the measurements (default 450; --tiny: 240)",
    )
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--w5-samplers", nargs="+", choices=W5_SAMPLERS, default=list(W5_SAMPLERS))
    ap.add_argument("--w5-backends", nargs="+", choices=W5_BACKENDS, default=list(W5_BACKENDS))
    ap.add_argument(
        "--w5-sizes",
        nargs="+",
        type=lambda x: int(float(x)),
        help="W5 sizes, in the order to run them (default 1e4 1e8 1e9 1e6 1e5 1e7: the ends first)",
    )
    ap.add_argument(
        "--no-hugepages",
        action="store_true",
        help="FRB_HUGEPAGES=0 in the children (host buffers on 4 KiB pages)",
    )
    args = ap.parse_args(argv)
    if args.job:
        return child(json.loads(args.job))
    if args.budget_s is None:
        args.budget_s = 240.0 if args.tiny else 450.0
    result = run(args)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
    md = tables(result)
    (args.out / "gpu.md").write_text(md)
    print(md)
    print(f"{args.out / 'gpu.json'}\n{args.out / 'gpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
