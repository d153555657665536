"""Every relative link in the repository's Markdown pages leads somewhere.

The results page links its explanations by heading (``NOTES.md#at-108-in-short``), and a
heading renamed breaks the link without a word from the documentation build, which reads
``docs/`` only. For every ``[text](target)`` outside code blocks in README.md,
examples/README.md, benchmarks/*.md and docs/**/*.md: the file must exist, and a ``#fragment``
into a Markdown page must be one of its headings, slugged as GitHub slugs them (lower case,
every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``, a
repeated heading numbered ``-1``, ``-2``). Links into the API reference's generated anchors
(``api/*.md#functional_rb...``) are the documentation build's to check
(``tests/test_docs.py``).
"""

import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "examples" / "README.md",
        *(ROOT / "benchmarks").glob("*.md"),
        *(ROOT / "docs").rglob("*.md"),
    ]
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")


def _outside_code(text):
    """The page's lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text):
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub does."""
    seen, out = {}, set()
    for line in _outside_code(text):
        m = _HEADING.fullmatch(line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


@functools.cache
def _anchors_of(path):
    """``anchors`` of the page at ``path`` (read and parsed once, however many links lead there)."""
    return anchors(path.read_text())


def broken_links(page):
    """``(target, why)`` for each relative link of the Markdown file ``page`` that leads
    nowhere."""
    bad = []
    for line in _outside_code(page.read_text()):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.exists():
                bad.append((target, "no such file"))
                continue
            if not fragment or dest.suffix != ".md":
                continue
            if dest.parent.name == "api" and fragment.startswith("functional_rb"):
                continue
            if fragment not in _anchors_of(dest):
                bad.append((target, f"no heading with the anchor #{fragment} in {dest.name}"))
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert broken_links(page) == []


def test_the_pages_have_links_to_check():
    links = sum(len(_LINK.findall(p.read_text())) for p in PAGES)
    assert len(PAGES) >= 20 and links >= 100, (len(PAGES), links)


def test_a_broken_file_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## W5: cost (at 10^8)\n\n## Twice\n## Twice\n"
    )
    page = tmp_path / "page.md"
    text = (
        "# A `code` heading\n\n"
        "[ok](other.md#w5-cost-at-108) [ok](other.md#twice-1) [ok](#a-code-heading)\n"
        "[bad](other.md#w5-cost) [bad](missing.md) [bad](#nowhere) [bad](other.md#twice-2)\n"
        "[skipped](https://example.org/x#y) `[in code](missing.md)`\n"
        "```\n[in a block](missing.md)\n```\n"
    )
    page.write_text(text)
    assert broken_links(page) == [
        ("other.md#w5-cost", "no heading with the anchor #w5-cost in other.md"),
        ("missing.md", "no such file"),
        ("#nowhere", "no heading with the anchor #nowhere in page.md"),
        ("other.md#twice-2", "no heading with the anchor #twice-2 in other.md"),
    ]
