"""Plots of the benchmark tables: ``python benchmarks/plot.py`` (needs matplotlib, in the
``bench`` extra).

Reads the tables that the benchmarks print (``benchmarks/run.py``: ``| mode | backend | value
| unit | ...``; ``w3_slices.py``: one row per sampler, one column per measure) from the sections
of ``benchmarks/README.md`` (``<!-- section: NAME -->`` markers), where each run's output is
pasted as printed, and writes one PNG per section, ``benchmarks/plots/NAME.png``: one panel
per measured mode, one bar per backend, functional_rb's bars in colour, the peers in grey.
Tables that are not measurements (ratio ranges, lists of runs) are skipped: a table is plotted
when its value column holds plain numbers.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

_HERE = pathlib.Path(__file__).resolve().parent
_NUMBER = re.compile(r"^-?[\d,]*\.?\d+$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text``, each a list of rows (the header first), cells
    stripped; the separator row is dropped."""
    out, cur = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            row = _cells(line)
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in row):
                cur.append(row)
        elif cur:
            out.append(cur)
            cur = []
    return out


def _number(cell: str) -> float | None:
    cell = cell.replace("*", "").strip()
    return float(cell.replace(",", "")) if _NUMBER.match(cell) else None


def measurements(table: list[list[str]]) -> list[dict]:
    """``[{mode, backend, value, unit}]`` from one table, or ``[]`` when it holds none."""
    head = [h.lower() for h in table[0]]
    rows = []
    if {"mode", "backend", "value"} <= set(head):
        m, b, v = head.index("mode"), head.index("backend"), head.index("value")
        u = head.index("unit") if "unit" in head else None
        for r in table[1:]:
            value = _number(r[v]) if len(r) > v else None
            if value is not None:
                rows.append(
                    {
                        "mode": r[m],
                        "backend": r[b],
                        "value": value,
                        "unit": r[u] if u is not None else "",
                    }
                )
        return rows
    # wide: one row per backend, one numeric column per measure ("name (unit)")
    for c, h in enumerate(table[0][1:], start=1):
        if h.lower().startswith(("vs", "x ")):
            continue
        unit = re.search(r"\(([^)]*)\)\s*$", h)
        for r in table[1:]:
            value = _number(r[c]) if len(r) > c else None
            if value is not None:
                rows.append(
                    {
                        "mode": re.sub(r"\s*\([^)]*\)\s*$", "", h),
                        "backend": r[0],
                        "value": value,
                        "unit": unit.group(1) if unit else "",
                    }
                )
    return rows


def sections(text: str) -> dict[str, str]:
    """``{name: text}`` of the ``<!-- section: NAME -->`` blocks of ``text``: from the marker to
    the next marker or the next second-level heading after the block's own, whichever comes
    first (the sections without a plot that follow it are not part of it)."""
    parts = re.split(r"<!--\s*section:\s*([\w-]+)\s*-->", text)
    out = {}
    for i in range(1, len(parts) - 1, 2):
        body = parts[i + 1]
        heads = [m.start() for m in re.finditer(r"^## ", body, re.MULTILINE)]
        out[parts[i]] = body[: heads[1]] if len(heads) > 1 else body
    return out


def _ours(backend: str) -> bool:
    b = backend.lower()
    return b.startswith(("functional_rb", "frb", "eager")) or "functional_rb" in b


def plot(name: str, title: str, rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    heights = [len({r["backend"] for r in rows if r["mode"] == m}) for m in modes]
    fig, axes = plt.subplots(
        len(modes),
        1,
        squeeze=False,
        figsize=(9, 1.2 + 0.38 * sum(heights) + 0.7 * len(modes)),
        gridspec_kw={"height_ratios": heights},
    )
    for ax, mode in zip(axes[:, 0], modes):
        sub = [r for r in rows if r["mode"] == mode]
        labels = [r["backend"] for r in sub][::-1]
        values = [r["value"] for r in sub][::-1]
        colours = ["tab:blue" if _ours(b) else "0.65" for b in labels]
        bars = ax.barh(range(len(sub)), values, color=colours)
        ax.set_yticks(range(len(sub)), labels, fontsize=8)
        unit = sub[0]["unit"]
        lower = "lower is better" in mode.lower() or unit.lower() in ("ms/step", "b/step")
        better = "lower is better" if lower else "higher is better"
        ax.set_title(
            f"{mode} [{unit}, {better}]" if better not in mode else f"{mode} [{unit}]",
            fontsize=9,
            loc="left",
        )
        ax.bar_label(
            bars,
            labels=[f"{v:,.3g}" if v < 100 else f"{v:,.0f}" for v in values],
            fontsize=7,
            padding=2,
        )
        ax.set_xlim(0, max(values) * 1.18)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


_PEER_STYLE = {"torchrl": ("0.35", "s"), "flashbax": ("0.55", "^"), "cpprb": ("0.7", "D")}


def plot_scale(rows: list[dict], out: pathlib.Path, title: str = "W5") -> None:
    """W5's lines: one panel per sampler, microseconds per step against stored items (both
    axes logarithmic), a line per backend with its min-max range shaded; functional_rb in
    colour, the peers in grey. ``rows``: ``benchmarks/w5_scale.py``'s summary rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    fig, axes = plt.subplots(
        1, len(samplers), squeeze=False, figsize=(3.6 * len(samplers) + 0.6, 3.6)
    )
    ours = iter(["tab:blue", "tab:cyan", "tab:purple"])
    colours = {}
    for ax, s in zip(axes[0], samplers):
        for b in dict.fromkeys(r["backend"] for r in rows if r["sampler"] == s):
            pts = sorted(
                (r["size"], r["median_us"], r["min_us"], r["max_us"])
                for r in rows
                if (r["sampler"], r["backend"]) == (s, b) and "median_us" in r
            )
            if not pts:
                continue
            if b not in colours:
                colours[b] = next(ours) if _ours(b) else _PEER_STYLE.get(b, ("0.5", "o"))[0]
            marker = "o" if _ours(b) else _PEER_STYLE.get(b, ("", "o"))[1]
            x, y, lo, hi = zip(*pts)
            ax.plot(x, y, marker=marker, color=colours[b], label=b, lw=1.6 if _ours(b) else 1)
            ax.fill_between(x, lo, hi, color=colours[b], alpha=0.15, lw=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(s, fontsize=9, loc="left")
        ax.set_xlabel("items stored", fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("us per step (lower is better)", fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", type=pathlib.Path, default=_HERE / "README.md")
    ap.add_argument("--out", type=pathlib.Path, default=_HERE / "plots")
    ap.add_argument(
        "--w5",
        type=pathlib.Path,
        help="also draw plots/bench-w5.png from this w5_scale.py JSON result",
    )
    args = ap.parse_args(argv)
    if args.w5:
        import json

        plot_scale(json.loads(args.w5.read_text())["rows"], args.out / "bench-w5.png")
    written = []
    for name, text in sections(args.readme.read_text()).items():
        if name == "bench-w5":  # W5's plot is drawn from its JSON (--w5), not its tables
            continue
        rows = [r for t in tables(text) for r in measurements(t)]
        if not rows:
            continue
        heading = re.search(r"^#+\s*(.+)$", text, re.MULTILINE)
        title = heading.group(1).replace("`", "") if heading else name
        path = args.out / f"{name}.png"
        plot(name, title, rows, path)
        written.append(path)
        print(f"{path}: {len(rows)} bars")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
