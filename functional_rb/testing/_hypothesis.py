"""The optional dependency on hypothesis, imported only by the modules that need it."""

import importlib

INSTALL = 'pip install -c constraints.txt ".[test]" (from a clone of functional_rb)'


def require() -> None:
    """Import hypothesis, or raise an ImportError saying how to install it."""
    try:
        importlib.import_module("hypothesis")
    except ImportError as e:
        raise ImportError(
            "functional_rb.testing.strategies and ReplayBufferMachine need hypothesis, which is "
            f"not installed. Install the test extra: {INSTALL}"
        ) from e
