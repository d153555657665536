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
- A default ``write`` of a full buffer keeps the newest steps (flashbax 0.1.3 loses them, its
  issue #66): the first write takes every step the buffer holds, oldest first (flashbax: only
  ``[0, current_index)``, nothing when the index wrapped to 0); a write after the buffer
  filled up, or after exactly its length was added, takes every new step (flashbax: 0 steps
  when ``current_index`` is back where the last write left it). Where more steps were added
  than the buffer holds, the steps it still holds are written and a ``UserWarning`` says how
  many never reached the vault (see :meth:`Vault.write`).
"""

from __future__ import annotations

import os
import warnings
from datetime import datetime
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


class _Received(NamedTuple):
    """What ``Vault.write`` saw of the buffer at its last write (it counts new steps from it)."""

    is_full: bool
    running_index: int | None  # the state's step counter, when it has one (prioritised, end_key)
    newest: tuple | None  # host copies of the newest time step of every leaf, when full


def _newest_step(experience, current_index: int, time: int) -> tuple:
    """Host copies of time index ``current_index - 1`` (the newest step of a full ring)."""
    t = (current_index - 1) % time
    return tuple(np.asarray(x[:, t]) for x in jax.tree_util.tree_leaves(experience))


def _same(a: tuple, b: tuple) -> bool:
    """Bitwise equality of two :func:`_newest_step` results (NaNs and bfloat16 included)."""
    return all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _newest_runs(current_index: int, steps: int, time: int) -> list:
    """The runs of a ring of length ``time`` holding its newest ``steps`` (written before
    ``current_index``), oldest first, as ``source`` pairs for :func:`functional_rb.vault.write`."""
    if steps < time:
        return [((current_index - steps) % time, current_index)]
    return [(current_index, time), (0, current_index)] if current_index else [(0, time)]


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
        self._last_received: _Received | None = None  # None until something is written
        self.vault_index = _vault.length(self._store)

    def write(
        self,
        fbx_state: TrajectoryBufferState,
        source_interval: tuple[int, int] = (0, 0),
        dest_start: int | None = None,
    ) -> int:
        """Write any new data from the buffer state to the vault.

        Args:
          fbx_state: a trajectory buffer state (``experience``, ``current_index``,
            ``is_full``; a ``running_index`` when it has one).
          source_interval: the buffer time indices to read, ``(a, b)``; ``a > b`` reads
            ``[a, T)`` then ``[0, b)`` (a wrapped ring). Default ``(0, 0)``: the steps added
            since the previous write (every step the buffer holds for the first write),
            oldest first, ending at ``current_index``.
          dest_start: the vault time step to write at (default: the vault index, its end).

        Returns the number of time steps written; the vault index grows by it (wherever
        ``dest_start`` put them, as in flashbax).

        How the default counts new steps (``T``: the buffer's time length): the first write
        takes ``T`` steps when the buffer is full, else ``current_index``; later ones take
        ``running_index`` minus its value at the last write when the state has one
        (prioritised and ``end_key`` buffers); else, when the buffer filled up since,
        ``current_index + T`` minus the last write's index (the fewest it can be); else the
        distance around the ring from the last write's index, or ``T`` when that is 0 and the
        newest step differs from the last write's (a plain state cannot tell ``2 * T`` new
        steps from ``T``). When more than ``T`` steps are new, the oldest were overwritten in
        the buffer before they reached the vault: the ``T`` it holds are written and a
        ``UserWarning`` names how many the vault skips (a warning, not an error: raising would
        not bring them back and would lose the ``T`` still held). Write at least once every
        ``T - 1`` steps added and nothing is lost. flashbax 0.1.3 writes only ``[last index,
        current_index)``: nothing when the buffer filled exactly, only the part after index 0
        when the first write finds it full (its unreleased fix #67 warns when nothing is
        written yet and the index is 0, and still writes nothing).

        >>> import tempfile, jax.numpy as jnp
        >>> from functional_rb.flashbax.vault import Vault
        >>> from functional_rb.flashbax.buffers.trajectory_buffer import TrajectoryBufferState
        >>> ring = {"t": jnp.array([[4.0, 5.0, 2.0, 3.0]])}  # full; the head wrapped to 2
        >>> v = Vault("demo", ring, rel_dir=tempfile.mkdtemp())  # doctest: +ELLIPSIS
        New vault created at ...
        >>> state = TrajectoryBufferState(experience=ring, current_index=jnp.int32(2),
        ...                               is_full=jnp.bool_(True))
        >>> v.write(state, source_interval=(2, 2)), v.write(state), v.write(state)
        (0, 4, 0)
        >>> v.read().experience["t"].tolist()
        [[2.0, 3.0, 4.0, 5.0]]
        """
        fbx_current_index = int(fbx_state.current_index)
        dest_start = self.vault_index if dest_start is None else dest_start
        if source_interval == (0, 0):
            runs = self._new_runs(fbx_state, fbx_current_index, dest_start)
        else:
            runs = [tuple(source_interval)]
        written = 0
        for run in runs:
            written += _vault.write(
                self._store, fbx_state.experience, dest_start=dest_start + written, source=run
            )
        if written == 0:  # flashbax returns here, before it updates anything
            return 0
        self.vault_index += written
        _vault.set_length(self._store, self.vault_index)
        self._last_received_fbx_index = fbx_current_index
        full = bool(fbx_state.is_full)
        running = getattr(fbx_state, "running_index", None)
        time = jax.tree_util.tree_leaves(fbx_state.experience)[0].shape[1]
        self._last_received = _Received(
            is_full=full,
            running_index=None if running is None else int(running),
            newest=_newest_step(fbx_state.experience, fbx_current_index, time) if full else None,
        )
        return written

    def _new_runs(
        self, fbx_state: TrajectoryBufferState, current_index: int, dest_start: int
    ) -> list:
        """The ``source`` runs of a default write: the new steps, oldest first (see ``write``)."""
        time = jax.tree_util.tree_leaves(fbx_state.experience)[0].shape[1]
        full = bool(fbx_state.is_full)
        last, previous = self._last_received, self._last_received_fbx_index
        running = getattr(fbx_state, "running_index", None)
        if last is None:  # the first write: everything the buffer holds
            new = time if full else current_index
        elif running is not None and last.running_index is not None:
            new = int(running)  # exact: the steps added since, or since a new init
            new -= last.running_index if new >= last.running_index else 0
        elif full and not last.is_full:  # it held `previous` steps then, current + k*T now
            new = current_index + time - previous
        else:
            new = (current_index - previous) % time
            if (
                new == 0
                and full
                and last.newest is not None
                and not _same(_newest_step(fbx_state.experience, current_index, time), last.newest)
            ):
                new = time
        if new > time:
            warnings.warn(
                f"functional_rb.flashbax.vault.Vault.write: {new} time steps were added to "
                f"the buffer since the last write, but it holds {time}: the oldest "
                f"{new - time} were overwritten before they reached the vault, which skips "
                f"them at vault index {dest_start}. The {time} steps the buffer holds "
                f"are written. Write at least once every {time - 1} steps added.",
                UserWarning,
                stacklevel=3,
            )
            new = time
        return _newest_runs(current_index, new, time) if new else []

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
