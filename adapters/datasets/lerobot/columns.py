"""LeRobot's columns -> TorchRL's canonical VLA keys: the key mapping of TorchRL's
``LeRobotExperienceReplay`` and ``lerobot_columns_to_tensordict``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

#: TorchRL's default mapping from LeRobot's dotted column names to the canonical VLA keys;
#: ``observation.images.<camera>`` becomes ``("observation", "image", <camera>)`` and any other
#: dotted name is split into a nested key.
DEFAULT_KEY_MAP = {
    "action": "action",
    "observation.state": ("observation", "state"),
    "episode_index": "episode",
    "frame_index": "frame",
    "task": "language_instruction",
    "next.reward": ("next", "reward"),
    "next.done": ("next", "done"),
}
_IMAGE_PREFIX = "observation.images."
_SUPPORTED_MAJOR = (2, 3)


def nested_key(key) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def map_lerobot_key(name: str, key_map: dict | None = None) -> tuple:
    """The nested key (a tuple) TorchRL gives the LeRobot column ``name``."""
    key_map = {**DEFAULT_KEY_MAP, **(key_map or {})}
    if name in key_map:
        return nested_key(key_map[name])
    if name.startswith(_IMAGE_PREFIX):
        return ("observation", "image", name[len(_IMAGE_PREFIX) :])
    return tuple(name.split("."))


def columns_to_leaves(columns: dict, key_map: dict | None, where: str) -> tuple[dict, dict, int]:
    """Columns -> (``{key: array [N, ...]}``, ``{key: [N] str}``, N): TorchRL's
    ``lerobot_columns_to_tensordict`` rules (1-D ``next`` entries get a trailing unit dim)."""
    arrays, text, n = {}, {}, None
    for name, value in columns.items():
        key = map_lerobot_key(name, key_map)
        if key in arrays or key in text:
            raise ValueError(
                f"{where}: column {name!r} maps to the key {key}, which another "
                "column already has; give one of them another key in key_map."
            )
        if isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
            if not all(isinstance(v, str) for v in value):
                raise ValueError(
                    f"Column {name!r} mixes strings and non-strings; expected a homogeneous column."
                )
            text[key], length = list(value), len(value)
        else:
            arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            if arr.dtype == object or arr.ndim == 0:
                raise TypeError(
                    f"{where}: column {name!r} must be numeric with a leading frame "
                    f"axis or a list of strings; got {type(value).__name__} of "
                    f"dtype {arr.dtype} and shape {arr.shape}."
                )
            if key[0] == "next" and arr.ndim == 1:
                arr = arr[:, None]
            arrays[key], length = arr, arr.shape[0]
        if n is not None and length != n:
            raise ValueError(
                f"{where}: column {name!r} has {length} frames, the columns "
                f"before it have {n}; every column needs one entry per frame."
            )
        n = length
    if n is None:
        raise ValueError("Could not infer the number of frames from `columns`.")
    return arrays, text, n


def lerobot_columns_to_tensordict(
    columns: dict[str, Any], *, key_map: dict | None = None
) -> TensorDict:
    """A LeRobot-style columnar dict (dotted names -> tensors/arrays ``[N, ...]`` or lists of
    ``N`` strings) as a flat ``[N]`` TensorDict in TorchRL's canonical VLA layout:
    ``observation.state`` -> ``("observation", "state")``, ``observation.images.<cam>`` ->
    ``("observation", "image", <cam>)``, ``episode_index`` -> ``"episode"``, ``frame_index`` ->
    ``"frame"``, ``task`` -> ``"language_instruction"`` (a ``NonTensorStack``), ``next.*`` ->
    ``("next", ...)`` ``[N, 1]``; ``key_map`` overrides/extends the mapping."""
    arrays, text, n = columns_to_leaves(columns, key_map, "lerobot_columns_to_tensordict")
    out = TensorDict({}, batch_size=[n])
    for key, arr in arrays.items():
        out.set(key if len(key) > 1 else key[0], torch.as_tensor(arr))
    for key, values in text.items():
        out.set(key if len(key) > 1 else key[0], NonTensorStack.from_list(values))
    return out
