"""The documentation site (mkdocs-material + mkdocstrings, the API reference built from the
docstrings) builds without a single warning, and documents every public class and function of
``functional_rb`` and of ``functional_rb.adapters`` under the paths users import them from.
(The python blocks of its guide pages run in tests/test_readme.py.)"""
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_docs_build_strict_and_render_docstrings(site):
    page = (site / "api" / "buffer" / "index.html").read_text()
    assert 'id="functional_rb.ReplayBuffer.sample"' in page
    assert "Draw a batch" in page  # ReplayBuffer.sample's docstring
    # Sphinx roles in the docstrings are rewritten to code (docs/sphinx_roles.py)
    assert ":class:" not in page and ":mod:" not in page


def test_every_public_class_and_function_is_documented(site):
    import functional_rb as frb
    anchors = set()
    for html in site.rglob("*.html"):
        anchors |= set(re.findall(r'id="(functional_rb[\w.]*)"', html.read_text()))
    names = {a.rsplit(".", 1)[-1] for a in anchors}
    missing = [n for n in frb.__all__
               if (inspect.isclass(getattr(frb, n)) or inspect.isfunction(getattr(frb, n)))
               and n not in names]
    assert not missing, (f"public names without an entry in the API reference: {missing}; add "
                         "a `::: functional_rb.<module>` block to a page under docs/api/")


def _anchors(site):
    anchors = set()
    for html in site.rglob("*.html"):
        anchors |= set(re.findall(r'id="(functional_rb[\w.]*)"', html.read_text()))
    return anchors


def test_every_adapter_is_documented_under_its_public_path(site):
    """TorchRL users find each class at ``functional_rb.adapters.<Name>`` (and the datasets at
    ``functional_rb.adapters.datasets.<Name>``), whatever module defines it."""
    pytest.importorskip("torch")
    pytest.importorskip("tensordict")
    import functional_rb.adapters as adapters
    import functional_rb.adapters.datasets as datasets
    anchors = _anchors(site)
    missing = [f"{mod.__name__}.{n}" for mod in (adapters, datasets) for n in mod.__all__
               if (inspect.isclass(getattr(mod, n)) or inspect.isfunction(getattr(mod, n)))
               and f"{mod.__name__}.{n}" not in anchors]
    assert not missing, (f"adapters without an entry in the API reference: {missing}; add a "
                         "`::: functional_rb.adapters.<Name>` block to docs/api/adapters/")


def test_reference_pages_show_types_and_no_private_members(site):
    page = (site / "api" / "buffer" / "index.html").read_text()
    signature = page[page.index('id="functional_rb.ReplayBuffer"'):]
    signature = signature[:signature.index("</code>")]
    assert "Any" not in re.sub(r"<[^>]+>", "", signature)  # the components' protocols instead
    assert 'class="doc doc-heading"' in page and "doc-signature" in page  # material + signatures
    for html in site.rglob("*.html"):
        private = re.findall(r'id="(functional_rb[\w.]*\._[a-z]\w*)"', html.read_text())
        assert not private, f"{html.relative_to(site)} documents private members: {private[:5]}"
