"""A griffe extension for the API reference: the docstrings cross-reference with Sphinx roles
(``:class:`~functional_rb.ReplayBuffer```), which Markdown would print literally. Each role
becomes inline code naming its target (the last dotted part when the target starts with ``~``).
Double-backquoted code (reST literals) is already Markdown code and is left as it is. Doctest
examples (``>>>`` lines and their output, up to the next blank line) become fenced Python
blocks, so Markdown neither reflows them nor reads ``x["a"][0]`` as a link."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def fence_doctests(text: str) -> str:
    """``text`` with every doctest example (a run of lines from a ``>>>`` line to the next
    blank or less indented line) inside a fenced ``python`` block."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(lines[i])
            i += 1
        out += [indent + "```python", *block, indent + "```"]
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(_ROLE.sub(_code, obj.docstring.value))
