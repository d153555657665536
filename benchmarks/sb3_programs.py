"""SB3 training runs with SB3's replay buffer, with ours, and with ours prioritized.

The same SB3 program (rl-zoo's hyperparameters) runs once per buffer and seed, each run in a
fresh process, the buffers interleaved and their order rotated from seed to seed, the load
average read before and after each run. The runs of a seed differ only in
``replay_buffer_class`` (and, for ``per``, :func:`functional_rb.sb3.use_priorities`).
Reported per run: the mean return of the final policy over 20 evaluation episodes
(deterministic) and the wall time of ``learn``; per buffer, the mean over seeds; per seed, the
ratio of ours' ``learn`` time to SB3's (below 1: ours is faster):

    python benchmarks/sb3_programs.py                      # DQN CartPole, seeds 0-2
    python benchmarks/sb3_programs.py --algo sac --seeds 0 1   # SAC / TD3 on Pendulum-v1
    python benchmarks/sb3_programs.py --quick              # tiny smoke run, not a result
    python benchmarks/sb3_programs.py --out benchmarks/results/sb3_programs_dqn.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUFFERS = ("sb3", "functional_rb", "functional_rb_per")

# rl-zoo's tuned hyperparameters (hyperparams/dqn.yml, sac.yml, td3.yml) for these environments
SETTINGS = {
    "dqn": dict(
        env="CartPole-v1",
        steps=50_000,
        kwargs=dict(
            learning_rate=2.3e-3,
            batch_size=64,
            buffer_size=100_000,
            learning_starts=1000,
            gamma=0.99,
            target_update_interval=10,
            train_freq=256,
            gradient_steps=128,
            exploration_fraction=0.16,
            exploration_final_eps=0.04,
            policy_kwargs=dict(net_arch=[256, 256]),
        ),
    ),
    "sac": dict(env="Pendulum-v1", steps=20_000, kwargs=dict(learning_rate=1e-3)),
    # td3.yml's Pendulum-v1 (its action noise: normal, sigma 0.1, built in the child)
    "td3": dict(
        env="Pendulum-v1",
        steps=20_000,
        kwargs=dict(
            gamma=0.98,
            buffer_size=200_000,
            learning_starts=10_000,
            gradient_steps=1,
            train_freq=1,
            learning_rate=1e-3,
            policy_kwargs=dict(net_arch=[400, 300]),
        ),
        action_noise=0.1,
    ),
}

_CHILD = r"""
import json, sys, time
import numpy as np
from stable_baselines3 import DQN, SAC, TD3
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.evaluation import evaluate_policy
algo, buffer, seed, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
setting = json.loads(sys.argv[6])
kwargs = dict(setting["kwargs"], seed=seed)
if "action_noise" in setting:
    kwargs["action_noise"] = NormalActionNoise(np.zeros(1), setting["action_noise"] * np.ones(1))
if buffer == "functional_rb":
    from functional_rb.sb3 import ReplayBuffer
    kwargs["replay_buffer_class"] = ReplayBuffer
elif buffer == "functional_rb_per":
    from functional_rb.sb3 import PrioritizedReplayBuffer
    kwargs["replay_buffer_class"] = PrioritizedReplayBuffer
    kwargs["replay_buffer_kwargs"] = dict(alpha=0.6, beta=0.4,
                                          beta_schedule=lambda p: 1.0 - 0.6 * p)
model = {"dqn": DQN, "sac": SAC, "td3": TD3}[algo]("MlpPolicy", setting["env"], **kwargs)
if buffer == "functional_rb_per":
    from functional_rb.sb3 import use_priorities
    use_priorities(model)
t = time.perf_counter()
model.learn(steps)
learn_s = time.perf_counter() - t
mean, std = evaluate_policy(model, model.get_env(), n_eval_episodes=20, deterministic=True)
json.dump({"return": float(mean), "return_std": float(std), "learn_s": learn_s}, open(out, "w"))
"""


def run_once(algo: str, buffer: str, seed: int, steps: int) -> dict:
    """One fresh process; its figures and the load average around it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out.json"
        setting = json.dumps(SETTINGS[algo])
        cmd = [sys.executable, "-c", _CHILD, algo, buffer, str(seed), str(steps), str(out), setting]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            raise RuntimeError(
                f"sb3_programs: {algo} {buffer} seed {seed} failed:\n" + "\n".join(tail)
            )
        result = json.loads(out.read_text())
    result.update(load_before=load, load_after=os.getloadavg()[0])
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=sorted(SETTINGS), default="dqn")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="default: rl-zoo's budget")
    p.add_argument("--buffers", nargs="+", choices=BUFFERS, default=list(BUFFERS))
    p.add_argument("--quick", action="store_true", help="a few hundred steps: a smoke run")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    steps = 1500 if args.quick else args.steps or SETTINGS[args.algo]["steps"]
    runs: dict = {b: [] for b in args.buffers}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for i, seed in enumerate(args.seeds):
        order = args.buffers[i % len(args.buffers) :] + args.buffers[: i % len(args.buffers)]
        for buffer in order:
            r = run_once(args.algo, buffer, seed, steps)
            runs[buffer].append(dict(seed=seed, **r))
            print(
                f"{args.algo} seed {seed} {buffer:18s} return {r['return']:7.1f}  learn "
                f"{r['learn_s']:6.1f} s  load {r['load_before']:.2f}->{r['load_after']:.2f}",
                flush=True,
            )
    summary = {
        b: dict(
            mean_return=statistics.fmean(r["return"] for r in rs),
            mean_learn_s=statistics.fmean(r["learn_s"] for r in rs),
        )
        for b, rs in runs.items()
    }
    if "sb3" in runs:
        for b, rs in runs.items():
            summary[b]["learn_time_vs_sb3"] = [
                r["learn_s"] / s["learn_s"] for r, s in zip(rs, runs["sb3"])
            ]
    result = dict(
        algo=args.algo,
        env=SETTINGS[args.algo]["env"],
        steps=steps,
        started=started,
        finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        quick=args.quick,
        runs=runs,
        summary=summary,
    )
    for b, s in summary.items():
        ratios = s.get("learn_time_vs_sb3", [])
        print(
            f"{b:18s} mean return {s['mean_return']:7.1f}  mean learn {s['mean_learn_s']:6.1f} s"
            + (f"  vs sb3 {', '.join(f'{x:.2f}x' for x in ratios)}" if ratios else "")
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
