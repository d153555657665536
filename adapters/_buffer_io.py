"""What a buffer saves and restores: ``state_dict`` / ``load_state_dict`` and ``dumps`` /
``loads`` in TorchRL's layout (``storage/``, ``sampler/``, ``writer/``, ``rng_state/``,
``transform.t``, ``buffer_metadata.json``). Each component writes its own part; the buffer adds
its batch size, random generator and transforms.

A mixin of :class:`~functional_rb.adapters.ReplayBuffer`, through its public surface:
``storage``, ``sampler``, ``writer``, ``transform``, ``lock``, ``batch_size``, ``generator`` /
``set_rng``, ``consume_after_n_samples``, ``synchronize`` and ``refresh``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

__all__ = ["Persistence"]


def _generator(rng) -> torch.Generator | None:
    """A generator from a saved ``(state, device)`` (or a bare state)."""
    if rng is None:
        return None
    state, device = rng if isinstance(rng, tuple) else (rng, "cpu")
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


class Persistence:
    """``state_dict`` / ``load_state_dict`` / ``dumps`` / ``loads`` of a buffer."""

    def register_save_hook(self, hook) -> None:
        """``hook(data, path=path) -> data`` runs on the storage's data before ``dumps``."""
        self.storage.register_save_hook(hook)

    def register_load_hook(self, hook) -> None:
        """``hook(data, out=None) -> data`` runs on the data ``loads`` read back."""
        self.storage.register_load_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            self.synchronize()
            rng = self.generator
            return {"_consume_after_n_samples": self.consume_after_n_samples,
                    "_storage": self.storage.state_dict(),
                    "_sampler": self.sampler.state_dict(),
                    "_writer": self.writer.state_dict(),
                    "_transforms": self.transform.state_dict(),
                    "_batch_size": self.batch_size,
                    "_rng": None if rng is None else (rng.get_state().clone(), str(rng.device))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.lock:
            self.storage.load_state_dict(state_dict["_storage"])
            self.sampler.load_state_dict(state_dict["_sampler"])
            self.writer.load_state_dict(state_dict["_writer"])
            self.transform.load_state_dict(state_dict["_transforms"])
            self.batch_size = state_dict["_batch_size"]
            gen = _generator(state_dict.get("_rng"))
            if gen is not None:
                self.set_rng(gen)
            self.refresh()

    def dumps(self, path) -> None:
        """Save in TorchRL's layout: TorchRL loads it, and we load TorchRL's."""
        path = Path(path).absolute()
        with self.lock:
            self.synchronize()
            path.mkdir(exist_ok=True)
            self.storage.dumps(path / "storage")
            self.sampler.dumps(path / "sampler")
            self.writer.dumps(path / "writer")
            rng = self.generator
            if rng is not None:
                TensorDict(rng_state=rng.get_state().clone(), device=rng.device).memmap(
                    path / "rng_state", copy_existing=True)
            tsd = self.transform.state_dict()
            if tsd:
                torch.save(tsd, path / "transform.t")
            with open(path / "buffer_metadata.json", "w") as f:
                json.dump({"batch_size": self.batch_size,
                           "consume_after_n_samples": self.consume_after_n_samples}, f)

    def loads(self, path) -> None:
        """Load what :meth:`dumps` (ours or TorchRL's) saved at ``path``."""
        path = Path(path).absolute()
        with self.lock:
            self.storage.loads(path / "storage")
            self.sampler.loads(path / "sampler")
            self.writer.loads(path / "writer")
            if (path / "rng_state").exists():
                td = TensorDict.load_memmap(path / "rng_state")
                self.set_rng(_generator((td["rng_state"].clone(), str(td.device or "cpu"))))
            if (path / "transform.t").exists():
                self.transform.load_state_dict(torch.load(path / "transform.t"))
            meta = json.loads((path / "buffer_metadata.json").read_text())
            self.batch_size = meta["batch_size"]
            self.refresh()

    def save(self, *args, **kwargs):
        return self.dumps(*args, **kwargs)

    dump = save

    def load(self, *args, **kwargs):
        return self.loads(*args, **kwargs)
