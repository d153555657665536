"""The ``>>>`` examples of the core's docstrings (and of ``functional_rb.flashbax``) run as
printed (doctest), so the API reference's examples cannot drift from the code. Every core
module whose docstrings hold an example is collected (the adapters' have their own test)."""

import doctest
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _modules():
    out = []
    for path in sorted((ROOT / "functional_rb").rglob("*.py")):
        rel = path.relative_to(ROOT / "functional_rb")
        if rel.parts[0] == "adapters" or ">>>" not in path.read_text():
            continue
        parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
        out.append(".".join(["functional_rb", *parts]))
    return out


MODULES = _modules()


def test_the_flashbax_api_and_the_new_core_modules_have_examples():
    for name in (
        "functional_rb.flashbax.buffers.trajectory_buffer",
        "functional_rb.flashbax.buffers.prioritised_trajectory_buffer",
        "functional_rb.samplers.sequences",
        "functional_rb.queue",
        "functional_rb.mixer",
    ):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    if name.startswith(("functional_rb.vault", "functional_rb.flashbax.vault")):
        pytest.importorskip("tensorstore")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"jax": jax, "jnp": jnp, "np": np},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=False,
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
