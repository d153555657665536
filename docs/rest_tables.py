"""A griffe extension for the API reference: a few module docstrings hold reST "simple tables"
(columns under runs of ``=``), which Markdown would print as one paragraph of ``=`` signs. Each
becomes a Markdown table. In a simple table a line whose first column is blank continues the
row above it."""

from __future__ import annotations

import re

import griffe

_BORDER = re.compile(r"^ *=+( +=+)+ *$")


def _columns(border: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"=+", border)]


def _cells(line: str, spans: list[tuple[int, int]]) -> list[str]:
    out = []
    for i, (start, _) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else len(line)
        out.append(line[start:end].strip())
    return out


def _table(lines: list[str], spans) -> list[str]:
    header, rows = None, []
    for line in lines:
        if _BORDER.match(line):
            continue
        cells = _cells(line, spans)
        if header is None:
            header = cells
        elif rows and not cells[0]:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
        else:
            rows.append(cells)

    def fmt(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [fmt(header), "| " + " | ".join("---" for _ in header) + " |", *map(fmt, rows)]


def convert(text: str) -> str:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if _BORDER.match(lines[i]):
            # a table: top border, header, border, rows, bottom border
            borders = [j for j in range(i, len(lines)) if _BORDER.match(lines[j])]
            if len(borders) >= 3 and borders[1] == i + 2:
                end = borders[2]
                out += ["", *_table(lines[i : end + 1], _columns(lines[i])), ""]
                i = end + 1
                continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


class RestTables(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        del kwargs
        if obj.docstring is not None and "==" in obj.docstring.value:
            obj.docstring.value = convert(obj.docstring.value)
