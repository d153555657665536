"""functional_rb.adapters.datasets: TorchRL's offline dataset loaders on the functional core.

Each loader downloads its source's real files over plain HTTP(S) (``urllib``, resumable, with
retries, checksums and ``tqdm`` progress bars; the base URL of every source can be overridden;
``FRB_DATASETS_DOWNLOADER=hub`` uses the Hugging Face / Minari client libraries instead,
``FRB_DATASETS_PROGRESS=0`` turns the bars off), converts them once into a memory-mapped TensorDict in TED
format under ``root`` and opens it read-only as a
:class:`~functional_rb.adapters.TensorDictReplayBuffer` (memory-mapped storage,
``ImmutableDatasetWriter``). Constructor arguments and methods follow TorchRL's classes of the
same names; see each class for its source, file format, keys, shapes and dtypes.

Requires torch, tensordict, h5py, pillow and (LeRobot) pyarrow (from a clone of the repository:
``pip install -c constraints.txt ".[datasets]"``).
"""

from functional_rb.adapters.datasets._common import BaseDatasetExperienceReplay
from functional_rb.adapters.datasets._download import DatasetChecksumError, DatasetDownloadError
from functional_rb.adapters.datasets._formats import DatasetFormatError
from functional_rb.adapters.datasets.atari_dqn import AtariDQNExperienceReplay
from functional_rb.adapters.datasets.d4rl import D4RLExperienceReplay
from functional_rb.adapters.datasets.gen_dgrl import GenDGRLExperienceReplay
from functional_rb.adapters.datasets.lerobot import (
    LeRobotExperienceReplay,
    lerobot_columns_to_tensordict,
)
from functional_rb.adapters.datasets.minari import MinariExperienceReplay
from functional_rb.adapters.datasets.openml import OpenMLExperienceReplay
from functional_rb.adapters.datasets.openx import OpenXExperienceReplay
from functional_rb.adapters.datasets.roboset import RobosetExperienceReplay
from functional_rb.adapters.datasets.vd4rl import VD4RLExperienceReplay

__all__ = (
    "AtariDQNExperienceReplay",
    "BaseDatasetExperienceReplay",
    "D4RLExperienceReplay",
    "DatasetChecksumError",
    "DatasetDownloadError",
    "DatasetFormatError",
    "GenDGRLExperienceReplay",
    "LeRobotExperienceReplay",
    "MinariExperienceReplay",
    "OpenMLExperienceReplay",
    "OpenXExperienceReplay",
    "RobosetExperienceReplay",
    "VD4RLExperienceReplay",
    "lerobot_columns_to_tensordict",
)
