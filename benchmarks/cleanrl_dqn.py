"""CleanRL's own ``cleanrl/dqn.py``, as published and with only its buffer import changed.

CleanRL's script keeps its transitions in ``cleanrl_utils.buffers.ReplayBuffer`` (its copy of
SB3's). This runs the script from a CleanRL checkout twice per seed, once as published and once
with that one import line replaced by ``from functional_rb.sb3 import ReplayBuffer``, each run a
fresh process, the two sides alternating which goes first, torch on one thread
(``OMP_NUM_THREADS=1``). Reported per run: the process's wall time, the script's own last
``SPS`` line (steps per second of its loop) and the mean of its last 10 episodic returns (the
same on both sides: ours draws SB3's indices from NumPy's generator, which the script seeds).

CleanRL pins gymnasium 0.29 (under 1.x the script fails on ``infos["final_observation"]`` with
either buffer), so ``--python`` is an interpreter of an environment with CleanRL's
requirements and this repository installed::

    python benchmarks/cleanrl_dqn.py --cleanrl ~/cleanrl --python ~/venv-gym029/bin/python \\
        --seeds 1 2 3 --steps 50000 --out benchmarks/results/cleanrl_dqn.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
THEIRS = "from cleanrl_utils.buffers import ReplayBuffer"
OURS = "from functional_rb.sb3 import ReplayBuffer"


def script_with_our_buffer(source: str) -> str:
    """``source`` with its one buffer import replaced; raises if it is not there once."""
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == THEIRS]
    if len(hits) != 1:
        raise SystemExit(
            f"cleanrl_dqn: expected the line {THEIRS!r} once in dqn.py, found {len(hits)}; "
            "point --cleanrl at a CleanRL checkout whose dqn.py imports its vendored buffer."
        )
    lines[hits[0]] = lines[hits[0]].replace(THEIRS, OURS)
    return "".join(lines)


def parse(stdout: str) -> dict:
    """The script's last ``SPS`` figure and the mean of its last 10 episodic returns."""
    sps = [int(x) for x in re.findall(r"^SPS: (\d+)", stdout, re.M)]
    returns = [float(x) for x in re.findall(r"episodic_return=\[?([0-9.]+)", stdout)]
    return {
        "sps": sps[-1] if sps else None,
        "episodes": len(returns),
        "return_last10": sum(returns[-10:]) / len(returns[-10:]) if returns else None,
    }


def run(python: str, script: pathlib.Path, cleanrl: pathlib.Path, seed: int, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(cleanrl), str(ROOT), env.get("PYTHONPATH", "")])
    argv = [python, str(script), "--seed", str(seed), "--total-timesteps", str(steps)]
    argv += ["--no-track", "--no-capture-video"]
    with tempfile.TemporaryDirectory() as cwd:  # the script's tensorboard runs/ land here
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"cleanrl_dqn: {script.name} seed {seed} failed:\n{done.stderr[-3000:]}")
    out = {"seed": seed, "wall_s": wall, "load_before": load, "load_after": os.getloadavg()[0]}
    return {**out, **parse(done.stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleanrl", type=pathlib.Path, required=True, help="a CleanRL checkout")
    ap.add_argument("--python", default=sys.executable, help="interpreter to run it with")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    source = (args.cleanrl / "cleanrl" / "dqn.py").read_text()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: dict = {"cleanrl": [], "functional_rb": []}
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {
            "cleanrl": args.cleanrl / "cleanrl" / "dqn.py",
            "functional_rb": pathlib.Path(tmp) / "dqn_functional_rb.py",
        }
        scripts["functional_rb"].write_text(script_with_our_buffer(source))
        for i, seed in enumerate(args.seeds):
            for side in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                path = scripts[side]
                r = run(args.python, path, args.cleanrl, seed, args.steps)
                runs[side].append(r)
                print(
                    f"seed {seed} {side:14s} wall {r['wall_s']:5.1f} s  SPS {r['sps']}  "
                    f"last-10 return {r['return_last10']}  load {r['load_before']:.2f}"
                    f"->{r['load_after']:.2f}",
                    flush=True,
                )
    report = {"benchmark": "cleanrl_dqn", "started": started, "steps": args.steps, "runs": runs}
    report["ended"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
