"""LeRobotExperienceReplay against a local Hugging Face-like server (127.0.0.1) serving small
datasets written in LeRobot's real layout (tests/support/_lerobot_files.py, pyarrow parquet):
download (plain HTTP and huggingface_hub), the data compared leaf by leaf with TorchRL's
``LeRobotExperienceReplay`` given the same frames, slices by episode, rehydrate against
TorchRL's ``NextStateReconstructor``, v2.1 and v3.0 layouts, and damaged or missing files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack

pytest.importorskip("pyarrow")
import _dataset_server as S  # noqa: E402
import _lerobot_files as L  # noqa: E402

import functional_rb.adapters.datasets as D  # noqa: E402
from functional_rb.adapters import SliceSampler  # noqa: E402

REPO = "lerobot/unit_test"


server = S.server_fixture(page_size=3)


@pytest.fixture(scope="module")
def cols():
    return L.frames()


def torchrl_columns(cols) -> dict:
    """What TorchRL's loader reads from these files through ``datasets`` (torch formatting:
    images ``[C, H, W]``, floats float32, integers int64) plus ``task`` from the tasks table."""
    c = {k: torch.as_tensor(v) for k, v in cols.items()}
    c["observation.images.top"] = c["observation.images.top"].permute(0, 3, 1, 2).contiguous()
    c["observation.environment_state"] = c["observation.environment_state"].float()
    c["task"] = [L.TASKS[i] for i in cols["task_index"]]
    return c


def assert_same_data(ours, theirs):
    """Same keys (text entries included), and per leaf the same shape, dtype and values."""
    keys = set(theirs.keys(True))
    assert set(ours.keys(True)) == keys
    for k in keys:
        a, b = ours.get(k), theirs.get(k)
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype, (
                k,
                a.shape,
                b.shape,
                a.dtype,
                b.dtype,
            )
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
        elif isinstance(b, NonTensorStack):
            assert a.tolist() == b.tolist(), k


def check_slices(rb, sample, slice_len):
    """Each slice: consecutive frames of one episode, equal to the stored rows, truncated (and
    done) at its last step only."""
    idx = sample["index"].reshape(-1, slice_len)
    assert (idx.diff(dim=1) == 1).all()
    stored = rb[idx.reshape(-1)]
    torch.testing.assert_close(sample["action"], stored["action"])
    ep = sample["episode"].reshape(-1, slice_len)
    assert (ep == ep[:, :1]).all()
    assert (sample["frame"].reshape(-1, slice_len).diff(dim=1) == 1).all()
    trunc = sample["next", "truncated"].reshape(-1, slice_len)
    assert trunc[:, -1].all() and not trunc[:, :-1].any()


# ------------------------------------------------------------------------ download + layout
def test_v3_download_matches_torchrl(server, tmp_path, cols):
    torchrl_datasets = pytest.importorskip("torchrl.data.datasets")
    prefix = L.serve(server, REPO, L.v3(cols))
    rb = D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url, batch_size=4)
    ref = torchrl_datasets.LeRobotExperienceReplay.from_columns(torchrl_columns(cols))
    assert len(rb) == len(ref) == sum(L.LENGTHS)
    assert_same_data(rb[:], ref[:])
    # TorchRL's key mapping, and the frames as written
    td = rb[:]
    np.testing.assert_array_equal(
        td["observation", "image", "top"].numpy(),
        cols["observation.images.top"].transpose(0, 3, 1, 2),
    )
    np.testing.assert_array_equal(td["episode"].numpy(), cols["episode_index"])
    np.testing.assert_array_equal(td["frame"].numpy(), cols["frame_index"])
    # a LeRobot episode ends where next.done is set, [N, 1] as TorchRL gives it
    ends = np.cumsum(L.LENGTHS) - 1
    assert td["next", "done"].shape == (len(rb), 1)
    np.testing.assert_array_equal(np.flatnonzero(td["next", "done"].numpy()), ends)
    assert td.get("language_instruction").tolist() == [
        L.TASKS[L.EPISODE_TASK[e]] for e in cols["episode_index"]
    ]
    assert rb.metadata["info"]["codebase_version"] == "v3.0"
    assert rb.metadata["stats"]["action"]["count"] == [len(rb)]
    assert rb.data_path == tmp_path / REPO.replace("/", "_")  # TorchRL's layout
    assert rb.video_keys == []
    # the data files are LFS files: fetched from the CDN the Hub redirects to
    assert any(p.startswith("/cdn/") for p in server.log)
    assert server.gets(prefix + "meta/stats.json")
    s = rb.sample()
    assert s.batch_size == (4,) and s.get("language_instruction").tolist() == [
        L.TASKS[int(t)] for t in s["task_index"]
    ]
    # the converted dataset is reused: no request at all
    n = server.requests()
    again = D.LeRobotExperienceReplay(
        REPO, root=tmp_path, base_url="http://127.0.0.1:9", download=False
    )
    assert server.requests() == n and len(again) == len(rb)


def test_slices_by_episode_have_torchrl_layout(server, tmp_path, cols):
    torchrl_datasets = pytest.importorskip("torchrl.data.datasets")
    L.serve(server, REPO, L.v3(cols))
    rb = D.LeRobotExperienceReplay(
        REPO, root=tmp_path, base_url=server.url, slice_len=3, batch_size=9
    )
    ref = torchrl_datasets.LeRobotExperienceReplay.from_columns(
        torchrl_columns(cols), slice_len=3, batch_size=9
    )
    torch.manual_seed(0)
    seen = set()
    for _ in range(30):
        s = rb.sample()
        check_slices(rb, s, 3)
        seen |= set(s["episode"].tolist())
    assert seen == {0, 1, 2}  # every episode is long enough for a slice of 3
    r = ref.sample()
    # same entries, shapes and dtypes as TorchRL's sample (values: other draws)
    for k in r.keys(True, True):
        a, b = s.get(k), r.get(k)
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), k
    assert {k for k in s.keys(True, True)} == {k for k in r.keys(True, True)}
    with pytest.raises(ValueError, match="not both"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, num_slices=2, slice_len=2)
    with pytest.raises(ValueError, match="exclusive with the `sampler`"):
        D.LeRobotExperienceReplay(
            REPO, root=tmp_path, slice_len=2, sampler=SliceSampler(slice_len=2, traj_key="episode")
        )


def test_rehydrate_matches_torchrl_next_state_reconstructor(server, tmp_path, cols):
    transforms = pytest.importorskip("torchrl.envs.transforms")
    L.serve(server, REPO, L.v3(cols))
    rb = D.LeRobotExperienceReplay(
        REPO, root=tmp_path, base_url=server.url, slice_len=2, batch_size=8, rehydrate=True
    )
    plain = D.LeRobotExperienceReplay(REPO, root=tmp_path, download=False)
    torch.manual_seed(1)
    filled = 0
    for _ in range(5):
        s = rb.sample()
        td = plain[s["index"].reshape(-1)]
        for keys, fill in (
            ([("observation", "state"), ("observation", "environment_state")], float("nan")),
            ([("observation", "image", "top")], 0),
        ):
            transforms.NextStateReconstructor(
                keys,
                traj_key="episode",
                done_key=("next", "done"),
                step_count_key="frame",
                fill_value=fill,
            )(td)
            for k in keys:
                torch.testing.assert_close(
                    s[("next",) + k], td[("next",) + k], equal_nan=True, rtol=0, atol=0
                )
        # the next observation is the following row when that row is the next frame of the
        # same episode (within a slice, or a back-to-back slice), else the fill
        ep, fr, done = td["episode"], td["frame"], td["next", "done"].reshape(-1)
        obs, nxt = s["observation", "state"], s["next", "observation", "state"]
        img = s["next", "observation", "image", "top"]
        for i in range(len(ep)):
            if i + 1 < len(ep) and ep[i + 1] == ep[i] and fr[i + 1] == fr[i] + 1 and not done[i]:
                assert torch.equal(nxt[i], obs[i + 1])
            else:
                filled += 1
                assert torch.isnan(nxt[i]).all() and (img[i] == 0).all()
    assert filled >= 5  # at least the last row of each batch


def test_v21_layout_gives_the_same_data(server, tmp_path, cols):
    L.serve(server, "lerobot/v21", L.v21(cols))
    L.serve(server, REPO, L.v3(cols))
    old = D.LeRobotExperienceReplay("lerobot/v21", root=tmp_path, base_url=server.url)
    new = D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert old.metadata["info"]["codebase_version"] == "v2.1"
    assert_same_data(old[:], new[:])


def test_frames_are_sorted_by_index_as_torchrl_does(server, tmp_path, cols):
    # episode 2 in the first file, episodes 0 and 1 in the second: path order is not frame order
    L.serve(server, REPO, L.v3(cols, file_episodes=((2,), (0, 1))))
    rb = D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    td = rb[:]
    np.testing.assert_array_equal(td["index"].numpy(), np.arange(len(rb)))
    np.testing.assert_array_equal(td["observation", "state"].numpy(), cols["observation.state"])
    assert td.get("language_instruction").tolist()[-1] == L.TASKS[L.EPISODE_TASK[2]]


def test_hub_client_path(server, tmp_path, cols, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "hub")
    L.serve(server, REPO, L.v3(cols))
    rb = D.LeRobotExperienceReplay(REPO, root=tmp_path / "hub", base_url=server.url)
    # huggingface_hub asks HEAD for each file's metadata (the plain HTTP path never does)
    assert any(e["method"] == "HEAD" for e in server.events)
    monkeypatch.setenv("FRB_DATASETS_DOWNLOADER", "http")
    ref = D.LeRobotExperienceReplay(REPO, root=tmp_path / "http", base_url=server.url)
    assert_same_data(rb[:], ref[:])


_TORCHRL_DOWNLOAD = """
import sys, torch
from torchrl.data.datasets import LeRobotExperienceReplay
rb = LeRobotExperienceReplay(sys.argv[1], root=sys.argv[2], download=True)
td = rb[:]
torch.save({str(k): (v.tolist() if not isinstance(v, torch.Tensor) else
                    v.as_subclass(torch.Tensor).clone())
            for k, v in td.items(True, True, is_leaf=lambda c: c is not None and
                                 c.__name__ in ("Tensor", "NonTensorStack",
                                                "MemoryMappedTensor"))}, sys.argv[3])
"""


@pytest.mark.parametrize("layout", ["v3", "v21"])
def test_torchrl_download_path_on_the_same_files(server, tmp_path, cols, layout):
    """TorchRL's own download path (huggingface_hub.snapshot_download from $HF_ENDPOINT, then
    ``datasets``' parquet loader) on the files served here gives our data, leaf for leaf. Runs
    where the ``datasets`` package is installed (TorchRL's loader needs it), in a subprocess:
    huggingface_hub reads HF_ENDPOINT when it is imported."""
    pytest.importorskip("datasets")
    pytest.importorskip("torchrl")
    L.serve(server, REPO, L.v3(cols) if layout == "v3" else L.v21(cols))
    ours = D.LeRobotExperienceReplay(REPO, root=tmp_path / "frb", base_url=server.url)[:]
    out = tmp_path / "torchrl.pt"
    env = {
        **os.environ,
        "HF_ENDPOINT": server.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": "0",
    }
    subprocess.run(
        [sys.executable, "-c", _TORCHRL_DOWNLOAD, REPO, str(tmp_path / "torchrl"), str(out)],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    theirs = torch.load(out)
    assert any("/revision/" in p for p in server.log)  # snapshot_download asked the server
    leaves = {
        str(k): v
        for k, v in ours.items(
            True,
            True,
            is_leaf=lambda c: (
                c is not None and c.__name__ in ("Tensor", "NonTensorStack", "MemoryMappedTensor")
            ),
        )
    }
    assert set(leaves) == set(theirs) and "language_instruction" in theirs
    for k, b in theirs.items():
        a = leaves[k]
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), k
            assert torch.equal(a, b), k
        else:
            assert a.tolist() == b, k


# ------------------------------------------------------------------------------ from_columns
def test_from_columns_and_columns_to_tensordict_match_torchrl(cols):
    lerobot = pytest.importorskip("torchrl.data.datasets.lerobot")
    c = torchrl_columns(cols)
    key_map = {"observation.environment_state": ("observation", "env")}
    ours = D.lerobot_columns_to_tensordict(c, key_map=key_map)
    assert_same_data(ours, lerobot.lerobot_columns_to_tensordict(c, key_map=key_map))
    rb = D.LeRobotExperienceReplay.from_columns(c, slice_len=2, batch_size=4)
    ref = lerobot.LeRobotExperienceReplay.from_columns(c, slice_len=2, batch_size=4)
    assert_same_data(rb[:], ref[:])
    check_slices(rb, rb.sample(), 2)
    root = rb.root
    assert root.exists()
    del rb
    import gc

    gc.collect()
    assert not root.exists()  # from_columns leaves nothing on disk
    with pytest.raises(ValueError, match="mixes strings"):
        D.lerobot_columns_to_tensordict({"task": ["a", 1]})
    with pytest.raises(ValueError, match="infer the number of frames"):
        D.lerobot_columns_to_tensordict({})
    with pytest.raises(ValueError, match="'action' has 2 frames"):
        D.lerobot_columns_to_tensordict(
            {"observation.state": torch.zeros(3, 1), "action": torch.zeros(2, 1)}
        )


# -------------------------------------------------------------------------------- failures
def files_under(root) -> list:
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def test_missing_data_file_is_named(server, tmp_path, cols):
    prefix = L.serve(server, REPO, L.v3(cols))
    del server.files[prefix + "data/chunk-000/file-001.parquet"]
    with pytest.raises(D.DatasetFormatError, match=r"file-001\.parquet is missing.*\[2\]"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert files_under(tmp_path) == []
    # listed by the Hub but not served: the download error names the URL
    server.listed_only.add(prefix + "data/chunk-000/file-001.parquet")
    with pytest.raises(D.DatasetDownloadError, match=r"file-001\.parquet failed with HTTP 404"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert files_under(tmp_path) == []


def test_corrupt_parquet_is_named(server, tmp_path, cols):
    prefix = L.serve(server, REPO, L.v3(cols), lfs=())
    server.files[prefix + "data/chunk-000/file-000.parquet"] = b"PAR1 not a parquet file"
    with pytest.raises(
        D.DatasetFormatError,
        match=r"resolve/main/data/chunk-000/file-000\.parquet is not a readable",
    ):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert files_under(tmp_path) == []


def test_inconsistent_metadata_is_named(server, tmp_path, cols):
    files = L.v3(cols)
    info = json.loads(files["meta/info.json"])
    files["meta/info.json"] = json.dumps({**info, "total_frames": 13}).encode()
    L.serve(server, REPO, files)
    with pytest.raises(D.DatasetFormatError, match="total_frames=13.*hold 12 frames"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    files["meta/info.json"] = json.dumps({**info, "codebase_version": "v1.6"}).encode()
    L.serve(server, REPO, files)
    with pytest.raises(D.DatasetFormatError, match=r"info\.json has codebase_version 'v1.6'"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert files_under(tmp_path) == []


def test_video_features(server, tmp_path, cols):
    prefix = L.serve(server, REPO, L.v3(cols, video=True))
    with pytest.raises(
        NotImplementedError,
        match=r"\['observation.images.wrist'\] are stored as MP4.*"
        "decode_video=False",
    ):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url)
    assert not any(p.startswith(prefix + "data/") or "/cdn/" in p for p in server.log)
    rb = D.LeRobotExperienceReplay(REPO, root=tmp_path, base_url=server.url, decode_video=False)
    assert rb.video_keys == ["observation.images.wrist"]
    assert "wrist" not in rb[:]["observation", "image"].keys()
    assert not any("videos/" in p for p in server.log)  # the MP4s are not downloaded
    # the cached conversion lacks the videos: asking to decode them raises again
    with pytest.raises(NotImplementedError, match="observation.images.wrist"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, download=False)


def test_key_map_is_recorded_with_the_cache(server, tmp_path, cols):
    L.serve(server, REPO, L.v3(cols))
    key_map = {"observation.state": ("observation", "proprio")}
    rb = D.LeRobotExperienceReplay(
        REPO, root=tmp_path, base_url=server.url, key_map=key_map, slice_len=2, batch_size=4
    )
    assert ("observation", "proprio") in rb[:].keys(True, True)
    with pytest.raises(ValueError, match="converted with other options"):
        D.LeRobotExperienceReplay(REPO, root=tmp_path, download=False)
    key_map = {"episode_index": "traj"}
    rb = D.LeRobotExperienceReplay(
        REPO,
        root=tmp_path,
        base_url=server.url,
        key_map=key_map,
        slice_len=2,
        batch_size=4,
        download="force",
    )
    check = rb.sample()
    assert (check["traj"].reshape(2, 2) == check["traj"].reshape(2, 2)[:, :1]).all()
    assert math.isclose(len(rb), sum(L.LENGTHS))
