"""The ``>>>`` examples of the adapters' docstrings run as printed (doctest), so the API
reference's examples cannot drift from the code. Every module of ``functional_rb.adapters``
whose docstrings hold an example is collected (the core's: tests/core/test_core_docstring_examples.py).
"""

import doctest
import importlib
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("tensordict")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the core's modules (functional_rb.errors, functional_rb._internal.names, ...) run in
# tests/core/test_core_docstring_examples.py: an example that registers a stable name must
# run once per process
CORE: list = []


def _adapter_modules():
    out = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        if ">>>" in path.read_text():
            rel = path.relative_to(ROOT / "adapters").with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append(".".join(["functional_rb.adapters", *parts]))
    return out


MODULES = _adapter_modules() + CORE


def test_the_adapters_have_examples():
    assert len(MODULES) >= 25


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:  # an optional dependency (ray, h5py, ...)
        if e.name and not e.name.startswith("functional_rb"):
            pytest.skip(f"{name} needs {e.name}")
        raise
    result = doctest.testmod(
        module,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=False,
        verbose=False,
    )
    assert result.attempted, f"{name}: no example found"
    assert not result.failed, (
        f"{name}: {result.failed} of {result.attempted} examples failed "
        "(run python -m doctest on the module to see them)"
    )
