"""Iterating a buffer in epochs: TorchRL's ``iter(rb)`` (batches until the sampler ran out, as
a :class:`~functional_rb.adapters.SamplerWithoutReplacement` does at the end of an epoch) and
``rb.next()`` (the same, one call at a time, for a caller that cannot hold an iterator).

These are methods of :class:`~functional_rb.adapters.ReplayBuffer`, bound by name in its class
body.
"""

from __future__ import annotations

from tensordict import is_tensor_collection

__all__ = ["iterate", "next_batch"]


def iterate(self):
    if self.batch_size is None:
        raise RuntimeError(
            "Cannot iterate over the replay buffer. Batch_size was not "
            "specified during construction of the replay buffer."
        )
    sampler = self.sampler
    sampler.ran_out = False
    # prefetched batches of the epoch are still served after the sampler ran out
    while not sampler.ran_out or len(self._prefetch_queue):
        yield self.sample()


def next_batch(self):
    """The next batch of an epoch of ``iter(self)`` (TorchRL's ``next``: for code that cannot
    hold an iterator, such as a remote caller); None at the end of the epoch, and the following
    call starts a new one. A TensorDict comes back as a device-less copy, as TorchRL's does
    (its device test compares a ``torch.device`` with a string, which never holds), so that it
    travels to other processes without a device reference."""
    if self._iterator is None:
        self._iterator = iter(self)
    try:
        out = next(self._iterator)
    except StopIteration:
        self._iterator = None
        return None
    if is_tensor_collection(out) and out.device is not None:
        out = out.copy().clear_device_()
    return out
