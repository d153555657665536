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

Where the library uses it: ``DeviceStorage.init`` on CPU (its slabs / leaves), the sum tree's
arrays (``sum_tree.init``), ``MemmapStorage``'s maps (``MADV_HUGEPAGE`` only: for a file
mapping it asks the page cache for large folios where the file system has them). A donated
``jax.jit(rb.add, donate_argnums=0)`` writes in place, so the buffer keeps its advice.

Everything falls back silently: not Linux, THP ``never`` or absent, a buffer below
:data:`MIN_BYTES` (32 MiB: glibc's largest mmap threshold, so a larger buffer has mappings of
its own and advising it touches nothing else), a GPU array, an abstract (traced) value, a
failing ``madvise``. Turn it off with the environment variable ``FRB_HUGEPAGES=0`` or
:func:`set_enabled`; :func:`report` says what the kernel gave.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ENV = "FRB_HUGEPAGES"
# Buffers smaller than this are left alone: a huge page cannot help much below a few of them,
# and 32 MiB is glibc's DEFAULT_MMAP_THRESHOLD_MAX, so an allocation above it is a mapping of
# its own (advising it never reaches a neighbour in a shared heap).
MIN_BYTES = 32 << 20

_THP = "/sys/kernel/mm/transparent_hugepage/"
_LINUX = sys.platform.startswith("linux")
_PAGE = mmap.PAGESIZE
# <asm-generic/mman-common.h>: the same numbers on every Linux architecture
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

_override: bool | None = None  # set_enabled's choice; None: the environment variable decides


def enabled() -> bool:
    """Whether :func:`advise` acts: :func:`set_enabled`'s choice if one was made, else the
    environment variable ``FRB_HUGEPAGES`` (``0``, ``false``, ``off`` or ``no``: off; read at
    every call, so a change after import counts).

    >>> from functional_rb._internal import hugepages
    >>> previous = hugepages.set_enabled(False)
    >>> hugepages.enabled()
    False
    >>> _ = hugepages.set_enabled(previous)
    """
    if _override is not None:
        return _override
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def set_enabled(flag: bool | None) -> bool | None:
    """Turn huge pages on (True) or off (False) for this process, or hand the choice back to
    ``FRB_HUGEPAGES`` (None). Returns the previous setting, to restore it.

    Only buffers created afterwards are affected; an advised buffer stays advised.

    >>> from functional_rb._internal import hugepages
    >>> previous = hugepages.set_enabled(False)   # e.g. to time a buffer without them
    >>> hugepages.advise(np.zeros(hugepages.MIN_BYTES, np.uint8))
    0
    >>> hugepages.set_enabled(previous) is False
    True
    """
    global _override
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(
            f"hugepages.set_enabled: flag must be True, False or None, got "
            f"{flag!r} ({type(flag).__name__})."
        )
    previous, _override = _override, flag
    return previous


def _read_choice(name: str) -> str:
    """The bracketed choice of a THP sysfs file (``always [madvise] never`` -> ``madvise``),
    ``"unavailable"`` without one."""
    try:
        with open(_THP + name) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def thp_mode() -> str:
    """The kernel's transparent huge page mode: ``"always"``, ``"madvise"``, ``"never"``, or
    ``"unavailable"`` (not Linux, or a kernel without THP).

    >>> from functional_rb._internal import hugepages
    >>> hugepages.thp_mode() in ("always", "madvise", "never", "unavailable")
    True
    """
    return _read_choice("enabled") if _LINUX else "unavailable"


@functools.lru_cache(maxsize=1)
def _madvise_fn():
    """libc's ``madvise`` through ctypes, or None where it cannot be had."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _madvise(start: int, length: int, advice: int) -> bool:
    fn = _madvise_fn()
    return fn is not None and fn(start, length, advice) == 0


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


def _page_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)`` (``start >= end``: none)."""
    return -(-address // _PAGE) * _PAGE, (address + nbytes) // _PAGE * _PAGE


def _mappings(start: int, end: int) -> list[tuple[int, int, str, int]]:
    """``(vma start, vma end, permissions, inode)`` of every mapping overlapping
    ``[start, end)``, from ``/proc/self/maps``."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo < end and hi > start:
                    out.append((lo, hi, fields[1], int(fields[4])))
    except (OSError, ValueError, IndexError):
        return []
    return out


def _private_anonymous(start: int, end: int) -> bool:
    """Whether ``[start, end)`` is wholly private anonymous memory (no file behind it): the
    only kind where a released page reads back as zeros."""
    covered = 0
    for lo, hi, perms, inode in _mappings(start, end):
        if inode != 0 or perms[3:4] != "p":
            return False
        covered += min(hi, end) - max(lo, start)
    return covered == end - start


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
      min_bytes: the smallest array advised (None: :data:`MIN_BYTES`, 32 MiB).

    Off (returns 0) when :func:`enabled` is False or :func:`thp_mode` is ``never`` or
    ``unavailable``. The advice lasts as long as the buffer: donated ``jax.jit`` calls that
    write in place keep it; a call that returns a new buffer does not.

    >>> from functional_rb._internal import hugepages
    >>> hugepages.advise(np.zeros(1000))           # small: left alone
    0
    >>> hugepages.advise(jnp.zeros(1000), min_bytes=1) >= 0   # what the kernel allows
    True
    """
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    if not _LINUX or not enabled() or getattr(array, "nbytes", 0) < min_bytes:
        return 0
    spans = [s for s in _host_spans(array) if s[1] >= min_bytes]
    if not spans or thp_mode() not in ("always", "madvise"):
        return 0
    done = 0
    for address, nbytes in spans:
        start, end = _page_range(address, nbytes)
        if end <= start or not _madvise(start, end - start, _MADV_HUGEPAGE):
            continue
        done += end - start
        if (zeroed or collapse) and _private_anonymous(start, end):
            # zeroed: a released page reads back as zeros and comes back huge at its next
            # write (nothing is copied); collapse: the kernel copies the pages into huge ones
            _madvise(start, end - start, _MADV_DONTNEED if zeroed else _MADV_COLLAPSE)
    return done


def _nbytes(shape, dtype) -> int:
    dims = (shape,) if np.ndim(shape) == 0 else tuple(shape)
    return math.prod(int(d) for d in dims) * np.dtype(dtype).itemsize


def _default_is_cpu() -> bool:
    """Whether new arrays (``jnp.zeros``) land on a CPU device."""
    dev = jax.config.jax_default_device
    platform = dev.platform if isinstance(dev, jax.Device) else (dev or jax.default_backend())
    return platform == "cpu"


# x is all zeros (from zeros()): x + v is v everywhere, written into x's own (advised) buffer
# because x is donated and used; a fill that ignored x would get a new buffer instead.
_fill = jax.jit(lambda x, v: x + v, donate_argnums=0)


def zeros(shape, dtype) -> jax.Array:
    """``jnp.zeros(shape, dtype)``, on huge pages when it is large and on the CPU (see
    :func:`advise`, ``zeroed=True``). Traced (inside ``jit``) it is plain ``jnp.zeros``.

    >>> from functional_rb._internal import hugepages
    >>> x = hugepages.zeros((3, 2), jnp.float32)
    >>> x.shape, x.dtype, float(x.sum())
    ((3, 2), dtype('float32'), 0.0)
    """
    x = jnp.zeros(shape, dtype)
    if _nbytes(shape, dtype) >= MIN_BYTES:
        advise(x, zeroed=True)
    return x


def full(shape, fill_value, dtype) -> jax.Array:
    """``jnp.full(shape, fill_value, dtype)``, on huge pages when it is large and on the CPU:
    advised zeros filled in place (the pages are touched once, already huge).

    >>> from functional_rb._internal import hugepages
    >>> hugepages.full((2,), jnp.inf, jnp.float32)
    Array([inf, inf], dtype=float32)
    """
    if _nbytes(shape, dtype) < MIN_BYTES or not enabled() or not _default_is_cpu():
        return jnp.full(shape, fill_value, dtype)
    x = jnp.zeros(shape, dtype)
    if not advise(x, zeroed=True):
        return jnp.full(shape, fill_value, dtype)
    return _fill(x, jnp.asarray(fill_value, dtype))


def _smaps_entry(address: int) -> dict | None:
    """The ``/proc/self/smaps`` fields of the mapping holding ``address`` (None if none)."""
    entry = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    if entry is not None:
                        return entry
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    entry = {"range": (lo, hi)} if lo <= address < hi else None
                elif entry is not None:
                    entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    except (OSError, ValueError):
        return None
    return entry


def advised(array) -> bool | None:
    """Whether the kernel records huge-page advice (``hg`` in ``VmFlags``) for the first
    whole page of ``array``'s host memory; None when that cannot be read (not Linux, no host
    buffer, an array under one page).

    >>> from functional_rb._internal import hugepages
    >>> hugepages.advised(jnp.zeros(8)) in (True, False, None)
    True
    """
    spans = _host_spans(array)
    if not _LINUX or not spans:
        return None
    start, end = _page_range(*spans[0])
    entry = _smaps_entry(start) if end > start else None
    if entry is None or "VmFlags" not in entry:
        return None
    return "hg" in entry["VmFlags"].split()


def _rollup() -> dict:
    """``{field: kB}`` of ``/proc/self/smaps_rollup`` ({} where it cannot be read)."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except (OSError, ValueError):
        return {}
    return out


def report() -> dict:
    """What this process asked for and what the kernel gave, for benchmark records.

    ``enabled`` (:func:`enabled`), ``thp`` (:func:`thp_mode`), ``defrag`` (the kernel's
    THP defrag choice), ``min_bytes``, and this process's ``anon_huge_pages_kib`` /
    ``shmem_pmd_mapped_kib`` / ``file_pmd_mapped_kib`` (``AnonHugePages``,
    ``ShmemPmdMapped``, ``FilePmdMapped`` of ``/proc/self/smaps_rollup``; None where the
    kernel does not say).

    >>> from functional_rb._internal import hugepages
    >>> sorted(hugepages.report())   # doctest: +NORMALIZE_WHITESPACE
    ['anon_huge_pages_kib', 'defrag', 'enabled', 'file_pmd_mapped_kib', 'min_bytes',
     'shmem_pmd_mapped_kib', 'thp']
    """
    rollup = _rollup() if _LINUX else {}
    return {
        "enabled": enabled(),
        "thp": thp_mode(),
        "defrag": _read_choice("defrag") if _LINUX else "unavailable",
        "min_bytes": MIN_BYTES,
        "anon_huge_pages_kib": rollup.get("AnonHugePages"),
        "shmem_pmd_mapped_kib": rollup.get("ShmemPmdMapped"),
        "file_pmd_mapped_kib": rollup.get("FilePmdMapped"),
    }
