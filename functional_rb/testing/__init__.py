"""Property-based testing of replay buffers: for your own components and training code.

Needs the ``test`` extra (hypothesis and scipy; from a clone of the repository:
``pip install -c constraints.txt ".[test]"``).

* :func:`assert_invariants` ``(rb, state)``: every invariant a state must satisfy (also under
  ``jax.jit``, as a host callback: a debug mode for training loops);
* :func:`assert_distribution` ``(rb, state, expected_probs, n=, seed=)``: a sampler's
  empirical distribution against expected probabilities (chi-square and per-position binomial
  tests, Bonferroni-bounded false-alarm rate); :func:`assert_frequencies` for counts you have;
* :func:`check_sampler`, :func:`check_writer`, :func:`check_storage`: conformance of
  components you write to the core's protocols (:mod:`functional_rb.protocol`);
* :class:`ReplayBufferMachine`: a hypothesis state machine that drives a buffer against a
  pure-Python reference model; subclass it with ``buffer`` and ``example``;
* :mod:`functional_rb.testing.strategies`: hypothesis strategies for items, episodes, buffer
  configurations and operation sequences.

hypothesis is imported only when ``strategies`` or ``ReplayBufferMachine`` is used; without it
they raise an ``ImportError`` that says how to install it.
"""

from functional_rb.testing._conformance import ConformanceError
from functional_rb.testing.checks import check_sampler
from functional_rb.testing.invariants import InvariantError, assert_invariants
from functional_rb.testing.stats import FrequencyTest, assert_distribution, assert_frequencies
from functional_rb.testing.storage_checks import check_storage
from functional_rb.testing.writer_checks import check_writer

__all__ = (
    "ConformanceError",
    "FrequencyTest",
    "InvariantError",
    "ReplayBufferMachine",
    "assert_distribution",
    "assert_frequencies",
    "assert_invariants",
    "check_sampler",
    "check_storage",
    "check_writer",
    "strategies",
)


def __getattr__(name):
    # hypothesis is optional: these import it (and say how to install it) only when used
    if name == "ReplayBufferMachine":
        from functional_rb.testing.machine import ReplayBufferMachine

        return ReplayBufferMachine
    if name == "strategies":
        import importlib

        return importlib.import_module("functional_rb.testing.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
