"""The adapters' prioritized buffers drop priority updates whose slot was rewritten after the
sample that drew it (pytorch/rl#4041), and count them (``dropped_priority_updates``)."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from functional_rb.adapters import (
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    PrioritizedSampler,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
)

CAP = 8


def _td(start, n):
    return TensorDict(
        {
            "obs": torch.arange(start, start + n, dtype=torch.float32)[:, None],
            "td_error": torch.ones(n),
        },
        batch_size=[n],
    )


def _values(rb):
    return rb.sampler.tree_values()  # (p + eps) ** alpha per slot, alpha = 1, eps = 0


def _buffers():
    return {
        "prioritized": lambda: PrioritizedReplayBuffer(
            alpha=1.0, beta=0.5, eps=0.0, storage=LazyTensorStorage(CAP), batch_size=6
        ),
        "generic": lambda: ReplayBuffer(
            storage=LazyTensorStorage(CAP),
            batch_size=6,
            sampler=PrioritizedSampler(CAP, alpha=1.0, beta=0.5, eps=0.0),
        ),
    }


@pytest.mark.parametrize("kind", sorted(_buffers()))
def test_a_delayed_update_across_the_wraparound_never_moves_a_newer_item(kind):
    torch.manual_seed(0)
    rb = _buffers()[kind]()
    rb.extend(torch.arange(CAP - 2, dtype=torch.float32))
    _, info = rb.sample(return_info=True)
    index = torch.as_tensor(info["index"])
    rb.extend(torch.arange(100, 105, dtype=torch.float32))  # slots 6, 7, 0, 1, 2: the ring wraps
    rewritten = np.isin(np.arange(CAP), [6, 7, 0, 1, 2])
    stale = rewritten[index.numpy()]
    before = _values(rb)
    rb.update_priority(index, torch.full((len(index),), 30.0))
    after = _values(rb)
    np.testing.assert_array_equal(after[rewritten], before[rewritten])
    if (~stale).any():
        np.testing.assert_allclose(after[np.unique(index.numpy()[~stale])], 30.0)
    assert rb.dropped_priority_updates == int(stale.sum())
    # a second, on-time round: nothing dropped
    _, info = rb.sample(return_info=True)
    rb.update_priority(info["index"], 2.0)
    assert rb.dropped_priority_updates == int(stale.sum())


def test_the_test_above_exercises_both_kinds_of_entries():
    torch.manual_seed(0)
    rb = _buffers()["prioritized"]()
    rb.extend(torch.arange(CAP - 2, dtype=torch.float32))
    _, info = rb.sample(return_info=True)
    stale = np.isin(np.asarray(info["index"]), [0, 1, 2])
    assert stale.any() and (~stale).any()


def test_tensordict_buffers_check_update_tensordict_priority():
    torch.manual_seed(1)
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=0.5, eps=0.0, storage=LazyTensorStorage(CAP), batch_size=6
    )
    rb.extend(_td(0, CAP))
    sample = rb.sample()
    rb.extend(_td(50, 3))  # slots 0, 1, 2 rewritten: extend's own priorities are never dropped
    assert rb.dropped_priority_updates == 0
    np.testing.assert_allclose(_values(rb)[:3], 1.0)
    sample.set("td_error", torch.full((6,), 20.0))
    rb.update_tensordict_priority(sample)
    stale = np.isin(sample["index"].numpy(), [0, 1, 2])
    assert rb.dropped_priority_updates == int(stale.sum()) > 0
    np.testing.assert_allclose(_values(rb)[:3], 1.0)
    fresh = np.unique(sample["index"].numpy()[~stale])
    np.testing.assert_allclose(_values(rb)[fresh], 20.0)


def test_a_slot_drawn_again_after_its_rewrite_is_updated():
    """Bare indices cannot say which sample they came from: the latest draw counts."""
    torch.manual_seed(2)
    rb = _buffers()["prioritized"]()
    rb.extend(torch.arange(CAP, dtype=torch.float32))
    rb.sample(return_info=True)
    rb.extend(torch.arange(100, 100 + CAP, dtype=torch.float32))  # everything rewritten
    _, info = rb.sample(return_info=True)  # drawn again
    rb.update_priority(info["index"], 5.0)
    assert rb.dropped_priority_updates == 0
    np.testing.assert_allclose(_values(rb)[np.unique(np.asarray(info["index"]))], 5.0)


def test_empty_makes_every_drawn_slot_stale_and_undrawn_slots_stay_writable():
    torch.manual_seed(3)
    rb = _buffers()["prioritized"]()
    rb.extend(torch.arange(CAP, dtype=torch.float32))
    _, info = rb.sample(return_info=True)
    rb.empty()
    rb.extend(torch.arange(CAP, dtype=torch.float32))
    rb.update_priority(info["index"], 9.0)
    assert rb.dropped_priority_updates == len(info["index"])
    undrawn = np.setdiff1d(np.arange(CAP), np.asarray(info["index"]))
    rb.update_priority(torch.as_tensor(undrawn), 4.0)  # never drawn: applied
    np.testing.assert_allclose(_values(rb)[undrawn], 4.0)
