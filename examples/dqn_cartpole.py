"""DQN on gymnax CartPole-v1: the whole training is ONE ``jax.jit`` call around ``lax.scan``.

    python examples/dqn_cartpole.py                 # default run (seed 0), a few minutes on 2 CPUs
    python examples/dqn_cartpole.py --seed 3
    python examples/dqn_cartpole.py --quick         # tiny smoke run (does not check the return)

Everything that touches the replay buffer goes through functional_rb's public API:
``frb.ReplayBuffer``, ``rb.init`` / ``rb.add`` / ``rb.sample`` / ``rb.can_sample`` / ``rb.size``,
``frb.Sample``. The Q-network is a plain-JAX MLP with LayerNorm (params are a PyTree) trained
with optax: Double DQN, Huber loss, a Polyak-averaged target network, Adam with a learning
rate that decays linearly to 0, large batches from a buffer that holds the whole run.
``num_envs`` CartPole environments run side by side with ``jax.vmap``; each vectorized step
adds ``[num_envs]`` transitions to an ``ndim=1`` buffer and takes ``updates_per_step``
updates.

``run_training`` is the one jitted function (its ``TrainState`` — networks, optimizer, buffer,
environments, key — is donated, so the buffer is updated in place). It is an outer
``lax.scan`` over ``num_chunks`` chunks; each chunk is an inner ``lax.scan`` over
``steps_per_chunk`` vectorized steps (collect, add, sample, learn), then a greedy check of the
current params on ``select_episodes`` episodes, then one progress line printed from inside the
compiled loop with ``jax.debug.callback(..., ordered=True)``.

Result: DQN's greedy policy on CartPole can dip between good phases, so the params with the
best greedy check so far are kept in the scan carry as the best checkpoint (later params win
ties), as evaluation callbacks do. The reported result is a greedy evaluation of that
checkpoint on ``eval_episodes`` fresh episodes (vmapped, at most 500 steps each), also inside
the jitted call; the last params are evaluated on the same episodes and printed too. The last
line is ``final average return: X``, and the script exits with status 1 when ``X < --target``
(450 by default), so a run that did not learn does not look like success.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Any, NamedTuple

import gymnax
import jax
import jax.numpy as jnp
import optax

import functional_rb as frb

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters. Frozen and hashable: it is a static argument of the jitted function."""

    seed: int = 0
    total_steps: int = 300_000  # environment steps, summed over all envs
    num_envs: int = 4
    # the whole run fits: early failure states stay in replay, so the network does not
    # forget them once the policy only produces long balanced episodes
    buffer_capacity: int = 300_000  # transitions
    # large batches: less gradient noise late in training, where DQN's greedy policy is fragile
    batch_size: int = 512
    learning_starts: int = 1_000  # environment steps before the first update
    updates_per_step: int = 2  # gradient updates per vectorized step
    gamma: float = 0.99
    lr: float = 5e-4
    lr_end_fraction: float = 0.0  # the learning rate decays linearly to lr * this
    max_grad_norm: float = 10.0
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_fraction: float = 0.1  # fraction of total_steps over which epsilon anneals
    tau: float = 0.005  # after every update: target <- tau*online + (1-tau)*target
    hidden: tuple[int, ...] = (128, 128)
    num_chunks: int = 20  # progress lines and greedy checks
    select_episodes: int = 64  # greedy episodes per chunk that pick the best checkpoint
    eval_episodes: int = 64  # fresh greedy episodes of the final evaluation

    @property
    def steps_per_chunk(self) -> int:
        """Vectorized steps (each: num_envs environment steps, updates_per_step updates)."""
        return max(1, self.total_steps // (self.num_envs * self.num_chunks))

    @property
    def env_steps_total(self) -> int:
        return self.num_envs * self.steps_per_chunk * self.num_chunks

    @property
    def num_updates_total(self) -> int:
        return self.steps_per_chunk * self.num_chunks * self.updates_per_step


QUICK = dict(
    total_steps=4_000,
    num_envs=4,
    buffer_capacity=2_000,
    batch_size=32,
    learning_starts=400,
    num_chunks=4,
    select_episodes=4,
    eval_episodes=4,
    hidden=(32, 32),
)


# ----------------------------------------------------------------------------- Q-network
def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    """Params of an MLP with layer sizes ``sizes`` (inputs first): a list of {'w', 'b'}."""
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes, sizes[1:])):
        w = jax.random.normal(k, (n_in, n_out), jnp.float32) * jnp.sqrt(2.0 / n_in)
        params.append({"w": w, "b": jnp.zeros((n_out,), jnp.float32)})
    return params


def q_values(params: list[dict[str, jax.Array]], obs: jax.Array) -> jax.Array:
    """obs float32 ``[B, 4]`` -> Q-values float32 ``[B, num_actions]``.

    Each hidden layer is normalized (LayerNorm without learned scale/offset) before its ReLU:
    bounded features keep the bootstrapped targets from chasing their own growth, which is
    what makes DQN's greedy policy on CartPole collapse late in training (see Gallici et al.,
    "Simplifying Deep Temporal Difference Learning", 2024).
    """
    x = obs
    for layer in params[:-1]:
        h = x @ layer["w"] + layer["b"][None, :]
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        x = jax.nn.relu(h)
    return x @ params[-1]["w"] + params[-1]["b"][None, :]


# ----------------------------------------------------------------------------- state
class TrainState(NamedTuple):
    params: PyTree  # online Q-network
    target_params: PyTree  # target Q-network (Polyak average of the online one)
    opt_state: PyTree  # optax state
    buffer: frb.BufferState  # the replay buffer
    env_state: PyTree  # gymnax states, leaves [num_envs, ...]
    obs: jax.Array  # float32 [num_envs, 4]: current observations
    ep_return: jax.Array  # float32 [num_envs]: return so far of each running episode
    key: jax.Array  # PRNG key
    step: jax.Array  # int32 []: vectorized steps taken
    num_updates: jax.Array  # int32 []: gradient updates taken


class ChunkMetrics(NamedTuple):
    """One chunk's numbers (scalars; ``run_training`` stacks them to ``[num_chunks]``)."""

    env_steps: jax.Array  # int32 []: environment steps so far (all envs)
    return_sum: jax.Array  # float32 []: sum of the returns of episodes completed in the chunk
    episodes: jax.Array  # int32 []: episodes completed in the chunk
    loss: jax.Array  # float32 []: mean TD loss over the chunk's updates (0 if none)
    updates: jax.Array  # int32 []: updates in the chunk
    greedy_return: jax.Array  # float32 []: mean greedy return of the chunk's last params
    buffer_size: jax.Array  # int32 []: transitions stored


class TrainResult(NamedTuple):
    state: TrainState  # the last state (last params, full buffer, ...)
    best_params: PyTree  # params with the best greedy check (the checkpoint)
    best_score: jax.Array  # float32 []: that check's mean greedy return
    best_chunk: jax.Array  # int32 []: the chunk (0-based) after which it was taken
    history: ChunkMetrics  # leaves [num_chunks]
    eval_returns: jax.Array  # float32 [eval_episodes]: best params on fresh episodes
    last_returns: jax.Array  # float32 [eval_episodes]: last params on the same episodes


def make_env():
    env, env_params = gymnax.make("CartPole-v1")
    return env, env_params


def make_buffer(cfg: Config) -> frb.ReplayBuffer:
    return frb.ReplayBuffer(capacity=cfg.buffer_capacity, batch_size=cfg.batch_size)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    # a learning rate that ends near 0 freezes the params at the end of training, so the last
    # params are as good as the recent ones instead of drifting into one of DQN's dips
    schedule = optax.linear_schedule(
        cfg.lr, cfg.lr * cfg.lr_end_fraction, transition_steps=cfg.num_updates_total
    )
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(schedule, eps=1e-5))


def example_transition() -> dict[str, jax.Array]:
    """ONE transition (no batch axis): what ``rb.init`` needs to allocate the storage."""
    return {
        "obs": jnp.zeros((4,), jnp.float32),
        "action": jnp.int32(0),
        "reward": jnp.float32(0.0),
        "next_obs": jnp.zeros((4,), jnp.float32),
        "terminated": jnp.bool_(False),
    }


def init_state(cfg: Config) -> TrainState:
    """The state before training: random network, empty buffer, reset environments."""
    env, env_params = make_env()
    key = jax.random.key(cfg.seed)
    key, k_net, k_env = jax.random.split(key, 3)
    params = init_mlp(k_net, (4, *cfg.hidden, env.num_actions))
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_env, cfg.num_envs), env_params
    )
    return TrainState(
        params=params,
        target_params=jax.tree_util.tree_map(jnp.copy, params),
        opt_state=make_optimizer(cfg).init(params),
        buffer=make_buffer(cfg).init(example_transition()),
        env_state=env_state,
        obs=obs,
        ep_return=jnp.zeros((cfg.num_envs,), jnp.float32),
        key=key,
        step=jnp.int32(0),
        num_updates=jnp.int32(0),
    )


# ----------------------------------------------------------------------------- learning
def td_loss(params, target_params, sample: frb.Sample, gamma: float) -> jax.Array:
    """Double-DQN Huber loss (float32 ``[]``) of a sampled batch, weighted by ``sample.weights``.

    ``weights`` are 1 for the uniform sampler and 0 where ``mask`` is False, so the same code
    is right for prioritized samplers and for batches drawn before the buffer could sample.
    """
    d = sample.data
    q = jnp.take_along_axis(q_values(params, d["obs"]), d["action"][:, None], axis=1)[:, 0]
    next_action = jnp.argmax(q_values(params, d["next_obs"]), axis=1)
    next_q = jnp.take_along_axis(
        q_values(target_params, d["next_obs"]), next_action[:, None], axis=1
    )[:, 0]
    # Bootstrap through time-limit truncations: only a real termination has no future value.
    target = d["reward"] + gamma * (1.0 - d["terminated"].astype(jnp.float32)) * next_q
    err = optax.huber_loss(q, jax.lax.stop_gradient(target))
    return jnp.sum(sample.weights * err) / jnp.maximum(jnp.sum(sample.weights), 1.0)


def epsilon(cfg: Config, step: jax.Array) -> jax.Array:
    """Exploration rate (float32 ``[]``) after ``step`` vectorized steps: linear decay."""
    frac = (step * cfg.num_envs) / max(1.0, cfg.eps_fraction * cfg.total_steps)
    return cfg.eps_start + (cfg.eps_end - cfg.eps_start) * jnp.clip(frac, 0.0, 1.0)


def _one_step(cfg: Config, ts: TrainState, _):
    """One vectorized step: act, step the envs, add to the buffer, sample and learn.

    Returns the new state and float32/int32 scalars: (sum of returns of the episodes that
    ended, number of them, sum of the TD losses, number of updates).
    """
    env, env_params = make_env()
    rb = make_buffer(cfg)
    opt = make_optimizer(cfg)
    key, k_eps, k_rand, k_env, k_sample = jax.random.split(ts.key, 5)

    # collect: epsilon-greedy on all envs at once
    greedy = jnp.argmax(q_values(ts.params, ts.obs), axis=1).astype(jnp.int32)
    random_action = jax.random.randint(k_rand, (cfg.num_envs,), 0, env.num_actions, jnp.int32)
    explore = jax.random.uniform(k_eps, (cfg.num_envs,)) < epsilon(cfg, ts.step)
    action = jnp.where(explore, random_action, greedy)
    obs, env_state, reward, terminated, truncated, info = jax.vmap(
        env.step, in_axes=(0, 0, 0, None)
    )(jax.random.split(k_env, cfg.num_envs), ts.env_state, action, env_params)
    done = terminated | truncated

    # add: [num_envs] transitions; next_obs is the pre-reset observation
    transitions = {
        "obs": ts.obs,
        "action": action,
        "reward": reward.astype(jnp.float32),
        "next_obs": info["final_observation"],
        "terminated": terminated,
    }
    buffer = rb.add(ts.buffer, transitions)

    # sample + learn, once the buffer holds enough
    def learn_once(carry, k):
        params, target_params, opt_state, buffer, num_updates = carry
        sample, buffer = rb.sample(buffer, k)
        loss, grads = jax.value_and_grad(td_loss)(params, target_params, sample, cfg.gamma)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # Polyak averaging: the target moves a little every update instead of jumping every
        # few hundred, so the regression target never changes abruptly
        target_params = optax.incremental_update(params, target_params, cfg.tau)
        return (params, target_params, opt_state, buffer, num_updates + 1), loss

    def learn(carry):
        carry, losses = jax.lax.scan(
            learn_once, carry, jax.random.split(k_sample, cfg.updates_per_step)
        )
        return carry, (jnp.sum(losses), jnp.int32(cfg.updates_per_step))

    def skip(carry):
        return carry, (jnp.float32(0.0), jnp.int32(0))

    ready = rb.can_sample(buffer) & ((ts.step + 1) * cfg.num_envs >= cfg.learning_starts)
    (params, target_params, opt_state, buffer, num_updates), (loss, updated) = jax.lax.cond(
        ready, learn, skip, (ts.params, ts.target_params, ts.opt_state, buffer, ts.num_updates)
    )

    ep_return = ts.ep_return + reward
    finished = jnp.where(done, ep_return, 0.0)
    ts = ts._replace(
        params=params,
        target_params=target_params,
        opt_state=opt_state,
        buffer=buffer,
        env_state=env_state,
        obs=obs,
        ep_return=jnp.where(done, 0.0, ep_return),
        key=key,
        step=ts.step + 1,
        num_updates=num_updates,
    )
    return ts, (jnp.sum(finished), jnp.sum(done.astype(jnp.int32)), loss, updated)


def greedy_returns(params, key: jax.Array, num_episodes: int) -> jax.Array:
    """Returns float32 ``[num_episodes]`` of the greedy policy on fresh episodes (<= 500 steps)."""
    env, env_params = make_env()
    k_reset, k_steps = jax.random.split(key)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_reset, num_episodes), env_params
    )

    def step(carry, k):
        obs, env_state, alive, ret = carry
        action = jnp.argmax(q_values(params, obs), axis=1).astype(jnp.int32)
        obs, env_state, reward, terminated, truncated, _ = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(k, num_episodes), env_state, action, env_params)
        ret = ret + jnp.where(alive, reward, 0.0)
        # env.step auto-resets; count only each env's first episode
        alive = alive & ~(terminated | truncated)
        return (obs, env_state, alive, ret), None

    carry = (
        obs,
        env_state,
        jnp.ones((num_episodes,), bool),
        jnp.zeros((num_episodes,), jnp.float32),
    )
    (_, _, _, ret), _ = jax.lax.scan(
        step, carry, jax.random.split(k_steps, env_params.max_steps_in_episode)
    )
    return ret


# ----------------------------------------------------------------------------- progress
class _Clock:
    """Host-side wall clock of the progress lines.

    The compiled ``run_training`` is cached per ``Config``, so its callback must not close over
    per-run objects; ``train`` restarts this module-level clock before each call instead.
    """

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def restart(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> tuple[float, float]:
        """(seconds since restart, seconds since the previous lap)."""
        now = time.perf_counter()
        elapsed, dt, self.last = now - self.start, now - self.last, now
        return elapsed, dt


_CLOCK = _Clock()


def _print_progress(chunk_env_steps: int, m: ChunkMetrics) -> None:
    """Host callback: one progress line per chunk (``m`` holds NumPy scalars)."""
    elapsed, dt = _CLOCK.lap()
    avg = float(m.return_sum) / max(int(m.episodes), 1)
    print(
        f"steps {int(m.env_steps):>8,}  episodes {int(m.episodes):>5}  "
        f"avg return {avg:6.1f}  greedy {float(m.greedy_return):6.1f}  "
        f"loss {float(m.loss):7.4f}  buffer {int(m.buffer_size):>6}  "
        f"{chunk_env_steps / max(dt, 1e-9):7,.0f} steps/s  {elapsed:6.1f} s",
        flush=True,
    )


# ----------------------------------------------------------------------------- training
@functools.partial(jax.jit, static_argnums=(0, 2), donate_argnums=1)
def run_training(cfg: Config, ts: TrainState, verbose: bool = True) -> TrainResult:
    """The whole training and the final evaluation in one compiled call; ``ts`` is donated.

    An outer ``lax.scan`` over ``cfg.num_chunks`` chunks; each runs ``cfg.steps_per_chunk``
    vectorized steps (inner ``lax.scan``), checks the greedy policy on
    ``cfg.select_episodes`` episodes, keeps the params if their mean return is at least the
    best so far (later params win ties) and, if ``verbose``, prints a progress line from
    inside the compiled loop through an ordered ``jax.debug.callback`` (ordered: the lines
    come out in chunk order, while the run goes on).
    """
    rb = make_buffer(cfg)

    def chunk(carry, i):
        ts, best_params, best_score, best_chunk = carry
        ts, (ret, eps, loss, upd) = jax.lax.scan(
            functools.partial(_one_step, cfg), ts, None, length=cfg.steps_per_chunk
        )
        key, k_check = jax.random.split(ts.key)
        ts = ts._replace(key=key)
        score = jnp.mean(greedy_returns(ts.params, k_check, cfg.select_episodes))
        better = score >= best_score
        best_params = jax.tree_util.tree_map(
            lambda new, old: jnp.where(better, new, old), ts.params, best_params
        )
        best_score = jnp.where(better, score, best_score)
        best_chunk = jnp.where(better, i, best_chunk)
        n_upd = jnp.sum(upd)
        m = ChunkMetrics(
            env_steps=ts.step * cfg.num_envs,
            return_sum=jnp.sum(ret),
            episodes=jnp.sum(eps),
            loss=jnp.sum(loss) / jnp.maximum(n_upd, 1).astype(jnp.float32),
            updates=n_upd,
            greedy_return=score,
            buffer_size=rb.size(ts.buffer),
        )
        if verbose:
            jax.debug.callback(
                functools.partial(_print_progress, cfg.num_envs * cfg.steps_per_chunk),
                m,
                ordered=True,
            )
        return (ts, best_params, best_score, best_chunk), m

    # -inf: the first check always becomes the checkpoint
    init = (ts, ts.params, jnp.float32(-jnp.inf), jnp.int32(-1))
    (ts, best_params, best_score, best_chunk), history = jax.lax.scan(
        chunk, init, jnp.arange(cfg.num_chunks, dtype=jnp.int32)
    )
    # fresh episodes, from a stream apart from training's: not the ones that chose the checkpoint
    eval_key = jax.random.fold_in(jax.random.key(cfg.seed), 1)
    return TrainResult(
        state=ts,
        best_params=best_params,
        best_score=best_score,
        best_chunk=best_chunk,
        history=history,
        eval_returns=greedy_returns(best_params, eval_key, cfg.eval_episodes),
        last_returns=greedy_returns(ts.params, eval_key, cfg.eval_episodes),
    )


def train(cfg: Config, verbose: bool = True) -> dict[str, Any]:
    """Run DQN (one ``run_training`` call). Returns a dict: ``state`` (last ``TrainState``),
    ``history`` (one dict per chunk), ``best_params``, ``best_score``, ``best_chunk``
    (0-based), ``eval_returns`` (float32 ``[cfg.eval_episodes]``: the checkpoint on fresh
    episodes, the reported result), ``last_returns`` (the last params on the same episodes),
    ``final_return`` (mean of ``eval_returns``) and ``seconds`` (wall time, compilation
    included).
    """
    # eager on purpose: under jit XLA may round the initial weights differently (1 ulp),
    # and RL training amplifies that, so the documented runs would no longer reproduce
    ts = init_state(cfg)
    if verbose:
        print(
            f"DQN CartPole-v1: {cfg.num_envs} envs x {cfg.num_chunks} chunks x "
            f"{cfg.steps_per_chunk} steps = {cfg.env_steps_total:,} env steps, "
            f"{cfg.updates_per_step} update(s) per step, seed {cfg.seed} "
            f"(the first line includes compilation)",
            flush=True,
        )
    _CLOCK.restart()
    out = run_training(cfg, ts, verbose)
    # the state stays on the device (its key is a typed PRNG key); the numbers come to host
    h, best_score, best_chunk, r, last = jax.device_get(
        (out.history, out.best_score, out.best_chunk, out.eval_returns, out.last_returns)
    )
    jax.effects_barrier()  # every progress line is printed before the summary
    seconds = time.perf_counter() - _CLOCK.start
    history = [
        dict(
            env_steps=int(h.env_steps[i]),
            episodes=int(h.episodes[i]),
            avg_return=float(h.return_sum[i]) / max(int(h.episodes[i]), 1),
            loss=float(h.loss[i]),
            updates=int(h.updates[i]),
            greedy_return=float(h.greedy_return[i]),
            buffer_size=int(h.buffer_size[i]),
        )
        for i in range(cfg.num_chunks)
    ]
    return dict(
        state=out.state,
        history=history,
        best_params=out.best_params,
        best_score=float(best_score),
        best_chunk=int(best_chunk),
        eval_returns=r,
        last_returns=last,
        final_return=float(r.mean()),
        seconds=seconds,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help=f"environment steps over all envs (default {Config.total_steps:,})",
    )
    p.add_argument("--num-envs", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny smoke run; skips the return check")
    p.add_argument(
        "--target",
        type=float,
        default=450.0,
        help="exit 1 if the final greedy average return is below this",
    )
    args = p.parse_args(argv)
    kw = dict(QUICK) if args.quick else {}
    kw["seed"] = args.seed
    if args.total_steps is not None:
        kw["total_steps"] = args.total_steps
    if args.num_envs is not None:
        kw["num_envs"] = args.num_envs
    cfg = Config(**kw)
    out = train(cfg)
    r, last = out["eval_returns"], out["last_returns"]
    chosen = out["history"][out["best_chunk"]]["env_steps"]
    print(
        f"wall time {out['seconds']:.1f} s; greedy evaluation on {cfg.eval_episodes} fresh "
        f"episodes: last params {last.mean():.1f}; best checkpoint (after {chosen:,} steps, "
        f"greedy {out['best_score']:.1f} when chosen) {r.mean():.1f}, "
        f"min {r.min():.0f}, max {r.max():.0f}"
    )
    print(f"final average return: {out['final_return']:.1f}")
    if args.quick:
        return 0
    if out["final_return"] < args.target:
        print(
            f"FAILED: final average return {out['final_return']:.1f} < {args.target}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
