"""TorchRL's ``RemoteTensorDictReplayBuffer``."""


from __future__ import annotations

from functional_rb.adapters.replay_buffers.tensordict import TensorDictReplayBuffer

__all__ = ["RemoteTensorDictReplayBuffer"]


class RemoteTensorDictReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``RemoteTensorDictReplayBuffer``: a :class:`TensorDictReplayBuffer` whose
    public methods may also be called through ``torch.distributed.rpc`` by other workers (it
    is an ordinary object: hand its ``RRef`` to them). Locally it behaves as its parent."""
