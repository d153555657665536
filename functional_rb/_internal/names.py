"""Moved: the stable names of checkpointed classes live in :mod:`functional_rb.checkpoint.names`.

This module keeps the old import path working (``from functional_rb._internal.names import
stable``) for code not yet moved to the new one.
"""

from functional_rb.checkpoint.names import (
    _BY_NAME,
    _NAME_OF,
    ALIASES,
    DEFINED_IN,
    lookup,
    name_of,
    stable,
    stable_name,
)

__all__ = [
    "ALIASES",
    "DEFINED_IN",
    "_BY_NAME",
    "_NAME_OF",
    "lookup",
    "name_of",
    "stable",
    "stable_name",
]
