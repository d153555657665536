"""What seeds what (docs/torchrl.md, "Seeding"), as in TorchRL: without a ``generator=``, the
uniform and slice samplers draw from torch's global generator and the prioritized ones from
NumPy's; with one, every sampler draws from it and the global generators are left alone."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
from tensordict import TensorDict

import functional_rb.adapters as A

SAMPLERS = {
    "random": lambda: A.RandomSampler(),
    "slice": lambda: A.SliceSampler(slice_len=4),
    "prioritized": lambda: A.PrioritizedSampler(200, alpha=0.7, beta=0.5),
    "prioritized_slice": lambda: A.PrioritizedSliceSampler(200, alpha=0.7, beta=0.5, slice_len=4),
}
PRIORITIZED = {"prioritized", "prioritized_slice"}


def _batch(kind, **buffer_kwargs):
    rb = A.TensorDictReplayBuffer(
        storage=A.LazyTensorStorage(200), batch_size=16, sampler=SAMPLERS[kind](), **buffer_kwargs
    )
    done = torch.zeros(200, 1, dtype=torch.bool)
    done[19::20] = True
    rb.extend(TensorDict({"obs": torch.arange(200), ("next", "done"): done}, [200]))
    if kind in PRIORITIZED:  # uneven priorities, so that the draws depend on the masses
        rb.update_priority(torch.arange(200), torch.linspace(0.1, 5.0, 200))
    return rb.sample()["index"]


def _seeded(kind, torch_seed, numpy_seed, **buffer_kwargs):
    torch.manual_seed(torch_seed)
    np.random.seed(numpy_seed)
    return _batch(kind, **buffer_kwargs)


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_both_global_seeds_make_every_sampler_reproducible(kind):
    assert torch.equal(_seeded(kind, 0, 0), _seeded(kind, 0, 0))


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_which_global_generator_each_sampler_draws_from(kind):
    same_torch = [_seeded(kind, 0, numpy_seed) for numpy_seed in (0, 1, 2)]
    same_numpy = [_seeded(kind, torch_seed, 0) for torch_seed in (0, 1, 2)]
    follows_numpy = not all(torch.equal(same_torch[0], b) for b in same_torch[1:])
    follows_torch = not all(torch.equal(same_numpy[0], b) for b in same_numpy[1:])
    if kind in PRIORITIZED:
        # TorchRL's prioritized draw: np.random.uniform when the buffer has no generator, so
        # torch.manual_seed alone does not fix the batch
        assert follows_numpy and not follows_torch
    else:
        assert follows_torch and not follows_numpy


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_a_buffer_generator_seeds_every_sampler_and_leaves_the_globals_alone(kind):
    def run(global_seed):
        torch.manual_seed(global_seed)
        np.random.seed(global_seed)
        before = torch.get_rng_state(), np.random.get_state()[1].copy()
        index = _batch(kind, generator=torch.Generator().manual_seed(7))
        after = torch.get_rng_state(), np.random.get_state()[1]
        assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
        return index

    assert torch.equal(run(0), run(1))  # the global state plays no part
