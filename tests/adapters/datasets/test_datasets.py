"""functional_rb.adapters.datasets against a local HTTP server serving small files in the real
formats (written here): download + conversion + loading, exact content, the cache (no second
download), sampling (slices never cross an episode), read-only behaviour and failed downloads.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

pytest.importorskip("h5py")
import _dataset_server as S  # noqa: E402

import functional_rb.adapters.datasets as D  # noqa: E402
from functional_rb.adapters import SliceSampler  # noqa: E402
from functional_rb.adapters.datasets._d4rl_files import D4RL_FILES  # noqa: E402

server = S.server_fixture(page_size=2)


def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def files_under(root) -> list:
    return sorted(str(p) for p in Path(root).rglob("*") if p.is_file())


def check_slices(rb, sample, slice_len, episode=None):
    """Each slice: consecutive storage indices, equal to the stored items there, with no stored
    episode end before its last step (and one episode id when ``episode`` is given)."""
    idx = _np(sample["index"]).reshape(-1, slice_len)
    assert (np.diff(idx, axis=1) == 1).all()
    stored = rb[torch.as_tensor(idx.reshape(-1))]
    np.testing.assert_array_equal(_np(sample["action"]), _np(stored["action"]))
    done = _np(stored["next", "done"]).reshape(-1, slice_len)
    assert not done[:, :-1].any()
    trunc = _np(sample["next", "truncated"]).reshape(-1, slice_len)
    assert trunc[:, -1].all()
    if episode is not None:
        ep = _np(stored[episode]).reshape(-1, slice_len)
        assert (ep == ep[:, :1]).all()


# =================================================================================== D4RL
def test_d4rl(server, tmp_path):
    data, (obs, act, rew, term, tout, qpos) = S.d4rl_file(tmp_path)
    server.files["/" + D4RL_FILES["hopper-medium-v2"]] = data
    root = tmp_path / "root"
    rb = D.D4RLExperienceReplay("hopper-medium-v2", 4, root=root, base_url=server.url)
    assert server.requests() == 1 and len(rb) == 6
    td = rb[:]
    done = (term | tout)[:6, None]
    nxt = obs[1:].copy()
    nxt[done[:, 0]] = 0
    np.testing.assert_array_equal(_np(td["observation"]), obs[:6])
    np.testing.assert_array_equal(_np(td["next", "observation"]), nxt)
    np.testing.assert_array_equal(_np(td["action"]), act[:6])
    np.testing.assert_array_equal(_np(td["next", "reward"]), rew[:6, None])
    np.testing.assert_array_equal(_np(td["reward"]), np.r_[0, rew[:5]][:, None])
    np.testing.assert_array_equal(_np(td["next", "done"]), done)
    np.testing.assert_array_equal(_np(td["next", "terminated"]), term[:6, None])
    np.testing.assert_array_equal(_np(td["next", "truncated"]), tout[:6, None])
    np.testing.assert_array_equal(_np(td["done"]), np.r_[[[False]], done[:5]])
    np.testing.assert_array_equal(_np(td["info", "qpos"]), qpos[:6])
    np.testing.assert_array_equal(_np(td["next", "info", "qpos"]), qpos[1:])
    assert td["observation"].dtype == torch.float32 and td["info", "qpos"].dtype == torch.float64
    assert td["next", "done"].dtype == torch.bool and td["next", "done"].shape == (6, 1)
    assert rb.metadata == {"iteration": 3}
    # the cache is reused: no request, even to a dead server
    rb2 = D.D4RLExperienceReplay(
        "hopper-medium-v2",
        4,
        root=root,
        base_url="http://127.0.0.1:9",
        sampler=SliceSampler(slice_len=2, end_key=("next", "done")),
    )
    assert server.requests() == 1
    s = rb2.sample()
    assert s.batch_size == (4,)
    check_slices(rb2, s, 2)
    # a dataset is written whole: its last row never joins its first (it is no ring)
    for seed in range(40):
        torch.manual_seed(seed)
        check_slices(rb2, rb2.sample(), 2)
    # sampled items are the stored ones
    s = rb.sample()
    np.testing.assert_array_equal(_np(s["observation"]), obs[_np(s["index"])])
    # read-only: extend raises, the maps cannot be written
    with pytest.raises(RuntimeError, match="[Ii]mmutable|read-only"):
        rb.extend(rb[:2].exclude("index") if "index" in rb[:2].keys() else rb[:2])
    assert not rb.storage.leaf(("observation",)).flags.writeable
    # other conversion options are not silently served from this cache
    with pytest.raises(ValueError, match="download='force'"):
        D.D4RLExperienceReplay(
            "hopper-medium-v2", 4, root=root, base_url=server.url, use_truncated_as_done=False
        )
    # download="force" converts again
    D.D4RLExperienceReplay("hopper-medium-v2", 4, root=root, base_url=server.url, download="force")
    assert server.requests() == 2
    # split_trajs: items are whole trajectories [max_len] with a mask
    rb3 = D.D4RLExperienceReplay(
        "hopper-medium-v2", 2, root=root, base_url="http://127.0.0.1:9", split_trajs=True
    )
    assert len(rb3) == 3 and rb3[:].batch_size == (3, 3)
    np.testing.assert_array_equal(_np(rb3[:]["mask"]), [[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(_np(rb3[1]["observation"])[:2], obs[3:5])
    assert rb3.sample().batch_size == (2, 3)
    assert server.requests() == 2


def test_download_false_and_state_dict(server, tmp_path):
    with pytest.raises(RuntimeError, match="could not be found"):
        D.D4RLExperienceReplay(
            "hopper-medium-v2", 4, root=tmp_path, download=False, base_url=server.url
        )
    assert server.requests() == 0
    data, _ = S.d4rl_file(tmp_path)
    server.files["/" + D4RL_FILES["hopper-medium-v2"]] = data
    rb = D.D4RLExperienceReplay("hopper-medium-v2", 4, root=tmp_path, base_url=server.url)
    sd = rb.state_dict()
    assert "_storage" not in sd and sd["_dataset_path"] == str(rb.data_path)  # no data copy
    rb.load_state_dict(sd)
    assert len(rb) == 6
    # preprocess: TorchRL's map over the dataset into a new memory-mapped storage
    storage = rb.preprocess(
        lambda td: td.select("observation").apply(lambda x: x * 2),
        chunksize=4,
        dest=tmp_path / "pre",
    )
    np.testing.assert_array_equal(
        TensorDict.load_memmap(tmp_path / "pre")["observation"].numpy(),
        2 * _np(rb[:]["observation"]),
    )
    assert storage.max_size == 6
    rb.delete()
    assert not rb.data_path.exists()


# =================================================================================== Minari
def minari_file(tmp_path):
    eps = {}
    rng = np.random.default_rng(0)
    for num, t, end in ((10, 2, "truncations"), (2, 3, "terminations")):
        ep = {
            "obs": rng.normal(size=(t + 1, 2)),
            "goal": rng.normal(size=(t + 1, 1)),
            "act": rng.normal(size=(t, 1)).astype(np.float32),
            "rew": rng.normal(size=t),
            "success": rng.random(t + 1) > 0.5,
            "dist": rng.normal(size=t),
            "end": end,
            "t": t,
        }
        eps[num] = ep

    def fill(f):
        for num, ep in eps.items():
            g = f.create_group(f"episode_{num}")
            g.attrs["id"] = num
            g["observations/observation"] = ep["obs"]
            g["observations/achieved_goal"] = ep["goal"]
            g["actions"] = ep["act"]
            g["rewards"] = ep["rew"]
            flags = {
                "terminations": np.zeros(ep["t"], bool),
                "truncations": np.zeros(ep["t"], bool),
            }
            flags[ep["end"]][-1] = True
            g["terminations"], g["truncations"] = flags["terminations"], flags["truncations"]
            g["infos/success"] = ep["success"]
            g["infos/dist"] = ep["dist"]  # no value at reset: padded in front
            g["infos/msg"] = np.array([b"x"] * (ep["t"] + 1))  # text: dropped

    return S.h5_bytes(tmp_path, "minari.hdf5", fill), eps


def test_minari(server, tmp_path):
    data, eps = minari_file(tmp_path)
    base = "/datasets/farama-minari/test/resolve/main/pointmaze/tiny-v0/data"
    server.files[base + "/main_data.hdf5"] = data
    server.files[base + "/metadata.json"] = json.dumps({"total_episodes": 2}).encode()
    root = tmp_path / "root"
    rb = D.MinariExperienceReplay("test/pointmaze/tiny-v0", 2, root=root, base_url=server.url)
    assert server.requests() == 2 and len(rb) == 5
    assert rb.metadata == {"total_episodes": 2}
    td = rb[:]
    order = [eps[2], eps[10]]  # numeric episode order (the file lists episode_10 first)
    np.testing.assert_array_equal(_np(td["episode"]), [2, 2, 2, 10, 10])
    assert td["episode"].dtype == torch.int64
    cat = lambda f: np.concatenate([f(e) for e in order])  # noqa: E731
    np.testing.assert_array_equal(
        _np(td["observation", "observation"]), cat(lambda e: e["obs"][:-1])
    )
    np.testing.assert_array_equal(
        _np(td["next", "observation", "observation"]), cat(lambda e: e["obs"][1:])
    )
    np.testing.assert_array_equal(
        _np(td["next", "observation", "achieved_goal"]), cat(lambda e: e["goal"][1:])
    )
    np.testing.assert_array_equal(_np(td["action"]), cat(lambda e: e["act"]))
    np.testing.assert_array_equal(_np(td["next", "reward"]), cat(lambda e: e["rew"])[:, None])
    np.testing.assert_array_equal(_np(td["info", "success"]), cat(lambda e: e["success"][:-1]))
    np.testing.assert_array_equal(
        _np(td["info", "dist"]), cat(lambda e: np.r_[0.0, e["dist"][:-1]])
    )
    np.testing.assert_array_equal(_np(td["next", "info", "dist"]), cat(lambda e: e["dist"]))
    assert "msg" not in td["info"].keys()
    np.testing.assert_array_equal(_np(td["next", "terminated"])[:, 0], [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(_np(td["next", "truncated"])[:, 0], [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], [0, 0, 1, 0, 1])
    assert td["next", "reward"].dtype == torch.float64 and td["action"].dtype == torch.float32
    rb2 = D.MinariExperienceReplay(
        "test/pointmaze/tiny-v0",
        4,
        root=root,
        base_url="http://127.0.0.1:9",
        sampler=SliceSampler(slice_len=2, traj_key="episode"),
    )
    assert server.requests() == 2
    check_slices(rb2, rb2.sample(), 2, episode="episode")


# =================================================================================== Atari
ATARI = "/atari-replay-datasets/dqn/Pong/1/replay_logs/"


def atari_files(server):
    rng = np.random.default_rng(1)
    ckpts = []
    for k, terminal in enumerate(([0, 1, 0, 0], [0, 0, 0, 1])):
        n = len(terminal)
        c = {
            "observation": rng.integers(0, 255, (n, 84, 84), dtype=np.uint8),
            "action": rng.integers(0, 6, n).astype(np.int32),
            "reward": rng.normal(size=n).astype(np.float32),
            "terminal": np.array(terminal, np.uint8),
        }
        for what, arr in c.items():
            server.files[f"{ATARI}$store$_{what}_ckpt.{k}.gz"] = S.npy_gz_bytes(arr)
        server.files[f"{ATARI}add_count_ckpt.{k}.gz"] = S.npy_gz_bytes(np.array(n + k))
        server.files[f"{ATARI}invalid_range_ckpt.{k}.gz"] = S.npy_gz_bytes(np.arange(3) + k)
        ckpts.append(c)
    server.files[f"{ATARI}checkpoint"] = b"not a replay log"
    return ckpts


def test_atari_dqn(server, tmp_path):
    ckpts = atari_files(server)
    root = tmp_path / "root"
    rb = D.AtariDQNExperienceReplay("Pong/1", 4, root=root, base_url=server.url, slice_len=2)
    n_files = 12
    listed = server.requests() - n_files
    assert listed >= 7  # 13 objects listed 2 per page
    assert len(rb) == 8
    td = rb[:]
    obs = np.concatenate([c["observation"] for c in ckpts])
    np.testing.assert_array_equal(_np(td["observation"]), obs)
    done = np.array([0, 1, 0, 1, 0, 0, 0, 1], bool)
    nxt = np.concatenate([obs[1:], obs[:1]])
    nxt[done] = 0
    np.testing.assert_array_equal(_np(td["next", "observation"]), nxt)
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], done)
    np.testing.assert_array_equal(_np(td["next", "terminated"])[:, 0], [0, 1, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "truncated"])[:, 0], [0, 0, 0, 1, 0, 0, 0, 0])
    assert not _np(td["done"]).any() and td["done"].shape == (8, 1)
    np.testing.assert_array_equal(_np(td["action"]), np.concatenate([c["action"] for c in ckpts]))
    np.testing.assert_array_equal(
        _np(td["next", "reward"]), np.concatenate([c["reward"] for c in ckpts])
    )
    assert td["observation"].dtype == torch.uint8 and td["action"].dtype == torch.int32
    np.testing.assert_array_equal(_np(rb.episodes), [0, 0, 1, 1, 2, 2, 2, 2])
    assert rb.metadata["checkpoints"][1] == {
        "checkpoint": 1,
        "add_count": 5,
        "invalid_range": [1, 2, 3],
    }
    # frames are stored once: ("next", "observation") is computed from "observation"
    assert not any("next/observation" in f for f in files_under(rb.data_path))
    s = rb.sample()
    assert s.batch_size == (4,)
    check_slices(rb, s, 2)
    np.testing.assert_array_equal(_np(s["next", "observation"]), nxt[_np(s["index"]).reshape(-1)])
    before = server.requests()
    D.AtariDQNExperienceReplay("Pong/1", 4, root=root, base_url=server.url)
    assert server.requests() == before
    # dumps writes TorchRL's layout, the computed next frames included
    rb.dumps(tmp_path / "dump")
    dumped = TensorDict.load_memmap(tmp_path / "dump" / "storage")
    np.testing.assert_array_equal(dumped["next", "observation"].numpy(), nxt)


# =================================================================================== V-D4RL
VD4RL = "/datasets/conglu/vd4rl/resolve/main/vd4rl/main/walker_walk/random/64px/"


def vd4rl_files(server):
    rng = np.random.default_rng(2)
    eps = []
    for i, (t, terminal) in enumerate(((3, False), (4, True))):
        ep = {
            "image": rng.integers(0, 255, (t, 8, 8, 3), dtype=np.uint8),
            "action": rng.normal(size=(t, 2)).astype(np.float32),
            "reward": rng.normal(size=t).astype(np.float32),
            "discount": np.ones(t, np.float32),
            "is_first": np.eye(1, t, 0, dtype=bool)[0],
            "is_last": np.eye(1, t, t - 1, dtype=bool)[0],
            "is_terminal": np.eye(1, t, t - 1, dtype=bool)[0] & terminal,
            "physics": rng.normal(size=(t, 3)),
        }
        server.files[f"{VD4RL}2022-ep{i}-{t}.npz"] = S.npz_bytes(**ep)
        eps.append(ep)
    server.files[VD4RL.replace("random", "expert") + "other.npz"] = S.npz_bytes(
        image=np.zeros((2, 8, 8, 3), np.uint8)
    )
    return eps


def test_vd4rl(server, tmp_path):
    eps = vd4rl_files(server)
    root = tmp_path / "root"
    rb = D.VD4RLExperienceReplay(
        "main/walker_walk/random/64px", 2, root=root, base_url=server.url, totensor=False
    )
    assert len(rb) == 7
    assert not any("expert" in p for p in server.log)
    td = rb[:]
    cat = lambda k: np.concatenate([e[k] for e in eps])  # noqa: E731
    np.testing.assert_array_equal(_np(td["pixels"]), cat("image"))
    nxt = np.concatenate(
        [np.concatenate([e["image"][1:], np.zeros_like(e["image"][:1])]) for e in eps]
    )
    np.testing.assert_array_equal(_np(td["next", "pixels"]), nxt)
    np.testing.assert_array_equal(_np(td["action"]), cat("action"))
    np.testing.assert_array_equal(_np(td["next", "reward"]), cat("reward")[:, None])
    np.testing.assert_array_equal(_np(td["is_init"]), cat("is_first"))
    np.testing.assert_array_equal(_np(td["state", "physics"]), cat("physics"))
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], [0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "terminated"])[:, 0], [0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "truncated"])[:, 0], [0, 0, 1, 0, 0, 0, 0])
    assert td["pixels"].dtype == torch.uint8
    n = server.requests()
    rb2 = D.VD4RLExperienceReplay(
        "main/walker_walk/random/64px",
        4,
        root=root,
        base_url=server.url,
        image_size=4,
        sampler=SliceSampler(slice_len=2, end_key=("next", "done")),
    )
    assert server.requests() == n
    s = rb2.sample()
    assert s["pixels"].shape == (4, 3, 4, 4) and s["pixels"].dtype == torch.float32
    assert float(s["pixels"].min()) >= 0 and float(s["pixels"].max()) <= 1
    check_slices(rb, s, 2)


# =================================================================================== Roboset
ROBOSET = "/datasets/jdvakil/RoboSet_Sim/resolve/main/DAPG(expert)/"


def roboset_files(server, tmp_path):
    rng = np.random.default_rng(3)
    trials = {}
    for seed, fname in enumerate(("door_v2d-v1/a.h5", "door_v2d-v1/b.h5")):
        eps = {}
        for k, t in ((0, 3), (1, 2)):
            eps[k] = {
                "observations": rng.normal(size=(t, 4)),
                "actions": rng.normal(size=(t, 2)),
                "rewards": rng.normal(size=t),
                "done": np.eye(1, t, t - 1, dtype=bool)[0] & (seed == 0 and k == 0),
                "time": np.arange(t, dtype=np.float64),
                "qpos": rng.normal(size=(t, 2)),
            }

        def fill(f, eps=eps):
            for k, e in eps.items():
                g = f.create_group(f"Trial{k}")
                for key in ("observations", "actions", "rewards", "done"):
                    g[key] = e[key]
                g["env_infos/time"] = e["time"]
                g["env_infos/state/qpos"] = e["qpos"]

        server.files[ROBOSET + fname] = S.h5_bytes(tmp_path, "r.h5", fill)
        trials[seed] = eps
    server.files[ROBOSET + "pen_v2d-v1/c.h5"] = b"not this dataset"
    return trials


def test_roboset(server, tmp_path):
    trials = roboset_files(server, tmp_path)
    root = tmp_path / "root"
    rb = D.RobosetExperienceReplay("DAPG(expert)/door_v2d-v1", 2, root=root, base_url=server.url)
    assert not any("pen_v2d" in p for p in server.log)
    order = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (trial, seed): TorchRL sorts by trial number
    td = rb[:]
    assert len(rb) == 10
    np.testing.assert_array_equal(_np(td["episode"]), [0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(_np(td["seed"]), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
    cat = lambda f: np.concatenate([f(trials[s][k]) for k, s in order])  # noqa: E731
    np.testing.assert_array_equal(_np(td["observation"]), cat(lambda e: e["observations"]))
    np.testing.assert_array_equal(
        _np(td["next", "observation"]),
        cat(lambda e: np.concatenate([e["observations"][1:], np.zeros((1, 4))])),
    )
    np.testing.assert_array_equal(_np(td["info", "state", "qpos"]), cat(lambda e: e["qpos"]))
    np.testing.assert_array_equal(
        _np(td["next", "info", "time"]), cat(lambda e: np.r_[e["time"][1:], 0.0])
    )
    np.testing.assert_array_equal(_np(td["action"]), cat(lambda e: e["actions"]))
    np.testing.assert_array_equal(_np(td["next", "reward"]), cat(lambda e: e["rewards"])[:, None])
    ends = np.array([0, 0, 1, 0, 0, 1, 0, 1, 0, 1], bool)
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], ends)
    np.testing.assert_array_equal(
        _np(td["next", "terminated"])[:, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    )
    np.testing.assert_array_equal(
        _np(td["next", "truncated"])[:, 0], ends & ~_np(td["next", "terminated"])[:, 0]
    )
    n = server.requests()
    rb2 = D.RobosetExperienceReplay(
        "DAPG(expert)/door_v2d-v1",
        4,
        root=root,
        base_url="http://127.0.0.1:9",
        sampler=SliceSampler(slice_len=2, end_key=("next", "done")),
    )
    assert server.requests() == n
    check_slices(rb2, rb2.sample(), 2, episode="seed")


# =================================================================================== Open X
OPENX = "/datasets/jxu124/OpenX-Embodiment/resolve/main/cmu_stretch/"


def openx_episode(rng, t, instruction):
    steps = []
    for i in range(t):
        steps.append(
            {
                "observation": {
                    "image": S.png_bytes(rng.integers(0, 255, (4, 5, 3), np.uint8)),
                    "state": rng.normal(size=2).astype(np.float32),
                },
                "action": rng.normal(size=3),
                "reward": np.float32(i == t - 1),
                "discount": 1.0,
                "is_first": i == 0,
                "is_last": i == t - 1,
                "is_terminal": i == t - 1 and t == 3,
                "language_instruction": instruction,
                "language_embedding": rng.normal(size=4).astype(np.float32),
            }
        )
    return {"steps": steps, "episode_metadata": {"file_path": "x"}}


def openx_files(server):
    rng = np.random.default_rng(4)
    eps = [
        openx_episode(rng, 3, b"lift the lid"),
        openx_episode(rng, 2, b"open the door"),
        openx_episode(rng, 4, "push"),
    ]
    server.files[OPENX + "cmu_stretch_00000.tar"] = S.tar_bytes(
        {
            "a.data.pickle": S.pickle_bytes(eps[0]),
            "a.json": b"{}",
            "b.data.pickle": S.pickle_bytes(eps[1]),
        }
    )
    server.files[OPENX + "cmu_stretch_00001.tar"] = S.tar_bytes(
        {"c.data.pickle": S.pickle_bytes(eps[2])}
    )
    return eps


def test_openx(server, tmp_path):
    import io

    from PIL import Image

    eps = openx_files(server)
    root = tmp_path / "root"
    rb = D.OpenXExperienceReplay("cmu_stretch", 4, root=root, base_url=server.url, slice_len=2)
    assert len(rb) == 9
    td = rb[:]
    steps = [s for e in eps for s in e["steps"]]
    img = np.stack(
        [
            np.asarray(Image.open(io.BytesIO(s["observation"]["image"]))).transpose(2, 0, 1)
            for s in steps
        ]
    )
    np.testing.assert_array_equal(_np(td["observation", "image"]), img)
    assert td["observation", "image"].dtype == torch.uint8
    np.testing.assert_array_equal(
        _np(td["observation", "state"]), np.stack([s["observation"]["state"] for s in steps])
    )
    nxt = np.stack([s["observation"]["state"] for s in steps[1:]] + [np.zeros(2, np.float32)])
    nxt[[2, 4]] = 0  # the next observation of an episode's last step is not in the data
    np.testing.assert_array_equal(_np(td["next", "observation", "state"]), nxt)
    np.testing.assert_array_equal(_np(td["action"]), np.stack([s["action"] for s in steps]))
    np.testing.assert_array_equal(_np(td["next", "reward"])[:, 0], [0, 0, 1, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], [0, 0, 1, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "terminated"])[:, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(_np(td["is_init"]), [1, 0, 0, 1, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(_np(td["episode"]), [0, 0, 0, 1, 1, 2, 2, 2, 2])
    assert td["episode"].dtype == torch.int32 and td["discount"].dtype == torch.float64
    assert (
        td.get("language_instruction").tolist()
        == ["lift the lid"] * 3 + ["open the door"] * 2 + ["push"] * 4
    )
    s = rb.sample()
    check_slices(rb, s, 2, episode="episode")
    ep = _np(s["episode"])
    names = ["lift the lid", "open the door", "push"]
    assert s.get("language_instruction").tolist() == [names[e] for e in ep]
    n = server.requests()
    rb2 = D.OpenXExperienceReplay(
        "cmu_stretch", root=root, base_url="http://127.0.0.1:9", shuffle=False
    )
    assert server.requests() == n
    assert [t.shape[0] for t in rb2] == [3, 2, 4]  # whole episodes without a batch size


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_openx_refuses_code_in_pickles(server, tmp_path):
    server.files[OPENX + "cmu_stretch_00000.tar"] = S.tar_bytes(
        {"a.data.pickle": S.pickle_bytes({"steps": [_Evil()]})}
    )
    with pytest.raises(D.DatasetFormatError, match="refusing to unpickle"):
        D.OpenXExperienceReplay("cmu_stretch", root=tmp_path / "root", base_url=server.url)
    assert files_under(tmp_path / "root") == []


# =================================================================================== Gen-DGRL
def gen_dgrl_files(server):
    rng = np.random.default_rng(5)
    trajs = []
    for t, ends in ((3, True), (2, False)):
        trajs.append(
            {
                "observations": rng.integers(0, 255, (t + 1, 2, 2, 3), dtype=np.uint8),
                "actions": rng.integers(0, 15, t),
                "rewards": rng.normal(size=t),
                "dones": np.eye(1, t, t - 1, dtype=bool)[0] & ends,
            }
        )
    members = {
        f"bigfish/{i}.npy": S.npy_bytes(np.array(tr, dtype=object), allow_pickle=True)
        for i, tr in enumerate(trajs)
    }
    server.files["/1M/level_200/expert/bigfish.tar.xz"] = S.tar_bytes(members, mode="w:xz")
    return trajs


def test_gen_dgrl(server, tmp_path):
    trajs = gen_dgrl_files(server)
    root = tmp_path / "root"
    rb = D.GenDGRLExperienceReplay("bigfish-1M_E", 2, root=root, base_url=server.url)
    assert len(rb) == 5 and server.requests() == 1
    td = rb[:]
    cat = lambda f: np.concatenate([f(t) for t in trajs])  # noqa: E731
    np.testing.assert_array_equal(_np(td["observation"]), cat(lambda t: t["observations"][:-1]))
    np.testing.assert_array_equal(
        _np(td["next", "observation"]), cat(lambda t: t["observations"][1:])
    )
    np.testing.assert_array_equal(_np(td["action"]), cat(lambda t: t["actions"]))
    np.testing.assert_array_equal(_np(td["next", "reward"]), cat(lambda t: t["rewards"]))
    np.testing.assert_array_equal(_np(td["next", "terminated"])[:, 0], [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(_np(td["next", "truncated"])[:, 0], [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(_np(td["next", "done"])[:, 0], [0, 0, 1, 0, 1])
    assert td["observation"].dtype == torch.uint8 and td["action"].dtype == torch.int64
    rb2 = D.GenDGRLExperienceReplay(
        "bigfish-1M_E",
        4,
        root=root,
        base_url="http://127.0.0.1:9",
        sampler=SliceSampler(slice_len=2),
    )
    assert server.requests() == 1
    check_slices(rb2, rb2.sample(), 2)


def test_gen_dgrl_refuses_code_in_npy(server, tmp_path):
    server.files["/1M/level_200/expert/bigfish.tar.xz"] = S.tar_bytes(
        {"0.npy": S.npy_bytes(np.array(_Evil(), dtype=object), allow_pickle=True)}, mode="w:xz"
    )
    with pytest.raises(D.DatasetFormatError, match="refusing to unpickle"):
        D.GenDGRLExperienceReplay("bigfish-1M_E", root=tmp_path / "root", base_url=server.url)
    assert files_under(tmp_path / "root") == []


# =================================================================================== OpenML
ADULT_ARFF = """% a tiny 'adult'
@relation adult
@attribute age numeric
@attribute workclass {Private, 'Self emp', State-gov}
@attribute fnlwgt numeric
@attribute occupation {Sales, Tech, Admin}
@attribute hours integer
@attribute class {'>50K', '<=50K'}
@data
30, Private, 1, Tech, 40, '>50K'
45, 'Self emp', 2, Sales, 50, '<=50K'
22, ?, 3, Admin, 20, '<=50K'
51, State-gov, 4, Admin, 45, '>50K'
38, Private, 5, Sales, 38, '<=50K'
"""
SHUTTLE_ARFF = """@relation shuttle
@attribute A1 numeric
@attribute A2 real
@attribute class {'1','4','5'}
@data
{0 3.5, 2 '4'}
{1 2.0, 2 '1'}
1.0, 7.0, '5'
{0 -1.5, 1 1.0, 2 '4'}
"""


def openml_files(server, name, did, arff, target, features):
    raw = arff.encode()
    server.files[f"/api/v1/json/data/list/data_name/{name}/limit/2/data_version/1"] = json.dumps(
        {"data": {"dataset": [{"did": did, "name": name, "version": 1}]}}
    ).encode()
    server.files[f"/api/v1/json/data/{did}"] = json.dumps(
        {
            "data_set_description": {
                "id": str(did),
                "file_id": str(did * 10),
                "default_target_attribute": target,
                "format": "ARFF",
                "md5_checksum": S.md5(raw),
            }
        }
    ).encode()
    server.files[f"/api/v1/json/data/features/{did}"] = json.dumps(
        {"data_features": {"feature": features}}
    ).encode()
    server.files[f"/data/v1/download/{did * 10}"] = gzip.compress(raw)


def _feat(name, ignore=False):
    return {
        "name": name,
        "is_ignore": "true" if ignore else "false",
        "is_row_identifier": "false",
        "is_target": "false",
    }


def _standardize(x):
    x = np.asarray(x, np.float64)
    return (x - x.mean(0)) / x.std(0)


def test_openml(server, tmp_path):
    openml_files(
        server,
        "adult",
        1590,
        ADULT_ARFF,
        "class",
        [
            _feat("age"),
            _feat("workclass"),
            _feat("fnlwgt", ignore=True),
            _feat("occupation"),
            _feat("hours"),
            _feat("class"),
        ],
    )
    root = tmp_path / "root"
    rb = D.OpenMLExperienceReplay("adult_onehot", 2, root=root, base_url=server.url)
    assert server.requests() == 4 and len(rb) == 4  # the row with a missing value is dropped
    td = rb[:]
    # kept rows: 0, 1, 3, 4; y = occupation label-encoded in sorted order Admin, Sales, Tech
    np.testing.assert_array_equal(_np(td["y"]), [2, 1, 0, 1])
    num = _standardize([[30, 40], [45, 50], [51, 45], [38, 38]])
    # workclass codes in sorted order: Private 0, Self emp 1, State-gov 2 -> one-hot
    onehot = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], np.float64)
    np.testing.assert_allclose(_np(td["X"]), np.concatenate([num, onehot], 1), rtol=1e-12)
    assert td["X"].dtype == torch.float64 and td["y"].dtype == torch.int64
    assert rb.max_outcome_val == 2
    rb_num = D.OpenMLExperienceReplay("adult_num", 4, root=root, base_url=server.url)
    assert server.requests() == 8  # another name, another conversion
    np.testing.assert_allclose(
        _np(rb_num[:]["X"]),
        _standardize([[30, 0, 40], [45, 1, 50], [51, 2, 45], [38, 0, 38]]),
        rtol=1e-12,
    )
    # default sampler: without replacement, one epoch covers every row once
    got = np.concatenate([_np(rb_num.sample()["y"]) for _ in range(1)])
    assert sorted(got.tolist()) == [0, 1, 1, 2]
    rb_again = D.OpenMLExperienceReplay("adult_onehot", 2, root=root, base_url=server.url)
    assert server.requests() == 8 and len(rb_again) == 4


def test_openml_sparse_arff(server, tmp_path):
    openml_files(
        server, "shuttle", 40685, SHUTTLE_ARFF, "class", [_feat("A1"), _feat("A2"), _feat("class")]
    )
    rb = D.OpenMLExperienceReplay("shuttle", 2, root=tmp_path, base_url=server.url)
    td = rb[:]
    np.testing.assert_allclose(
        _np(td["X"]), _standardize([[3.5, 0], [0, 2.0], [1.0, 7.0], [-1.5, 1.0]]), rtol=1e-12
    )
    np.testing.assert_array_equal(_np(td["y"]), [1, 0, 2, 1])


def test_openml_md5_mismatch(server, tmp_path):
    openml_files(
        server, "shuttle", 40685, SHUTTLE_ARFF, "class", [_feat("A1"), _feat("A2"), _feat("class")]
    )
    server.files["/data/v1/download/406850"] = SHUTTLE_ARFF.replace("3.5", "3.6").encode()
    with pytest.raises(D.DatasetFormatError, match="MD5"):
        D.OpenMLExperienceReplay("shuttle", 2, root=tmp_path, base_url=server.url)
    assert files_under(tmp_path) == []


# =================================================================================== failures
def _fail_cases():
    def d4rl(srv, root):
        return D.D4RLExperienceReplay("hopper-medium-v2", 2, root=root, base_url=srv.url)

    def minari(srv, root):
        # the data file exists, its metadata.json does not
        srv.files["/datasets/farama-minari/test/resolve/main/x-v0/data/main_data.hdf5"] = b"1"
        return D.MinariExperienceReplay("test/x-v0", 2, root=root, base_url=srv.url)

    def atari(srv, root):
        atari_files(srv)
        del srv.files[f"{ATARI}$store$_reward_ckpt.1.gz"]
        srv.listed_only.add(f"{ATARI}$store$_reward_ckpt.1.gz")
        return D.AtariDQNExperienceReplay("Pong/1", 2, root=root, base_url=srv.url)

    def vd4rl(srv, root):
        vd4rl_files(srv)
        path = f"{VD4RL}2022-ep1-4.npz"
        del srv.files[path]
        srv.listed_only.add(path)
        return D.VD4RLExperienceReplay(
            "main/walker_walk/random/64px", 2, root=root, base_url=srv.url
        )

    def roboset(srv, root):
        return D.RobosetExperienceReplay("DAPG(expert)/door_v2d-v1", 2, root=root, base_url=srv.url)

    def openx(srv, root):
        openx_files(srv)
        path = OPENX + "cmu_stretch_00001.tar"
        del srv.files[path]
        srv.listed_only.add(path)
        return D.OpenXExperienceReplay("cmu_stretch", 2, root=root, base_url=srv.url)

    def gen_dgrl(srv, root):
        return D.GenDGRLExperienceReplay("bigfish-1M_E", 2, root=root, base_url=srv.url)

    def openml(srv, root):
        openml_files(srv, "shuttle", 40685, SHUTTLE_ARFF, "class", [])
        del srv.files["/data/v1/download/406850"]
        return D.OpenMLExperienceReplay("shuttle", 2, root=root, base_url=srv.url)

    return {
        "d4rl": (d4rl, "/" + D4RL_FILES["hopper-medium-v2"]),
        "minari": (minari, "/x-v0/data/metadata.json"),
        "atari": (atari, "%24store%24_reward_ckpt.1.gz"),
        "vd4rl": (vd4rl, "2022-ep1-4.npz"),
        "roboset": (roboset, "/api/datasets/jdvakil/RoboSet_Sim/tree/main/DAPG%28expert%29"),
        "openx": (openx, "cmu_stretch_00001.tar"),
        "gen_dgrl": (gen_dgrl, "/1M/level_200/expert/bigfish.tar.xz"),
        "openml": (openml, "/data/v1/download/406850"),
    }


@pytest.mark.parametrize("case", list(_fail_cases()))
def test_failed_download_names_url_and_leaves_no_cache(server, tmp_path, case):
    build, url_part = _fail_cases()[case]
    root = tmp_path / "root"
    with pytest.raises(D.DatasetDownloadError) as err:
        build(server, root)
    msg = str(err.value)
    assert "404" in msg and server.url in msg and url_part in msg
    assert files_under(root) == []  # no half-written download nor conversion


def test_unknown_ids_raise(tmp_path):
    with pytest.raises(KeyError, match="unknown D4RL dataset"):
        D.D4RLExperienceReplay("nope-v0", 2, root=tmp_path)
    with pytest.raises(ValueError, match="available"):
        D.AtariDQNExperienceReplay("Pong/9", 2, root=tmp_path)
    with pytest.raises(ValueError, match="game"):
        D.GenDGRLExperienceReplay("bigfish-2M", 2, root=tmp_path)
    with pytest.raises(RuntimeError, match="does not exist"):
        D.OpenMLExperienceReplay("iris", 2, root=tmp_path)
    with pytest.raises(NotImplementedError, match="streaming"):
        D.OpenXExperienceReplay("cmu_stretch", streaming=True, root=tmp_path)
    assert files_under(tmp_path) == []


def test_cached_dataset_is_a_tensordict_memmap(server, tmp_path):
    """The cache is TorchRL's on-disk layout: TensorDict.load_memmap reads it."""
    data, (obs, *_) = S.d4rl_file(tmp_path)
    server.files["/" + D4RL_FILES["hopper-medium-v2"]] = data
    rb = D.D4RLExperienceReplay("hopper-medium-v2", 2, root=tmp_path / "r", base_url=server.url)
    td = TensorDict.load_memmap(rb.data_path)
    np.testing.assert_array_equal(td["observation"].numpy(), obs[:6])
