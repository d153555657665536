"""TorchRL's own programs (tutorials, the sota DQN CartPole script) run side by side as written
and with only their replay-buffer imports changed to ``functional_rb.adapters``: wall time,
ratio ours / TorchRL, and whether the seeded outputs are the same.

Each program is taken from a TorchRL checkout (``--rl DIR``) or from a bare git mirror
(``--mirror``, read with ``git show HEAD:path``), written twice into a scratch directory (as
written; imports changed by ``benchmarks/torchrl_examples.patch_imports``: every ``from
torchrl.data... import a, b`` imports the names ``functional_rb.adapters`` exports from it
instead), and both are run in fresh processes, interleaved (A B, then B A, ...), ``--rounds``
rounds. "Same output" compares the two programs' stdout and TorchRL logger messages (stderr),
lines that carry times or progress bars removed; it is only claimed where TorchRL's own runs
agree with each other
(``torchrl deterministic``), since a program that is not seeded throughout cannot match.

``--short`` applies each program's listed substitutions (fewer frames), the same to both.
``--imports`` instead times ``import torchrl.data`` against ``import functional_rb.adapters``
in fresh processes (interleaved) and lists what ``-X importtime`` charges to jax, jaxlib and
functional_rb's core.

Usage::

    python benchmarks/torchrl_programs.py --mirror /work/.mirror/pytorch+rl/repo --short
    python benchmarks/torchrl_programs.py --programs rb_tutorial --rounds 3
    python benchmarks/torchrl_programs.py --imports --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

from benchmarks.torchrl_examples import patch_imports

# name: (path in the TorchRL tree, extra argv, {regex: replacement} applied with --short)
PROGRAMS = {
    # --short: stop after 3000 frames; no video (rendering needs pygame) in either variant
    "getting-started-5": (
        "tutorials/sphinx-tutorials/getting-started-5.py",
        [],
        {
            r"if max_length > 200:": "if max_length > 200 or total_count >= 3000:",
            r"record_env = TransformedEnv\(\s*GymEnv\([^)]*from_pixels=True[^)]*\),"
            r"\s*video_recorder\s*\)": "record_env = None",
            r"record_env\.rollout\(max_steps=1000, policy=policy\)": "pass",
            r"video_recorder\.dump\(\)": "pass",
        },
    ),
    "rb_tutorial": ("tutorials/sphinx-tutorials/rb_tutorial.py", [], {}),
    "memory_efficient_rl": ("tutorials/sphinx-tutorials/memory_efficient_rl.py", [], {}),
    "coding_dqn": (
        "tutorials/sphinx-tutorials/coding_dqn.py",
        [],
        {r"total_frames = 5_000\b": "total_frames = 1_000"},
    ),
    "dqn_with_rnn": ("tutorials/sphinx-tutorials/dqn_with_rnn.py", [], {}),
    # needs hydra-core; its config: collector.total_frames etc. as hydra overrides
    "dqn_cartpole": (
        "sota-implementations/dqn/dqn_cartpole.py",
        [
            "logger.backend=",
            "collector.total_frames=3000",
            "collector.init_random_frames=1000",
            "collector.frames_per_batch=500",
            "loss.num_updates=10",
            "logger.test_interval=100000",
        ],
        {},
    ),
}
# files a program reads from its own folder
SIDECARS = {
    "dqn_cartpole": [
        "sota-implementations/dqn/config_cartpole.yaml",
        "sota-implementations/dqn/utils_cartpole.py",
    ]
}
# a TorchRL logger line: "<ESC>[92m<date> <time> [torchrl][INFO]<ESC>[0m message"
_LOGGER = re.compile(r"^.*?\[torchrl\]\[\w+\](\x1b\[0m)?\s*")
# lines that differ run to run whatever the seed: timings, progress bars, addresses
_VOLATILE = re.compile(
    r"(\d+(\.\d+)?\s*(s|ms|us|sec|seconds|it/s|s/it)\b|\d+:\d\d|%\||0x[0-9a-f]+"
    r"|\btime\b|elapsed|Elapsed)",
    re.IGNORECASE,
)


def _source(path, rl, mirror) -> str:
    if rl:
        return (pathlib.Path(rl) / path).read_text()
    return subprocess.run(
        ["git", "-C", str(mirror), "show", f"HEAD:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _prepare(name, args, ours, root) -> dict:
    """Both variants of ``name`` written under ``root``; {variant: script path}."""
    path, _, subs = PROGRAMS[name]
    src = _source(path, args.rl, args.mirror)
    if args.short:
        for pat, rep in subs.items():
            src, n = re.subn(pat, rep, src)
            if n == 0:
                raise SystemExit(
                    f"--short: {name}: pattern {pat!r} not found in {path}; "
                    "update PROGRAMS for this TorchRL version"
                )
    out = {}
    for variant, text in (("torchrl", src), ("frb", patch_imports(src, ours))):
        d = root / name / variant
        d.mkdir(parents=True, exist_ok=True)
        for side in SIDECARS.get(name, []):
            body = _source(side, args.rl, args.mirror)
            if variant == "frb" and side.endswith(".py"):
                body = patch_imports(body, ours)
            (d / pathlib.Path(side).name).write_text(body)
        (d / pathlib.Path(path).name).write_text(text)
        out[variant] = d / pathlib.Path(path).name
    return out


def _run(script: pathlib.Path, argv, timeout) -> dict:
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        JAX_PLATFORMS="cpu",
        MPLBACKEND="Agg",
        WANDB_MODE="disabled",
        TQDM_DISABLE="1",
    )
    t = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, script.name, *argv],
            cwd=script.parent,
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = "timeout", "", ""
    # what the program reports: stdout, and the messages of TorchRL's logger (on stderr)
    logged = [_LOGGER.sub("", x) for x in err.splitlines() if _LOGGER.search(x)]
    stable = "\n".join(x for x in out.splitlines() + logged if not _VOLATILE.search(x))
    return {
        "rc": rc,
        "seconds": round(time.perf_counter() - t, 2),
        "stdout_stable": stable,
        "reported_lines": len(out.splitlines()) + len(logged),
        "stderr_tail": err[-1500:],
    }


def programs(args) -> dict:
    from functional_rb import adapters

    ours = set(adapters.__all__)
    report = {}
    with tempfile.TemporaryDirectory(prefix="torchrl_programs_") as tmp:
        scripts = {n: _prepare(n, args, ours, pathlib.Path(tmp)) for n in args.programs}
        runs = {(n, v): [] for n in args.programs for v in ("torchrl", "frb")}
        for r in range(args.rounds):
            for n in args.programs:
                order = ("torchrl", "frb") if r % 2 == 0 else ("frb", "torchrl")
                for v in order:
                    res = _run(scripts[n][v], PROGRAMS[n][1], args.timeout)
                    runs[(n, v)].append(res)
                    print(
                        f"[round {r + 1}] {n:22s} {v:8s} rc={res['rc']!s:7s} "
                        f"{res['seconds']:7.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    for n in args.programs:
        t, f = runs[(n, "torchrl")], runs[(n, "frb")]
        ok = [(a["seconds"], b["seconds"]) for a, b in zip(t, f) if a["rc"] == 0 == b["rc"]]
        ratios = [b / a for a, b in ok]
        det = len({x["stdout_stable"] for x in t if x["rc"] == 0}) == 1 and len(t) > 1
        same = det and all(x["stdout_stable"] == t[0]["stdout_stable"] for x in f)
        report[n] = {
            "torchrl_rc": [x["rc"] for x in t],
            "frb_rc": [x["rc"] for x in f],
            "torchrl_s": [x["seconds"] for x in t],
            "frb_s": [x["seconds"] for x in f],
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "torchrl_deterministic": det,
            "same_output": same if det else None,
            "lines_compared": t[0]["reported_lines"],
            "first_difference": _first_diff(t[0]["stdout_stable"], f[0]["stdout_stable"]),
            "errors": {
                v: x["stderr_tail"].strip().splitlines()[-1:]
                for v, x in (("torchrl", t[-1]), ("frb", f[-1]))
                if x["rc"] != 0
            },
        }
    return report


def _first_diff(a: str, b: str):
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return {"line": i, "torchrl": x[:200], "frb": y[:200]}
    la, lb = len(a.splitlines()), len(b.splitlines())
    return None if la == lb else {"line": min(la, lb), "lines": [la, lb]}


def program_table(report) -> str:
    lines = [
        "| program | torchrl s (median) | frb s (median) | frb / torchrl (range) | seeded output |",
        "|---|---:|---:|---:|---|",
    ]
    for n, r in report.items():
        if r["ratio_median"] is None:
            why = "; ".join(f"{v}: {' '.join(e)}" for v, e in r["errors"].items())
            lines.append(f"| {n} | | | did not run | {why[:160]} |")
            continue
        same = {None: "torchrl not deterministic", True: "same", False: "differs"}[
            r["same_output"]
        ] + f" ({r['lines_compared']} lines)"
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {n} | {statistics.median(r['torchrl_s']):.1f} | "
            f"{statistics.median(r['frb_s']):.1f} | {r['ratio_median']:.2f} "
            f"({lo:.2f}-{hi:.2f}) | {same} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ imports
def imports(rounds: int) -> dict:
    stmts = {
        "torchrl.data": "import torchrl.data",
        "functional_rb.adapters": "import functional_rb.adapters",
        "torch + tensordict": "import torch, tensordict",
    }
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    times = {k: [] for k in stmts}
    for r in range(rounds):
        for k, s in stmts.items() if r % 2 == 0 else reversed(stmts.items()):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", s], check=True, env=env)
            times[k].append(time.perf_counter() - t)
    p = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import torch, tensordict; import functional_rb.adapters",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    self_us = {}
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            mod = m[4]
            top = (
                "functional_rb.adapters"
                if mod.startswith("functional_rb.adapters")
                else mod.split(".")[0]
            )
            self_us[top] = self_us.get(top, 0) + int(m[1])
    charged = {
        k: round(self_us.get(k, 0) / 1e6, 3)
        for k in (
            "jax",
            "jaxlib",
            "functional_rb",
            "functional_rb.adapters",
            "numpy",
            "scipy",
            "ml_dtypes",
            "opt_einsum",
        )
    }
    return {
        "seconds": {
            k: {
                "median": round(statistics.median(v), 3),
                "range": [round(min(v), 3), round(max(v), 3)],
            }
            for k, v in times.items()
        },
        "after_torch_and_tensordict_self_s": charged,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--rl", type=pathlib.Path, help="a checkout of pytorch/rl")
    src.add_argument(
        "--mirror",
        type=pathlib.Path,
        default=pathlib.Path("/work/.mirror/pytorch+rl/repo"),
        help="a bare git mirror of pytorch/rl (read at HEAD)",
    )
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", action="store_true", help="fewer frames (see PROGRAMS)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--imports", action="store_true", help="time the imports instead")
    ap.add_argument("--out", type=pathlib.Path, default=_HERE / "results" / "torchrl_programs.json")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    if args.imports:
        report = imports(args.rounds)
        print(json.dumps(report, indent=1))
    else:
        report = programs(args)
        print(program_table(report))
    print(
        f"\nload average {load0:.2f} before, {os.getloadavg()[0]:.2f} after; {args.rounds} rounds"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "load_before": load0,
                "load_after": os.getloadavg()[0],
                "report": report,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
