"""DQN on CartPole data-parallel over 8 devices, with one sharded prioritized replay buffer.

    python examples/dqn_sharded.py            # 8 fake CPU devices (the script asks JAX for them)
    python examples/dqn_sharded.py --quick    # tiny smoke run (does not check the return)

The DQN of ``examples/dqn_cartpole.py`` (its Q-network, optimizer, environments and greedy
evaluation are imported from there) in the Anakin pattern: the whole training is one
``jax.jit`` of one ``jax.shard_map`` over a mesh axis ``"data"`` of 8 devices. Each device
runs its own CartPole environments and holds one shard of the buffer; every update,

* each device adds its transitions to its own shard (no communication),
* each device draws its part of one global prioritized batch,
  ``rb.sample(local, key, axis_name="data")``: rows from every shard in proportion to the
  global priorities, importance weights with the global minimum (exactly what one buffer
  holding all shards would draw; the rows that live elsewhere travel by ``all_to_all``),
* gradients are averaged over the devices (``lax.pmean``), so the replicated parameters stay
  identical,
* each device sends its new priorities (``|TD error|``) to the shards owning those items,
  ``rb.update(local, indices, priorities, axis_name="data")``.

With fake CPU devices the 8 "devices" share this machine's cores: the point is the program,
which runs unchanged on 8 accelerators (or on several hosts with ``jax.distributed``). The
last line is ``final average return: X``; the script exits with status 1 when ``X < 450``.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count="
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts: 8 CPU devices
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}8".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import functional_rb as frb  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from dqn_cartpole import greedy_returns, init_mlp, make_env, q_values  # noqa: E402

PyTree = Any
AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters (frozen: a static argument of the jitted function). Per-device numbers
    are ``*_per_device``; the run as a whole matches dqn_cartpole.py's: 300k environment steps,
    global batches of 512, one update per two environment steps."""

    seed: int = 0
    devices: int = 8
    total_steps: int = 300_000  # environment steps, all devices
    envs_per_device: int = 1
    capacity_per_device: int = 37_500  # the whole run fits in the 8 shards
    batch_per_device: int = 64  # global batch 512
    learning_starts: int = 1_000
    updates_per_step: int = 4  # per vectorized step of 8 envs: 0.5 per env step
    gamma: float = 0.99
    lr: float = 5e-4
    max_grad_norm: float = 10.0
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_fraction: float = 0.1
    tau: float = 0.005
    alpha: float = 0.6  # prioritized replay (Schaul et al.)
    beta_start: float = 0.4  # annealed linearly to 1 over the run
    priority_eps: float = 1e-3
    hidden: tuple[int, ...] = (128, 128)
    num_chunks: int = 20
    select_episodes: int = 64
    eval_episodes: int = 64

    @property
    def num_envs(self) -> int:
        return self.devices * self.envs_per_device

    @property
    def steps_per_chunk(self) -> int:
        return max(1, self.total_steps // (self.num_envs * self.num_chunks))

    @property
    def num_updates_total(self) -> int:
        return self.steps_per_chunk * self.num_chunks * self.updates_per_step


QUICK = dict(
    total_steps=4_000,
    capacity_per_device=256,
    batch_per_device=8,
    learning_starts=400,
    num_chunks=2,
    select_episodes=8,
    eval_episodes=8,
    hidden=(32, 32),
)


def make_buffer(cfg: Config) -> frb.ReplayBuffer:
    """One shard's buffer: prioritized."""
    return frb.ReplayBuffer(
        capacity=cfg.capacity_per_device,
        batch_size=cfg.batch_per_device,
        sampler=frb.PrioritizedSampler(alpha=cfg.alpha, beta=cfg.beta_start),
    )


def make_mesh(cfg: Config):
    return jax.make_mesh((cfg.devices,), (AXIS,), devices=jax.devices()[: cfg.devices])


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(cfg.lr, 0.0, transition_steps=cfg.num_updates_total)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(schedule, eps=1e-5))


class TrainState(NamedTuple):
    params: PyTree  # replicated
    target_params: PyTree  # replicated
    opt_state: PyTree  # replicated
    buffer: frb.ShardedState  # one shard per device
    env_state: PyTree  # leaves [num_envs, ...], envs_per_device per device
    obs: jax.Array  # float32 [num_envs, 4]
    ep_return: jax.Array  # float32 [num_envs]
    key: jax.Array  # replicated PRNG key
    step: jax.Array  # int32 []: vectorized steps taken
    num_updates: jax.Array  # int32 []


# how each field is laid out over the mesh (a prefix tree of the TrainState)
STATE_SPECS = TrainState(
    params=P(),
    target_params=P(),
    opt_state=P(),
    buffer=P(AXIS),
    env_state=P(AXIS),
    obs=P(AXIS),
    ep_return=P(AXIS),
    key=P(),
    step=P(),
    num_updates=P(),
)


class Metrics(NamedTuple):
    env_steps: jax.Array
    return_sum: jax.Array
    episodes: jax.Array
    loss: jax.Array
    greedy_return: jax.Array
    buffer_size: jax.Array


def init_state(cfg: Config) -> TrainState:
    env, env_params = make_env()
    srb = frb.ShardedReplayBuffer(make_buffer(cfg), make_mesh(cfg), axis_name=AXIS)
    key = jax.random.key(cfg.seed)
    key, k_net, k_env = jax.random.split(key, 3)
    params = init_mlp(k_net, (4, *cfg.hidden, env.num_actions))
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_env, cfg.num_envs), env_params
    )
    example = {
        "obs": jnp.zeros((4,), jnp.float32),
        "action": jnp.int32(0),
        "reward": jnp.float32(0.0),
        "next_obs": jnp.zeros((4,), jnp.float32),
        "terminated": jnp.bool_(False),
    }
    ts = TrainState(
        params=params,
        target_params=jax.tree_util.tree_map(jnp.copy, params),
        opt_state=make_optimizer(cfg).init(params),
        buffer=srb.init(example),
        env_state=env_state,
        obs=obs,
        ep_return=jnp.zeros((cfg.num_envs,), jnp.float32),
        key=key,
        step=jnp.int32(0),
        num_updates=jnp.int32(0),
    )
    mesh = make_mesh(cfg)
    return jax.tree_util.tree_map(
        lambda spec, sub: jax.device_put(sub, jax.sharding.NamedSharding(mesh, spec)),
        STATE_SPECS,
        ts,
        is_leaf=lambda x: isinstance(x, P),
    )


def td_errors(params, target_params, sample: frb.Sample, gamma: float) -> jax.Array:
    """Double-DQN TD errors, float32 ``[B]``."""
    d = sample.data
    q = jnp.take_along_axis(q_values(params, d["obs"]), d["action"][:, None], axis=1)[:, 0]
    next_action = jnp.argmax(q_values(params, d["next_obs"]), axis=1)
    next_q = jnp.take_along_axis(
        q_values(target_params, d["next_obs"]), next_action[:, None], axis=1
    )[:, 0]
    target = d["reward"] + gamma * (1.0 - d["terminated"].astype(jnp.float32)) * next_q
    return q - jax.lax.stop_gradient(target)


def loss_fn(params, target_params, sample, gamma):
    """Importance-weighted Huber loss of this device's rows; its TD errors as aux."""
    err = td_errors(params, target_params, sample, gamma)
    return jnp.mean(sample.weights * optax.huber_loss(err)), err


def _one_step(cfg: Config, srb: frb.ShardedReplayBuffer, ts: TrainState, _):
    """One vectorized step on every device (inside the shard_map): act, add to this device's
    shard, and, once the buffer allows, ``updates_per_step`` global prioritized updates."""
    env, env_params = make_env()
    rb, opt = srb.buffer, make_optimizer(cfg)
    me = jax.lax.axis_index(AXIS)
    key, k_act, k_learn = jax.random.split(ts.key, 3)  # the same on every device
    k_eps, k_rand, k_env = jax.random.split(jax.random.fold_in(k_act, me), 3)  # per device
    n = cfg.envs_per_device
    frac = (ts.step * cfg.num_envs) / max(1.0, cfg.eps_fraction * cfg.total_steps)
    eps = cfg.eps_start + (cfg.eps_end - cfg.eps_start) * jnp.clip(frac, 0.0, 1.0)
    greedy = jnp.argmax(q_values(ts.params, ts.obs), axis=1).astype(jnp.int32)
    explore = jax.random.uniform(k_eps, (n,)) < eps
    action = jnp.where(explore, jax.random.randint(k_rand, (n,), 0, env.num_actions), greedy)
    obs, env_state, reward, terminated, truncated, info = jax.vmap(
        env.step, in_axes=(0, 0, 0, None)
    )(jax.random.split(k_env, n), ts.env_state, action.astype(jnp.int32), env_params)
    done = terminated | truncated
    local = rb.add(
        srb.local(ts.buffer),
        {
            "obs": ts.obs,
            "action": action.astype(jnp.int32),
            "reward": reward.astype(jnp.float32),
            "next_obs": info["final_observation"],
            "terminated": terminated,
        },
    )
    beta = cfg.beta_start + (1.0 - cfg.beta_start) * jnp.minimum(
        ts.num_updates / cfg.num_updates_total, 1.0
    )

    def learn_once(carry, k):
        params, target_params, opt_state, local, num_updates = carry
        sample, local = rb.sample(local, k, axis_name=AXIS, beta=beta)  # a global draw
        (loss, err), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, target_params, sample, cfg.gamma
        )
        grads = jax.lax.pmean(grads, AXIS)  # data parallel
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        target_params = optax.incremental_update(params, target_params, cfg.tau)
        local = rb.update(
            local, sample.indices, jnp.abs(err) + cfg.priority_eps, axis_name=AXIS
        )  # to the owning shards
        return (params, target_params, opt_state, local, num_updates + 1), jax.lax.pmean(loss, AXIS)

    def learn(carry):
        carry, losses = jax.lax.scan(
            learn_once, carry, jax.random.split(k_learn, cfg.updates_per_step)
        )
        return carry, jnp.sum(losses)

    # the same on every device (global size, replicated step): collectives run everywhere
    ready = rb.can_sample(local, axis_name=AXIS) & (
        (ts.step + 1) * cfg.num_envs >= cfg.learning_starts
    )
    (params, target_params, opt_state, local, num_updates), loss = jax.lax.cond(
        ready,
        learn,
        lambda c: (c, jnp.float32(0.0)),
        (ts.params, ts.target_params, ts.opt_state, local, ts.num_updates),
    )
    ep_return = ts.ep_return + reward
    ts = ts._replace(
        params=params,
        target_params=target_params,
        opt_state=opt_state,
        buffer=srb.block(local),
        env_state=env_state,
        obs=obs,
        ep_return=jnp.where(done, 0.0, ep_return),
        key=key,
        step=ts.step + 1,
        num_updates=num_updates,
    )
    finished = jax.lax.psum(jnp.sum(jnp.where(done, ep_return, 0.0)), AXIS)
    episodes = jax.lax.psum(jnp.sum(done.astype(jnp.int32)), AXIS)
    return ts, (finished, episodes, loss)


def _print_progress(device, m: Metrics) -> None:
    if int(device) != 0:  # every device runs the callback; one prints
        return
    avg = float(m.return_sum) / max(int(m.episodes), 1)
    print(
        f"steps {int(m.env_steps):>8,}  episodes {int(m.episodes):>5}  avg return {avg:6.1f}"
        f"  greedy {float(m.greedy_return):6.1f}  loss {float(m.loss):7.4f}  "
        f"buffer {int(m.buffer_size):>6}  {time.perf_counter() - _T0[0]:6.1f} s",
        flush=True,
    )


_T0 = [0.0]


@functools.partial(jax.jit, static_argnums=(0, 2), donate_argnums=1)
def run_training(cfg: Config, ts: TrainState, verbose: bool = True):
    """The whole run in one compiled call: a shard_map over the devices around the scans of
    dqn_cartpole.py; returns ``(state, best_params, best_score, eval_returns)``."""
    srb = frb.ShardedReplayBuffer(make_buffer(cfg), make_mesh(cfg), axis_name=AXIS)
    rb = srb.buffer
    per_device_checks = max(1, cfg.select_episodes // cfg.devices)

    def chunk(carry, _):
        ts, best_params, best_score = carry
        ts, (ret, eps, loss) = jax.lax.scan(
            functools.partial(_one_step, cfg, srb), ts, None, length=cfg.steps_per_chunk
        )
        key, k_check = jax.random.split(ts.key)
        ts = ts._replace(key=key)
        me = jax.lax.axis_index(AXIS)
        score = jax.lax.pmean(
            jnp.mean(greedy_returns(ts.params, jax.random.fold_in(k_check, me), per_device_checks)),
            AXIS,
        )
        better = score >= best_score
        best_params = jax.tree_util.tree_map(
            lambda a, b: jnp.where(better, a, b), ts.params, best_params
        )
        m = Metrics(
            env_steps=ts.step * cfg.num_envs,
            return_sum=jnp.sum(ret),
            episodes=jnp.sum(eps),
            loss=jnp.sum(loss) / (cfg.steps_per_chunk * cfg.updates_per_step),
            greedy_return=score,
            buffer_size=rb.size(srb.local(ts.buffer), axis_name=AXIS),
        )
        if verbose:
            jax.debug.callback(_print_progress, me, m)  # (ordered: one device only)
        return (ts, best_params, jnp.where(better, score, best_score)), None

    def body(ts):
        (ts, best, score), _ = jax.lax.scan(
            chunk, (ts, ts.params, jnp.float32(-jnp.inf)), None, length=cfg.num_chunks
        )
        me = jax.lax.axis_index(AXIS)
        eval_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), 1), me)
        per_device = max(1, cfg.eval_episodes // cfg.devices)
        returns = greedy_returns(best, eval_key, per_device)
        return ts, best, score, returns

    return jax.shard_map(
        body,
        mesh=make_mesh(cfg),
        in_specs=(STATE_SPECS,),
        out_specs=(STATE_SPECS, P(), P(), P(AXIS)),
        check_vma=False,
    )(ts)


def train(cfg: Config, verbose: bool = True) -> dict:
    ts = init_state(cfg)
    if verbose:
        print(
            f"sharded DQN CartPole-v1: {cfg.devices} devices x {cfg.envs_per_device} env(s), "
            f"{cfg.num_chunks} chunks x {cfg.steps_per_chunk} steps = "
            f"{cfg.num_envs * cfg.steps_per_chunk * cfg.num_chunks:,} env steps, "
            f"global prioritized batches of {cfg.devices * cfg.batch_per_device} "
            "(the first line includes compilation)",
            flush=True,
        )
    _T0[0] = time.perf_counter()
    state, best, score, returns = run_training(cfg, ts, verbose)
    returns = jax.device_get(returns)
    jax.effects_barrier()
    return dict(
        state=state,
        best_params=best,
        best_score=float(score),
        eval_returns=returns,
        final_return=float(returns.mean()),
        seconds=time.perf_counter() - _T0[0],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--quick", action="store_true", help="tiny smoke run; no return check")
    p.add_argument("--target", type=float, default=450.0)
    args = p.parse_args(argv)
    cfg = Config(seed=args.seed, **(QUICK if args.quick else {}))
    out = train(cfg)
    r = out["eval_returns"]
    print(
        f"wall time {out['seconds']:.1f} s; best checkpoint (greedy {out['best_score']:.1f} "
        f"when chosen) on {r.size} fresh episodes: min {r.min():.0f}, max {r.max():.0f}"
    )
    print(f"final average return: {out['final_return']:.1f}")
    if not args.quick and out["final_return"] < args.target:
        print(
            f"FAILED: final average return {out['final_return']:.1f} < {args.target}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
