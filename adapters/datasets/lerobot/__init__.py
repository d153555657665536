"""LeRobot datasets (https://github.com/huggingface/lerobot): robot episodes stored as parquet
frames plus JSON/parquet metadata on the Hugging Face Hub, read in LeRobot's own on-disk format
(v2.x and v3.x) with ``pyarrow``, without the ``lerobot`` or ``datasets`` packages (as TorchRL's
``torchrl.data.datasets.lerobot`` reads it).

Modules: :mod:`.columns` (LeRobot column names -> TorchRL's keys), :mod:`._snapshot` (the
on-disk format), :mod:`.rehydrate` (``rehydrate=True``), :mod:`.dataset` (the buffer).
"""

from functional_rb.adapters.datasets.lerobot.columns import (
    DEFAULT_KEY_MAP,
    lerobot_columns_to_tensordict,
    map_lerobot_key,
)
from functional_rb.adapters.datasets.lerobot.dataset import LeRobotExperienceReplay
from functional_rb.adapters.datasets.lerobot.rehydrate import NextFromFollowingRow

__all__ = (
    "DEFAULT_KEY_MAP",
    "LeRobotExperienceReplay",
    "NextFromFollowingRow",
    "lerobot_columns_to_tensordict",
    "map_lerobot_key",
)
