"""Every fenced ```python block of the README runs as printed, each as a program of its own, so
no snippet can drift from the library.

A block that needs something heavy (a download) may be skipped by an HTML comment on the line
just before its fence: ``<!-- readme-test: skip (why) -->``. Keep that rare: the test below
allows two.
"""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.+?)\)\s*-->\s*$")


def blocks():
    """``(line, heading, code, skip reason or None)`` of every ```python block."""
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].splitlines()
        line = len(before) + 1
        heading = next((h.lstrip("#").strip() for h in reversed(before) if h.startswith("#")),
                       "top")
        skip = _SKIP.search(before[-1]) if before else None
        out.append((line, heading, m.group(1), skip.group(1) if skip else None))
    return out


BLOCKS = blocks()


def test_the_readme_has_python_blocks_and_few_skips():
    assert len(BLOCKS) >= 8
    skipped = [(line, why) for line, _, _, why in BLOCKS if why]
    assert len(skipped) <= 2, f"too many skipped README blocks: {skipped}"


@pytest.mark.parametrize("line,heading,code,skip", BLOCKS,
                         ids=[f"L{b[0]}-{re.sub(r'[^a-z0-9]+', '-', b[1].lower())[:30]}"
                              for b in BLOCKS])
def test_readme_block_runs_as_printed(line, heading, code, skip, capsys):
    if skip:
        pytest.skip(f"README line {line}: {skip}")
    # line numbers in tracebacks point into README.md
    exec(compile("\n" * line + code, str(README), "exec"), {"__name__": "__readme__"})
    capsys.readouterr()


def test_readme_example_prints_the_shapes_it_claims(capsys):
    """The first example's comments state what it prints."""
    _, _, code, _ = BLOCKS[0]
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(256, 4) (256,) (256,) (256,)")
    assert out[1] == "96 True"
