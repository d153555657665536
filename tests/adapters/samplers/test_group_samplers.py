"""StalenessAwareSampler (core and adapter) and PromptGroupSampler (adapter).

The core sampler is checked against the exact law (chi-square, fixed seeds), under jit and
without, with hypothesis properties; the adapters run beside TorchRL's own classes on the same
data and seeds (same indices, same info, same errors, same files).
"""

from __future__ import annotations

import functools
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.testing import assert_distribution, assert_frequencies, check_sampler

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import functional_rb.adapters as A  # noqa: E402

LIBS = pytest.mark.parametrize("L", [T, A], ids=["torchrl", "frb"])
EXAMPLE = {"obs": jnp.zeros(2), "policy_version": jnp.int32(0)}


def _exp_weight(s):
    return jnp.exp(-jnp.abs(s))


def _core_state(versions, consumer, max_staleness=-1, capacity=None, batch_size=4, fn=None):
    versions = np.asarray(versions, np.int32)
    sampler = frb.StalenessAwareSampler(max_staleness=max_staleness, staleness_weight_fn=fn)
    rb = frb.ReplayBuffer(capacity or len(versions), sampler=sampler, batch_size=batch_size)
    state = rb.init(EXAMPLE)
    state = rb.add(
        state, {"obs": jnp.zeros((len(versions), 2)), "policy_version": jnp.asarray(versions)}
    )
    return rb, rb.sampler.set_consumer_version(state, consumer)


# ---------------------------------------------------------------------- core: the law
def test_core_conformance():
    # ndim=2 only (its flat positions include ndim=1's case); ndim=1 is covered below
    check_sampler(
        frb.StalenessAwareSampler(max_staleness=2, staleness_weight_fn=_exp_weight),
        example=EXAMPLE,
        ndims=(2,),
    )


def test_core_draws_with_replacement_follow_freshness_weights():
    # versions 0..7, consumer 7, max_staleness 3: versions 4..7 (staleness 3..0) are drawable,
    # with weights 1/4, 1/3, 1/2, 1; batch 64 > 4 drawable: independent draws
    rb, state = _core_state(np.arange(8), 7, max_staleness=3, batch_size=64)
    w = np.array([0, 0, 0, 0, 1 / 4, 1 / 3, 1 / 2, 1])
    assert_distribution(rb, state, w / w.sum(), n=12_000, seed=1)


def test_core_distinct_draws_follow_successive_weighted_sampling():
    # four drawable items, batch of 2 without replacement: P(i, j) = w_i / W * w_j / (W - w_i)
    # (the fifth item, staleness 12, is beyond the gate)
    rb, state = _core_state([3, 2, 1, 0, -9], 3, max_staleness=3, capacity=5, batch_size=2)
    idx = jax.jit(jax.vmap(lambda k: rb.sample(state, k)[0].indices))(
        jax.random.split(jax.random.key(3), 20_000)
    )
    idx = np.asarray(idx)
    assert (idx[:, 0] != idx[:, 1]).all() and (idx < 4).all()
    w = 1.0 / (np.array([0, 1, 2, 3]) + 1.0)  # staleness 0..3
    expected = np.array(
        [
            [w[i] / w.sum() * w[j] / (w.sum() - w[i]) if i != j else 0.0 for j in range(4)]
            for i in range(4)
        ]
    )
    counts = np.bincount(idx[:, 0] * 4 + idx[:, 1], minlength=16)
    assert_frequencies(counts, expected.reshape(-1), what="ordered pairs")


def test_core_uniform_weights_are_uniform_and_ndim2_gates_per_element():
    sampler = frb.StalenessAwareSampler(max_staleness=1, staleness_weight_fn=lambda s: s * 0 + 1)
    rb = frb.ReplayBuffer(12, sampler=sampler, batch_size=32, ndim=2)
    state = rb.init({"obs": jnp.zeros((2, 2)), "policy_version": jnp.zeros(2, jnp.int32)})
    v = jnp.asarray([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]], jnp.int32)  # [env, time]
    state = rb.add(state, {"obs": jnp.zeros((2, 5, 2)), "policy_version": v})
    state = rb.sampler.set_consumer_version(state, 4)
    probs = np.zeros(12)
    probs[[3, 4, 6, 7]] = 0.25  # flat env * 6 + t, versions 3 and 4
    assert_distribution(rb, state, probs, n=8_000, seed=2)


# ---------------------------------------------------------------------- core: properties
_CAP = 12
_LAYOUT = frb.protocol.Layout(capacity=_CAP, num_envs=1, row_capacity=_CAP, ndim=1)


@functools.cache
def _sampler_fns(max_staleness: int, batch_size: int):
    """The sampler's own sample / can_sample at a fixed capacity: eager and jitted (one
    compilation per configuration, whatever the data)."""
    sampler = frb.StalenessAwareSampler(
        max_staleness=max_staleness, staleness_weight_fn=_exp_weight
    )

    def sample(state, key, filled):
        ctx = frb.protocol.Context(_LAYOUT, filled, filled)
        return sampler.sample(state, key, batch_size, ctx)[0], sampler.can_sample(
            state, ctx, batch_size
        )

    return sample, jax.jit(sample)


@given(
    versions=st.lists(st.integers(0, 6), min_size=0, max_size=_CAP),
    consumer=st.integers(0, 9),
    max_staleness=st.sampled_from([-1, 2]),
    batch_size=st.sampled_from([1, 5, _CAP]),
    seed=st.integers(0, 2**31 - 1),
)
def test_core_properties(versions, consumer, max_staleness, batch_size, seed):
    """Drawn items are stored and within the gate; a batch is distinct whenever enough items
    are drawable; mask and weights agree with can_sample; jit draws what eager draws."""
    n_stored = len(versions)
    padded = np.zeros(_CAP, np.int32)
    padded[:n_stored] = versions
    state = frb.StalenessState(jnp.asarray(padded), jnp.int32(consumer))
    stale = consumer - padded
    drawable = np.arange(_CAP) < n_stored
    if max_staleness >= 0:
        drawable &= stale <= max_staleness
    n = int(drawable.sum())
    eager_fn, jit_fn = _sampler_fns(max_staleness, batch_size)
    key, filled = jax.random.key(seed), jnp.int32(n_stored)
    (drawn, can), (jdrawn, jcan) = eager_fn(state, key, filled), jit_fn(state, key, filled)
    for a, b in zip(drawn, jdrawn):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    idx, w, m = (np.asarray(x) for x in jdrawn)
    assert bool(can) == bool(jcan) == (n > 0)
    assert idx.dtype == np.int32 and (idx >= 0).all() and (idx < _CAP).all()
    assert (m == (n > 0)).all() and (w == m.astype(np.float32)).all()
    if n:
        assert drawable[idx].all()
    if n >= batch_size:
        assert len(set(idx.tolist())) == batch_size


def test_core_all_stale_eager_raises_jit_masks(maybe_jit):
    rb, state = _core_state([0, 0, 1], 10, max_staleness=2)
    assert not bool(rb.can_sample(state))
    if maybe_jit is jax.jit:
        s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
        assert not np.asarray(s.mask).any() and (np.asarray(s.weights) == 0).all()
    else:
        with pytest.raises(ValueError, match="nothing can be sampled"):
            rb.sample(state, jax.random.key(0))


def test_core_items_newer_than_the_consumer_raise_eagerly_and_are_skipped_under_jit():
    rb, state = _core_state([5, 1, 2], 1)  # default weight: staleness -4 gives -1/3
    with pytest.raises(ValueError, match=r"position 0, whose version is 5 .*set_consumer_version"):
        rb.sample(state, jax.random.key(0))
    rb, state = _core_state([5, 1, 2], 1)
    s, _ = jax.jit(rb.sample)(state, jax.random.key(0))
    assert np.asarray(s.mask).all() and set(np.asarray(s.indices).tolist()) <= {1, 2}


def test_core_consumer_version_is_pure_state_in_scan_and_checkpoints(tmp_path):
    rb, state = _core_state([0, 1, 2, 3], 0)

    def step(st, key):
        st = rb.sampler.increment_consumer_version(st)
        s, st = rb.sample(st, key)
        return st, rb.sampler.staleness(st, s.indices)

    # start at 3: every item has staleness >= 0 from the first step on
    state = rb.sampler.set_consumer_version(state, 2)
    final, stale = jax.lax.scan(step, state, jax.random.split(jax.random.key(0), 5))
    assert int(final.sampler.consumer_version) == 7
    assert (np.asarray(stale) >= 0).all() and np.asarray(stale).max() <= 7
    frb.checkpoint.save(tmp_path / "ck", final)
    loaded = frb.checkpoint.load(tmp_path / "ck")
    assert int(loaded.sampler.consumer_version) == 7
    np.testing.assert_array_equal(loaded.sampler.versions, final.sampler.versions)


def test_core_float_versions_and_argument_errors():
    sampler = frb.StalenessAwareSampler(max_staleness=0)
    rb = frb.ReplayBuffer(4, sampler=sampler, batch_size=2)
    state = rb.init({"x": jnp.zeros(()), "policy_version": jnp.zeros((1,), jnp.float32)})
    state = rb.add(state, {"x": jnp.zeros(3), "policy_version": jnp.asarray([[0.5], [1.5], [1.5]])})
    state = rb.sampler.set_consumer_version(state, 1.5)
    s, state = rb.sample(state, jax.random.key(0))
    assert set(np.asarray(s.indices).tolist()) == {1, 2}
    with pytest.raises(KeyError, match="version_key=\\('policy_version',\\) is not in"):
        frb.ReplayBuffer(4, sampler=sampler).init({"x": jnp.zeros(())})
    with pytest.raises(ValueError, match="one number per item"):
        frb.ReplayBuffer(4, sampler=sampler).init({"policy_version": jnp.zeros(2)})
    with pytest.raises(ValueError, match="max_staleness must be"):
        frb.StalenessAwareSampler(max_staleness=-2)
    rb_int, st_int = _core_state([0, 1], 1)
    with pytest.raises(TypeError, match="scalar integer"):
        rb_int.sampler.set_consumer_version(st_int, 1.5)
    with pytest.raises(TypeError, match="sampler=StalenessAwareSampler"):
        sampler.set_consumer_version(frb.ReplayBuffer(4).init({"x": jnp.zeros(())}), 1)


# ---------------------------------------------------------------------- adapter: staleness
def _versioned(n, versions, start=0):
    return TensorDict(
        {
            "obs": torch.arange(start, start + n).float()[:, None],
            "policy_version": torch.as_tensor(versions, dtype=torch.float32),
        },
        [n],
    )


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage", "LazyStackStorage"])
@pytest.mark.parametrize("max_staleness,batch_size", [(-1, 16), (3, 16), (3, 64)])
def test_staleness_same_draws_as_torchrl(storage, max_staleness, batch_size):
    def run(L):
        sampler = L.StalenessAwareSampler(max_staleness=max_staleness)
        rb = L.TensorDictReplayBuffer(
            storage=getattr(L, storage)(60), sampler=sampler, batch_size=batch_size
        )
        for v in range(4):  # 80 items into 60 slots: the ring wraps
            rb.extend(_versioned(20, [2.0 * v] * 20, start=20 * v))
        sampler.consumer_version = 7
        torch.manual_seed(0)
        out = [rb.sample(return_info=True) for _ in range(3)]
        return [(s["obs"].clone(), info["index"], info["staleness"]) for s, info in out]

    ref, ours = run(T), run(A)
    for a, b in zip(ref, ours):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


@LIBS
def test_staleness_errors_and_state(L, tmp_path):
    sampler = L.StalenessAwareSampler(max_staleness=2)
    rb = L.TensorDictReplayBuffer(storage=L.LazyTensorStorage(10), sampler=sampler, batch_size=4)
    rb.extend(_versioned(10, [0.0] * 10))
    sampler.consumer_version = 5
    with pytest.raises(RuntimeError, match="exceed max_staleness=2"):
        rb.sample()
    sampler.increment_consumer_version()
    assert sampler.consumer_version == 6 and repr(sampler) == (
        "StalenessAwareSampler(consumer_version=6, max_staleness=2)"
    )
    sd = sampler.state_dict()
    assert list(sd) == ["consumer_version", "max_staleness"] and sd["consumer_version"] == 6
    sampler.dumps(tmp_path / "s")
    other = L.StalenessAwareSampler()
    other.loads(tmp_path / "s")
    assert (other.consumer_version, other.max_staleness) == (6, 2)
    bare = L.TensorDictReplayBuffer(
        storage=L.LazyTensorStorage(4), sampler=L.StalenessAwareSampler(), batch_size=2
    )
    bare.extend(TensorDict({"obs": torch.zeros(4)}, [4]))
    with pytest.raises(KeyError, match="policy_version"):
        bare.sample()


def test_staleness_dumps_read_across_libraries(tmp_path):
    for src, dst, name in ((T, A, "t2a"), (A, T, "a2t")):
        s = src.StalenessAwareSampler(max_staleness=4)
        s.consumer_version = 11
        s.dumps(tmp_path / name)
        d = dst.StalenessAwareSampler()
        d.loads(tmp_path / name)
        assert (d.consumer_version, d.max_staleness) == (11, 4)


def test_staleness_adapter_extras():
    # can_sample knows the gate; ndim=2 gets per-dim indices whose data match the info
    sampler = A.StalenessAwareSampler(max_staleness=1)
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(12, ndim=2), sampler=sampler, batch_size=8
    )
    v = torch.arange(6.0)[:, None].expand(6, 2).clone()  # [time, env]
    rb.extend(TensorDict({"obs": torch.zeros(6, 2), "policy_version": v}, [6, 2]))
    sampler.consumer_version = 5
    s, info = rb.sample(return_info=True)
    assert isinstance(info["index"], tuple)
    assert (s["policy_version"] >= 4).all()
    torch.testing.assert_close(info["staleness"], 5 - s["policy_version"])
    sampler.consumer_version = 50
    assert not rb.can_sample()
    with pytest.raises(RuntimeError, match="staleness_weight_fn gave weight inf"):
        sampler.consumer_version = 0  # items newer than the consumer: negative weights
        rb.sample()


def test_staleness_adapter_draws_follow_freshness_weights():
    sampler = A.StalenessAwareSampler(max_staleness=3)
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(8),
        sampler=sampler,
        batch_size=64,
        generator=torch.Generator().manual_seed(4),
    )
    rb.extend(_versioned(8, torch.arange(8.0)))
    sampler.consumer_version = 7
    counts = np.zeros(8, np.int64)
    for _ in range(400):
        counts += np.bincount(rb.sample(return_info=True)[1]["index"].numpy(), minlength=8)
    w = np.array([0, 0, 0, 0, 1 / 4, 1 / 3, 1 / 2, 1])
    assert_frequencies(counts, w / w.sum())


# ---------------------------------------------------------------------- adapter: prompt groups
def _prompt_rb(L, sampler, batch_size, storage="LazyStackStorage", max_size=100):
    return L.ReplayBuffer(
        storage=getattr(L, storage)(max_size), sampler=sampler, batch_size=batch_size
    )


def _prompts(n, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "prompt": torch.randint(groups, (n,), generator=g),
            "id": torch.arange(n),
            ("next", "reward"): torch.randn(n, 2, generator=g),
        },
        [n],
    )


@pytest.mark.parametrize("storage", ["LazyStackStorage", "LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("strategy", ["random", "recency", "reward", "variance"])
def test_prompt_groups_same_draws_as_torchrl(storage, strategy):
    def run(L):
        sampler = L.PromptGroupSampler(num_groups=3, group_key="prompt", strategy=strategy)
        rb = _prompt_rb(L, sampler, 12, storage, max_size=40)
        rb.extend(_prompts(30, 5))
        rb.extend(_prompts(25, 5, seed=1))  # wraps the ring: recency must follow
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # small groups are completed, with one warning
            return [rb.sample(return_info=True)[1]["index"] for _ in range(4)], sampler.state_dict()

    (ref, ref_sd), (ours, our_sd) = run(T), run(A)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(a, b)
    # the recency stamps: the same order (their values count notifications, which differ)
    assert ref_sd.keys() == our_sd.keys()
    if ref_sd:
        torch.testing.assert_close(
            torch.argsort(ref_sd["position_recency"]), torch.argsort(our_sd["position_recency"])
        )


def test_prompt_groups_string_keys_same_as_torchrl():
    def run(L):
        rb = _prompt_rb(L, L.PromptGroupSampler(samples_per_group=2, group_key="q"), 6)
        rb.extend(TensorDict({"q": NonTensorStack(*"aabbbcccd"), "v": torch.arange(9)}, [9]))
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [rb.sample()["v"] for _ in range(5)]

    for a, b in zip(run(T), run(A)):
        torch.testing.assert_close(a, b)


def test_prompt_groups_are_chosen_uniformly():
    sampler = A.PromptGroupSampler(num_groups=1, group_key="prompt")
    rb = _prompt_rb(A, sampler, 2)
    rb.extend(TensorDict({"prompt": torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2])}, [10]))
    rb.set_rng(torch.Generator().manual_seed(5))
    picks = [int(rb.sample()["prompt"][0]) for _ in range(3000)]
    assert_frequencies(np.bincount(picks, minlength=3), [1 / 3] * 3, what="groups")


def test_prompt_groups_follow_in_place_edits_and_pickle_drops_the_cache(tmp_path):
    sampler = A.PromptGroupSampler(num_groups=2, group_key="prompt")
    rb = _prompt_rb(A, sampler, 4, "LazyTensorStorage", max_size=4)
    rb.extend(TensorDict({"prompt": torch.tensor([0, 0, 1, 1])}, [4]))
    rb.sample()
    rb[0] = TensorDict({"prompt": torch.tensor(2)}, [])  # an edit that moves no cursor
    seen = set()
    for _ in range(30):
        seen.update(rb.sample()["prompt"].tolist())
    assert 2 in seen
    restored = pickle.loads(pickle.dumps(sampler))
    assert restored._group_index is None and restored.rng is None


@LIBS
def test_prompt_group_errors(L):
    with pytest.raises(TypeError):
        L.PromptGroupSampler(num_groups=2, samples_per_group=2)
    with pytest.raises(ValueError, match="strategy"):
        L.PromptGroupSampler(num_groups=2, strategy="best")
    rb = _prompt_rb(L, L.PromptGroupSampler(num_groups=3, group_key="prompt"), 8)
    rb.extend(_prompts(6, 3))
    with pytest.raises(ValueError, match="divisible"):
        rb.sample()
    rb = L.ReplayBuffer(
        storage=L.ListStorage(4),
        sampler=L.PromptGroupSampler(num_groups=1, group_key="prompt"),
        batch_size=2,
    )
    rb.extend(_prompts(4, 2))
    with pytest.raises(TypeError, match="Plain ListStorage is not supported"):
        rb.sample()
