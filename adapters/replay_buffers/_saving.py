"""What a buffer saves and restores: ``state_dict`` / ``load_state_dict`` and ``dumps`` /
``loads`` in TorchRL's layout (``storage/``, ``sampler/``, ``writer/``, ``rng_state/``,
``transform.t``, ``buffer_metadata.json``). Each component writes its own part; the buffer adds
its batch size, random generator and transforms.

Dumps are crash-safe: the files are written into a staged sibling directory that replaces
``path`` in one atomic rename once every file is fsynced and listed, with its size and SHA-256,
in a manifest (``frb_manifest.json``, :func:`functional_rb.checkpoint.staged`); a process killed
at any moment leaves the previous dump or the new one, never a mix. The manifest also records
the buffer's configuration: ``loads`` checks every file (a damaged one raises
:class:`functional_rb.checkpoint.CheckpointError` naming it) and refuses a dump of another
configuration, naming the difference, before anything is read. TorchRL's dumps (no manifest)
load too: their files are checked by shape and size as they are read. TorchRL ignores the
manifest, so it loads our dumps.

Methods of :class:`~functional_rb.adapters.ReplayBuffer`, bound by name in its class body; they
use its public surface only:
``storage``, ``sampler``, ``writer``, ``transform``, ``lock``, ``batch_size``, ``generator`` /
``set_rng``, ``consume_after_n_samples``, ``wait_updates``, ``synchronize``, ``refresh`` and the
prefetch queue's ``prefetch`` / ``prefetch_settled`` / ``restore_prefetch``. Queued updates and
prefetch draws take the buffer's lock, so they are settled before it is taken, never under it.
The prefetched batches are saved with the rest (TorchRL's ``_prefetch_state``, ``prefetch.pkl``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from functional_rb.adapters.replay_buffers._prefetch import check_prefetch_state, prefetch_state
from functional_rb.checkpoint import atomic as checkpoint

__all__ = [
    "dump_config",
    "dumps",
    "generator_from",
    "load_state_dict",
    "loads",
    "state_dict",
]

_FORMAT = "functional_rb.adapters.dump"
_PREFETCH_FILE = "prefetch.pkl"


def _read_prefetch(file: Path, where: str):
    """A dump's prefetch queue (TorchRL's ``prefetch.pkl``; None in dumps made before it).
    Like TorchRL's, it is a pickle: load dumps you trust, as with ``torch.load``."""
    if not file.exists():
        return None
    try:
        with open(file, "rb") as f:
            return pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise checkpoint.CheckpointError(where, str(file), f"cannot be read ({e})") from None


def generator_from(rng) -> torch.Generator | None:
    """A generator from a saved ``(state, device)`` (or a bare state)."""
    if rng is None:
        return None
    state, device = rng if isinstance(rng, tuple) else (rng, "cpu")
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def register_save_hook(self, hook) -> None:
    """``hook(data, path=path) -> data`` runs on the storage's data before ``dumps``."""
    self.storage.register_save_hook(hook)


def register_load_hook(self, hook) -> None:
    """``hook(data, out=None) -> data`` runs on the data ``loads`` read back."""
    self.storage.register_load_hook(hook)


def state_dict(self) -> dict[str, Any]:
    """TorchRL's ``state_dict`` of the buffer: each component's, and the buffer's own."""
    # queued updates and draws in flight take the buffer's lock: settle them before it
    self.wait_updates()
    with self.prefetch_settled() as queue, self.lock:
        self.synchronize(updates=False)
        rng = self.generator
        return {
            "_consume_after_n_samples": self.consume_after_n_samples,
            "_storage": self.storage.state_dict(),
            "_sampler": self.sampler.state_dict(),
            "_writer": self.writer.state_dict(),
            "_transforms": self.transform.state_dict(),
            "_batch_size": self.batch_size,
            "_rng": None if rng is None else (rng.get_state().clone(), str(rng.device)),
            "_prefetch_state": prefetch_state(self.prefetch, queue),
        }


def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Restore what :func:`state_dict` gave (the prefetch queue checked first)."""
    where = f"{type(self).__name__}.load_state_dict"
    pstate = state_dict.get("_prefetch_state")
    check_prefetch_state(pstate, self.prefetch, where)
    self.wait_updates()
    with self.prefetch_settled(clear=True), self.lock:
        self.storage.load_state_dict(state_dict["_storage"])
        self.sampler.load_state_dict(state_dict["_sampler"])
        self.writer.load_state_dict(state_dict["_writer"])
        self.transform.load_state_dict(state_dict["_transforms"])
        self.batch_size = state_dict["_batch_size"]
        gen = generator_from(state_dict.get("_rng"))
        if gen is not None:
            self.set_rng(gen)
        self.refresh()
        self.restore_prefetch(pstate)


def dump_config(self) -> dict:
    """What a dump must agree with to be loaded here (recorded in its manifest)."""
    st, sm = self.storage, self.sampler
    cfg = {
        "storage": type(st).__name__,
        "ndim": st.ndim,
        "max_size": st.max_size,
        "sampler": type(sm).__name__,
        "writer": type(self.writer).__name__,
    }
    if sm.prioritized:
        cfg["max_capacity"] = getattr(sm, "max_size", None)
    return cfg


def dumps(self, path) -> None:
    """Save in TorchRL's layout, atomically (see the module docstring)."""
    path = Path(path).absolute()
    where = f"{type(self).__name__}.dumps"
    if path.is_dir() and any(path.iterdir()) and not (path / "buffer_metadata.json").exists():
        raise FileExistsError(
            f"{where}: {path} is a non-empty directory that holds no "
            "buffer dump; refusing to replace it. Choose another path."
        )
    self.wait_updates()
    with self.prefetch_settled() as queue, self.lock:
        self.synchronize(updates=False)
        with checkpoint.staged(path, replace_foreign=True, where=where) as stage:
            _write_dump(self, Path(stage.directory), queue)
            stage.meta = {"format": _FORMAT, "config": self.dump_config()}


def _write_dump(self, root: Path, queue: tuple) -> None:
    self.storage.dumps(root / "storage")
    self.sampler.dumps(root / "sampler")
    self.writer.dumps(root / "writer")
    rng = self.generator
    if rng is not None:
        TensorDict(rng_state=rng.get_state().clone(), device=rng.device).memmap(
            root / "rng_state", copy_existing=True
        )
    tsd = self.transform.state_dict()
    if tsd:
        torch.save(tsd, root / "transform.t")
    with open(root / "buffer_metadata.json", "w") as f:
        json.dump(
            {
                "batch_size": self.batch_size,
                "consume_after_n_samples": self.consume_after_n_samples,
            },
            f,
        )
    with open(root / _PREFETCH_FILE, "wb") as f:  # TorchRL's file, read by its loads
        pickle.dump(prefetch_state(self.prefetch, queue, clone=False), f)


def _check_dump(self, path: Path) -> Path:
    """The directory to read (a save killed between renames leaves the previous dump at
    a sibling name), after checking it against its manifest and this configuration."""
    where = f"{type(self).__name__}.loads"
    try:
        manifest = checkpoint.verify(path, where=where)
    except checkpoint.NoManifestError:
        return Path(path)  # TorchRL's dump: files are checked as they are read
    cfg = manifest.meta.get("config", {}) if manifest.meta.get("format") == _FORMAT else {}
    mine = self.dump_config()
    diff = {k: (cfg[k], mine[k]) for k in cfg if k in mine and cfg[k] != mine[k]}
    st = self.storage
    if (
        "max_size" in diff
        and st.ndim > 1
        and not st.initialized
        and diff["max_size"][0] >= diff["max_size"][1]
    ):
        del diff["max_size"]  # rounded up to whole rows by the first write, as TorchRL's
    if diff:
        raise ValueError(
            f"{where}: the dump in {path} was made by a buffer configured otherwise: "
            + ", ".join(f"{k}={a!r} there, {b!r} here" for k, (a, b) in diff.items())
            + ". Build the buffer like the one that was dumped."
        )
    return Path(manifest.directory)


def loads(self, path) -> None:
    """Load what :meth:`dumps` (ours or TorchRL's) saved at ``path``."""
    path = _check_dump(self, Path(path).absolute())
    meta_file = path / "buffer_metadata.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise checkpoint.CheckpointError(
            f"{type(self).__name__}.loads", str(meta_file), f"cannot be read ({e})"
        ) from None
    pstate = _read_prefetch(path / _PREFETCH_FILE, f"{type(self).__name__}.loads")
    check_prefetch_state(pstate, self.prefetch, f"{type(self).__name__}.loads")
    self.wait_updates()
    with self.prefetch_settled(clear=True), self.lock:
        self.storage.loads(path / "storage")
        self.sampler.loads(path / "sampler")
        self.writer.loads(path / "writer")
        if (path / "rng_state").exists():
            td = TensorDict.load_memmap(path / "rng_state")
            self.set_rng(generator_from((td["rng_state"].clone(), str(td.device or "cpu"))))
        if (path / "transform.t").exists():
            self.transform.load_state_dict(torch.load(path / "transform.t"))
        self.batch_size = meta["batch_size"]
        self.refresh()
        self.restore_prefetch(pstate, clone=False, where="loads")
