"""Vault: flashbax's on-disk format for experience, read and written by the core.

A vault is how flashbax users keep experience on disk and how offline datasets such as
og-marl's are shipped. This package reads and writes it without flashbax: a vault written here
opens in ``flashbax.vault.Vault``, and one written by flashbax 0.1.x opens here. It needs
tensorstore, an optional dependency: ``pip install "functional-rb[vault]"``.

Typical use::

    store = frb.vault.create("vaults/run/0", like)        # like: leaves [num_envs, T, ...]
    frb.vault.append(store, data)                         # T more steps in every row
    frb.vault.append_buffer(store, rb, state, steps=8)    # the newest 8 steps of an ndim=2 state
    store = frb.vault.open("vaults/run/0")                # later, or in another process
    data = frb.vault.read(store, timesteps=100)           # the last 100 steps of every row
    state = frb.vault.read_buffer(store, rb)              # a core buffer state holding them

What is on disk (:mod:`functional_rb.vault.format`): ``<path>/metadata.json``, plain JSON with
the format version, the experience structure (shapes and dtype names per leaf, as flashbax
records them) and the user's metadata; and one OCDBT database written by tensorstore holding a
zarr array ``[num_envs, TIME_AXIS_MAX_LENGTH, ...]`` per leaf (named by its dict keys and
attribute names: ``"obs.x."``; gzip level 5 unless ``create`` is given another compressor,
chunks as tensorstore lays them out) and ``"vault_index"``, the number of steps written.
Nothing is unpickled or evaluated.

Guarantees: :func:`create` builds the vault in a sibling directory and renames it into place,
so ``path`` holds a complete vault or nothing; :func:`append` writes the data before the
index, so a crash in between leaves the vault as it was. A missing vault raises
``FileNotFoundError``; damaged files (an unreadable ``metadata.json``, a truncated data file,
an array that disagrees with the metadata) raise :class:`VaultError` naming the file or leaf;
data or a template whose structure, dtype or shape differs from the vault's raises
``ValueError`` / ``TypeError`` naming the leaf, what was expected, what was received and the
fix.

The flashbax class ``Vault`` (same constructor, ``write``, ``read``, ``vault_index``) is
``functional_rb.flashbax.vault.Vault``, built on these functions.
"""

from functional_rb.vault.buffers import (
    append_buffer,
    buffer_items,
    read_buffer,
    structure,
)
from functional_rb.vault.format import (
    DEFAULT_COMPRESSION,
    METADATA_FILE,
    TIME_AXIS_MAX_LENGTH,
    VERSION,
    VaultError,
    leaf_name,
)
from functional_rb.vault.store import (
    VaultStore,
    append,
    create,
    length,
    open,
    read,
    set_length,
    write,
)

__all__ = (
    "DEFAULT_COMPRESSION",
    "METADATA_FILE",
    "TIME_AXIS_MAX_LENGTH",
    "VERSION",
    "VaultError",
    "VaultStore",
    "append",
    "append_buffer",
    "buffer_items",
    "create",
    "leaf_name",
    "length",
    "open",
    "read",
    "read_buffer",
    "set_length",
    "structure",
    "write",
)
