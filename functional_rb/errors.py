"""The exceptions of functional_rb that a program may catch, importable from one public place.

``import functional_rb as frb`` then ``except frb.errors.ConsumedStateError:``. The rest of the
library raises Python's own exceptions (``ValueError``, ``TypeError``, ``OverflowError``), as
the error policy says (:mod:`functional_rb._internal.errors`, the guide's "Errors" page).

- :class:`ConsumedStateError`: a state passed again after an eager call consumed it.
- :class:`ArgumentTypeError`: a configuration argument of the wrong type (a ``TypeError`` that
  is also a ``ValueError``).
- :class:`CheckpointError`: a checkpoint that cannot be read as it was written (also
  ``functional_rb.checkpoint.CheckpointError``).

This module is the bottom layer: it imports nothing of the package, and the modules that raise
these exceptions import them from here (their older paths, ``functional_rb._internal.errors``
and ``functional_rb.checkpoint.atomic``, name the same classes).
"""

from __future__ import annotations

__all__ = ["ArgumentTypeError", "CheckpointError", "ConsumedStateError"]


class ConsumedStateError(RuntimeError):
    """A state passed to a buffer method was consumed (its arrays donated) by an earlier call.

    Calls outside ``jax.jit`` update the state in place and consume the one they are given;
    keep the state a call returns.

    Example:
        >>> import jax.numpy as jnp
        >>> import functional_rb as frb
        >>> rb = frb.ReplayBuffer(capacity=8, batch_size=2)
        >>> old = rb.init({"x": jnp.float32(0)})
        >>> new = rb.add(old, {"x": jnp.arange(3.0)})   # consumes `old`
        >>> try:
        ...     rb.size(old)
        ... except frb.errors.ConsumedStateError as e:
        ...     print(str(e)[:58])
        ReplayBuffer.size: this state was consumed by an earlier c
    """


class ArgumentTypeError(TypeError, ValueError):
    """A configuration argument of the wrong type. A ``TypeError`` that is also a ``ValueError``,
    so code written against either keeps working.

    Example:
        >>> import functional_rb as frb
        >>> try:
        ...     frb.ReplayBuffer(capacity=1.5)
        ... except frb.errors.ArgumentTypeError as e:
        ...     print(type(e).__name__, isinstance(e, ValueError))
        ArgumentTypeError True
    """


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as written: a file missing, truncated, extended or
    altered, a manifest that is damaged or from a newer version. ``file`` names the file,
    ``problem`` says what is wrong with it.

    Example:
        >>> import os, tempfile
        >>> import jax.numpy as jnp
        >>> import functional_rb as frb
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> frb.checkpoint.save(path, {"x": jnp.arange(4.0)})
        >>> with open(os.path.join(path, "data.bin"), "r+b") as f:  # damage it
        ...     _ = f.write(b"oops")
        >>> try:
        ...     frb.checkpoint.load(path)
        ... except frb.errors.CheckpointError as e:
        ...     print(type(e).__name__, os.path.basename(e.file))
        CheckpointError data.bin
    """

    def __init__(self, where: str, file: str, problem: str, fix: str = ""):
        self.file = file
        self.problem = problem
        super().__init__(f"{where}: {file}: {problem}." + (f" {fix}" if fix else ""))
