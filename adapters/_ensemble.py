"""TorchRL's ``ReplayBufferEnsemble`` and ``ReplayBufferTrainer`` over the adapter buffers."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection

from functional_rb.adapters._transforms import TransformChain
from functional_rb.adapters.replay_buffers import ReplayBuffer


def _stack(samples):
    if is_tensor_collection(samples[0]):
        return torch.stack(samples)
    return jax.tree_util.tree_map(lambda *x: torch.stack(x), *samples,
                                  is_leaf=lambda x: isinstance(x, torch.Tensor))


class ReplayBufferEnsemble:
    """Sample from several adapter buffers at once (TorchRL's ``ReplayBufferEnsemble``).

    Each ``sample(batch_size)`` picks ``num_buffer_sampled`` buffer ids (default: the number of
    buffers) with replacement, with probabilities ``p`` (uniform when ``None``), or every buffer
    once with ``sample_from_all=True``; then draws ``batch_size // num_buffer_sampled`` items
    from each picked buffer (its own sampler and transforms) and stacks the results to
    ``[num_buffer_sampled, batch_size // num_buffer_sampled]``. TensorDict samples carry
    ``("index", "buffer_ids")`` and ``("index", "index")`` (int64), as in TorchRL. Writing goes to
    the member buffers (``ensemble[i].extend(...)``).
    """

    def __init__(self, *rbs: ReplayBuffer, transform=None, batch_size: int | None = None,
                 collate_fn: Callable | None = None, p: Sequence[float] | None = None,
                 sample_from_all: bool = False, num_buffer_sampled: int | None = None,
                 generator: torch.Generator | None = None, **unsupported):
        if unsupported:
            raise NotImplementedError(f"ReplayBufferEnsemble: arguments {sorted(unsupported)} "
                                      "are not supported by the functional adapters (pass the "
                                      "member buffers).")
        if not rbs or not all(isinstance(rb, ReplayBuffer) for rb in rbs):
            raise TypeError("ReplayBufferEnsemble: pass functional_rb.adapters replay buffers, "
                            "e.g. ReplayBufferEnsemble(rb0, rb1, p=[0.5, 0.5]).")
        if sample_from_all and p is not None:
            raise RuntimeError("ReplayBufferEnsemble: sample_from_all=True is not compatible "
                               "with p.")
        self._rbs = tuple(rbs)
        if p is not None:
            p = torch.as_tensor(p, dtype=torch.float64)
            if p.shape != (len(rbs),) or (p < 0).any() or p.sum() <= 0:
                raise ValueError(f"ReplayBufferEnsemble: p must hold {len(rbs)} non-negative "
                                 f"weights with a positive sum, got {p.tolist()}.")
            p = p / p.sum()
        self.p = p
        self.sample_from_all = sample_from_all
        self.num_buffer_sampled = len(rbs) if (num_buffer_sampled is None or sample_from_all) \
            else int(num_buffer_sampled)
        self._batch_size = batch_size
        self._collate_fn = collate_fn or _stack
        self._rng = generator
        self._transform = TransformChain()
        if transform is not None:
            self._transform.append(transform)

    def __len__(self) -> int:
        return len(self._rbs)

    def __getitem__(self, index):
        if isinstance(index, int):
            return self._rbs[index]
        if isinstance(index, tuple):
            return self._rbs[index[0]][index[1:] if len(index) > 2 else index[1]]
        raise IndexError("ReplayBufferEnsemble: index with an int (a member buffer) or "
                         "(buffer, item index).")

    def extend(self, data, **kwargs):
        raise RuntimeError("ReplayBufferEnsemble writes are disabled: extend the member buffers "
                           "(ensemble[i].extend(data)).")

    def _buffer_ids(self) -> torch.Tensor:
        n = self.num_buffer_sampled
        if self.sample_from_all:
            return torch.arange(len(self._rbs))
        if self.p is None:
            return torch.randint(len(self._rbs), (n,), generator=self._rng)
        return torch.multinomial(self.p, n, True, generator=self._rng)

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        bs = self._batch_size if batch_size is None else batch_size
        if bs is None:
            raise RuntimeError("ReplayBufferEnsemble: batch_size not specified.")
        if bs % self.num_buffer_sampled:
            raise ValueError("The batch size must be divisible by num_buffer_sampled.")
        sub = bs // self.num_buffer_sampled
        ids = self._buffer_ids()
        samples, indices = [], []
        for i in ids.tolist():
            rb = self._rbs[i]
            data, info = rb.sample(sub, return_info=True)
            samples.append(data)
            index = info["index"]
            indices.append(torch.stack(index, -1) if isinstance(index, tuple) else index)
        data = self._collate_fn(samples)
        index = torch.stack(indices)
        buffer_ids = ids.reshape(-1, *([1] * (index.ndim - 1))).expand(index.shape).clone()
        info = TensorDict({"buffer_ids": buffer_ids, "index": index},
                          batch_size=index.shape[:2])
        if is_tensor_collection(data):
            data.set("index", info)
        if len(self._transform):
            data = self._transform(data)
        if return_info:
            return data, info
        return data

    def __iter__(self):
        while True:
            yield self.sample()

    def __repr__(self):
        return (f"ReplayBufferEnsemble(num_buffers={len(self._rbs)}, p={self.p}, "
                f"sample_from_all={self.sample_from_all}, batch_size={self._batch_size})")


class ReplayBufferTrainer:
    """TorchRL's ``ReplayBufferTrainer`` hook provider for an adapter buffer.

    ``register(trainer)`` registers :meth:`extend` on ``"batch_process"``, :meth:`sample` on
    ``"process_optim_batch"`` and :meth:`update_priority` on ``"post_loss"``, and itself as a
    module under ``name`` (any object with TorchRL's ``register_op`` / ``register_module``).
    """

    def __init__(self, replay_buffer: ReplayBuffer, batch_size: int | None = None,
                 memmap: bool = False, device=None, flatten_tensordicts: bool = False,
                 max_dims: Sequence[int] | None = None, iterate: bool = False):
        self.replay_buffer = replay_buffer
        if hasattr(replay_buffer, "update_tensordict_priority"):
            self._update_priority = replay_buffer.update_tensordict_priority
        else:
            if replay_buffer.sampler.prioritized:
                raise ValueError("Prioritized sampler not supported for replay buffer trainer "
                                 "if not within a TensorDictReplayBuffer")
            self._update_priority = None
        self.batch_size = batch_size
        self.memmap = memmap
        self.device = device
        self.flatten_tensordicts = flatten_tensordicts
        self.max_dims = max_dims
        self.iterate = iterate
        if iterate:
            self.replay_buffer_iter = iter(self.replay_buffer)

    def extend(self, batch: TensorDictBase) -> TensorDictBase:
        if self.flatten_tensordicts:
            if ("collector", "mask") in batch.keys(True):
                batch = batch[batch.get(("collector", "mask"))]
            else:
                if "next" in batch.keys() and "truncated" in batch["next"].keys():
                    batch["next", "truncated"][..., -1] = True
                batch = batch.reshape(-1)
        elif self.max_dims is not None:
            from tensordict import pad
            pads = []
            for d in range(batch.ndimension()):
                pads += [0, 0 if self.max_dims[d] == -1 else self.max_dims[d] - batch.batch_size[d]]
            batch = pad(batch, pads)
        batch = batch.cpu()
        self.replay_buffer.extend(batch)
        return batch

    def sample(self, batch: TensorDictBase) -> TensorDictBase:
        if self.iterate:
            try:
                sample = next(self.replay_buffer_iter)
            except StopIteration:
                self.replay_buffer_iter = iter(self.replay_buffer)
                raise
        else:
            sample = self.replay_buffer.sample(batch_size=self.batch_size)
        return sample.to(self.device) if self.device is not None else sample

    def update_priority(self, batch: TensorDictBase) -> None:
        if self._update_priority is not None:
            self._update_priority(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"replay_buffer": self.replay_buffer.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.replay_buffer.load_state_dict(state_dict["replay_buffer"])

    def register(self, trainer, name: str = "replay_buffer"):
        trainer.register_op("batch_process", self.extend)
        trainer.register_op("process_optim_batch", self.sample)
        trainer.register_op("post_loss", self.update_priority)
        trainer.register_module(name, self)
