"""TEDStorage's jitted, donated add writes the state's tables in place: no O(capacity) copy.

XLA updates a donated array in place only when every read of its old value comes before the
first write into it; otherwise the compiled program copies the whole array on entry and back
on exit, and an add costs O(capacity) (``benchmarks/NOTES.md``, W5; the layout that avoids
it is in ``functional_rb/ted/write.py``'s docstring). These tests read the compiled HLO.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _users_hlo import users_hlo

import functional_rb as frb

_HLO_TYPES = {"float32": "f32", "int32": "s32", "bool": "pred", "uint8": "u8"}
_COPY = re.compile(r"=\s*([a-z0-9]+\[[0-9,]*\])\S*\s+copy\(")


def _copied_shapes(hlo: str) -> set:
    """``{"f32[4083,4]", ...}``: the array types of the ``copy`` instructions of ``hlo``."""
    return {m.group(1) for m in map(_COPY.search, hlo.splitlines()) if m}


def _hlo_type(x) -> str:
    return f"{_HLO_TYPES[np.dtype(x.dtype).name]}[{','.join(map(str, np.shape(x)))}]"


def test_the_copy_detector_sees_a_copy_of_a_donated_array():
    """The control: a donated array whose old value is returned beside the new one must be
    copied, and the detector names its type."""

    def f(x):
        return x.at[3].set(1.0), x

    x = jnp.zeros((1000, 4), jnp.float32)
    hlo = users_hlo(jax.jit(f, donate_argnums=0), x)
    assert "f32[1000,4]" in _copied_shapes(hlo)


# (ndim, num_envs, frame_stack): the pre-history is read from the table it is written into
@pytest.mark.parametrize("ndim,envs,k", [(1, 1, 1), (2, 2, 3)], ids=["ndim1", "ndim2-stack3"])
def test_donated_add_copies_no_state_table(ndim, envs, k):
    cap = 2000
    rb = frb.ReplayBuffer(
        capacity=cap,
        ndim=ndim,
        batch_size=8,
        storage=frb.TEDStorage(min_episode_len=25, frame_stack=k),
    )
    one = {
        "obs": jnp.zeros((4,)),
        "action": jnp.int32(0),
        "next": {"obs": jnp.zeros((4,)), "reward": jnp.float32(0), "done": jnp.bool_(False)},
    }
    lead = (8,) if ndim == 1 else (envs, 4)
    if ndim == 2:
        one = jax.tree_util.tree_map(lambda x: jnp.stack([x] * envs), one)
    batch = jax.tree_util.tree_map(lambda x: jnp.zeros(lead + x.shape[ndim - 1 :], x.dtype), one)
    state = rb.init(one)
    hlo = users_hlo(jax.jit(rb.add, donate_argnums=0), state, batch)
    # every storage array with more rows than a batch: the frame table, the rows (pointer,
    # distance, action, reward, done), owner
    tables = {
        _hlo_type(x)
        for x in jax.tree_util.tree_leaves(state.storage)
        if np.ndim(x) and np.shape(x)[0] > 16
    }
    assert len(tables) == 3, tables
    assert not tables & _copied_shapes(hlo), sorted(tables & _copied_shapes(hlo))
