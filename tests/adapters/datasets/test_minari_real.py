"""MinariExperienceReplay on datasets written by Minari itself (``DataCollector`` on Gymnasium
environments, offline): over plain HTTP from the local server (the files as the Hub serves
them), from Minari's local cache, and through ``minari.download_dataset`` pointed at the local
server (``FRB_DATASETS_DOWNLOADER=hub``). Every value is compared with what
``minari.load_dataset`` reads from the same files.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("h5py")
gym = pytest.importorskip("gymnasium")
minari = pytest.importorskip("minari")
import _dataset_server as S  # noqa: E402

import functional_rb.adapters.datasets as D  # noqa: E402
from functional_rb.adapters.datasets import _download as dl  # noqa: E402

REPO = "/datasets/farama-minari/test/resolve/main/"


class DictEnv(gym.Env):
    """Dict observations, a Box action and per-step infos (one of them a bool)."""

    def __init__(self):
        box = gym.spaces.Box(-10, 10, (2,), np.float32)
        self.observation_space = gym.spaces.Dict({"pos": box, "goal": box})
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self):
        return {"pos": self.pos.copy(), "goal": self.goal.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.normal(size=2).astype(np.float32)
        self.goal = self.np_random.normal(size=2).astype(np.float32)
        self.t = 0
        return self._obs(), {
            "dist": np.float64(np.linalg.norm(self.pos - self.goal)),
            "success": False,
        }

    def step(self, action):
        self.pos = (self.pos + action).astype(np.float32)
        self.t += 1
        d = float(np.linalg.norm(self.pos - self.goal))
        return self._obs(), -d, d < 0.5, self.t >= 6, {"dist": np.float64(d), "success": d < 0.5}


def _collect(env, episodes, max_steps=None):
    for ep in range(episodes):
        env.reset(seed=ep)
        env.action_space.seed(ep)
        done, t = False, 0
        while not done and (max_steps is None or t < max_steps):
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            done, t = term or trunc, t + 1


@pytest.fixture(scope="module")
def minari_cache(tmp_path_factory):
    """Two datasets written by minari.DataCollector into a fresh MINARI_DATASETS_PATH."""
    path = tmp_path_factory.mktemp("minari")
    about = dict(
        algorithm_name="random",
        author="functional_rb tests",
        author_email="tests@functional-rb.invalid",
        description="test data",
        code_permalink="tests/adapters/datasets/test_minari_real.py",
    )
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # minari's "eval_env is None"
        mp.setenv("MINARI_DATASETS_PATH", str(path))
        if "FrbDict-v0" not in gym.registry:  # Minari stores the spec: a string entry point
            gym.register("FrbDict-v0", entry_point=f"{__name__}:DictEnv")
        env = minari.DataCollector(gym.make("CartPole-v1"), record_infos=True)
        _collect(env, 3, max_steps=12)  # the DataCollector truncates unfinished episodes
        env.create_dataset(dataset_id="test/cartpole/tiny-v0", **about)
        env = minari.DataCollector(gym.make("FrbDict-v0"), record_infos=True)
        _collect(env, 4)
        env.create_dataset(dataset_id="test/dict/tiny-v0", **about)
        episodes = {
            ds: list(minari.load_dataset(ds).iterate_episodes())
            for ds in ("test/cartpole/tiny-v0", "test/dict/tiny-v0")
        }
    return path, episodes


server = S.server_fixture(page_size=50)


def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def serve(server, cache: Path, dataset_id: str, lfs=True):
    """The dataset's files where Minari's Hugging Face remote keeps them (the HDF5 as an LFS
    file, as on the Hub)."""
    _, rest = dataset_id.split("/", 1)
    for f in ("main_data.hdf5", "metadata.json"):
        server.files[f"{REPO}{rest}/data/{f}"] = (cache / dataset_id / "data" / f).read_bytes()
    if lfs:
        server.lfs.add(f"{REPO}{rest}/data/main_data.hdf5")


def check_against_minari(rb, episodes):
    """rb's items, in order, are Minari's episodes cut into TED transitions."""
    td = rb[:]
    cat = lambda f: np.concatenate([np.asarray(f(e)) for e in episodes])  # noqa: E731
    assert len(rb) == sum(len(e.actions) for e in episodes)
    np.testing.assert_array_equal(_np(td["episode"]), cat(lambda e: np.full(len(e.actions), e.id)))
    obs = episodes[0].observations
    keys = [(k,) for k in obs] if isinstance(obs, dict) else [()]
    for k in keys:
        get = (lambda e, k=k: e.observations[k[0]]) if k else (lambda e: e.observations)
        np.testing.assert_array_equal(
            _np(td[("observation",) + k]), cat(lambda e, get=get: get(e)[:-1])
        )
        np.testing.assert_array_equal(
            _np(td[("next", "observation") + k]), cat(lambda e, get=get: get(e)[1:])
        )
        assert td[("observation",) + k].dtype == torch.from_numpy(get(episodes[0])).dtype
    np.testing.assert_array_equal(_np(td["action"]), cat(lambda e: e.actions))
    np.testing.assert_array_equal(_np(td["next", "reward"])[:, 0], cat(lambda e: e.rewards))
    np.testing.assert_array_equal(
        _np(td["next", "terminated"])[:, 0], cat(lambda e: e.terminations)
    )
    np.testing.assert_array_equal(_np(td["next", "truncated"])[:, 0], cat(lambda e: e.truncations))
    np.testing.assert_array_equal(
        _np(td["next", "done"])[:, 0], cat(lambda e: e.terminations | e.truncations)
    )
    for k in episodes[0].infos:
        np.testing.assert_array_equal(_np(td["info", k]), cat(lambda e, k=k: e.infos[k][:-1]))
        np.testing.assert_array_equal(
            _np(td["next", "info", k]), cat(lambda e, k=k: e.infos[k][1:])
        )


@pytest.mark.parametrize("dataset_id", ["test/cartpole/tiny-v0", "test/dict/tiny-v0"])
def test_real_minari_dataset_over_http(server, tmp_path, minari_cache, monkeypatch, dataset_id):
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "http")
    cache, episodes = minari_cache
    serve(server, cache, dataset_id)
    rb = D.MinariExperienceReplay(dataset_id, 4, root=tmp_path / "root", base_url=server.url)
    check_against_minari(rb, episodes[dataset_id])
    meta = json.loads((cache / dataset_id / "data" / "metadata.json").read_text())
    assert rb.metadata == meta and rb.metadata["dataset_id"] == dataset_id
    assert rb.sample().batch_size == (4,)
    # the HDF5 came through the Hub's LFS redirect; nothing is left but the converted data
    assert [e["status"] for e in server.events][:2] == [302, 200]
    assert not (tmp_path / "root" / ".downloads").exists()


def test_real_minari_dataset_from_the_local_cache(tmp_path, minari_cache, monkeypatch):
    cache, episodes = minari_cache
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(cache))
    rb = D.MinariExperienceReplay(
        "test/dict/tiny-v0", 2, root=tmp_path / "root", load_from_local_minari=True
    )
    check_against_minari(rb, episodes["test/dict/tiny-v0"])


def test_corrupted_real_file_is_rejected(server, tmp_path, minari_cache, monkeypatch):
    """A body corrupted in transit fails the sha256 the Hub publishes for LFS files."""
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "http")
    monkeypatch.setattr(dl, "DEFAULT_RETRY", dl.Retry(sleep=lambda s: None))
    cache, _ = minari_cache
    serve(server, cache, "test/cartpole/tiny-v0")
    real = (cache / "test/cartpole/tiny-v0/data/main_data.hdf5").read_bytes()
    corrupt = bytearray(real)
    corrupt[len(real) // 2] ^= 0xFF
    server.faults[f"/cdn/{S.sha256(real)}"] = [("body", bytes(corrupt))]
    root = tmp_path / "root"
    with pytest.raises(dl.DatasetChecksumError) as err:
        D.MinariExperienceReplay("test/cartpole/tiny-v0", 2, root=root, base_url=server.url)
    assert "main_data.hdf5" in str(err.value) and S.sha256(real) in str(err.value)
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_minari_client_path(server, tmp_path, minari_cache, monkeypatch):
    """FRB_DATASETS_DOWNLOADER=hub: minari.download_dataset (through huggingface_hub) fetches
    the dataset into Minari's cache, which the loader then converts."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache, episodes = minari_cache
    dataset_id = "test/cartpole/tiny-v0"
    serve(server, cache, dataset_id)
    # what Minari's Hugging Face remote lists: the namespaces and datasets of the repo
    server.files[REPO + "namespace_metadata.json"] = json.dumps(
        {"datasets": [dataset_id], "namespaces": ["test/cartpole"]}
    ).encode()
    server.files[REPO + "cartpole/namespace_metadata.json"] = b"{}"
    # huggingface_hub reads HF_ENDPOINT once, at import: point its constants at the server
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        server.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "hub")
    rb = D.MinariExperienceReplay(dataset_id, 2, root=tmp_path / "root")
    check_against_minari(rb, episodes[dataset_id])
    assert (tmp_path / "minari" / dataset_id / "data" / "main_data.hdf5").read_bytes() == (
        cache / dataset_id / "data" / "main_data.hdf5"
    ).read_bytes()
    assert any(e["path"] == "/api/datasets" for e in server.events)  # minari's listing
    with pytest.raises(ValueError, match="base_url cannot be used"):
        D.MinariExperienceReplay(dataset_id, 2, root=tmp_path / "root2", base_url=server.url)
