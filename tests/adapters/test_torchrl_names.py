"""TorchRL's remaining public names, each beside TorchRL's own on the same data and seed:
the parameter schedulers (``functional_rb.adapters.scheduler``), ``MultiStep`` and
``DensifyReward`` (``functional_rb.adapters.postprocs``), ``find_start_stop_traj`` and
``DEFAULT_DONE_KEYS``, ``CompressedListStorageCheckpointer``, ``Storage.flatten`` and
``CompressedListStorage.to_bytestream``.

TorchRL's prioritized samplers need its C++ extension, which does not load here; the
schedulers are compared on a TorchRL ``Sampler`` holding plain ``alpha`` / ``beta``
attributes (what TorchRL's schedulers read and set), and the annealed values' effect on our
samplers is checked against the sampling rule itself.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("torchrl.data")
from scipy import stats  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data.postprocs import DensifyReward as TDensifyReward  # noqa: E402
from torchrl.data.postprocs import MultiStep as TMultiStep  # noqa: E402
from torchrl.data.replay_buffers import scheduler as TS  # noqa: E402
from torchrl.data.replay_buffers.samplers import Sampler as TSampler  # noqa: E402

import functional_rb.adapters as A  # noqa: E402
from functional_rb.adapters import scheduler as S  # noqa: E402


# ---------------------------------------------------------------------- schedulers
class _TorchRLParams(TSampler):
    """A TorchRL sampler holding ``alpha`` and ``beta`` as TorchRL's prioritized one does."""

    def __init__(self, alpha, beta):
        self.alpha, self.beta = alpha, beta

    def sample(self, storage, batch_size):
        raise NotImplementedError

    def _empty(self):
        pass

    def dumps(self, path):
        pass

    def loads(self, path):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def _ours(alpha=0.6, beta=0.4, n=0):
    rb = A.TensorDictPrioritizedReplayBuffer(
        alpha=alpha, beta=beta, storage=A.ListStorage(max(n, 1))
    )
    if n:
        rb.extend(TensorDict({"x": torch.arange(n)}, [n]))
    return rb


SCHEDULES = {
    "linear": lambda L, obj, p: L.LinearScheduler(obj, p, final_value=0.05, num_steps=7),
    "step_mult": lambda L, obj, p: L.StepScheduler(obj, p, gamma=0.8, n_steps=3, min_value=0.1),
    "step_add": lambda L, obj, p: L.StepScheduler(
        obj, p, gamma=0.15, n_steps=2, mode="additive", max_value=1.3
    ),
    "lambda": lambda L, obj, p: L.LambdaScheduler(
        obj, p, lambda s: 1.0 / (1 + s), min_value=0.0, max_value=0.9
    ),
    "min_zero": lambda L, obj, p: L.StepScheduler(obj, p, gamma=-0.2, mode="additive", min_value=0),
}


@pytest.mark.parametrize("param", ["alpha", "beta"])
@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@pytest.mark.parametrize("tensor", [False, True], ids=["float", "tensor"])
def test_schedules_match_torchrl(kind, param, tensor):
    """Our scheduler on our buffer sets the same values, step by step, as TorchRL's on a
    TorchRL sampler starting from the same value (the buffer is empty: no re-expression)."""
    start = {"alpha": 0.7, "beta": 0.5}
    theirs = _TorchRLParams(**{k: torch.tensor(v) if tensor else v for k, v in start.items()})
    rb = _ours(**start)
    ours, ref = SCHEDULES[kind](S, rb, param), SCHEDULES[kind](TS, theirs, param)
    for step in range(12):
        ours.step()
        ref.step()
        got, want = getattr(rb.sampler, param), float(getattr(theirs, param))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (kind, step, got, want)
    assert type(getattr(rb.sampler, param)) is float


def test_torchrl_suite_scenario_alpha_and_beta_through_buffer():
    """TorchRL's test_prioritized_parameter_scheduler, shortened: alpha annealed linearly to
    its minimum, beta stepped additively to its cap, sampling between steps."""
    rb = A.TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.7, storage=A.ListStorage(max_size=100)
    )
    rb.extend(TensorDict({"data": torch.randn(100, 5)}, batch_size=100))
    alpha_s = S.LinearScheduler(rb, param_name="alpha", final_value=0.2, num_steps=4)
    beta_s = S.StepScheduler(
        rb, param_name="beta", gamma=0.1, n_steps=3, max_value=0.9, mode="additive"
    )
    scheduler = S.SchedulerList(schedulers=(alpha_s, beta_s))
    alphas = torch.nn.functional.pad(torch.linspace(0.6, 0.2, 5), (0, 3), value=0.2)
    betas = (0.7 + torch.arange(3) * 0.1).repeat_interleave(3).clip(None, 0.9)
    for i in range(8):
        assert rb.sampler.alpha == pytest.approx(float(alphas[i]), abs=1e-6)
        assert rb.sampler.beta == pytest.approx(float(betas[i]), abs=1e-6)
        rb.sample(20)
        scheduler.step()


def test_annealed_alpha_reaches_sampling_and_beta_the_weights():
    """After each alpha step the stored values are ``(p + eps) ** alpha`` of the raw
    priorities and draws follow them (chi-square, fixed seed); beta sets the weights."""
    torch.manual_seed(0)
    rb = _ours(alpha=1.0, beta=0.5, n=4)
    priorities = torch.tensor([1.0, 2.0, 4.0, 8.0])
    rb.update_priority(torch.arange(4), priorities)
    alpha_s = S.LinearScheduler(rb, "alpha", final_value=0.0, num_steps=2)
    beta_s = S.StepScheduler(rb, "beta", gamma=0.5, mode="additive")
    for alpha, beta in [(0.5, 1.0), (0.0, 1.5)]:
        alpha_s.step()
        beta_s.step()
        assert (rb.sampler.alpha, rb.sampler.beta) == (alpha, beta)
        expected = (priorities.double() + 1e-8) ** alpha
        np.testing.assert_allclose(rb.sampler.tree_values()[:4], expected.numpy(), rtol=1e-5)
        probs = (expected / expected.sum()).numpy()
        sample, info = rb.sample(4000, return_info=True)
        counts = np.bincount(info["index"].numpy(), minlength=4)
        assert stats.chisquare(counts, probs * counts.sum()).pvalue > 1e-3
        weight = (probs.min() / probs[info["index"].numpy()]) ** beta
        np.testing.assert_allclose(info["priority_weight"].numpy(), weight, rtol=1e-4)


def test_prioritized_slice_sampler_alpha_beta_settable():
    """The slice sampler's alpha re-expresses the stored values (kept by TorchRL's index)
    and its beta reaches the weights; a refused value leaves the sampler unchanged."""
    steps = 40
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[9::10] = True
    data = TensorDict({"obs": torch.arange(steps), ("next", "done"): done}, [steps])
    sampler = A.PrioritizedSliceSampler(max_capacity=steps, alpha=1.0, beta=0.5, slice_len=5)
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(steps), sampler=sampler, batch_size=10
    )
    rb.extend(data)
    rb.sample()
    priorities = torch.linspace(0.5, 4.0, steps)
    rb.update_priority(torch.arange(steps), priorities)
    S.LinearScheduler(rb, "alpha", final_value=0.5, num_steps=1).step()
    np.testing.assert_allclose(
        sampler.tree_values(), (priorities.double() + 1e-8) ** 0.5, rtol=1e-5
    )
    S.StepScheduler(rb, "beta", gamma=2.0).step()
    assert sampler.beta == 1.0
    _, info = rb.sample(return_info=True)
    np.testing.assert_allclose(
        sampler.tree_values(), (priorities.double() + 1e-8) ** 0.5, rtol=1e-5
    )
    assert info["priority_weight"].max() <= 1.0
    for name, bad in [("alpha", -0.1), ("beta", float("nan"))]:
        with pytest.raises(ValueError, match=f"{name} must be greater or equal"):
            setattr(sampler, name, bad)
    assert (sampler.alpha, sampler.beta) == (0.5, 1.0)


def test_torchrl_schedulers_drive_our_sampler_once_registered():
    """TorchRL's schedulers accept a TorchRL ``Sampler``; registering an adapter sampler
    class with TorchRL's abstract base lets them drive it (the buffer cannot be registered)."""

    class Registered(A.PrioritizedSampler):
        pass

    with pytest.raises(TypeError, match="ParameterScheduler only supports Sampler class"):
        TS.LinearScheduler(_ours(), "beta", final_value=1.0, num_steps=4)
    TSampler.register(Registered)
    rb = A.TensorDictReplayBuffer(
        storage=A.ListStorage(8), sampler=Registered(8, alpha=0.7, beta=0.6)
    )
    scheduler = TS.SchedulerList([TS.LinearScheduler(rb.sampler, "beta", 1.0, num_steps=4)])
    values = []
    for _ in range(5):
        scheduler.step()
        values.append(rb.sampler.beta)
    assert values == pytest.approx([0.7, 0.8, 0.9, 1.0, 1.0])
    # and ours accepts TorchRL's in its list
    ours = S.SchedulerList(S.LinearScheduler(rb, "alpha", 0.5, 2))
    ours.append(TS.StepScheduler(rb.sampler, "beta", gamma=0.5))
    ours.step()
    assert (rb.sampler.alpha, rb.sampler.beta) == pytest.approx((0.6, 0.5))


def test_scheduler_state_dict_matches_torchrl_layout():
    """The same entries as TorchRL's; a linear schedule resumes where it stopped (a step
    schedule reads the sampler's current value, which the state does not hold, as in
    TorchRL)."""
    for build in (
        lambda L, o: L.LinearScheduler(o, "beta", 1.0, 5),
        lambda L, o: L.StepScheduler(o, "beta", 0.5, 2, min_value=0.1),
        lambda L, o: L.LambdaScheduler(o, "alpha", abs, max_value=2.0),
    ):
        ours, ref = build(S, _ours(alpha=0.7, beta=0.5)), build(TS, _TorchRLParams(0.7, 0.5))
        for _ in range(3):
            ours.step()
            ref.step()
        sd = ours.state_dict()
        assert set(sd) == set(ref.state_dict())
        assert sd["_step_cnt"] == 3
    ours = S.LinearScheduler(_ours(beta=0.5), "beta", 1.0, 5)
    for _ in range(3):
        ours.step()
    fresh = S.LinearScheduler(_ours(beta=0.5), "beta", 1.0, 5)
    fresh.load_state_dict(ours.state_dict())
    fresh.step()
    ours.step()
    assert fresh.sampler.beta == pytest.approx(ours.sampler.beta) == pytest.approx(0.9)


def test_scheduler_errors():
    rb = _ours()
    with pytest.raises(TypeError, match="ParameterScheduler only supports Sampler class"):
        S.LinearScheduler(object(), "beta", 1.0, 3)
    with pytest.raises(TypeError, match="ParameterScheduler only supports Sampler class"):
        S.LinearScheduler(_TorchRLParams(0.5, 0.5), "beta", 1.0, 3)
    with pytest.raises(ValueError, match="does not have an attribute gamma"):
        S.StepScheduler(rb, "gamma")
    with pytest.raises(AttributeError, match="eps is read-only"):
        S.StepScheduler(rb, "eps")
    with pytest.raises(ValueError, match="Invalid mode: linear. Choose 'multiplicative' or"):
        S.StepScheduler(rb, "beta", mode="linear")
    for bad in (0, -2, "3", True):
        with pytest.raises(ValueError, match="num_steps must be a positive number"):
            S.LinearScheduler(rb, "beta", 1.0, bad)
        with pytest.raises(ValueError, match="n_steps must be a positive number"):
            S.StepScheduler(rb, "beta", n_steps=bad)
    with pytest.raises(ValueError, match="min_value=1.0 is larger than max_value=0.5"):
        S.StepScheduler(rb, "beta", min_value=1.0, max_value=0.5)
    with pytest.raises(TypeError, match="lambda_fn must be callable"):
        S.LambdaScheduler(rb, "beta", 2.0)
    with pytest.raises(TypeError, match="expected a scheduler"):
        S.SchedulerList([S.StepScheduler(rb, "beta"), 3])
    # a value the setter refuses surfaces at step(), the sampler unchanged
    down = S.StepScheduler(rb, "beta", gamma=-1.0, mode="additive")
    with pytest.raises(ValueError, match="beta must be greater or equal to 0"):
        down.step()
    assert rb.sampler.beta == 0.4


# ---------------------------------------------------------------------- MultiStep
def _rollout(batch, steps, *, agents=None, mask=True, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (*batch, steps)
    flag_shape = shape + ((agents,) if agents else (1,))
    done = torch.rand(flag_shape, generator=g) < 0.2
    obs_shape = shape + ((agents, 3) if agents else (3,))
    td = TensorDict(
        {
            "obs": torch.randn(obs_shape, generator=g),
            "step": torch.arange(steps)[:, None].expand(*shape, agents or 1).clone(),
            "next": {
                "obs": torch.randn(obs_shape, generator=g),
                "step": torch.arange(1, steps + 1)[:, None].expand(*shape, agents or 1).clone(),
                "reward": torch.randn(flag_shape, generator=g).to(dtype),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros_like(done),
            },
        },
        shape,
    )
    if mask and not agents:
        td["collector", "mask"] = torch.rand(shape, generator=g) < 0.9
    return td


def _assert_same_td(ours, theirs, **tol):
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    assert ours.batch_size == theirs.batch_size
    for key in theirs.keys(True, True):
        a, b = ours.get(key), theirs.get(key)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), key
        torch.testing.assert_close(a, b, msg=lambda m, k=key: f"{k}: {m}", **tol)


@pytest.mark.parametrize(
    "batch,steps,n,gamma,agents",
    [
        ((), 12, 3, 0.9, None),
        ((2,), 7, 1, 1.0, None),
        ((3, 2), 9, 4, 0.5, None),
        ((2,), 30, 5, 0.99, None),
        ((2,), 6, 3, 0.9, 3),
        ((), 5, 8, 0.7, None),
    ],
)
def test_multistep_matches_torchrl(batch, steps, n, gamma, agents):
    data = _rollout(batch, steps, agents=agents)
    before = data.clone()
    ours, theirs = A.MultiStep(gamma, n)(data), TMultiStep(gamma, n)(data)
    _assert_same_td(ours, theirs)
    _assert_same_td(data, before, rtol=0, atol=0)  # the caller's batch is untouched
    torch.testing.assert_close(A.MultiStep(gamma, n).gammas, TMultiStep(gamma, n).gammas)


def test_multistep_settable_keys_and_float64_rewards():
    data = _rollout((2,), 10, dtype=torch.float64).rename_key_(("next", "reward"), ("next", "r"))
    ours, theirs = A.MultiStep(0.9, 3), TMultiStep(0.9, 3)
    for m in (ours, theirs):
        m.reward_keys, m.mask_key, m.done_key = ("r",), None, "terminated"
    # float64 rewards are summed in float32 by the core: float32 rounding
    _assert_same_td(ours(data), theirs(data), rtol=1e-6, atol=1e-6)


def test_multistep_as_collector_postproc_shape():
    """TorchRL's docstring example: steps 0..9, no done: next step_count shifted by up to
    n_steps."""
    td = TensorDict(
        {
            "step_count": torch.arange(10)[:, None],
            ("next", "step_count"): torch.arange(1, 11)[:, None],
            ("next", "reward"): torch.ones(10, 1),
            ("next", "done"): torch.zeros(10, 1, dtype=torch.bool),
        },
        [10],
    )
    out = A.MultiStep(n_steps=4, gamma=0.99)(td)
    assert out["next", "step_count"].squeeze(-1).tolist() == [4, 5, 6, 7, 8, 9, 10, 10, 10, 10]
    _assert_same_td(out, TMultiStep(n_steps=4, gamma=0.99)(td))


def test_multistep_errors():
    for lib in (A, T):
        with pytest.raises(ValueError, match="n_steps must be a non-negative integer"):
            lib.MultiStep(0.9, 0)
        for gamma in (0.0, 1.5):
            with pytest.raises(ValueError, match="got out-of-bounds gamma decay"):
                lib.MultiStep(gamma, 2)
    with pytest.raises(ValueError, match=r"MultiStep: the batch \(0,\) holds no step"):
        A.MultiStep(0.9, 2)(_rollout((), 0))
    m = A.MultiStep(0.9, 2)
    m.reward_keys = ("reward", "other")
    with pytest.raises(ValueError, match="reward_keys must hold exactly one key"):
        m(_rollout((), 4))
    bad = _rollout((2,), 4, mask=False)
    bad["next", "done"] = torch.zeros(2, 4, 3, dtype=torch.bool)
    bad["x"] = torch.zeros(2, 4)  # no agent dim: cannot follow the done's shape
    for lib in (A, T):
        with pytest.raises(RuntimeError, match="tensordict shape must be compatible"):
            lib.MultiStep(0.9, 2)(bad)


# ---------------------------------------------------------------------- DensifyReward
def _sparse(batch, steps, seed=0, p_done=0.15):
    g = torch.Generator().manual_seed(seed)
    shape = (*batch, steps, 1)
    done = torch.rand(shape, generator=g) < p_done
    reward = torch.where(done, torch.randn(shape, generator=g), torch.zeros(shape))
    reward += 0.01 * torch.randn(shape, generator=g)
    return TensorDict({("next", "reward"): reward, ("next", "done"): done}, shape[:-1])


@pytest.mark.parametrize(
    "batch,steps,discount",
    [((), 10, 1.0), ((2,), 30, 0.1), ((3,), 12, 0.9), ((2, 2), 8, 1.3), ((), 1, 0.5)],
)
def test_densify_reward_matches_torchrl(batch, steps, discount):
    data = _sparse(batch, steps)
    ours = A.DensifyReward(discount=discount)(data.clone())
    theirs = TDensifyReward(discount=discount)(data.clone())
    _assert_same_td(ours, theirs)


def test_densify_reward_long_trajectory_drops_the_same_terms():
    """Past 1,603 steps at discount 0.99 TorchRL drops terms below 1e-7: so do we."""
    data = _sparse((2,), 2500, p_done=0.0002)
    data["next", "reward"] = torch.ones_like(data["next", "reward"], dtype=torch.float64)
    ours = A.DensifyReward(discount=0.99)(data.clone())["next", "reward"]
    theirs = TDensifyReward(discount=0.99)(data.clone())["next", "reward"]
    torch.testing.assert_close(ours, theirs)
    untruncated = (1 - 0.99 ** torch.arange(2500, 0, -1.0, dtype=torch.float64)) / 0.01
    assert (ours[0, :500, 0] < untruncated[:500] - 1e-6).all()


def test_densify_reward_docstring_example_and_keys():
    td = TensorDict(
        {"next": {"reward": torch.zeros(10, 1), "done": torch.zeros(10, 1, dtype=torch.bool)}}, [10]
    )
    td["next", "done"][[3, 7]] = True
    td["next", "reward"][3], td["next", "reward"][7] = 3, 7
    out = A.DensifyReward(reward_key_out="dense")(td.clone())
    assert out["next", "dense"].squeeze(-1).tolist() == [3.0] * 4 + [7.0] * 4 + [0.0] * 2
    assert (out["next", "reward"] == td["next", "reward"]).all()
    ref = TDensifyReward(reward_key_out="dense")(td.clone())
    _assert_same_td(out, ref)
    assert A.DensifyReward().in_keys == TDensifyReward().in_keys
    assert A.DensifyReward(reward_key_out="x").out_keys == ["x"]


def test_densify_reward_time_dim_and_discount_zero():
    data = _sparse((3,), 9)
    ours_last = A.DensifyReward(discount=0.8)(data.clone())
    time_first = data.clone().transpose(0, 1)  # [T, B]: time along batch dim 0
    ours_first = A.DensifyReward(discount=0.8, time_dim=0)(time_first)
    torch.testing.assert_close(
        ours_first["next", "reward"].transpose(0, 1), ours_last["next", "reward"]
    )
    with pytest.raises(ValueError, match="time_dim=2 is not a batch dim"):
        A.DensifyReward(time_dim=2)(data.clone())
    # discount 0: the rewards as they are (TorchRL fails there)
    out = A.DensifyReward(discount=0.0)(data.clone())
    torch.testing.assert_close(out["next", "reward"], data["next", "reward"])
    with pytest.raises(IndexError):
        TDensifyReward(discount=0.0)(data.clone())
    with pytest.raises(ValueError, match="discount must be a finite number >= 0"):
        A.DensifyReward(discount=-0.5)
    bad = data.clone()
    bad["next", "done"] = bad["next", "done"].squeeze(-1)
    for cls in (A.DensifyReward, TDensifyReward):
        with pytest.raises(RuntimeError, match="reward and done state are expected to have"):
            cls()(bad)


# ---------------------------------------------------------------------- boundaries
def test_default_done_keys_and_checkpointer_are_torchrl_s():
    assert A.DEFAULT_DONE_KEYS == T.DEFAULT_DONE_KEYS
    assert A.CompressedListStorageCheckpointer is A.checkpointers.CompressedListStorageCheckpointer
    assert isinstance(A.CompressedListStorage(4).checkpointer, A.CompressedListStorageCheckpointer)


def test_compressed_list_checkpointer_files_load_in_torchrl(tmp_path):
    items = [torch.arange(6).reshape(2, 3) * i for i in range(3)]
    ours = A.CompressedListStorage(5)
    ours.checkpointer = A.CompressedListStorageCheckpointer()
    rb = A.ReplayBuffer(storage=ours)
    rb.extend(items)
    ours.dumps(tmp_path / "s")
    theirs = T.CompressedListStorage(5)
    theirs.loads(tmp_path / "s")
    assert len(theirs) == 3
    for i in range(3):
        assert torch.equal(theirs.get(i), items[i])


def _random_signals(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        steps = int(torch.randint(1, 12, (), generator=g))
        dims = int(torch.randint(0, 3, (), generator=g))
        batch = [int(b) for b in torch.randint(1, 4, (dims,), generator=g)]
        at_capacity = bool(torch.randint(0, 2, (), generator=g))
        cursor = None
        if at_capacity and torch.rand((), generator=g) < 0.5:
            cursor = int(torch.randint(0, steps, (), generator=g))
        if torch.rand((), generator=g) < 0.5:
            kw = {"trajectory": torch.randint(0, 3, (steps, *batch), generator=g)}
        else:
            kw = {"end": torch.rand(steps, *batch, generator=g) < 0.3}
        yield dict(kw, at_capacity=at_capacity, cursor=cursor)


def test_find_start_stop_traj_matches_torchrl():
    for kw in _random_signals(300):
        ours, theirs = A.find_start_stop_traj(**kw), T.find_start_stop_traj(**kw)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b), kw


@pytest.mark.parametrize("cursor", [4, torch.tensor([2, 3, 4]), torch.tensor(4), range(2, 5)])
def test_find_start_stop_traj_docstring_example(cursor):
    end = torch.zeros(10, dtype=torch.bool)
    end[2] = end[7] = True
    before = end.clone()
    start, stop, lengths = A.find_start_stop_traj(end=end, at_capacity=True, cursor=cursor)
    assert start.squeeze(-1).tolist() == [8, 3, 5]
    assert stop.squeeze(-1).tolist() == [2, 4, 7]
    assert lengths.tolist() == [5, 2, 3]
    assert torch.equal(end, before)
    trajectory = torch.tensor([5, 5, 5, 0, 0, 1, 1, 1, 5, 5])
    for a, b in zip(
        A.find_start_stop_traj(trajectory=trajectory, at_capacity=True, device="cpu"),
        (start, stop, lengths),
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(at_capacity=True), TypeError, "Exactly one of `trajectory` and `end`"),
        (dict(end=torch.zeros(0, dtype=torch.bool), at_capacity=True), RuntimeError, "empty"),
        (dict(end=torch.tensor(True), at_capacity=True), RuntimeError, "at least 1-dimensional"),
        (
            dict(
                end=torch.zeros(4, dtype=torch.bool),
                at_capacity=True,
                cursor=torch.tensor([], dtype=torch.long),
            ),
            RuntimeError,
            "cursor must not be",
        ),
        (
            dict(end=torch.zeros(4, dtype=torch.bool), at_capacity=True, cursor=range(0)),
            RuntimeError,
            "cursor must not be an empty range",
        ),
        (
            dict(end=torch.zeros(4, dtype=torch.bool), at_capacity=True, cursor=1.5),
            RuntimeError,
            "cursor should be an integer",
        ),
        (
            dict(end=torch.zeros(4, dtype=torch.bool), at_capacity=True, cursor=9),
            IndexError,
            "out of bounds",
        ),
    ],
)
def test_find_start_stop_traj_errors_as_torchrl(kwargs, exc, match):
    for lib in (A, T):
        with pytest.raises(exc, match=match):
            lib.find_start_stop_traj(**kwargs)


# ---------------------------------------------------------------------- storages
@pytest.mark.parametrize("full", [False, True])
def test_flatten_matches_torchrl(full):
    rows = 3 if full else 2
    data = TensorDict(
        {"x": torch.arange(rows * 4).reshape(rows, 4), "y": {"z": torch.randn(rows, 4, 2)}},
        [rows, 4],
    )
    flat = {}
    for name, lib in (("ours", A), ("theirs", T)):
        storage = lib.LazyTensorStorage(12, ndim=2)
        storage.set(torch.arange(rows), data)
        flat[name] = storage.flatten()
    ours, theirs = flat["ours"], flat["theirs"]
    assert isinstance(ours, A.TensorStorage) and len(ours) == len(theirs) == rows * 4
    _assert_same_td(ours[:], theirs[:])
    pytree = A.LazyTensorStorage(8, ndim=2)
    pytree.set(torch.arange(2), {"a": torch.arange(8).reshape(2, 4)})
    assert torch.equal(pytree.flatten()[:]["a"], torch.arange(8))


def test_flatten_one_dim_and_errors():
    for lib in (A, T):
        storage = lib.LazyTensorStorage(5)
        assert storage.flatten() is storage
        listed = lib.ListStorage(5)
        assert listed.flatten() is listed
        with pytest.raises(RuntimeError, match="Cannot flatten a non-initialized storage"):
            lib.LazyTensorStorage(6, ndim=2).flatten()


def test_to_bytestream_matches_torchrl():
    ours, theirs = A.CompressedListStorage(4), T.CompressedListStorage(4)
    for tensor in (
        torch.arange(6.0).reshape(2, 3),
        torch.arange(12).reshape(3, 4).T,
        torch.tensor([True, False]),
    ):
        assert ours.to_bytestream(tensor) == theirs.to_bytestream(tensor)
    # TorchRL's numpy and object branches fail (isinstance(x, np.array)); ours keep their
    # documented meaning: the array's buffer, else a pickle
    arr = np.arange(5, dtype=np.int16)
    assert ours.to_bytestream(arr) == arr.tobytes()
    obj = {"a": [1, 2], "b": "c"}
    assert pickle.loads(ours.to_bytestream(obj)) == obj
    with pytest.raises(TypeError):
        theirs.to_bytestream(obj)
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert ours.to_bytestream(bf16) == bf16.view(torch.int16).numpy().tobytes()
    assert len(ours.to_bytestream(torch.zeros(3, 3))) == 36
