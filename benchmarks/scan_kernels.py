"""Kernels per step of W5's ``lax.scan`` step, and its time, on whatever device JAX picks.

Inside ``lax.scan`` on a GPU a step costs about its number of kernel launches (NOTES.md,
"GPU"); this counts them. For each (backend, sampler, size) point it builds
``scale_backends.py``'s buffer, compiles W5's scan step and counts, in the body of the scan's
``while`` loop, the instructions that launch work (fusions, copies, custom calls, conditionals,
nested loops), then times the step (two warm-up calls, then blocks of ``--steps`` steps).

``--variant fast-path`` is an experiment, not a library mode: every ``jax.lax.cond`` traced while
the point is built and compiled takes its first branch, always. For the slice samplers that is
the draw without its exact fallback (correct only while every slice finds a record in its
``TRIES`` candidates, as in W5), so the difference to ``--variant as-is`` is what that
conditional costs a step.

    python benchmarks/scan_kernels.py --backends functional_rb flashbax \\
        --samplers slices ted --sizes 1e4 --out scan_kernels.json

On a lent GPU this ran as one command from the repository root (flashbax carried as a wheel,
see ``benchmarks/gpu.py``); ``--budget-s`` skips the points left once the time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import statistics
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/scan_kernels.py` from the checkout
    sys.path.append(str(_ROOT))

LAUNCHES = {
    "fusion": r" fusion\(",
    "copy": r" copy\(",
    "custom_call": r" custom-call\(",
    "conditional": r" conditional\(",
    "while": r" while\(",
}


def body_counts(hlo: str) -> dict:
    """Instructions of each kind in the body of the ``while`` loop that ENTRY runs (W5's
    scan), from a compiled module's text; ``lines``: the body's instructions in all."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif name and line.strip() not in ("", "}"):
            comps[name].append(line)
    loops = [line for line in comps.get("ENTRY", []) if " while(" in line]
    if not loops:
        raise ValueError("scan_kernels.body_counts: no while loop in ENTRY (is this a scan?)")
    body_name = re.search(r"body=%?([\w.\-]+)", loops[0])
    if body_name is None:
        raise ValueError(f"scan_kernels.body_counts: no body in {loops[0][:120]!r}")
    body = comps[body_name.group(1)]
    out = {k: sum(1 for line in body if re.search(p, line)) for k, p in LAUNCHES.items()}
    return dict(out, lines=len(body))


@contextlib.contextmanager
def _first_branch_always():
    import jax

    real = jax.lax.cond

    def first(pred, true_fun, false_fun, *operands, **kwargs):
        return true_fun(*operands)

    jax.lax.cond = first
    try:
        yield
    finally:
        jax.lax.cond = real


def point(backend: str, sampler: str, size: int, variant: str, steps: int, blocks: int) -> dict:
    from benchmarks import scale_backends as sb

    cls = {"functional_rb": sb.FunctionalRB, "flashbax": sb.Flashbax}[backend]
    row = {"backend": backend, "sampler": sampler, "size": size, "variant": variant}
    fast = _first_branch_always() if variant == "fast-path" else contextlib.nullcontext()
    with fast:
        b = cls(sampler, size, None)
        b.scan_steps(steps)  # traced and compiled here, under the variant
        row["kernels"] = body_counts(b.scan_hlo())
    b.block()
    b.scan_steps(steps)
    b.block()
    us = []
    for _ in range(blocks):
        t = time.perf_counter()
        b.scan_steps(steps)
        b.block()
        us.append((time.perf_counter() - t) / steps * 1e6)
    return dict(row, median_us=statistics.median(us), min_us=min(us), max_us=max(us))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["functional_rb", "flashbax"])
    ap.add_argument("--samplers", nargs="+", default=["slices", "ted"])
    ap.add_argument("--sizes", nargs="+", type=lambda x: int(float(x)), default=[10_000])
    ap.add_argument("--variants", nargs="+", choices=("as-is", "fast-path"), default=["as-is"])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    import jax

    start, rows = time.time(), []
    for backend in args.backends:
        for sampler in args.samplers:
            for size in args.sizes:
                for variant in args.variants if backend == "functional_rb" else ["as-is"]:
                    if time.time() - start > args.budget_s:
                        row = dict(backend=backend, sampler=sampler, size=size, variant=variant)
                        row["skipped"] = "time budget spent"
                    else:
                        row = point(backend, sampler, size, variant, args.steps, args.blocks)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "argv": sys.argv[1:]}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
