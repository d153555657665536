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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
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
    missing = [
        n
        for n in frb.__all__
        if (inspect.isclass(getattr(frb, n)) or inspect.isfunction(getattr(frb, n)))
        and n not in names
    ]
    assert not missing, (
        f"public names without an entry in the API reference: {missing}; add "
        "a `::: functional_rb.<module>` block to a page under docs/api/"
    )


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
    missing = [
        f"{mod.__name__}.{n}"
        for mod in (adapters, datasets)
        for n in mod.__all__
        if (inspect.isclass(getattr(mod, n)) or inspect.isfunction(getattr(mod, n)))
        and f"{mod.__name__}.{n}" not in anchors
    ]
    assert not missing, (
        f"adapters without an entry in the API reference: {missing}; add a "
        "`::: functional_rb.adapters.<Name>` block to docs/api/adapters/"
    )


def test_reference_pages_show_types_and_no_private_members(site):
    page = (site / "api" / "buffer" / "index.html").read_text()
    signature = page[page.index('id="functional_rb.ReplayBuffer"') :]
    signature = signature[: signature.index("</code>")]
    assert "Any" not in re.sub(r"<[^>]+>", "", signature)  # the components' protocols instead
    assert 'class="doc doc-heading"' in page and "doc-signature" in page  # material + signatures
    for html in site.rglob("*.html"):
        private = re.findall(r'id="(functional_rb[\w.]*\._[a-z]\w*)"', html.read_text())
        assert not private, f"{html.relative_to(site)} documents private members: {private[:5]}"


# The adapters' reference pages: one typed bullet per constructor parameter, no raw section
# labels, no private bases, and page titles that tell the JAX core's pages from the adapters'.
ADAPTER_PAGES = (
    "replay_buffers",
    "storages",
    "samplers",
    "writers",
    "checkpointers",
    "ted",
    "datasets",
)
_BULLET = re.compile(r"<b><code>([\w*]+)</code></b>\s*(\(<code>)?")


def _page_text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def _class_blocks(html: str):
    """``(dotted name, its HTML up to the next top-level object)`` of each documented class."""
    heads = list(re.finditer(r'<h2 id="(functional_rb\.adapters[\w.]*)"', html))
    for m, nxt in zip(heads, heads[1:] + [None]):
        yield m.group(1), html[m.start() : nxt.start() if nxt else len(html)]


# being rewritten with the services (the Ray actor's life in one place): their docstrings list
# each argument once that work lands; then drop them from this set
_SERVICES_IN_PROGRESS = {
    "functional_rb.adapters.RayReplayBuffer",
    "functional_rb.adapters.comm.DistributedReplayClient",
}


def _constructor_params(path: str) -> list:
    import enum
    import importlib

    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    if (
        not inspect.isclass(obj)
        or obj.__init__ is object.__init__
        or issubclass(obj, (BaseException, enum.Enum))
        or path in _SERVICES_IN_PROGRESS
    ):
        return []
    return [
        p
        for p in inspect.signature(obj.__init__).parameters.values()
        if p.name != "self" and not p.name.startswith("_")
    ]


def test_adapter_pages_document_each_parameter_with_its_type(site):
    pytest.importorskip("torch")
    problems = []
    for page in ADAPTER_PAGES:
        html = (site / "api" / "adapters" / page / "index.html").read_text()
        for path, block in _class_blocks(html):
            bullets = {m.group(1): bool(m.group(2)) for m in _BULLET.finditer(block)}
            for p in _constructor_params(path):
                name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
                if name not in bullets:
                    problems.append(f"{page}: {path}({p.name}) has no bullet of its own")
                elif not bullets[name] and not name.startswith("*"):
                    problems.append(f"{page}: {path}({p.name}) has no type")
    assert not problems, "\n".join(problems)


def test_adapter_pages_have_no_raw_labels_or_private_bases(site):
    for page in ADAPTER_PAGES:
        text = _page_text((site / "api" / "adapters" / page / "index.html").read_text())
        raw = re.findall(r"(?:Keyword )?Args: \S+", text)
        assert not raw, f"{page}: docstring section labels rendered as text: {raw[:3]}"
    for html in site.rglob("*.html"):
        bases = [
            _page_text(b)
            for b in re.findall(
                r'<p class="doc doc-class-bases">(.*?)</p>', html.read_text(), re.DOTALL
            )
        ]
        private = [b for b in bases if re.search(r"(:|,) _\w", b)]
        assert not private, f"{html.relative_to(site)}: private bases shown: {private}"


def test_page_titles_are_distinct(site):
    titles = {}
    for html in site.rglob("*.html"):
        m = re.search(r"<title>(.*?)</title>", html.read_text(), re.DOTALL)
        if m and html.name == "index.html" and "404" not in str(html):
            titles.setdefault(m.group(1).strip(), []).append(str(html.relative_to(site)))
    doubled = {t: p for t, p in titles.items() if len(p) > 1}
    assert not doubled, f"pages sharing a title (search cannot tell them apart): {doubled}"
