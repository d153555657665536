"""The optimized HLO of a jitted function as users' programs compile it.

The suite compiles with XLA's older CPU emitters (``tests/conftest.py``: they compile faster),
which also rewrite every scatter as a loop before fusion. A test that reads compiled HLO
(copies of donated arrays, window reads, which instructions read the key) asks for the
compiler users run, with the emitters XLA uses by default."""

from __future__ import annotations

import os

# the flag tests/conftest.py adds to XLA_FLAGS where this jaxlib knows it
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def users_hlo(jitted, *args) -> str:
    """``jitted.lower(*args)`` compiled as users' programs are; its optimized HLO text."""
    # only where the suite turned the older emitters on (a jaxlib that knows the option)
    old = OLD_EMITTERS in os.environ.get("XLA_FLAGS", "")
    options = {"xla_cpu_use_fusion_emitters": True} if old else {}
    return jitted.lower(*args).compile(compiler_options=options).as_text()
