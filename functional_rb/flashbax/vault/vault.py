"""flashbax's ``Vault`` (``flashbax.vault.vault``) on the core's :mod:`functional_rb.vault`.

Same module names, constructor, defaults, methods and files as flashbax 0.1.3: a vault written
through this class opens in flashbax, and one written by flashbax opens here. What differs,
each because flashbax's behaviour loses data or hides an error:

- Wrong input raises an error naming the leaf, what was expected and what was received: a
  template (``experience_structure``) that does not match an existing vault, a state whose
  leaves differ from the vault's, a structure whose leaves would share one datastore (two
  leaves of a tuple; flashbax leaves a half-created vault behind), ``read`` intervals outside
  the vault. flashbax's own failures here are tensorstore errors or silent casts.
- A vault is created whole (in a sibling directory, renamed into place) and damaged files
  raise :class:`~functional_rb.vault.VaultError` naming the file or leaf.
- ``write`` and ``read`` need no event loop (flashbax's ``asyncio.run`` fails inside one, as in
  Jupyter); ``read`` reads up to the index on disk.
"""

from __future__ import annotations

import os
from datetime import datetime

import jax
import jax.numpy as jnp

from functional_rb import vault as _vault
from functional_rb.flashbax.buffers.trajectory_buffer import (
    Experience,
    TrajectoryBufferState,
)

__all__ = (
    "COMPRESSION_DEFAULT",
    "DRIVER",
    "METADATA_FILE",
    "TIME_AXIS_MAX_LENGTH",
    "VERSION",
    "Vault",
)

DRIVER = "file://"
METADATA_FILE = _vault.METADATA_FILE
TIME_AXIS_MAX_LENGTH = _vault.TIME_AXIS_MAX_LENGTH
COMPRESSION_DEFAULT = dict(_vault.DEFAULT_COMPRESSION)
VERSION = _vault.VERSION
_path_to_ds_name = _vault.leaf_name  # flashbax's private name, for code that imported it


class Vault:
    """flashbax's utility for storing buffer experience on disk, on :mod:`functional_rb.vault`.

    Args:
      vault_name: the upper-level name of this vault; the vault lives at
        ``<cwd>/<rel_dir>/<vault_name>/<vault_uid>``.
      experience_structure: the structure of the experience, usually
        ``buffer_state.experience`` (leaves ``[add_batch_size, max_length_time_axis, ...]``).
        Needed to create a vault; when the vault exists it is checked against the stored one
        and ``read`` returns its tree (without it: nested dicts).
      rel_dir: the base directory of all vaults (default ``"vaults"``).
      vault_uid: this vault's identifier (default: the current time, ``%Y%m%d%H%M%S``).
      compression: a zarr compressor used when creating the vault (default gzip level 5).
      metadata: extra JSON metadata to save (other values are saved as their ``str``).

    Raises ``ValueError`` when the vault does not exist and no ``experience_structure`` is
    given.

    >>> import os, tempfile, jax.numpy as jnp
    >>> from functional_rb.flashbax.vault import Vault
    >>> from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferState
    >>> exp = {"obs": jnp.arange(8.0).reshape(1, 8)}
    >>> v = Vault("demo", exp, rel_dir=tempfile.mkdtemp(), vault_uid="0")  # doctest: +ELLIPSIS
    New vault created at ...
    >>> v.write(TrajectoryBufferState(experience=exp, current_index=jnp.int32(3),
    ...                               is_full=jnp.bool_(False)))
    3
    >>> v.read().experience["obs"].tolist()
    [[0.0, 1.0, 2.0]]
    """

    def __init__(
        self,
        vault_name: str,
        experience_structure: Experience | None = None,
        rel_dir: str = "vaults",
        vault_uid: str | None = None,
        compression: dict | None = None,
        metadata: dict | None = None,
    ) -> None:
        vault_str = vault_uid if vault_uid else datetime.now().strftime("%Y%m%d%H%M%S")
        self._base_path = os.path.normpath(
            os.path.join(os.getcwd(), rel_dir, vault_name, vault_str)
        )
        if os.path.exists(self._base_path):
            self._store = _vault.open(self._base_path, like=experience_structure)
            print(f"Loading vault found at {self._base_path}")
            if compression is not None:
                print("Requested compression settings will be ignored as the vault already exists.")
        elif experience_structure is not None:
            self._store = _vault.create(
                self._base_path, experience_structure, compression=compression, metadata=metadata
            )
            print(f"New vault created at {self._base_path}")
            time = jax.tree_util.tree_leaves(self._store.structure)[0].shape[1]
            print(
                f"Since the provided buffer state has a temporal dimension of {time}, "
                f"you must write to the vault at least every {time - 1} "
                "timesteps to avoid data loss."
            )
        else:
            raise ValueError(
                "Vault does not exist and no experience_structure was provided. "
                f"(Nothing is at {self._base_path}: pass the buffer's "
                "experience, e.g. Vault(name, buffer_state.experience, ...), to "
                "create it, or check vault_name, rel_dir and vault_uid.)"
            )
        # where the next default write starts reading the buffer (flashbax keeps it in memory)
        self._last_received_fbx_index = 0
        self.vault_index = _vault.length(self._store)

    def write(
        self,
        fbx_state: TrajectoryBufferState,
        source_interval: tuple[int, int] = (0, 0),
        dest_start: int | None = None,
    ) -> int:
        """Write any new data from the buffer state to the vault.

        Args:
          fbx_state: a trajectory buffer state (``experience``, ``current_index``).
          source_interval: the buffer time indices to read, ``(a, b)``; ``a > b`` reads
            ``[a, T)`` then ``[0, b)`` (a wrapped ring). Default ``(0, 0)``: from the index
            the previous write ended at (0 for the first) up to ``current_index``.
          dest_start: the vault time step to write at (default: the vault index, its end).

        Returns the number of time steps written; the vault index grows by it (wherever
        ``dest_start`` put them, as in flashbax).

        >>> import tempfile, jax.numpy as jnp
        >>> from functional_rb.flashbax.vault import Vault
        >>> from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferState
        >>> exp = {"obs": jnp.arange(4.0).reshape(1, 4)}
        >>> v = Vault("demo", exp, rel_dir=tempfile.mkdtemp())  # doctest: +ELLIPSIS
        New vault created at ...
        >>> state = TrajectoryBufferState(experience=exp, current_index=jnp.int32(1),
        ...                               is_full=jnp.bool_(True))
        >>> v.write(state, source_interval=(1, 1)), v.write(state), v.vault_index
        (0, 1, 1)
        """
        fbx_current_index = int(fbx_state.current_index)
        if source_interval == (0, 0):
            source_interval = (self._last_received_fbx_index, fbx_current_index)
        dest_start = self.vault_index if dest_start is None else dest_start
        written = _vault.write(
            self._store, fbx_state.experience, dest_start=dest_start, source=tuple(source_interval)
        )
        if written == 0:  # flashbax returns here, before it updates anything
            return 0
        self.vault_index += written
        _vault.set_length(self._store, self.vault_index)
        self._last_received_fbx_index = fbx_current_index
        return written

    def read(
        self,
        timesteps: int | None = None,
        percentiles: tuple[int, int] | None = None,
    ) -> TrajectoryBufferState:
        """Read the vault: all of it (default), its last ``timesteps`` steps, or (when
        ``timesteps`` is None) the run between ``percentiles=(low, high)`` of its length.

        Returns a ``TrajectoryBufferState`` whose ``experience`` leaves are
        ``[add_batch_size, steps, ...]``, with ``current_index`` 0 and ``is_full`` True.

        >>> import tempfile, jax.numpy as jnp
        >>> from functional_rb.flashbax.vault import Vault
        >>> from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferState
        >>> exp = {"obs": jnp.arange(10.0).reshape(1, 10)}
        >>> v = Vault("demo", exp, rel_dir=tempfile.mkdtemp())  # doctest: +ELLIPSIS
        New vault created at ...
        >>> _ = v.write(TrajectoryBufferState(experience=exp, current_index=jnp.int32(0),
        ...                                   is_full=jnp.bool_(True)), source_interval=(0, 10))
        >>> v.read(timesteps=2).experience["obs"].tolist()
        [[8.0, 9.0]]
        >>> v.read(percentiles=(0, 30)).experience["obs"].tolist()
        [[0.0, 1.0, 2.0]]
        """
        experience = _vault.read(
            self._store,
            timesteps=timesteps,
            percentiles=None if timesteps is not None else percentiles,
        )
        return TrajectoryBufferState(
            experience=experience,
            current_index=jnp.array(0, dtype=int),
            is_full=jnp.array(True, dtype=bool),
        )
