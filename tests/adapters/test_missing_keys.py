"""A key the user names that the data does not hold raises a ``KeyError`` naming the argument,
the key, the entries the data has and the fix, never ``'NoneType' object is not
subscriptable`` from deeper down (``TensorDict.get(key)`` returns None for a missing key)."""

import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict

import functional_rb.adapters as A
from functional_rb.adapters import errors


def _steps(n=20):
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[n // 2 - 1] = done[-1] = True
    return TensorDict(
        {"obs": torch.arange(n), ("next", "done"): done, ("next", "reward"): torch.ones(n, 1)}, [n]
    )


def test_entry_returns_the_value_or_names_what_is_missing():
    td = TensorDict({"a": torch.zeros(2), ("n", "b"): torch.ones(2)}, [2])
    assert torch.equal(errors.entry(td, ("n", "b"), where="f", argument="k"), torch.ones(2))
    with pytest.raises(KeyError) as e:
        errors.entry(td, "c", where="Thing.sample", argument="traj_key", fix="Do this.")
    msg = str(e.value)
    assert "Thing.sample: traj_key='c' is not in the data" in msg
    assert "whose entries are [('n', 'b'), 'a']. Do this." in msg
    assert isinstance(e.value, KeyError) and str(e.value) == e.value.args[0]  # printed as is


def test_slice_sampler_traj_key_missing_names_it():
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(100),
        batch_size=8,
        sampler=A.SliceSampler(slice_len=4, traj_key="episode"),
    )
    rb.extend(TensorDict({"obs": torch.randn(20, 2)}, [20]))  # neither ids nor end flags
    with pytest.raises(
        KeyError,
        match=r"SliceSampler: traj_key='episode' is not in the data"
        r".*'obs'.*end_key",
    ):
        rb.sample()


def test_slice_sampler_missing_traj_key_still_falls_back_to_stored_end_flags():
    # TorchRL's rule, unchanged: a traj_key absent from the storage, an end key present
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(100),
        batch_size=8,
        sampler=A.SliceSampler(slice_len=4, traj_key="episode"),
    )
    rb.extend(_steps())
    assert rb.sample().shape == (8,)


def test_multistep_missing_done_or_reward_names_it():
    step = A.MultiStep(gamma=0.9, n_steps=2)
    with pytest.raises(KeyError, match=r"MultiStep: done_key=\('next', 'done'\) is not in"):
        step(
            TensorDict({"obs": torch.zeros(1, 4), ("next", "reward"): torch.ones(1, 4, 1)}, [1, 4])
        )
    with pytest.raises(KeyError, match=r"MultiStep: reward_keys=\('next', 'reward'\) is not"):
        step(
            TensorDict(
                {
                    "obs": torch.zeros(1, 4),
                    ("next", "done"): torch.zeros(1, 4, 1, dtype=torch.bool),
                },
                [1, 4],
            )
        )


def test_prompt_group_sampler_missing_group_key_names_it():
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(16),
        batch_size=4,
        sampler=A.PromptGroupSampler(samples_per_group=2),
    )
    rb.extend(TensorDict({"prompt": torch.arange(8) // 2}, [8]))
    with pytest.raises(KeyError, match=r"PromptGroupSampler: group_key='query' is not in"):
        rb.sample()


def test_routed_writes_missing_routing_key_name_it():
    members = [A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(10)) for _ in range(2)]
    rb = A.ReplayBufferEnsemble(*members, batch_size=2, routing_key="member")
    with pytest.raises(KeyError, match=r"routing_key='member' is not in the data.*routing_dim"):
        rb.extend(TensorDict({"obs": torch.zeros(4)}, [4]))
    rb.extend(TensorDict({"obs": torch.zeros(4), "member": torch.tensor([0, 1, 0, 1])}, [4]))
    assert [len(m) for m in members] == [2, 2]


def test_sequence_unit_missing_done_key_names_it():
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(50),
        batch_size=2,
        sample_unit=A.Sequence(length=3, done_key="finished"),
    )
    rb.extend(_steps())
    with pytest.raises(KeyError, match=r"Sequence: done_key='finished' is not in the data"):
        rb.sample()
