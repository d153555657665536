"""TorchRL's Episode Data format (TED) in the core: each observation stored once.

:mod:`~functional_rb.ted.storage` (``TEDStorage``) writes batches through the pure steps of
:mod:`~functional_rb.ted.write`; :mod:`~functional_rb.ted.flat` converts TED to TorchRL's flat
host format and back; :mod:`~functional_rb.ted.nstep` reads n-step returns from a buffer.
"""

from functional_rb.ted.flat import flat_to_ted, flat_to_ted_lines, ted_to_flat, ted_to_flat_lines
from functional_rb.ted.nstep import n_step_returns
from functional_rb.ted.storage import TEDStorage, TEDStorageState

__all__ = (
    "TEDStorage",
    "TEDStorageState",
    "flat_to_ted",
    "flat_to_ted_lines",
    "n_step_returns",
    "ted_to_flat",
    "ted_to_flat_lines",
)
