"""The kernel's side of huge pages: ``madvise`` on address ranges, what ``/proc`` records, and
the library-wide switch. The standard library only: no JAX, no NumPy.

:mod:`functional_rb._internal.hugepages` builds on it for NumPy and JAX arrays; the torch
adapters call :func:`advise_range` directly with a tensor's address, so that a torch program
using :mod:`functional_rb.adapters` never imports JAX for it. Why huge pages, what each advice
does and where the library asks for them: see :mod:`functional_rb._internal.hugepages`.

One switch for both: :func:`enabled` (``FRB_HUGEPAGES=0`` or :func:`set_enabled`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

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
# where torch (shm_open) and multiprocessing put shared memory
_SHM_MOUNT = "/dev/shm"

_override: bool | None = None  # set_enabled's choice; None: the environment variable decides


def enabled() -> bool:
    """Whether the library asks for huge pages: :func:`set_enabled`'s choice if one was made,
    else the environment variable ``FRB_HUGEPAGES`` (``0``, ``false``, ``off`` or ``no``: off;
    read at every call, so a change after import counts).

    >>> from functional_rb._internal import pages
    >>> previous = pages.set_enabled(False)
    >>> pages.enabled()
    False
    >>> _ = pages.set_enabled(previous)
    """
    if _override is not None:
        return _override
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def set_enabled(flag: bool | None) -> bool | None:
    """Turn huge pages on (True) or off (False) for this process, or hand the choice back to
    ``FRB_HUGEPAGES`` (None). Returns the previous setting, to restore it.

    Only buffers created afterwards are affected; an advised buffer stays advised.

    >>> from functional_rb._internal import pages
    >>> previous = pages.set_enabled(False)   # e.g. to time a buffer without them
    >>> pages.advise_range(0, pages.MIN_BYTES)
    0
    >>> pages.set_enabled(previous) is False
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
    """The kernel's transparent huge page mode for private memory: ``"always"``,
    ``"madvise"``, ``"never"``, or ``"unavailable"`` (not Linux, or a kernel without THP).

    >>> from functional_rb._internal import pages
    >>> pages.thp_mode() in ("always", "madvise", "never", "unavailable")
    True
    """
    return _read_choice("enabled") if _LINUX else "unavailable"


def _mount_huge(mount: str) -> str | None:
    """The ``huge=`` option of the tmpfs mounted at ``mount`` (``"never"`` when it has none,
    the kernel's default), None when no tmpfs is mounted there."""
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:  # the last mount at a point is the one in effect
        fields = line.split()
        if len(fields) >= 4 and fields[1] == mount and fields[2] == "tmpfs":
            options = dict(o.partition("=")[::2] for o in fields[3].split(","))
            found = options.get("huge", "never")
    return found


def shared_mode() -> str:
    """Whether shared memory (``/dev/shm``, where torch's ``share_memory_`` puts tensors) can
    take huge pages: ``shmem_enabled``'s ``force`` / ``deny`` override every mount, otherwise
    the mount's ``huge=`` option decides (``"always"``, ``"within_size"``, ``"advise"``,
    ``"never"``); ``"unavailable"`` without THP or without that mount.

    >>> from functional_rb._internal import pages
    >>> pages.shared_mode() in ("always", "within_size", "advise", "never", "unavailable")
    True
    """
    if not _LINUX:
        return "unavailable"
    override = _read_choice("shmem_enabled")
    if override == "unavailable":
        return "unavailable"
    if override in ("force", "deny"):
        return "always" if override == "force" else "never"
    return _mount_huge(_SHM_MOUNT) or "unavailable"


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


def active(*, shared: bool = False) -> bool:
    """Whether advice can do anything now: Linux, :func:`enabled`, and the kernel's mode for
    private memory (``shared``: for shared memory, :func:`shared_mode`) takes advice."""
    if not _LINUX or not enabled():
        return False
    if shared:
        return shared_mode() in ("always", "within_size", "advise")
    return thp_mode() in ("always", "madvise")


def advise_range(
    address: int,
    nbytes: int,
    *,
    zeroed: bool = False,
    collapse: bool = False,
    shared: bool = False,
    min_bytes: int | None = None,
) -> int:
    """Ask for huge pages for the whole pages of host memory in ``[address, address +
    nbytes)``; returns the bytes advised (0 when nothing was done, which is never an error).

    Args:
      address, nbytes: the buffer (e.g. a torch CPU tensor's ``untyped_storage()``'s
        ``data_ptr()`` and ``nbytes()``); the partial pages at either end are left alone.
      zeroed: the caller promises the buffer's contents need not be kept (all zeros, or not
        initialized yet): its touched pages are released so that they come back huge at the
        next write. Done only for private anonymous memory, where a released page reads as
        zero.
      collapse: move the pages already touched into huge pages now (``MADV_COLLAPSE``,
        Linux 6.1+; contents kept, a few hundred ms per GiB; private anonymous memory only).
      shared: the memory is shared memory (``/dev/shm``): advised only where
        :func:`shared_mode` takes advice.
      min_bytes: the smallest buffer advised (None: :data:`MIN_BYTES`, 32 MiB).

    >>> from functional_rb._internal import pages
    >>> pages.advise_range(0, 4096)   # small: left alone
    0
    """
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    if nbytes < min_bytes or not active(shared=shared):
        return 0
    start, end = _page_range(address, nbytes)
    if end <= start or not _madvise(start, end - start, _MADV_HUGEPAGE):
        return 0
    if (zeroed or collapse) and _private_anonymous(start, end):
        # zeroed: a released page reads back as zeros and comes back huge at its next write
        # (nothing is copied); collapse: the kernel copies the pages into huge ones
        _madvise(start, end - start, _MADV_DONTNEED if zeroed else _MADV_COLLAPSE)
    return end - start


def _smaps_entry(address: int) -> dict | None:
    """The ``/proc/self/smaps`` fields of the mapping holding ``address`` (None if none)."""
    entry: dict | None = None
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


def advised_range(address: int, nbytes: int) -> bool | None:
    """Whether the kernel records huge-page advice (``hg`` in ``VmFlags``) for the first whole
    page of ``[address, address + nbytes)``; None when that cannot be read (not Linux, a
    range without a whole page, an address no mapping holds).

    >>> from functional_rb._internal import pages
    >>> pages.advised_range(0, 8) is None   # no whole page
    True
    """
    if not _LINUX:
        return None
    start, end = _page_range(address, nbytes)
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

    ``enabled`` (:func:`enabled`), ``thp`` (:func:`thp_mode`), ``shared`` (:func:`shared_mode`),
    ``defrag`` (the kernel's THP defrag choice), ``min_bytes``, and this process's
    ``anon_huge_pages_kib`` / ``shmem_pmd_mapped_kib`` / ``file_pmd_mapped_kib``
    (``AnonHugePages``, ``ShmemPmdMapped``, ``FilePmdMapped`` of ``/proc/self/smaps_rollup``;
    None where the kernel does not say).

    >>> from functional_rb._internal import pages
    >>> sorted(pages.report())   # doctest: +NORMALIZE_WHITESPACE
    ['anon_huge_pages_kib', 'defrag', 'enabled', 'file_pmd_mapped_kib', 'min_bytes',
     'shared', 'shmem_pmd_mapped_kib', 'thp']
    """
    rollup = _rollup() if _LINUX else {}
    return {
        "enabled": enabled(),
        "thp": thp_mode(),
        "shared": shared_mode(),
        "defrag": _read_choice("defrag") if _LINUX else "unavailable",
        "min_bytes": MIN_BYTES,
        "anon_huge_pages_kib": rollup.get("AnonHugePages"),
        "shmem_pmd_mapped_kib": rollup.get("ShmemPmdMapped"),
        "file_pmd_mapped_kib": rollup.get("FilePmdMapped"),
    }
