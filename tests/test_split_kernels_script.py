"""benchmarks/split_kernels.py, whose counts NOTES.md quotes, cannot rot: its ring writes run
and say how many kernels XLA split, and its HLO reading finds each split kernel's op name."""

import pathlib

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
    import sys

    if str(ROOT) not in sys.path:  # the checkout's benchmarks/ is not an installed package
        sys.path.append(str(ROOT))
    from benchmarks import split_kernels

    return split_kernels


def test_the_ring_writes_run_and_count_their_split_kernels():
    got = _module().writes(200_000, rounds=1, calls=5)
    assert got["us"] > 0 and got["range"][0] <= got["us"] <= got["range"][1]
    # three scatters into arrays of 0.8 MB and more: each split on two CPUs with XLA's default
    # emitters; none with one CPU, or with the older emitters this suite compiles with
    assert got["split"] in (0, 3)


_HLO = """HloModule m

%fused (p: f32[10]) -> f32[10] {
  %p = f32[10]{0} parameter(0)
  ROOT %n = f32[10]{0} negate(%p), metadata={op_name="jit(f)/neg"}
}

ENTRY %main (x: f32[10], i: s32[4]) -> (f32[10], f32[10]) {
  %x = f32[10]{0} parameter(0)
  %i = s32[4]{0} parameter(1)
  %a = f32[10]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/cond/branch_0_fun/neg"}, backend_config={"outer_dimension_partitions":["2"]}
  %b = f32[10]{0} fusion(%x, %i), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/scatter"}, backend_config={"outer_dimension_partitions":["2"]}
  %c = f32[10]{0} fusion(%x), kind=kLoop, calls=%fused
  ROOT %t = (f32[10]{0}, f32[10]{0}) tuple(%a, %b)
}
"""


def test_ops_counts_kernels_and_names_each_split_one():
    kernels, split, where = _module()._ops(_HLO)
    assert (kernels, split) == (3, 2)
    assert where == ["jit(f)/cond/branch_0_fun/neg", "jit(f)/scatter"]


def test_ops_reads_a_compiled_program():
    x = jnp.zeros((200_000, 7), jnp.float32)
    idx = jnp.arange(256, dtype=jnp.int32) * 7

    def f(x, i):
        return x.at[i].set(x[i] + 1.0, unique_indices=True)

    text = jax.jit(f).lower(x, idx).compile().as_text()
    kernels, split, where = _module()._ops(text)
    assert kernels >= 1
    assert split == len(where) == text.count("outer_dimension_partitions")
    assert all(w.startswith("jit(f)/") for w in where), where
