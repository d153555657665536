"""Transparent huge pages for large host buffers (Linux; a no-op elsewhere).

A buffer of 10^7-10^8 items sampled at random costs a cache miss per row *and*, on 4 KiB
pages, a page-table walk: the TLB covers a few MiB of 4 KiB pages, far less than the buffer.
With 2 MiB pages the walk mostly goes. Linux gives anonymous memory huge pages on its own only
when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``; in the common ``madvise``
mode a mapping must ask with ``madvise(MADV_HUGEPAGE)``. NumPy asks for its own large arrays,
XLA's CPU allocator does not, and a memory-mapped file never does.

:func:`advise` asks for the page-aligned range inside a large host buffer (a NumPy array, an
``np.memmap``, a CPU ``jax.Array``): ``MADV_HUGEPAGE`` marks the range (``hg`` in its
``VmFlags`` in ``/proc/self/smaps``), so pages touched from then on are huge. Pages already
touched stay small unless the caller says more:

- ``zeroed=True`` (the buffer holds only zeros, e.g. fresh from ``jnp.zeros``): the range's
  pages are also released (``MADV_DONTNEED``). For private anonymous memory, which is what
  this is checked to be first, a released page reads back as zeros, so the contents do not
  change; the next write to each 2 MiB block faults in a huge page. This is what
  :func:`zeros` and :func:`full` do, and why they cost no more than ``jnp.zeros``.
- ``collapse=True``: the kernel copies the touched pages into huge pages now
  (``MADV_COLLAPSE``, Linux 6.1+), keeping the contents; a few hundred ms per GiB.

Where the library uses it (every array that grows with the capacity):

- the core, on CPU: ``DeviceStorage.init`` (its slabs / leaves), the sum tree's arrays
  (``sum_tree.init``), ``TEDStorage.init`` (its data and the ``ptr`` / ``owner`` / ``dist``
  records), the slice samplers' trajectory records (``trajectories.init``), the epoch
  permutation of ``SliceSamplerWithoutReplacement`` and the ``prio`` / ``valid`` arrays of
  ``PrioritizedSliceSampler`` (:func:`zeros` / :func:`full`);
- ``ReplayBuffer.init_from_data`` of a large state writes the data with the compiled, donated
  ``add``, in place into those advised buffers (written op by op, each write would return a
  new, unadvised one);
- ``checkpoint.load``: each large CPU leaf it restores is collapsed into huge pages
  (``collapse=True``; the copy into XLA's memory touched every page already);
- ``MemmapStorage``'s maps (``MADV_HUGEPAGE`` only: for a file mapping it asks the page cache
  for large folios where the file system has them);
- the torch adapters, through the JAX-free :mod:`functional_rb._internal.pages`:
  ``LazyTensorStorage`` / ``LazyMemmapStorage`` tensors and maps at their first write,
  ``TensorStorage``'s given data, tensors moved to shared memory where ``/dev/shm`` takes
  huge pages (``adapters/storages/_hugepages.py``). The adapters' NumPy sum trees need no
  call: NumPy advises its own arrays of 4 MiB or more (``adapters/samplers/_trees.py``).

A donated ``jax.jit(rb.add, donate_argnums=0)`` (and every eager ``add`` / ``sample``) writes
in place, so the buffer keeps its advice.

Everything falls back silently: not Linux, THP ``never`` or absent, a buffer below
``pages.MIN_BYTES`` (32 MiB: glibc's largest mmap threshold, so a larger buffer has mappings of
its own and advising it touches nothing else), a GPU array, an abstract (traced) value, a
failing ``madvise``. Turn it off with the environment variable ``FRB_HUGEPAGES=0`` or
:func:`set_enabled`; :func:`report` says what the kernel gave. The kernel-side half (advice on
an address range, ``/proc`` readers, the switch) is :mod:`functional_rb._internal.pages`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from functional_rb._internal import pages

# the switch, the kernel's modes and the report are the JAX-free module's, re-exported here
from functional_rb._internal.pages import ENV, enabled, report, set_enabled, shared_mode, thp_mode

__all__ = (
    "ENV",
    "advise",
    "advised",
    "enabled",
    "full",
    "report",
    "set_enabled",
    "shared_mode",
    "thp_mode",
    "zeros",
)


def _host_spans(array) -> list[tuple[int, int]]:
    """``[(address, nbytes)]`` of the host memory holding ``array``: one span for a NumPy
    array, one per CPU shard of a ``jax.Array``; ``[]`` for anything else (GPU, traced,
    deleted, non-contiguous)."""
    if isinstance(array, np.ndarray):
        if not (array.flags.c_contiguous or array.flags.f_contiguous) or array.nbytes == 0:
            return []
        return [(array.__array_interface__["data"][0], array.nbytes)]
    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        return []
    try:
        if array.is_deleted():
            return []
        parts = [array] if len(array.devices()) == 1 else [s.data for s in array.addressable_shards]
        spans = []
        for part in parts:
            if next(iter(part.devices())).platform != "cpu":
                continue
            part.block_until_ready()  # its pages are written before they are advised
            spans.append((part.unsafe_buffer_pointer(), part.nbytes))
        return spans
    except Exception:  # noqa: BLE001 - a buffer whose address JAX will not give: left alone
        return []


def advise(
    array, *, zeroed: bool = False, collapse: bool = False, min_bytes: int | None = None
) -> int:
    """Ask the kernel for huge pages for ``array``'s host memory; returns the bytes advised
    (0 when nothing was done, which is never an error).

    Args:
      array: a NumPy array (an ``np.memmap`` too) or a ``jax.Array``; only its CPU buffers
        are advised (each shard of a sharded array), only when the array holds at least
        ``min_bytes``. Anything else (a GPU or traced array, a non-contiguous view) is left
        alone.
      zeroed: the caller promises the buffer holds only zeros and nothing else reads it yet
        (it was just made by ``jnp.zeros``). Its pages are then released, so that they come
        back as huge pages at the next write; done only for private anonymous memory, where
        a released page reads as zero, so the contents stay the same either way.
      collapse: move the pages already touched into huge pages now (``MADV_COLLAPSE``; the
        contents are kept, a few hundred ms per GiB; private anonymous memory only).
      min_bytes: the smallest array advised (None: ``pages.MIN_BYTES``, 32 MiB).

    Off (returns 0) when :func:`enabled` is False or :func:`thp_mode` is ``never`` or
    ``unavailable``. The advice lasts as long as the buffer: donated ``jax.jit`` calls that
    write in place keep it; a call that returns a new buffer does not.

    >>> from functional_rb._internal import hugepages
    >>> hugepages.advise(np.zeros(1000))           # small: left alone
    0
    >>> hugepages.advise(jnp.zeros(1000), min_bytes=1) >= 0   # what the kernel allows
    True
    """
    min_bytes = pages.MIN_BYTES if min_bytes is None else min_bytes
    # checked before the spans: reading a jax.Array's address waits for it to be computed
    if getattr(array, "nbytes", 0) < min_bytes or not pages.active():
        return 0
    return sum(
        pages.advise_range(address, nbytes, zeroed=zeroed, collapse=collapse, min_bytes=min_bytes)
        for address, nbytes in _host_spans(array)
    )


def _nbytes(shape, dtype) -> int:
    dims = (shape,) if np.ndim(shape) == 0 else tuple(shape)
    return math.prod(int(d) for d in dims) * np.dtype(dtype).itemsize


def _default_is_cpu() -> bool:
    """Whether new arrays (``jnp.zeros``) land on a CPU device."""
    dev = jax.config.jax_default_device  # type: ignore[attr-defined]  # set at run time
    platform = dev.platform if isinstance(dev, jax.Device) else (dev or jax.default_backend())
    return platform == "cpu"


# x is all zeros (from zeros()): x + v is v everywhere, written into x's own (advised) buffer
# because x is donated and used; a fill that ignored x would get a new buffer instead.
_fill = jax.jit(lambda x, v: x + jnp.broadcast_to(v, x.shape), donate_argnums=0)


def zeros(shape, dtype) -> jax.Array:
    """``jnp.zeros(shape, dtype)``, on huge pages when it is large and on the CPU (see
    :func:`advise`, ``zeroed=True``). Traced (inside ``jit``) it is plain ``jnp.zeros``.

    >>> from functional_rb._internal import hugepages
    >>> x = hugepages.zeros((3, 2), jnp.float32)
    >>> x.shape, x.dtype, float(x.sum())
    ((3, 2), dtype('float32'), 0.0)
    """
    x = jnp.zeros(shape, dtype)
    if _nbytes(shape, dtype) >= pages.MIN_BYTES:
        advise(x, zeroed=True)
    return x


def full(shape, fill_value, dtype) -> jax.Array:
    """``jnp.full(shape, fill_value, dtype)``, on huge pages when it is large and on the CPU:
    advised zeros filled in place (the pages are touched once, already huge). ``fill_value``
    may also be an array that broadcasts to ``shape`` (a ``jnp.arange``, a row), copied in
    the same way.

    >>> from functional_rb._internal import hugepages
    >>> hugepages.full((2,), jnp.inf, jnp.float32)
    Array([inf, inf], dtype=float32)
    """
    if _nbytes(shape, dtype) < pages.MIN_BYTES or not enabled() or not _default_is_cpu():
        return jnp.full(shape, fill_value, dtype)
    x = jnp.zeros(shape, dtype)
    if not advise(x, zeroed=True):
        return jnp.full(shape, fill_value, dtype)
    return _fill(x, jnp.asarray(fill_value, dtype))


def advised(array) -> bool | None:
    """Whether the kernel records huge-page advice (``hg`` in ``VmFlags``) for the first
    whole page of ``array``'s host memory; None when that cannot be read (not Linux, no host
    buffer, an array under one page).

    >>> from functional_rb._internal import hugepages
    >>> hugepages.advised(jnp.zeros(8)) in (True, False, None)
    True
    """
    spans = _host_spans(array)
    return pages.advised_range(*spans[0]) if spans else None
