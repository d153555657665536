"""The exact pass over all trajectory records, counted a block at a time: the same count and
the same ``u``-th eligible record as the whole-array pass, for any block size, and the slice
samplers' compiled ``sample`` holds no temporary that grows with the capacity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_rb as frb
from functional_rb.samplers import trajectories


def _state(lengths, num_envs, row_cap, steps_per_add):
    """A slice sampler's records after episodes of ``lengths`` were added to every row
    (rows shifted against each other), ``ctx.filled`` too."""
    done = np.zeros(sum(lengths), bool)
    done[np.cumsum(lengths) - 1] = True
    done[-1] = False  # the newest episode is still running
    rb = frb.ReplayBuffer(
        capacity=num_envs * row_cap,
        sampler=frb.SliceSampler(slice_len=2),
        batch_size=2,
        ndim=2,
    )
    state = rb.init({"next": {"done": jnp.zeros((num_envs,), bool)}})
    rows = np.stack([np.roll(done, 3 * e) for e in range(num_envs)])
    for a in range(0, rows.shape[1], steps_per_add):
        state = rb.add(state, {"next": {"done": rows[:, a : a + steps_per_add]}})
    return state.sampler, rb.context(state).filled


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=20),
    num_envs=st.sampled_from([1, 3]),
    row_cap=st.sampled_from([5, 17, 40]),
    block=st.sampled_from([1, 4, 7, 1 << 14]),
    seq_len=st.integers(1, 6),
    complete=st.booleans(),
)
def test_blocked_pass_equals_the_whole_array(lengths, num_envs, row_cap, block, seq_len, complete):
    sst, filled = _state(lengths, num_envs, row_cap, steps_per_add=6)
    ks, _, elig = trajectories.all_records(sst, filled, seq_len, True, complete)
    elig, ks = np.asarray(elig).reshape(-1), np.asarray(ks).reshape(-1)
    flat = np.nonzero(elig)[0]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(trajectories, "BLOCK", block)
        n = int(trajectories.count_eligible(sst, filled, seq_len, True, complete))
        assert n == flat.size
        counts = trajectories._block_counts(sst, filled, seq_len, True, complete)

        # every u in one compiled call: n eager calls would be most of the test's time
        @jax.jit
        def locate_all(sst, counts, filled):
            def one(u):
                return trajectories._locate(sst, counts, u, filled, seq_len, True, complete)

            return jax.vmap(one)(jnp.arange(n, dtype=jnp.int32))

        e, k = locate_all(sst, counts, filled)
        np.testing.assert_array_equal(np.asarray(e), flat // row_cap)
        np.testing.assert_array_equal(np.asarray(k), ks[flat])


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=20),
    num_envs=st.sampled_from([1, 3]),
    row_cap=st.sampled_from([5, 17, 40]),
    seq_len=st.integers(1, 9),
    strict=st.booleans(),
    complete=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    jit=st.booleans(),
)
def test_a_draw_hands_on_what_it_read_of_its_records(
    lengths, num_envs, row_cap, seq_len, strict, complete, seed, jit
):
    """``draw_records_read`` draws what ``draw_records`` draws, and the geometry it hands to
    ``slice_indices`` is ``record``'s for every drawn record, whether the draw ended among
    its candidates or in the exact fallback (long slices over short episodes), eager and
    under jit."""
    sst, filled = _state(lengths, num_envs, row_cap, steps_per_add=6)
    bits = jax.random.bits(jax.random.key(seed), (16, trajectories.TRIES + 1), jnp.uint32)

    def draw(sst, bits, filled):
        e, k, ok, rec = trajectories.draw_records_read(sst, bits, seq_len, filled, strict, complete)
        want = trajectories.record(sst, e, k, filled)
        plain = trajectories.draw_records(sst, bits, seq_len, filled, strict, complete)
        return (e, k, ok), plain, want, rec

    got, plain, want, rec = (jax.jit(draw) if jit else draw)(sst, bits, filled)
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b)
    if rec is None:  # every alive trajectory eligible: the draw reads no record
        assert not strict and not complete
        return
    ok = np.asarray(got[2])
    for a, b in zip(rec, want):
        np.testing.assert_array_equal(np.asarray(a)[ok], np.asarray(b)[ok])


def test_exact_fallback_draws_uniformly_over_eligible_records(monkeypatch):
    """Most trajectories too short for the slice, so most slices fall back to the exact pass;
    with blocks of 4 record slots, the trajectories drawn are uniform over the eligible ones
    (chi-square, fixed seed), and none is short."""
    from scipy.stats import chisquare

    monkeypatch.setattr(trajectories, "BLOCK", 4)
    jax.clear_caches()  # a sampler traced with another block size would be reused
    lengths = [1, 2, 9, 1, 1, 10, 2, 1, 1, 1, 12, 2, 1, 1, 8, 1, 2, 11, 1, 3]
    done = np.zeros(sum(lengths), bool)
    done[np.cumsum(lengths) - 1] = True
    ep = np.repeat(np.arange(len(lengths)), lengths)
    rb = frb.ReplayBuffer(capacity=128, sampler=frb.SliceSampler(slice_len=8), batch_size=8 * 512)
    state = rb.init({"ep": jnp.int32(0), "next": {"done": jnp.bool_(False)}})
    state = rb.add(state, {"ep": ep, "next": {"done": done}})
    sample = jax.jit(rb.sample)
    drawn = []
    for i in range(4):
        s, state = sample(state, jax.random.key(i))
        assert bool(np.asarray(s.mask).all())
        drawn.append(np.asarray(s.data["ep"])[:, 0])
    drawn = np.concatenate(drawn)
    long_eps = [i for i, n in enumerate(lengths) if n >= 8]
    assert set(drawn.tolist()) == set(long_eps)
    counts = np.array([np.sum(drawn == i) for i in long_eps])
    assert chisquare(counts).pvalue > 1e-3, counts
    jax.clear_caches()


@pytest.mark.parametrize(
    "sampler",
    [
        frb.SliceSampler(slice_len=8),
        frb.EpisodeSampler(slice_len=8),
        frb.PrioritizedSliceSampler(slice_len=8, alpha=0.6, beta=0.4),
    ],
    ids=lambda s: type(s).__name__,
)
def test_sample_program_holds_no_capacity_sized_temporary(sampler):
    """XLA's CPU runtime allocates every temporary of a program at each call, those of a
    branch not taken too: an O(capacity) exact pass in the sample's program cost a 1.2 GB
    allocation and its page faults at every sample of a 10^8-step buffer."""
    if jax.default_backend() != "cpu":
        pytest.skip("the allocation per call is the CPU runtime's")
    # the exact pass holds ~0.5 MB of one block's temporaries whatever the capacity; a
    # temporary of a quarter byte per stored step already fails
    capacity = 1 << 22
    rb = frb.ReplayBuffer(capacity=capacity, sampler=sampler, batch_size=64)
    state = rb.init({"obs": jnp.zeros((2,), jnp.uint8), "next": {"done": jnp.bool_(False)}})
    done = (np.arange(256) % 50) == 49
    batch = {"obs": np.zeros((256, 2), np.uint8), "next": {"done": done}}
    state = rb.add(state, batch)
    compiled = jax.jit(rb.sample, donate_argnums=0).lower(state, jax.random.key(0)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < capacity // 4, f"{temp:,} bytes of temporaries at capacity {capacity:,}"


RECORD_SAMPLERS = {
    "slice strict": lambda: frb.SliceSampler(slice_len=4, end_key="done"),
    "slice loose": lambda: frb.SliceSampler(slice_len=4, end_key="done", strict_length=False),
    "episodes": lambda: frb.EpisodeSampler(slice_len=4, end_key="done"),
}


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(RECORD_SAMPLERS)),
    ends=st.lists(st.booleans(), max_size=20),
    capacity=st.sampled_from([6, 12]),
    jit=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_record_samplers_mask_says_whether_it_can_sample(name, ends, capacity, jit, seed):
    """``draw_reports_ok``: ``rb.sample`` reads whether it could sample from the draw's mask
    instead of ``can_sample``; the two agree on every state (empty, only short trajectories,
    unfinished episodes, a wrapped ring)."""
    rb = frb.ReplayBuffer(capacity=capacity, batch_size=8, sampler=RECORD_SAMPLERS[name]())
    assert rb.sampler.draw_reports_ok
    state = rb.init({"t": jnp.int32(0), "done": jnp.bool_(False)})
    if ends:
        t = jnp.arange(len(ends), dtype=jnp.int32)
        state = rb.add(state, {"t": t, "done": jnp.asarray(ends)})
    can = bool(rb.can_sample(state))
    sample = jax.jit(rb.sample) if jit else rb.sample
    if not can and not jit:
        with pytest.raises(ValueError, match="nothing can be sampled yet"):
            sample(state, jax.random.key(seed))
        return
    s, _ = sample(state, jax.random.key(seed))
    assert bool(jnp.any(s.mask)) == can
    assert bool(jnp.all(jnp.any(s.mask, axis=1))) == can  # every slice, or none
