"""One process of the two-process test of sharded buffers (tests/core/sharded/test_sharded_distributed.py):
``python _sharded_worker.py PROCESS_ID PORT OUT_DIR``, 4 CPU devices per process, 8 in all,
gloo collectives over 127.0.0.1. Writes what it saw to OUT_DIR/result-<id>.json."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

PROCESS, PORT, OUT = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    num_processes=2,
    process_id=PROCESS,
    initialization_timeout=120,
)

import functional_rb as frb  # noqa: E402

N, CAP, B, PER = 8, 16, 8, 5
rb = frb.ReplayBuffer(CAP, sampler=frb.PrioritizedSampler(alpha=1.0, beta=1.0), batch_size=B)
mesh = jax.make_mesh((N,), ("data",))
srb = frb.ShardedReplayBuffer(rb, mesh)
example = {"obs": jnp.zeros(2), "id": jnp.int32(0)}
state = srb.init(example)

# each process provides the items of its own devices: device d adds ids 100 d + [0, PER)
mine = [d.id for d in mesh.devices.reshape(-1) if d.process_index == PROCESS]
order = [d.id for d in mesh.devices.reshape(-1)]
ids = np.concatenate([100 * order.index(i) + np.arange(PER) for i in mine]).astype(np.int32)
items = {"obs": np.stack([ids, -ids], 1).astype(np.float32), "id": ids}
items = jax.tree_util.tree_map(
    lambda x: jax.make_array_from_process_local_data(srb.sharding, x), items
)
add = jax.jit(srb.add, donate_argnums=0)
sample = jax.jit(srb.sample, donate_argnums=0)
update = jax.jit(srb.update, donate_argnums=0)
state = add(state, items)
smp, state = sample(state, jax.random.key(0))
state = update(state, smp.indices, jnp.full(smp.indices.shape, 0.5))
# then every stored item gets priority 1 + its shard: a global draw favours the later shards
every = (np.arange(N)[:, None] * CAP + np.arange(PER)).reshape(-1).astype(np.int32)
state = update(state, every, (every // CAP + 1).astype(np.float32))
counts = np.zeros(N * CAP)
weights = {}
for step in range(40):
    smp, state = sample(state, jax.random.key(step + 1))
    g = multihost_utils.process_allgather(smp, tiled=True)
    np.testing.assert_array_equal(g.data["id"], g.indices // CAP * 100 + g.indices % CAP)
    np.add.at(counts, g.indices, 1)
    weights.update(zip(g.indices.tolist(), g.weights.tolist()))
size = int(srb.size(state))
frb.checkpoint.save(os.path.join(OUT, "ckpt"), state)  # each process writes its own shards
back = frb.checkpoint.load(os.path.join(OUT, "ckpt"), like=srb.init(example))
equal = jax.jit(lambda a, b: jnp.all(a == b))  # a replicated scalar: read its local copy
same = all(
    bool(np.asarray(equal(a, b).addressable_data(0)))
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state))
)
with open(os.path.join(OUT, f"result-{PROCESS}.json"), "w") as f:
    json.dump(
        {
            "size": size,
            "counts": counts.tolist(),
            "weights": weights,
            "restored_equal": same,
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
        },
        f,
    )
jax.distributed.shutdown()
