"""A griffe extension for the API reference: the docstrings cross-reference with Sphinx roles
(``:class:`~functional_rb.ReplayBuffer```), which Markdown would print literally. Each role
becomes inline code naming its target (the last dotted part when the target starts with ``~``).
Double-backquoted code (reST literals) is already Markdown code and is left as it is."""
from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
