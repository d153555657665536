"""DQN on gymnax CartPole-v1 written for flashbax (purejaxrl's style); ``--buffer functional_rb``
changes only the import line to ``import functional_rb.flashbax as fbx``.

    python examples/flashbax_dqn.py                            # flashbax, seed 0
    python examples/flashbax_dqn.py --buffer functional_rb     # the same program on functional_rb
    python examples/flashbax_dqn.py --prioritised              # PER DQN (set_priorities)
    python examples/flashbax_dqn.py --num-seeds 4              # seeds vmapped in one jit
    python examples/flashbax_dqn.py --quick                    # a tiny smoke run

The program is the way flashbax users write it (purejaxrl's ``dqn.py``, Stoix's DQN): a flax
Q-network and ``TrainState``, ``fbx.make_flat_buffer(...)`` with
``buffer.replace(init=jax.jit(buffer.init), add=jax.jit(buffer.add, donate_argnums=0),
sample=jax.jit(buffer.sample), can_sample=jax.jit(buffer.can_sample))``, transitions read as
``sample.experience.first`` / ``.second``, and the whole training as one ``jax.jit`` of a
``jax.vmap`` over seeds of a ``lax.scan`` over vectorized environment steps. ``--prioritised``
builds ``fbx.make_prioritised_flat_buffer`` instead, weights the loss by importance weights
computed from ``sample.probabilities`` and writes the new |TD error|s back with
``buffer.set_priorities``.

Hyper-parameters are purejaxrl's for CartPole (500k environment steps over 10 environments, a
10k-transition buffer, batches of 128, one update per vectorized step after 10k steps, a hard
target update every 500 steps). Where this program departs from purejaxrl's file: gymnax 1.0's
``step`` returns ``terminated`` and ``truncated`` (stored ``done`` is either, which is what
purejaxrl's older gymnax returned), the network is initialised from the run's key (purejaxrl
reuses its fixed dummy key there), and a few metrics are kept for the summary. PER weights
are written as Stoix writes them: ``(1 / (p + 1e-6)) ** beta``, divided by their maximum.

Nothing else differs between ``--buffer flashbax`` and ``--buffer functional_rb``: the module
bound to ``fbx`` (:func:`import_fbx`). Output: the compile time and the run time (separately),
the final average return per seed (the mean of the returns of the episodes completed in the
last 5% of training, epsilon-greedy as trained, purejaxrl's metric) and a greedy evaluation of
the final network on fresh episodes. ``--json PATH`` writes them for
``benchmarks/flashbax_programs.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import chex
import flax
import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from gymnax.wrappers.purerl import FlattenObservationWrapper, LogWrapper

# purejaxrl's CartPole configuration (its dqn.py), plus the PER and evaluation settings
CONFIG = {
    "NUM_ENVS": 10,
    "BUFFER_SIZE": 10_000,
    "BUFFER_BATCH_SIZE": 128,
    "TOTAL_TIMESTEPS": 500_000,
    "EPSILON_START": 1.0,
    "EPSILON_FINISH": 0.05,
    "EPSILON_ANNEAL_TIME": 250_000,
    "TARGET_UPDATE_INTERVAL": 500,
    "LR": 2.5e-4,
    "LEARNING_STARTS": 10_000,
    "TRAINING_INTERVAL": 10,
    "GAMMA": 0.99,
    "TAU": 1.0,
    "ENV_NAME": "CartPole-v1",
    "PRIORITISED": False,
    "PRIORITY_EXPONENT": 0.6,  # flashbax applies it inside set_priorities
    "IMPORTANCE_SAMPLING_EXPONENT": 0.4,
    "EVAL_EPISODES": 16,  # greedy episodes after training (0: none)
}
QUICK = {
    "TOTAL_TIMESTEPS": 2_000,
    "NUM_ENVS": 4,
    "BUFFER_SIZE": 512,
    "BUFFER_BATCH_SIZE": 16,
    "LEARNING_STARTS": 200,
    "EPSILON_ANNEAL_TIME": 1_000,
    "TARGET_UPDATE_INTERVAL": 100,
    "TRAINING_INTERVAL": 4,
    "EVAL_EPISODES": 0,
}


def import_fbx(buffer: str):
    """The one line a flashbax user changes (``--buffer``)."""
    if buffer == "flashbax":
        import flashbax as fbx
    elif buffer == "functional_rb":
        import functional_rb.flashbax as fbx
    else:
        raise ValueError(
            f"import_fbx: buffer must be 'flashbax' or 'functional_rb', got {buffer!r}"
        )
    return fbx


class QNetwork(nn.Module):
    """purejaxrl's Q-network: a 120-84 ReLU MLP, one output per action."""

    action_dim: int

    @nn.compact
    def __call__(self, x: jnp.ndarray):
        x = nn.relu(nn.Dense(120)(x))
        x = nn.relu(nn.Dense(84)(x))
        return nn.Dense(self.action_dim)(x)


@chex.dataclass(frozen=True)
class TimeStep:
    """One transition's first half, as stored (the next one's ``obs`` completes it)."""

    obs: chex.Array
    action: chex.Array
    reward: chex.Array
    done: chex.Array


class CustomTrainState(TrainState):
    """flax's ``TrainState`` with the target network and the step counters."""

    target_network_params: flax.core.FrozenDict
    timesteps: int
    n_updates: int


def make_buffer(config, fbx):
    """The buffer as flashbax users build it, its functions jitted with ``.replace``."""
    common = {
        "max_length": config["BUFFER_SIZE"],
        "min_length": config["BUFFER_BATCH_SIZE"],
        "sample_batch_size": config["BUFFER_BATCH_SIZE"],
        "add_sequences": False,
        "add_batch_size": config["NUM_ENVS"],
    }
    if config["PRIORITISED"]:
        buffer = fbx.make_prioritised_flat_buffer(
            **common, priority_exponent=config["PRIORITY_EXPONENT"]
        )
        buffer = buffer.replace(set_priorities=jax.jit(buffer.set_priorities, donate_argnums=0))
    else:
        buffer = fbx.make_flat_buffer(**common)
    return buffer.replace(
        init=jax.jit(buffer.init),
        add=jax.jit(buffer.add, donate_argnums=0),
        sample=jax.jit(buffer.sample),
        can_sample=jax.jit(buffer.can_sample),
    )


def make_env(config):
    """``(basic_env, wrapped env that logs episode returns, env_params)``."""
    basic_env, env_params = gymnax.make(config["ENV_NAME"])
    return basic_env, LogWrapper(FlattenObservationWrapper(basic_env)), env_params


def eps_greedy_exploration(config, rng, q_vals, t):
    """Actions ``[num_envs]``: random with probability epsilon (linear decay in ``t``)."""
    rng_a, rng_e = jax.random.split(rng)
    eps = jnp.clip(
        (config["EPSILON_FINISH"] - config["EPSILON_START"]) / config["EPSILON_ANNEAL_TIME"] * t
        + config["EPSILON_START"],
        config["EPSILON_FINISH"],
    )
    greedy_actions = jnp.argmax(q_vals, axis=-1)
    random_actions = jax.random.randint(rng_a, greedy_actions.shape, 0, q_vals.shape[-1])
    return jnp.where(
        jax.random.uniform(rng_e, greedy_actions.shape) < eps, random_actions, greedy_actions
    )


def make_learn_phase(config, network, buffer):
    """``(train_state, buffer_state, rng) -> (train_state, buffer_state, loss)``: one DQN
    update from a sampled batch of transitions (PER: weighted, then ``set_priorities``)."""

    def _learn_phase(train_state, buffer_state, rng):
        sample = buffer.sample(buffer_state, rng)
        learn_batch = sample.experience
        q_next_target = jnp.max(
            network.apply(train_state.target_network_params, learn_batch.second.obs), axis=-1
        )
        target = (
            learn_batch.first.reward
            + (1 - learn_batch.first.done) * config["GAMMA"] * q_next_target
        )
        if config["PRIORITISED"]:
            # as Stoix writes it; the 1e-6 matters: flashbax 0.1.3 can draw a transition whose
            # probability is 0 (with 1 / p alone, seed 0 turns NaN after ~19,000 env steps)
            weights = (1.0 / (sample.probabilities + 1e-6)) ** config[
                "IMPORTANCE_SAMPLING_EXPONENT"
            ]
            weights = weights / jnp.max(weights)
        else:
            weights = jnp.ones_like(target)

        def _loss_fn(params):
            q_vals = network.apply(params, learn_batch.first.obs)
            chosen_action_qvals = jnp.take_along_axis(
                q_vals, jnp.expand_dims(learn_batch.first.action, axis=-1), axis=-1
            ).squeeze(axis=-1)
            td_error = chosen_action_qvals - target
            return jnp.mean(weights * td_error**2), td_error

        (loss, td_error), grads = jax.value_and_grad(_loss_fn, has_aux=True)(train_state.params)
        train_state = train_state.apply_gradients(grads=grads)
        train_state = train_state.replace(n_updates=train_state.n_updates + 1)
        if config["PRIORITISED"]:
            buffer_state = buffer.set_priorities(
                buffer_state, sample.indices, jnp.abs(td_error) + 1e-6
            )
        return train_state, buffer_state, loss

    return _learn_phase


def make_update_step(config, network, buffer, learn_phase, vmap_step):
    """purejaxrl's ``_update_step``: one vectorized environment step, its transitions added
    to the buffer, one update when it is time, the target network's update; returns the new
    runner state and the step's metrics."""

    def _update_step(runner_state, unused):
        train_state, buffer_state, env_state, last_obs, rng = runner_state

        # STEP THE ENV
        rng, rng_a, rng_s = jax.random.split(rng, 3)
        q_vals = network.apply(train_state.params, last_obs)
        action = eps_greedy_exploration(config, rng_a, q_vals, train_state.timesteps)
        obs, env_state, reward, terminated, truncated, info = vmap_step(rng_s, env_state, action)
        done = jnp.logical_or(terminated, truncated)
        train_state = train_state.replace(timesteps=train_state.timesteps + config["NUM_ENVS"])

        # BUFFER UPDATE
        timestep = TimeStep(obs=last_obs, action=action, reward=reward, done=done)
        buffer_state = buffer.add(buffer_state, timestep)

        # NETWORKS UPDATE
        rng, _rng = jax.random.split(rng)
        is_learn_time = (
            buffer.can_sample(buffer_state)
            & (train_state.timesteps > config["LEARNING_STARTS"])
            & (train_state.timesteps % config["TRAINING_INTERVAL"] == 0)
        )
        train_state, buffer_state, loss = jax.lax.cond(
            is_learn_time,
            learn_phase,
            lambda train_state, buffer_state, rng: (train_state, buffer_state, jnp.array(0.0)),
            train_state,
            buffer_state,
            _rng,
        )

        # update target network
        train_state = jax.lax.cond(
            train_state.timesteps % config["TARGET_UPDATE_INTERVAL"] == 0,
            lambda train_state: train_state.replace(
                target_network_params=optax.incremental_update(
                    train_state.params, train_state.target_network_params, config["TAU"]
                )
            ),
            lambda train_state: train_state,
            operand=train_state,
        )

        metrics = {
            "timesteps": train_state.timesteps,
            "updates": train_state.n_updates,
            "loss": loss.mean(),
            # returns of the episodes that ended at this step (sum and count)
            "return_sum": jnp.sum(
                jnp.where(info["returned_episode"], info["returned_episode_returns"], 0.0)
            ),
            "episodes": jnp.sum(info["returned_episode"]),
        }
        return (train_state, buffer_state, env_state, obs, rng), metrics

    return _update_step


def make_train(config, fbx):
    """purejaxrl's ``make_train``: ``train(rng) -> {"runner_state", "metrics", "eval_returns"}``
    with ``fbx`` the buffer module (flashbax or functional_rb.flashbax)."""
    config = dict(config, NUM_UPDATES=config["TOTAL_TIMESTEPS"] // config["NUM_ENVS"])
    basic_env, env, env_params = make_env(config)

    def vmap_reset(rng):
        return jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(rng, config["NUM_ENVS"]), env_params
        )

    def vmap_step(rng, env_state, action):
        return jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(rng, config["NUM_ENVS"]), env_state, action, env_params
        )

    def train(rng):
        rng, _rng = jax.random.split(rng)
        init_obs, env_state = vmap_reset(_rng)

        # INIT BUFFER from one dummy time step
        buffer = make_buffer(config, fbx)
        dummy = jax.random.PRNGKey(0)
        _action = basic_env.action_space().sample(dummy)
        _, _env_state = env.reset(dummy, env_params)
        _obs, _, _reward, _done, _, _ = env.step(dummy, _env_state, _action, env_params)
        buffer_state = buffer.init(TimeStep(obs=_obs, action=_action, reward=_reward, done=_done))

        # INIT NETWORK AND OPTIMIZER
        network = QNetwork(action_dim=env.action_space(env_params).n)
        rng, _rng = jax.random.split(rng)
        network_params = network.init(_rng, jnp.zeros(env.observation_space(env_params).shape))
        train_state = CustomTrainState.create(
            apply_fn=network.apply,
            params=network_params,
            target_network_params=jax.tree_util.tree_map(jnp.copy, network_params),
            tx=optax.adam(learning_rate=config["LR"]),
            timesteps=0,
            n_updates=0,
        )
        update_step = make_update_step(
            config, network, buffer, make_learn_phase(config, network, buffer), vmap_step
        )

        # TRAIN: one lax.scan over the vectorized steps
        rng, _rng = jax.random.split(rng)
        runner_state = (train_state, buffer_state, env_state, init_obs, _rng)
        runner_state, metrics = jax.lax.scan(update_step, runner_state, None, config["NUM_UPDATES"])
        rng, _rng = jax.random.split(rng)
        eval_returns = (
            greedy_returns(config, network, runner_state[0].params, _rng)
            if config["EVAL_EPISODES"]
            else jnp.zeros((0,), jnp.float32)
        )
        return {"runner_state": runner_state, "metrics": metrics, "eval_returns": eval_returns}

    return train


def greedy_returns(config, network, params, rng):
    """float32 ``[EVAL_EPISODES]``: the greedy policy's return on fresh episodes."""
    basic_env, env_params = gymnax.make(config["ENV_NAME"])
    n = config["EVAL_EPISODES"]
    rng, _rng = jax.random.split(rng)
    obs, env_state = jax.vmap(basic_env.reset, in_axes=(0, None))(
        jax.random.split(_rng, n), env_params
    )

    def step(carry, rng):
        obs, env_state, alive, ret = carry
        action = jnp.argmax(network.apply(params, obs), axis=-1)
        obs, env_state, reward, terminated, truncated, _ = jax.vmap(
            basic_env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(rng, n), env_state, action, env_params)
        ret = ret + jnp.where(alive, reward, 0.0)
        alive = alive & ~(terminated | truncated)  # count each env's first episode only
        return (obs, env_state, alive, ret), None

    carry = (obs, env_state, jnp.ones((n,), bool), jnp.zeros((n,), jnp.float32))
    (_, _, _, ret), _ = jax.lax.scan(
        step, carry, jax.random.split(rng, env_params.max_steps_in_episode)
    )
    return ret


def final_average_return(metrics, fraction: float = 0.05) -> np.ndarray:
    """Per seed: the mean return of the episodes that ended in the last ``fraction`` of the
    steps (``metrics`` leaves ``[num_seeds, NUM_UPDATES]``)."""
    n = max(1, int(np.shape(metrics["episodes"])[1] * fraction))
    total = np.asarray(metrics["return_sum"])[:, -n:].sum(axis=1)
    count = np.asarray(metrics["episodes"])[:, -n:].sum(axis=1)
    return total / np.maximum(count, 1)


def run(config, buffer: str, seed: int = 0, num_seeds: int = 1) -> dict[str, Any]:
    """Compile and run ``num_seeds`` trainings (vmapped) with the ``buffer`` module; returns
    the outputs and the figures the program prints."""
    fbx = import_fbx(buffer)
    rngs = jax.random.split(jax.random.PRNGKey(seed), num_seeds)
    t0 = time.perf_counter()
    train_vjit = jax.jit(jax.vmap(make_train(config, fbx))).lower(rngs).compile()
    t1 = time.perf_counter()
    outs = jax.block_until_ready(train_vjit(rngs))
    t2 = time.perf_counter()
    metrics = jax.device_get(outs["metrics"])
    return {
        "outs": outs,
        "buffer": buffer,
        "seed": seed,
        "num_seeds": num_seeds,
        "compile_s": t1 - t0,
        "run_s": t2 - t1,
        "timesteps": int(metrics["timesteps"][0, -1]),
        "updates": [int(u) for u in metrics["updates"][:, -1]],
        "final_return": [float(r) for r in final_average_return(metrics)],
        "greedy_return": [
            float(np.mean(r)) for r in np.asarray(outs["eval_returns"]) if np.size(r)
        ],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buffer", choices=("flashbax", "functional_rb"), default="flashbax")
    p.add_argument(
        "--prioritised",
        action="store_true",
        help="make_prioritised_flat_buffer + set_priorities (PER DQN)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seeds", type=int, default=1, help="seeds vmapped in one jit")
    p.add_argument("--total-timesteps", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    p.add_argument("--json", default=None, help="write the figures as JSON to this path")
    args = p.parse_args(argv)
    config = dict(CONFIG, **(QUICK if args.quick else {}), PRIORITISED=args.prioritised)
    if args.total_timesteps is not None:
        config["TOTAL_TIMESTEPS"] = args.total_timesteps
    out = run(config, args.buffer, args.seed, args.num_seeds)
    kind = "prioritised flat buffer" if args.prioritised else "flat buffer"
    print(
        f"DQN CartPole-v1 with {args.buffer}'s {kind}: {out['timesteps']:,} env steps x "
        f"{args.num_seeds} seed(s) from seed {args.seed}, {out['updates'][0]:,} updates"
    )
    print(f"compile time: {out['compile_s']:.1f} s, run time: {out['run_s']:.1f} s")
    if out["greedy_return"]:
        print("greedy return per seed: " + ", ".join(f"{r:.1f}" for r in out["greedy_return"]))
    print("final average return per seed: " + ", ".join(f"{r:.1f}" for r in out["final_return"]))
    print(f"final average return: {np.mean(out['final_return']):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in out.items() if k != "outs"}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
