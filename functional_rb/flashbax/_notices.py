"""flashbax's warnings, raised where a flashbax user's warning filters find them.

flashbax raises its ``UserWarning``\\ s with ``stacklevel=1``, so Python attributes each to the
flashbax module that raised it (``flashbax.buffers.trajectory_buffer``), and users filter them
by that module: flashbax's own pytest settings turn every warning into an error except two of
its own, matched as ``ignore:<message>:UserWarning:flashbax``. A warning raised from
``functional_rb.flashbax.buffers.trajectory_buffer`` would not match that filter (the module
field is matched from the start of the name), so :func:`warn` attributes it to the module's
flashbax name, with the message text flashbax uses, word for word.
"""

from __future__ import annotations

import sys
import warnings

_PREFIX = "functional_rb."


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue ``message`` as flashbax would from the calling module: attributed to that
    module's flashbax name (``functional_rb.flashbax.x`` -> ``flashbax.x``), at the caller's
    file and line, shown once per location as ``warnings.warn`` does.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     warnings.filterwarnings("ignore", module="flashbax")  # a flashbax user's filter
    ...     warn("ignored as flashbax's own")
    >>> seen
    []
    """
    frame = sys._getframe(1)
    module = frame.f_globals.get("__name__", "flashbax")
    if module.startswith(_PREFIX):
        module = module[len(_PREFIX) :]
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module,
        registry=registry,
        module_globals=frame.f_globals,
    )
