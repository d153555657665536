"""TorchRL's ``rehydrate=True``: ``("next", "observation", ...)`` filled at sampling time from
the following row of each sampled slice (TorchRL's ``NextStateReconstructor``)."""

from __future__ import annotations

import warnings

import torch

from functional_rb.adapters.datasets.lerobot.columns import map_lerobot_key, nested_key


class NextFromFollowingRow:
    """TorchRL's ``NextStateReconstructor`` as a plain callable: in a flat ``[B]`` sample,
    ``("next", *key)[i] = key[i + 1]`` where row ``i + 1`` is the next step of the same
    trajectory (same ``traj_key``, ``step_count_key`` one more, ``done_key`` not set at ``i``),
    else ``fill_value``."""

    def __init__(
        self,
        keys,
        *,
        traj_key,
        done_key=None,
        step_count_key=None,
        fill_value: float = float("nan"),
    ):
        self.keys = [nested_key(k) for k in keys]
        self.traj_key, self.done_key, self.step_count_key = traj_key, done_key, step_count_key
        self.fill_value = fill_value

    @staticmethod
    def _marker(td, key, b):
        v = td.get(key if len(key) > 1 else key[0])
        return v.reshape(b, -1)[:, 0]

    def __call__(self, td):
        if td.batch_dims != 1:
            raise ValueError(
                "NextFromFollowingRow expects a flat ``(B,)`` sample. Got "
                f"batch_size={tuple(td.batch_size)}."
            )
        b = td.batch_size[0]
        valid = torch.zeros(b, dtype=torch.bool)
        valid[:-1] = True
        traj = self._marker(td, self.traj_key, b)
        valid[:-1] &= traj[1:] == traj[:-1]
        if self.done_key is not None:
            valid[:-1] &= ~self._marker(td, self.done_key, b)[:-1].bool()
        if self.step_count_key is not None:
            step = self._marker(td, self.step_count_key, b)
            valid[:-1] &= step[1:] == step[:-1] + 1
        for key in self.keys:
            root = td.get(key if len(key) > 1 else key[0])
            nxt = torch.empty_like(root)
            nxt[:-1] = root[1:]
            mask = (~valid).reshape((b,) + (1,) * (root.ndim - 1))
            td.set(("next",) + key, torch.where(mask, root.new_full((), self.fill_value), nxt))
        return td

    def __repr__(self):
        return f"NextFromFollowingRow(keys={self.keys}, fill_value={self.fill_value})"


def rehydrate_transforms(empty, episode_key: tuple, key_map) -> list:
    """TorchRL's ``rehydrate=True``: one transform for float observation leaves (NaN fill) and
    one for the others (0 fill), with the episode, frame and ``("next", "done")`` markers."""
    leaves = {nested_key(k) for k in empty.keys(include_nested=True, leaves_only=True)}
    obs = sorted(k for k in leaves if k[0] == "observation")
    if not obs:
        warnings.warn(
            "LeRobotExperienceReplay: rehydrate=True but the dataset has no "
            "'observation' entry; nothing to re-hydrate.",
            stacklevel=3,
        )
        return []
    if episode_key not in leaves:
        raise ValueError(
            "rehydrate=True requires the episode entry "
            f"({episode_key!r}) to delimit trajectories, but it is not present "
            "in the dataset."
        )
    frame_key = map_lerobot_key("frame_index", key_map)
    if frame_key not in leaves:
        warnings.warn(
            "LeRobotExperienceReplay: rehydrate=True without a per-episode frame "
            f"counter ({frame_key!r}): back-to-back slices of the same episode "
            "cannot be told apart from a contiguous slice.",
            stacklevel=3,
        )
        frame_key = None
    done_key = map_lerobot_key("next.done", key_map)
    done_key = done_key if done_key in leaves else None
    out = []
    for floating, fill in ((True, float("nan")), (False, 0)):
        keys = [
            k
            for k in obs
            if isinstance(empty.get(k), torch.Tensor)
            and empty.get(k).is_floating_point() == floating
        ]
        if keys:
            out.append(
                NextFromFollowingRow(
                    keys,
                    traj_key=episode_key,
                    done_key=done_key,
                    step_count_key=frame_key,
                    fill_value=fill,
                )
            )
    return out
