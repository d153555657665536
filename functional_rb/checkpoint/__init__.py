"""Save and load a buffer state: bit-exact, atomic, checked, without pickle.

Typical use::

    frb.checkpoint.save("ckpt/rb", state)                    # a directory, replaced atomically
    state = frb.checkpoint.load("ckpt/rb")                   # the tree from the manifest
    state = frb.checkpoint.load("ckpt/rb", like=rb.init(ex)) # ... checked against a template

Guarantees
----------
- **Atomic and durable.** A save is staged in a sibling directory, every file is fsynced, the
  manifest is written last, and one atomic rename puts the directory at ``path`` (the parent
  is then fsynced). After a crash at any moment, ``load(path)`` returns the previous checkpoint
  or the new one, never a mix. Leftovers of killed saves are deleted by the next save.
- **Checked.** ``load`` checks every file's size and SHA-256 against the manifest before using
  it; a damaged, truncated, missing or altered file raises :class:`CheckpointError` naming the
  file and what is wrong.
- **Exact.** Every leaf's bits come back (NaN payloads, -0.0, bfloat16, typed PRNG keys), and so
  does the tree, static fields included (``num_envs``, a packed storage's item description, a
  slice sampler's ``slice_len``): a loaded state samples exactly what the saved one would have
  (sampler state, priorities, epochs).
- **Matched.** With ``like=`` (a state of the buffer you resume, e.g. ``rb.init(example)``, or
  its ``jax.eval_shape``) a checkpoint of another configuration (capacity, ``ndim``, sampler,
  writer or storage kind, item shapes or dtypes) raises ``ValueError`` at load time naming the
  first difference; the result takes the template's tree, and its leaves the template's
  shardings.
- **No pickle.** Only registered classes are rebuilt, by their stable names: the manifest
  names each dataclass by the name it was registered under, never by module path, so files
  outlive code moves (files of earlier versions, which recorded ``module:qualname``, load
  through an alias table). A state class of your own component is registered with
  ``@frb.checkpoint.stable_name("MyState")`` (pick a name you never give another class).

On disk
-------
``path/`` holds two files: ``data.bin``, every array's raw bytes (C order, the leaf's dtype,
native byte order, each at a multiple of 64 bytes), the leaves in ``jax.tree_util`` flatten
order, then the items of host-backed states; and ``frb_manifest.json`` (plain JSON): the
envelope (``files``: each file's size and SHA-256; ``manifest_sha256``: its own checksum) and,
under ``meta``: ``format`` (``"functional_rb.checkpoint"``), ``version`` (4; 3 is read
too), the tree (containers, dataclass names, static fields), and per array its path
(``jax.tree_util.keystr``), dtype, shape, byte offset and length. One data file means one
fsync per save, whatever the number of leaves. A leaf split over devices (a sharded state)
is stored shard by shard instead, in ``shards-<process>.bin`` files, each written by the
process holding those shards: see :mod:`functional_rb.checkpoint.sharded_io` (restoring it with ``like=``
needs a mesh of the same shape).

Host-backed states
------------------
A state node whose items live outside its array leaves implements :class:`HostBacked`
(:class:`functional_rb.storages.memmap.MemmapStorageState` does): ``save`` copies its items into the
checkpoint, so the checkpoint is self-contained, and ``load`` writes them back into the
node's storage: the template's (``like=``) or, without one, the one recorded at save time.

The envelope, for other writers
-------------------------------
The atomic, checked directory is available to any writer (the torch adapters use it for
TorchRL-layout dumps)::

    with frb.checkpoint.staged(path) as stage:   # stage.directory: a new, empty sibling
        write_any_files(stage.directory)         # any layout, any subdirectories
        stage.meta["layout"] = "torchrl"         # optional JSON stored in the manifest
    # here: files fsynced and hashed, manifest written last, renamed onto path atomically

    manifest = frb.checkpoint.verify(path)       # sizes + SHA-256 of every listed file
    read_files_from(manifest.directory)          # path (see below)

- ``staged(path, replace_foreign=False)`` yields a :class:`Stage` (``directory``, ``meta``,
  ``write(name, bytes)`` which hashes while writing; other files are read back and hashed at
  the end). An exception in the block leaves ``path`` untouched. ``path`` may be missing, an
  empty directory or an earlier checkpoint; a directory without a manifest is replaced only
  with ``replace_foreign=True``, a file never.
- ``verify(path, data=True)`` returns a :class:`Manifest` (``directory``, ``meta``, ``files``,
  ``read(name)``, ``check_file(name)``). It raises :class:`NoManifestError` (a subclass of
  :class:`CheckpointError`) when the directory has no manifest: not damage, but a directory
  written by something else (a TorchRL dump), which the caller may read its own way; and
  :class:`CheckpointError` for damage, ``FileNotFoundError`` when nothing is at ``path``.
  ``data=False`` checks sizes only. ``manifest.directory`` is ``path`` except after a save
  killed on a filesystem without atomic exchange (see :mod:`functional_rb.checkpoint.atomic`).

Orbax
-----
A device-backed state (DeviceStorage, TEDStorage) is a plain PyTree of arrays with its static
fields in the tree definition, so ``orbax.checkpoint`` saves it, beside your parameters if you
like, and restores it given a template (from a clone of the repository: ``pip install -c constraints.txt ".[orbax]"``)::

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(d, {"params": params, "rb": without_empty_leaves(state)})
    tree = ckptr.restore(d, {"params": abstract_params,
                             "rb": without_empty_leaves(jax.eval_shape(lambda: state))})
    state = with_empty_leaves(tree["rb"], like=rb.init(example))

Orbax refuses arrays with no elements, which some states hold (a sum tree no larger than its
fan-out, ``TEDStorage``'s ``dist`` when ``frame_stack=1``): :func:`without_empty_leaves`
replaces them with ``None`` and :func:`with_empty_leaves` puts them back (a state with none
needs neither). Orbax stores array leaves only: a ``MemmapStorage`` state's items are in its
files, so use this module or ``MemmapStorage.checkpoint`` for it.
"""

from typing import TYPE_CHECKING

from functional_rb._internal.lazy import lazy_exports_from_type_checking

# imported on first use: the JAX-free atomic module serves storages without the rest
# (the public names, each written once: read by type checkers, the API docs and
# lazy_exports_from_type_checking, which imports each on first read)
if TYPE_CHECKING:
    from functional_rb._internal.names import stable_name
    from functional_rb.checkpoint.atomic import (
        MANIFEST,
        CheckpointError,
        Manifest,
        NoManifestError,
        Stage,
        identity,
        staged,
        verify,
    )
    from functional_rb.checkpoint.codec import HostBacked
    from functional_rb.checkpoint.state_io import (
        DATA,
        FORMAT,
        READS,
        VERSION,
        load,
        save,
        with_empty_leaves,
        without_empty_leaves,
    )

__all__, __getattr__, __dir__ = lazy_exports_from_type_checking(__name__)
