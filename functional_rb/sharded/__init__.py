"""Sharded replay buffers: one buffer over the devices of a mesh axis, with exact global sampling.

:mod:`~functional_rb.sharded.buffer` holds :class:`ShardedReplayBuffer` and :func:`sample`
(global draws inside one's own ``shard_map``); what each shard does with its peers is in
:mod:`functional_rb.collectives`, which ``ReplayBuffer`` calls given ``axis_name=``. Sharded
checkpoints are written by :mod:`functional_rb.checkpoint.sharded_io`.
"""

from functional_rb.sharded.buffer import ShardedReplayBuffer, ShardedState, sample

__all__ = ("ShardedReplayBuffer", "ShardedState", "sample")
