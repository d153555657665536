"""DLPack exchange: pointer equality where zero-copy is promised, value equality otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

from functional_rb.adapters.dlpack import (  # noqa: E402
    copy_reason,
    jax_to_torch,
    pytree_to_tensordict,
    tensordict_to_pytree,
    torch_to_jax,
)

ZERO_COPY_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.bool,
    torch.complex64,
]


def _assert_values_equal(a, t):
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: compare as float32
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())
    else:
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_torch_to_jax_zero_copy(dtype):
    t = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    assert copy_reason(t) is None
    a = torch_to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == (2, 3, 4) and str(a.dtype) == str(dtype).replace("torch.", "")
    _assert_values_equal(a, t)
    back = jax_to_torch(a)  # and back again: still the same buffer
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: torch.arange(12.0).reshape(3, 4)[:, 1], "layout"),
        (lambda: torch.arange(12.0).reshape(3, 4).T, "layout"),
        (lambda: torch.arange(100.0)[1:], "alignment"),
        (lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4), "dtype"),
        (lambda: torch.linspace(0, 1, 12, dtype=torch.float64), "dtype"),
    ],
    ids=["strided", "transposed", "unaligned", "int64", "float64"],
)
def test_torch_to_jax_copies_are_detected_and_correct(make, reason):
    t = make()
    assert copy_reason(t).startswith(reason)
    a = torch_to_jax(t)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    want = t.numpy()
    if want.dtype == np.int64:
        want = want.astype(np.int32)
    elif want.dtype == np.float64:
        want = want.astype(np.float32)
    assert a.dtype == want.dtype and a.shape == want.shape
    np.testing.assert_array_equal(np.asarray(a), want)


def test_zero_copy_aliases_torch_writes():
    t = torch.zeros(16)
    a = torch_to_jax(t)
    t[3] = 7.0  # documented hazard: in-place torch ops show through the shared buffer
    assert float(a[3]) == 7.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bool_, jnp.bfloat16, jnp.uint8])
def test_jax_to_torch_zero_copy(dtype):
    a = (jnp.arange(12) % 2).astype(dtype).reshape(3, 4)
    t = jax_to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert tuple(t.shape) == (3, 4)
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(a.astype(jnp.float32)))


def test_tensordict_roundtrip_zero_copy():
    td = tensordict.TensorDict(
        {
            "obs": torch.randn(5, 3, generator=torch.Generator().manual_seed(0)),
            "done": torch.zeros(5, 1, dtype=torch.bool),
            "collector": {"traj_ids": torch.arange(5, dtype=torch.int32)},
        },
        batch_size=[5],
    )
    tree = tensordict_to_pytree(td)
    assert set(tree) == {"obs", "done", "collector"} and set(tree["collector"]) == {"traj_ids"}
    assert tree["obs"].unsafe_buffer_pointer() == td["obs"].data_ptr()
    assert (
        tree["collector"]["traj_ids"].unsafe_buffer_pointer()
        == td["collector", "traj_ids"].data_ptr()
    )
    back = pytree_to_tensordict(tree, batch_size=[5])
    assert back.batch_size == torch.Size([5])
    assert back["obs"].data_ptr() == td["obs"].data_ptr()
    assert (back == td).all()
    # jitted code consumes the converted tree directly
    total = jax.jit(lambda t: t["obs"].sum() + t["collector"]["traj_ids"].sum())(tree)
    np.testing.assert_allclose(float(total), float(td["obs"].sum() + 10), rtol=1e-5)


def test_errors_name_the_entry():
    td = tensordict.TensorDict({"obs": torch.zeros(2)}, batch_size=[2])
    td.set_non_tensor("tag", "hello")
    with pytest.raises(TypeError, match="'tag'"):
        tensordict_to_pytree(td)
    with pytest.raises(TypeError, match=r"\['x'\]"):
        pytree_to_tensordict({"x": [1, 2]}, batch_size=[2])
    with pytest.raises(TypeError, match="torch.Tensor"):
        torch_to_jax(np.zeros(3))
    with pytest.raises(RuntimeError):  # TensorDict names the key with the wrong batch dim
        pytree_to_tensordict({"obs": jnp.zeros((3, 2))}, batch_size=[2])
