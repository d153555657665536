"""Every fenced ```python block of the README and of the documentation site's pages
(``docs/**/*.md``) runs as printed, each as a program of its own, so no snippet can drift from
the library.

A block that needs something heavy (a download) may be skipped by an HTML comment on the line
just before its fence: ``<!-- readme-test: skip (why) -->``. Keep that rare: the test below
allows two in all.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.+?)\)\s*-->\s*$")


def blocks(path):
    """``(path, line, heading, code, skip reason or None)`` of every ```python block."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].splitlines()
        line = len(before) + 1
        heading = next(
            (h.lstrip("#").strip() for h in reversed(before) if h.startswith("#")), "top"
        )
        skip = _SKIP.search(before[-1]) if before else None
        out.append((path, line, heading, m.group(1), skip.group(1) if skip else None))
    return out


README_BLOCKS = blocks(README)
BLOCKS = README_BLOCKS + [b for page in PAGES for b in blocks(page)]


def _id(block):
    path, line, heading = block[:3]
    name = "README" if path == README else path.relative_to(ROOT / "docs").with_suffix("")
    return f"{name}-L{line}-{re.sub(r'[^a-z0-9]+', '-', heading.lower())[:30]}"


def test_the_readme_and_pages_have_python_blocks_and_few_skips():
    assert len(README_BLOCKS) >= 2
    assert len(BLOCKS) >= 20
    skipped = [(_id(b), b[4]) for b in BLOCKS if b[4]]
    assert len(skipped) <= 2, f"too many skipped blocks: {skipped}"


@pytest.mark.parametrize("path,line,heading,code,skip", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_block_runs_as_printed(path, line, heading, code, skip, capsys):
    if skip:
        pytest.skip(f"{path.name} line {line}: {skip}")
    # line numbers in tracebacks point into the Markdown file
    exec(compile("\n" * line + code, str(path), "exec"), {"__name__": "__readme__"})
    capsys.readouterr()


def test_readme_example_prints_the_shapes_it_claims(capsys):
    """The first example's comments state what it prints."""
    _, _, _, code, _ = README_BLOCKS[0]
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(256, 4) (256,) (256,) (256,)")
    assert out[1] == "96 True"


def test_readme_test_command_is_the_ci_command():
    """The README's test command installs and runs what ``.ci/run`` installs and runs."""
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")
    readme = README.read_text()
    install = 'pip install -c constraints.txt ".[test]"'
    assert f"python -m {install}" in ci and install in readme
    pytest_line = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    lint = " && ".join(
        line.removesuffix(" || exit 1")
        for line in ci.splitlines()
        if line.startswith(("python -m ruff", "python -m mypy"))
    )
    # the lint, the format check and the type check
    assert lint.count("ruff") == 2 and lint.count("mypy") == 1
    assert f"{install} && {lint} && {pytest_line}\n" in readme
