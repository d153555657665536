"""The errors a TorchRL user meets in the adapters name the cause and the fix.

A key the user names that the data does not hold raises a ``KeyError`` naming the argument,
the key, the entries the data has and the fix, never ``'NoneType' object is not
subscriptable`` from deeper down (``TensorDict.get(key)`` returns None for a missing key).
A write of the wrong trailing shape names the entry, a missing entry prints cleanly, sampling
an empty buffer says which storage and how to fix it (each with TorchRL's type and phrase
first), and importing the adapters without torch names the extra to install."""

import re
import subprocess
import sys

import pytest
from _hang import HANG_S

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
T = pytest.importorskip("torchrl.data")
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


# -------------------------------------------------------------- shapes, empty buffers, no torch
def _td(obs_dim=4, reward_dim=1):
    return TensorDict(
        {"obs": torch.zeros(8, obs_dim), "next": {"reward": torch.zeros(8, reward_dim)}}, [8]
    )


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_wrong_trailing_shape_names_the_entry(storage):
    for bad, entry, want, got in (
        (_td(obs_dim=5), "'obs'", "[4]", "[5]"),
        (_td(reward_dim=2), "('next', 'reward')", "[1]", "[2]"),
    ):
        caught = []
        for L in (T, A):
            rb = L.TensorDictReplayBuffer(storage=getattr(L, storage)(100))
            rb.extend(_td())
            with pytest.raises(RuntimeError) as info:
                rb.extend(bad)
            caught.append(str(info.value))
        theirs, ours = caught
        assert ours.startswith(theirs)  # TorchRL's type and phrase first
        for part in (
            entry,
            f"shape {want} there",
            f"have shape {got}",
            f"Give the entry shape {want}",
        ):
            assert part in ours, (part, ours)
    rb = A.ReplayBuffer(storage=A.LazyTensorStorage(10))
    rb.extend(torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match=r"shape mismatch.*items of shape \[4\].*\[5\]"):
        rb.extend(torch.zeros(3, 5))


def test_missing_key_prints_cleanly():
    rb = A.TensorDictReplayBuffer(storage=A.LazyTensorStorage(100))
    rb.extend(_td())
    with pytest.raises(KeyError) as info:
        rb.extend(TensorDict({"obs": torch.zeros(8, 4)}, [8]))
    text = str(info.value)
    assert (
        "\\" not in text
        and "('next', 'reward')" in text
        and text.startswith("LazyTensorStorage.set")
    )


@pytest.mark.parametrize("storage", ["ListStorage", "LazyTensorStorage"])
def test_sampling_an_empty_buffer_says_which_and_how_to_fix(storage):
    for L in (T, A):
        rb = L.ReplayBuffer(storage=getattr(L, storage)(10), batch_size=2)
        with pytest.raises(
            RuntimeError, match=re.escape("Cannot sample from an empty storage.")
        ) as info:
            rb.sample()
    text = str(info.value)
    assert f"ReplayBuffer.sample: the buffer is empty: its {storage} holds no items" in text
    assert "extend()" in text and "len(buffer) > 0" in text
    rb = A.ReplayBuffer(storage=A.ListStorage(10), batch_size=2, consume_after_n_samples=1)
    rb.extend(torch.arange(2))
    rb.sample()
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage.*consumed"):
        rb.sample()


_NO_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import functional_rb  # the core needs no torch
try:
    import functional_rb.adapters
except ImportError as e:
    print(type(e).__name__, "|", e.name, "|", e)
"""


def test_importing_the_adapters_without_torch_names_the_extra():
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 0, out.stderr
    kind, name, message = out.stdout.strip().split(" | ")
    assert kind == "ModuleNotFoundError" and name == "torch"
    assert 'pip install "functional_rb[torch]"' in message and "'torch' is not" in message
