"""What one shard does with its peers over a mesh axis: the per-shard path of ``ReplayBuffer``
methods given ``axis_name=`` (below the buffer; :mod:`functional_rb.sharded` builds on it)."""
